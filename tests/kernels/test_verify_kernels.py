"""Verification kernels: the reference's mathematics, and Triton == reference bit for bit.

Every case below is a fixed, seeded input. Cases with a known answer check the reference against it;
every case checks the Triton kernel against the reference with torch.equal.

The Triton side runs in one child process (this file run as a script) started with
TRITON_INTERPRET=1. Setting the variable inside this process would be too late whenever anything
earlier in the pytest session has imported triton (transformers' model code and torch._dynamo do):
triton.language's own @jit helpers (tl.max, ...) are built when triton is imported, and an
interpreted kernel cannot call them once built for the GPU ("Cannot call @triton.jit'd outside of
the scope of a kernel").
"""

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

import tandem.kernels as kernels
from tandem.kernels import reference


@dataclass
class Case:
    fn: str  # "greedy_accept" or "rejection_sample"
    args: tuple  # the function's positional arguments
    expected: tuple[list[list[int]], list[int]] | None = None  # (output_ids, num_accepted) if known


def _ids(values: list) -> torch.Tensor:  # [B, K] or [B] int64
    return torch.tensor(values, dtype=torch.int64)


def _dist(V: int, mass: dict[int, float]) -> torch.Tensor:  # [V] float32
    d = torch.zeros(V)
    for v, m in mass.items():
        d[v] = m
    return d


def _random_probs(g: torch.Generator, shape: tuple[int, ...], keep: float = 1.0) -> torch.Tensor:
    """Peaked random distributions over the last dim; with keep < 1 each entry is zero with
    probability 1 - keep (a top-k / top-p support), the row's largest entry always kept."""
    logits = 3.0 * torch.randn(shape, generator=g)
    support = torch.rand(shape, generator=g) < keep
    support |= logits == logits.max(-1, keepdim=True).values
    probs = torch.softmax(logits, -1) * support
    return probs / probs.sum(-1, keepdim=True)


def _greedy_random(seed: int, B: int, K: int, num_drafts: list[int], agree: float) -> Case:
    """Drafts equal the target argmax with probability `agree` (a vocabulary of 5 collides too)."""
    g = torch.Generator().manual_seed(seed)
    target_argmax = torch.randint(0, 5, (B, K + 1), generator=g)
    draft_ids = torch.where(
        torch.rand(B, K, generator=g) < agree,
        target_argmax[:, :K],
        torch.randint(0, 5, (B, K), generator=g),
    )
    return Case("greedy_accept", (draft_ids, _ids(num_drafts), target_argmax))


def _sampling_random(
    seed: int, B: int, K: int, V: int, num_drafts: list[int], one_hot: bool = False
) -> Case:
    """A drafter close to the target (its logits perturbed), sparse support, drafts x ~ q; the
    deterministic drafter proposes the argmax of its q."""
    g = torch.Generator().manual_seed(seed)
    target_probs = _random_probs(g, (B, K + 1, V), keep=0.5)
    perturbed = target_probs[:, :K].clamp_min(1e-6).log() + torch.randn(B, K, V, generator=g)
    draft_probs = torch.softmax(perturbed, -1) * (torch.rand(B, K, V, generator=g) < 0.7)
    draft_probs[..., 0] += 1e-3  # never an all-zero row
    draft_probs /= draft_probs.sum(-1, keepdim=True)
    if one_hot:
        draft_ids = draft_probs.argmax(-1)
    else:
        draft_ids = torch.multinomial(draft_probs.reshape(-1, V), 1, generator=g).reshape(B, K)
    uniform = torch.rand(B, K, generator=g)
    exp_noise = torch.empty(B, V).exponential_(generator=g)
    q = None if one_hot else draft_probs
    args = (draft_ids, _ids(num_drafts), q, target_probs, uniform, exp_noise)
    return Case("rejection_sample", args)


def _greedy_hand() -> Case:
    return Case(
        "greedy_accept",
        (
            _ids([[5, 6, 7], [5, 6, 7], [1, 2, 3], [9, 9, 9], [2, 7, 1]]),
            _ids([3, 3, 3, 0, 1]),
            _ids([[5, 6, 9, 4], [5, 6, 7, 8], [4, 2, 3, 1], [3, 9, 9, 9], [2, 7, 1, 0]]),
        ),
        expected=(
            [
                [5, 6, 9, -1],  # mismatch at 2: two accepted, 9 recovered
                [5, 6, 7, 8],  # all accepted, bonus 8
                [4, -1, -1, -1],  # none accepted
                [3, -1, -1, -1],  # padded row: plain step (its padding would match: ignored)
                [2, 7, -1, -1],  # one draft, accepted; padding past it ignored
            ],
            [2, 3, 0, 0, 1],
        ),
    )


def _greedy_k1_hand() -> Case:
    return Case(
        "greedy_accept",
        (_ids([[4], [4], [4]]), _ids([1, 1, 0]), _ids([[4, 2], [3, 2], [4, 2]])),
        expected=([[4, 2], [3, -1], [4, -1]], [1, 0, 0]),
    )


def _sampling_hand() -> Case:
    """V = 37 and explicit distributions whose extra token is certain whatever the noise."""
    B, K, V = 6, 3, 37
    g = torch.Generator().manual_seed(7)
    target_probs = _random_probs(g, (B, K + 1, V))
    draft_probs = _random_probs(g, (B, K, V))
    draft_ids = torch.zeros(B, K, dtype=torch.int64)
    uniform = torch.rand(B, K, generator=g)
    exp_noise = torch.empty(B, V).exponential_(generator=g)
    # Row 0, all accepted: p == q makes p / q == 1 >= u; p_3 is one-hot, so the bonus is 11.
    draft_probs[0] = target_probs[0, :K]
    draft_ids[0] = _ids([3, 17, 30])
    target_probs[0, 3] = _dist(V, {11: 1.0})
    # Row 1, none accepted: p(7) = 0 < q(7); residual max(0, p - q) is mass on 3 only.
    draft_ids[1, 0] = 7
    target_probs[1, 0] = _dist(V, {3: 0.5, 4: 0.5})
    draft_probs[1, 0] = _dist(V, {4: 0.5, 7: 0.5})
    # Row 2, q(9) = 0 rejects however large p(9) and small u; residual is mass on 9 only.
    draft_probs[2, 0] = target_probs[2, 0]
    draft_ids[2, :2] = _ids([25, 9])
    target_probs[2, 1] = _dist(V, {9: 0.9, 2: 0.1})
    draft_probs[2, 1] = _dist(V, {2: 1.0})
    uniform[2, 1] = 0.01
    # Row 3, rejected with an all-zero residual (p == q, q(5) = 0): race over p, whose only
    # mass is on 2 and 1; the noise makes 2 win (0.5 / 1 > 0.5 / 2).
    draft_ids[3, 0] = 5
    target_probs[3, 0] = draft_probs[3, 0] = _dist(V, {1: 0.5, 2: 0.5})
    exp_noise[3, 1], exp_noise[3, 2] = 2.0, 1.0
    # Row 4, padded (num_drafts = 0): a plain sample from p_0, one-hot at 30.
    target_probs[4, 0] = _dist(V, {30: 1.0})
    # Row 5, out-of-vocabulary drafts are rejected; residual max(0, p - q) is mass on 36 only.
    draft_ids[5] = _ids([V, -1, V + 5])
    target_probs[5, 0] = _dist(V, {36: 0.6, 0: 0.4})
    draft_probs[5, 0] = _dist(V, {0: 1.0})
    num_drafts = _ids([3, 2, 2, 1, 0, 3])
    return Case(
        "rejection_sample",
        (draft_ids, num_drafts, draft_probs, target_probs, uniform, exp_noise),
        expected=(
            [[3, 17, 30, 11], [3, -1, -1, -1], [25, 9, -1, -1], [2, -1, -1, -1], [30, -1, -1, -1],
             [36, -1, -1, -1]],
            [3, 0, 1, 0, 0, 0],
        ),
    )


def _sampling_one_hot_hand() -> Case:
    """draft_probs None: q is one-hot at the draft, so a draft is accepted iff p(x) >= u and the
    residual max(0, p - q) is p with the draft's own entry zeroed."""
    B, K, V = 4, 2, 37
    g = torch.Generator().manual_seed(8)
    target_probs = _random_probs(g, (B, K + 1, V))
    exp_noise = torch.empty(B, V).exponential_(generator=g)
    draft_ids = _ids([[4, 5], [4, 5], [40, 0], [0, 0]])
    uniform = torch.tensor([[0.3, 0.7], [0.99, 0.99], [0.5, 0.5], [0.5, 0.5]])
    # Row 0: p_0(4) = 0.3 >= u = 0.3 accepts (the boundary accepts); p_1(5) = 0.6 < 0.7 rejects;
    # the residual is mass on 20.
    target_probs[0, 0] = _dist(V, {4: 0.3, 8: 0.7})
    target_probs[0, 1] = _dist(V, {5: 0.6, 20: 0.4})
    # Row 1: p(x) = 1 accepts whatever u; the bonus comes from p_2, one-hot at 33.
    target_probs[1, 0] = _dist(V, {4: 1.0})
    target_probs[1, 1] = _dist(V, {5: 1.0})
    target_probs[1, 2] = _dist(V, {33: 1.0})
    # Row 2: draft 40 is out of the vocabulary: rejected, residual = p_0, mass on 8 only.
    target_probs[2, 0] = _dist(V, {8: 1.0})
    # Row 3: padded; p_0 one-hot at 36.
    target_probs[3, 0] = _dist(V, {36: 1.0})
    return Case(
        "rejection_sample",
        (draft_ids, _ids([2, 2, 1, 0]), None, target_probs, uniform, exp_noise),
        expected=([[4, 20, -1], [4, 5, 33], [8, -1, -1], [36, -1, -1]], [1, 2, 0, 0]),
    )


def _sampling_ties() -> Case:
    """V = 1500 spans two chunks of MAX_BLOCK_V = 1024; with unit noise, equal weights tie and the
    lowest index wins, within a chunk and across chunks."""
    B, K, V = 3, 1, 1500
    target_probs = torch.stack(
        [
            torch.stack([_dist(V, {5: 0.5, 1030: 0.5}), _dist(V, {0: 1.0})]),
            torch.stack([_dist(V, {1400: 0.5, 1030: 0.5}), _dist(V, {0: 1.0})]),
            torch.stack([_dist(V, {1100: 0.25, 700: 0.25, 1499: 0.5}), _dist(V, {0: 1.0})]),
        ]
    )
    args = (_ids([[0], [0], [0]]), _ids([0, 0, 0]), None, target_probs, torch.full((B, K), 0.5),
            torch.ones(B, V))
    return Case("rejection_sample", args, expected=([[5, -1], [1030, -1], [1499, -1]], [0, 0, 0]))


def _sampling_special(kind: str, seed: int, V: int = 37) -> Case:
    """Random inputs bent so that every draft meets one rule: accepted, p(x) = 0, q(x) = 0,
    or p == q with drafts outside the support (all-zero residual)."""
    case = _sampling_random(seed, B=4, K=3, V=V, num_drafts=[3, 3, 2, 1])
    draft_ids, num, draft_probs, target_probs, uniform, exp_noise = case.args
    drafted = draft_ids[..., None]  # [B, K, 1]
    if kind == "all_accepted":  # p / q == 1 at drafts the target supports
        draft_probs = target_probs[:, :3].clone()
        draft_ids = draft_probs.argmax(-1)
    elif kind == "p_zero":
        target_probs[:, :3] = target_probs[:, :3].scatter(-1, drafted, 0.0)
        target_probs /= target_probs.sum(-1, keepdim=True)
    elif kind == "q_zero":
        draft_probs = draft_probs.scatter(-1, drafted, 0.0)
        draft_probs /= draft_probs.sum(-1, keepdim=True)
    elif kind == "residual_zero":
        draft_probs = draft_probs.scatter(-1, drafted, 0.0)
        draft_probs /= draft_probs.sum(-1, keepdim=True)
        target_probs[:, :3] = draft_probs
    return Case("rejection_sample", (draft_ids, num, draft_probs, target_probs, uniform, exp_noise))


CASES: dict[str, Case] = {
    "greedy_hand": _greedy_hand(),
    "greedy_k1_hand": _greedy_k1_hand(),
    "greedy_mixed": _greedy_random(1, B=4, K=5, num_drafts=[5, 0, 2, 3], agree=0.8),
    "greedy_k1": _greedy_random(2, B=4, K=1, num_drafts=[1, 0, 1, 1], agree=0.5),
    "greedy_all_accepted": _greedy_random(3, B=3, K=4, num_drafts=[4, 4, 2], agree=1.0),
    "greedy_padded": _greedy_random(4, B=3, K=4, num_drafts=[0, 0, 0], agree=1.0),
    "greedy_k0": _greedy_random(5, B=2, K=0, num_drafts=[0, 0], agree=1.0),
    "sample_hand_v37": _sampling_hand(),
    "sample_one_hot_hand_v37": _sampling_one_hot_hand(),
    "sample_ties_two_chunks": _sampling_ties(),
    "sample_v37_sparse_q": _sampling_random(11, B=4, K=5, V=37, num_drafts=[5, 0, 3, 1]),
    "sample_v1000": _sampling_random(12, B=4, K=4, V=1000, num_drafts=[4, 2, 4, 3]),
    "sample_v1500_two_chunks": _sampling_random(13, B=2, K=3, V=1500, num_drafts=[3, 1]),
    "sample_one_hot_v37": _sampling_random(14, 4, 5, 37, num_drafts=[5, 4, 0, 2], one_hot=True),
    "sample_one_hot_v1000": _sampling_random(15, 3, 3, 1000, num_drafts=[3, 1, 3], one_hot=True),
    "sample_k1": _sampling_random(16, B=4, K=1, V=37, num_drafts=[1, 0, 1, 1]),
    "sample_k0": _sampling_random(17, B=2, K=0, V=37, num_drafts=[0, 0]),
    "sample_padded": _sampling_random(18, B=3, K=3, V=1000, num_drafts=[0, 0, 0]),
    "sample_all_accepted": _sampling_special("all_accepted", 19),
    "sample_p_zero_none_accepted": _sampling_special("p_zero", 20),
    "sample_q_zero_rejected": _sampling_special("q_zero", 21),
    "sample_residual_zero": _sampling_special("residual_zero", 22),
}


def _tree_hand_greedy() -> Case:
    return Case(
        "tree_greedy_accept",
        (
            _ids([[5, 6, 7], [5, 6, 7], [5, 6, 7], [9, 9, 9], [1, 2, 3]]),
            _ids([[-1, -1, 1], [-1, 0, 1], [-1, -1, 1], [-1, 0, 1], [-1, -1, -1]]),
            _ids([3, 3, 3, 0, 3]),
            _ids([[6, 0, 7, 4], [5, 6, 7, 8], [9, 1, 1, 1], [3, 9, 9, 9], [3, 0, 0, 8]]),
        ),
        expected=(
            [[6, 7, 4, -1], [5, 6, 7, 8], [9, -1, -1, -1], [3, -1, -1, -1], [3, 8, -1, -1]],
            [2, 3, 0, 0, 1],
            [[1, 2, -1], [0, 1, 2], [-1, -1, -1], [-1, -1, -1], [2, -1, -1]],
        ),
    )


def _tree_hand_sampled() -> Case:
    """Explicit distributions, V = 37: siblings tested in order against the residual."""
    B, K, V = 5, 3, 37
    g = torch.Generator().manual_seed(9)
    target_probs = _random_probs(g, (B, K + 1, V))
    exp_noise = torch.empty(B, V).exponential_(generator=g)
    draft_ids = _ids([[4, 5, 0], [4, 5, 0], [40, 4, 0], [4, 6, 7], [0, 0, 0]])
    parents = _ids([[-1, -1, 0], [-1, -1, 0], [-1, -1, 0], [-1, 0, 0], [-1, 0, 1]])
    uniform = torch.tensor([[0.9, 0.5, 0.5], [0.9, 0.9, 0.5], [0.5, 0.5, 0.5], [0.5, 0.5, 0.2],
                            [0.5, 0.5, 0.5]])
    # Row 0: 4 rejected (0.3 < 0.9), S = 0.7; 5 accepted (0.5 >= 0.5 * 0.7); 5 is a leaf, so the
    # bonus comes from its row (row 2), one-hot at 11.
    target_probs[0, 0] = _dist(V, {4: 0.3, 5: 0.5, 8: 0.2})
    target_probs[0, 2] = _dist(V, {11: 1.0})
    # Row 1: both rejected (0.1 < 0.9, 0.1 < 0.9 * 0.9): the residual's only mass is on 8.
    target_probs[1, 0] = _dist(V, {4: 0.1, 5: 0.1, 8: 0.8})
    # Row 2: 40 is out of the vocabulary (rejected, S unchanged); 4 accepted with p = 1; node 1 is a
    # leaf: the bonus from row 2, one-hot at 12.
    target_probs[2, 0] = _dist(V, {4: 1.0})
    target_probs[2, 2] = _dist(V, {12: 1.0})
    # Row 3: 4 accepted, then its children 6 (0.2 < 0.5, S = 0.8) and 7 (0.2 >= 0.2 * 0.8); the
    # bonus after node 2 is 33.
    target_probs[3, 0] = _dist(V, {4: 1.0})
    target_probs[3, 1] = _dist(V, {6: 0.2, 7: 0.2, 20: 0.6})
    target_probs[3, 3] = _dist(V, {33: 1.0})
    # Row 4: no drafts: a plain sample, one-hot at 30.
    target_probs[4, 0] = _dist(V, {30: 1.0})
    return Case(
        "tree_rejection_sample",
        (draft_ids, parents, _ids([2, 2, 2, 3, 0]), target_probs, uniform, exp_noise),
        expected=(
            [[5, 11, -1, -1], [8, -1, -1, -1], [4, 12, -1, -1], [4, 7, 33, -1], [30, -1, -1, -1]],
            [1, 0, 1, 2, 0],
            [[1, -1, -1], [-1, -1, -1], [1, -1, -1], [0, 2, -1], [-1, -1, -1]],
        ),
    )


def _random_tree(g: torch.Generator, n: int, K: int, tokens_for) -> tuple[list[int], list[int]]:
    """n nodes (padded to K) with random parents; `tokens_for(parent, count)` gives each sibling
    group its distinct tokens."""
    parents = [int(torch.randint(-1, i, (1,), generator=g)) if i else -1 for i in range(n)]
    tokens = [0] * n
    for par in [-1, *range(n)]:
        kids = [i for i in range(n) if parents[i] == par]
        if not kids:
            continue
        for i, t in zip(kids, tokens_for(par, len(kids))):
            tokens[i] = t
    return tokens + [0] * (K - n), parents + [-1] * (K - n)


def _tree_greedy_random(seed: int, B: int, K: int, num_drafts: list[int]) -> Case:
    """Vocabulary of 5: siblings take distinct tokens, so some child often carries the argmax."""
    g = torch.Generator().manual_seed(seed)
    target_argmax = torch.randint(0, 5, (B, K + 1), generator=g)
    rows = [_random_tree(g, n, K, lambda par, c: torch.randperm(5, generator=g)[:c].tolist())
            for n in num_drafts]
    return Case("tree_greedy_accept", (_ids([r[0] for r in rows]), _ids([r[1] for r in rows]),
                                       _ids(num_drafts), target_argmax))


def _tree_sampling_random(seed: int, B: int, K: int, V: int, num_drafts: list[int], *,
                          chain: bool = False, oov: bool = False) -> Case:
    """Each sibling group's tokens drawn without replacement from the target at its parent's row
    (so accepting and rejecting both happen); `chain`: parents i - 1; `oov`: some tokens past V."""
    g = torch.Generator().manual_seed(seed)
    target_probs = _random_probs(g, (B, K + 1, V), keep=0.5)
    draft_ids, parents = [], []
    for b, n in enumerate(num_drafts):
        def tokens_for(par, c, b=b):
            picked = torch.multinomial(target_probs[b, par + 1] + 1e-3, c, replacement=False, generator=g)
            return [V + int(t) if oov and t % 3 == 0 else int(t) for t in picked]
        if chain:
            toks = [tokens_for(i - 1, 1)[0] for i in range(n)]
            draft_ids.append(toks + [0] * (K - n))
            parents.append(list(range(-1, n - 1)) + [-1] * (K - n))
        else:
            t, p = _random_tree(g, n, K, tokens_for)
            draft_ids.append(t)
            parents.append(p)
    uniform = 1.0 - torch.rand(B, K, generator=g)
    exp_noise = torch.empty(B, V).exponential_(generator=g)
    return Case("tree_rejection_sample", (_ids(draft_ids), _ids(parents), _ids(num_drafts), target_probs,
                                          uniform, exp_noise))


TREE_CASES: dict[str, Case] = {
    "tree_greedy_hand": _tree_hand_greedy(),
    "tree_sample_hand_v37": _tree_hand_sampled(),
    "tree_greedy_random": _tree_greedy_random(31, B=6, K=7, num_drafts=[7, 0, 3, 7, 5, 1]),
    "tree_greedy_k1": _tree_greedy_random(32, B=3, K=1, num_drafts=[1, 0, 1]),
    "tree_greedy_k0": _tree_greedy_random(33, B=2, K=0, num_drafts=[0, 0]),
    "tree_sample_v37": _tree_sampling_random(34, B=6, K=7, V=37, num_drafts=[7, 0, 4, 7, 6, 2]),
    "tree_sample_v1500_two_chunks": _tree_sampling_random(35, B=3, K=6, V=1500, num_drafts=[6, 3, 6]),
    "tree_sample_oov": _tree_sampling_random(36, B=4, K=5, V=37, num_drafts=[5, 5, 2, 4], oov=True),
    "tree_sample_chain": _tree_sampling_random(37, B=4, K=5, V=37, num_drafts=[5, 3, 5, 0], chain=True),
    "tree_sample_k0": _tree_sampling_random(38, B=2, K=0, V=37, num_drafts=[0, 0]),
}


def _run_reference(case: Case) -> tuple[torch.Tensor, ...]:
    return getattr(reference, case.fn)(*case.args)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.expected is not None])
def test_reference_known_answers(name):
    output_ids, num_accepted = _run_reference(CASES[name])
    expected_ids, expected_accepted = CASES[name].expected
    assert output_ids.tolist() == expected_ids
    assert num_accepted.tolist() == expected_accepted


def test_reference_rules_on_bent_cases():
    """Each bent case forces one rule on every draft."""
    _, acc = _run_reference(CASES["sample_all_accepted"])
    assert acc.tolist() == CASES["sample_all_accepted"].args[1].tolist()
    for name in ["sample_p_zero_none_accepted", "sample_q_zero_rejected", "sample_residual_zero"]:
        _, acc = _run_reference(CASES[name])
        assert acc.tolist() == [0, 0, 0, 0], name
    # All-zero residual falls back to p: the recovered token lies in p's support.
    draft_ids, _, _, target_probs, _, _ = CASES["sample_residual_zero"].args
    out, _ = _run_reference(CASES["sample_residual_zero"])
    assert (target_probs[torch.arange(4), 0, out[:, 0]] > 0).all()
    assert (out[:, 0] != draft_ids[:, 0]).all()


def test_reference_committed_layout():
    """For every case: accepted drafts, one extra token, then -1; the extra token is in the
    vocabulary and has positive target probability when sampling."""
    for name, case in CASES.items():
        out, acc = _run_reference(case)
        draft_ids = case.args[0]
        for b in range(out.shape[0]):
            a = int(acc[b])
            assert a <= int(case.args[1][b]), name
            assert out[b, :a].tolist() == draft_ids[b, :a].tolist(), name
            assert out[b, a] >= 0 and (out[b, a + 1 :] == -1).all(), name
            if case.fn == "rejection_sample":
                assert case.args[3][b, a, out[b, a]] > 0, name


def test_random_cases_cover_accept_and_reject():
    accepted, drafted = [], []
    for case in CASES.values():
        _, acc = _run_reference(case)
        accepted += acc.tolist()
        drafted += case.args[1].tolist()
    partial = [a for a, n in zip(accepted, drafted) if 0 < a < n]
    full = [a for a, n in zip(accepted, drafted) if 0 < a == n]
    none = [a for a, n in zip(accepted, drafted) if a == 0 < n]
    assert len(partial) >= 5 and len(full) >= 5 and len(none) >= 5


def test_reference_rejects_bad_arguments():
    case = CASES["sample_v37_sparse_q"]
    draft_ids, num, q, p, u, e = case.args
    with pytest.raises(ValueError, match="outside"):
        reference.rejection_sample(draft_ids, num + 1, q, p, u, e)
    with pytest.raises(ValueError, match="target_probs"):
        reference.rejection_sample(draft_ids, num, q, p.double(), u, e)
    with pytest.raises(ValueError, match="exp_noise"):
        reference.rejection_sample(draft_ids, num, q, p, u, e[:, :-1])


@pytest.mark.parametrize("one_hot", [False, True], ids=["sparse_q", "one_hot_q"])
def test_reference_sampling_follows_target(one_hot):
    """Losslessness: whatever the drafter, the first committed token is distributed as p_0 and the
    bonus token (after an accepted draft) as p_1; the acceptance rate is sum_v min(p_0, q)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    N, V = 20000, 6
    g = torch.Generator().manual_seed(1234)
    p0 = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.05, 0.2])
    p1 = torch.tensor([0.3, 0.0, 0.1, 0.4, 0.2, 0.0])
    target_probs = torch.stack([p0, p1]).expand(N, 2, V).contiguous()
    if one_hot:  # a deterministic drafter: its guess depends on the context (here: the row)
        draft_ids = (torch.arange(N) % V)[:, None]
        draft_probs = None
        acceptance = p0.mean()  # guesses uniform over V, each accepted with probability p_0(x)
    else:
        q = torch.tensor([0.5, 0.3, 0.0, 0.2, 0.0, 0.0])
        draft_ids = torch.multinomial(q.expand(N, V), 1, replacement=True, generator=g)
        draft_probs = q.expand(N, 1, V).contiguous()
        acceptance = torch.minimum(p0, q).sum()
    uniform = torch.rand(N, 1, generator=g)
    exp_noise = torch.empty(N, V).exponential_(generator=g)
    num_drafts = torch.ones(N, dtype=torch.int64)
    out, acc = reference.rejection_sample(
        draft_ids, num_drafts, draft_probs, target_probs, uniform, exp_noise
    )

    assert abs(acc.float().mean() - acceptance) < 0.02  # ~6 standard deviations
    first = torch.bincount(out[:, 0], minlength=V)
    assert _chisquare_pvalue(scipy_stats, first, p0) > 1e-3
    bonus = torch.bincount(out[acc == 1, 1], minlength=V)
    support = p1 > 0
    assert (bonus[~support] == 0).all()
    assert _chisquare_pvalue(scipy_stats, bonus[support], p1[support]) > 1e-3
    assert (out[acc == 0, 1] == -1).all()


def _chisquare_pvalue(
    scipy_stats,
    counts: torch.Tensor,  # [V] int64
    probs: torch.Tensor,  # [V] float32, > 0
) -> float:
    # scipy requires the expected and observed totals to agree to ~1e-8: normalize in float64.
    expected = probs.double() / probs.double().sum() * counts.sum().item()
    return scipy_stats.chisquare(counts.double().numpy(), expected.numpy()).pvalue


@pytest.mark.parametrize("name", [n for n, c in TREE_CASES.items() if c.expected is not None])
def test_tree_reference_known_answers(name):
    got = _run_reference(TREE_CASES[name])
    assert [t.tolist() for t in got] == list(TREE_CASES[name].expected)


def test_tree_reference_path_is_consistent():
    """Every tree case: the committed tokens are the accepted nodes' tokens along a parent chain,
    then one extra token (positive target probability when sampling), then -1."""
    outcomes = []
    for name, case in TREE_CASES.items():
        out, acc, nodes = _run_reference(case)
        draft_ids, parents, num = case.args[0], case.args[1], case.args[2]
        for b in range(out.shape[0]):
            a = int(acc[b])
            path = nodes[b, :a].tolist()
            assert (nodes[b, a:] == -1).all() and all(0 <= i < int(num[b]) for i in path), name
            assert [int(parents[b, i]) for i in path] == [-1, *path][:a], name
            assert out[b, :a].tolist() == [int(draft_ids[b, i]) for i in path], name
            assert out[b, a] >= 0 and (out[b, a + 1:] == -1).all(), name
            if case.fn == "tree_rejection_sample":
                row = path[-1] + 1 if path else 0
                assert case.args[3][b, row, out[b, a]] > 0, name
            outcomes.append((a, int(num[b])))
    assert sum(0 < a for a, n in outcomes) >= 8 and sum(a == 0 < n for a, n in outcomes) >= 3
    assert any(a >= 2 for a, _ in outcomes)


def test_tree_as_chain_equals_chain_kernels():
    """A chain given as a tree (parents i - 1) gets the chain kernels' result, bit for bit, from
    the same random numbers."""
    case = TREE_CASES["tree_sample_chain"]
    draft_ids, parents, num, probs, u, e = case.args
    out, acc, nodes = reference.tree_rejection_sample(*case.args)
    out_c, acc_c = reference.rejection_sample(draft_ids, num, None, probs, u, e)
    assert torch.equal(out, out_c) and torch.equal(acc, acc_c)
    assert acc.tolist() != [0, 0, 0, 0]
    argmax = probs.argmax(-1)
    chain_drafts = torch.where(torch.rand(draft_ids.shape, generator=torch.Generator().manual_seed(3)) < 0.8,
                               argmax[:, :-1], draft_ids)
    out, acc, _ = reference.tree_greedy_accept(chain_drafts, parents, num, argmax)
    out_c, acc_c = reference.greedy_accept(chain_drafts, num, argmax)
    assert torch.equal(out, out_c) and torch.equal(acc, acc_c)


def test_tree_reference_rejects_bad_trees():
    ids = _ids([[1, 2]])
    with pytest.raises(ValueError, match="parent"):
        reference.tree_greedy_accept(ids, _ids([[0, -1]]), _ids([2]), _ids([[1, 2, 3]]))
    with pytest.raises(ValueError, match="repeats token"):
        reference.tree_greedy_accept(_ids([[1, 1]]), _ids([[-1, -1]]), _ids([2]), _ids([[1, 2, 3]]))
    with pytest.raises(ValueError, match="parents"):
        reference.tree_greedy_accept(ids, _ids([[-1]]), _ids([2]), _ids([[1, 2, 3]]))


def test_tree_sampling_follows_target():
    """Losslessness of the sibling rule: with a fixed tree (three guesses after the pending token,
    two after the first of them), the first committed token is distributed as p_0 and the token
    after it, when it is the first guess, as p_1 (the row of node 0)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    N, V = 20000, 6
    g = torch.Generator().manual_seed(4321)
    p0 = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.05, 0.2])
    p1 = torch.tensor([0.3, 0.0, 0.1, 0.4, 0.2, 0.0])
    rest = torch.full((V,), 1.0 / V)
    target_probs = torch.stack([p0, p1, rest, rest, rest, rest]).expand(N, 6, V).contiguous()
    draft_ids = _ids([[2, 0, 4, 3, 1]]).expand(N, 5).contiguous()
    parents = _ids([[-1, -1, -1, 0, 0]]).expand(N, 5).contiguous()
    uniform = 1.0 - torch.rand(N, 5, generator=g)
    exp_noise = torch.empty(N, V).exponential_(generator=g)
    out, acc, nodes = reference.tree_rejection_sample(draft_ids, parents, torch.full((N,), 5), target_probs,
                                                       uniform, exp_noise)
    first = torch.bincount(out[:, 0], minlength=V)
    assert _chisquare_pvalue(scipy_stats, first, p0) > 1e-3
    after = out[out[:, 0] == 2, 1]
    counts = torch.bincount(after, minlength=V)
    support = p1 > 0
    assert (counts[~support] == 0).all()
    assert _chisquare_pvalue(scipy_stats, counts[support], p1[support]) > 1e-3
    # the drafts are accepted as often as the target picks them: p0 over the guesses, then p1(3, 1)
    assert abs((acc >= 1).float().mean() - (p0[2] + p0[0] + p0[4])) < 0.02
    assert abs((acc == 2).float().mean() - p0[2] * (p1[3] + p1[1])) < 0.02


@pytest.fixture(scope="module")
def triton_outputs(tmp_path_factory) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Run every case through the public dispatch with TANDEM_FORCE_TRITON=1 in a child process
    that has TRITON_INTERPRET=1 from its start; inputs travel by file, so they are identical."""
    if importlib.util.find_spec("triton") is None:  # find, not import: triton stays out of here
        pytest.skip("triton is not installed")
    folder = tmp_path_factory.mktemp("triton_verify")
    cases_path, outputs_path = folder / "cases.pt", folder / "outputs.pt"
    torch.save({name: (case.fn, case.args) for name, case in {**CASES, **TREE_CASES}.items()}, cases_path)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("TANDEM_FORCE_TRITON", None)
    child = subprocess.run(
        [sys.executable, __file__, str(cases_path), str(outputs_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-6000:]
    return torch.load(outputs_path)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference(name, triton_outputs):
    expected_ids, expected_accepted = _run_reference(CASES[name])
    output_ids, num_accepted = triton_outputs[name]
    assert output_ids.dtype == num_accepted.dtype == torch.int64
    assert torch.equal(output_ids, expected_ids), (output_ids, expected_ids)
    assert torch.equal(num_accepted, expected_accepted), (num_accepted, expected_accepted)


@pytest.mark.parametrize("name", list(TREE_CASES))
def test_triton_tree_matches_reference(name, triton_outputs):
    expected = _run_reference(TREE_CASES[name])
    got = triton_outputs[name]
    assert len(got) == 3 and all(t.dtype == torch.int64 for t in got)
    for g, e in zip(got, expected):
        assert torch.equal(g, e), (got, expected)


def _child_run_triton(cases_path: str, outputs_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    cases = torch.load(cases_path)
    # CPU tensors take the reference path, which never imports triton.
    kernels.greedy_accept(*cases["greedy_hand"][1])
    assert "tandem.kernels.triton_verify" not in sys.modules
    os.environ["TANDEM_FORCE_TRITON"] = "1"
    outputs = {name: getattr(kernels, fn)(*args) for name, (fn, args) in cases.items()}
    assert "tandem.kernels.triton_verify" in sys.modules
    torch.save(outputs, outputs_path)


if __name__ == "__main__":  # the child process of `triton_outputs`
    _child_run_triton(*sys.argv[1:])
