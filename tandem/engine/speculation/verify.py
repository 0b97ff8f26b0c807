"""One verification step: target logits + a draft -> the committed tokens, for a whole batch.

This is where docs/design.md's lossless rule is applied; the arithmetic itself lives in `tandem.kernels`
(Triton for CUDA tensors, the PyTorch reference for CPU tensors).

A session describes its step as a `Check` before the forward (its draft, its sampling, its
generator); whoever runs the forward runs the checks. The verifier's step loop runs every row of a
step together (`verify_rows`): each row's logits are turned into what its rule compares against
(argmax, or probabilities after penalties / temperature / top-k / top-p), on the logits' device,
then the rows of each kind go to their kernel in one call over `[B, K]`: greedy chains, sampled
chains, greedy trees, sampled trees. The drafts' ids, proposal probabilities and random numbers are
built on the host and move to the device once per kind per step, and the results come back in one
copy, so a step costs one host sync per kind, not one per session.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from tandem import kernels
from tandem.contract.params import SamplingParams
from tandem.engine.speculation.draft import Draft
from tandem.engine.speculation.sampling import adjust_logits, argmax_rows, exp_noise, logits_to_probs


@dataclass
class Verdict:
    tokens: list[int]  # committed this step: accepted drafts, then one recovered or bonus token
    accepted: int  # drafts accepted (len(tokens) - 1)
    drafted: int
    nodes: list[int] | None = None  # a tree's accepted path (node indices); None for a chain

    @property
    def bonus(self) -> bool:
        """True when every draft was accepted, so the last token came from the position after them."""
        return self.accepted == self.drafted


@dataclass
class Check:
    """One row's verification, described by its session before the forward and run after it by
    whoever ran the forward (`verify_rows`); the outcome lands in `verdict` or `error`.

    Penalties and logit_bias are applied row by row with the drafts before each row counted as
    generated, and a grammar's `mask` before anything else: the rule then sees at every position the
    distribution plain decoding would. A tree (draft.parents) takes deterministic drafts and no
    penalties, bias or grammar (Generation never sends it one with those)."""

    draft: Draft | None
    sampling: SamplingParams
    gen: torch.Generator | None  # the request's CPU generator (sampled rows)
    prompt_ids: Sequence[int] = ()  # for penalties (SamplingParams.adjusts_logits): the context
    generated_ids: Sequence[int] = ()  # and the tokens generated before this step
    mask: Callable[[torch.Tensor], torch.Tensor] | None = None  # a grammar's: refused tokens to -inf
    verdict: Verdict | None = None
    error: BaseException | None = None

    @property
    def tokens(self) -> list[int]:
        return self.draft.tokens if self.draft is not None else []

    @property
    def tree(self) -> bool:
        """A token tree with a branch (a chain given as a tree is verified as a chain)."""
        return self.draft is not None and self.draft.is_tree

    @property
    def kind(self) -> tuple[bool, bool]:
        """(sampled, tree): rows of one kind share a kernel call."""
        return (not self.sampling.greedy, self.tree)

    def result(self) -> Verdict:
        if self.error is not None:
            raise self.error
        if self.verdict is None:
            raise RuntimeError("the check was not run")
        return self.verdict


@dataclass
class _Row:
    """A check's kernel inputs for one step (`_prepare`)."""

    check: Check
    target: torch.Tensor  # [k+1] int64 argmax (greedy) or [k+1, V] float32 probabilities, on the device
    q: torch.Tensor | None = None  # [k, V] float32 on the host: a sampling drafter's proposal
    uniform: torch.Tensor | None = None  # [max(k, 1)] float32 on the host
    noise: torch.Tensor | None = None  # [V] float32 on the host


def _prepare(check: Check, logits: torch.Tensor) -> _Row:
    """logits `# [k+1, vocab]` -> the row's kernel inputs; random numbers from the request's
    generator in a fixed order (k uniforms, then one noise row), so a seeded request replays
    exactly, on any device and in any batch."""
    tokens = check.tokens
    k = len(tokens)
    if logits.shape[0] < k + 1:
        raise ValueError(f"logits must cover the pending token and every draft: {logits.shape[0]} rows for {k} drafts")
    logits = logits[: k + 1]
    if check.mask is not None:
        logits = check.mask(logits)
    if not check.tree:
        logits = adjust_logits(logits, check.sampling, check.prompt_ids, check.generated_ids, tokens)
    if check.sampling.greedy:
        return _Row(check, argmax_rows(logits))
    probs = logits_to_probs(logits, check.sampling)  # [k+1, vocab]
    vocab = probs.shape[-1]
    q = check.draft.dense_probs(vocab) if (k and not check.tree) else None  # [k, vocab] or None
    # 1 - U[0,1) lies in (0, 1]: a draft with p(x) = 0 can never be accepted.
    uniform = 1.0 - torch.rand(max(k, 1), generator=check.gen)  # [max(k,1)]
    noise = exp_noise(vocab, check.gen)  # [vocab]
    return _Row(check, probs, q=q, uniform=uniform, noise=noise)


def verify_rows(checks: list[Check], logits: list[torch.Tensor]) -> None:
    """Run every check on its row's logits (`# [k_b+1, vocab]` each, one device): one kernel call
    per kind of row. Each check gets its verdict or its error; one row's fault (a draft that does
    not fit its logits) fails that row alone, a kernel's fault the rows of that call."""
    groups: dict[tuple[bool, bool], list[_Row]] = {}
    for check, row_logits in zip(checks, logits, strict=True):
        try:
            groups.setdefault(check.kind, []).append(_prepare(check, row_logits))
        except Exception as exc:
            check.error = exc
    for (sampled, tree), rows in groups.items():
        try:
            _run_kind(rows, sampled, tree)
        except Exception as exc:
            for row in rows:
                row.check.error = exc


def _run_kind(rows: list[_Row], sampled: bool, tree: bool) -> None:
    device = rows[0].target.device
    B = len(rows)
    K = max(1, max(len(r.check.tokens) for r in rows))
    # Host-built integer inputs, padded to [B, K]: entries past num_drafts are never read.
    draft_ids = torch.zeros(B, K, dtype=torch.long)
    parents = torch.full((B, K), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        n = len(r.check.tokens)
        draft_ids[b, :n] = torch.tensor(r.check.tokens, dtype=torch.long)
        if tree:
            parents[b, :n] = torch.tensor(r.check.draft.parents, dtype=torch.long)
    num_drafts = torch.tensor([len(r.check.tokens) for r in rows], dtype=torch.long)
    draft_ids, num_drafts = draft_ids.to(device), num_drafts.to(device)
    target = _pad([r.target for r in rows], K + 1)  # [B, K+1] or [B, K+1, V], on the device
    nodes = None
    if not sampled:
        if tree:
            out, acc, nodes = kernels.tree_greedy_accept(draft_ids, parents.to(device), num_drafts, target)
        else:
            out, acc = kernels.greedy_accept(draft_ids, num_drafts, target)
    else:
        vocab = target.shape[-1]
        uniform = torch.ones(B, K)
        for b, r in enumerate(rows):
            uniform[b, : r.uniform.shape[0]] = r.uniform
        noise = torch.stack([r.noise for r in rows]).to(device)  # [B, V]
        uniform = uniform.to(device)  # [B, K]
        if tree:
            out, acc, nodes = kernels.tree_rejection_sample(draft_ids, parents.to(device), num_drafts, target,
                                                            uniform, noise)
        else:
            q = None
            if any(r.q is not None for r in rows):
                # One call for rows with and without a proposal distribution: a deterministic row's
                # q is one-hot at its drafts, exactly what the kernel assumes for q = None.
                q = torch.zeros(B, K, vocab)
                for b, r in enumerate(rows):
                    if r.q is not None:
                        q[b, : r.q.shape[0]] = r.q
                    else:
                        for i, tok in enumerate(r.check.tokens):
                            if 0 <= tok < vocab:
                                q[b, i, tok] = 1.0
                q = q.to(device)  # [B, K, V]
            out, acc = kernels.rejection_sample(draft_ids, num_drafts, q, target, uniform, noise)
    # One copy back per kind: the step's only host sync for verification.
    out_l, acc_l = out.cpu().tolist(), acc.cpu().tolist()
    nodes_l = nodes.cpu().tolist() if nodes is not None else None
    for b, r in enumerate(rows):
        a = int(acc_l[b])
        r.check.verdict = Verdict(tokens=out_l[b][: a + 1], accepted=a, drafted=len(r.check.tokens),
                                  nodes=nodes_l[b][:a] if nodes_l is not None else None)


def _pad(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    """Stack rows `# [n_b, ...]` (n_b <= length) into `# [B, length, ...]`, zero-padded, on their device."""
    out = pad_sequence(rows, batch_first=True)
    if out.shape[1] < length:
        pad = [0, 0] * (out.dim() - 2) + [0, length - out.shape[1]]
        out = torch.nn.functional.pad(out, pad)
    return out

