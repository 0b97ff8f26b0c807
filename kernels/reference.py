"""Plain PyTorch references of the verification kernels: slow, row by row, obviously right.

They define the semantics that `triton_verify` must reproduce bit for bit on identical inputs
(random numbers included), and they serve CPU tensors at run time. Every float operation that
decides an outcome is a single IEEE-rounded float32 operation (a subtraction, a division, a
comparison), so the two implementations cannot disagree by rounding.
"""

import torch


def check_greedy_args(
    draft_ids: torch.Tensor,  # [B, K] int64
    num_drafts: torch.Tensor,  # [B] int64
    target_argmax: torch.Tensor,  # [B, K+1] int64
) -> None:
    """Check shapes and dtypes (cheap, no device sync); shared by both implementations."""
    if draft_ids.dim() != 2:
        raise ValueError(f"draft_ids must be [B, K], got {tuple(draft_ids.shape)}")
    B, K = draft_ids.shape
    _expect("num_drafts", num_drafts, (B,), torch.int64)
    _expect("draft_ids", draft_ids, (B, K), torch.int64)
    _expect("target_argmax", target_argmax, (B, K + 1), torch.int64)


def check_sampling_args(
    draft_ids: torch.Tensor,  # [B, K] int64
    num_drafts: torch.Tensor,  # [B] int64
    draft_probs: torch.Tensor | None,  # [B, K, V] float32, or None for a deterministic drafter
    target_probs: torch.Tensor,  # [B, K+1, V] float32
    uniform: torch.Tensor,  # [B, K] float32
    exp_noise: torch.Tensor,  # [B, V] float32
) -> None:
    """Check shapes and dtypes (cheap, no device sync); shared by both implementations."""
    if draft_ids.dim() != 2 or target_probs.dim() != 3:
        raise ValueError(
            f"draft_ids must be [B, K] and target_probs [B, K+1, V], "
            f"got {tuple(draft_ids.shape)} and {tuple(target_probs.shape)}"
        )
    B, K = draft_ids.shape
    V = target_probs.shape[-1]
    _expect("draft_ids", draft_ids, (B, K), torch.int64)
    _expect("num_drafts", num_drafts, (B,), torch.int64)
    if draft_probs is not None:
        _expect("draft_probs", draft_probs, (B, K, V), torch.float32)
    _expect("target_probs", target_probs, (B, K + 1, V), torch.float32)
    _expect("uniform", uniform, (B, K), torch.float32)
    _expect("exp_noise", exp_noise, (B, V), torch.float32)


def greedy_accept(
    draft_ids: torch.Tensor,  # [B, K] int64
    num_drafts: torch.Tensor,  # [B] int64
    target_argmax: torch.Tensor,  # [B, K+1] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # output_ids [B, K+1] int64, num_accepted [B] int64
    """Accept drafts while they equal the target's argmax, then commit the target's own token.

    Example (K = 3): drafts [5, 6, 7], num_drafts 3, target_argmax [5, 6, 9, 4]
    -> output_ids [5, 6, 9, -1] (two accepted, 9 recovered), num_accepted 2.
    """
    check_greedy_args(draft_ids, num_drafts, target_argmax)
    B, K = draft_ids.shape
    # On Python lists: indexing tensors element by element cost ~20 us a row per step on a CPU
    # (0.3 ms of a 16-session step), and this is the verifier's CPU path, not only the tests' oracle.
    drafts, targets, counts = draft_ids.tolist(), target_argmax.tolist(), num_drafts.tolist()
    output_ids = [[-1] * (K + 1) for _ in range(B)]
    num_accepted = [0] * B
    for b in range(B):
        n = _count_in_range(counts[b], b, K)
        accepted = 0
        while accepted < n and drafts[b][accepted] == targets[b][accepted]:
            accepted += 1
        output_ids[b][:accepted] = drafts[b][:accepted]
        # Recovered token at the first mismatch, or bonus token after the last draft.
        output_ids[b][accepted] = targets[b][accepted]
        num_accepted[b] = accepted
    device = draft_ids.device
    return (torch.tensor(output_ids, dtype=torch.int64, device=device),
            torch.tensor(num_accepted, dtype=torch.int64, device=device))


def rejection_sample(
    draft_ids: torch.Tensor,  # [B, K] int64
    num_drafts: torch.Tensor,  # [B] int64
    draft_probs: torch.Tensor | None,  # [B, K, V] float32, or None for a deterministic drafter
    target_probs: torch.Tensor,  # [B, K+1, V] float32
    uniform: torch.Tensor,  # [B, K] float32, in (0, 1)
    exp_noise: torch.Tensor,  # [B, V] float32, Exponential(1), > 0
) -> tuple[torch.Tensor, torch.Tensor]:  # output_ids [B, K+1] int64, num_accepted [B] int64
    """Speculative sampling (Leviathan et al. 2023): the committed tokens are distributed as if
    sampled from the target alone.

    Draft x at position i is accepted iff q_i(x) > 0 and p_i(x) / q_i(x) >= uniform[b, i]. At the
    first rejection the recovered token is drawn from norm(max(0, p_i - q_i)) (from p_i when that
    residual is all zero); after the last accepted draft the bonus token is drawn from p_n. Both
    draws use the exponential race on this row's noise: argmax_v w_v / exp_noise[b, v], lowest index
    on ties. A draft id outside [0, V) is rejected like any other token the drafter gave q = 0.
    """
    check_sampling_args(draft_ids, num_drafts, draft_probs, target_probs, uniform, exp_noise)
    B, K = draft_ids.shape
    V = target_probs.shape[-1]
    output_ids = torch.full((B, K + 1), -1, dtype=torch.int64, device=draft_ids.device)
    num_accepted = torch.zeros(B, dtype=torch.int64, device=draft_ids.device)
    for b in range(B):
        n = _num_drafts(num_drafts, b, K)
        accepted = 0
        extra = None  # the recovered or bonus token
        for i in range(n):
            x = int(draft_ids[b, i])
            p_i = target_probs[b, i]  # [V]
            q_i = _proposal(draft_probs, b, i, x, p_i)  # [V]
            in_vocab = 0 <= x < V
            p = p_i[x] if in_vocab else p_i.new_zeros(())
            q = q_i[x] if in_vocab else q_i.new_zeros(())
            if q > 0 and p / q >= uniform[b, i]:  # float32 / float32, as in the kernel
                output_ids[b, i] = x
                accepted += 1
                continue
            residual = torch.clamp(p_i - q_i, min=0.0)  # [V]
            extra = _exponential_race(residual if residual.max() > 0 else p_i, exp_noise[b])
            break
        if extra is None:  # every draft accepted: bonus token from the next position
            extra = _exponential_race(target_probs[b, n], exp_noise[b])
        output_ids[b, accepted] = extra
        num_accepted[b] = accepted
    return output_ids, num_accepted


def check_tree_args(
    draft_ids: torch.Tensor,  # [B, K] int64
    parents: torch.Tensor,  # [B, K] int64
    num_drafts: torch.Tensor,  # [B] int64
) -> None:
    """Shapes and dtypes of a tree's extra argument (cheap, no device sync)."""
    if draft_ids.dim() != 2:
        raise ValueError(f"draft_ids must be [B, K], got {tuple(draft_ids.shape)}")
    _expect("parents", parents, tuple(draft_ids.shape), torch.int64)


def check_tree(
    draft_ids: torch.Tensor,  # [B, K] int64
    parents: torch.Tensor,  # [B, K] int64
    num_drafts: torch.Tensor,  # [B] int64
) -> None:
    """The tree contract, row by row (a host loop: callers on a GPU check their Python lists
    instead, see tandem.engine.speculation.proposers.check_tree): node i's parent is -1 (the pending token) or
    an earlier node, and siblings carry distinct tokens (the sampled rule tests each token once)."""
    B, K = draft_ids.shape
    for b in range(B):
        n = _num_drafts(num_drafts, b, K)
        seen: set[tuple[int, int]] = set()
        for i in range(n):
            par, tok = int(parents[b, i]), int(draft_ids[b, i])
            if not -1 <= par < i:
                raise ValueError(f"parents[{b}, {i}] = {par}: a node's parent is -1 or an earlier node")
            if (par, tok) in seen:
                raise ValueError(f"row {b}: node {i} repeats token {tok} among its siblings")
            seen.add((par, tok))


def tree_greedy_accept(
    draft_ids: torch.Tensor,  # [B, K] int64, the tree's nodes in topological order
    parents: torch.Tensor,  # [B, K] int64, parent node of each (-1: the pending token)
    num_drafts: torch.Tensor,  # [B] int64, nodes per row
    target_argmax: torch.Tensor,  # [B, K+1] int64; row 0 after the pending token, row i+1 after node i
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # -> output_ids [B, K+1] int64, num_accepted [B] int64, accepted_nodes [B, K] int64
    """Walk the tree from the pending token: at each node take the child whose token is the
    target's argmax there; where none is, commit the argmax itself (recovered, or bonus at a leaf).
    accepted_nodes lists the path's node indices (-1 after), which tells the caller which KV to keep.

    Example: nodes [5, 6, 7] with parents [-1, -1, 1] (5 and 6 both follow the pending token, 7
    follows 6), target_argmax [6, 0, 7, 4] -> output_ids [6, 7, 4, -1], num_accepted 2, nodes [1, 2, -1].
    """
    check_greedy_args(draft_ids, num_drafts, target_argmax)
    check_tree_args(draft_ids, parents, num_drafts)
    check_tree(draft_ids, parents, num_drafts)

    def step(b: int, cur: int, n: int) -> tuple[int | None, int]:
        a = int(target_argmax[b, cur + 1])
        return next((j for j in range(n) if int(parents[b, j]) == cur and int(draft_ids[b, j]) == a), None), a

    return _walk_tree(draft_ids, num_drafts, step)


def tree_rejection_sample(
    draft_ids: torch.Tensor,  # [B, K] int64, topological order
    parents: torch.Tensor,  # [B, K] int64 (-1: the pending token)
    num_drafts: torch.Tensor,  # [B] int64
    target_probs: torch.Tensor,  # [B, K+1, V] float32; row 0 after the pending token, row i+1 after node i
    uniform: torch.Tensor,  # [B, K] float32, in (0, 1]: node i's test
    exp_noise: torch.Tensor,  # [B, V] float32, Exponential(1), > 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # -> output_ids [B, K+1] int64, num_accepted [B] int64, accepted_nodes [B, K] int64
    """Lossless sampling over a tree of deterministic drafts (each node's q is one-hot at its
    token): recursive rejection over siblings (SpecInfer's multi-draft rule, one-hot case).

    At a node with target distribution p, its children are tested in index order against the
    residual r (p with the children rejected so far zeroed; S = 1 - their mass, subtracted one by
    one): child x is accepted iff r(x) > 0 and r(x) >= uniform * S, i.e. with probability
    r(x) / S, its share of what is left. Then the walk goes on from x. When every child is rejected
    (or there is none), one token is drawn from r (from p where r is all zero) by the exponential
    race on the row's noise, as in `rejection_sample`. By induction over the children the token
    leaving each node is distributed as p: the committed text is distributed as the target's.
    A chain (parents i - 1) gives exactly `rejection_sample`'s result with one-hot drafts.
    """
    check_tree_args(draft_ids, parents, num_drafts)
    check_sampling_args(draft_ids, num_drafts, None, target_probs, uniform, exp_noise)
    check_tree(draft_ids, parents, num_drafts)
    V = target_probs.shape[-1]

    def step(b: int, cur: int, n: int) -> tuple[int | None, int]:
        p = target_probs[b, cur + 1]  # [V]
        left = torch.ones((), dtype=torch.float32, device=p.device)  # S
        rejected: list[int] = []
        for j in range(n):
            if int(parents[b, j]) != cur:
                continue
            x = int(draft_ids[b, j])
            if not 0 <= x < V:
                continue  # q(x) = 0: rejected, nothing to take out of the residual
            px = p[x]
            if px > 0 and px >= uniform[b, j] * left:  # float32 * float32, as in the kernel
                return j, x
            left = left - px
            rejected.append(x)
        residual = p.clone()
        residual[rejected] = 0.0
        return None, _exponential_race(residual if residual.max() > 0 else p, exp_noise[b])

    return _walk_tree(draft_ids, num_drafts, step)


def _proposal(
    draft_probs: torch.Tensor | None,  # [B, K, V] float32, or None
    b: int,
    i: int,
    x: int,
    like: torch.Tensor,  # [V] float32, p_i: gives V and the device
) -> torch.Tensor:  # [V] float32
    """q_i of row b; a deterministic drafter's q is one-hot at its draft (all zero if x is OOV)."""
    if draft_probs is not None:
        return draft_probs[b, i]
    q = torch.zeros_like(like)
    if 0 <= x < q.shape[0]:
        q[x] = 1.0
    return q


def _exponential_race(
    weights: torch.Tensor,  # [V] float32, >= 0
    exp_noise: torch.Tensor,  # [V] float32, Exponential(1)
) -> int:
    """Sample v with probability weights_v / sum(weights): argmax_v weights_v / exp_noise_v.

    (weights_v / E_v is the inverse of an Exponential(rate = weights_v); the smallest of independent
    exponentials is v with probability proportional to its rate.) torch.argmax returns the first of
    equal maxima, i.e. the lowest index on ties.
    """
    return int(torch.argmax(weights / exp_noise))


def _walk_tree(draft_ids: torch.Tensor, num_drafts: torch.Tensor, step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both tree rules' walk, row by row from the pending token (node -1): `step(b, cur, n)` gives
    the child of `cur` it accepts and that child's token, or (None, the recovered or bonus token)
    where the walk ends. Returns output_ids `[B, K+1]` (the path's tokens, then the last one, then
    -1), num_accepted `[B]` and accepted_nodes `[B, K]` (the path's nodes, then -1)."""
    B, K = draft_ids.shape
    dev = draft_ids.device
    output_ids = torch.full((B, K + 1), -1, dtype=torch.int64, device=dev)
    num_accepted = torch.zeros(B, dtype=torch.int64, device=dev)
    accepted_nodes = torch.full((B, K), -1, dtype=torch.int64, device=dev)
    for b in range(B):
        n = _num_drafts(num_drafts, b, K)
        cur, accepted = -1, 0
        while True:
            child, token = step(b, cur, n)
            output_ids[b, accepted] = token
            if child is None:
                break
            accepted_nodes[b, accepted] = child
            accepted += 1
            cur = child
        num_accepted[b] = accepted
    return output_ids, num_accepted, accepted_nodes


def _num_drafts(num_drafts: torch.Tensor, b: int, K: int) -> int:
    return _count_in_range(int(num_drafts[b]), b, K)


def _count_in_range(n: int, b: int, K: int) -> int:
    if not 0 <= n <= K:
        raise ValueError(f"num_drafts[{b}] = {n} is outside [0, K = {K}]")
    return n


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise ValueError(f"{name} must be {list(shape)} {dtype}, got {list(t.shape)} {t.dtype}")
