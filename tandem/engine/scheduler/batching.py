"""The verifier's step loop (`BatchExecutor`): one thread plans, forwards, verifies and commits every
attached session's step together, prompt pieces beside them. What it asks of a generation is the
`Step` protocol below; `Scheduled` is the handle its reader (a gRPC handler) holds."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.contract.ids import common_prefix_len
from tandem.contract.results import StepOutput
from tandem.engine.scheduler.prefill import PieceBudget, PrefillPolicy
from tandem.engine.speculation.verify import Check, verify_rows

log = logging.getLogger("tandem.engine.scheduler.batching")


# A common prefix shorter than this is cheaper to recompute than to find and copy
SHARE_MIN_TOKENS = 32


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
    # a prompt whose cache was empty, of a scope (a tenant) whose prompts may share KV (_follow)
    scope: str | None = None
    fresh: bool = False
    copied: int = 0  # of its tokens, those copied from another prompt's KV rather than computed

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

    output: StepOutput
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


class Step(Protocol):
    """What the step loop asks of a generation it runs (tandem.engine.scheduler.generate.Generation).

    Each step: the loop calls `plan_step` (an output when the step ended the generation without a
    forward, else the block to forward), runs every planned block in one batched forward and one
    `verify_rows` call, then hands each generation its rows of logits in `finish_step`, which
    commits and returns what the step emitted. `finished` ends it; `cancel` lets go of its
    resources when its reader stopped it."""

    @property
    def finished(self) -> bool: ...

    def plan_step(self) -> PlannedStep | StepOutput: ...

    def finish_step(self, planned: PlannedStep, raw: torch.Tensor) -> StepOutput: ...

    def cancel(self) -> None: ...


class Scheduled:
    """A generation the step loop runs (BatchExecutor.attach); its reader only reads the steps.

    The loop plans, forwards, verifies and commits it with every other session's step; the reader
    (a gRPC handler) takes `StepRecord`s with `next` and may `stop` it. Up to `max_unread` steps
    are run ahead of the reader, then the session waits for it (a slow client holds nobody else).
    """

    def __init__(self, gen: Step, cond: threading.Condition, max_unread: int):
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

    def __init__(self, runner, policy: PrefillPolicy | None = None):
        self.runner = runner
        self.policy = policy or PrefillPolicy()
        # a piece can be split over steps by layers where the forward runs its layers as raw calls
        self.split_layers = runner.backend.split_layers
        self.budget = PieceBudget(self.policy, self.split_layers, runner.costs)
        self._cond = threading.Condition()
        self._queue: list[_Job] = []
        self._prefills: list[_Job] = []  # prompts being prefilled, oldest first (worker thread only)
        self._recent: list[_Job] = []  # fresh prompts finished in the last step: donors for the next
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
        # with whatever another thread last set (tandem.engine.native.threads.use_threads).
        self.threads = torch.get_num_threads()
        self._verify_s = 0.0  # the last _run's verify part
        # Per step: (decoding rows, prompt pieces' token counts, seconds). Bounded: a debugging view.
        self.history: deque[tuple[int, tuple[int, ...], float]] = deque(maxlen=self.HISTORY)
        threading.Thread(target=self._loop, daemon=True, name="step-loop").start()

    @property
    def busy_sessions(self) -> int:
        """Generations the loop is running (their rows share its steps)."""
        return len(self._attached)

    def attach(self, gen: Step, max_unread: int | None = None) -> Scheduled:
        """Run `gen` in the step loop from its next step on; read its steps from the result."""
        entry = Scheduled(gen, self._cond, max_unread or self.MAX_UNREAD)
        with self._cond:
            self._attached.append(entry)
            self._cond.notify_all()
        return entry

    def forward(self, cache, ids: list[int], all_logits: bool, alone: bool = False,
                tree: list[int] | None = None, check: Check | None = None) -> torch.Tensor | None:
        """One block from the caller's thread, run in the next step; the caller waits for it."""
        return self._wait(_Job(cache, list(ids), all_logits, threading.Event(), alone=alone, tree=tree, check=check))

    def prefill(self, cache, ids: list[int], scope: str | None = None) -> int:
        """A prompt's KV, in pieces between decoding steps; the caller waits for it. With a `scope`
        and an empty cache, its first tokens may be copied from another prompt of the scope that
        begins the same way and is being prefilled now (`_follow`). Returns the tokens copied."""
        job = _Job(cache, list(ids), False, threading.Event(), scope=scope,
                   fresh=self.runner.backend.cache_len(cache) == 0)
        self._wait(job)
        return job.copied

    def _wait(self, job: _Job) -> torch.Tensor | None:
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
        from tandem.engine.native.threads import use_threads

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

    def _follow(self) -> set[int]:
        """New prompts that begin like an older prompt of their scope (a tenant) take its KV for
        the common part instead of computing it: at once when the older one has computed that far
        (or finished in the step before), else they wait (the ids returned) while it gets there.
        Why: 32 agent sessions arriving together on a verifier with no idle session of their
        tool list each computed its 1,260 tokens (tandem.services.verifier.core shares only what
        resident idle sessions hold). Here, between steps on the loop's thread, no forward runs,
        and the positions copied are ones the older prompt has finished and will not change;
        their bits are those the new prompt would compute itself (the kernels are row-invariant:
        a position's KV depends only on the tokens up to it)."""
        recent, self._recent = self._recent, []
        if not self.runner.backend.shares_prefix:
            return set()
        waiting: set[int] = set()
        donors: list[_Job] = list(recent)
        for j in self._prefills:
            if j.scope is None or not j.fresh:
                continue
            if j.done_tokens == 0 and j.layer == 0:
                best, donor = 0, None
                for d in donors:
                    if d.scope == j.scope:
                        n = common_prefix_len(d.ids, j.ids)
                        if n > best:
                            best, donor = n, d
                if donor is not None and best >= SHARE_MIN_TOKENS:
                    if donor.done_tokens >= best:
                        self.runner.backend.copy_prefix(donor.cache, j.cache, best)
                        j.done_tokens = j.copied = best
                        if best == len(j.ids):
                            j.done.set()
                    else:
                        waiting.add(id(j))
            donors.append(j)  # only older prompts are donors: no two wait on each other
        self._prefills = [j for j in self._prefills if not j.done.is_set()]
        return waiting

    def _long(self, job: _Job) -> bool:
        """A prompt no one piece holds: its pieces are what the budget steers (and may split)."""
        return len(job.ids) > self.policy.max_piece

    def _step(self, decode: list[_Job]) -> None:
        """plan (which prompt pieces join the decoding rows) and forward."""
        decoding = bool(self._attached) or bool(decode)
        budget = self.budget.next(bool(decode), decoding)
        L, low = self.split_layers, budget < self.policy.min_piece
        following = self._follow()
        moving = [j for j in self._prefills if j.layer > 0]  # a piece part-way through the layers
        rest = [j for j in self._prefills if j.layer == 0 and id(j) not in following]
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
                if j.fresh and j.scope is not None:
                    self._recent.append(j)  # a donor for the next step's new prompts still
        self._prefills = [j for j in self._prefills if not j.done.is_set()]
        return seconds

