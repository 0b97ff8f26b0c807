"""The target runner: a KV cache per sequence, one forward over a block of new tokens, rollback.

Invariant of a `Sequence` between steps: `ids` are the committed tokens (prompt + output so far) and
the KV cache holds exactly `ids[:-1]`. The last committed token is *pending*: the next step feeds it
together with the k drafts, so one forward yields the k+1 distributions that verification needs:

    input  = [ids[-1], d_0, ..., d_{k-1}]          # k+1 tokens
    logits = [k+1, vocab]; row i predicts the token after input i
    accept a drafts, commit a+1 tokens (accepted drafts + recovered/bonus), crop the cache to the
    new len(ids) - 1, which drops the KV of rejected drafts.

Worked example: ids = [5, 9] (cache holds [5]); drafts [7, 3]; forward [9, 7, 3] (cache now [5, 9, 7,
3]); target argmax rows = [7, 4, ...] so a = 1 and 4 is the recovered token; ids = [5, 9, 7, 4] and
the cache is cropped to 3 entries [5, 9, 7]. The pending token is 4.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import logging

import torch
from transformers import DynamicCache

from tandem.engine.gemm import rows_alone
from tandem.engine.ids import common_prefix_len
from tandem.engine.models import LoadedModel
from tandem.engine.verify import Check, verify_rows

log = logging.getLogger("tandem.engine.runner")


@dataclass
class PrefillStats:
    reused: int  # context tokens whose KV was already resident
    computed: int  # context tokens run through the target now


class ForwardCosts:
    """The target's forward time by number of new tokens: a curve through the medians of recent
    measurements, binned by token count.

    Shared by every sequence of a runner: the cost of a forward is a property of the model and the
    machine, so a new session starts with measured costs instead of guesses. Medians, not means:
    on a shared machine one preempted forward can take ten times the usual, and must not make the
    controller give up speculating.

    Why bins, and a curve rather than a table: the controller compares C(T + k + 1) for k = 0..8 at
    the batch's T, and in a batch of many sessions a token costs a fraction of a percent of the step
    (64 sessions at 300 tokens of context: ~0.8 ms a token of a ~150 ms step, AMD EPYC). There the
    step's token count seldom repeats, so a median per count was one sample, and the noise between
    neighbouring counts (measured: 143 tokens 129 ms, 144 tokens 101 ms, 164 tokens 252 ms) read as
    slopes, often negative: a block looked free wherever a low sample lay next to it, every session
    drafted into it, and speculation ran 0.85x plain decoding at 64 two-turn sessions. So counts up
    to EXACT keep a bin each (a lone session's blocks, which recur, and whose first extra tokens are
    nearly free on a CPU: a shape no line has), and above that a bin spans a factor of BIN_RATIO.
    A bin's point is (median count, median seconds) of its last WINDOW samples (for a cost that
    grows with the count, the median time is the time at the median count); the points are pooled
    where noise made the curve fall (pool-adjacent-violators: a pooled pair becomes one point at
    their weighted mean, so no flat stretch appears where extra tokens would look free), and
    `estimate` interpolates between them. A slope then spans a bin's width, not one token.

    >>> c = ForwardCosts()
    >>> for n in (60, 61, 62, 90, 91, 92):  # noisy: 61 and 91 tokens measured low
    ...     c.observe(n, 0.032 + 0.0008 * n - (0.004 if n % 10 == 1 else 0.0))
    >>> round(c.estimate(80) * 1e3)  # the truth: 32 ms + 0.8 ms a token = 96 ms
    95
    >>> c.estimate(92) > c.estimate(91) > c.estimate(90)  # a step more never looks cheaper
    True
    """

    WINDOW = 31  # samples a bin keeps: a wide bin's come from many counts, and its median must be steady
    EXACT = 16  # token counts up to this keep a bin of their own
    BIN_RATIO = 2 ** 0.5

    def __init__(self) -> None:
        self._samples: dict[int, deque[tuple[int, float]]] = {}  # bin -> recent (tokens, seconds)
        self._bin_points: dict[int, tuple[float, float, int]] = {}  # bin -> (median count, median s, samples)
        # The curve, rising with the count: token counts (a bin's median, may be fractional), seconds.
        self._xs: list[float] = []
        self._ys: list[float] = []

    @property
    def points(self) -> dict[float, float]:
        """The curve: token count -> seconds."""
        return dict(zip(self._xs, self._ys))

    @points.setter
    def points(self, curve: dict[float, float]) -> None:  # a fixed curve (tests)
        self._xs = sorted(curve)
        self._ys = [curve[x] for x in self._xs]

    @classmethod
    def _bin(cls, num_tokens: int) -> int:
        if num_tokens <= cls.EXACT:
            return num_tokens
        return cls.EXACT + 1 + int(math.log(num_tokens / cls.EXACT) / math.log(cls.BIN_RATIO))

    def observe(self, num_tokens: int, seconds: float) -> None:
        b = self._bin(num_tokens)
        window = self._samples.setdefault(b, deque(maxlen=self.WINDOW))
        window.append((num_tokens, seconds))
        # Only this bin's point changed (a step observes once: the medians of one window, not all).
        self._bin_points[b] = (statistics.median(n for n, _ in window), statistics.median(s for _, s in window),
                               len(window))
        self._refit()

    def _refit(self) -> None:
        # The bins' points in count order, pooled until the seconds rise with the count.
        pooled: list[tuple[float, float, float]] = []
        for b in sorted(self._bin_points):
            pooled.append(self._bin_points[b])
            while len(pooled) > 1 and pooled[-1][1] <= pooled[-2][1]:
                (x1, y1, w1), (x2, y2, w2) = pooled.pop(-2), pooled.pop()
                w = w1 + w2
                pooled.append(((x1 * w1 + x2 * w2) / w, (y1 * w1 + y2 * w2) / w, w))
        self._xs, self._ys = [p[0] for p in pooled], [p[1] for p in pooled]

    def estimate(self, num_tokens: int) -> float | None:
        """Seconds for a forward over `num_tokens` new tokens, interpolated from the curve."""
        xs, ys = self._xs, self._ys
        if not xs:
            return None
        if len(xs) == 1:
            # One point only: assume the measured shape of a small dense model on a CPU, where each
            # extra token of a block costs ~5% of a single-token step (DESIGN.md: 8 drafts ~ 1.4 steps).
            return ys[0] * (1 + 0.05 * (num_tokens - 1)) / (1 + 0.05 * (xs[0] - 1))
        i = bisect.bisect_left(xs, num_tokens)
        if i < len(xs) and xs[i] == num_tokens:
            return ys[i]
        # between two points, or beyond the ends along the nearest two points' slope
        i = min(max(i, 1), len(xs) - 1)
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        return max(1e-6, ys[i - 1] + slope * (num_tokens - xs[i - 1]))


class NominalCosts:
    """A fixed cost curve, forward(n tokens) = 1 + 0.05 (n - 1) in units of a plain step.

    Used where a choice must not depend on timing: a seeded sampled request must replay exactly, and
    its random draws follow its block lengths, so those may depend only on the text.
    """

    def estimate(self, num_tokens: int) -> float:
        return 1.0 + 0.05 * (num_tokens - 1)


class HFBackend:
    """Any `transformers` causal LM, with its DynamicCache (one sequence per forward)."""

    name = "transformers"

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.device = next(model.parameters()).device

    def new_cache(self) -> DynamicCache:
        return DynamicCache()

    @staticmethod
    def cache_len(cache: DynamicCache) -> int:
        return cache.get_seq_length()

    @staticmethod
    def crop(cache: DynamicCache, length: int) -> None:
        excess = cache.get_seq_length() - length
        if excess > 0:
            cache.crop(-excess)  # transformers >= 5: a negative count removes from the end

    batched = False  # one sequence per forward: a batch runs its blocks one after another
    shares_prefix = False  # no KV copy between sequences: each prefills its own
    trees = False  # no token-tree blocks: proposers' trees are verified as their best chain
    rows_alone = False  # no forward whose rows get the bits they would alone (see NativeBackend)
    split_layers = 0  # prompt pieces run whole (see NativeBackend)

    @torch.inference_mode()
    def forward(self, cache: DynamicCache, input_ids: list[int], all_logits: bool, alone: bool = False,
                tree: list[int] | None = None) -> torch.Tensor | None:
        if tree is not None:
            raise ValueError("the transformers backend runs no token trees (trees = False)")
        # `alone` cannot be honoured here (rows_alone is False): TargetRunner never asks for it.
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)  # [1, n]
        out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=0 if all_logits else 1)
        return out.logits[0].float() if all_logits else None  # [n, vocab]

    def forward_batch(self, blocks: list[tuple], need: list[bool], alone: bool = False,
                      trees: list | None = None, layers: list | None = None) -> list[torch.Tensor | None]:
        if layers is not None:
            raise ValueError("the transformers backend runs no pieces split by layers (split_layers = 0)")
        trees = trees or [None] * len(blocks)
        return [self.forward(cache, ids, n, tree=t) for (cache, ids), n, t in zip(blocks, need, trees)]


class NativeBackend:
    """The native Llama-family forward (tandem.engine.llama): preallocated KV, chunked LM head."""

    name = "native"

    def __init__(self, model: torch.nn.Module, quantized=None):
        from tandem.engine.llama import NativeLlama

        self.impl = NativeLlama(model, quantized=quantized)

    def new_cache(self):
        return self.impl.new_cache()

    @staticmethod
    def cache_len(cache) -> int:
        return cache.length

    @staticmethod
    def crop(cache, length: int) -> None:
        cache.crop_to(length)

    @staticmethod
    @torch.inference_mode()  # dst may hold inference tensors already (a resident session's cache)
    def copy_prefix(src, dst, length: int) -> None:
        dst.ensure(length)
        dst.k[:, :, :length] = src.k[:, :, :length]
        dst.v[:, :, :length] = src.v[:, :, :length]
        dst.length = length

    batched = True  # ragged blocks of many sequences in one forward
    shares_prefix = True  # a sequence can start from a copy of another's KV prefix
    trees = True  # token-tree blocks (tree positions and mask; keep_path after verification)

    @staticmethod
    def keep_path(cache, start: int, rows: list[int]) -> None:
        from tandem.engine.llama import NativeLlama

        NativeLlama.keep_path(cache, start, rows)

    @property
    def rows_alone(self) -> bool:
        """Whether `alone=True` forwards are batch-invariant: each row's logits and KV the bits a
        one-token step gets (gemm.rows_alone with our attention and row kernels)."""
        return self.impl.can_run_rows_alone

    def forward(self, cache, input_ids: list[int], all_logits: bool, alone: bool = False,
                tree: list[int] | None = None) -> torch.Tensor | None:
        return self.forward_batch([(cache, input_ids)], [all_logits], alone, [tree])[0]

    @property
    def split_layers(self) -> int:
        """Layers a prompt piece can be split over, one range per step (`forward_batch`'s
        `layers`); 0: pieces run whole."""
        return self.impl.n_layers if self.impl.splits_layers else 0

    def forward_batch(self, blocks: list[tuple], need: list[bool], alone: bool = False,
                      trees: list | None = None, layers: list | None = None) -> list[torch.Tensor | None]:
        with rows_alone() if alone and self.rows_alone else contextlib.nullcontext():
            return self.impl.forward_batch([(ids, cache) for cache, ids in blocks], need, trees, layers)


def make_backend(model: torch.nn.Module, choice: str = "auto", quantized=None):
    """`auto`: native for the Llama family, transformers otherwise (saying why, once). `quantized`
    (LoadedModel.quantized): the GGUF's quantized weights, which only the native forward runs;
    asking for the transformers forward with them is refused (it would be another target: the
    dequantized float32 model; load with precision float32 for that)."""
    if choice == "transformers":
        if quantized is not None:
            from tandem.engine.models import ModelError

            raise ModelError("the transformers forward runs the dequantized float32 model, not the GGUF's "
                             "quantized one: load the model with precision float32 to use it")
        return HFBackend(model)
    from tandem.engine.llama import Unsupported

    try:
        return NativeBackend(model, quantized)
    except Unsupported as exc:
        if choice == "native":
            raise
        log.warning("using the transformers forward, one session per forward%s: %s",
                    " (the GGUF's quantized weights are dropped: the target is the float32 model)" if quantized else "", exc)
        return HFBackend(model)


class TargetRunner:
    """Owns a causal LM and runs forwards for its sequences. Not thread-safe: one caller at a time."""

    def __init__(self, loaded: LoadedModel, backend: str = "auto", prefill_chunk: int = 256):
        """`prefill_chunk`: the longest piece of a prompt one forward runs (PrefillPolicy)."""
        self.loaded = loaded
        self.prefill_chunk = prefill_chunk
        self.model = loaded.model
        self.backend = make_backend(loaded.model, backend, loaded.quantized)
        self.costs = ForwardCosts()
        self.nominal_costs = NominalCosts()
        self.executor: BatchExecutor | None = None

    @property
    def vocab_size(self) -> int:
        return self.loaded.vocab_size

    @property
    def precision(self) -> str:
        """What the target computes in, which is what "lossless" is judged against: e.g.
        "GGUF Q4_1 + Q8_0" (the file's quantized weights, tandem.engine.quant) or "float32"."""
        impl = getattr(self.backend, "impl", None)
        if impl is not None:
            return impl.precision
        return str(next(self.model.parameters()).dtype).replace("torch.", "")

    @property
    def trees_ok(self) -> bool:
        """Whether generations may verify token trees here: the backend runs them, and the forward
        is not the batch-invariant one (there a chain's rows have plain decoding's bits; a tree row's
        ancestors sit at other key slots, so its attention sums in another order)."""
        impl = getattr(self.backend, "impl", None)
        return self.backend.trees and not (impl is not None and impl.batch_invariant)

    def new_sequence(self) -> "Sequence":
        return Sequence(self)

    def forward(self, cache, input_ids: list[int], *, all_logits: bool = True, alone: bool = False,
                tree: list[int] | None = None, check: Check | None = None) -> torch.Tensor | None:
        """Run `input_ids` on top of `cache` (which grows by len(input_ids)).

        Returns logits `# [len(input_ids), vocab]` float32 when `all_logits`, else None (prefill
        skips the LM head, ~20% of a small model's cost per token). `alone`: where the backend can
        (`backend.rows_alone`), each row is computed with the bits it would get in a one-token
        step, whatever the batch (for logprobs equal to plain decoding's); such forwards are slower
        and left out of the cost model. `tree`: the block is a token tree (NativeLlama.forward_batch:
        parents of its rows), where `backend.trees`; it costs what a chain of as many tokens costs.
        `check`: the block's verification, run on these logits (tandem.engine.verify.verify_rows;
        the step loop runs every row's check of a step together); its outcome lands in the check.
        """
        alone = alone and self.backend.rows_alone
        if self.executor is not None:
            return self.executor.forward(cache, input_ids, all_logits, alone, tree, check)
        if not all_logits and tree is None and len(input_ids) > self.prefill_chunk:
            # A long prompt in pieces: attention memory grows with piece x context, not context^2
            # (an 8k prompt in one piece is slower too: 4,096 tokens 9.6 s whole vs 6.7 s in 256s).
            for at in range(0, len(input_ids), self.prefill_chunk):
                self.backend.forward(cache, input_ids[at : at + self.prefill_chunk], False)
            return None
        start = time.perf_counter()
        logits = self.backend.forward(cache, input_ids, all_logits, alone, tree)
        if all_logits and not alone:
            self.costs.observe(len(input_ids), time.perf_counter() - start)
        if check is not None:
            verify_rows([check], [logits])
        return logits

    def enable_batching(self, prefill: "PrefillPolicy | None" = None) -> "BatchExecutor":
        """From now on one step loop runs every forward: generations attached to it
        (`BatchExecutor.attach`) and blocks of concurrent callers run batched, and prompts are
        prefilled in pieces that share steps with decoding (`prefill`)."""
        if self.executor is None:
            policy = prefill or PrefillPolicy(max_piece=self.prefill_chunk)
            self.executor = BatchExecutor(self, policy)
        return self.executor


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


@dataclass
class _Job:
    cache: object
    ids: list[int]
    all_logits: bool
    done: threading.Event
    alone: bool = False  # computed as rows alone (TargetRunner.forward): batched only with its kind
    tree: list[int] | None = None  # a token-tree block's row parents
    check: Check | None = None  # the block's verification, run with the step's other rows
    result: torch.Tensor | None = None
    error: BaseException | None = None
    done_tokens: int = 0  # a prefill's tokens already run (the executor runs it in pieces)
    # a piece part-way through the layers (split over steps): its tokens, the next layer to run and
    # its residual stream after the layer before (PieceBudget)
    piece: int = 0
    layer: int = 0
    hidden: torch.Tensor | None = None
    start_ns: int = 0  # when a generation planned it (wall clock, for its trace span)

    @property
    def prefill(self) -> bool:
        """A prompt (no logits wanted): run in pieces between decoding steps."""
        return not self.all_logits and self.tree is None and not self.alone


@dataclass
class PlannedStep:
    """A decode step's forward as its generation planned it (spec.Generation.plan_step): the block
    `inputs` (the pending token, then the drafts) on top of `cache`, the step's verification
    (`check`), and the generation's own notes for finishing the step (`state`)."""

    cache: object
    inputs: list[int]
    check: Check
    alone: bool = False  # each row with a one-token step's bits (TargetRunner.forward)
    tree: list[int] | None = None  # row parents of a token tree (Sequence.tree_rows)
    state: object = None


@dataclass
class StepRecord:
    """One step of a scheduled generation, as its reader gets it."""

    output: object  # spec.StepOutput
    start_ns: int  # wall clock (time.time_ns) when the step was planned and when it committed
    end_ns: int
    batch_size: int  # rows and prompt pieces in the forward that ran it (1: alone)


@dataclass(frozen=True)
class StepPhases:
    """Where one step of the loop spent its time (seconds), and what it carried."""

    rows: int  # decoding rows of attached generations (verify blocks, plain steps)
    tokens: int  # their tokens (pending + drafts)
    committed: int  # tokens they committed
    pieces: int  # prompt tokens carried beside them
    plan: float
    forward: float
    verify: float
    commit: float


class Scheduled:
    """A generation the step loop runs (BatchExecutor.attach); its reader only reads the steps.

    The generation must offer `plan_step() -> PlannedStep | output` (an output when the step ended
    it without a forward), `finish_step(planned, logits) -> output`, `finished` and `cancel()`.
    The loop plans, forwards, verifies and commits it with every other session's step; the reader
    (a gRPC handler) takes `StepRecord`s with `next` and may `stop` it. Up to `max_unread` steps
    are run ahead of the reader, then the session waits for it (a slow client holds nobody else).
    """

    def __init__(self, gen, cond: threading.Condition, max_unread: int):
        self.gen = gen
        self._cond = cond
        self.max_unread = max_unread
        self._records: deque[StepRecord] = deque()
        self._stop = False
        self.error: BaseException | None = None
        self.detached = False  # the loop will not touch the generation again (guarded by cond)

    @property
    def ready(self) -> bool:
        """The loop should take it up at its next step (under the condition's lock)."""
        return not self.detached and (self._stop or len(self._records) < self.max_unread)

    def next(self, timeout_s: float) -> StepRecord | None:
        """The next step, or None when none came within `timeout_s` or none will come (the
        generation ended or stopped: see `done`). Raises the error that failed the generation."""
        with self._cond:
            end = time.monotonic() + timeout_s
            while not self._records and not self.detached:
                left = end - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            if self._records:
                rec = self._records.popleft()
                self._cond.notify_all()  # room to run ahead again
                return rec
            if self.error is not None:
                raise self.error
            return None

    @property
    def done(self) -> bool:
        """No step is left to read and the loop has let go of the generation."""
        with self._cond:
            return self.detached and not self._records

    def stop(self, timeout_s: float | None = None) -> bool:
        """Ask the loop to let go of the generation before its next step; wait until it has (the
        caller may then touch the generation and its sequence). False: not within `timeout_s`."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            end = None if timeout_s is None else time.monotonic() + timeout_s
            while not self.detached:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    # -- the loop's side (its thread only) ----------------------------------------------------

    def _deliver(self, rec: StepRecord) -> None:
        with self._cond:
            self._records.append(rec)
            self._cond.notify_all()

    def _detach(self, error: BaseException | None = None) -> None:
        with self._cond:
            if error is not None and self.error is None:
                self.error = error
            self.detached = True
            self._cond.notify_all()


class BatchExecutor:
    """The verifier's step loop: one thread runs every session's step, together.

    Each step has four parts. **plan**: every attached generation (`attach`) that its reader keeps
    up with plans its block (drafts from its proposer, the block length from the batch cost model)
    and prompts waiting to be prefilled get pieces within the step's token budget (`PrefillPolicy`,
    `PieceBudget`); **forward**: one ragged batched forward over all of it (prompt pieces, verify
    blocks, plain steps, token trees); **verify**: every row's check in one `verify_rows` call (one
    kernel call per kind, greedy and sampled rows together); **commit**: each generation advances
    its KV and output and tells its drafter, and its step goes to its reader. No session has a
    thread of its own: gRPC handlers attach a generation and read its steps.

    Prompts come from the handlers' own threads (`forward` with no logits wanted: the caller waits
    while the loop runs them in pieces beside the decoding rows), so a long prompt arriving does not
    stop the sessions that are streaming. `forward` with logits also still works from any thread
    (one block, run in the next step): what tests and other callers use.
    """

    HISTORY = 4096  # steps kept in `history` (for tests and debugging)
    MAX_UNREAD = 8  # steps a generation runs ahead of its reader

    def __init__(self, runner: "TargetRunner", policy: PrefillPolicy | None = None):
        self.runner = runner
        self.policy = policy or PrefillPolicy()
        # a piece can be split over steps by layers where the forward runs its layers as raw calls
        self.split_layers = runner.backend.split_layers
        self.budget = PieceBudget(self.policy, self.split_layers, runner.costs)
        self._cond = threading.Condition()
        self._queue: list[_Job] = []
        self._prefills: list[_Job] = []  # prompts being prefilled, oldest first (worker thread only)
        self._attached: list[Scheduled] = []  # generations the loop runs, in arrival order
        self.last_batch_tokens = 0
        self.last_batch_size = 0
        self.batches = 0
        self.prefill_pieces = 0  # prompt pieces run
        self.prefill_tokens = 0  # their tokens
        self.mixed_steps = 0  # steps that carried prompt pieces and decoding rows together
        self.verified_rows = 0  # rows verified by the step loop (verify_rows, batched per step)
        # The last step's attached rows: (tokens, committed) in all, which a planning generation
        # reads, less its own, as what the others add to the next forward (Generation._batch_load).
        self.last_rows = (0, 0, 0)  # (rows, tokens, committed)
        self.steps_planned = 0  # steps that carried attached generations (last_rows is the newest's)
        self.phases: deque[StepPhases] = deque(maxlen=self.HISTORY)
        self.on_step: Callable[[StepPhases], None] | None = None  # e.g. the verifier's metrics
        # The loop thread runs every forward with the creating thread's OpenMP thread count, not
        # with whatever another thread last set (tandem.engine.threads.use_threads).
        self.threads = torch.get_num_threads()
        self._verify_s = 0.0  # the last _run's verify part
        # Per step: (decoding rows, prompt pieces' token counts, seconds). Bounded: a debugging view.
        self.history: deque[tuple[int, tuple[int, ...], float]] = deque(maxlen=self.HISTORY)
        threading.Thread(target=self._loop, daemon=True, name="step-loop").start()

    @property
    def busy_sessions(self) -> int:
        """Generations the loop is running (their rows share its steps)."""
        return len(self._attached)

    def attach(self, gen, max_unread: int | None = None) -> Scheduled:
        """Run `gen` in the step loop from its next step on; read its steps from the result."""
        entry = Scheduled(gen, self._cond, max_unread or self.MAX_UNREAD)
        with self._cond:
            self._attached.append(entry)
            self._cond.notify_all()
        return entry

    def forward(self, cache, ids: list[int], all_logits: bool, alone: bool = False,
                tree: list[int] | None = None, check: Check | None = None) -> torch.Tensor | None:
        """One block from the caller's thread, run in the next step; the caller waits for it."""
        job = _Job(cache, list(ids), all_logits, threading.Event(), alone=alone, tree=tree, check=check)
        if job.prefill and not job.ids:
            return None  # nothing to run (and a piece plan never finishes an empty prompt)
        with self._cond:
            self._queue.append(job)
            self._cond.notify_all()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def _loop(self) -> None:
        from tandem.engine.threads import use_threads

        use_threads(self.threads)
        while True:
            with self._cond:
                while not self._queue and not self._prefills and not any(e.ready for e in self._attached):
                    self._cond.wait()
                queued, self._queue = self._queue, []
                entries = [e for e in self._attached if e.ready]
            self._prefills.extend(j for j in queued if j.prefill)
            t0 = time.perf_counter()
            planned = self._plan(entries)
            t1 = time.perf_counter()
            pieces_before = self.prefill_tokens
            self._verify_s = 0.0
            step_jobs = [job for _, _, job in planned]
            decode = [j for j in queued if not j.prefill and not j.alone] + [j for j in step_jobs if not j.alone]
            # Rows-alone jobs run as their own batch: the others keep the plan's (faster) paths.
            alone = [j for j in queued if j.alone] + [j for j in step_jobs if j.alone]
            try:
                self._step(decode)
            except Exception as exc:  # a fault in planning: fail this step's sessions, never the loop
                log.exception("step planning failed; %d sessions get the error", len(decode) + len(self._prefills))
                for j in [*decode, *self._prefills]:
                    j.error = exc
                    j.done.set()
                self._prefills = []
            if alone:
                self._run(alone, [], alone=True)
            t2 = time.perf_counter()
            committed = self._commit(planned)
            if planned:
                t3 = time.perf_counter()
                tokens = sum(len(job.ids) for _, _, job in planned)
                self.last_rows = (len(planned), tokens, committed)
                self.steps_planned += 1
                phases = StepPhases(len(planned), tokens, committed, self.prefill_tokens - pieces_before,
                                    t1 - t0, t2 - t1 - self._verify_s, self._verify_s, t3 - t2)
                self.phases.append(phases)
                if self.on_step is not None:
                    self.on_step(phases)

    def _plan(self, entries: list[Scheduled]) -> list[tuple[Scheduled, PlannedStep, _Job]]:
        """plan: each generation's block for this step (drafts, verification); a generation that
        was stopped or ended without a forward is let go here."""
        planned = []
        for entry in entries:
            gen = entry.gen
            if entry._stop or gen.finished:
                self._let_go(entry)
                continue
            start_ns = time.time_ns()
            try:
                step = gen.plan_step()
            except Exception as exc:  # this session's fault (its proposer, its grammar): its error
                log.exception("planning a step failed; the session gets the error")
                self._let_go(entry, exc)
                continue
            if not isinstance(step, PlannedStep):  # it ended without a forward (a grammar dead end)
                entry._deliver(StepRecord(step, start_ns, time.time_ns(), 0))
                if gen.finished:
                    self._let_go(entry)
                continue
            job = _Job(step.cache, step.inputs, True, threading.Event(), alone=step.alone, tree=step.tree,
                       check=step.check, start_ns=start_ns)
            planned.append((entry, step, job))
        return planned

    def _commit(self, planned: list[tuple[Scheduled, PlannedStep, _Job]]) -> int:
        """commit: each generation takes its verdict (KV, output, its drafter told); the step
        goes to its reader. Returns the tokens committed."""
        size = self.last_batch_size
        committed = 0
        for entry, step, job in planned:
            if job.error is not None:
                self._let_go(entry, job.error)
                continue
            try:
                out = entry.gen.finish_step(step, job.result)
            except Exception as exc:
                log.exception("committing a step failed; the session gets the error")
                self._let_go(entry, exc)
                continue
            committed += len(step.check.result().tokens)
            entry._deliver(StepRecord(out, job.start_ns, time.time_ns(), 1 if job.alone else size))
            if entry.gen.finished:
                self._let_go(entry)
        return committed

    def _let_go(self, entry: Scheduled, error: BaseException | None = None) -> None:
        with self._cond:
            if entry in self._attached:
                self._attached.remove(entry)
        entry._detach(error)

    def _long(self, job: _Job) -> bool:
        """A prompt no one piece holds: its pieces are what the budget steers (and may split)."""
        return len(job.ids) > self.policy.max_piece

    def _step(self, decode: list[_Job]) -> None:
        """plan (which prompt pieces join the decoding rows) and forward."""
        decoding = bool(self._attached) or bool(decode)
        budget = self.budget.next(bool(decode), decoding)
        L, low = self.split_layers, budget < self.policy.min_piece
        moving = [j for j in self._prefills if j.layer > 0]  # a piece part-way through the layers
        rest = [j for j in self._prefills if j.layer == 0]
        # Only a long prompt's tail stays in the budget once started. A short one (one piece holds
        # it) may have got a first min_piece piece only because whole prompts filled that step; it
        # goes whole at its next step, as a new chat turn would (held to the budget, a 137-token
        # prompt took 14 steps beside 15 sessions, growing from 4 tokens a step).
        long = [self._long(j) for j in rest]
        plan, whole = self.policy.split(int(budget) if not moving else 0, [len(j.ids) - j.done_tokens for j in rest],
                                        [lg and j.done_tokens > 0 for j, lg in zip(rest, long)])
        # pieces: (job, tokens, first layer, end layer); beside a moving piece, whole short prompts only
        pieces = [(j, n, 0, L) for j, n, lg in zip(rest, plan, long)
                  if n > 0 and (not moving or (not lg and j.done_tokens + n == len(j.ids)))]
        if moving:
            j = moving[0]
            pieces.append((j, j.piece, j.layer, min(L, j.layer + (L if not low else self.budget.depth(budget)))))
        elif L and low:  # the oldest long prompt's min_piece piece, through a share of the layers
            for i, (j, n, _, _) in enumerate(pieces):
                if self._long(j):
                    pieces[i] = (j, n, 0, self.budget.depth(budget))
                    break
        if decode or pieces:
            seconds = self._run(decode, pieces)
            # Steps with whole prompts are outside the budget's control: they teach it nothing.
            if seconds is not None and pieces and decoding and not whole:
                carried = sum(n * ((e - a) / L if L else 1.0) for _, n, a, e in pieces)
                rows = sum(len(j.ids) for j in decode) if decode else self.last_rows[1]
                self.budget.observe(bool(decode), seconds, carried, rows)

    def _run(self, jobs: list[_Job], pieces: list[tuple[_Job, int, int, int]], alone: bool = False) -> float | None:
        """One forward of `jobs` and prompt `pieces` (job, tokens, first and end layer); its
        seconds (None: it failed)."""
        start = time.perf_counter()
        blocks = [(j.cache, j.ids) for j in jobs] + [(j.cache, j.ids[j.done_tokens : j.done_tokens + n])
                                                     for j, n, _, _ in pieces]
        need = [j.all_logits for j in jobs] + [False] * len(pieces)
        trees = [j.tree for j in jobs] + [None] * len(pieces)
        L = self.split_layers
        split = [(a, e, j.hidden) if (a, e) != (0, L) else None for j, _, a, e in pieces]
        layers = [None] * len(jobs) + split if any(sp is not None for sp in split) else None
        try:
            outs = self.runner.backend.forward_batch(blocks, need, alone,
                                                     trees if any(t is not None for t in trees) else None, layers)
        except BaseException as exc:  # every waiting session learns of it
            for j in [*jobs, *(j for j, *_ in pieces)]:
                j.error = exc
                j.done.set()
            self._prefills = [j for j in self._prefills if j.error is None]
            return None
        seconds = time.perf_counter() - start
        total = sum(len(ids) for _, ids in blocks)
        if jobs and not pieces and all(j.all_logits for j in jobs) and not alone:
            self.runner.costs.observe(total, seconds)
        rows = sum(len(j.ids) for j in jobs)
        if jobs and not pieces and not alone:
            self.budget.observe_decode(seconds, rows)
        if jobs and not alone and not any(self._long(j) for j, *_ in pieces):
            self.budget.observe_calm(seconds, rows)
        self.last_batch_tokens, self.last_batch_size = total, len(jobs) + len(pieces)
        self.batches += 1
        # a piece through a share of the layers is recorded as that share of its tokens
        self.history.append((len(jobs), tuple(n if (a, e) == (0, L) else n * (e - a) / L for _, n, a, e in pieces),
                             seconds))
        done = [(j, n) for j, n, _, e in pieces if e == L]  # pieces through their last layer
        self.prefill_pieces += len(done)
        self.prefill_tokens += sum(n for _, n in done)
        self.mixed_steps += bool(jobs and pieces)
        checked = [(j, out) for j, out in zip(jobs, outs) if j.check is not None]
        if checked:
            # verify: every row's check in one kernel call per kind (a row's fault is its own)
            t = time.perf_counter()
            verify_rows([j.check for j, _ in checked], [out for _, out in checked])
            self._verify_s += time.perf_counter() - t
            self.verified_rows += len(checked)
        for j, out in zip(jobs, outs):
            j.result = out
            j.done.set()
        for (j, n, _, e), out in zip(pieces, outs[len(jobs):]):
            if e < L:  # part-way: the next step continues it from its residual stream
                j.piece, j.layer, j.hidden = n, e, out
                continue
            j.piece, j.layer, j.hidden = 0, 0, None
            j.done_tokens += n
            if j.done_tokens == len(j.ids):
                j.done.set()
        self._prefills = [j for j in self._prefills if not j.done.is_set()]
        return seconds


class Sequence:
    """One sequence's committed tokens and KV cache (see the module docstring for the invariant)."""

    def __init__(self, runner: TargetRunner):
        self.runner = runner
        self.cache = runner.backend.new_cache()
        self.ids: list[int] = []

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def cached_len(self) -> int:
        return self.runner.backend.cache_len(self.cache)

    def set_context(self, context_ids: list[int]) -> PrefillStats:
        """Make the committed tokens equal `context_ids`, reusing the longest resident prefix.

        A later turn of a conversation extends the previous one, so only its new tokens are computed;
        a context that diverges earlier rolls the cache back to the divergence first.
        """
        if not context_ids:
            raise ValueError("a sequence needs at least one context token")
        common = common_prefix_len(self.ids[: self.cached_len], context_ids)
        # The cache may hold at most context[:-1]: the last context token stays pending.
        keep = min(common, len(context_ids) - 1)
        self.rollback(keep)
        todo = context_ids[keep:-1]
        if todo:
            self.runner.forward(self.cache, todo, all_logits=False)
        self.ids = list(context_ids)
        return PrefillStats(reused=keep, computed=len(todo))

    def block_inputs(self, drafts: list[int]) -> list[int]:
        """A step's forward input: the pending token, then the drafts."""
        assert self.cached_len == len(self.ids) - 1, "cache must hold ids[:-1] between steps"
        return [self.ids[-1], *drafts]

    @staticmethod
    def tree_rows(parents: list[int]) -> list[int]:
        """The forward's row parents for a token tree behind the pending token (row 0)."""
        return [-1] + [p + 1 for p in parents]

    def forward_block(self, drafts: list[int], *, alone: bool = False, check: Check | None = None) -> torch.Tensor:
        """One target forward over the pending token and `drafts`; logits `# [k+1, vocab]`.
        `alone`: each row as a one-token step computes it; `check`: the step's verification, run
        on these logits (TargetRunner.forward)."""
        return self.runner.forward(self.cache, self.block_inputs(drafts), alone=alone, check=check)

    def forward_tree(self, drafts: list[int], parents: list[int], *, check: Check | None = None) -> torch.Tensor:
        """One target forward over the pending token and a token tree (`parents[i]`: the draft node
        that node i follows, -1 for the pending token; topological order); logits `# [k+1, vocab]`,
        row i+1 after node i. Then `commit_tree` keeps the accepted path."""
        return self.runner.forward(self.cache, self.block_inputs(drafts), tree=self.tree_rows(parents), check=check)

    def commit_tree(self, tokens: list[int], nodes: list[int]) -> None:
        """`commit` after `forward_tree`: `nodes` are the accepted path's node indices (the first
        len(nodes) of `tokens`); their KV moves next to the pending token's, the rest is dropped."""
        start = len(self.ids) - 1
        self.runner.backend.keep_path(self.cache, start, [0] + [i + 1 for i in nodes])
        self.commit(tokens)

    def commit(self, tokens: list[int]) -> None:
        """Append the step's committed tokens (accepted drafts + one recovered/bonus token) and drop
        the KV of everything after the new pending token."""
        self.ids.extend(tokens)
        self.rollback(len(self.ids) - 1)

    def truncate(self, length: int) -> None:
        """Keep the first `length` committed tokens, the last of them pending (its KV dropped)."""
        if not 0 < length <= len(self.ids):
            raise ValueError(f"cannot keep {length} of {len(self.ids)} tokens")
        del self.ids[length:]
        self.rollback(length - 1)

    def share_from(self, other: "Sequence", length: int) -> None:
        """Take the first `length` positions of another sequence's KV (a copy: both stay
        independent) instead of computing them; then `set_context` computes only the rest."""
        self.runner.backend.copy_prefix(other.cache, self.cache, length)
        self.ids = list(other.ids[:length])

    # A common prefix shorter than this is cheaper to recompute than to find and copy
    SHARE_MIN_TOKENS = 32

    def share_longest(self, donors: Iterable["Sequence"], context_ids: list[int]) -> int:
        """Copy the KV of the longest prefix of `context_ids` that one of `donors` holds (a common
        system prompt, a tool schema) into this sequence, when that beats what it holds itself by at
        least SHARE_MIN_TOKENS. The last context token stays pending, so at most len - 1 positions
        are taken. Returns the length copied (0: nothing worth sharing, or a backend without it).

        Example: donors hold [sys..., toolsA..., q1...]; context [sys..., toolsA..., q2...] takes
        len(sys + toolsA) positions, then `set_context` computes only q2."""
        if not self.runner.backend.shares_prefix:
            return 0
        own = common_prefix_len(self.ids[: self.cached_len], context_ids)
        best, donor = own, None
        for other in donors:
            if other is self:
                continue
            n = common_prefix_len(other.ids[: other.cached_len], context_ids)
            if n > best:
                best, donor = n, other
        best = min(best, len(context_ids) - 1)
        if donor is None or best - own < self.SHARE_MIN_TOKENS:
            return 0
        self.share_from(donor, best)
        return best

    def rollback(self, length: int) -> None:
        """Crop the KV cache to its first `length` entries (a no-op when it is not longer)."""
        self.runner.backend.crop(self.cache, length)
