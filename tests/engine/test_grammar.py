"""Structured output inside verification (tandem.engine.speculation.grammar, xgrammar): the grammar's mask is
applied to the target at every verified position, drafted or not.

- greedy speculation (prompt lookup, a draft model, k = 1/4/8) equals constrained plain decoding
  token for token, and the output matches the schema;
- sampled speculation follows the constrained target distribution (chi-square against the masked
  model probabilities computed by hand), and a negative control shows the test has power;
- a grammar that does not compile is a clear error.
"""

from __future__ import annotations

import json

import pytest
import torch

from tandem.contract.params import Grammar, SamplingParams, SpecConfig
from tandem.engine.scheduler.generate import Engine
from tandem.engine.speculation.grammar import Constraint, GrammarError, compile_grammar

from test_engine import DRAWS, P_MIN, chi_square_p_values, full_logits, run_draws  # noqa: F401
from test_engine import contexts, near, sharp  # noqa: F401

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
GRAMMARS = {
    "json_schema": Grammar(kind="json_schema", value=json.dumps(SCHEMA)),
    "regex": Grammar(kind="regex", value=r"(yes|no|maybe)(,(yes|no|maybe)){2,6}"),  # no spaces: the test vocabulary has none
}


def _text(tokenizer, ids):
    """The output as the grammar sees it: the tokens' strings concatenated (this word-level test
    tokenizer decodes with spaces between words, which the grammar does not count)."""
    return "".join(tokenizer.convert_ids_to_tokens(ids))


@pytest.mark.parametrize("kind", list(GRAMMARS))
@pytest.mark.parametrize("strategy", ["ngram", "model"])
def test_greedy_speculation_under_a_grammar_equals_constrained_plain_decoding(kind, strategy, sharp, near, contexts):
    engine = Engine(sharp, near)
    sampling = SamplingParams(max_new_tokens=48, grammar=GRAMMARS[kind])
    drafted = stops = 0
    for name, ctx in contexts.items():
        plain = engine.generate(ctx, sampling, SpecConfig(strategy="none"))
        for k in (1, 4, 8):
            res = engine.generate(ctx, sampling, SpecConfig(strategy=strategy, adaptive=False, max_draft_tokens=k))
            assert res.token_ids == plain.token_ids, f"{kind}/{strategy}/{name}/k={k}"
            drafted += res.stats.drafted
        text = _text(sharp.tokenizer, plain.token_ids)
        stops += plain.finish_reason.value == "stop"
        if plain.finish_reason.value == "stop":  # the grammar completed: the output is in its language
            if kind == "json_schema":
                value = json.loads(text)
                assert set(value) == {"name", "age"} and isinstance(value["age"], int)
            else:
                words = text.split(",")
                assert 3 <= len(words) <= 7 and set(words) <= {"yes", "no", "maybe"}, text
    assert drafted > 0
    assert stops >= 2, "the grammar must complete (and the output be checked) in some contexts"


def test_unconstrained_output_breaks_the_grammar(sharp, contexts):
    """Without the grammar this model writes no JSON: the constraint is what produced it above."""
    engine = Engine(sharp)
    ctx = contexts["prose"]
    free = engine.generate(ctx, SamplingParams(max_new_tokens=24), SpecConfig(strategy="none")).token_ids
    constrained = engine.generate(ctx, SamplingParams(max_new_tokens=24, grammar=GRAMMARS["json_schema"]),
                                  SpecConfig(strategy="none")).token_ids
    assert free != constrained and _text(sharp.tokenizer, constrained).startswith("{")


def test_a_grammar_that_does_not_compile_is_a_clear_error(sharp):
    for bad in (Grammar(kind="regex", value="(unclosed"), Grammar(kind="json_schema", value="{\"type\": 5}"),
                Grammar(kind="ebnf", value="root ::= ")):
        with pytest.raises(GrammarError, match="does not compile"):
            compile_grammar(bad, sharp.tokenizer, sharp.vocab_size, [])


def _masked_first_two(model, tokenizer, vocab, ctx, grammar, top_k):
    """p(t1) and p(t1) p(t2 | t1) under the grammar, by hand: a fresh matcher per prefix."""

    def dist(generated):
        c = Constraint(grammar, tokenizer, vocab, [])
        c.advance(generated)
        _, bitmask = c.prepare(None)
        logits = c.mask(full_logits(model, ctx + generated)[-1:], bitmask)[0].double()
        top = logits.topk(top_k)
        keep = top.values > float("-inf")
        return dict(zip(top.indices[keep].tolist(), torch.softmax(top.values[keep], -1).tolist()))

    p1 = dist([])
    joint = {(t1, t2): a * b for t1, a in p1.items() for t2, b in dist([t1]).items()}
    return p1, joint


@pytest.mark.slow
def test_sampled_speculation_under_a_grammar_follows_the_constrained_target(sharp, near, contexts):
    grammar = Grammar(kind="regex", value=r"(yes|no|maybe|true|false|none)[a-z]{0,40}")
    ctx = contexts["prose"]
    spec = SpecConfig(strategy="model", adaptive=False, max_draft_tokens=4)
    firsts, pairs, (drafted, accepted, _) = run_draws(Engine(sharp, near), ctx, spec, DRAWS, grammar=grammar)
    assert drafted > 0 and accepted > 0
    # Every draw is in the grammar's language (its first tokens spell a prefix of an allowed word),
    # which the unconstrained model's top-4 are not: the mask is what is being tested.
    c = Constraint(grammar, sharp.tokenizer, sharp.vocab_size, [])
    for pair in set(pairs):
        c.advance(pair)
        c.matcher.rollback(len(pair))
    free = full_logits(sharp.model, ctx)[-1].topk(4).indices.tolist()
    assert set(free) != set(firsts)
    p1, joint = _masked_first_two(sharp.model, sharp.tokenizer, sharp.vocab_size, ctx, grammar, 4)
    p_first, p_joint = chi_square_p_values(firsts, pairs, p1, joint)
    assert p_first > P_MIN and p_joint > P_MIN, (p_first, p_joint)


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_a_draft_model_drafts_inside_the_grammar(kind, sharp, near, contexts, monkeypatch):
    """Told the request's grammar, the draft model masks its own logits like the target's: every
    block it proposes is in the grammar (without the mask, some are not), drafting ahead past an
    uncommitted guess and back included; greedy output stays constrained plain decoding's, and more
    drafts are accepted than without the mask."""
    from tandem.engine.speculation.proposers import DraftModelProposer

    grammar = GRAMMARS[kind]
    sampling = SamplingParams(max_new_tokens=48, grammar=grammar)
    stop = sorted(set(sharp.eos_token_ids))

    def in_grammar(generated: list[int], block: list[int]) -> bool:
        c = Constraint(grammar, sharp.tokenizer, sharp.vocab_size, stop)
        c.advance(generated)
        return all(c.matcher.accept_token(t) for t in block)

    engine = Engine(sharp)
    outside = 0
    for ctx in contexts.values():
        out = engine.generate(ctx, sampling, SpecConfig(strategy="none")).token_ids
        masked = DraftModelProposer(near, vocab_limit=sharp.vocab_size, stop_below=0.0)
        free = DraftModelProposer(near, vocab_limit=sharp.vocab_size, stop_below=0.0)
        for cut in (0, 3, 9, 5, len(out) - 2):  # forward, and back (a guess that failed)
            ids = ctx + out[:cut]
            block = masked.propose(ids, 6, sampling, None).tokens
            assert block and in_grammar(out[:cut], block), (kind, cut, block)
            outside += not in_grammar(out[:cut], free.propose(ids, 6, SamplingParams(max_new_tokens=48), None).tokens)
    assert outside > 0, "unmasked drafts leave the grammar: otherwise this test shows nothing"

    def run() -> tuple[list[list[int]], int]:
        eng = Engine(sharp, near)
        results = [eng.generate(ctx, sampling, SpecConfig(strategy="model", adaptive=False, max_draft_tokens=4))
                   for ctx in contexts.values()]
        return [r.token_ids for r in results], sum(r.stats.accepted for r in results)

    told, accepted_told = run()
    monkeypatch.setattr(DraftModelProposer, "_grammar_at", lambda self, ids, sampling: None)
    untold, accepted_untold = run()
    assert told == untold == [engine.generate(ctx, sampling, SpecConfig(strategy="none")).token_ids
                              for ctx in contexts.values()]
    assert accepted_told > accepted_untold
