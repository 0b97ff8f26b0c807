"""Streaming text out of token ids (shared by the gateway and the CLI)."""

from __future__ import annotations

from collections.abc import Sequence


class Detokenizer:
    """Incremental detokenization in O(new tokens): decode a short window that starts at the
    previous delta's tokens (so tokenizers that render a token differently at the start of a text,
    such as SentencePiece's leading space, see their context) and emit what it adds. Text ending in
    U+FFFD (a UTF-8 character cut between tokens) is held back until the character completes.

    Example (word-level tokenizer): push([the]) -> "the", push([answer, is]) -> " answer is".
    """

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text was emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def push(self, ids: Sequence[int], *, final: bool = False) -> str:
        self._ids.extend(ids)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]
