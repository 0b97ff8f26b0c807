"""One logging setup for every Tandem process: human-readable lines by default, JSON lines on
request (`--log-json` or TANDEM_LOG_JSON=1), each line of a request carrying its trace id (when
tracing is on) and session id.

    2026-05-04 12:00:01,234 INFO tandem.verifier: evicted idle session s1 (812 tokens) [session=s2 trace=4bf9...]
    {"ts": "2026-05-04T12:00:01.234Z", "level": "INFO", "logger": "tandem.verifier", "message": "evicted ...",
     "session_id": "s2", "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736", "span_id": "00f067aa0ba902b7"}

Services mark the request they work on with `session_context(session_id)` (or set `session_id_var`
in a request's own asyncio task); the filter reads it and the current OpenTelemetry span. Prompt
and completion text never reach the logs unless TANDEM_LOG_PROMPTS=1 (`log_prompts_enabled`).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import sys
import time
from collections.abc import Iterator

from opentelemetry import trace

session_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("tandem_session_id", default=None)

_NOISY = ("httpx", "transformers", "accelerate", "urllib3", "opentelemetry.exporter")


_warned_exposed: set[str] = set()


def warn_if_exposed(path, what: str) -> bool:
    """Log a warning (once per file) when a secret's file (`what`: "API key file", "TLS private key")
    can be read by its group or by others; True when it can. Secrets of a service are its user's
    alone: `chmod 600`."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    exposed = bool(mode & 0o077)
    if exposed and str(path) not in _warned_exposed:
        _warned_exposed.add(str(path))
        logging.getLogger("tandem.security").warning(
            "the %s %s is readable by group or others (mode %03o): run `chmod 600 %s`", what, path, mode & 0o777, path)
    return exposed


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def log_prompts_enabled() -> bool:
    """TANDEM_LOG_PROMPTS=1: the gateway logs each request's prompt (off by default: user text)."""
    return _flag("TANDEM_LOG_PROMPTS")


@contextlib.contextmanager
def session_context(session_id: str | None) -> Iterator[None]:
    """Tag the log lines written inside (this thread or task) with `session_id`."""
    token = session_id_var.set(session_id or None)
    try:
        yield
    finally:
        try:
            session_id_var.reset(token)
        except ValueError:  # a generator closed from another context: its context dies with it
            pass


class RequestContextFilter(logging.Filter):
    """Adds `trace_id`, `span_id` (hex, "" without a sampled span) and `session_id` ("" outside a
    request) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            record.trace_id, record.span_id = f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
        else:
            record.trace_id = record.span_id = ""
        record.session_id = session_id_var.get() or ""
        return True


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        tags = [f"{key}={value}" for key, value in (
            ("session", getattr(record, "session_id", "")), ("trace", getattr(record, "trace_id", ""))) if value]
        if not tags:
            return line
        head, sep, tail = line.partition("\n")  # tags end the message line, before any traceback
        return f"{head} [{' '.join(tags)}]{sep}{tail}"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("session_id", "trace_id", "span_id"):
            value = getattr(record, key, "")
            if value:
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(level: str = "info", json_lines: bool | None = None) -> None:
    """Configure the root logger for this process (replacing earlier handlers). `json_lines`
    None = the TANDEM_LOG_JSON environment variable decides."""
    if json_lines is None:
        json_lines = _flag("TANDEM_LOG_JSON")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestContextFilter())
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    for noisy in _NOISY:
        logging.getLogger(noisy).setLevel(logging.WARNING)
