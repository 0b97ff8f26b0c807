"""The gateway's tokenizer (tandem.engine.model.tokenizer, loaded without torch) gives every text and
chat the ids that transformers' AutoTokenizer gives, which is what the verifier's tokenizer was
before both tiers loaded the class the model names: a gateway and a verifier never disagree on a
prompt's tokens."""

from __future__ import annotations

import pytest

from tandem.engine.model.tokenizer import apply_chat_template, load_tokenizer
from smollm_fixture import smollm  # noqa: F401 (fixture)
from tandem.services.gateway import tool_calls

CHATS = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write def f(x): return x + 1"},
     {"role": "assistant", "content": "done."}, {"role": "user", "content": "Again, with 2 and ünïcode ✓"}],
]
TEXTS = ["", "plain words", "  leading spaces\nand\ttabs", "emoji 🙂 and 中文", "<|im_start|> looks special"]
TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def compare(path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(path))
    _, ours, _ = load_tokenizer(str(path), progress=False)
    assert len(ours) == len(reference) and ours.eos_token_id == reference.eos_token_id
    for chat in CHATS:
        for prompt in (True, False):
            assert apply_chat_template(ours, chat, add_generation_prompt=prompt) == \
                apply_chat_template(reference, chat, add_generation_prompt=prompt)
    for text in TEXTS:
        for special in (True, False):
            ids = ours(text, add_special_tokens=special)["input_ids"]
            assert ids == reference(text, add_special_tokens=special)["input_ids"]
            assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    support = tool_calls.detect(ours)
    other = tool_calls.detect(reference)
    assert (support.renderer, support.label, support.dialect.name) == (other.renderer, other.label, other.dialect.name)
    assert tool_calls.render(ours, CHATS[0], [TOOL["function"]], apply_chat_template, support) == \
        tool_calls.render(reference, CHATS[0], [TOOL["function"]], apply_chat_template, support)


def test_the_tiny_models_tokenizer(tiny_dir) -> None:
    compare(tiny_dir)


@pytest.mark.slow
def test_the_embedded_models_tokenizer(smollm) -> None:
    compare(smollm.path)
