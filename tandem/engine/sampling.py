"""From logits to the distribution the target actually samples from, and per-request randomness.

`p_i` in DESIGN.md's verification rule is the output of `logits_to_probs`: temperature, then top-k,
then top-p. The drafter's proposal `q_i` is checked against exactly this distribution, so plain
sampling and speculative sampling share this one function.
"""

from __future__ import annotations

import torch

from tandem.engine.config import SamplingParams


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits `# [n, vocab]` -> probabilities `# [n, vocab]` float32 (rows sum to 1).

    Greedy (temperature 0) yields one-hot rows at the argmax, so greedy decoding is the same rule.
    """
    logits = logits.float()
    if params.greedy:
        probs = torch.zeros_like(logits)
        probs.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return probs
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [n, vocab]
        sorted_probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p: a token is dropped when the mass strictly
        # before it already reaches top_p (the first token is always kept).
        before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def make_generator(seed: int | None) -> torch.Generator:
    """A per-request CPU generator: the same seed gives the same draws on any device, because the
    random numbers are drawn on the CPU and then moved."""
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def sample_from(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One token from `probs # [vocab]` by the exponential race (argmax p / E, E ~ Exp(1)), the same
    rule the verification kernels use for recovered and bonus tokens."""
    noise = torch.empty(probs.shape[-1], dtype=torch.float32).exponential_(generator=gen)
    return int((probs.cpu() / noise).argmax())
