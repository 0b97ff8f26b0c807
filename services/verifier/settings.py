"""Verifier settings: built once from the CLI (or a test) and passed down."""

from __future__ import annotations

import os
import socket

from pydantic import BaseModel, ConfigDict, Field

from tandem.engine.config import DraftStrategy


def default_id(role: str) -> str:
    # A StatefulSet pod's hostname is stable across restarts, so residency records stay meaningful.
    return os.environ.get("POD_NAME") or f"{role}-{socket.gethostname()}-{os.getpid()}"


class VerifierSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    verifier_id: str = Field(default_factory=lambda: default_id("verifier"))
    host: str = "127.0.0.1"  # interface to bind
    port: int = Field(50061, ge=0, le=65535)  # 0 = any free port (tests)
    advertise_address: str | None = None  # host:port others reach us at (default host:bound port)
    model: str = "default"
    redis_url: str | None = None
    heartbeat_s: float = Field(2.0, gt=0)  # registration refresh period; its TTL is 5x this
    session_ttl_s: float = Field(600.0, gt=0)  # residency TTL of an idle session
    kv_capacity_tokens: int = Field(65536, ge=1)  # KV budget over all resident sessions
    max_sessions: int = Field(64, ge=1)
    draft_wait_ms: float = Field(10.0, ge=0)  # longest wait for a draft block before a plain step
    drafter_retry_s: float = Field(1.0, gt=0)  # after a drafter stream fails, reconnect this often
    max_draft_tokens: int = Field(8, ge=1, le=64)
    batch_wait_ms: float = Field(2.0, ge=0)  # longest wait for busy sessions to join a batched forward
    default_strategy: DraftStrategy = DraftStrategy.ngram
    threads: int | None = Field(None, ge=1)  # torch CPU threads (default: all cores)
    device: str = "auto"  # where the target runs: auto (cuda when available), cpu, cuda, cuda:N
    metrics_port: int | None = Field(None, ge=0, le=65535)
