"""Which threads run model work (tandem.engine.native.threads): the verifier's step loop and the drafter's
model thread use the OpenMP thread count they were configured with, model work runs on them and
not on whichever thread asked, and a passing thread's result or error comes back to its caller.
(The speed this is for is measured in docs/benchmarks.md, never asserted here.)"""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig
from tandem.engine.native.threads import ComputeThread, in_passing_thread
from tandem.engine.speculation.proposers import DraftModelProposer
from tandem.services.drafter.core import DrafterCore
from tandem.services.drafter.server import build_server as build_drafter
from tandem.services.drafter.settings import DrafterSettings
from tandem.services.verifier.core import VerifierCore
from tandem.services.verifier.drafter_client import GrpcDrafterConnector
from tandem.services.verifier.settings import VerifierSettings


@pytest.fixture
def one_thread():
    """This thread set to one OpenMP thread (a new thread would start from every core, 2+ on CI)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_passing_thread_returns_the_result_raises_the_error_and_ends(one_thread):
    seen = {}

    def work(x: int) -> int:
        seen["thread"], seen["threads"] = threading.current_thread(), torch.get_num_threads()
        return x + 1

    assert in_passing_thread(work, 41) == 42
    assert seen["thread"] is not threading.current_thread() and not seen["thread"].is_alive()
    assert seen["threads"] == 1, "with the caller's thread count"

    def fail() -> None:
        raise ValueError("bad model path")

    with pytest.raises(ValueError, match="bad model path"):
        in_passing_thread(fail)


def test_a_compute_thread_runs_every_call_itself_in_order(one_thread):
    compute = ComputeThread("test-compute")
    assert compute.threads == 1
    where, order = set(), []

    def work(i: int) -> int:
        where.add(threading.current_thread().name)
        order.append(i)
        assert torch.get_num_threads() == 1
        return compute.call(lambda: i * 2)  # a call from the compute thread itself runs at once

    results = {}
    callers = [threading.Thread(target=lambda i=i: results.setdefault(i, compute.call(work, i))) for i in range(8)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(30)
    assert results == {i: 2 * i for i in range(8)} and where == {"test-compute"} and sorted(order) == list(range(8))
    with pytest.raises(ZeroDivisionError):
        compute.call(lambda: 1 / 0)
    assert compute.call(lambda: "still serving") == "still serving"


def test_the_step_loop_keeps_its_thread_count_and_grpc_handlers_own_no_pool(tiny_loaded):
    """A verifier built with 2 OpenMP threads, served over real gRPC: the handler threads run
    torch with one thread (so they grow no pool), which sets torch's process-wide default to one;
    every forward of the step loop still runs with its own 2 (before, the loop thread took the
    default at its first forward, after the handlers had changed it)."""
    from tandem.services.verifier.server import build_server
    from tandem.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        core = VerifierCore(VerifierSettings(verifier_id="v-threads", port=0), tiny_loaded)
        backend, real_forward, real_generate = core.engine.runner.backend, core.engine.runner.backend.forward_batch, core.generate
        loop, handler = set(), set()

        def forward(*args, **kwargs):
            loop.add((threading.current_thread().name, torch.get_num_threads()))
            return real_forward(*args, **kwargs)

        def generate(*args, **kwargs):
            handler.add(torch.get_num_threads())
            return real_generate(*args, **kwargs)

        backend.forward_batch, core.generate = forward, generate
        server, port, _ = build_server(core)
        server.start()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = verifier_pb2_grpc.VerifierStub(channel)
                for i in range(2):
                    request = verifier_pb2.SessionGenerateRequest(
                        session_id=f"s{i}", context_ids=list(range(20 + i, 60)),
                        sampling=common_pb2.SamplingParams(max_new_tokens=6, ignore_eos=True))
                    assert len(list(stub.Generate(request, timeout=60))) > 1
        finally:
            server.stop(None)
    finally:
        torch.set_num_threads(before)
    assert handler == {1}, handler
    assert loop == {("step-loop", 2)}, loop


def test_the_drafters_model_runs_on_its_own_thread(tiny_loaded, tiny_draft_loaded, one_thread, monkeypatch):
    """Draft-model proposals, whichever drafter worker handles the session's messages, all run on
    the drafter's one model thread, with its configured thread count."""
    where = set()
    real = DraftModelProposer.propose

    def propose(self, *args, **kwargs):
        where.add((threading.current_thread().name, torch.get_num_threads()))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DraftModelProposer, "propose", propose)
    dcore = DrafterCore(DrafterSettings(drafter_id="d-threads", draft_model=tiny_draft_loaded))
    server, port = build_drafter(dcore, "127.0.0.1:0")
    server.start()
    try:
        core = VerifierCore(VerifierSettings(verifier_id="v-draft", port=0, draft_wait_ms=200,
                                             drafters=(f"127.0.0.1:{port}",)), tiny_loaded,
                            connector=GrpcDrafterConnector())
        spec = SpecConfig(strategy=DraftStrategy.model, adaptive=False, max_draft_tokens=3)
        # one after another: a lone session waits for its blocks (with others running it would
        # not, and might draft nothing); each session's messages go to whichever worker is free
        done = [list(core.generate(f"s{i}", list(range(30 + i, 70 + i)),
                                   SamplingParams(max_new_tokens=12, ignore_eos=True), spec,
                                   f"127.0.0.1:{port}"))[-1] for i in range(3)]
    finally:
        server.stop(None)
    assert len(done) == 3 and sum(r.stats.drafted for r in done) > 0
    assert where == {("draft-model", 1)}, where
