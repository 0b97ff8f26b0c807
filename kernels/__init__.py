"""Verification kernels of the speculative decoding step (installed as `tandem.kernels`).

Each step verifies up to K drafts per request row b; entries past num_drafts[b] are padding and
num_drafts[b] = 0 is a plain decoding step. Both functions return

- output_ids [B, K+1] int64: the row's committed tokens, i.e. its accepted drafts, then exactly one
  recovered token (at the first rejection) or bonus token (after every draft was accepted), then -1;
- num_accepted [B] int64: accepted drafts per row; committed tokens = num_accepted + 1.

`greedy_accept` accepts a draft while it equals the target's argmax. `rejection_sample` is lossless
speculative sampling (Leviathan et al. 2023): a draft x is accepted iff q(x) > 0 and
p(x) / q(x) >= uniform, the recovered token is drawn from norm(max(0, p - q)) and the bonus token
from p, both by the exponential race argmax_v w_v / exp_noise_v (lowest index on ties). All
randomness is an input, so a seeded generator makes a step reproducible on any device.

Token trees (several drafts per position, sharing prefixes): `tree_greedy_accept` and
`tree_rejection_sample` take each node's parent beside its token (-1: the pending token) and also
return the accepted path's node indices [B, K] (-1 after), so the caller keeps exactly that path's
KV. Sampled trees take deterministic drafts only (one-hot q), verified by recursive rejection over
siblings (reference.tree_rejection_sample); a chain given as a tree gets `rejection_sample`'s result.

Dispatch: CUDA tensors run the Triton kernels (`triton_verify`), CPU tensors the PyTorch reference
(`reference`), which defines the semantics; the two agree bit for bit. TANDEM_FORCE_TRITON=1 sends
CPU tensors to Triton too, for tests under TRITON_INTERPRET=1. Triton is imported only on that path,
so CPU-only users need no Triton.
"""

import os

import torch

from . import reference

__all__ = ["greedy_accept", "rejection_sample", "tree_greedy_accept", "tree_rejection_sample"]


def greedy_accept(
    draft_ids: torch.Tensor,  # [B, K] int64
    num_drafts: torch.Tensor,  # [B] int64, 0..K
    target_argmax: torch.Tensor,  # [B, K+1] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # output_ids [B, K+1] int64, num_accepted [B] int64
    if _use_triton(draft_ids):
        from .triton_verify import greedy_accept as impl
    else:
        impl = reference.greedy_accept
    return impl(draft_ids, num_drafts, target_argmax)


def rejection_sample(
    draft_ids: torch.Tensor,  # [B, K] int64
    num_drafts: torch.Tensor,  # [B] int64, 0..K
    draft_probs: torch.Tensor | None,  # [B, K, V] float32; None: deterministic drafter (one-hot q)
    target_probs: torch.Tensor,  # [B, K+1, V] float32, after temperature / top-k / top-p
    uniform: torch.Tensor,  # [B, K] float32, U(0, 1); 0 itself would accept a draft with p = 0
    exp_noise: torch.Tensor,  # [B, V] float32, Exponential(1), > 0
) -> tuple[torch.Tensor, torch.Tensor]:  # output_ids [B, K+1] int64, num_accepted [B] int64
    if _use_triton(draft_ids):
        from .triton_verify import rejection_sample as impl
    else:
        impl = reference.rejection_sample
    return impl(draft_ids, num_drafts, draft_probs, target_probs, uniform, exp_noise)


def tree_greedy_accept(
    draft_ids: torch.Tensor,  # [B, K] int64, nodes in topological order
    parents: torch.Tensor,  # [B, K] int64, -1 or an earlier node; siblings' tokens distinct
    num_drafts: torch.Tensor,  # [B] int64, 0..K
    target_argmax: torch.Tensor,  # [B, K+1] int64; row i+1 after node i
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # output_ids [B, K+1], num_accepted [B], nodes [B, K]
    if _use_triton(draft_ids):
        from .triton_verify import tree_greedy_accept as impl
    else:
        impl = reference.tree_greedy_accept
    return impl(draft_ids, parents, num_drafts, target_argmax)


def tree_rejection_sample(
    draft_ids: torch.Tensor,  # [B, K] int64, nodes in topological order (deterministic drafts)
    parents: torch.Tensor,  # [B, K] int64, -1 or an earlier node; siblings' tokens distinct
    num_drafts: torch.Tensor,  # [B] int64, 0..K
    target_probs: torch.Tensor,  # [B, K+1, V] float32, after temperature / top-k / top-p
    uniform: torch.Tensor,  # [B, K] float32, U(0, 1]
    exp_noise: torch.Tensor,  # [B, V] float32, Exponential(1), > 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # output_ids [B, K+1], num_accepted [B], nodes [B, K]
    if _use_triton(draft_ids):
        from .triton_verify import tree_rejection_sample as impl
    else:
        impl = reference.tree_rejection_sample
    return impl(draft_ids, parents, num_drafts, target_probs, uniform, exp_noise)


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TANDEM_FORCE_TRITON") == "1"
