"""Typed configuration. Values enter at one edge (CLI flags, HTTP/gRPC requests, env) and become
these objects; everything below takes them as they are and never re-reads the environment."""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, model_validator


class DraftStrategy(str, Enum):
    none = "none"  # plain decoding: one target forward per token
    ngram = "ngram"  # prompt lookup over the sequence's own context
    model = "model"  # a small causal LM sharing the target's tokenizer
    hybrid = "hybrid"  # per step, prompt lookup or the draft model, whichever is expected to pay more


class SamplingParams(BaseModel):
    """How the target's next-token distribution is shaped and sampled.

    temperature 0 is greedy (argmax); otherwise logits are divided by the temperature, then top-k,
    then top-p (nucleus) truncate the distribution. A seed makes a sampled request reproducible.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    max_new_tokens: int = Field(128, ge=1, le=1_000_000)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SpecConfig(BaseModel):
    """Speculation settings of one request (server defaults fill what a request leaves out)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: DraftStrategy = DraftStrategy.ngram
    max_draft_tokens: int = Field(8, ge=1, le=64)  # upper bound on the block length k
    adaptive: bool = True  # choose k per step from measured acceptance and cost; False = always max
    ngram_min: int = Field(1, ge=1, le=16)  # shortest context suffix the prompt lookup may match
    ngram_max: int = Field(4, ge=1, le=16)  # longest suffix tried first
    draft_top_k: int = Field(16, ge=1, le=1024)  # support size of a sampled draft model's proposals

    @model_validator(mode="after")
    def _ngram_range(self) -> "SpecConfig":
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})")
        return self
