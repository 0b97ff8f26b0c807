"""`tandem loadtest`'s arithmetic on request timelines (its run against a real stack is in
tests/services/test_full_chain.py)."""

from __future__ import annotations

import pytest

from tandem.tools.loadtest import Phase, RequestResult


def _request(worker: int, start: float, chunks: list[float], tokens: int, end: float | None = None) -> RequestResult:
    return RequestResult(0, True, tokens=tokens, start=start, chunks=chunks, worker=worker,
                         end=chunks[-1] if end is None else end)


def test_steady_throughput_counts_only_while_every_worker_is_in_flight():
    """Two workers: the second starts at 1 s and the first ends its last request at 9 s, the second
    runs on alone to 20 s. The steady window is 1-9 s; a request's tokens are spread over its
    chunks (2 tokens a chunk here) and only chunks inside the window count. The whole-phase
    figure holds the lone tail."""
    phase = Phase(2, False, wall_s=20.0)
    phase.results = [
        _request(0, 0.0, [0.5 + i for i in range(5)], 10),  # chunks 0.5-4.5 s: 4 in the window
        _request(0, 5.0, [5.5 + i for i in range(4)], 8, end=9.0),  # 5.5-8.5 s: all 4 in
        _request(1, 1.0, [1.5 + i for i in range(19)], 38),  # 1.5-19.5 s: 1.5-8.5 in, 8 chunks
    ]
    s = phase.summary()
    assert s["steady_window_s"] == pytest.approx(8.0)
    assert s["steady_tokens_per_s"] == pytest.approx((4 * 2 + 4 * 2 + 8 * 2) / 8.0)
    assert s["tokens_per_s"] == pytest.approx(56 / 20.0)


def test_no_steady_window_without_every_worker_or_without_overlap():
    lone = Phase(2, False, wall_s=5.0)
    lone.results = [_request(0, 0.0, [1.0, 2.0], 4)]  # the other worker sent nothing
    assert lone.summary()["steady_tokens_per_s"] is None
    apart = Phase(2, False, wall_s=5.0)
    apart.results = [_request(0, 0.0, [1.0], 2, end=1.0), _request(1, 2.0, [3.0], 2)]  # never together
    assert apart.summary()["steady_tokens_per_s"] is None and apart.summary()["steady_window_s"] is None
