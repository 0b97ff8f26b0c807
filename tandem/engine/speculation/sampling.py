"""From logits to the distribution the target actually samples from, and per-request randomness.

`p_i` in docs/design.md's verification rule is the output of `logits_to_probs(adjust_logits(...))`:
logit_bias and penalties on the raw logits (per position, with the drafts before it counted as
generated), then temperature, top-k, top-p and min-p. The drafter's proposal `q_i` is checked
against exactly this distribution, so plain sampling and speculative sampling share these functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tandem.contract.params import SamplingParams


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token of each row: `# [n, vocab]` -> `# [n]` int64 (or `# [vocab]` -> a 0-d
    tensor), the index of the row's first maximal value, a NaN counting as the maximum, as
    torch.argmax defines it. On the CPU for float32 through numpy: torch's CPU argmax took 72 us a
    49,152-wide row on the Intel host (numpy's 2.7 us), 0.3 ms of a 5 ms one-session step and 1.2 ms
    of a 16-session one. Same indices (tested on ties and NaNs)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(np.asarray(logits.detach().numpy().argmax(-1), dtype=np.int64))
    return logits.argmax(-1)


def adjust_logits(
    logits: torch.Tensor,  # [n, vocab] raw target logits at n consecutive positions
    params: SamplingParams,
    prompt_ids: Sequence[int],  # the request's context (the repetition penalty counts it)
    generated_ids: Sequence[int],  # tokens generated before row 0
    drafts: Sequence[int] = (),  # the drafts at rows 0..n-2: row i also counts drafts[:i] as generated
) -> torch.Tensor:
    """The logits after logit_bias, presence / frequency penalties and the repetition penalty, row
    by row: row i is the position after `generated_ids + drafts[:i]`, exactly the history plain
    decoding would have there, so speculation changes nothing. Returns `logits` itself (no copy)
    when the request adjusts nothing. `# [n, vocab]` float32."""
    if not params.adjusts_logits:
        return logits
    n, vocab = logits.shape
    out = logits.float().clone()
    device = out.device
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias if t < vocab], dtype=torch.long, device=device)
        bias = torch.tensor([b for t, b in params.logit_bias if t < vocab], dtype=torch.float32, device=device)
        out[:, ids] += bias
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
        drafts = list(drafts)[: n - 1]
        # counts[i] = how often each token was generated before row i: the base, plus the drafts
        # before it (a cumulative sum over one-hot draft rows, shifted down by one).
        base = torch.bincount(torch.tensor(list(generated_ids), dtype=torch.long), minlength=vocab)[:vocab].float()
        counts = base.expand(n, vocab).clone()  # [n, vocab]
        if drafts:
            step = torch.zeros(n, vocab)
            step[torch.arange(1, len(drafts) + 1), torch.tensor(drafts, dtype=torch.long)] = 1.0
            counts += step.cumsum(0)
        counts = counts.to(device)
        if params.frequency_penalty:
            out -= params.frequency_penalty * counts
        if params.presence_penalty:
            out -= params.presence_penalty * (counts > 0).float()
        if params.repetition_penalty != 1.0:
            seen = counts > 0  # [n, vocab]
            if len(prompt_ids):
                seen[:, torch.tensor(list(prompt_ids), dtype=torch.long, device=device).clamp(max=vocab - 1)] = True
            # The usual rule: a positive logit is divided by the penalty, a negative one multiplied,
            # so a penalty > 1 always makes a seen token less likely.
            penalized = torch.where(out > 0, out / params.repetition_penalty, out * params.repetition_penalty)
            out = torch.where(seen, penalized, out)
    return out


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
    probs = logits.softmax(-1)
    if params.min_p > 0.0:
        # min-p: keep tokens at least min_p times as probable as the most probable one (which always
        # stays), then renormalise.
        keep = probs >= params.min_p * probs.max(-1, keepdim=True).values
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def make_generator(seed: int | None) -> torch.Generator:
    """A per-request CPU generator: the same seed gives the same draws on any device, because the
    random numbers are drawn on the CPU and then moved."""
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def exp_noise(n: int, gen: torch.Generator) -> torch.Tensor:
    """`# [n]` float32 draws of Exp(1) from the CPU generator `gen`, as -log(1 - U) with U uniform
    in [0, 1) drawn in float64 (so E = 0, which would make its token win the race whatever its
    probability, has chance 2^-53 a draw; in float32 it would be 2^-24, a 0.3% chance a row at
    SmolLM2's 49,152-token vocabulary). 2.9x faster than `exponential_` (0.31 vs 0.89 ms a row of
    49,152 on one EPYC core), which a sampled row pays every step: one noise row per verification."""
    return torch.rand(n, dtype=torch.float64, generator=gen).neg_().log1p_().neg_().to(torch.float32)
