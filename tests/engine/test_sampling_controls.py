"""Sampling controls inside verification: logit_bias, presence / frequency / repetition penalties and
min-p. Each drafted position must see exactly the distribution plain decoding would see there, so:

- `adjust_logits` equals a plain per-row loop written from the definitions (drafts before a row
  count as generated);
- greedy speculation (prompt lookup and a draft model) equals plain decoding token for token with
  every control on, and the controls do change the output (so the equality is not vacuous);
- sampled speculation with penalties and a bias follows the penalised target distribution
  (chi-square against probabilities computed from the model's logits by hand).
"""

from __future__ import annotations

import random

import pytest
import torch

from tandem.contract.params import SamplingParams, SpecConfig
from tandem.engine.scheduler.generate import Engine
from tandem.engine.speculation.sampling import adjust_logits, argmax_rows, logits_to_probs

from test_engine import DRAWS, P_MIN, chi_square_p_values, full_logits, run_draws  # noqa: F401 (fixtures below)
from test_engine import contexts, near, sharp, sampling_context  # noqa: F401

CONTROLS = dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3,
                logit_bias=((5, 2.0), (17, -100.0)))


def _reference_adjust(logits, params, prompt, generated, drafts):
    """Row by row, token by token, from the definitions."""
    out = logits.clone().double()
    n, vocab = out.shape
    for i in range(n):
        history = list(generated) + list(drafts[:i])
        for tok, bias in params.logit_bias:
            out[i, tok] += bias
        for tok in set(history):
            c = history.count(tok)
            out[i, tok] -= params.frequency_penalty * c + params.presence_penalty
        for tok in set(history) | set(prompt):
            x = out[i, tok]
            out[i, tok] = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
    return out.float()


def test_adjust_logits_equals_the_definition_row_by_row():
    torch.manual_seed(0)
    vocab = 40
    params = SamplingParams(**CONTROLS)
    prompt, generated, drafts = [1, 2, 3, 5], [7, 7, 9], [7, 11, 5]
    logits = torch.randn(len(drafts) + 1, vocab) * 3
    got = adjust_logits(logits, params, prompt, generated, drafts)
    torch.testing.assert_close(got, _reference_adjust(logits, params, prompt, generated, drafts), atol=1e-5, rtol=1e-5)
    assert adjust_logits(logits, SamplingParams(), prompt, generated, drafts) is logits  # nothing to adjust


def test_min_p_keeps_tokens_near_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, min_p=0.2))  # threshold 0.1
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.3, 0.12, 0.0]]) / 0.92)
    assert logits_to_probs(logits, SamplingParams(temperature=1.0, min_p=1.0))[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_sampling_params_refuse_bad_controls():
    for bad in (dict(presence_penalty=3), dict(frequency_penalty=float("nan")), dict(repetition_penalty=0),
                dict(logit_bias=((1, 101.0),)), dict(logit_bias=((-1, 1.0),)), dict(min_p=1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# Strong penalties make prompt lookup useless (it drafts repeats, which they push down), so its cases
# use milder ones under which copies are still accepted; the draft model gets all of them at once.
MILD = [dict(frequency_penalty=0.1, logit_bias=((5, 2.0), (17, -100.0))),
        dict(presence_penalty=0.2, logit_bias=((5, 2.0),)),
        dict(repetition_penalty=1.1)]


@pytest.mark.parametrize("strategy,controls", [("ngram", c) for c in MILD] + [("model", CONTROLS)])
def test_greedy_speculation_with_controls_equals_plain_decoding(strategy, controls, sharp, near, contexts):
    engine = Engine(sharp, near)
    greedy = SamplingParams(max_new_tokens=40, ignore_eos=True, **controls)
    changed = accepted = 0
    for name, ctx in contexts.items():
        plain = engine.generate(ctx, greedy, SpecConfig(strategy="none")).token_ids
        for max_draft in (1, 4, 8):
            res = engine.generate(ctx, greedy, SpecConfig(strategy=strategy, adaptive=False, max_draft_tokens=max_draft))
            assert res.token_ids == plain, f"{strategy}/{name}/k={max_draft}"
            accepted += res.stats.accepted
        without = engine.generate(ctx, SamplingParams(max_new_tokens=40, ignore_eos=True), SpecConfig(strategy="none"))
        changed += without.token_ids != plain
    assert changed >= 2, "the controls must change the output, or this test proves nothing"
    assert accepted > 0, "drafts must have been accepted under the penalties"


def _exact_first_two(model, ctx, params, top_k):
    """p(t1) and p(t1) p(t2 | t1) with the controls applied by hand (t1 counts as generated for t2)."""

    def dist(ids, generated):
        logits = full_logits(model, ids)[-1:].double()
        logits = _reference_adjust(logits, params, ctx, generated, []).double()[0]
        top = logits.topk(top_k)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()))

    p1 = dist(ctx, [])
    joint = {(t1, t2): a * b for t1, a in p1.items() for t2, b in dist(ctx + [t1], [t1]).items()}
    return p1, joint


@pytest.mark.slow
def test_sampled_speculation_with_penalties_follows_the_penalised_target(sharp, near, sampling_context):
    ctx = sampling_context
    controls = dict(frequency_penalty=1.5, presence_penalty=0.5, logit_bias=((ctx[-1], 1.0),))
    spec = SpecConfig(strategy="model", adaptive=False, max_draft_tokens=4)
    firsts, pairs, (drafted, accepted, _) = run_draws(Engine(sharp, near), ctx, spec, DRAWS, **controls)
    assert drafted >= DRAWS and 0 < accepted < drafted
    p1, joint = _exact_first_two(sharp.model, ctx, SamplingParams(**controls), 4)
    p_first, p_joint = chi_square_p_values(firsts, pairs, p1, joint)
    assert p_first > P_MIN and p_joint > P_MIN, (p_first, p_joint)


# -- stop strings ----------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["none", "ngram", "model"])
def test_stop_strings_end_at_the_token_that_completes_them(strategy, sharp, near, contexts, tiny_tokenizer):
    """A stop string spanning a token boundary ends generation at the token completing it, the same
    token with speculation as without."""
    engine = Engine(sharp, near)
    free = SamplingParams(max_new_tokens=40, ignore_eos=True)
    spec = SpecConfig(strategy=strategy, adaptive=False, max_draft_tokens=4)
    checked = 0
    for name, ctx in contexts.items():
        full = engine.generate(ctx, free, SpecConfig(strategy="none")).token_ids
        text = tiny_tokenizer.decode(full, skip_special_tokens=True)
        words = text.split(" ")
        if len(words) < 8:
            continue
        stop = f"{words[4][-2:]} {words[5][:2]}"  # across a token boundary, cut inside both words
        first = text.find(stop)
        res = engine.generate(ctx, free.model_copy(update={"stop": (stop,)}), spec)
        assert res.finish_reason.value == "stop", name
        done = tiny_tokenizer.decode(res.token_ids, skip_special_tokens=True)
        before = tiny_tokenizer.decode(res.token_ids[:-1], skip_special_tokens=True)
        assert stop in done and stop not in before, (name, stop, done)  # the completing token is the last
        assert res.token_ids == full[: len(res.token_ids)] and done.find(stop) == first
        checked += 1
    assert checked >= 3


def test_text_cut_applies_stop_strings_whatever_the_chunking():
    from tandem.services.gateway.core import TextCut

    rng = random.Random(3)
    text = "the answer is 42. The answer is forty-two! And so on."
    for stops in [("answer is f",), ("!", "zzz"), ("so on.",), ("nowhere",), ("42. The", "is")]:
        firsts = [text.find(s) for s in stops if s in text]
        expected = text[: min(firsts)] if firsts else text
        for _ in range(50):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 10)))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            cut = TextCut(stops)
            out = "".join(cut.push(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces))
            assert out == expected, (stops, pieces)
            # Nothing streamed ever held a piece of text beyond what the final answer shows.


# -- logprobs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["none", "ngram", "model"])
def test_logprobs_are_the_targets_at_each_committed_position(strategy, sharp, near, contexts):
    """Each token's logprob and alternatives equal the model's own log-softmax at its position (one
    full forward over the sequence, no cache: the oracle), whichever way the token was committed."""
    engine = Engine(sharp, near)
    sampling = SamplingParams(max_new_tokens=24, ignore_eos=True, top_logprobs=3)
    for name, ctx in list(contexts.items())[:3]:
        gen = engine.start(ctx, sampling, SpecConfig(strategy=strategy, adaptive=False, max_draft_tokens=4))
        items = [lp for step in gen for lp in step.logprobs]
        tokens = gen.result().token_ids
        assert [t.token for t in items] == tokens
        oracle = torch.log_softmax(full_logits(sharp.model, ctx + tokens)[len(ctx) - 1: -1], -1)  # [n, vocab]
        for i, t in enumerate(items):
            assert t.logprob == pytest.approx(float(oracle[i, t.token]), abs=1e-4), (name, i)
            top = oracle[i].topk(3)
            assert [a for a, _ in t.top] == top.indices.tolist(), (name, i)
            assert [b for _, b in t.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert engine.generate(ctx, SamplingParams(max_new_tokens=4), SpecConfig(strategy="none")).token_ids  # no logprobs: fine


# -- the drafter is told the controls, to draft better ------------------------------------------------


@pytest.mark.parametrize("reduced_head", [False, True])
def test_a_draft_model_drafts_under_the_requests_bias_and_penalties(reduced_head, sharp, contexts, monkeypatch):
    """The target itself as the draft model (float weights): with the request's logit_bias and
    penalties applied to its own logits too, every draft is what the penalised target picks, so all
    are accepted; drafting from the raw logits (the adjustment switched off) loses drafts to the
    penalties, and a banned id is then proposed. Output is plain decoding's either way (only speed
    depends on the drafter). A reduced LM head (`tandem distill`'s) maps its rows the same way."""
    import copy

    from tandem.engine.model.loading import LoadedModel
    from tandem.engine.speculation import proposers

    draft = sharp
    if reduced_head:  # the whole vocabulary, as a permuted head: each row stands for head_vocab[row]
        model = copy.deepcopy(sharp.model)
        perm = torch.randperm(sharp.vocab_size, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            head = model.get_output_embeddings()
            head.weight = torch.nn.Parameter(head.weight[perm].clone())
        draft = LoadedModel(model_id="permuted", path="", model=model, tokenizer=sharp.tokenizer, head_vocab=perm)
    ctx = contexts["code"]
    plain = Engine(sharp).generate(ctx, SamplingParams(max_new_tokens=40, ignore_eos=True), SpecConfig(strategy="none"))
    banned = plain.token_ids[3]  # a token plain decoding writes, banned below
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, frequency_penalty=0.8, presence_penalty=0.3,
                            repetition_penalty=1.2, logit_bias=((banned, -100.0),))
    spec = SpecConfig(strategy="model", adaptive=False, max_draft_tokens=4)
    target_only = Engine(sharp).generate(ctx, params, SpecConfig(strategy="none")).token_ids
    assert target_only != plain.token_ids and banned not in target_only  # the controls matter here

    proposed: list[int] = []
    original = proposers.DraftModelProposer.propose

    def recording(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        proposed.extend(out.tokens)
        return out

    monkeypatch.setattr(proposers.DraftModelProposer, "propose", recording)
    engine = Engine(sharp, draft)
    engine.factory.draft_int8 = False
    told = engine.generate(ctx, params, spec)
    assert told.token_ids == target_only
    assert told.stats.drafted > 0 and told.stats.accepted == told.stats.drafted and banned not in proposed

    proposed.clear()
    monkeypatch.setattr(proposers.DraftModelProposer, "_adjusted", lambda self, logits, *a: logits)
    untold = engine.generate(ctx, params, spec)
    assert untold.token_ids == target_only
    assert untold.stats.accepted < untold.stats.drafted and banned in proposed


def test_the_greedy_token_is_torchs_argmax_on_ties_nans_and_infinities() -> None:
    """argmax_rows (numpy on the CPU, for speed) picks the index torch.argmax picks: the first maximal
    value, a NaN counting as the maximum; rows and single vectors; many ties (small integers)."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        n, vocab = 1 + trial % 5, (7, 100, 49152)[trial % 3]
        x = torch.randint(-3, 3, (n, vocab), generator=gen).float()  # [n, vocab]: ties everywhere
        if trial % 4 == 0:
            x[0, trial % vocab] = float("nan")
        if trial % 7 == 0:
            x[-1, (3 * trial) % vocab] = float("nan")
            x[-1, (5 * trial + 1) % vocab] = float("nan")
        if trial % 11 == 0:
            x[0] = float("-inf")
        got, want = argmax_rows(x), x.argmax(-1)
        assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want), trial
        assert torch.equal(argmax_rows(x[-1]), x[-1].argmax(-1)), trial
        assert torch.equal(argmax_rows(x[:, : vocab // 2 + 1]), x[:, : vocab // 2 + 1].argmax(-1)), trial  # a view
