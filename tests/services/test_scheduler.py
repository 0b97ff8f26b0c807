"""The verifier's step loop under load: chunked prefill next to decoding, and the admission queue.

Real verifier cores on the tiny random Llama (native backend); progress is measured in steps
(the executor's history and the streams' step counts), never in wall-clock time.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from tandem import kernels
from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig
from tandem.contract.results import GenerationResult
from tandem.engine.scheduler.generate import Engine
from tandem.engine.scheduler.prefill import PieceBudget, PrefillPolicy
from tandem.services.verifier.core import Cancelled, Overloaded, VerifierCore
from tandem.services.verifier.settings import VerifierSettings

NONE = SpecConfig(strategy=DraftStrategy.none)
NGRAM = SpecConfig(strategy=DraftStrategy.ngram, adaptive=False, max_draft_tokens=3)


def _core(loaded, **kw) -> VerifierCore:
    # evict_after_idle_s 0 unless a test is about it: the others evict what LRU order says at once
    return VerifierCore(VerifierSettings(**{"verifier_id": "v-sched", "port": 0, "evict_after_idle_s": 0.0, **kw}),
                        loaded)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(10, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _in_threads(run, args: list[tuple], name: str = "") -> None:
    """run(*a) for each a in `args`, each in a thread of its own (named name-i when `name`), all
    at once; back when every one has ended."""
    threads = [threading.Thread(target=run, args=a, name=f"{name}-{i}" if name else None) for i, a in enumerate(args)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)


def _wait_until(cond, what: str, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def test_prefill_split_runs_short_prompts_whole_and_long_ones_in_the_budget():
    policy = PrefillPolicy(max_piece=64, min_piece=8, cost_factor=2.0)
    assert policy.split(64, [1000]) == ([64], 0)
    assert policy.split(64, [1000, 900]) == ([8, 56], 0), "the oldest its minimum, then shortest first"
    # Short prompts go whole whatever the budget (a new turn is not slowed by a long prefill)...
    assert policy.split(16, [1000, 30, 10]) == ([8, 30, 10], 40)
    # ...up to max_piece of them a step, shortest first; the long one still advances.
    assert policy.split(16, [1000, 50, 40, 30]) == ([8, 0, 0, 30], 30)
    assert policy.split(8, [3]) == ([3], 3) and policy.split(64, []) == ([], 0)
    # A long prompt's tail is no new turn: it stays in the budget (at its context a token costs what
    # the rest cost), while a new short prompt still goes whole.
    assert policy.split(16, [40, 20], [True, False]) == ([8, 20], 20)
    assert policy.split(16, [40, 20], [False, False]) == ([40, 20], 60)


def test_piece_budget_goes_below_min_piece_where_pieces_split_by_layers():
    """Where the forward can split a piece over steps by layers, steps that cost too much even at
    min_piece shrink the budget below it, down to min_piece / layers: then a min_piece piece runs
    through that share of the layers a step (`depth`), and the step time comes back to target.
    Without splitting, min_piece stays the floor."""
    policy = PrefillPolicy(max_piece=256, min_piece=4, cost_factor=2.0)
    split, whole = PieceBudget(policy, layers=30), PieceBudget(policy)
    for b in (split, whole):
        for _ in range(5):
            b.observe_decode(0.010)
    per_layer = 0.0006  # a 4-token piece at a long context: 18 ms over 30 layers, the step 10 ms more
    for _ in range(60):
        n = split.next(True, True)
        depth = split.depth(n)
        split.observe(True, 0.010 + per_layer * depth, 4 * depth / 30)
        whole.observe(True, 0.010 + per_layer * 30, whole.next(True, True))
    assert whole.next(True, True) == 4 and whole.depth(4.0) == 0
    depth = split.depth(split.next(True, True))
    assert 14 <= depth <= 18, depth  # 2x the 10 ms step: 10 ms of piece, ~17 of the 30 layers
    assert split.depth(4.0) == 30 and split.depth(0.0) == 1
    for _ in range(40):  # a preempted machine: down to one layer a step, never below
        split.observe(True, 5.0, split.next(True, True))
    assert split.next(True, True) == 4 / 30 and split.depth(split.next(True, True)) == 1


def test_a_piece_is_split_only_beyond_the_calm_steps_own_tail():
    """Below min_piece the budget answers to the calm steps' tail: where steps without long-prompt
    pieces already vary (several sessions: verify blocks, new turns' prompts), a min_piece piece
    that costs 2.4x the median step but less than 2x their tail keeps every layer (the long prompt
    keeps its pace); with a tight tail the same piece is split. One slow step alone does not split."""
    policy = PrefillPolicy(max_piece=256, min_piece=4, cost_factor=2.0)
    loose, tight = PieceBudget(policy, layers=30), PieceBudget(policy, layers=30)
    for b, tail in ((loose, 0.020), (tight, 0.0105)):
        for i in range(64):
            b.observe_decode(0.010)
            b.observe_calm(tail if i % 5 == 0 else 0.010)  # a fifth of the calm steps: the tail
    for _ in range(40):
        for b in (loose, tight):
            n = b.next(True, True)
            depth = b.depth(n)
            b.observe(True, 0.010 + 0.014 * depth / 30, 4 * depth / 30)  # whole depth: 24 ms, 2.4x
    assert loose.next(True, True) >= 4 and loose.depth(loose.next(True, True)) == 30
    assert tight.depth(tight.next(True, True)) < 30
    for _ in range(3):  # recovering: whole depth again on the loose one
        loose.observe(True, 0.024, 4)
    loose.observe(True, 0.5, 4)  # one step slowed by something else
    assert loose.depth(loose.next(True, True)) == 30


def test_piece_budget_reads_step_times_against_the_rows_that_ran_beside_the_piece():
    """The load rises while a prompt is being prefilled (4 sessions decoding, then 16): every step
    from then on carries a piece, so no decoding-only step at the new load is ever measured. Read
    against the cost curve at each step's decoding tokens, a 4-token piece that adds 10% to a
    16-row step keeps every layer and the budget grows; read against the old load's steps (no
    curve: what the budget did before), the same steps look 2.75x "the decoding step" and the
    prompt crawls at one layer a step (measured: a 137-token prompt took 58 steps)."""
    from tandem.engine.model.backends import ForwardCosts

    policy = PrefillPolicy(max_piece=256, min_piece=4, cost_factor=2.0)
    costs = ForwardCosts()
    for _ in range(5):  # what the runner's curve learnt from decoding-only steps
        for tokens, seconds in ((4, 0.008), (8, 0.012), (16, 0.020)):
            costs.observe(tokens, seconds)
    aware, blind = PieceBudget(policy, layers=30, costs=costs), PieceBudget(policy, layers=30)
    for b in (aware, blind):
        for _ in range(64):  # the calm steps of 4 sessions
            b.observe_decode(0.008, 4)
            b.observe_calm(0.008, 4)
    for _ in range(40):  # 16 sessions, and every step has a piece of the new prompt
        for b in (aware, blind):
            n = b.next(True, True)
            depth = b.depth(n)
            carried = min(n, 64.0) if n >= 4 else 4 * depth / 30
            b.observe(True, 0.020 + 0.0005 * carried, carried, 16)
    assert aware.next(True, True) > 4 and aware.depth(aware.next(True, True)) == 30
    assert blind.depth(blind.next(True, True)) == 1, "the old reading: the test would not tell them apart"
    # Without rows (the sessions wait for their readers) the step stands in for the last rows' step.
    aware.observe(False, 0.010, 4.0, 16)
    assert aware.next(False, True) >= 4
    # A step without rows before any step with them (tokens 0) is read as a one-token step: raw
    # seconds against relative ones would have read a step 3x a decoding step as far under target
    # and grown the budget 1.5x; over target, it stays at its floor.
    early = PieceBudget(policy, costs=costs)
    for _ in range(5):
        early.observe_decode(0.008, 4)
    early.observe(False, 3 * costs.estimate(1), 4.0, 0)
    assert early.next(False, True) == 4
    # Below its first point the curve extrapolates; a noisy slope can reach ~0 there, and no step
    # is read against less than half the cheapest one measured.
    steep = ForwardCosts()
    steep.observe(8, 0.010)
    steep.observe(9, 0.020)
    steep_budget = PieceBudget(policy, costs=steep)
    assert steep.estimate(1) < 1e-3 and steep_budget._rows_cost(1, steep_budget._floor()) == 0.005


def test_piece_budget_steers_steps_to_the_cost_factor():
    """Steps whose time grows with their prompt tokens (and with their context: a growing slope):
    the budget follows, so a step beside decoding stays near 2x the decoding step and a step without
    rows near 1x, never outside [min_piece, max_piece]."""
    policy = PrefillPolicy(max_piece=256, min_piece=16, cost_factor=2.0)
    budget = PieceBudget(policy)
    assert budget.next(True, True) == 16, "nothing measured: the minimum"
    assert budget.next(False, False) == 256, "nobody decoding: whole pieces"
    budget.observe(True, 1.0, 16)
    assert budget.next(True, True) == 16, "no decoding step measured yet: nothing learned"
    for _ in range(5):
        budget.observe_decode(0.040)
    for slope in (0.001, 0.0015):  # s per prompt token grows with the prompt's context
        for _ in range(60):
            for rows in (True, False):
                n = budget.next(rows, True)
                budget.observe(rows, (0.040 if rows else 0.0) + 0.010 + slope * n, n)
        with_rows, alone = budget.next(True, True), budget.next(False, True)
        assert abs((0.050 + slope * with_rows) / 0.040 - 2.0) < 0.15, (slope, with_rows)
        assert abs((0.010 + slope * alone) / 0.040 - 1.0) < 0.15, (slope, alone)
    for _ in range(20):  # a preempted machine: steps far over target shrink it to the minimum
        budget.observe(True, 5.0, budget.next(True, True))
    assert budget.next(True, True) == 16
    for _ in range(40):  # free steps grow it, to the maximum at most
        budget.observe(True, 0.001, budget.next(True, True))
    assert budget.next(True, True) == 256


def test_a_long_prompt_does_not_stop_running_streams(tiny_loaded, kv_pool):
    """The denial of service of one-piece prefill: a long prompt arriving while a session streams.
    The streaming session must keep getting steps while the prompt is prefilled in pieces, and both
    outputs are the target alone's."""
    core = _core(tiny_loaded, prefill_chunk_tokens=16, prefill_min_tokens=8)
    ctx_a, ctx_b = _ids(20, 1), _ids(440, 2)
    sampling_a = SamplingParams(max_new_tokens=200, ignore_eos=True)  # 200 plain steps
    sampling_b = SamplingParams(max_new_tokens=4, ignore_eos=True)
    a_steps: list = []
    a_done = threading.Event()

    def stream_a() -> None:
        for item in core.generate("a", ctx_a, sampling_a, NONE):
            a_steps.append(item)
        a_done.set()

    threading.Thread(target=stream_a, daemon=True).start()
    _wait_until(lambda: len(a_steps) >= 3, "session a to stream")
    before, h0 = len(a_steps), len(core.executor.history)
    b_items = []
    for item in core.generate("b", ctx_b, sampling_b, NONE):
        if not b_items:  # b's first step: its prefill is over
            during = len(a_steps) - before
            history = list(core.executor.history)[h0:]
        b_items.append(item)
    a_done.wait(60)
    pieces = [p for _, ps, _ in history for p in ps]
    assert sum(pieces) >= len(ctx_b) - 1, "b's prompt ran as pieces in these steps"
    assert max(pieces) <= 16
    mixed = sum(1 for rows, ps, _ in history if rows and ps)
    # 439 prompt tokens in pieces of at most 16: at least 28 steps of prefill, and a decoded in them
    # (a one-piece prefill gives a at most one or two steps meanwhile). Not all 28: a step whose
    # rows' reader is behind runs the piece alone, and on 2 busy cores (the full suite) that was 13
    # of them once; 10 keeps a wide margin over the one-piece case.
    assert mixed >= 10, history
    assert during >= 10, f"a streamed {during} steps during b's prefill"
    expected_a = Engine(tiny_loaded).generate(ctx_a, sampling_a, NONE).token_ids
    expected_b = Engine(tiny_loaded).generate(ctx_b, sampling_b, NONE).token_ids
    assert isinstance(a_steps[-1], GenerationResult) and a_steps[-1].token_ids == expected_a
    assert b_items[-1].token_ids == expected_b


def test_a_short_prompt_started_in_a_full_step_goes_whole_at_its_next(tiny_loaded):
    """Three short prompts (each fits one piece of 16) arrive together beside a decoding row: the
    first goes whole, the second gets the oldest's min_piece because the step is full, the third
    waits. At the next step the second's rest goes whole like any short prompt (it is no long
    prompt's tail, which would stay in the budget: 4 tokens a step here), and the third starts."""
    from tandem.engine.scheduler.batching import _Job
    from tandem.engine.scheduler.runner import Sequence

    core = _core(tiny_loaded, prefill_chunk_tokens=16, prefill_min_tokens=4)
    ex, runner = core.executor, core.engine.runner
    seq = Sequence(runner)
    seq.set_context(_ids(6, 3))  # through the loop, which then waits for work
    jobs = [_Job(runner.backend.new_cache(), _ids(n, 10 + n), False, threading.Event()) for n in (10, 11, 12)]
    row = _Job(seq.cache, [seq.ids[-1]], True, threading.Event())
    # The loop thread is idle (nothing queued): drive its planning here, a step at a time.
    ex._prefills = list(jobs)
    steps = []
    for _ in range(4):
        h = len(ex.history)
        ex._step([row])
        steps.append(list(ex.history)[h:][0][1])
        if all(j.done.is_set() for j in jobs):
            break
    # 1: the first whole, the second its min_piece, the third waits; 2: the second's rest whole,
    # the third (no room beside it) its min_piece; 3: the third's rest whole. Held to the budget,
    # the second would have run (4, 12) then (3,): done a step later, the same way as a long tail.
    assert steps == [(10, 4), (7, 4), (8,)], steps
    assert all(j.done.is_set() and j.done_tokens == len(j.ids) for j in jobs)


def test_chunked_prefill_is_lossless_for_mixed_batches(tiny_loaded, monkeypatch, kv_pool):
    """Prefill pieces, verify blocks and plain rows in the same steps, greedy and sampled together:
    greedy rows equal the target alone; a seeded sampled row replays itself in process. The step
    loop verifies a step's rows together: at most one call of each kernel per step, carrying rows
    of several sessions."""
    calls: dict[str, list[int]] = {}
    for name in ("greedy_accept", "rejection_sample"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _r=real, _n=name: calls.setdefault(_n, []).append(a[0].shape[0])
                            or _r(*a))
    core = _core(tiny_loaded, prefill_chunk_tokens=24, prefill_min_tokens=8)
    prompts = [_ids(30, 3) * 2, _ids(300, 4), _ids(12, 5) * 3, _ids(250, 6)]
    specs = [NGRAM, NONE, NGRAM, NGRAM]
    samplings = [SamplingParams(max_new_tokens=30, ignore_eos=True),
                 SamplingParams(max_new_tokens=20, ignore_eos=True),
                 SamplingParams(max_new_tokens=25, ignore_eos=True, temperature=0.8, seed=7),
                 SamplingParams(max_new_tokens=15, ignore_eos=True)]
    results: dict[int, GenerationResult] = {}

    def run(i: int) -> None:
        results[i] = list(core.generate(f"m{i}", prompts[i], samplings[i], specs[i]))[-1]

    _in_threads(run, [(i,) for i in range(4)])
    assert core.executor.mixed_steps > 0, "some steps carried prompt pieces and decoding rows"
    ex = core.executor
    assert sum(calls["greedy_accept"]) + sum(calls["rejection_sample"]) == ex.verified_rows
    assert len(calls["greedy_accept"]) <= ex.batches and len(calls["rejection_sample"]) <= ex.batches
    for i in (0, 1, 3):
        assert results[i].token_ids == Engine(tiny_loaded).generate(prompts[i], samplings[i], NONE).token_ids, i
    # The seeded sampled row: its block lengths follow the text only (NominalCosts) and its draws
    # the seed, so it replays what it samples alone (batching moves logits by rounding only).
    alone = Engine(tiny_loaded).generate(prompts[2], samplings[2], NGRAM).token_ids
    assert len(alone) == 25 and results[2].token_ids == alone
    if kv_pool[0] == 4096:
        # A pool that holds every session: their decoding overlaps, so steps of several sessions
        # went through the pooled attention. (Where it runs out, which caches keep a region
        # depends on the order they grew in, piece by piece as the budget sized the pieces, so
        # two pooled ones need not decode in the same step: that case checks the outputs above,
        # with sessions in and out of the pool.)
        assert len(kv_pool) > 1, "steps of several sessions went through the pooled attention"


def test_a_steps_rows_are_verified_in_one_kernel_call(tiny_loaded, monkeypatch):
    """Sessions decoding together share each step's verification call (B > 1 in the kernel's
    [B, K] inputs) and each still gets the target alone's output."""
    sizes: list[int] = []
    real = kernels.greedy_accept
    monkeypatch.setattr(kernels, "greedy_accept", lambda *a: sizes.append(a[0].shape[0]) or real(*a))
    core = _core(tiny_loaded)
    prompts = [_ids(16, 20 + i) * 2 for i in range(3)]
    sampling = SamplingParams(max_new_tokens=24, ignore_eos=True)
    results: dict[int, GenerationResult] = {}
    start = threading.Barrier(3)

    def run(i: int) -> None:
        start.wait()
        results[i] = list(core.generate(f"r{i}", prompts[i], sampling, NGRAM))[-1]

    _in_threads(run, [(i,) for i in range(3)])
    assert sum(sizes) == core.executor.verified_rows and len(sizes) <= core.executor.batches
    assert max(sizes) == 3, f"the three sessions' rows shared a call: call sizes {sizes}"
    for i in range(3):
        assert results[i].token_ids == Engine(tiny_loaded).generate(prompts[i], sampling, NONE).token_ids, i


def test_every_sessions_step_runs_on_the_step_loop_thread(tiny_loaded, monkeypatch):
    """No thread per session: the request handlers only read steps. Every plan and every commit of
    six concurrent sessions runs on the one step-loop thread, their rows share steps, and each
    output is the target alone's."""
    from tandem.engine.scheduler.generate import Generation

    where: list[str] = []
    real_plan, real_finish = Generation.plan_step, Generation.finish_step
    monkeypatch.setattr(Generation, "plan_step",
                        lambda self: where.append(threading.current_thread().name) or real_plan(self))
    monkeypatch.setattr(Generation, "finish_step",
                        lambda self, p, r: where.append(threading.current_thread().name) or real_finish(self, p, r))
    core = _core(tiny_loaded)
    prompts = [_ids(16, 40 + i) * 2 for i in range(6)]
    specs = [NGRAM, NONE] * 3
    sampling = SamplingParams(max_new_tokens=20, ignore_eos=True)
    results: dict[int, list] = {}
    start = threading.Barrier(6)

    def run(i: int) -> None:
        start.wait()
        results[i] = list(core.generate(f"t{i}", prompts[i], sampling, specs[i]))

    _in_threads(run, [(i,) for i in range(6)], name="handler")
    steps = sum(len(items) - 1 for items in results.values())
    assert len(results) == 6 and len(where) == 2 * steps, (len(results), len(where), steps)
    assert set(where) == {"step-loop"}, set(where)
    assert max(rows for rows, _, _ in core.executor.history) > 1, "sessions shared steps"
    assert core.executor.busy_sessions == 0, "every generation was let go"
    for i in range(6):
        assert results[i][-1].token_ids == Engine(tiny_loaded).generate(prompts[i], sampling, NONE).token_ids, i


def test_a_reader_that_stops_reading_holds_only_its_own_session(tiny_loaded):
    """A client that stops reading its stream: its session runs a few steps ahead (the loop's
    bound), then waits for it, while another session runs to the end; read again, it finishes
    with the target alone's output."""
    from tandem.engine.scheduler.batching import BatchExecutor

    core = _core(tiny_loaded)
    ctx_slow, ctx_fast = _ids(20, 50), _ids(20, 51)
    sampling = SamplingParams(max_new_tokens=60, ignore_eos=True)
    slow = core.generate("slow", ctx_slow, sampling, NONE)
    first = next(slow)  # streaming, then its reader stalls
    fast = list(core.generate("fast", ctx_fast, sampling, NONE))
    assert len(fast[-1].token_ids) == 60
    (entry,) = core.executor._attached
    ahead = len(entry.gen.output) - len(first.tokens)
    assert 0 < ahead <= BatchExecutor.MAX_UNREAD, f"the stalled session ran {ahead} steps ahead of its reader"
    rest = list(slow)
    assert rest[-1].token_ids == Engine(tiny_loaded).generate(ctx_slow, sampling, NONE).token_ids
    assert fast[-1].token_ids == Engine(tiny_loaded).generate(ctx_fast, sampling, NONE).token_ids


def test_a_client_leaving_mid_stream_keeps_a_consistent_session(tiny_loaded):
    """The reader closes its stream after three steps (the loop may have run further): the loop
    lets go of the generation, the session stays resident and consistent, and the next turn, built
    from what the client saw, is the target alone's."""
    core = _core(tiny_loaded)
    ctx = _ids(20, 60)
    running = core.generate("c", ctx, SamplingParams(max_new_tokens=50, ignore_eos=True), NONE)
    seen = [tok for _, step in zip(range(3), running) for tok in step.tokens]
    running.close()
    assert core.executor.busy_sessions == 0 and core.running() == 0
    assert "c" in core.session_ids()
    turn2 = ctx + seen + _ids(5, 61)
    sampling = SamplingParams(max_new_tokens=10, ignore_eos=True)
    again = list(core.generate("c", turn2, sampling, NGRAM))[-1]
    assert again.stats.prefill_reused_tokens >= len(ctx) + len(seen) - 1, "the session's KV was kept"
    assert again.token_ids == Engine(tiny_loaded).generate(turn2, sampling, NONE).token_ids


def test_one_sessions_failing_step_fails_it_alone(tiny_loaded, monkeypatch):
    """A step that fails in planning (a proposer's or a grammar's bug) fails its own session with
    the error; the sessions in the same steps finish normally."""
    from tandem.engine.scheduler.generate import Generation

    real_plan = Generation.plan_step
    broken = {"n": 0}

    def plan(self):
        if self.prompt_len == 21 and len(self.output) >= 5:  # the "bad" session's sixth step
            broken["n"] += 1
            raise RuntimeError("proposer bug")
        return real_plan(self)

    monkeypatch.setattr(Generation, "plan_step", plan)
    core = _core(tiny_loaded)
    sampling = SamplingParams(max_new_tokens=30, ignore_eos=True)
    outcome: dict[str, object] = {}

    def run(sid: str, ctx: list[int]) -> None:
        try:
            outcome[sid] = list(core.generate(sid, ctx, sampling, NONE))[-1]
        except RuntimeError as exc:
            outcome[sid] = exc

    ctxs = {"bad": _ids(21, 70), "good": _ids(20, 71)}
    _in_threads(run, list(ctxs.items()))
    assert broken["n"] == 1 and isinstance(outcome["bad"], RuntimeError) and "proposer bug" in str(outcome["bad"])
    assert outcome["good"].token_ids == Engine(tiny_loaded).generate(ctxs["good"], sampling, NONE).token_ids
    assert "bad" not in core.session_ids(), "the failed session's KV is not trusted"


@pytest.mark.parametrize("same_tenant", [True, False])
def test_prompts_arriving_together_compute_their_common_prefix_once(tiny_loaded, same_tenant):
    """Six sessions of one tenant arrive at once with a 300-token common prefix (a tool list) on a
    verifier holding nothing: the step loop computes the prefix for the first and the others copy
    it as it gets there; every output is the target's alone, token for token. Sessions of other
    tenants share nothing."""
    core = _core(tiny_loaded)
    prefix = _ids(300, 110)
    ctxs = {f"s{i}": prefix + _ids(10, 111 + i) for i in range(6)}
    sampling = SamplingParams(max_new_tokens=12, ignore_eos=True)
    out: dict[str, GenerationResult] = {}

    def run(sid: str, ctx: list[int]) -> None:
        out[sid] = list(core.generate(sid, ctx, sampling, NONE, cache_salt="acme" if same_tenant else sid))[-1]

    _in_threads(run, list(ctxs.items()))
    for sid, ctx in ctxs.items():
        assert out[sid].token_ids == Engine(tiny_loaded).generate(ctx, sampling, NONE).token_ids, sid
    computed = sum(r.stats.prefill_computed_tokens for r in out.values())
    shared = core.metrics.value("tandem_prefix_shared_tokens_total")
    if same_tenant:
        assert shared >= 4 * 300 and computed <= 2 * 300 + 6 * 10, (shared, computed)
    else:
        assert shared == 0 and computed == 6 * 309


def test_in_process_prefill_in_pieces_equals_one_piece(tiny_loaded):
    """TargetRunner without an executor runs a long prompt in prefill_chunk pieces; the next step's
    logits match the one-piece prefill's (same greedy token, rounding-level differences only)."""
    from tandem.engine.scheduler.runner import TargetRunner

    ctx = _ids(300, 8)
    whole, pieces = TargetRunner(tiny_loaded, prefill_chunk=1000), TargetRunner(tiny_loaded, prefill_chunk=32)
    a, b = whole.new_sequence(), pieces.new_sequence()
    a.set_context(ctx), b.set_context(ctx)
    assert a.cached_len == b.cached_len == len(ctx) - 1
    la, lb = a.forward_block([5, 6]), b.forward_block([5, 6])
    torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
    assert torch.equal(la.argmax(-1), lb.argmax(-1))


# -- admission ----------------------------------------------------------------------------------


def _hold(core: VerifierCore, sid: str, ctx: list[int]):
    """Start a generation and stop it mid-way: the session is busy (not evictable) until resumed."""
    running = core.generate(sid, ctx, SamplingParams(max_new_tokens=30, ignore_eos=True), NONE)
    next(running)
    return running


def test_a_request_waits_for_room_and_gets_in_first_come_first_served(tiny_loaded):
    core = _core(tiny_loaded, max_sessions=1, admission_queue=4, admission_wait_s=60)
    a = _hold(core, "a", _ids(20, 10))
    order: list[str] = []

    def request(sid: str) -> None:
        items = list(core.generate(sid, _ids(20, ord(sid)), SamplingParams(max_new_tokens=3), NONE))
        assert isinstance(items[-1], GenerationResult)
        order.append(sid)

    tb = threading.Thread(target=request, args=("b",))
    tb.start()
    _wait_until(lambda: core.metrics.value("tandem_admission_waiting") == 1, "b to queue")
    tc = threading.Thread(target=request, args=("c",))
    tc.start()
    _wait_until(lambda: core.metrics.value("tandem_admission_waiting") == 2, "c to queue")
    assert order == [], "nobody got in while a held the only slot"
    list(a)  # a finishes: its slot frees
    tb.join(60), tc.join(60)
    assert order == ["b", "c"], "admitted in arrival order"
    assert core.metrics.value("tandem_admission_waiting") == 0


def test_sessions_generating_at_once_are_capped_apart_from_resident_ones(tiny_loaded):
    """max_generating bounds a step's rows; idle sessions beyond it stay resident (their KV is
    bounded by the KV budget). The load test's case: every worker holds a conversation, one starts
    a new one while another is between its turns; with one bound for both, the LRU idle session
    evicted was often the one between turns, whose second turn then prefilled everything again."""
    core = _core(tiny_loaded, max_sessions=4, max_generating=2, admission_queue=4, admission_wait_s=60)
    done = [list(core.generate(sid, _ids(20, 40 + i), SamplingParams(max_new_tokens=2), NONE))[-1]
            for i, sid in enumerate(["idle-1", "idle-2"])]
    assert all(isinstance(r, GenerationResult) for r in done)
    a, b = _hold(core, "a", _ids(20, 42)), _hold(core, "b", _ids(20, 43))
    assert sorted(core.session_ids()) == ["a", "b", "idle-1", "idle-2"], "4 resident, 2 of them generating"
    finished: list[str] = []

    def request(sid: str) -> None:
        list(core.generate(sid, _ids(20, 44), SamplingParams(max_new_tokens=2), NONE))
        finished.append(sid)

    waiter = threading.Thread(target=request, args=("c",))
    waiter.start()
    _wait_until(lambda: core.metrics.value("tandem_admission_waiting") == 1, "c to queue")
    # Waiting for a generating slot takes nobody's KV: the idle sessions are all still resident.
    assert sorted(core.session_ids()) == ["a", "b", "idle-1", "idle-2"] and finished == []
    list(a)  # a generating slot frees: c gets in, evicting the least recently used idle session
    waiter.join(60)
    assert finished == ["c"]
    assert sorted(core.session_ids()) == ["a", "b", "c", "idle-2"]
    list(b)
    assert core.info()["active_sessions"] == 0


def test_a_new_session_waits_rather_than_evict_a_conversation_between_its_turns(tiny_loaded):
    """The KV budget is full and the only idle session just ended a turn: a new session waits
    (it may not evict it for evict_after_idle_s); that session's next turn arrives after it and
    goes first, with its KV still resident; the new session gets in once a session has been idle
    long enough. Before: the new session evicted the conversation, whose next turn then prefilled
    everything again (60% of the prefill at 64 agent sessions)."""
    core = _core(tiny_loaded, kv_capacity_tokens=100, admission_queue=4, admission_wait_s=60,
                 evict_after_idle_s=30.0)
    core._gaps.extend([5.0] * 8)  # next turns here have come within 5 s: protect for min(30, 2 x 5) s
    assert core._protect_s() == 10.0
    first = _ids(40, 60)
    turn1 = list(core.generate("conv", first, SamplingParams(max_new_tokens=4, ignore_eos=True), NONE))[-1]
    held = _hold(core, "busy", _ids(40, 61))  # 40 + 44 of 100 held
    order: list[str] = []

    def request(sid: str, ctx: list[int]) -> None:
        last = list(core.generate(sid, ctx, SamplingParams(max_new_tokens=2, ignore_eos=True), NONE))[-1]
        order.append(sid)
        outcome[sid] = last

    outcome: dict[str, GenerationResult] = {}
    newcomer = threading.Thread(target=request, args=("new", _ids(30, 62)))
    newcomer.start()
    _wait_until(lambda: core.metrics.value("tandem_admission_waiting") == 1, "the new session to wait")
    assert "conv" in core.session_ids(), "the conversation between its turns was not evicted"
    turn2 = first + turn1.token_ids + [7, 8]
    nxt = threading.Thread(target=request, args=("conv", turn2))
    nxt.start()
    nxt.join(60)
    assert order == ["conv"], "the next turn went before the new session"
    assert outcome["conv"].stats.prefill_reused_tokens >= len(first), "with its KV still resident"
    assert core.metrics.value("tandem_kv_evictions_total") == 0 and newcomer.is_alive()
    core.settings = core.settings.model_copy(update={"evict_after_idle_s": 0.0})  # as if the time had passed
    newcomer.join(60)
    assert not newcomer.is_alive()
    assert order == ["conv", "new"] and core.metrics.value("tandem_kv_evictions_total") == 1
    list(held)


def test_eviction_keeps_the_last_idle_holder_of_a_prefix_in_use(tiny_loaded):
    """A generating session shares its first tokens (a tool list) with one idle session: a new
    session needing room evicts another idle session, though it was used more recently, so the
    next session of that prefix can copy it rather than compute it."""
    core = _core(tiny_loaded, kv_capacity_tokens=240)
    prefix = _ids(36, 90)
    small = SamplingParams(max_new_tokens=2, ignore_eos=True)
    list(core.generate("holder", prefix + _ids(4, 91), small, NONE))
    list(core.generate("other", _ids(40, 92), small, NONE))
    running = _hold(core, "running", prefix + _ids(4, 93))
    list(core.generate("new", _ids(130, 94), small, NONE))  # room for it: one idle session goes
    assert "holder" in core.session_ids() and "other" not in core.session_ids()
    *_, last = core.generate("next", prefix + _ids(4, 95), small, NONE)  # "new" goes, idle and newer
    assert sorted(core.session_ids()) == ["holder", "next", "running"]
    assert last.stats.prefill_reused_tokens == 36, "the prefix was copied from its holder"
    list(running)


def test_the_last_holder_of_a_prefix_goes_when_nothing_else_could_make_room(tiny_loaded):
    """Kept for a session of its prefix only while a generating session will free room: alone in
    the verifier, it is evicted for the arriving session rather than leave it waiting in vain."""
    core = _core(tiny_loaded, kv_capacity_tokens=100, admission_wait_s=5)
    prefix = _ids(36, 99)
    small = SamplingParams(max_new_tokens=2, ignore_eos=True)
    list(core.generate("holder", prefix + _ids(40, 100), small, NONE))
    *_, last = core.generate("same-prefix", prefix + _ids(40, 101), small, NONE)
    assert core.session_ids() == ["same-prefix"] and isinstance(last, GenerationResult)


def test_a_request_that_must_wait_anyway_evicts_nobody(tiny_loaded):
    """Evicting every idle session would not make room for the arriving one: it waits (and is
    refused at its deadline), and the idle session stays resident."""
    core = _core(tiny_loaded, kv_capacity_tokens=120, admission_wait_s=0.2)
    small = SamplingParams(max_new_tokens=2, ignore_eos=True)
    list(core.generate("idle", _ids(30, 96), small, NONE))
    running = _hold(core, "running", _ids(60, 97))
    with pytest.raises(Overloaded):
        list(core.generate("big", _ids(70, 98), small, NONE))  # 60 busy + 70 > 120 with or without "idle"
    assert "idle" in core.session_ids() and core.metrics.value("tandem_kv_evictions_total") == 0
    list(running)


def test_sessions_that_never_return_are_not_protected(tiny_loaded):
    """Until next turns have been seen, nothing is protected: one-shot sessions in a full verifier
    are evicted at once for the next (no pause per admission)."""
    core = _core(tiny_loaded, max_sessions=1, evict_after_idle_s=30.0, admission_wait_s=0.5)
    for i in range(3):
        list(core.generate(f"once-{i}", _ids(20, 70 + i), SamplingParams(max_new_tokens=2), NONE))
    assert core._protect_s() == 0.0 and core.session_ids() == ["once-2"]


def test_a_request_behind_others_in_the_queue_keeps_its_own_deadline(tiny_loaded):
    """Only the front waiter tries admission, but every waiter's deadline runs: a request behind a
    long wait is refused when its own admission_wait_s is up, not when the front one gets in."""
    core = _core(tiny_loaded, max_sessions=1, admission_queue=4, admission_wait_s=60)
    held = _hold(core, "a", _ids(20, 50))
    outcome: dict[str, object] = {}

    def request(sid: str) -> None:
        try:
            list(core.generate(sid, _ids(20, 51), SamplingParams(max_new_tokens=2), NONE))
            outcome[sid] = "done"
        except Overloaded as refused:
            outcome[sid] = refused

    front = threading.Thread(target=request, args=("front",))
    front.start()
    _wait_until(lambda: core.metrics.value("tandem_admission_waiting") == 1, "the front request to queue")
    core.settings = core.settings.model_copy(update={"admission_wait_s": 0.3})  # the next one waits 0.3 s
    with pytest.raises(Overloaded, match=r"1 requests ahead; waited 0.3 s"):
        list(core.generate("behind", _ids(20, 52), SamplingParams(max_new_tokens=2), NONE))
    assert front.is_alive() and "front" not in outcome, "the front request still waits on its own 60 s"
    list(held)
    front.join(60)
    assert outcome == {"front": "done"}


def test_the_generating_cap_never_exceeds_the_resident_one():
    from tandem.services.verifier.server import server_workers

    settings = VerifierSettings(verifier_id="v-caps", port=0, max_sessions=3, max_generating=64, admission_queue=5)
    assert settings.generating_slots == 3
    assert server_workers(settings) == 3 + 5 + 16, "a server thread per generation in flight, not per resident session"


def test_anonymous_requests_count_against_the_budget_while_they_run(tiny_loaded):
    """A request without a session id is never resident, but while it runs it holds KV and a slot:
    a flood of anonymous requests cannot run past admission (the way around it they once were)."""
    core = _core(tiny_loaded, max_sessions=2, kv_capacity_tokens=100, admission_queue=4, admission_wait_s=0.3)
    first = _hold(core, "", _ids(60, 30))
    assert core.kv_used_tokens() >= 60 and core.info()["active_sessions"] == 1
    with pytest.raises(Overloaded) as err:  # 60 + 60 > 100: it waits, then is refused at the deadline
        list(core.generate("", _ids(60, 31), SamplingParams(max_new_tokens=2), NONE))
    assert "waited 0.3 s" in str(err.value)
    with pytest.raises(Overloaded):  # a named session does not get the anonymous one's KV either
        list(core.generate("named", _ids(60, 32), SamplingParams(max_new_tokens=2), NONE))
    second = _hold(core, "", _ids(20, 33))  # fits beside it: 2 slots, 80 + 20 tokens
    with pytest.raises(Overloaded):  # both slots held
        list(core.generate("", _ids(5, 34), SamplingParams(max_new_tokens=2), NONE))
    list(first), list(second)
    assert core.kv_used_tokens() == 0 and core.session_ids() == [], "finished anonymous requests keep nothing"
    items = list(core.generate("", _ids(60, 31), SamplingParams(max_new_tokens=2), NONE))
    assert isinstance(items[-1], GenerationResult)


def test_the_caller_may_ask_for_a_shorter_admission_wait(tiny_loaded):
    """A gateway with another verifier to try asks a full one to wait briefly (admission_wait_ms):
    the request is refused after that, not after the verifier's own 60 s."""
    core = _core(tiny_loaded, max_sessions=1, admission_wait_s=60)
    held = _hold(core, "a", _ids(20, 120))
    with pytest.raises(Overloaded, match=r"waited 0.2 s"):
        list(core.generate("b", _ids(20, 121), SamplingParams(max_new_tokens=2), NONE, admission_wait_s=0.2))
    list(held)


def test_a_full_queue_refuses_at_once_with_a_retry_hint(tiny_loaded):
    core = _core(tiny_loaded, max_sessions=1, admission_queue=1, admission_wait_s=60)
    a = _hold(core, "a", _ids(20, 11))
    waiter = threading.Thread(target=lambda: list(core.generate("b", _ids(20, 12), SamplingParams(max_new_tokens=2), NONE)))
    waiter.start()
    _wait_until(lambda: core.metrics.value("tandem_admission_waiting") == 1, "b to queue")
    with pytest.raises(Overloaded) as err:
        list(core.generate("c", _ids(20, 13), SamplingParams(max_new_tokens=2), NONE))
    assert "already wait" in str(err.value) and err.value.retry_after_s >= 1
    list(a)
    waiter.join(60)
    assert not waiter.is_alive()


def test_a_queued_request_is_refused_at_its_deadline_and_a_departed_caller_leaves_the_queue(tiny_loaded):
    core = _core(tiny_loaded, max_sessions=1, admission_queue=4, admission_wait_s=0.3)
    a = _hold(core, "a", _ids(20, 14))
    with pytest.raises(Overloaded) as err:
        list(core.generate("b", _ids(20, 15), SamplingParams(max_new_tokens=2), NONE))
    assert "waited 0.3 s" in str(err.value)
    core.settings = core.settings.model_copy(update={"admission_wait_s": 60})
    looks = iter([True])  # the caller is there at its first look, gone from the second on
    with pytest.raises(Cancelled):
        list(core.generate("c", _ids(20, 16), SamplingParams(max_new_tokens=2), NONE,
                           is_active=lambda: next(looks, False)))
    assert core.metrics.value("tandem_admission_waiting") == 0, "the departed caller left the queue"
    list(a)
    assert isinstance(list(core.generate("d", _ids(20, 17), SamplingParams(max_new_tokens=2), NONE))[-1],
                      GenerationResult), "the verifier keeps serving"


def test_a_context_larger_than_the_whole_budget_is_refused_without_waiting(tiny_loaded):
    core = _core(tiny_loaded, kv_capacity_tokens=50, admission_wait_s=60)
    with pytest.raises(Overloaded) as err:
        list(core.generate("big", _ids(80, 18), SamplingParams(max_new_tokens=2), NONE))
    assert "larger than its whole KV budget" in str(err.value)


def test_the_kv_budget_can_come_from_free_memory(tiny_loaded):
    from tandem.services.verifier.core import free_memory_bytes, kv_bytes_per_token

    cfg = tiny_loaded.model.config
    per_token = kv_bytes_per_token(tiny_loaded)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert per_token == 2 * cfg.num_hidden_layers * kv_heads * head_dim * 4  # float32
    core = _core(tiny_loaded, kv_memory_fraction=0.01, kv_capacity_tokens=10**9)
    free = free_memory_bytes(torch.device("cpu"))
    assert 0 < core.kv_capacity <= 10**9
    assert abs(core.kv_capacity - free * 0.01 / per_token) < 0.2 * free * 0.01 / per_token  # memory moves a little
    assert core.info()["kv_capacity_tokens"] == core.kv_capacity
    capped = _core(tiny_loaded, kv_memory_fraction=0.5, kv_capacity_tokens=1000)
    assert capped.kv_capacity == 1000, "the fixed budget caps the memory-derived one"


def test_a_fault_in_step_planning_fails_that_step_and_the_loop_keeps_serving(tiny_loaded):
    core = _core(tiny_loaded)
    real = core.executor.budget.next
    calls = {"n": 0}

    def broken_once(rows: bool, decoding: bool) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("planning bug")
        return real(rows, decoding)

    core.executor.budget.next = broken_once  # the next step's planning fails once
    with pytest.raises(RuntimeError, match="planning bug"):
        list(core.generate("x", _ids(20, 30), SamplingParams(max_new_tokens=4, ignore_eos=True), NONE))
    result = list(core.generate("y", _ids(20, 31), SamplingParams(max_new_tokens=4, ignore_eos=True), NONE))[-1]
    assert isinstance(result, GenerationResult) and len(result.token_ids) == 4, "the step loop is alive"
    assert "x" not in core.session_ids(), "the failed session's KV is not trusted"


def test_health_is_answered_while_every_admission_slot_is_taken(tiny_loaded):
    """One running session holds the only slot; 40 gRPC requests wait for admission, each holding
    a server thread (more than the old fixed 32 threads). All 40 reach the queue, and a health
    check is answered meanwhile: a supervisor kills a verifier whose health check goes unanswered
    (found by the 64-session load test, where streams past 32 and the health checks queued)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tandem.services.verifier.server import build_server, server_workers
    from tandem.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

    settings = VerifierSettings(verifier_id="v-slots", port=0, max_sessions=1, admission_queue=40,
                                admission_wait_s=60)
    core = VerifierCore(settings, tiny_loaded)
    assert server_workers(settings) > 41
    server, port, _ = build_server(core)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = verifier_pb2_grpc.VerifierStub(channel)
    holder = _hold(core, "a", _ids(12, 39))
    streams = [stub.Generate(verifier_pb2.SessionGenerateRequest(
        session_id=f"s{i}", context_ids=_ids(12, 40 + i),
        sampling=common_pb2.SamplingParams(max_new_tokens=2, ignore_eos=True)), timeout=60) for i in range(40)]
    try:
        _wait_until(lambda: core.metrics.value("tandem_admission_waiting") == 40, "40 requests to queue", 30)
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        list(holder)  # the slot frees: the queue drains, first come first served
        assert all(list(s)[-1].finish_reason for s in streams), "every queued request completed"
    finally:
        for s in streams:
            s.cancel()
        channel.close()
        server.stop(None)


def test_the_loop_reports_its_step_phases_and_what_each_step_committed(tiny_loaded):
    """Each step of the loop: its rows, tokens and committed tokens, and the time of each part
    (plan, forward, verify, commit), in `phases` and in the Prometheus histogram."""
    core = _core(tiny_loaded)
    prompts = [_ids(16, 80 + i) * 2 for i in range(3)]
    sampling = SamplingParams(max_new_tokens=20, ignore_eos=True)
    done: dict[int, GenerationResult] = {}

    def run(i: int) -> None:
        done[i] = list(core.generate(f"p{i}", prompts[i], sampling, NGRAM))[-1]

    _in_threads(run, [(i,) for i in range(3)])
    phases = list(core.executor.phases)
    assert len(phases) == core.executor.steps_planned > 0
    assert sum(p.rows for p in phases) == sum(r.stats.steps for r in done.values())
    # every step commits at least a token a row; the tokens committed are the outputs (a last
    # block may commit past the limit: the output is cut there)
    assert all(p.rows <= p.committed <= p.tokens for p in phases)
    assert sum(p.committed for p in phases) >= 3 * 20
    assert all(min(p.plan, p.forward, p.verify, p.commit) >= 0 for p in phases)
    for name in ("plan", "forward", "verify", "commit"):
        assert core.metrics.value("tandem_step_phase_seconds_count", phase=name) == len(phases)


def test_a_plan_prices_its_drafts_against_what_the_others_committed(tiny_loaded):
    """The batch a block joins: the loop's last step less the planning generation's own part of
    it (when it was in it), with the others' committed tokens as committed, not one a row."""
    core = _core(tiny_loaded)
    gen = core.engine.start(_ids(20, 90), SamplingParams(max_new_tokens=4, ignore_eos=True), NGRAM)
    ex = core.executor
    ex.last_rows, ex.steps_planned = (3, 12, 9), 5
    gen._last_step = (5, 4, 3)  # it was in that step: 4 tokens, 3 committed
    assert gen._batch_load() == (8, 6.0)
    gen._last_step = (4, 4, 3)  # it was not (its reader was behind): the whole step is the others'
    assert gen._batch_load() == (12, 9.0)
    ex.last_rows = (1, 4, 3)
    gen._last_step = (5, 4, 3)
    assert gen._batch_load() == (0, 0.0), "alone in the batch"
