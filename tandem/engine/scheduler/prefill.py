"""How much of the waiting prompts a step carries beside the decoding rows: `PrefillPolicy` splits the
step's prompt tokens between prompts, `PieceBudget` steers that count by the measured step time so
a long prompt arriving never stalls the sessions that are streaming."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from tandem.engine.model.backends import ForwardCosts


@dataclass(frozen=True)
class PrefillPolicy:
    """How a step mixes prompt pieces with decoding (chunked prefill).

    A prompt is not run as one forward: a step carries every decoding row (verify blocks, plain
    steps) plus pieces of waiting prompts, as many prompt tokens as keep the step within
    `cost_factor` times the decoding step without them, but at least `min_piece` (a long prompt
    always advances) and at most `max_piece` in all (PieceBudget steers the count by measured step
    times: a piece's cost grows with its context, which no token-count model knows). With nobody
    decoding a step carries `max_piece` prompt tokens. Measured on the Intel host, SmolLM2-135M, 2
    threads, context 1k: a forward of 1 token 22 ms, 16 tokens 52 ms, 64 105 ms, 256 328 ms.

    The step loop plans every decoding session's block itself, so pieces ride along in their steps;
    a step without their rows while they decode (all of them waiting for their readers) may take
    only (cost_factor - 1) times their step, which bounds what they wait for it.
    """

    max_piece: int = 256
    min_piece: int = 4  # at 7k context 16 tokens of attention already cost ~2x a lone decoding step (EPYC)
    cost_factor: float = 2.0

    def split(self, budget: int, waiting: list[int], started: list[bool] | None = None) -> tuple[list[int], int]:
        """Prompt tokens per waiting prompt for one step, and how many of them went whole.
        `waiting`: remaining tokens of each prompt, oldest first; `started`: which of them already
        ran pieces (default none).

        Prompts that fit in one piece (at most `max_piece` left) go whole, shortest first, up to
        `max_piece` of them a step: a new chat turn starts as fast as it did before chunking,
        whatever long prompt is in the middle of its prefill. A long prompt's tail is not one of
        them: it is as costly a token as the rest at its context (its last 256 tokens at 7,000
        took ~0.6 s as one piece), so it stays in the budget. The longer ones share `budget`
        (less what went whole, but at least `min_piece`): the oldest its `min_piece` first (it
        always advances), then shortest first.

        >>> PrefillPolicy(64, 8).split(16, [500, 20, 900])  # 20 goes whole, 500 (oldest) gets 8
        ([8, 20, 0], 20)
        >>> PrefillPolicy(64, 8).split(64, [900, 500])  # 900 (oldest) its minimum, then shortest first
        ([8, 56], 0)
        >>> PrefillPolicy(64, 8).split(16, [40, 20], [True, False])  # 40 left of a long prompt: in the budget
        ([8, 20], 20)
        """
        pieces = [0] * len(waiting)
        whole = 0
        started = started or [False] * len(waiting)
        for i in sorted(range(len(waiting)), key=lambda i: waiting[i]):
            if not started[i] and waiting[i] <= self.max_piece and whole + waiting[i] <= self.max_piece:
                pieces[i] = waiting[i]
                whole += waiting[i]
        rest = [i for i in range(len(waiting)) if not pieces[i]]
        if not rest:
            return pieces, whole
        budget = max(self.min_piece, budget - whole)
        pieces[rest[0]] = min(waiting[rest[0]], self.min_piece, budget)
        budget -= pieces[rest[0]]
        for i in sorted(rest, key=lambda i: waiting[i] - pieces[i]):
            take = min(waiting[i] - pieces[i], budget)
            pieces[i] += take
            budget -= take
        return pieces, whole


class PieceBudget:
    """Prompt tokens the next step may carry, steered by the step times measured.

    Two budgets: for a step with decoding rows (target: cost_factor x the median decoding step) and
    for one without while sessions decode (target: cost_factor - 1 of it). After each such step the
    budget is scaled by target / measured (a step's time is nearly linear in its tokens), growing
    at most 1.5x a step so one fast step cannot overshoot, within [min_piece, max_piece]. Until a
    decoding step was measured, steps beside decoding carry min_piece.

    Below min_piece, where the forward can split a piece over steps by layers (`layers` > 0, the
    raw layer calls): the budget goes down to min_piece / layers, and a step carries a min_piece
    piece through `depth(budget)` of the layers, the rest in the next steps. Why: a piece attends
    to its whole prompt so far, so at long contexts even min_piece tokens cost more than the
    target (a 1-token piece at 7,000 tokens of context reads ~160 MB of float16 KV: ~2x a lone
    decoding step on 2 cores), and no token count could keep a running stream's gaps near 2x; a
    share of the layers reads that share of the KV. Below min_piece the target is cost_factor x
    the calm steps' tail (CALM_QUANTILE of the steps with rows and no long-prompt piece), not their
    median, and the recent piece steps' median is what it is held against: a split slows the long
    prompt, so it is made only where a stream would feel the piece beyond its own usual spread (a
    lone session: steps of ~6 ms, every piece step stands out), not where several sessions' steps
    already vary more than a piece adds (4 sessions: splitting to the median target made a 7k
    prompt's prefill 1.8-2.5x slower for gaps no one needed shortened; docs/benchmarks.md).

    The decoding rows' own cost moves with the load (16 sessions' rows cost ~4x one session's),
    so every time is read against the forward cost curve at its step's decoding tokens (`costs`,
    the runner's ForwardCosts): a step's time over what its rows alone would cost. Without that,
    the reference was the decoding steps of whatever load ran last, and while a long prompt is
    being prefilled no step runs without a piece to update it: a prompt arriving after the load
    had risen from 4 to 15 sessions saw every piece step "over target" and crawled at one layer a
    step (a 137-token prompt took 58 steps, its session's whole answer then ran alone).

    >>> b = PieceBudget(PrefillPolicy(max_piece=256, min_piece=16, cost_factor=2.0))
    >>> b.observe_decode(0.040)
    >>> for _ in range(30):  # a step costs 40 ms + 2 ms a prompt token: 2x at 20 tokens
    ...     b.observe(True, 0.040 + 0.002 * b.next(True, True), b.next(True, True))
    >>> 18 <= b.next(True, True) <= 22
    True
    """

    WINDOW = 15
    CALM_WINDOW = 64  # steps whose tail sets how far below min_piece a piece may go (`observe_calm`)
    CALM_QUANTILE = 0.9
    PIECE_WINDOW = 5

    def __init__(self, policy: PrefillPolicy, layers: int = 0, costs: "ForwardCosts | None" = None):
        self.policy = policy
        self.layers = layers
        self.costs = costs  # None: times are compared as they are (every step the same load)
        self.floor = policy.min_piece / layers if layers else float(policy.min_piece)
        # (decoding tokens, seconds) of recent steps: read against the cost curve when used, so a
        # sample and the step it is compared with are in the same units whatever the curve learnt
        self._decode_s: deque[tuple[int, float]] = deque(maxlen=self.WINDOW)
        self._calm_s: deque[tuple[int, float]] = deque(maxlen=self.CALM_WINDOW)
        # the last few steps with pieces, per kind: below min_piece the budget follows their
        # median, so one step slowed by something else (a long verify block, a new turn's prompt,
        # the host) does not split the long prompt's pieces and cut its pace
        self._piece_s = {True: deque(maxlen=self.PIECE_WINDOW), False: deque(maxlen=self.PIECE_WINDOW)}
        self._budget = {True: float(policy.min_piece), False: float(policy.min_piece)}

    def _rows_cost(self, tokens: int, floor: float) -> float:
        """What a step of `tokens` decoding tokens costs on the curve (1.0: no curve yet), never
        under `floor` (`_floor()`, read once by the caller for all the samples it reads)."""
        est = self.costs.estimate(tokens) if self.costs is not None and tokens > 0 else None
        return max(est, floor) if est else 1.0

    def _floor(self) -> float:
        """Below the curve's first point it extrapolates along a slope, which noise can make steep
        enough to reach ~0: no step is read against less than half the cheapest one measured."""
        points = self.costs.points if self.costs is not None else {}
        return 0.5 * min(points.values()) if points else 0.0

    def _relative(self, sample: tuple[int, float], floor: float) -> float:
        tokens, seconds = sample
        return seconds / self._rows_cost(tokens, floor)

    def observe_decode(self, seconds: float, tokens: int = 0) -> None:
        """A step with decoding rows (`tokens` of them) and no prompt pieces took `seconds`."""
        self._decode_s.append((tokens, seconds))

    def observe_calm(self, seconds: float, tokens: int = 0) -> None:
        """A step with decoding rows (`tokens`) and no piece of a long prompt (whole short prompts
        may ride along: a new chat turn) took `seconds`: what a stream's gaps are made of without
        long prompts."""
        self._calm_s.append((tokens, seconds))

    def _tail(self, median: float, floor: float) -> float:
        """The calm steps' CALM_QUANTILE, relative (at least the decoding median; the median until
        ten)."""
        if len(self._calm_s) < 10:
            return median
        calm = sorted(self._relative(c, floor) for c in self._calm_s)
        return max(median, calm[int(self.CALM_QUANTILE * (len(calm) - 1))])

    def next(self, rows: bool, decoding: bool) -> float:
        """The budget of a step with (`rows`) or without decoding rows, in prompt tokens (below
        min_piece: a min_piece piece through a share of the layers, `depth`); `decoding`: sessions
        are decoding (without, a step carries max_piece)."""
        if not rows and not decoding:
            return float(self.policy.max_piece)
        return self._budget[rows]

    def depth(self, budget: float) -> int:
        """Layers a min_piece piece runs through in a step with `budget` (all where it is at least
        min_piece or pieces cannot be split).

        >>> b = PieceBudget(PrefillPolicy(min_piece=4), layers=30)
        >>> b.depth(4.0), b.depth(2.0), b.depth(0.5), b.depth(0.01)
        (30, 15, 4, 1)
        """
        if not self.layers or budget >= self.policy.min_piece:
            return self.layers
        return max(1, min(self.layers, math.ceil(self.layers * budget / self.policy.min_piece - 1e-9)))

    def observe(self, rows: bool, seconds: float, carried: float, tokens: int = 0) -> None:
        """A step with prompt pieces (`carried` tokens of them, a piece through a share of the
        layers counting that share; with decoding rows or not, while sessions decode) took
        `seconds`; `tokens`: its decoding tokens (without rows: those of the last step with
        them, the step the pieces stand in for)."""
        if not self._decode_s or seconds <= 0:
            return
        factor = self.policy.cost_factor if rows else self.policy.cost_factor - 1
        # every time below is relative to what this step's decoding rows alone would cost
        floor = self._floor()  # once: the curve does not change during this call
        # no rows known yet (a rowless step before any step with rows): a one-token step's cost,
        # never 1.0, which would compare raw seconds with relative ones
        seconds /= self._rows_cost(max(1, tokens), floor)
        median = statistics.median(self._relative(d, floor) for d in self._decode_s)
        # Above min_piece the budget steers to factor x the median decoding step. Below it (a piece
        # split by layers) to factor x the calm steps' tail instead: a stream's gaps are to stay
        # near their own tail, and where that tail is long anyway (several sessions, whole new
        # turns riding along), a min_piece piece needs no split and the long prompt keeps its pace.
        target, deep = median * factor, self._tail(median, floor) * factor
        min_piece = self.policy.min_piece
        current = self._budget[rows]
        t = target if current >= min_piece else deep
        if carried < (int(current) if current >= min_piece else current * 0.999) and seconds < t:
            return  # the prompts ran out, not the budget: nothing learned about growing it
        recent = self._piece_s[rows]
        recent.append(seconds)
        smooth = statistics.median(recent)  # below min_piece: the recent steps' median, not one step
        if current >= min_piece:
            scaled = current * min(1.5, target / seconds)
            if scaled < min_piece:
                scaled = min(float(min_piece), current * min(1.5, deep / smooth))
        else:
            scaled = current * min(1.5, deep / smooth)
        self._budget[rows] = min(float(self.policy.max_piece), max(self.floor, scaled))

