"""One request, one answer: on the default path a position's logits and KV have the same bits however
it arrives: its prompt prefilled whole, in pieces of any length (chunked prefill under load), one
token at a time, copied from another session's prefix that was computed in other pieces, or batched
beside other sessions' prompt pieces and decode rows.

The reproduction of issue 54: greedy chat output differed under load because a prompt prefilled
whole went through torch's attention (more than 32 rows, or any block on an AVX2 host) while the
same prompt in pieces went through ours, and 8-bit activations then turned last-bit differences
into different tokens. On the old code every check here fails on an AVX2 host, and all but the
one-row ones on an AVX-512 host.
"""

from __future__ import annotations

import pytest
import torch

from tandem.engine.model.backends import NativeBackend
from tandem.engine.model.llama import NativeLlama
from tandem.engine.model.loading import load_model
from tandem.engine.model.tokenizer import apply_chat_template
from tandem.engine.native import attend, quant
from tandem.tools.determinism import system_prompt

needs_kernels = pytest.mark.skipif(
    attend.library() is None or not quant.int8_activations_available(),
    reason="no C compiler or no AVX2 here: the default path is not batch-invariant (docs/history.md)")

SYSTEM = "You are a helpful assistant. Answer clearly and concisely."


@pytest.fixture(scope="module")
def default_target():
    """The embedded SmolLM2 as `tandem up` runs it (precision auto: the GGUF's own quantized model)."""
    loaded = load_model("default", progress=False)
    return loaded, NativeLlama(loaded.model, quantized=loaded.quantized)


def _prompts(tok) -> tuple[list[int], list[int]]:
    """Two chat prompts sharing the system prompt's prefix (as every chat request of a tenant does)."""
    a = apply_chat_template(tok, [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": "Write a short poem about the mountains in winter."}])
    b = apply_chat_template(tok, [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": "Explain what a hash map is, with an example in "
                                                              "Python, and say when a list is the better choice."}])
    return a, b


def _prefill(m: NativeLlama, cache, ids: list[int], pieces: list[int]) -> torch.Tensor:
    """Prefill `ids` in `pieces` (the rest as the last piece); the last position's logits `# [vocab]`."""
    at = 0
    for n in pieces:
        m.forward(ids[at:at + n], cache, all_logits=False)
        at += n
    return m.forward(ids[at:], cache)[-1]


def _decode(m: NativeLlama, cache, first: torch.Tensor, steps: int) -> list[int]:
    out = [int(first.argmax())]
    for _ in range(steps - 1):
        out.append(int(m.forward([out[-1]], cache)[-1].argmax()))
    return out


@needs_kernels
@pytest.mark.slow
def test_a_prompt_gives_the_same_bits_in_any_pieces(default_target) -> None:
    loaded, m = default_target
    assert m.batch_invariant
    ids, _ = _prompts(loaded.tokenizer)
    ref_cache = m.new_cache()
    ref = _prefill(m, ref_cache, ids, [])  # idle: the whole prompt in one forward
    ref_tokens = _decode(m, ref_cache, ref, 24)
    L = len(ids)
    assert L > 33
    for pieces in ([1] * 6, [7], [33], [5, 9, 20], [L - 1], [L // 2, L // 2 - 3]):
        cache = m.new_cache()
        logits = _prefill(m, cache, ids, pieces)
        assert torch.equal(logits, ref), pieces
        assert torch.equal(cache.k[:, :, :L], ref_cache.k[:, :, :L]) and torch.equal(cache.v[:, :, :L], ref_cache.v[:, :, :L])
        assert _decode(m, cache, logits, 24) == ref_tokens, pieces


@needs_kernels
@pytest.mark.slow
def test_a_copied_prefix_and_a_busy_batch_give_the_idle_bits(default_target) -> None:
    """Session b starts from a copy of session a's KV for the shared system prompt (a computed it in
    other pieces), and every forward of b's prefill and decode runs batched beside another
    session's prompt pieces and decode rows: b's tokens and logits equal b alone and idle."""
    loaded, m = default_target
    a_ids, b_ids = _prompts(loaded.tokenizer)
    shared = next(i for i, (x, y) in enumerate(zip(a_ids, b_ids)) if x != y)
    assert shared > 10
    idle_cache = m.new_cache()
    idle = _prefill(m, idle_cache, b_ids, [])
    idle_tokens = _decode(m, idle_cache, idle, 20)

    a_cache = m.new_cache()
    _prefill(m, a_cache, a_ids, [3, 4])  # a's prompt in its own pieces
    b_cache = m.new_cache()
    NativeBackend.copy_prefix(a_cache, b_cache, shared)
    other = m.new_cache()
    noise = list(range(1000, 1400))  # another session's long prompt, fed in pieces beside b
    m.forward(noise[:50], other, all_logits=False)
    rest = b_ids[shared:]
    at, step, logits = 0, 0, None
    while at < len(rest):  # b's prompt rest in pieces of 5, each beside a 37-row piece of the other prompt
        n = min(5, len(rest) - at)
        piece = noise[50 + 37 * step: 50 + 37 * (step + 1)]
        outs = m.forward_batch([(piece, other), (rest[at:at + n], b_cache)], [False, True])
        logits = outs[1][-1]
        at += n
        step += 1
    assert torch.equal(logits, idle)
    tokens = [int(logits.argmax())]
    extra = [m.new_cache() for _ in range(3)]
    for c in extra:
        m.forward([5, 6, 7, 8], c, all_logits=False)
    while len(tokens) < len(idle_tokens):  # b's decode rows beside three other sessions' rows
        outs = m.forward_batch([(c_ids, c) for c_ids, c in zip(([9], [10, 11], [12, 13, 14]), extra)]
                               + [([tokens[-1]], b_cache)])
        tokens.append(int(outs[-1][-1].argmax()))
    assert tokens == idle_tokens


@needs_kernels
@pytest.mark.slow
def test_a_shared_prefix_held_once_gives_the_idle_bits(default_target) -> None:
    """Sessions of one tenant whose system prompt and tool list (here ~700 tokens) are held once
    (llama.KVPrefix: the owner's storage read in place by the others, on the raw layer calls and
    their one call a layer for all blocks): a sharer's prompt rest and decode rows, batched beside
    the owner and a session without a prefix, give the tokens and logits of its context alone."""
    loaded, m = default_target
    assert m.raw_layers
    tok = loaded.tokenizer
    system = system_prompt(40)  # `tandem determinism --tools 40`'s
    a_ids = apply_chat_template(tok, [{"role": "system", "content": system}, {"role": "user", "content": "List /tmp."}])
    b_ids = apply_chat_template(tok, [{"role": "system", "content": system},
                                      {"role": "user", "content": "Read the first lines of /etc/hosts, please."}])
    shared = next(i for i, (x, y) in enumerate(zip(a_ids, b_ids)) if x != y)
    assert shared >= 2 * attend.SPAN
    idle_cache = m.new_cache()
    idle = _prefill(m, idle_cache, b_ids, [])
    idle_tokens = _decode(m, idle_cache, idle, 16)

    a_cache = m.new_cache()
    _prefill(m, a_cache, a_ids, [100, 300])
    b_cache = m.new_cache()
    NativeBackend.copy_prefix(a_cache, b_cache, shared)
    assert b_cache.off == shared // attend.SPAN * attend.SPAN and b_cache.prefix.k.data_ptr() == a_cache.k.data_ptr()
    other = m.new_cache()
    m.forward(list(range(1000, 1040)), other, all_logits=False)
    logits = m.forward_batch([([5], other), (b_ids[shared:], b_cache), ([6], a_cache)])[1][-1]
    assert torch.equal(logits, idle)
    tokens = [int(logits.argmax())]
    while len(tokens) < len(idle_tokens):
        outs = m.forward_batch([([7], other), ([tokens[-1]], b_cache), ([8, 9], a_cache)])
        tokens.append(int(outs[1][-1].argmax()))
    assert tokens == idle_tokens
