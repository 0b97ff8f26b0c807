"""The verification kernels' dispatch (re-exported by the package, `tandem.kernels`): CUDA tensors to
the Triton kernels, CPU tensors to the PyTorch reference. See the package's docstring."""

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
