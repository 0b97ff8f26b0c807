"""Independent oracles the tests compare the engine against."""

from __future__ import annotations

import torch


def plain_generate(model: torch.nn.Module, context_ids: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """Greedy decoding with Hugging Face `generate`: an independent oracle for the tests."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([context_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=sorted(eos) or None,
            pad_token_id=0,
        )
    toks = out[0, len(context_ids) :].tolist()
    for i, t in enumerate(toks):
        if t in eos:
            return toks[:i]
    return toks

