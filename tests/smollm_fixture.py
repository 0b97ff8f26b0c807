"""Session fixtures for the embedded SmolLM2-135M-Instruct (tests marked `slow`).

Import them into a test module (`from smollm_fixture import smollm, smollm_draft`). The first load
of a fresh machine dequantizes the GGUF into the cache (~20 s), later loads take ~1-3 s.

Threads: the suite runs torch with one thread (conftest). On this 2-core shared machine that is also
the faster choice for SmolLM2: measured on 4 prompts x 48 tokens (plain, n-gram, draft model, HF
generate) 56 s with 1 thread against 82 s with 2, whose runs had 5-10x outliers when a neighbour's
job took a core.
"""

from __future__ import annotations

import copy

import pytest

from tandem.engine.model.loading import LoadedModel, load_model

DRAFT_LAYERS = 4


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    """The embedded default target. Session-scoped: do not mutate it."""
    return load_model("default", progress=False, precision="float32")  # the quantized default: tests/engine/test_quant.py


@pytest.fixture(scope="session")
def smollm_draft(smollm) -> LoadedModel:
    """A real draft model sharing SmolLM2's tokenizer: SmolLM2 cut to its first 4 decoder layers (the
    final norm and LM head kept). It agrees with the full model on few tokens (docs/design.md), which
    makes it a good test of rejection and rollback, not a fast drafter."""
    model = copy.deepcopy(smollm.model)
    model.model.layers = model.model.layers[:DRAFT_LAYERS]
    model.config.num_hidden_layers = DRAFT_LAYERS
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:DRAFT_LAYERS]
    model.eval()
    return LoadedModel(
        model_id=f"{smollm.model_id}-first{DRAFT_LAYERS}", path=smollm.path, model=model, tokenizer=smollm.tokenizer
    )
