"""How a target's forward is run and what it costs: the native forward (tandem.engine.model.llama,
every session's block in one batched call) or any `transformers` causal LM (one sequence per
forward), and the measured cost curve that the block-length controller and the piece budget read."""

from __future__ import annotations

import bisect
import contextlib
import logging
import math
import statistics
from collections import deque

import torch
from transformers import DynamicCache

from tandem.engine.model.gemm import rows_alone

log = logging.getLogger("tandem.engine.model.backends")


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
            # extra token of a block costs ~5% of a single-token step (docs/design.md: 8 drafts ~ 1.4 steps).
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
    """The native Llama-family forward (tandem.engine.model.llama): preallocated KV, chunked LM head."""

    name = "native"

    def __init__(self, model: torch.nn.Module, quantized=None):
        from tandem.engine.model.llama import NativeLlama

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
        """dst becomes src's first `length` positions: read from src's storage in place where they
        fill whole attention runs (llama.KVCache.take_prefix: held once however many sessions
        share them), the rest copied."""
        dst.take_prefix(src, length)

    @staticmethod
    def kv_held(cache) -> tuple[int, tuple[int, int] | None]:
        """(positions the cache holds in storage of its own, its shared prefix as (an identity
        of the storage it lies in, its length) or None); an identity is also the own storage's
        `own_key` for the cache it came from."""
        pre = cache.prefix
        return cache.length - cache.off, None if pre is None else (pre.k.data_ptr(), cache.off)

    @staticmethod
    def own_key(cache) -> int:
        return cache.k.data_ptr()

    @staticmethod
    def shareable(cache, length: int) -> int:
        """Of a cache's first `length` positions, how many another cache taking them would read in
        place (KVCache.take_prefix)."""
        from tandem.engine.native.attend import SPAN

        if cache.pool is not None or length < SPAN:
            return 0
        whole = length // SPAN * SPAN
        return min(cache.off, whole) if cache.prefix is not None else whole

    batched = True  # ragged blocks of many sequences in one forward
    shares_prefix = True  # a sequence can start from a copy of another's KV prefix
    trees = True  # token-tree blocks (tree positions and mask; keep_path after verification)

    @staticmethod
    def keep_path(cache, start: int, rows: list[int]) -> None:
        from tandem.engine.model.llama import NativeLlama

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
            from tandem.engine.model.paths import ModelError

            raise ModelError("the transformers forward runs the dequantized float32 model, not the GGUF's "
                             "quantized one: load the model with precision float32 to use it")
        return HFBackend(model)
    from tandem.engine.model.llama import Unsupported

    try:
        return NativeBackend(model, quantized)
    except Unsupported as exc:
        if choice == "native":
            raise
        log.warning("using the transformers forward, one session per forward%s: %s",
                    " (the GGUF's quantized weights are dropped: the target is the float32 model)" if quantized else "", exc)
        return HFBackend(model)

