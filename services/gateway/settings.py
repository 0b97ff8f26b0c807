"""The gateway's typed configuration: built once at the edge (`tandem gateway`
flags, or a test) and passed down; nothing below re-reads the environment."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tandem.contract.params import DraftStrategy, SpecConfig
from tandem.serving.tlsconfig import TlsConfig


def _check_address(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r} is not a host:port address")
    return value


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a DNS name: it may resolve to anything


class GatewaySettings(BaseModel):
    # Errors never echo inputs: a Redis URL carries a password.
    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    # Loopback by default: listening on other interfaces is a decision (see api_keys_file).
    http_host: str = "127.0.0.1"
    http_port: int = Field(8000, ge=0, le=65535)  # 0 = any free port (tests)
    grpc_host: str = "127.0.0.1"
    grpc_port: int = Field(50051, ge=0, le=65535)

    # Verifiers the gateway polls itself (GetInfo) and routes to even when Redis is down; with Redis,
    # the verifiers registered there are candidates too.
    verifiers: tuple[str, ...] = ()  # host:port
    # Drafters the gateway hands to verifiers, one per session, round-robin among those offering the
    # session's strategy (from their GetInfo). None offering it: the verifier decodes plainly.
    drafters: tuple[str, ...] = ()  # host:port
    redis_url: str | None = Field(None, repr=False)  # None: no residency, routing by load alone
    redis_ca: str | None = None  # rediss:// only: CA bundle, client certificate and key files
    redis_cert: str | None = None
    redis_key: str | None = None
    prefix_block_size: int = Field(32, ge=1, le=4096)  # must equal the verifiers' block size
    # residency (session > prefix > load), or a baseline that ignores what verifiers hold
    # (tandem/serving/routing.py)
    routing: Literal["residency", "round-robin", "least-loaded"] = "residency"
    redis_timeout_s: float = Field(0.2, gt=0)

    # The gateway loads only the tokenizer (and the context window) of this model: a Hugging Face
    # directory, a .gguf file, or "default" (the embedded SmolLM2).
    model: str = "default"
    served_model_name: str | None = None  # the id clients use; None = the model's own id
    max_context_tokens: int | None = Field(None, ge=2)  # None = the model's; verifiers may lower it

    default_speculation: SpecConfig = SpecConfig(strategy=DraftStrategy.ngram, max_draft_tokens=8)
    default_max_tokens: int = Field(512, ge=1)  # when a request names none (capped by the context left)
    max_tokens_cap: int = Field(4096, ge=1)  # larger max_tokens is refused (400)
    max_concurrent_requests: int = Field(256, ge=1)  # more in flight: RESOURCE_EXHAUSTED / 429
    request_timeout_s: float = Field(600.0, gt=0)  # whole-request deadline unless the client sets a shorter one

    poll_interval_s: float = Field(2.0, gt=0)  # GetInfo of the static verifiers and the drafters
    rpc_timeout_s: float = Field(1.0, gt=0)  # GetInfo deadline
    down_backoff_s: float = Field(2.0, ge=0)  # a verifier that refused a connection is skipped this long
    max_sessions: int = Field(100_000, ge=1)  # session histories kept (least recently used dropped)
    session_idle_s: float = Field(3600.0, gt=0)  # a history unused this long is dropped
    shutdown_grace_s: float = Field(20.0, ge=0)  # in-flight requests get this long at SIGTERM, then are cut
    # A verifier stream cut mid-way (the verifier died or drained) continues on another verifier
    # from the tokens already streamed, at most this many times per request (0: fail it instead).
    resume_attempts: int = Field(3, ge=0, le=16)
    # A cut stream with no other verifier to take it (a lone verifier restarting, a rolling update
    # replacing one) waits this long for one to appear, polling the verifiers, before it fails.
    resume_wait_s: float = Field(10.0, ge=0)
    # Prometheus /metrics on its own port; when set, the public HTTP port does not serve it.
    metrics_port: int | None = Field(None, ge=0, le=65535)

    # -- trust (docs/security.md) ---------------------------------------------------------------
    # API keys -> tenants and their limits (services/gateway/auth.py). None: open, every caller is
    # one anonymous tenant; refused on a non-loopback interface unless allow_unauthenticated.
    api_keys_file: Path | None = None
    allow_unauthenticated: bool = False
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)  # larger HTTP bodies / gRPC messages: 413
    max_input_tokens: int | None = Field(None, ge=1)  # per request, every tenant (a tenant may set less)
    grpc_reflection: bool = False  # reflection on the public gRPC port reveals the whole API surface
    # A model whose chat template has no tool support (or writes calls in a dialect the gateway
    # does not parse, services/gateway/tool_calls.py): True = requests with tools get the gateway's
    # Hermes-style <tool_call> convention (said in every such response, `tandem.tool_format`);
    # False = they are refused with a clear 400 / INVALID_ARGUMENT.
    tool_fallback: bool = True
    # mTLS toward verifiers and drafters: the gateway presents tls.cert and accepts only peers whose
    # certificate chains to tls.ca and names their role (tandem-verifier / tandem-drafter). None:
    # plaintext inside (a trusted network only).
    tls: TlsConfig | None = None
    # HTTPS and gRPC over TLS on the public ports (server certificate only: clients use API keys).
    public_tls: TlsConfig | None = None

    @field_validator("verifiers", "drafters")
    @classmethod
    def _addresses(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(_check_address(v) for v in values)

    @model_validator(mode="after")
    def _open_only_on_loopback(self) -> "GatewaySettings":
        if self.api_keys_file is None and not self.allow_unauthenticated:
            public = sorted({h for h in (self.http_host, self.grpc_host) if not is_loopback(h)})
            if public:
                raise ValueError(
                    f"the gateway would listen on {', '.join(public)} without API keys, so anyone who "
                    "can reach it could use it; give an API key file (--api-keys FILE) or say that "
                    "this is intended (--allow-unauthenticated)"
                )
        return self

    @model_validator(mode="after")
    def _limits(self) -> "GatewaySettings":
        if self.default_max_tokens > self.max_tokens_cap:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) exceeds max_tokens_cap ({self.max_tokens_cap})"
            )
        return self
