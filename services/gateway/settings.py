"""The gateway's typed configuration: built once at the edge (`python -m tandem.services.gateway`
flags, or a test) and passed down; nothing below re-reads the environment."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tandem.engine.config import DraftStrategy, SpecConfig


def _check_address(value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r} is not a host:port address")
    return value


class GatewaySettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    http_host: str = "0.0.0.0"
    http_port: int = Field(8000, ge=0, le=65535)  # 0 = any free port (tests)
    grpc_host: str = "0.0.0.0"
    grpc_port: int = Field(50051, ge=0, le=65535)

    # Verifiers the gateway polls itself (GetInfo) and routes to even when Redis is down; with Redis,
    # the verifiers registered there are candidates too.
    verifiers: tuple[str, ...] = ()  # host:port
    # Drafters the gateway hands to verifiers, one per session, round-robin among those offering the
    # session's strategy (from their GetInfo). None offering it: the verifier decodes plainly.
    drafters: tuple[str, ...] = ()  # host:port
    redis_url: str | None = None  # None: no residency, routing by load alone
    prefix_block_size: int = Field(32, ge=1, le=4096)  # must equal the verifiers' block size
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
    shutdown_grace_s: float = Field(5.0, ge=0)  # in-flight calls get this long at SIGTERM
    metrics_port: int | None = Field(None, ge=0, le=65535)  # Prometheus /metrics on its own port too

    @field_validator("verifiers", "drafters")
    @classmethod
    def _addresses(cls, values: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(_check_address(v) for v in values)

    @model_validator(mode="after")
    def _limits(self) -> "GatewaySettings":
        if self.default_max_tokens > self.max_tokens_cap:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) exceeds max_tokens_cap ({self.max_tokens_cap})"
            )
        return self
