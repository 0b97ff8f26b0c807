"""One verification step: target logits + a draft -> the committed tokens.

This is where DESIGN.md's lossless rule is applied; the arithmetic itself lives in `tandem.kernels`
(Triton for CUDA tensors, the PyTorch reference for CPU tensors).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem import kernels
from tandem.engine.config import SamplingParams
from tandem.engine.proposers import Draft
from tandem.engine.sampling import adjust_logits, logits_to_probs


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


def verify(
    logits: torch.Tensor,  # [k+1, vocab] target logits at the pending token and each draft
    draft: Draft | None,
    sampling: SamplingParams,
    gen: torch.Generator | None,
    *,
    prompt_ids: Sequence[int] = (),  # for penalties (SamplingParams.adjusts_logits): the context
    generated_ids: Sequence[int] = (),  # and the tokens generated before this step
) -> Verdict:
    tokens = draft.tokens if draft is not None else []
    k = len(tokens)
    # Penalties and logit_bias, row by row with the drafts before each row counted as generated:
    # the rule below then sees at every position the distribution plain decoding would.
    logits = adjust_logits(logits, sampling, prompt_ids, generated_ids, tokens)
    device = logits.device
    draft_ids = torch.tensor([tokens if k else [0]], dtype=torch.long, device=device)  # [1, max(k,1)]
    num_drafts = torch.tensor([k], dtype=torch.long, device=device)  # [1]
    if sampling.greedy:
        target_argmax = logits.argmax(-1)  # [k+1]
        if k == 0:
            return Verdict(tokens=[int(target_argmax[0])], accepted=0, drafted=0)
        out, acc = kernels.greedy_accept(draft_ids, num_drafts, target_argmax.unsqueeze(0))
    else:
        probs = logits_to_probs(logits, sampling)  # [k+1, vocab]
        vocab = probs.shape[-1]
        q = draft.dense_probs(vocab) if (draft is not None and k) else None  # [k, vocab] or None
        # Random numbers come from the request's CPU generator in a fixed order (k uniforms, then one
        # noise row), so a seeded request replays exactly, on any device.
        # 1 - U[0,1) lies in (0, 1]: a draft with p(x) = 0 can never be accepted.
        uniform = (1.0 - torch.rand(1, max(k, 1), generator=gen)).to(device)  # [1, max(k,1)]
        exp_noise = torch.empty(1, vocab).exponential_(generator=gen).to(device)  # [1, vocab]
        if k == 0:
            # No drafts: plain sampling, the same exponential race the kernel uses for the bonus.
            return Verdict(tokens=[int((probs[0] / exp_noise[0]).argmax())], accepted=0, drafted=0)
        q_b = None if q is None else q.to(device).unsqueeze(0)  # [1, k, vocab]
        if probs.shape[0] < k + 1:
            raise ValueError("logits must cover the pending token and every draft")
        out, acc = kernels.rejection_sample(
            draft_ids, num_drafts, q_b, probs.unsqueeze(0), uniform, exp_noise
        )
    a = int(acc[0])
    return Verdict(tokens=[int(t) for t in out[0, : a + 1].tolist()], accepted=a, drafted=k)


def verify_tree(
    logits: torch.Tensor,  # [k+1, vocab] target logits: row 0 after the pending token, row i+1 after node i
    draft: Draft,  # a token tree (draft.parents), deterministic drafts
    sampling: SamplingParams,
    gen: torch.Generator | None,
) -> Verdict:
    """The tree's longest accepted path and one more token (tandem.kernels.tree_*): greedy, the
    target's argmax at every node; sampled, recursive rejection over siblings, lossless. Penalties,
    logit bias, grammars and logprobs need drafts position by position: those generations verify
    chains (Generation never sends them a tree)."""
    k = len(draft.tokens)
    device = logits.device
    if logits.shape[0] < k + 1:
        raise ValueError("logits must cover the pending token and every node")
    draft_ids = torch.tensor([draft.tokens], dtype=torch.long, device=device)  # [1, k]
    parents = torch.tensor([draft.parents], dtype=torch.long, device=device)  # [1, k]
    num_drafts = torch.tensor([k], dtype=torch.long, device=device)  # [1]
    if sampling.greedy:
        out, acc, nodes = kernels.tree_greedy_accept(draft_ids, parents, num_drafts, logits.argmax(-1).unsqueeze(0))
    else:
        probs = logits_to_probs(logits, sampling)  # [k+1, vocab]
        # The same draws, in the same order, as a chain of k drafts: k uniforms, one noise row.
        uniform = (1.0 - torch.rand(1, k, generator=gen)).to(device)  # [1, k]
        exp_noise = torch.empty(1, probs.shape[-1]).exponential_(generator=gen).to(device)  # [1, vocab]
        out, acc, nodes = kernels.tree_rejection_sample(draft_ids, parents, num_drafts, probs.unsqueeze(0),
                                                        uniform, exp_noise)
    a = int(acc[0])
    return Verdict(tokens=[int(t) for t in out[0, : a + 1].tolist()], accepted=a, drafted=k,
                   nodes=[int(i) for i in nodes[0, :a].tolist()])
