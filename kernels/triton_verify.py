"""Triton kernels of the verification step, one program per request row (grid = (B,)).

Same signatures and same results, bit for bit, as `reference.py`. Two details keep them exact:

- Every division is `tl.div_rn` (IEEE round-to-nearest, as torch computes it). Triton's `/` on
  float32 lowers to the approximate `div.full.f32` on NVIDIA GPUs (up to 2 ulp), which could flip an
  acceptance test `p / q >= u` or an argmax of the exponential race.
- The vocabulary is scanned in BLOCK_V chunks keeping a running (max, argmax); a chunk replaces the
  running best only when strictly greater, and `tl.max(..., return_indices=True)` breaks ties to the
  left inside a chunk, so ties resolve to the lowest index as `torch.argmax` does.
"""

import torch
import triton
import triton.language as tl

from .reference import check_greedy_args, check_sampling_args, check_tree_args

# Widest vocabulary chunk per loop iteration; a 150k vocabulary takes ~150 iterations.
MAX_BLOCK_V = 1024


@triton.jit
def _race_start():
    """The race before its first chunk: (best_id 0, best_score -inf, w_max 0)."""
    return tl.zeros([], dtype=tl.int64), tl.full([], float("-inf"), tl.float32), tl.zeros([], dtype=tl.float32)


@triton.jit
def _race_chunk(w, noise_row_ptr, offs, in_vocab, start, best_id, best_score, w_max):
    """One chunk of the vocabulary in the exponential race: `w # [BLOCK_V]` (this chunk's weights at
    `offs`, from `start`) divided by its noise; returns (best_id, best_score, w_max) updated. An
    equal score in a later chunk loses the tie (strict >), so the lowest index wins overall."""
    noise = tl.load(noise_row_ptr + offs, mask=in_vocab, other=1.0)
    score = tl.where(in_vocab, tl.div_rn(w, noise), float("-inf"))
    chunk_best, chunk_id = tl.max(score, axis=0, return_indices=True)
    better = chunk_best > best_score
    return (tl.where(better, start + chunk_id, best_id), tl.where(better, chunk_best, best_score),
            tl.maximum(w_max, tl.max(w, axis=0)))


@triton.jit
def _greedy_accept_kernel(
    draft_ids_ptr,  # [B, K] int64
    num_drafts_ptr,  # [B] int64
    target_argmax_ptr,  # [B, K+1] int64
    output_ids_ptr,  # [B, K+1] int64
    num_accepted_ptr,  # [B] int64
    K,
    BLOCK_K: tl.constexpr,  # power of two >= K + 1
):
    b = tl.program_id(0).to(tl.int64)
    # The contract is 0 <= n <= K; clamping only keeps a bad input from reading out of bounds.
    n = tl.minimum(tl.maximum(tl.load(num_drafts_ptr + b), 0), K)
    offs = tl.arange(0, BLOCK_K)
    is_draft = offs < n
    drafts = tl.load(draft_ids_ptr + b * K + offs, mask=is_draft, other=0)
    target = tl.load(target_argmax_ptr + b * (K + 1) + offs, mask=offs < K + 1, other=-1)
    # Accepted = length of the matching prefix = position of the first mismatch (n if none).
    num_acc = tl.min(tl.where(is_draft & (drafts != target), offs, n), axis=0)
    out = tl.where(offs < num_acc, drafts, tl.where(offs == num_acc, target, -1))
    tl.store(output_ids_ptr + b * (K + 1) + offs, out, mask=offs < K + 1)
    tl.store(num_accepted_ptr + b, num_acc)


@triton.jit
def _exponential_race(
    p_row_ptr,  # [V] float32, p_i of this row
    q_row_ptr,  # [V] float32, q_i of this row (read only when HAS_DRAFT_PROBS and subtract)
    noise_row_ptr,  # [V] float32, Exponential(1) noise of this row
    onehot_id,  # scalar int64: the draft whose one-hot q is subtracted when not HAS_DRAFT_PROBS
    subtract,  # scalar bool: race over max(0, p - q) if true, over p if false
    V,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """argmax_v w_v / noise_v, lowest index on ties, with w = max(0, p - q) or p; also max_v w_v.

    With subtract false, w = max(0, p - 0) = p exactly, which is what the reference races over.
    """
    # q is read (or built) only below q_end / at q_id: nowhere unless subtract. (Comparisons, not
    # `mask & subtract`: the interpreter turns an int1 scalar broadcast by `&` into a non-bool
    # mask, which tl.load rejects.)
    q_end = tl.where(subtract, V, 0)
    q_id = tl.where(subtract, onehot_id, -1)
    best_id, best_score, w_max = _race_start()
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        in_vocab = offs < V
        p = tl.load(p_row_ptr + offs, mask=in_vocab, other=0.0)
        if HAS_DRAFT_PROBS:
            q = tl.load(q_row_ptr + offs, mask=offs < q_end, other=0.0)
        else:
            q = tl.where(offs == q_id, 1.0, 0.0)
        w = tl.maximum(p - q, 0.0)
        best_id, best_score, w_max = _race_chunk(w, noise_row_ptr, offs, in_vocab, start, best_id, best_score, w_max)
    return best_id, w_max


@triton.jit
def _rejection_sample_kernel(
    draft_ids_ptr,  # [B, K] int64
    num_drafts_ptr,  # [B] int64
    draft_probs_ptr,  # [B, K, V] float32 (any tensor when not HAS_DRAFT_PROBS; never read)
    target_probs_ptr,  # [B, K+1, V] float32
    uniform_ptr,  # [B, K] float32
    exp_noise_ptr,  # [B, V] float32
    output_ids_ptr,  # [B, K+1] int64
    num_accepted_ptr,  # [B] int64
    K,
    V,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_K: tl.constexpr,  # power of two >= K + 1
    BLOCK_V: tl.constexpr,  # power of two
):
    b = tl.program_id(0).to(tl.int64)
    # The contract is 0 <= n <= K; clamping only keeps a bad input from reading out of bounds.
    n = tl.minimum(tl.maximum(tl.load(num_drafts_ptr + b), 0), K)
    offs_k = tl.arange(0, BLOCK_K)
    is_draft = offs_k < n

    # Acceptance tests of all drafts at once; an out-of-vocabulary draft has p = q = 0: rejected.
    x = tl.load(draft_ids_ptr + b * K + offs_k, mask=is_draft, other=0)
    x_ok = is_draft & (x >= 0) & (x < V)
    p = tl.load(target_probs_ptr + (b * (K + 1) + offs_k) * V + x, mask=x_ok, other=0.0)
    if HAS_DRAFT_PROBS:
        q = tl.load(draft_probs_ptr + (b * K + offs_k) * V + x, mask=x_ok, other=0.0)
    else:
        q = tl.where(x_ok, 1.0, 0.0)
    u = tl.load(uniform_ptr + b * K + offs_k, mask=is_draft, other=1.0)
    accept = (q > 0) & (tl.div_rn(p, tl.where(q > 0, q, 1.0)) >= u)
    num_acc = tl.min(tl.where(is_draft & ~accept, offs_k, n), axis=0)

    # One extra token at position num_acc: recovered from max(0, p - q) if that draft was rejected,
    # bonus from p if every draft was accepted (num_acc == n).
    rejected = num_acc < n
    x_rejected = tl.sum(tl.where(offs_k == num_acc, x, 0), axis=0)
    p_row_ptr = target_probs_ptr + (b * (K + 1) + num_acc) * V
    q_row_ptr = draft_probs_ptr + (b * K + num_acc) * V
    noise_row_ptr = exp_noise_ptr + b * V
    extra, w_max = _exponential_race(
        p_row_ptr, q_row_ptr, noise_row_ptr, x_rejected, rejected, V, HAS_DRAFT_PROBS, BLOCK_V
    )
    if w_max <= 0.0:  # residual all zero (p == q where rejected): race over p itself
        no_subtract = tl.zeros([], dtype=tl.int1)  # a tensor, not False: a mask operand below
        extra, w_max = _exponential_race(
            p_row_ptr, q_row_ptr, noise_row_ptr, x_rejected, no_subtract, V,
            HAS_DRAFT_PROBS, BLOCK_V,
        )

    out = tl.where(offs_k < num_acc, x, tl.where(offs_k == num_acc, extra, -1))
    tl.store(output_ids_ptr + b * (K + 1) + offs_k, out, mask=offs_k < K + 1)
    tl.store(num_accepted_ptr + b, num_acc)


@triton.jit
def _tree_row(draft_ids_ptr, parents_ptr, num_drafts_ptr, K, BLOCK_K: tl.constexpr):
    """This program's row b of a tree batch: its node count n, offsets `# [BLOCK_K]`, which are drafts, their
    tokens (-1 past the drafts) and parents (-2 past them: no node's child), and its outputs, all -1
    so far."""
    b = tl.program_id(0).to(tl.int64)
    n = tl.minimum(tl.maximum(tl.load(num_drafts_ptr + b), 0), K)
    offs = tl.arange(0, BLOCK_K)
    is_draft = offs < n
    drafts = tl.load(draft_ids_ptr + b * K + offs, mask=is_draft, other=-1)
    parents = tl.load(parents_ptr + b * K + offs, mask=is_draft, other=-2)
    empty = tl.full([BLOCK_K], -1, dtype=tl.int64)
    return b, n, offs, is_draft, drafts, parents, empty, empty


@triton.jit
def _tree_greedy_kernel(
    draft_ids_ptr,  # [B, K] int64
    parents_ptr,  # [B, K] int64
    num_drafts_ptr,  # [B] int64
    target_argmax_ptr,  # [B, K+1] int64
    output_ids_ptr,  # [B, K+1] int64
    num_accepted_ptr,  # [B] int64
    accepted_nodes_ptr,  # [B, K] int64
    K,
    BLOCK_K: tl.constexpr,  # power of two >= K + 1
):
    """One level of the tree per iteration, all of a node's children compared at once; writes
    are masked once the walk has ended (Triton has no break)."""
    b, n, offs, is_draft, drafts, parents, out, nodes = _tree_row(draft_ids_ptr, parents_ptr, num_drafts_ptr, K, BLOCK_K)
    cur = tl.full([], -1, dtype=tl.int64)
    acc = tl.zeros([], dtype=tl.int64)
    live = tl.full([], 1, dtype=tl.int32)
    for _ in range(0, K + 1):
        a = tl.load(target_argmax_ptr + b * (K + 1) + cur + 1)
        # the lowest-index child carrying the argmax, as the reference's first match
        child = tl.min(tl.where(is_draft & (parents == cur) & (drafts == a), offs, BLOCK_K), axis=0)
        found = (child < BLOCK_K) & (live == 1)
        out = tl.where((offs == acc) & (live == 1), a, out)
        nodes = tl.where((offs == acc) & found, child, nodes)
        acc = acc + found.to(tl.int64)
        cur = tl.where(found, child.to(tl.int64), cur)
        live = found.to(tl.int32)
    tl.store(output_ids_ptr + b * (K + 1) + offs, out, mask=offs < K + 1)
    tl.store(accepted_nodes_ptr + b * K + offs, nodes, mask=offs < K)
    tl.store(num_accepted_ptr + b, acc)


@triton.jit
def _tree_race(
    p_row_ptr,  # [V] float32
    noise_row_ptr,  # [V] float32
    drafts,  # [BLOCK_K] int64, the tree's tokens
    rejected,  # [BLOCK_K] int1: which of them are zeroed in the residual
    V,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """argmax_v w_v / noise_v (lowest index on ties) with w = p, zero at the rejected tokens;
    also max_v w_v."""
    best_id, best_score, w_max = _race_start()
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        in_vocab = offs < V
        p = tl.load(p_row_ptr + offs, mask=in_vocab, other=0.0)
        hit = (offs[:, None] == drafts[None, :]) & rejected[None, :]  # [BLOCK_V, BLOCK_K]
        w = tl.where(tl.max(hit.to(tl.int32), axis=1) > 0, 0.0, p)
        best_id, best_score, w_max = _race_chunk(w, noise_row_ptr, offs, in_vocab, start, best_id, best_score, w_max)
    return best_id, w_max


@triton.jit
def _tree_sample_kernel(
    draft_ids_ptr,  # [B, K] int64
    parents_ptr,  # [B, K] int64
    num_drafts_ptr,  # [B] int64
    target_probs_ptr,  # [B, K+1, V] float32
    uniform_ptr,  # [B, K] float32
    exp_noise_ptr,  # [B, V] float32
    output_ids_ptr,  # [B, K+1] int64
    num_accepted_ptr,  # [B] int64
    accepted_nodes_ptr,  # [B, K] int64
    K,
    V,
    BLOCK_K: tl.constexpr,  # power of two >= K + 1
    BLOCK_V: tl.constexpr,
):
    """Per level, the children are tested one by one in index order (the residual's mass S is
    subtracted sequentially, as in the reference: a cumulative sum could round differently)."""
    b, n, offs, is_draft, drafts, parents, out, nodes = _tree_row(draft_ids_ptr, parents_ptr, num_drafts_ptr, K, BLOCK_K)
    cur = tl.full([], -1, dtype=tl.int64)
    last = tl.full([], -1, dtype=tl.int64)  # the node the walk ended at
    acc = tl.zeros([], dtype=tl.int64)
    live = tl.full([], 1, dtype=tl.int32)
    for _ in range(0, K + 1):
        p_row = target_probs_ptr + (b * (K + 1) + cur + 1) * V
        left = tl.full([], 1.0, tl.float32)
        taken = tl.full([], -1, dtype=tl.int64)
        for j in range(0, K):
            pj = tl.load(parents_ptr + b * K + j)
            xj = tl.load(draft_ids_ptr + b * K + j)
            uj = tl.load(uniform_ptr + b * K + j)
            test = (live == 1) & (j < n) & (pj == cur) & (taken < 0) & (xj >= 0) & (xj < V)
            px = tl.load(p_row + xj, mask=test, other=0.0)
            ok = test & (px > 0.0) & (px >= uj * left)
            taken = tl.where(ok, j, taken)
            left = tl.where(test & ~ok, left - px, left)
        found = (taken >= 0) & (live == 1)
        token = tl.sum(tl.where(offs == taken, drafts, 0), axis=0)
        out = tl.where((offs == acc) & found, token, out)
        nodes = tl.where((offs == acc) & found, taken, nodes)
        last = tl.where((live == 1) & ~found, cur, last)
        acc = acc + found.to(tl.int64)
        cur = tl.where(found, taken, cur)
        live = found.to(tl.int32)
    # every child of the last node was tested and rejected (a leaf has none): zero them
    rejected = is_draft & (parents == last) & (drafts >= 0) & (drafts < V)
    p_row = target_probs_ptr + (b * (K + 1) + last + 1) * V
    extra, w_max = _tree_race(p_row, exp_noise_ptr + b * V, drafts, rejected, V, BLOCK_K, BLOCK_V)
    if w_max <= 0.0:  # all of p's mass was on rejected tokens: race over p itself
        extra, w_max = _tree_race(p_row, exp_noise_ptr + b * V, drafts, rejected & (offs < 0), V,
                                  BLOCK_K, BLOCK_V)
    out = tl.where(offs == acc, extra, out)
    tl.store(output_ids_ptr + b * (K + 1) + offs, out, mask=offs < K + 1)
    tl.store(accepted_nodes_ptr + b * K + offs, nodes, mask=offs < K)
    tl.store(num_accepted_ptr + b, acc)


def greedy_accept(draft_ids, num_drafts, target_argmax) -> tuple[torch.Tensor, ...]:
    """reference.greedy_accept on the GPU: the same arguments (shapes and dtypes there) and bits."""
    check_greedy_args(draft_ids, num_drafts, target_argmax)
    B, K = draft_ids.shape
    output_ids = torch.empty((B, K + 1), dtype=torch.int64, device=draft_ids.device)
    num_accepted = torch.empty(B, dtype=torch.int64, device=draft_ids.device)
    if B > 0:
        _greedy_accept_kernel[(B,)](
            draft_ids.contiguous(),
            num_drafts.contiguous(),
            target_argmax.contiguous(),
            output_ids,
            num_accepted,
            K,
            BLOCK_K=triton.next_power_of_2(K + 1),
        )
    return output_ids, num_accepted


def rejection_sample(draft_ids, num_drafts, draft_probs, target_probs, uniform, exp_noise) -> tuple[torch.Tensor, ...]:
    """reference.rejection_sample on the GPU: the same arguments (shapes and dtypes there) and bits."""
    check_sampling_args(draft_ids, num_drafts, draft_probs, target_probs, uniform, exp_noise)
    B, K = draft_ids.shape
    V = target_probs.shape[-1]
    output_ids = torch.empty((B, K + 1), dtype=torch.int64, device=draft_ids.device)
    num_accepted = torch.empty(B, dtype=torch.int64, device=draft_ids.device)
    if B > 0:
        target_probs = target_probs.contiguous()
        _rejection_sample_kernel[(B,)](
            draft_ids.contiguous(),
            num_drafts.contiguous(),
            target_probs if draft_probs is None else draft_probs.contiguous(),
            target_probs,
            uniform.contiguous(),
            exp_noise.contiguous(),
            output_ids,
            num_accepted,
            K,
            V,
            HAS_DRAFT_PROBS=draft_probs is not None,
            BLOCK_K=triton.next_power_of_2(K + 1),
            BLOCK_V=min(MAX_BLOCK_V, triton.next_power_of_2(V)),
        )
    return output_ids, num_accepted


def _tree_outputs(draft_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised outputs of a tree kernel, which writes every entry: output_ids `[B, K+1]`,
    num_accepted `[B]`, accepted_nodes `[B, K]`, int64."""
    B, K = draft_ids.shape
    dev = draft_ids.device
    return (torch.empty((B, K + 1), dtype=torch.int64, device=dev), torch.empty(B, dtype=torch.int64, device=dev),
            torch.empty((B, K), dtype=torch.int64, device=dev))


def tree_greedy_accept(draft_ids, parents, num_drafts, target_argmax) -> tuple[torch.Tensor, ...]:
    """reference.tree_greedy_accept on the GPU: the same arguments (shapes and dtypes there) and bits.
    The tree contract (reference.check_tree) is the caller's: checking it here would cost a host
    round trip per step."""
    check_greedy_args(draft_ids, num_drafts, target_argmax)
    check_tree_args(draft_ids, parents, num_drafts)
    B, K = draft_ids.shape
    output_ids, num_accepted, accepted_nodes = _tree_outputs(draft_ids)
    if B > 0:
        _tree_greedy_kernel[(B,)](
            draft_ids.contiguous(), parents.contiguous(), num_drafts.contiguous(), target_argmax.contiguous(),
            output_ids, num_accepted, accepted_nodes, K, BLOCK_K=triton.next_power_of_2(K + 1),
        )
    return output_ids, num_accepted, accepted_nodes


def tree_rejection_sample(draft_ids, parents, num_drafts, target_probs, uniform, exp_noise) -> tuple[torch.Tensor, ...]:
    """reference.tree_rejection_sample on the GPU: the same arguments (shapes and dtypes there) and bits."""
    check_tree_args(draft_ids, parents, num_drafts)
    check_sampling_args(draft_ids, num_drafts, None, target_probs, uniform, exp_noise)
    B, K = draft_ids.shape
    V = target_probs.shape[-1]
    output_ids, num_accepted, accepted_nodes = _tree_outputs(draft_ids)
    if B > 0:
        _tree_sample_kernel[(B,)](
            draft_ids.contiguous(), parents.contiguous(), num_drafts.contiguous(), target_probs.contiguous(),
            uniform.contiguous(), exp_noise.contiguous(), output_ids, num_accepted, accepted_nodes, K, V,
            BLOCK_K=triton.next_power_of_2(K + 1), BLOCK_V=min(MAX_BLOCK_V, triton.next_power_of_2(V)),
        )
    return output_ids, num_accepted, accepted_nodes
