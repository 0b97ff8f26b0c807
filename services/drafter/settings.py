"""Typed settings of one drafter process (built once at the CLI edge, then passed down)."""

from __future__ import annotations

import os
import socket

from pydantic import BaseModel, ConfigDict, Field, InstanceOf, model_validator

from tandem.engine.model.loading import LoadedModel
from tandem.engine.speculation.proposers import DraftModelProposer
from tandem.serving.tlsconfig import TlsConfig


def default_drafter_id() -> str:
    # Unique per process and readable in logs and Redis: two drafters on one host differ by pid.
    return f"{socket.gethostname()}-{os.getpid()}"


class DrafterSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    drafter_id: str = Field(default_factory=default_drafter_id, min_length=1)
    ngram_min: int = Field(1, ge=1, le=16)  # shortest context suffix the prompt lookup may match
    ngram_max: int = Field(4, ge=1, le=16)  # longest suffix tried first
    # Offers DRAFT_STRATEGY_MODEL when set. InstanceOf keeps the caller's object (no copy of the
    # weights, no re-validation of the dataclass).
    draft_model: InstanceOf[LoadedModel] | None = None
    draft_top_k: int = Field(16, ge=1, le=1024)  # support size of a sampled draft's proposals
    draft_int8: bool = True  # draft model steps with int8 weights on a CPU (memory-bound; same agreement)
    # The draft model reads at most this many of a session's last tokens when it starts on it (a
    # first look is a prefill of its own, per session: DraftModelProposer.CONTEXT); None: all.
    draft_context: int | None = Field(DraftModelProposer.CONTEXT, ge=1)
    # Strategy hybrid: prompt lookup drafts when its match is at least this long, else the model.
    # (In process the controller compares measured values instead; a drafter drafts ahead of the
    # verifier's measurements, so it uses this rule.)
    hybrid_min_match: int = Field(3, ge=1, le=64)
    lookahead: bool = True  # draft block n+1 while block n is verified (speculative blocks)
    max_sessions: int = Field(1024, ge=1)  # open sessions over all streams; more are refused
    # A session closed normally keeps its draft state (the draft model's KV cache, the prompt-lookup
    # and suffix indexes) for its next turn, up to this many sessions and tokens over all of them
    # (oldest dropped first; 0: none kept). A turn re-opened from it reads only its new tokens:
    # without it, every turn of a 1,400-token agent conversation made the draft model read all
    # 1,400 again. Memory: the draft model's KV per token (3 KB for the default 2-layer draft, so
    # ~200 MB at the default bound) plus the indexes (~0.5 KB a token).
    parked_sessions: int = Field(256, ge=0)
    parked_tokens: int = Field(65_536, ge=0)
    # Threads that draft for the sessions of every stream: a session's messages run in order on
    # one of them at a time, different sessions' concurrently (a slow one holds only its own).
    draft_workers: int = Field(16, ge=1)
    # Longest committed sequence (context + commits) one session may hold, in tokens. Prompt lookup
    # indexes every committed token, so without a bound one Open of a million tokens costs seconds
    # and hundreds of MB. Longer Opens and Commits drop the session (the verifier decodes plainly).
    max_context_tokens: int = Field(131072, ge=1)
    # Hard cap on the drafts of one block whatever a request asks for: a model drafts token by
    # token, so an unbounded next_block_len would hold the draft model for arbitrarily long.
    max_block_len: int = Field(64, ge=1, le=1024)
    # Suffix decoding's cross-session stores: tokens of recent responses kept per (target model,
    # tenant scope), the oldest evicted first; and how many such stores (least recently used go).
    suffix_store_tokens: int = Field(100_000, ge=0)
    suffix_max_stores: int = Field(64, ge=1)
    # Suffix decoding answers with token trees where the verifier can verify them (OpenSession.token_trees).
    suffix_trees: bool = True
    metrics_port: int | None = Field(None, ge=0, le=65535)  # Prometheus /metrics (0 = any free port)
    # Mutual TLS on the service port: only callers with a certificate from tls.ca (the verifiers)
    # may open draft streams. None: plaintext (a trusted network only).
    tls: TlsConfig | None = None
    health_port: int | None = Field(None, ge=0, le=65535)  # plaintext gRPC health only (probes, with tls)

    @model_validator(mode="after")
    def _ngram_range(self) -> "DrafterSettings":
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})")
        return self
