"""Structured output: a grammar's token mask applied to the target at every verified position.

Library: xgrammar. Measured on the EPYC host for SmolLM2's 49,152-token vocabulary over a JSON
schema (docs/history.md): mask computation median 4 us / mean 8 us per token against
llguidance's 18 us / 93 us, and 0.15 s against 0.47 s to set up and compile.

How verification stays lossless (docs/design.md's rule with p replaced by the masked target):

- before the forward, the drafts are walked through the matcher, filling the mask of every
  position; the block is cut right after the first draft the grammar refuses. That draft is kept:
  its masked target probability is 0, so it is rejected with certainty and the standard residual
  draws the replacement (cutting it off instead would draw from p where the rule draws from the
  residual, which changes the distribution of sampled output);
- the matcher is rolled back to the committed position, the masked target is verified as usual, and
  the matcher then advances through the committed tokens only.

Greedy output equals constrained plain decoding token for token; sampled output follows the
constrained target distribution (tests/engine/test_grammar.py).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from tandem.contract.params import Grammar
from tandem.engine.speculation.draft import Draft

_COMPILERS: dict[tuple, object] = {}  # (tokenizer id, vocab, stop ids) -> GrammarCompiler
_COMPILED: "OrderedDict[tuple, object]" = OrderedDict()  # (compiler key, grammar) -> CompiledGrammar
_MAX_COMPILED = 256
_LOCK = threading.Lock()


class GrammarError(ValueError):
    """The grammar (schema, regex, EBNF) does not compile: the request is invalid."""


def _compiler(tokenizer, vocab_size: int, stop_ids: Sequence[int]):
    import xgrammar as xgr

    key = (id(tokenizer), vocab_size, tuple(sorted(stop_ids)))
    with _LOCK:
        comp = _COMPILERS.get(key)
        if comp is None:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=list(stop_ids) or None)
            comp = _COMPILERS[key] = xgr.GrammarCompiler(info)
    return key, comp


def compile_grammar(grammar: Grammar, tokenizer, vocab_size: int, stop_ids: Sequence[int]):
    """The compiled grammar (cached: agents send the same schema over and over)."""
    key, comp = _compiler(tokenizer, vocab_size, stop_ids)
    ckey = (key, grammar.kind, grammar.value)
    with _LOCK:
        if ckey in _COMPILED:
            _COMPILED.move_to_end(ckey)
            return _COMPILED[ckey]
    try:
        if grammar.kind == "json_object":
            compiled = comp.compile_builtin_json_grammar()
        elif grammar.kind == "json_schema":
            # Compact JSON: free whitespace lets a weak model loop on blanks until max_tokens.
            compiled = comp.compile_json_schema(grammar.value, strict_mode=True, any_whitespace=False,
                                                separators=(",", ":"))
        elif grammar.kind == "regex":
            compiled = comp.compile_regex(grammar.value)
        else:
            compiled = comp.compile_grammar(grammar.value)
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the parser's message
        raise GrammarError(f"the {grammar.kind} does not compile: {str(exc)[:300]}") from None
    with _LOCK:
        _COMPILED[ckey] = compiled
        while len(_COMPILED) > _MAX_COMPILED:
            _COMPILED.popitem(last=False)
    return compiled


class Constraint:
    """One request's grammar state at its committed position."""

    def __init__(self, grammar: Grammar, tokenizer, vocab_size: int, stop_ids: Sequence[int]):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.matcher = xgr.GrammarMatcher(compile_grammar(grammar, tokenizer, vocab_size, stop_ids))

    def prepare(self, draft: Draft | None) -> tuple[Draft | None, torch.Tensor]:
        """(the draft cut right after its first refused token, the bitmask `# [k+1, words]` int32 of
        every position of the block); the matcher ends where it started."""
        tokens = draft.tokens if draft is not None else []
        bitmask = self._xgr.allocate_token_bitmask(len(tokens) + 1, self.vocab_size)  # all allowed
        walked, keep = 0, len(tokens)
        for i, tok in enumerate(tokens):
            self.matcher.fill_next_token_bitmask(bitmask, i)
            if not self.matcher.accept_token(tok):
                keep = i + 1  # this one stays, to be rejected by the rule (see the module docstring)
                break
            walked += 1
            if self.matcher.is_terminated():  # a stop token completed the grammar: nothing follows it
                keep = i + 1
                break
        else:
            self.matcher.fill_next_token_bitmask(bitmask, len(tokens))
        if walked:
            self.matcher.rollback(walked)
        if draft is not None and keep < len(draft):
            draft = draft.truncated(keep)
        return draft, bitmask[: keep + 1]

    @staticmethod
    def dead_end(bitmask: torch.Tensor) -> bool:
        """Whether the committed position's mask allows no token at all (the grammar needs text this
        vocabulary cannot write)."""
        return not bool(bitmask[0].any())

    def mask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """`logits # [n, vocab]` with refused tokens at -inf (a copy; float32)."""
        out = logits.float().clone()
        self._xgr.apply_token_bitmask_inplace(out, bitmask[: out.shape[0]].to(out.device))
        return out

    def advance(self, tokens: Sequence[int]) -> None:
        for tok in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(tok):  # cannot happen: every committed token was masked
                raise RuntimeError(f"the grammar refused committed token {tok}")


def parse_json_schema(value) -> str:
    """A JSON schema given as an object or a string, as the canonical string the compiler takes."""
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, dict):
        raise ValueError("a JSON schema must be a JSON object")
    return json.dumps(value, sort_keys=True)
