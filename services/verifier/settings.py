"""Verifier settings: built once from the CLI (or a test) and passed down."""

from __future__ import annotations

import os
import re
import socket
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tandem.contract.params import DraftStrategy
from tandem.serving.residency import ResidencyConfig
from tandem.serving.tlsconfig import TlsConfig


def default_id(role: str) -> str:
    # A StatefulSet pod's hostname is stable across restarts, so residency records stay meaningful.
    return os.environ.get("POD_NAME") or f"{role}-{socket.gethostname()}-{os.getpid()}"


# A DNS name or IPv4 address (lower-case ASCII), or a bracketed IPv6 address; then a port.
_HOST = re.compile(r"\[[0-9a-f:.]+\]|[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*")
_PORT = re.compile(r"[0-9]{1,10}")  # leading zeros allowed; the range is checked as a number


def drafter_address(address: str) -> str:
    """The canonical form of a drafter's `host:port`: stripped, host lower-cased, port without
    leading zeros. Raises ValueError for anything else (unix:/path, dns:///..., no port, ...).

    Names are compared, never resolved: "LOCALHOST:050052 " and "localhost:50052" are one address,
    "127.0.0.1:50052" is another. Example: drafter_address(" Drafter-0.NS:50052") == "drafter-0.ns:50052".
    """
    text = address.strip()
    host, _, port = text.rpartition(":")
    host = host.lower()
    if not (text.isascii() and _HOST.fullmatch(host) and _PORT.fullmatch(port) and 0 < int(port) < 65536):
        raise ValueError(f"drafter address {address[:100]!r} is not HOST:PORT (a DNS name, an IPv4 address or a "
                         f"bracketed IPv6 address, and a port 1-65535)")
    return f"{host}:{int(port)}"


class VerifierSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)  # inputs hold redis_url's password

    verifier_id: str = Field(default_factory=lambda: default_id("verifier"))
    host: str = "127.0.0.1"  # interface to bind
    port: int = Field(50061, ge=0, le=65535)  # 0 = any free port (tests)
    advertise_address: str | None = None  # host:port others reach us at (default host:bound port)
    model: str = "default"
    redis_url: str | None = Field(None, repr=False)  # may carry a password: kept out of reprs
    redis_ca: str | None = None  # CA bundle that verifies a rediss:// server (default: the system's)
    redis_cert: str | None = None  # client certificate (PEM) for a rediss:// server that asks for one
    redis_key: str | None = None  # its private key, when not in redis_cert's file
    heartbeat_s: float = Field(2.0, gt=0)  # registration refresh period; its TTL is 5x this
    session_ttl_s: float = Field(600.0, gt=0)  # residency TTL of an idle session
    kv_capacity_tokens: int = Field(65536, ge=1)  # KV budget over all resident sessions
    # Sessions kept resident (idle or generating; their KV within kv_capacity_tokens): beyond, the
    # least recently used idle one is evicted. Of them, at most max_generating generate at once (a
    # step's rows); more requests wait in the admission queue.
    max_sessions: int = Field(256, ge=1)
    max_generating: int = Field(64, ge=1)
    draft_wait_ms: float = Field(10.0, ge=0)  # longest wait for a draft block before a plain step
    drafter_retry_s: float = Field(1.0, gt=0)  # after a drafter stream fails, reconnect this often
    # The only drafters this verifier connects to (canonical host:port). A request naming any other
    # is refused: callers choose among drafters the operator allowed, never where we connect.
    # Empty: no drafter at all (sessions draft with the verifier's own prompt lookup or decode plainly).
    drafters: tuple[str, ...] = ()
    max_draft_tokens: int = Field(8, ge=1, le=64)
    # Chunked prefill (runner.PrefillPolicy): prompts run in pieces that share steps with decoding;
    # a step with pieces may cost up to prefill_cost_factor times the step without them (steered by
    # measured step times), with at least prefill_min_tokens and at most prefill_chunk_tokens of
    # prompt; a prefill_min_tokens piece may run through a share of the layers per step (PieceBudget).
    prefill_chunk_tokens: int = Field(256, ge=1)
    prefill_min_tokens: int = Field(4, ge=1)
    prefill_cost_factor: float = Field(2.0, ge=1.0)
    # Admission: a request that finds the KV budget held by running sessions, or max_generating
    # sessions generating, waits (first come, first served) up to admission_wait_s for room, behind at most
    # admission_queue others; beyond either it is refused (RESOURCE_EXHAUSTED with a retry hint).
    admission_queue: int = Field(32, ge=0)
    # 60 s: a turn that waits for room still beats one refused (an agent's workflow fails on it);
    # at 64 agent sessions over a full budget, the queue's front waited 10-20 s.
    admission_wait_s: float = Field(60.0, ge=0)
    # A new session may not evict a session that ended a turn more recently than next turns usually
    # take to come here (twice the 90th percentile of the gaps seen), nor than this: it waits for
    # room instead. An agent's next turn follows its last within milliseconds to seconds.
    evict_after_idle_s: float = Field(2.0, ge=0)
    # The KV budget from free memory: this fraction of the memory free after the model loaded (RAM,
    # or the GPU's on CUDA), in tokens of this model's KV; the smaller of it and kv_capacity_tokens.
    kv_memory_fraction: float | None = Field(None, gt=0, le=0.95)
    default_strategy: DraftStrategy = DraftStrategy.ngram
    threads: int | None = Field(None, ge=1)  # torch CPU threads (default: all cores)
    device: str = "auto"  # where the target runs: auto (cuda when available), cpu, cuda, cuda:N
    # What the target computes in (models.load_model): for a GGUF model, "gguf" keeps its quantized
    # weights with 8-bit activations (the target is that quantized model, as llama.cpp computes it),
    # "gguf-float" with float32 activations, "float32" dequantizes, "auto" = the first that runs here
    precision: Literal["auto", "gguf", "gguf-float", "float32"] = "auto"
    metrics_port: int | None = Field(None, ge=0, le=65535)
    # Mutual TLS: the service port accepts only clients with a certificate from tls.ca (gateways),
    # and drafter streams present tls.cert and require a drafter certificate. None: plaintext.
    tls: TlsConfig | None = None
    health_port: int | None = Field(None, ge=0, le=65535)  # plaintext gRPC health only (probes, with tls)
    # SIGTERM: running generations get this long to finish, then are cut with UNAVAILABLE (the
    # gateway resumes them elsewhere). Keep it below the pod's terminationGracePeriodSeconds.
    drain_grace_s: float = Field(20.0, ge=0)

    @field_validator("drafters", mode="before")
    @classmethod
    def _canonical_drafters(cls, value):
        if isinstance(value, str):
            value = [value]
        return tuple(dict.fromkeys(drafter_address(a) for a in value))  # canonical, deduplicated, in order

    @model_validator(mode="after")
    def _redis_options_agree(self) -> "VerifierSettings":
        # TLS files without a Redis, or without rediss://, or a key without its certificate: fail at
        # the edge, not at the first Redis call.
        if not self.redis_url and (self.redis_ca or self.redis_cert or self.redis_key):
            raise ValueError("redis_ca / redis_cert / redis_key need a redis_url (rediss://...)")
        self.residency_config()
        if self.prefill_min_tokens > self.prefill_chunk_tokens:
            raise ValueError(f"prefill_min_tokens ({self.prefill_min_tokens}) is above prefill_chunk_tokens "
                             f"({self.prefill_chunk_tokens})")
        return self

    @property
    def generating_slots(self) -> int:
        """Sessions that may generate at once: max_generating, never more than may be resident."""
        return min(self.max_generating, self.max_sessions)

    def residency_config(self) -> ResidencyConfig | None:
        """The ResidencyConfig of this verifier's publisher (None without Redis): its URL, TLS files
        and TTLs (registration: 5 heartbeats)."""
        if not self.redis_url:
            return None
        return ResidencyConfig(url=self.redis_url, ca_file=self.redis_ca, cert_file=self.redis_cert,
                               key_file=self.redis_key, heartbeat_ttl_s=self.heartbeat_s * 5,
                               session_ttl_s=self.session_ttl_s)
