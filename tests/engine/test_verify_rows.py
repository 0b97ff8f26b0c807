"""Batched verification (tandem.engine.speculation.verify.verify_rows): every row of a step in one kernel call
per kind, each row's outcome exactly what verifying it alone gives (random draws included)."""

from __future__ import annotations

import pytest
import torch

from tandem import kernels
from tandem.contract.params import SamplingParams
from tandem.engine.speculation.draft import Draft
from tandem.engine.speculation.sampling import make_generator
from tandem.engine.speculation.verify import Check, verify_rows

V = 64
GREEDY = SamplingParams(max_new_tokens=8)
WARM = SamplingParams(max_new_tokens=8, temperature=0.9, top_k=40)
PENALIZED = SamplingParams(max_new_tokens=8, temperature=0.7, presence_penalty=0.5, repetition_penalty=1.3)


def _q(k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    support = torch.stack([torch.randperm(V, generator=g)[:4] for _ in range(k)])  # [k, 4]
    probs = torch.rand(k, 4, generator=g) + 0.05
    return support, probs / probs.sum(-1, keepdim=True)


def _rows() -> list[tuple[Draft | None, SamplingParams, int | None, dict]]:
    """(draft, sampling, seed, extra Check fields): every kind, plain rows and padding lengths."""
    sup, sp = _q(3, 11)
    return [
        (Draft([5, 9, 3], "ngram"), GREEDY, None, {}),
        (None, GREEDY, None, {}),
        (Draft([7], "ngram"), GREEDY, None, {"prompt_ids": [1, 2], "generated_ids": [7]}),
        (Draft([4, 8, 15, 16, 23], "ngram"), WARM, 1, {}),
        (Draft(sup[:, 0].tolist(), "model", support=sup, support_probs=sp), WARM, 2, {}),
        (None, WARM, 3, {}),
        (Draft([30, 31], "ngram"), PENALIZED, 4, {"prompt_ids": [30, 5], "generated_ids": [31, 31]}),
        (Draft([10, 11, 12, 13], "suffix", parents=[-1, -1, 0, 1]), GREEDY, None, {}),
        (Draft([20, 21, 22], "suffix", parents=[-1, 0, -1]), WARM, 5, {}),
        (Draft([40, 41, 42], "suffix", parents=[-1, 0, 1]), WARM, 6, {}),  # a chain given as a tree
    ]


def _checks(rows) -> list[Check]:
    return [Check(d, s, make_generator(seed) if seed is not None else None, **extra) for d, s, seed, extra in rows]


def _logits(rows, seed: int = 0, boost: float = 30.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for r, (d, _, _, _) in enumerate(rows):
        k = len(d.tokens) if d is not None else 0
        lg = torch.randn(k + 1, V, generator=g) * 1.5
        if d is not None:  # make drafts likely: every one in even rows (a bonus token), half in odd
            for i, tok in enumerate(d.tokens[: k if r % 2 == 0 else (k + 1) // 2]):
                lg[i, tok] += boost
        out.append(lg)
    return out


@pytest.mark.parametrize("seed,boost", [(0, 30.0), (1, 4.0), (2, 5.0), (3, 5.0), (4, 6.0)])
def test_a_batch_gives_each_row_what_it_gets_alone_in_one_kernel_call_per_kind(monkeypatch, seed, boost):
    """Strong boosts: whole blocks accepted (bonus tokens beside padding); mild ones: the uniforms
    and the noise decide, so a row given another row's draws would come out otherwise."""
    rows, logits = _rows(), _logits(_rows(), seed, boost)
    alone = _checks(rows)
    for c, lg in zip(alone, logits):
        verify_rows([c], [lg])
    calls: dict[str, list[int]] = {}
    for name in ("greedy_accept", "rejection_sample", "tree_greedy_accept", "tree_rejection_sample"):
        real = getattr(kernels, name)

        def spy(*args, _real=real, _name=name):
            calls.setdefault(_name, []).append(args[0].shape[0])  # B of draft_ids [B, K]
            return _real(*args)

        monkeypatch.setattr(kernels, name, spy)
    batch = _checks(rows)
    verify_rows(batch, logits)
    assert calls == {"greedy_accept": [3], "rejection_sample": [5], "tree_greedy_accept": [1],
                     "tree_rejection_sample": [1]}
    accepted, bonus = set(), 0
    for i, (a, b) in enumerate(zip(alone, batch)):
        assert a.error is None and b.error is None, (i, a.error, b.error)
        assert b.verdict == a.verdict, i
        assert len(b.verdict.tokens) == b.verdict.accepted + 1
        accepted.add(b.verdict.accepted)
        bonus += b.verdict.bonus and b.verdict.drafted > 0
    assert len(accepted) > 1, "rows accepted different lengths (padding was exercised)"
    if boost > 10:
        assert bonus >= 4, "whole blocks were accepted"
    # The generators moved alike: the next draws agree too.
    for a, b in zip(alone, batch):
        if a.gen is not None:
            assert torch.equal(torch.rand(3, generator=a.gen), torch.rand(3, generator=b.gen))


def test_one_rows_fault_is_its_own():
    """A draft its logits do not cover fails that row; the step's other rows are verified."""
    rows = _rows()[:4]
    logits = _logits(rows)
    logits[0] = logits[0][:2]  # 3 drafts need 4 rows of logits
    checks = _checks(rows)
    verify_rows(checks, logits)
    assert isinstance(checks[0].error, ValueError) and "cover" in str(checks[0].error)
    with pytest.raises(ValueError):
        checks[0].result()
    assert all(c.error is None and c.verdict is not None for c in checks[1:])


def test_greedy_rows_commit_the_targets_argmax_path():
    """A can-fail check of the semantics through the batch: greedy rows commit the accepted prefix
    of drafts equal to the argmax, then the argmax itself."""
    rows = [r for r in _rows() if r[1] is GREEDY and (r[0] is None or r[0].parents is None)]
    logits = _logits(rows)
    checks = _checks(rows)
    verify_rows(checks, logits)
    for c, lg in zip(checks, logits):
        want, am = [], lg.argmax(-1).tolist()
        for i, tok in enumerate(c.tokens):
            if tok != am[i]:
                break
            want.append(tok)
        want.append(am[len(want)])
        assert c.verdict.tokens == want
