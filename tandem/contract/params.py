"""Typed configuration. Values enter at one edge (CLI flags, HTTP/gRPC requests, env) and become
these objects; everything below takes them as they are and never re-reads the environment."""

from __future__ import annotations

from enum import Enum

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class DraftStrategy(str, Enum):
    none = "none"  # plain decoding: one target forward per token
    ngram = "ngram"  # prompt lookup over the sequence's own context
    model = "model"  # a small causal LM sharing the target's tokenizer
    hybrid = "hybrid"  # per step, prompt lookup, suffix decoding or the draft model, whichever is expected to pay most
    suffix = "suffix"  # suffix decoding: the session's own tokens and earlier responses (tandem.engine.speculation.suffix)


class Grammar(BaseModel):
    """A constraint on the output (tandem.engine.speculation.grammar): any JSON value ("json_object", value
    unused), a JSON schema (strict), a regular expression, or an EBNF grammar (GBNF dialect)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["json_object", "json_schema", "regex", "ebnf"]
    value: str = Field("", max_length=256 * 1024)


class SamplingParams(BaseModel):
    """How the target's next-token distribution is shaped and sampled.

    temperature 0 is greedy (argmax); otherwise logits are divided by the temperature, then top-k,
    then top-p (nucleus) and min-p truncate the distribution. A seed makes a sampled request
    reproducible. Before all of that the raw logits are adjusted (tandem.engine.speculation.sampling.adjust_logits):
    logit_bias, then the OpenAI presence / frequency penalties over the tokens generated so far, then
    the repetition penalty over the prompt and the generated tokens. Every one of these is applied per
    position inside verification, drafts before the position counted as generated, so a drafted
    position sees exactly the distribution plain decoding would.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, lt=2**31)  # the wire carries an int32
    seed: int | None = Field(None, ge=0, lt=2**63)
    max_new_tokens: int = Field(128, ge=1, le=1_000_000)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)  # OpenAI: minus this once a token was generated
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)  # OpenAI: minus this per time it was generated
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)  # divide (positive) / multiply (negative) logits of seen tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the logits
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # drop tokens below min_p x the most probable one's probability
    # Stop strings: generation ends with the token whose text completes one (matched on the detokenized
    # output, across token boundaries). That token is committed; the text shown stops before the string.
    stop: tuple[str, ...] = ()
    # Return each generated token's log-probability under the target model (its raw logits, before
    # penalties and temperature), with this many most probable alternatives; None = no logprobs.
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Structured output: every position, drafted or not, is sampled from the target masked to the
    # tokens the grammar allows there.
    grammar: Grammar | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: tuple[str, ...]) -> tuple[str, ...]:
        if len(stop) > 8:
            raise ValueError(f"at most 8 stop strings, got {len(stop)}")
        if any(not 0 < len(s) <= 256 for s in stop):
            raise ValueError("each stop string must be 1 to 256 characters")
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, pairs: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        if len(pairs) > 1024:
            raise ValueError(f"logit_bias holds {len(pairs)} entries; at most 1024")
        for tok, bias in pairs:
            if tok < 0:
                raise ValueError(f"logit_bias token id {tok} is negative")
            if not -100.0 <= bias <= 100.0:  # NaN fails too
                raise ValueError(f"logit_bias for token {tok} is {bias}; it must lie in [-100, 100]")
        return pairs

    @classmethod
    def from_given(cls, **given) -> "SamplingParams":
        """The parameters a request gave; None means not given, so the default above applies (the
        one place defaults are spelled)."""
        return cls(**{name: value for name, value in given.items() if value is not None})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def stop_ids(self, eos_token_ids) -> set[int]:
        """The token ids that end generation: the request's own, and the model's EOS ids unless
        ignore_eos."""
        return set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))

    @property
    def adjusts_logits(self) -> bool:
        """Whether the raw logits are changed before temperature (see adjust_logits)."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 \
            or self.repetition_penalty != 1.0


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
