"""Helpers on sequences of token ids, shared by the runner, the proposers and the services."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences.

    Example: common_prefix_len([5, 9, 7], [5, 9, 2, 1]) == 2. Turns of a conversation extend each
    other, so the whole-prefix comparison usually answers at once; otherwise a binary search over
    prefix equality keeps every comparison a slice compare at C speed.
    """
    a, b = list(a), list(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
