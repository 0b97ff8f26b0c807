"""The gateway's tokenizer pool takes tenants in turn: one tenant's backlog never queues another's
job behind it (order of events, no clock)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tandem.services.gateway.fairpool import FairPool


def test_a_tenants_backlog_does_not_queue_another_tenants_job():
    async def main():
        pool = FairPool(workers=2, name="t")
        gates = [threading.Event() for _ in range(6)]
        backlog = [asyncio.ensure_future(pool.run("bulk", gate.wait, 10)) for gate in gates]
        await asyncio.sleep(0)
        other = asyncio.ensure_future(pool.run("chat", lambda: "served"))
        await asyncio.sleep(0.05)
        assert pool.started == ["bulk", "bulk"] and pool.waiting == 5  # both threads busy
        gates[0].set()  # one thread frees: the other tenant's job goes next, not bulk's third
        assert await other == "served"
        assert pool.started[:3] == ["bulk", "bulk", "chat"]
        assert not any(f.done() for f in backlog[2:]), "the other tenant waited for no more of the backlog"
        for gate in gates:
            gate.set()
        assert await asyncio.gather(*backlog) == [True] * 6
        assert pool.started.count("bulk") == 6
        pool.shutdown()

    asyncio.run(main())


def test_turns_alternate_between_waiting_tenants_and_skip_abandoned_jobs():
    async def main():
        pool = FairPool(workers=1, name="t")
        gate = threading.Event()
        first = asyncio.ensure_future(pool.run("a", gate.wait, 10))
        await asyncio.sleep(0)
        queued = {t: [asyncio.ensure_future(pool.run(t, lambda t=t: t)) for _ in range(3)] for t in "ab"}
        gone = asyncio.ensure_future(pool.run("c", lambda: "never"))
        await asyncio.sleep(0)
        gone.cancel()  # its caller left while it waited: it never runs
        gate.set()
        await first
        await asyncio.gather(*queued["a"], *queued["b"])
        assert pool.started == ["a", "b", "a", "b", "a", "b", "a"] or pool.started == ["a", "a", "b", "a", "b", "a", "b"]
        assert "c" not in pool.started
        pool.shutdown()

    asyncio.run(main())


def test_a_failing_job_raises_in_its_caller_and_frees_its_thread():
    async def main():
        pool = FairPool(workers=1, name="t")

        def boom():
            raise ValueError("bad prompt")

        with pytest.raises(ValueError, match="bad prompt"):
            await pool.run("a", boom)
        assert await pool.run("a", lambda: 7) == 7
        pool.shutdown()

    asyncio.run(main())
