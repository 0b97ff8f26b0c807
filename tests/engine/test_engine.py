"""The speculative core on tiny random Llamas: its output must be the target's own.

What is checked is the mathematics of docs/design.md's "Lossless verification":
- greedy: speculative output == plain decoding == Hugging Face `generate`, token for token, for every
  proposer and block-length policy, with drafts that really get accepted (else nothing is tested);
- sampling: the committed tokens follow the target distribution (chi-square against the exact
  distribution computed from the model), and a seeded request replays exactly;
- the pieces under it: KV rollback, prompt lookup, the draft model's proposals, logits -> probs,
  stops, and the block-length controller.

Two model pairs are used. `tiny_loaded` / `tiny_draft_loaded` (conftest) are independent random
models: the draft almost never agrees with the target, and the target's logits are nearly flat. The
module's own `sharp` target is the same random Llama with its LM head scaled up (a peaked, non-uniform
distribution, so a biased sampler shows up in a chi-square test) and `near` is a noisy copy of it (a
draft that agrees often but not always, so both acceptance and rejection paths run).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from scipy.stats import chisquare

from conftest import EOS_ID, make_tiny_llama
from tandem import kernels
from tandem.contract.params import SamplingParams, SpecConfig
from tandem.contract.results import FinishReason
from tandem.engine.model.backends import ForwardCosts
from tandem.engine.model.llama import NativeLlama
from tandem.engine.model.loading import LoadedModel
from tandem.engine.model.tokenizer import apply_chat_template
from tandem.engine.scheduler.generate import Engine
from tandem.engine.scheduler.runner import TargetRunner
from tandem.engine.speculation.adaptive import AcceptanceCounts, BlockLengthController
from tandem.engine.speculation.draft import Draft, Proposer
from tandem.engine.speculation.proposers import DraftModelProposer, NgramProposer
from tandem.engine.speculation.sampling import exp_noise, logits_to_probs, make_generator
from oracle import plain_generate

GREEDY_TOKENS = 40
GREEDY40 = SamplingParams(max_new_tokens=GREEDY_TOKENS)


# --- models and contexts -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharp(tiny_tokenizer) -> LoadedModel:
    """The conftest target's weights with the LM head scaled by 8: top-4 probabilities ~[.42 .29 .15 .14]."""
    model = make_tiny_llama(seed=0, num_layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return LoadedModel(model_id="sharp", path="", model=model, tokenizer=tiny_tokenizer)


@pytest.fixture(scope="module")
def near(sharp) -> LoadedModel:
    """A draft close to `sharp`: every weight matrix perturbed by 20% noise, the head made 1.5x sharper.
    Greedy agreement ~20-40% per token; sampled, its q overlaps the target's p by ~60%."""
    model = copy.deepcopy(sharp.model)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if "norm" not in name:
                w.add_(torch.randn(w.shape, generator=gen) * w.std() * 0.2)
        model.lm_head.weight.mul_(1.5)
    return LoadedModel(model_id="near", path="", model=model, tokenizer=sharp.tokenizer)


def _contexts(tok) -> dict[str, list[int]]:
    ids = lambda text: list(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    rng = random.Random(11)
    return {
        "prose": ids("the cat is on the mat and the dog is in the house"),
        "code": ids(
            "def add ( a , b ) : return a + b \n def sub ( a , b ) : return a - b \n "
            "def mul ( a , b ) : return a * b \n def div ( a , b ) :"
        ),
        "json": ids(
            '{"name": "get", "arguments": {"city": "paris", "day": 1}} '
            '{"name": "get", "arguments": {"city": "rome", "day": 2}} {"name": "get", "arguments": {'
        ),
        "chat": apply_chat_template(tok, [{"role": "user", "content": "write a list of two names"}]),
        "random": [rng.randrange(9, 512) for _ in range(30)],
        "one_token": [1],
    }


@pytest.fixture(scope="module")
def contexts(tiny_tokenizer) -> dict[str, list[int]]:
    return _contexts(tiny_tokenizer)


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits `# [len(ids), vocab]` of one forward over the whole sequence, no cache: the oracle."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def greedy_oracle(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens by full recomputation at every step (no KV cache, no stop token)."""
    ids = list(ids)
    out = []
    for _ in range(n):
        tok = int(full_logits(model, ids)[-1].argmax())
        out.append(tok)
        ids.append(tok)
    return out


_PLAIN: dict[tuple[str, str], list[int]] = {}


def plain_reference(engine: Engine, name: str, ctx: list[int]) -> list[int]:
    """Plain greedy decoding of the target (strategy none), checked against HF `generate` once."""
    key = (engine.target.model_id, name)
    if key not in _PLAIN:
        res = engine.generate(ctx, SamplingParams(max_new_tokens=GREEDY_TOKENS), SpecConfig(strategy="none"))
        assert res.stats.drafted == 0
        assert res.stats.steps == len(res.token_ids) + (res.finish_reason == FinishReason.stop)
        hf = plain_generate(engine.target.model, ctx, GREEDY_TOKENS, set(engine.target.eos_token_ids))
        assert res.token_ids == hf, f"plain decoding differs from HF generate on {name}"
        _PLAIN[key] = res.token_ids
    return _PLAIN[key]


# --- greedy: token-for-token equality ---------------------------------------------------------------

SPECS = {
    "adaptive": dict(max_draft_tokens=8),  # with a fixed cost curve (below): deterministic choices
    "measured": dict(max_draft_tokens=8),  # adaptive on this machine's measured, noisy costs
    "fixed1": dict(adaptive=False, max_draft_tokens=1),
    "fixed4": dict(adaptive=False, max_draft_tokens=4),
    "fixed8": dict(adaptive=False, max_draft_tokens=8),
}
REPETITIVE = ("code", "json")


class CpuCostCurve(ForwardCosts):
    """docs/design.md's measured CPU shape (a block of 9 tokens costs 1.4 single steps), ignoring timings:
    on tiny models, timing noise alone decides whether speculation pays, and a test that asserts drafts
    were accepted must not depend on it."""

    def __init__(self):
        super().__init__()
        self.points = {1: 1.0, 9: 1.4}

    def observe(self, num_tokens: int, seconds: float) -> None:
        pass


def make_engine(spec_name: str, target: LoadedModel, draft: LoadedModel | None = None) -> Engine:
    engine = Engine(target, draft)
    if spec_name == "adaptive":
        engine.runner.costs = CpuCostCurve()
    return engine


@pytest.mark.parametrize("pair", ["tiny", "sharp"])
@pytest.mark.parametrize("spec_name", list(SPECS))
def test_greedy_ngram_equals_plain_decoding(pair, spec_name, request, contexts) -> None:
    target = request.getfixturevalue("tiny_loaded" if pair == "tiny" else "sharp")
    engine = make_engine(spec_name, target)
    spec = SpecConfig(strategy="ngram", **SPECS[spec_name])
    for name, ctx in contexts.items():
        res = engine.generate(ctx, GREEDY40, spec)
        assert res.token_ids == plain_reference(engine, name, ctx), f"{pair}/{spec_name}/{name}"
        st = res.stats
        if res.finish_reason == FinishReason.length:  # committed = steps + accepted, all emitted
            assert st.steps + st.accepted == len(res.token_ids)
        if name in REPETITIVE and spec_name != "measured":
            # Speculation must really happen here, or this test would pass with it switched off.
            assert st.accepted > 0 and st.steps < len(res.token_ids), f"{pair}/{spec_name}/{name}: {st}"
        if not spec.adaptive:
            assert len(st.drafted_by_position) <= spec.max_draft_tokens


@pytest.mark.parametrize("pair", ["tiny", "sharp"])
@pytest.mark.parametrize("spec_name", list(SPECS))
def test_greedy_draft_model_equals_plain_decoding(pair, spec_name, request, contexts) -> None:
    target = request.getfixturevalue("tiny_loaded" if pair == "tiny" else "sharp")
    draft = request.getfixturevalue("tiny_draft_loaded" if pair == "tiny" else "near")
    engine = make_engine(spec_name, target, draft)
    spec = SpecConfig(strategy="model", **SPECS[spec_name])
    accepted = drafted = 0
    for name, ctx in contexts.items():
        res = engine.generate(ctx, GREEDY40, spec)
        assert res.token_ids == plain_reference(engine, name, ctx), f"{pair}/{spec_name}/{name}"
        accepted += res.stats.accepted
        drafted += res.stats.drafted
    if spec_name != "measured":
        assert drafted > 0
        if pair == "sharp":  # the near draft agrees often enough that both outcomes are exercised
            assert 0 < accepted < drafted


def test_greedy_with_a_perfect_drafter_commits_whole_blocks(sharp, contexts) -> None:
    """The draft model == the target: every draft is accepted, so each step commits k + 1 tokens
    (the bonus path at every step) and the output is still the target's."""
    engine = Engine(sharp, sharp, draft_int8=False)  # the draft's exact numbers: it is the target
    ctx = contexts["prose"]
    res = engine.generate(ctx, GREEDY40, SpecConfig(strategy="model", adaptive=False, max_draft_tokens=4))
    assert res.token_ids == plain_reference(engine, "prose", ctx)
    assert res.stats.accepted == res.stats.drafted > 0
    assert res.stats.steps == -(-GREEDY_TOKENS // 5)  # 5 tokens a step, the last step clipped by room


def test_garbage_drafts_never_change_the_output(tiny_loaded, contexts) -> None:
    """A proposer that sends random ids (out-of-range ones are not allowed by the local path, so
    in-range noise) can only cost time."""

    class Noise(Proposer):
        name = "noise"

        def __init__(self):
            self.rng = random.Random(3)

        def propose(self, ids, k, sampling, gen):
            return Draft(tokens=[self.rng.randrange(512) for _ in range(k)], proposer=self.name)

    engine = Engine(tiny_loaded)
    ctx = contexts["prose"]
    spec = SpecConfig(strategy="ngram", adaptive=False, max_draft_tokens=4)
    gen = engine.start(ctx, GREEDY40, spec, proposer=Noise())
    for _ in gen:
        pass
    assert gen.result().token_ids == plain_reference(engine, "prose", ctx)
    assert gen.stats.drafted > 0


# --- the target runner: KV cache, rollback, prefix reuse -------------------------------------------


def test_forward_block_matches_full_recompute_through_commits_and_rollbacks(tiny_loaded, contexts) -> None:
    runner = TargetRunner(tiny_loaded)
    model = tiny_loaded.model
    seq = runner.new_sequence()
    ctx = contexts["prose"]
    seq.set_context(ctx)
    assert seq.cached_len == len(ctx) - 1
    rng = random.Random(0)
    for step in range(12):
        k = rng.randrange(0, 6)
        drafts = [rng.randrange(512) for _ in range(k)]
        logits = seq.forward_block(drafts)  # [k+1, vocab]
        ref = full_logits(model, seq.ids + drafts)[len(seq.ids) - 1 :]
        assert logits.shape == (k + 1, 512)
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4, msg=f"step {step}")
        # Keep a random prefix of the drafts, then one token that differs from the next draft: the KV
        # of the rejected drafts must go.
        a = rng.randrange(0, k + 1)
        extra = int(logits[a].argmax())
        if a < k and extra == drafts[a]:
            extra = (extra + 1) % 512
        seq.commit(drafts[:a] + [extra])
        assert seq.cached_len == len(seq.ids) - 1


def test_rollback_then_continue_equals_never_having_gone_ahead(tiny_loaded, contexts) -> None:
    runner = TargetRunner(tiny_loaded)
    model = tiny_loaded.model
    ctx = contexts["code"]
    seq = runner.new_sequence()
    seq.set_context(ctx)
    rng = random.Random(1)
    for _ in range(6):  # go ahead: several committed multi-token steps
        drafts = [rng.randrange(512) for _ in range(3)]
        seq.forward_block(drafts)
        seq.commit(drafts[:2] + [rng.randrange(512)])
    committed = list(seq.ids)
    drafts = [7, 8, 9]
    for length in sorted({1, 2, len(ctx) - 1, len(ctx), len(ctx) + 4, len(committed) - 1}, reverse=True):
        prefill = seq.set_context(committed[:length])  # back to an earlier committed length
        assert (prefill.reused, prefill.computed) == (length - 1, 0)
        assert seq.cached_len == length - 1
        rolled = seq.forward_block(drafts)
        fresh = runner.new_sequence()
        fresh.set_context(committed[:length])
        never_ahead = fresh.forward_block(drafts)
        torch.testing.assert_close(rolled, never_ahead, atol=1e-4, rtol=1e-4)
        recomputed = full_logits(model, committed[:length] + drafts)[length - 1 :]
        torch.testing.assert_close(rolled, recomputed, atol=1e-4, rtol=1e-4)
        seq.commit([drafts[0]])  # leave the invariant intact for the next, shorter set_context
    # And forward again to the full committed length: only the new tokens are computed.
    prefill = seq.set_context(committed)
    assert prefill.reused == 1  # the loop ended at length 1: one token of KV was resident
    torch.testing.assert_close(seq.forward_block([]), full_logits(model, committed)[-1:], atol=1e-4, rtol=1e-4)


def test_set_context_reuses_the_common_prefix(tiny_loaded, contexts) -> None:
    runner = TargetRunner(tiny_loaded)
    fed: list[int] = []
    forward = runner.forward

    def counting(cache, input_ids, **kw):
        fed.append(len(input_ids))
        return forward(cache, input_ids, **kw)

    runner.forward = counting
    model = tiny_loaded.model
    a = contexts["prose"]
    b = [40, 41, 42, 43, 44]
    seq = runner.new_sequence()

    def check(ctx, reused):
        fed.clear()
        stats = seq.set_context(ctx)
        assert (stats.reused, stats.computed) == (reused, len(ctx) - 1 - reused)
        assert sum(fed) == stats.computed  # the counters describe what really ran
        assert seq.ids == ctx and seq.cached_len == len(ctx) - 1
        torch.testing.assert_close(seq.forward_block([]), full_logits(model, ctx)[-1:], atol=1e-4, rtol=1e-4)

    check(a, 0)
    seq.commit([99])  # one decode step: the reply so far is a + [99], KV resident for all of a
    check(a + [99] + b, len(a))  # the next turn extends the conversation: only its new tokens run
    seq.rollback(len(seq.ids) - 1)  # back to the invariant (cache = ids[:-1]) without committing
    check(a + [99] + b + [7], len(a) + len(b))  # b's last token was pending: it has no KV yet
    seq.rollback(len(seq.ids) - 1)
    diverging = a[:5] + [a[5] + 1] + b
    check(diverging, 5)  # diverges at index 5: roll back to the divergence, recompute from there
    check(diverging, len(diverging) - 1)  # the same again (after a forward): nothing recomputed
    check(diverging[:3], 2)  # a shorter prefix: rollback only
    check([a[0] + 1, *a[1:]], 0)  # differs in the first token: nothing reusable


def test_set_context_refuses_an_empty_context(tiny_loaded) -> None:
    with pytest.raises(ValueError):
        TargetRunner(tiny_loaded).new_sequence().set_context([])


# --- prompt lookup ------------------------------------------------------------------------------------

GREEDY = SamplingParams()


def _ngram(ids, k=8, n_min=1, n_max=4, proposer=None) -> tuple[list[int], int]:
    p = proposer or NgramProposer(n_min, n_max)
    d = p.propose(ids, k, GREEDY, None)
    return d.tokens, d.bucket


def brute_force_ngram(ids: list[int], k: int, n_min: int, n_max: int) -> tuple[list[int], int, int]:
    """(proposal, match length, available) by scanning, as NgramProposer documents its rule: the
    longest suffix of n_max..n_min tokens that occurs earlier (ending before the suffix ends); among
    its CANDIDATES most recent occurrences, the one whose match extends furthest back (up to
    MATCH_CAP tokens), the most recent on ties."""
    n = len(ids)
    for size in range(min(n_max, n - 1), n_min - 1, -1):
        ends = [e for e in range(size, n) if ids[e - size : e] == ids[n - size :]]
        if not ends:
            continue
        best_len, best_end = -1, -1
        for end in reversed(ends[-NgramProposer.CANDIDATES :]):
            length = size
            while length < NgramProposer.MATCH_CAP and end - length - 1 >= 0:
                if ids[end - length - 1] != ids[n - length - 1]:
                    break
                length += 1
            if length > best_len:
                best_len, best_end = length, end
        return ids[best_end : best_end + k], best_len, n - best_end
    return [], 0, 0


def test_ngram_longest_suffix_wins() -> None:
    # [1 2 3] occurred once, long ago; [3 4] occurred more recently than that, more times than the
    # candidates kept per n-gram: looking up 3-grams finds the old occurrence, 2-grams cannot.
    repeats = [3, 4, 5] * (NgramProposer.CANDIDATES + 1)
    ids = [1, 2, 3, 4, 7, *repeats, 1, 2, 3, 4]
    assert _ngram(ids, 3) == ([7, 3, 4], 4)
    assert _ngram(ids, 3, n_max=2) == ([5, 1, 2], 2)  # the most recent [3 4]: none extends further


def test_ngram_longer_match_among_candidates_wins() -> None:
    # [1 2] occurred before 9 and before 8; only the first is preceded by 5, as the suffix is: its
    # match is 3 tokens long, so it wins over the more recent one, and reports length 3.
    ids = [5, 1, 2, 9, 6, 1, 2, 8, 5, 1, 2]
    assert _ngram(ids, 3, n_max=2) == ([9, 6, 1], 3)
    # The measured match length is capped at MATCH_CAP.
    cap = NgramProposer.MATCH_CAP
    ids = list(range(cap + 8)) + [999] + list(range(cap + 8))
    assert _ngram(ids, 2) == ([999, 0], cap)


def test_ngram_most_recent_occurrence_wins() -> None:
    ids = [1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3]
    assert _ngram(ids, 3) == ([8, 1, 2], 3)


def test_ngram_continuation_is_clipped_at_the_end_of_the_context() -> None:
    ids = [4, 5, 6, 4, 5]
    assert _ngram(ids, 8) == ([6, 4, 5], 2)
    p = NgramProposer()
    offer = p.peek(ids)
    assert (offer.proposer, offer.bucket, offer.available) == ("ngram", 2, 3)
    assert _ngram([9, 9], 8) == ([9], 1)  # overlapping occurrence: only what exists is proposed


def test_ngram_never_matches_the_suffix_itself() -> None:
    assert _ngram([1, 2, 3, 4]) == ([], 0)
    assert _ngram([5]) == ([], 0)
    assert NgramProposer().peek([1, 2, 3, 4]).available == 0
    assert _ngram([1, 2, 3], k=0) == ([], 0)


def test_ngram_min_and_max_are_honoured() -> None:
    ids = [1, 2, 9, 5, 2]  # only a 1-gram ([2]) recurs
    assert _ngram(ids, 2, n_min=1) == ([9, 5], 1)
    assert _ngram(ids, 2, n_min=2) == ([], 0)
    # n_max bounds the suffix looked up (the match may then extend further back): with 4, the
    # old [1 2 3 4] is found; with 2, only the recent [3 4]s.
    repeats = [3, 4, 5] * (NgramProposer.CANDIDATES + 1)
    ids = [1, 2, 3, 4, 7, *repeats, 1, 2, 3, 4]
    assert _ngram(ids, 2, n_max=4) == ([7, 3], 4)
    assert _ngram(ids, 2, n_max=2) == ([5, 1], 2)
    assert _ngram(ids, 2, n_min=3, n_max=3) == ([7, 3], 4)


def test_ngram_index_equals_brute_force_on_random_sequences() -> None:
    """The incremental index against a scan, over seeded random token streams over small alphabets
    (so matches of every length are common). Each stream grows as a decode loop grows it (the same
    list extended in place, and fresh lists), and sometimes diverges: rolled back to an earlier
    length and continued with other tokens, which must not leave stale entries behind."""
    rng = random.Random(1234)
    checks = 0
    for trial in range(60):
        n_min = rng.randint(1, 3)
        n_max = rng.randint(n_min, 5)
        alphabet = rng.randint(2, 5)
        p = NgramProposer(n_min, n_max)
        ids = [rng.randrange(alphabet) for _ in range(rng.randint(1, 6))]
        for _ in range(40):
            r = rng.random()
            if r < 0.5:
                ids.extend(rng.randrange(alphabet) for _ in range(rng.randint(1, 4)))  # in place
            elif r < 0.8:
                ids = ids + [rng.randrange(alphabet) for _ in range(rng.randint(1, 4))]
            else:
                cut = rng.randint(1, len(ids))
                ids = ids[:cut] + [rng.randrange(alphabet) for _ in range(rng.randint(0, len(ids) - cut + 3))]
            k = rng.randint(0, 6)
            want, size, available = brute_force_ngram(ids, k, n_min, n_max)
            if k == 0:
                want = []
            offer = p.peek(ids)
            assert (offer.bucket, offer.available) == (size, available), (trial, ids, n_min, n_max)
            assert _ngram(ids, k, proposer=p) == (want, size), (trial, ids, k, n_min, n_max)
            checks += 1
    assert checks == 60 * 40


def test_ngram_resets_on_a_new_sequence() -> None:
    p = NgramProposer()
    assert _ngram([1, 2, 3, 1, 2], 3, proposer=p) == ([3, 1, 2], 2)
    # An unrelated sequence of the same length with the same first and last tokens.
    assert _ngram([1, 5, 6, 7, 2], 3, proposer=p) == ([], 0)
    assert _ngram([8, 9, 8], 3, proposer=p) == ([9, 8], 1)  # shorter and different


# --- the draft model proposer -----------------------------------------------------------------------


def test_greedy_drafts_are_the_draft_models_own_greedy_continuation(tiny_draft_loaded, contexts) -> None:
    p = DraftModelProposer(tiny_draft_loaded, stop_below=0.0)
    for name in ("prose", "code", "one_token"):
        ids = contexts[name]
        d = p.propose(ids, 6, GREEDY, None)
        assert d.tokens == greedy_oracle(tiny_draft_loaded.model, ids, 6), name
        assert d.support is None and d.proposer == "model"
        assert p.lm.length == len(p._ids)


def test_a_draft_stops_where_the_draft_model_hesitates(tiny_draft_loaded, contexts) -> None:
    """Adaptive drafting stops a block at the first position (after the first) where the draft
    model's probability for its own token is below `stop_below`; the tokens are a prefix of its
    greedy continuation, and the first draft's probability is the block's confidence bucket."""
    from tandem.engine.speculation.draft import confidence_bucket

    ids = contexts["prose"]
    full = greedy_oracle(tiny_draft_loaded.model, ids, 6)
    with torch.inference_mode():
        probs = [float(torch.softmax(tiny_draft_loaded.model(torch.tensor([ids + full[:i]])).logits[0, -1], -1).max())
                 for i in range(6)]
    low = sorted(probs[1:])
    threshold = (low[1] + low[2]) / 2  # stops somewhere inside the block (midway: no float ties)
    d = DraftModelProposer(tiny_draft_loaded, stop_below=threshold).propose(ids, 6, GREEDY, None)
    expected = 1 + next((i for i, p in enumerate(probs[1:]) if p < threshold), 5)
    assert d.tokens == full[:expected] and 1 <= len(d.tokens) < 6
    assert d.bucket == confidence_bucket(probs[0])
    peeked = DraftModelProposer(tiny_draft_loaded, stop_below=0.0)
    assert peeked.peek(ids).bucket == d.bucket  # peek rates the same first draft, and propose reuses it
    assert peeked.propose(ids, 6, GREEDY, None).tokens == full


def test_draft_model_resyncs_after_a_rejection_and_a_rollback(near, contexts) -> None:
    p = DraftModelProposer(near, stop_below=0.0)
    ids = contexts["code"]
    first = p.propose(ids, 5, GREEDY, None)
    # The target accepted one draft and recovered another token: the proposer must drop the rest.
    committed = ids + first.tokens[:1] + [(first.tokens[1] + 1) % 512]
    again = p.propose(committed, 5, GREEDY, None)
    assert again.tokens == greedy_oracle(near.model, committed, 5)
    assert again.tokens == DraftModelProposer(near, stop_below=0.0).propose(committed, 5, GREEDY, None).tokens
    assert p.lm.length == len(p._ids)
    # A new, shorter context diverging early (a new conversation reusing the proposer).
    other = ids[:3] + [17, 18]
    assert p.propose(other, 4, GREEDY, None).tokens == greedy_oracle(near.model, other, 4)
    assert p.lm.length == len(p._ids) == len(other) + 3


def test_a_draft_model_reads_only_the_last_context_tokens_and_stays_bounded(near, contexts) -> None:
    """With `context` W a draft starts on the last W tokens of a longer context (its drafts are
    the draft model's own greedy continuation of those W alone), follows commits incrementally,
    and starts over on the last W once its cache would pass REWINDOW x W: its cost per session
    does not grow with the prompt."""
    W = 8
    p = DraftModelProposer(near, stop_below=0.0, context=W, int8=False)  # exact numbers: the oracle is float
    ids = contexts["code"] + contexts["prose"]
    assert len(ids) > 2 * W
    assert p.propose(ids, 4, GREEDY, None).tokens == greedy_oracle(near.model, ids[-W:], 4)
    assert p.lm.length == W + 3  # the window, then its own drafts but the last
    grown = list(ids)
    for t in range(4 * W):  # commits one token at a time, as decoding does
        grown.append((7 * t + 3) % 500)
        d = p.propose(grown, 3, GREEDY, None)
        assert W <= p.lm.length - 2 <= DraftModelProposer.REWINDOW * W
        assert d.tokens == greedy_oracle(near.model, grown[p._base:], 3)  # what its cache read
    assert p._base > len(ids) - W  # it started over at least once
    # a long catch-up (a new turn with more than W new tokens) starts over too
    turn = grown + contexts["prose"] * 2
    assert p.propose(turn, 2, GREEDY, None).tokens == greedy_oracle(near.model, turn[-W:], 2)
    with pytest.raises(ValueError, match="context"):
        DraftModelProposer(near, context=0)


def test_greedy_with_a_short_draft_window_equals_plain_decoding(tiny_loaded, tiny_draft_loaded, contexts) -> None:
    engine = make_engine("adaptive", tiny_loaded, tiny_draft_loaded)
    spec = SpecConfig(strategy="model", max_draft_tokens=4)
    drafted = 0
    for name, ctx in contexts.items():
        proposer = DraftModelProposer(tiny_draft_loaded, stop_below=0.0, context=4,
                                      vocab_limit=tiny_loaded.vocab_size)
        gen = engine.start(ctx, GREEDY40, spec, proposer=proposer)
        for _ in gen:
            pass
        res = gen.result()
        assert res.token_ids == plain_reference(engine, name, ctx), name
        drafted += res.stats.drafted
    assert drafted > 0


def test_sampled_drafts_carry_their_exact_proposal_distribution(near, contexts) -> None:
    ids = contexts["prose"]
    sampling = SamplingParams(temperature=0.7)
    # float32 steps: q is compared with the draft's own float32 distribution below
    p = DraftModelProposer(near, draft_top_k=16, stop_below=0.0, int8=False)
    d = p.propose(ids, 4, sampling, make_generator(0))
    assert d.support.shape == (4, 16) and d.support_probs.shape == (4, 16)
    torch.testing.assert_close(d.support_probs.sum(-1), torch.ones(4))
    prefix = list(ids)
    for i, tok in enumerate(d.tokens):
        row = d.support[i].tolist()
        assert tok in row and d.support_probs[i][row.index(tok)] > 0
        # q_i is the draft's own distribution after the drafts before it, truncated to its top 16.
        probs = torch.softmax(full_logits(near.model, prefix)[-1] / 0.7, -1)
        top = probs.topk(16)
        assert set(row) == set(top.indices.tolist())
        dense = d.dense_probs(512)[i]
        torch.testing.assert_close(dense[top.indices], top.values / top.values.sum(), atol=1e-5, rtol=1e-4)
        prefix.append(tok)
    # The same generator state gives the same drafts; another seed other drafts (at least once).
    assert DraftModelProposer(near, stop_below=0.0, int8=False).propose(ids, 4, sampling, make_generator(0)).tokens == d.tokens
    assert any(
        DraftModelProposer(near, stop_below=0.0, int8=False).propose(ids, 4, sampling, make_generator(s)).tokens != d.tokens
        for s in range(1, 6)
    )


# --- sampling: the committed tokens follow the target's distribution --------------------------------

TOP_K = 4
DRAWS = 2000
P_MIN = 1e-3


def exact_first_two(model, ctx: list[int], top_k: int, temperature: float):
    """p(t1) and p(t1) p(t2 | t1) after temperature and top-k, straight from the model's logits
    (independent of `logits_to_probs`)."""

    def dist(ids):
        logits = full_logits(model, ids)[-1].double() / temperature
        top = logits.topk(top_k)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()))

    p1 = dist(ctx)
    joint = {(t1, t2): pr1 * pr2 for t1, pr1 in p1.items() for t2, pr2 in dist(ctx + [t1]).items()}
    return p1, joint


def run_draws(engine: Engine, ctx, spec: SpecConfig, draws: int = DRAWS, **controls):
    """`draws` generations of 3 tokens, one seed each. The seeds come from a seeded RNG, not 0..N-1:
    with the model proposer, seeds 0..1499 alone gave p = 3e-5 for the first token (other blocks of
    consecutive seeds, and random seeds, gave ordinary p-values at 4x the sample), so the test keeps
    to well-mixed seeds and is about the sampler, not about torch's seeding of nearby seeds."""
    firsts, pairs = [], []
    drafted = accepted = recovered = 0
    rng = random.Random(20240601)
    for seed in (rng.getrandbits(62) for _ in range(draws)):
        sampling = SamplingParams(temperature=1.0, top_k=TOP_K, seed=seed, max_new_tokens=3, ignore_eos=True, **controls)
        res = engine.generate(ctx, sampling, spec)
        firsts.append(res.token_ids[0])
        pairs.append(tuple(res.token_ids[:2]))
        drafted += res.stats.drafted
        accepted += res.stats.accepted
        recovered += res.stats.recovered
    return firsts, pairs, (drafted, accepted, recovered)


def chi_square_p_values(firsts, pairs, p1, joint) -> tuple[float, float]:
    assert set(firsts) <= set(p1), f"tokens outside the target's top-{TOP_K}: {set(firsts) - set(p1)}"
    assert set(pairs) <= set(joint), f"pairs outside the target's support: {set(pairs) - set(joint)}"
    n = len(firsts)
    keys1 = sorted(p1)
    obs1 = [firsts.count(t) for t in keys1]
    exp1 = [n * p1[t] for t in keys1]
    keys2 = sorted(joint)
    obs2 = [pairs.count(k) for k in keys2]
    exp2 = [n * joint[k] for k in keys2]
    assert min(exp2) >= 5, "too few expected counts per cell for a chi-square test"
    s1, s2 = sum(exp1), sum(exp2)  # float rounding: make the sums match exactly
    return (
        float(chisquare(obs1, [e * n / s1 for e in exp1]).pvalue),
        float(chisquare(obs2, [e * n / s2 for e in exp2]).pvalue),
    )


@pytest.fixture(scope="module")
def sampling_context(sharp, contexts) -> list[int]:
    """A prefix of the target's own greedy continuation on which prompt lookup drafts the target's
    most likely tokens: so n-gram drafts are accepted with p(x) and rejected with 1 - p(x), both often."""
    ctx = contexts["prose"]
    out = Engine(sharp).generate(ctx, SamplingParams(max_new_tokens=30), SpecConfig(strategy="none")).token_ids
    full = ctx + out
    for end in range(len(ctx) + 4, len(full) - 2):
        tokens, _ = _ngram(full[:end], 2)
        if tokens == full[end : end + 2]:
            return full[:end]
    raise AssertionError("no context where prompt lookup drafts the greedy continuation")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ngram", "suffix", "model"])
def test_sampled_output_follows_the_target_distribution(strategy, sharp, near, sampling_context) -> None:
    ctx = sampling_context
    engine = Engine(sharp, near)
    spec = SpecConfig(strategy=strategy, adaptive=False, max_draft_tokens=4)
    p1, joint = exact_first_two(sharp.model, ctx, TOP_K, 1.0)
    firsts, pairs, (drafted, accepted, recovered) = run_draws(engine, ctx, spec)
    # Every draw speculated; drafts were both accepted and rejected (both paths of the rule ran).
    assert drafted >= DRAWS and 0.1 * drafted < accepted < 0.9 * drafted and recovered > 0.1 * DRAWS
    p_first, p_joint = chi_square_p_values(firsts, pairs, p1, joint)
    assert p_first > P_MIN and p_joint > P_MIN, (p_first, p_joint)


@pytest.mark.slow
def test_plain_sampling_follows_the_target_distribution(sharp, sampling_context) -> None:
    ctx = sampling_context
    p1, joint = exact_first_two(sharp.model, ctx, TOP_K, 1.0)
    firsts, pairs, (drafted, _, _) = run_draws(Engine(sharp), ctx, SpecConfig(strategy="none"), DRAWS // 2)
    assert drafted == 0
    p_first, p_joint = chi_square_p_values(firsts, pairs, p1, joint)
    assert p_first > P_MIN and p_joint > P_MIN, (p_first, p_joint)


@pytest.mark.slow
def test_the_chi_square_test_catches_a_biased_sampler(sharp, near, sampling_context, monkeypatch) -> None:
    """Negative control: the classic bug of drawing the recovered token from p instead of
    norm(max(0, p - q)) must fail the same test, at half its sample size; else the test above has no
    power and could never fail."""

    def recovered_from_p(draft_ids, num_drafts, draft_probs, target_probs, uniform, exp_noise):
        out, acc = kernels.reference.rejection_sample(
            draft_ids, num_drafts, draft_probs, target_probs, uniform, exp_noise
        )
        a = int(acc[0])
        if a < int(num_drafts[0]):
            out[0, a] = int(torch.argmax(target_probs[0, a] / exp_noise[0]))
        return out, acc

    monkeypatch.setattr(kernels, "rejection_sample", recovered_from_p)
    ctx = sampling_context
    p1, joint = exact_first_two(sharp.model, ctx, TOP_K, 1.0)
    spec = SpecConfig(strategy="model", adaptive=False, max_draft_tokens=4)
    firsts, pairs, _ = run_draws(Engine(sharp, near), ctx, spec, DRAWS // 2)
    p_first, p_joint = chi_square_p_values(firsts, pairs, p1, joint)
    assert min(p_first, p_joint) < P_MIN, (p_first, p_joint)


def _tree_draws(engine: Engine, ctx: list[int], draws: int):
    """`draws` sampled generations of 5 tokens (room for a 4-node tree) drafted from a store whose two answers fork at once:
    the target's two likeliest first tokens, each followed by its likeliest second token, so the
    tree has two branches of two. The store holds its answers (never grows): draws stay i.i.d."""
    from tandem.engine.speculation.suffix import SuffixProposer, SuffixStore

    p1, joint = exact_first_two(engine.target.model, ctx, TOP_K, 1.0)
    t1, t2 = sorted(p1, key=p1.get, reverse=True)[:2]
    second = {t: max((b for a, b in joint if a == t), key=lambda b: joint[(t, b)]) for t in (t1, t2)}
    store = SuffixStore()
    store.add(ctx, [t1, second[t1], 11, 12, 13])
    store.add(ctx, [t2, second[t2], 14, 15, 16])
    store.hold()
    spec = SpecConfig(strategy="suffix", adaptive=False, max_draft_tokens=4)
    firsts, pairs, accepted = [], [], 0
    rng = random.Random(20241202)
    for seed in (rng.getrandbits(62) for _ in range(draws)):
        sampling = SamplingParams(temperature=1.0, top_k=TOP_K, seed=seed, max_new_tokens=5, ignore_eos=True)
        gen = engine.start(ctx, sampling, spec, proposer=SuffixProposer(store, trees=True))
        for step in gen:
            accepted += step.accepted
        out = gen.result().token_ids
        firsts.append(out[0])
        pairs.append(tuple(out[:2]))
    store.release(keep=False)
    return p1, joint, firsts, pairs, accepted


@pytest.mark.slow
def test_sampled_tree_drafts_follow_the_target_distribution(sharp, contexts, monkeypatch, measured_gemm) -> None:
    """Trees verified by recursive rejection over siblings: the first two committed tokens follow
    the target's distribution (chi-square), drafts both accepted and rejected, every first step a
    4-node tree with two branches (counted at the real tree forward)."""
    from tandem.engine.scheduler.runner import Sequence

    calls = []
    real = Sequence.tree_rows  # every token tree a step verifies, in process or in the step loop
    monkeypatch.setattr(Sequence, "tree_rows", staticmethod(lambda p: calls.append(list(p)) or real(p)))
    ctx = contexts["random"]
    p1, joint, firsts, pairs, accepted = _tree_draws(Engine(sharp), ctx, DRAWS)
    assert len(calls) >= DRAWS and calls[0] == [-1, -1, 0, 1]
    assert 0.2 * DRAWS < accepted < 1.8 * DRAWS
    p_first, p_joint = chi_square_p_values(firsts, pairs, p1, joint)
    assert p_first > P_MIN and p_joint > P_MIN, (p_first, p_joint)


@pytest.mark.slow
def test_the_chi_square_test_catches_a_biased_tree_sampler(sharp, contexts, monkeypatch, measured_gemm) -> None:
    """Negative control: drawing the token after rejected siblings from p (not from p without
    them) must fail the same test at half the sample size."""

    def residual_keeps_siblings(draft_ids, parents, num_drafts, target_probs, uniform, exp_noise):
        out, acc, nodes = kernels.reference.tree_rejection_sample(draft_ids, parents, num_drafts, target_probs,
                                                                  uniform, exp_noise)
        a = int(acc[0])
        row = int(nodes[0, a - 1]) + 1 if a else 0
        out[0, a] = int(torch.argmax(target_probs[0, row] / exp_noise[0]))
        return out, acc, nodes

    monkeypatch.setattr(kernels, "tree_rejection_sample", residual_keeps_siblings)
    ctx = contexts["random"]
    p1, joint, firsts, pairs, _ = _tree_draws(Engine(sharp), ctx, DRAWS // 2)
    p_first, p_joint = chi_square_p_values(firsts, pairs, p1, joint)
    assert min(p_first, p_joint) < P_MIN, (p_first, p_joint)


@pytest.mark.parametrize("strategy", ["none", "ngram", "model"])
def test_seeded_sampling_replays_exactly(strategy, sharp, near, contexts) -> None:
    """Same seed, same text, on the same engine even after other requests changed its shared
    acceptance statistics and measured costs (adaptive block lengths on); other seeds, other text."""
    engine = Engine(sharp, near)
    spec = SpecConfig(strategy=strategy)
    ctx = contexts["code"]
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_new_tokens=24, ignore_eos=True)
    first = engine.generate(ctx, sampling, spec).token_ids
    for s in range(4):
        engine.generate(contexts["prose"], sampling.model_copy(update={"seed": 100 + s}), spec)
        engine.generate(ctx, SamplingParams(max_new_tokens=12), spec)  # greedy requests too
    assert engine.generate(ctx, sampling, spec).token_ids == first
    assert Engine(sharp, near).generate(ctx, sampling, spec).token_ids == first
    others = [engine.generate(ctx, sampling.model_copy(update={"seed": s}), spec).token_ids for s in range(4)]
    assert any(o != first for o in others)


# --- logits -> probabilities ------------------------------------------------------------------------


def test_greedy_probs_are_one_hot_at_the_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


def test_temperature_scales_the_logits() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, -1.0]])
    for t in (0.5, 1.0, 2.0):
        probs = logits_to_probs(logits, SamplingParams(temperature=t))
        torch.testing.assert_close(probs, torch.softmax(logits / t, -1))


def test_top_k_keeps_the_k_most_likely() -> None:
    logits = torch.tensor([[5.0, 1.0, 4.0, 3.0, 2.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    want = torch.zeros(2, 5)
    want[0, [0, 2]] = torch.softmax(torch.tensor([5.0, 4.0]), -1)
    want[1, [3, 4]] = torch.softmax(torch.tensor([3.0, 4.0]), -1)
    torch.testing.assert_close(probs, want)
    # top_k >= vocab and top_k 0 are no truncation
    full = torch.softmax(logits, -1)
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=5)), full)
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=0)), full)


def test_top_p_keeps_the_token_that_crosses_the_threshold() -> None:
    # Probabilities .05 .5 .15 .3 (sorted: .5 .3 .15 .05, cumulative .5 .8 .95 1.0), unsorted on purpose.
    p = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = p.log().unsqueeze(0)
    cases = {
        0.4: [1],  # .5 alone already exceeds .4
        0.79: [1, 3],  # .5 < .79: the next token (.3) crosses it and is kept
        0.81: [1, 3, 2],  # .8 < .81: .15 is needed too
        0.99: [1, 3, 2, 0],
        1.0: [1, 3, 2, 0],
    }
    for top_p, keep in cases.items():
        probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))[0]
        want = torch.zeros(4)
        want[keep] = p[keep] / p[keep].sum()
        torch.testing.assert_close(probs, want, msg=f"top_p={top_p}")


def test_temperature_then_top_k_then_top_p() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -2.0]])
    # T = 2: softmax([1, .5, 0]) over the top 3 = [.506 .307 .186]; top_p .7 keeps the first two.
    probs = logits_to_probs(logits, SamplingParams(temperature=2.0, top_k=3, top_p=0.7))[0]
    kept = torch.softmax(torch.tensor([1.0, 0.5]), -1)
    torch.testing.assert_close(probs, torch.cat([kept, torch.zeros(3)]))


def test_make_generator_is_seeded() -> None:
    a = torch.rand(5, generator=make_generator(7))
    assert torch.equal(a, torch.rand(5, generator=make_generator(7)))
    assert not torch.equal(a, torch.rand(5, generator=make_generator(8)))


def test_the_race_noise_is_exponential_and_seeded() -> None:
    """exp_noise draws Exp(1): Kolmogorov-Smirnov against the exponential law over 200,000 draws,
    its first two moments, no zero (a zero wins the race for any token); a seed replays it."""
    from scipy.stats import kstest

    e = exp_noise(200_000, make_generator(11))
    assert e.dtype == torch.float32 and e.shape == (200_000,)
    assert float(e.min()) > 0.0
    assert kstest(e.double().numpy(), "expon").pvalue > 1e-3
    assert abs(float(e.double().mean()) - 1.0) < 0.02 and abs(float(e.double().var()) - 1.0) < 0.05
    assert torch.equal(exp_noise(100, make_generator(3)), exp_noise(100, make_generator(3)))
    # a biased law fails the same test (rate 1.03 instead of 1)
    assert kstest((e.double() / 1.03).numpy(), "expon").pvalue < 1e-3


# --- stop handling ------------------------------------------------------------------------------------


class Scripted(Proposer):
    """Proposes the next `n` tokens of a known continuation, ignoring k: every draft is accepted, so a
    step commits n + 1 tokens whatever room is left (a drafter sending more than was asked)."""

    name = "script"

    def __init__(self, prompt_len: int, script: list[int], n: int):
        self.prompt_len, self.script, self.n = prompt_len, script, n

    def propose(self, ids, k, sampling, gen):
        pos = len(ids) - self.prompt_len
        return Draft(tokens=self.script[pos : pos + self.n], proposer=self.name)


def test_max_new_tokens_is_exact_when_a_step_commits_several_tokens(tiny_loaded, contexts) -> None:
    engine = Engine(tiny_loaded)
    ctx = contexts["prose"]
    plain = plain_reference(engine, "prose", ctx)
    for limit in (1, 2, 5, 9, 10, 13, 23):
        sampling = SamplingParams(max_new_tokens=limit)
        spec = SpecConfig(strategy="ngram", adaptive=False, max_draft_tokens=8)
        gen = engine.start(ctx, sampling, spec, proposer=Scripted(len(ctx), plain, 8))
        steps = list(gen)
        res = gen.result()
        assert res.token_ids == plain[:limit] and res.finish_reason == FinishReason.length, limit
        assert [t for s in steps for t in s.tokens] == res.token_ids  # each token emitted once, in order
        assert [s.first_index for s in steps] == [9 * i for i in range(len(steps))]
        assert len(steps) == -(-limit // 9)  # 9 tokens a step: the last one was cut
        # The real prompt lookup, which respects the room left, gives the same.
        res = engine.generate(ctx, sampling, spec)
        assert res.token_ids == plain[:limit] and res.finish_reason == FinishReason.length


def test_eos_stops_in_the_middle_of_a_block_and_is_not_emitted(tiny_tokenizer, tiny_loaded, contexts) -> None:
    ctx = contexts["prose"]
    plain = plain_reference(Engine(tiny_loaded), "prose", ctx)
    # A stop token whose first occurrence lies strictly inside a later step's block of 7 committed
    # tokens (6 accepted drafts + a bonus), so that the step commits tokens on both sides of it.
    j, stop = next((j, t) for j, t in enumerate(plain) if plain.index(t) == j and j > 7 and j % 7 not in (0, 6))
    # The same weights as the target, with `stop` as an extra EOS id in its generation config.
    model = make_tiny_llama(seed=0, num_layers=2)
    model.generation_config.eos_token_id = [EOS_ID, stop]
    target = LoadedModel(model_id="tiny-eos", path="", model=model, tokenizer=tiny_tokenizer)
    assert set(target.eos_token_ids) == {EOS_ID, stop}
    engine = Engine(target)
    scripted = Scripted(len(ctx), plain, 6)
    gen = engine.start(ctx, GREEDY40, SpecConfig(strategy="ngram", adaptive=False), proposer=scripted)
    steps = list(gen)
    res = gen.result()
    assert res.token_ids == plain[:j] and res.finish_reason == FinishReason.stop
    assert 0 < len(steps[-1].tokens) < steps[-1].accepted + 1  # tokens before it in the same step kept
    assert res.token_ids == plain_generate(model, ctx, GREEDY_TOKENS, {EOS_ID, stop})
    for strategy in ("none", "ngram"):
        res = engine.generate(ctx, GREEDY40, SpecConfig(strategy=strategy, adaptive=False))
        assert res.token_ids == plain[:j] and res.finish_reason == FinishReason.stop
    # Requested stop ids work the same way; ignore_eos turns the model's EOS off.
    stop_sampling = SamplingParams(max_new_tokens=GREEDY_TOKENS, stop_token_ids=(stop,))
    res = Engine(tiny_loaded).generate(ctx, stop_sampling, SpecConfig(adaptive=False))
    assert res.token_ids == plain[:j] and res.finish_reason == FinishReason.stop
    no_eos = SamplingParams(max_new_tokens=GREEDY_TOKENS, ignore_eos=True)
    res = engine.generate(ctx, no_eos, SpecConfig(adaptive=False))
    assert res.token_ids == plain and res.finish_reason == FinishReason.length


# --- the block-length controller -----------------------------------------------------------------------


def _costs(per_token: float = 0.05) -> ForwardCosts:
    """A forward costs 50 ms plus `per_token` x 50 ms per extra token."""
    costs = ForwardCosts()
    for n in (1, 5, 9):
        costs.observe(n, 0.05 * (1 + per_token * (n - 1)))
    return costs


def test_controller_stops_speculating_when_nothing_is_accepted() -> None:
    c = BlockLengthController(8, _costs(), AcceptanceCounts())
    assert c.choose("model", 0, 8) > 0  # the prior alone (30%) makes a short block worth trying
    for _ in range(50):
        c.observe("model", 0, 4, 0)
    assert c.choose("model", 0, 8) == 0
    # Another sequence sharing the runner-wide counts starts out pessimistic too.
    assert BlockLengthController(8, _costs(), c.shared).choose("model", 0, 8) == 0


def test_controller_speculates_when_acceptance_is_high() -> None:
    c = BlockLengthController(8, _costs(), AcceptanceCounts())
    for _ in range(50):
        c.observe("ngram", 4, 8, 8)
    assert c.choose("ngram", 4, 8) == 8
    assert c.choose("ngram", 4, 3) == 3  # never more than the proposer has
    # Drafting that costs little beside a target step does not change that.
    c.observe_draft_cost("ngram", 8, 8 * 0.0001)
    assert c.choose("ngram", 4, 8) > 0


def test_controller_weighs_draft_cost_and_forward_growth() -> None:
    c = BlockLengthController(8, _costs(per_token=1.0), AcceptanceCounts())  # forward(k+1) = (k+1) x forward(1)
    for _ in range(50):
        c.observe("model", 0, 8, 4)  # half the positions accepted, then a rejection
    assert c.choose("model", 0, 8) == 0  # expected tokens < cost growth
    c2 = BlockLengthController(8, _costs(), AcceptanceCounts())
    for _ in range(50):
        c2.observe("model", 0, 8, 8)
    assert c2.choose("model", 0, 8) > 0
    c2.observe_draft_cost("model", 1, 1.0)  # a draft token costs 20 target steps
    assert c2.choose("model", 0, 8) == 0


def test_batch_costs_from_noisy_distinct_counts_price_drafts_by_their_slope() -> None:
    """A big batch's steps seldom repeat a token count, so each count has one noisy sample. The
    curve must still rise with every token (no draft looks free beside a low sample), and a
    session in a batch of 60 others must decline drafts at 30% acceptance, where a token costs more
    than it brings, and take them at 95%. A per-count table (before) read the noise as slopes and
    drafted at 30% (measured: speculation 0.85x plain at 64 sessions)."""
    import random

    rng = random.Random(3)
    costs = ForwardCosts()
    true = lambda n: 0.032 + 0.0008 * n  # 64 sessions at ~300 tokens of context, AMD EPYC
    for _ in range(600):  # counts in any order, as a batch's rows come and go
        n = rng.randrange(60, 200)
        costs.observe(n, true(n) * rng.uniform(0.8, 1.25))
    est = [costs.estimate(n) for n in range(55, 210)]
    assert all(b > a for a, b in zip(est, est[1:])), "a forward of one more token never looks cheaper"
    assert all(abs(costs.estimate(n) / true(n) - 1) < 0.1 for n in range(60, 200, 7))
    for rate, pays in ((0.3, False), (0.95, True)):
        c = BlockLengthController(8, costs, AcceptanceCounts())
        for _ in range(200):  # the bucket's rate, learnt: each draft accepted with `rate`
            accepted = 0
            while accepted < 8 and rng.random() < rate:
                accepted += 1
            c.observe("ngram", 4, 8, accepted)
        k = c.choose("ngram", 4, 8, batch_tokens=90, batch_committed=60.0)
        assert (k > 0) == pays, (rate, k, c.rates("ngram", 4, 3))


def test_costs_keep_exact_points_for_a_lone_sessions_blocks() -> None:
    """Up to ForwardCosts.EXACT tokens every count is its own point: on a CPU the first extra
    tokens of a lone session's block are nearly free, a shape a line through wider bins would lose."""
    costs = ForwardCosts()
    for n, s in ((1, 5.8), (2, 5.95), (3, 6.0), (5, 6.45), (9, 8.37), (17, 13.4)):
        for _ in range(3):
            costs.observe(n, s / 1000)
    assert [round(costs.estimate(n) * 1000, 2) for n in (1, 2, 3, 5, 9)] == [5.8, 5.95, 6.0, 6.45, 8.37]
    assert costs.estimate(1) < costs.estimate(4) < costs.estimate(5)


def test_controller_expects_an_unreached_position_to_do_as_well_as_the_one_before() -> None:
    """Blocks of 3 accepted 95% of the time say nothing about positions 4-8; the controller must
    expect them to do about as well, not fall back to the bucket's fixed prior, or a cost curve
    that jumps at 5 tokens (a CPU's GEMM tiles) keeps it at 3 drafts for ever (measured: the
    hybrid at 1.2x where suffix decoding alone ran 1.4x, agent_tools, Intel Xeon)."""
    costs = ForwardCosts()
    for n, ms in ((1, 5.6), (2, 6.1), (3, 6.2), (4, 7.7), (5, 10.6), (6, 10.8), (7, 11.0), (8, 11.2), (9, 11.4)):
        for _ in range(3):
            costs.observe(n, ms / 1000)
    c = BlockLengthController(8, costs, AcceptanceCounts())
    bucket = 16 + 15  # a long match in the cross-session store
    for _ in range(40):
        c.observe("suffix", bucket, 3, 3 if _ % 20 else 2)
    rates = c.rates("suffix", bucket, 8)
    assert min(rates[3:]) > 0.9, rates  # not the fixed prior (0.75) of a long match
    assert c.choose("suffix", bucket, 32) == 8
    # a bucket whose first position fails is expected to fail on, and is not drafted
    c2 = BlockLengthController(8, costs, AcceptanceCounts())
    for _ in range(40):
        c2.observe("ngram", 1, 1, 0)
    assert max(c2.rates("ngram", 1, 8)) < 0.1 and c2.choose("ngram", 1, 8) == 0


def test_a_new_sequence_knows_what_a_look_at_the_draft_model_costs() -> None:
    """A draft model's look is priced from the runner's measure of its cost, so a new session whose
    best offer already beats anything the model could add does not pay a look (the first one reads
    its prompt); unmeasured anywhere, the first look is taken (the only way to learn its cost)."""
    shared = AcceptanceCounts()
    first = BlockLengthController(8, _costs(), shared)
    strong = (6.0, 0.06)  # a long suffix match: 6 tokens expected for 1.2 steps' time
    assert first.worth_peeking("model", 8, strong)  # nothing measured: look
    first.observe_draft_cost("model", 1, 0.02)  # a draft-model step costs 40% of a target step
    later = BlockLengthController(8, _costs(), shared)
    assert not later.worth_peeking("model", 8, strong)
    assert later.worth_peeking("model", 8, (1.0, 0.05))  # against a plain step it still pays to look


def test_controller_without_measurements_takes_a_plain_step() -> None:
    assert BlockLengthController(8, ForwardCosts(), AcceptanceCounts()).choose("ngram", 4, 8) == 0


def test_fixed_block_length_returns_the_limit() -> None:
    c = BlockLengthController(6, ForwardCosts(), AcceptanceCounts(), adaptive=False)
    for _ in range(50):
        c.observe("model", 0, 6, 0)
    assert c.choose("model", 0, 100) == 6
    assert c.choose("model", 0, 4) == 4
    assert c.choose("model", 0, 0) == 0


def _simulate(c: BlockLengthController, costs: ForwardCosts, script, *, seed: int = 0) -> list[tuple[int, int, float]]:
    """Run the controller as the decode loop does, on a scripted text: `script(step)` gives the
    step's offer (proposer, bucket, available) and the acceptance probability of each of its drafts.
    Returns per step (k drafted, accepted, cost in plain-step units, from the scripted cost curve)."""
    import random

    rng = random.Random(seed)
    out = []
    for step in range(len(script)):
        proposer, bucket, available, p_accept = script[step]
        k = c.choose(proposer, bucket, available)
        if k == 0:
            k = c.probe(proposer, bucket, available)
        accepted = 0
        while accepted < k and rng.random() < p_accept:
            accepted += 1
        if k:
            c.observe(proposer, bucket, k, accepted)
        out.append((k, accepted, costs.estimate(k + 1) / costs.estimate(1)))
    return out


def test_controller_resumes_drafting_when_the_text_turns_repetitive() -> None:
    """Half-way through a reply the text starts repeating itself (long prompt-lookup matches that
    are accepted): the controller, which had stopped drafting on the first half's rejected short
    matches, drafts again within a few steps and commits several tokens a step."""
    costs = _costs()
    c = BlockLengthController(8, costs, AcceptanceCounts())
    script = [("ngram", 2, 8, 0.0)] * 200 + [("ngram", 20, 8, 0.95)] * 100
    steps = _simulate(c, costs, script)
    first_half = steps[:200]
    assert sum(k for k, _, _ in first_half[50:]) <= 8, "after learning, the useless short matches are only probed"
    resumed = next(i for i, (k, _, _) in enumerate(steps[200:]) if k > 0)
    assert resumed <= 2, f"drafting resumed only {resumed} steps after the text turned repetitive"
    late = steps[210:]
    assert sum(a + 1 for _, a, _ in late) / len(late) > 4, "long accepted matches commit many tokens per step"


def test_controller_keeps_probing_but_stays_near_plain_where_drafting_never_pays() -> None:
    """A host where every extra token costs as much as the first (forward(n) = n forward(1)):
    drafting cannot pay, and must cost at most a little. Short and long matches alike, 500 steps."""
    costs = _costs(per_token=1.0)
    c = BlockLengthController(8, costs, AcceptanceCounts())
    script = [("ngram", 2 if i % 3 else 12, 8, 0.3 if i % 3 else 0.6) for i in range(500)]
    steps = _simulate(c, costs, script, seed=1)
    committed = sum(a + 1 for _, a, _ in steps)
    cost = sum(units for _, _, units in steps)
    assert committed / cost > 0.95, f"tokens per plain-step cost {committed / cost:.3f}: not within noise of plain"
    assert 0 < c.probes < 40, c.probes  # it keeps testing, rarely


def test_probes_back_off_and_reset() -> None:
    costs = _costs(per_token=1.0)  # nothing pays: every offer is declined, only probes draft
    c = BlockLengthController(8, costs, AcceptanceCounts())
    probe_steps = []
    for step in range(300):
        if c.probe("ngram", 2, 8):
            probe_steps.append(step)
            c.observe("ngram", 2, 1, 0)
    gaps = [b - a for a, b in zip(probe_steps, probe_steps[1:])]
    assert probe_steps[0] == 7 and gaps[:3] == [16, 32, 64] and set(gaps[3:]) == {64}
    # Drafting by plan (an observation that was no probe) resets the bucket's backoff.
    c.observe("ngram", 2, 4, 4)
    assert [c.probe("ngram", 2, 8) for _ in range(8)] == [0] * 7 + [1]
    # A long match is looked at on its first decline, and never less often than every 16th.
    long_steps = [i for i in range(100) if c.probe("ngram", 16, 8)]
    assert long_steps[0] == 0 and max(b - a for a, b in zip(long_steps, long_steps[1:])) == 16
    # A draft model's offers are never probed: its probe would pay its own draft steps too.
    assert not any(c.probe("model", 3, 8) for _ in range(200))
    # Fixed block lengths never probe (they always draft the most).
    assert BlockLengthController(8, costs, AcceptanceCounts(), adaptive=False).probe("ngram", 2, 8) == 0


def test_the_native_forwards_fused_norm_and_rope_are_the_spelled_out_arithmetic(tiny_loaded) -> None:
    """The native forward's RMSNorm without the row kernel (torch's fused op) and RoPE (a roll against
    a sine with its first half negated) give the bits of the textbook forms (transformers' Llama:
    rsqrt of the mean square, rotate_half); the row kernel's norm (tests/engine/test_rowops.py) is
    within float32 rounding of them."""
    native = NativeLlama(tiny_loaded.model)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, generator=gen)
    for n in (1, 2, 9, 17, 300):
        x = torch.randn(n, 64, generator=gen) * 3
        spelled = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + native.eps))
        assert torch.equal(F.rms_norm(x, (64,), w, native.eps), spelled)  # the forward's op without the kernel
        assert torch.allclose(native._rms(x, w), spelled, rtol=1e-6, atol=1e-6)
        D = native.head_dim
        positions = torch.arange(500, 500 + n)
        cos, signed_sin = native._rope(positions)  # [n, 1, D]
        freqs = positions.float()[:, None] * native.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], -1)  # [n, D]
        xh = torch.randn(n, 5, D, generator=gen)  # [n, heads, D]
        rotate_half = torch.cat([-xh[..., D // 2 :], xh[..., : D // 2]], -1)
        textbook = xh * emb.cos()[:, None] + rotate_half * emb.sin()[:, None]
        assert torch.equal(native._rotate(xh, cos, signed_sin), textbook)


@pytest.mark.parametrize("strategy", ["none", "ngram"])
def test_a_resumed_sampled_generation_follows_the_targets_distribution(strategy, sharp, sampling_context) -> None:
    """Failover: a generation continued after 3 streamed tokens (resumed=3) samples its next token
    from the target's distribution with those tokens counted as output (here: a presence penalty
    on them), as the uninterrupted generation would have. Chi-square against the exact distribution
    from the model's logits; the same distribution without the penalty on them (a continuation that
    took them for prompt) is far enough away for the test to tell the two apart."""
    ctx = sampling_context
    streamed = Engine(sharp).generate(ctx, SamplingParams(max_new_tokens=3), SpecConfig(strategy="none")).token_ids
    penalty = 1.5
    logits = full_logits(sharp.model, ctx + streamed)[-1].double()

    def dist(penalized):
        adjusted = logits.clone()
        for t in set(penalized):
            adjusted[t] -= penalty
        top = adjusted.topk(TOP_K)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()))

    exact, wrong = dist(streamed), dist([])
    tv = 0.5 * sum(abs(exact.get(t, 0.0) - wrong.get(t, 0.0)) for t in set(exact) | set(wrong))
    assert tv > 0.1, f"the penalty must matter for this test to have power (total variation {tv:.3f})"
    engine = Engine(sharp)
    spec = SpecConfig(strategy=strategy, adaptive=False, max_draft_tokens=4)
    rng = random.Random(20261202)
    firsts = []
    for seed in (rng.getrandbits(62) for _ in range(DRAWS // 2)):
        sampling = SamplingParams(temperature=1.0, top_k=TOP_K, seed=seed, max_new_tokens=2, ignore_eos=True,
                                  presence_penalty=penalty)
        gen = engine.start(ctx + streamed, sampling, spec, resumed=len(streamed))
        firsts.append(next(iter(gen)).tokens[0])
    assert set(firsts) <= set(exact)
    keys = sorted(exact)
    n = len(firsts)
    obs = [firsts.count(t) for t in keys]
    total = sum(exact.values())
    assert float(chisquare(obs, [n * exact[t] / total for t in keys]).pvalue) > P_MIN
    wrong_keys = sorted(set(keys) | set(wrong))
    if set(firsts) <= set(wrong):  # against the wrong distribution (if it can explain the draws at all)
        wtotal = sum(wrong.get(t, 0.0) for t in wrong_keys)
        expected_wrong = [max(n * wrong.get(t, 0.0) / wtotal, 1e-9) for t in wrong_keys]
        obs_wrong = [firsts.count(t) for t in wrong_keys]
        scale = n / sum(expected_wrong)
        assert float(chisquare(obs_wrong, [e * scale for e in expected_wrong]).pvalue) < P_MIN


def test_resumed_must_leave_a_prompt(tiny_loaded) -> None:
    with pytest.raises(ValueError, match="resumed_tokens"):
        Engine(tiny_loaded).start([1, 2, 3], SamplingParams(max_new_tokens=2), SpecConfig(strategy="none"), resumed=3)


def test_a_finished_generation_leaves_its_sequence_as_plain_decoding_does(tiny_loaded, contexts) -> None:
    """A verification block may commit tokens past a stop id (drafts accepted after it). They are
    dropped, so the sequence (its ids, and which positions a decode step computed the KV of) is
    exactly what plain decoding leaves, and a later turn reusing it computes the same numbers in
    every mode. Before, the speculative sequence kept the stop id's KV from its block while plain
    decoding computed it in the next turn's prefill, with torch's attention: on the GGUF target
    (8-bit activations amplify a last-bit difference) a second agent turn differed from plain.
    An oracle proposer (plain decoding's own continuation) makes every block run past the stop."""

    class Oracle(Proposer):
        name = "oracle"

        def __init__(self, text: list[int]):
            self.text = text  # context + plain decoding's output, and beyond

        def propose(self, ids, k, sampling, gen):
            return Draft(tokens=self.text[len(ids) : len(ids) + k], proposer=self.name)

    engine = Engine(tiny_loaded)
    none = SpecConfig(strategy="none")
    ngram = SpecConfig(strategy="ngram", adaptive=False, max_draft_tokens=8)
    for name in ("code", "json", "prose"):
        ctx = contexts[name]
        plain = engine.generate(ctx, SamplingParams(max_new_tokens=48, ignore_eos=True), none).token_ids
        stop = plain[20]
        for strategy, proposer in (("none", None), ("oracle", Oracle(ctx + plain))):
            seq = engine.runner.new_sequence()
            sampling = SamplingParams(max_new_tokens=48, stop_token_ids=[stop], ignore_eos=True)
            gen = engine.start(ctx, sampling, none if proposer is None else ngram, sequence=seq, proposer=proposer)
            steps = list(gen)
            if proposer is not None:  # the last block committed tokens past the stop id
                assert steps[-1].accepted + 1 > len(steps[-1].tokens) + 1, name
            ended = (gen.result().token_ids, list(seq.ids), seq.cached_len)
            # the next turn: the reply, then new text, prefilled on top of what the sequence holds
            nxt = engine.start(list(seq.ids) + contexts["prose"][:9], SamplingParams(max_new_tokens=12), none,
                               sequence=seq)
            for _ in nxt:
                pass
            if proposer is None:
                expected = (*ended, nxt.result().token_ids)
            else:
                assert (*ended, nxt.result().token_ids) == expected, name
