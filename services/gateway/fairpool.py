"""A few threads for blocking work (chat templates, tokenization), shared fairly between tenants.

A plain thread pool serves whoever queued first: a tenant that sends many large prompts at once
fills every thread and the queue behind them, and another tenant's short chat waits for all of
it. Here each tenant has its own queue and a freed thread takes the next job of the tenant after
the tenant with the fewest jobs running (round robin among equals), so another tenant's job waits
for at most one job per busy thread, never for a tenant's backlog. How many of a tenant's jobs exist at all is bounded earlier,
by its concurrency slot (auth.TenantLimiter): a tenant holds no more threads than its slots.

Everything but the job itself runs on the event loop's thread, so the queues need no lock.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class FairPool:
    def __init__(self, workers: int, name: str):
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._free = workers
        # tenant -> its waiting jobs; a tenant served moves to the end (the order breaks ties).
        self._queues: OrderedDict[str, deque[tuple[Callable[[], Any], asyncio.Future]]] = OrderedDict()
        self._running: Counter[str] = Counter()  # tenant -> its jobs on a thread now
        self.started: list[str] = []  # tenants in the order their jobs started (tests read it)

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on a pool thread, in `tenant`'s turn."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._queues.setdefault(tenant, deque()).append((lambda: fn(*args), done))
        self._dispatch(loop)
        return await done  # cancelled while still queued: _dispatch skips it

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def _dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        while self._free and self._queues:
            # The waiting tenant with the fewest jobs running; among equals, the one served longest ago.
            tenant = min(self._queues, key=lambda t: self._running[t])
            queue = self._queues[tenant]
            job, done = queue.popleft()
            if queue:
                self._queues.move_to_end(tenant)
            else:
                del self._queues[tenant]
            if done.done():  # its caller went away while it waited
                continue
            self._free -= 1
            self._running[tenant] += 1
            self.started.append(tenant)
            del self.started[:-256]
            running = self._executor.submit(job)
            running.add_done_callback(lambda f, done=done, tenant=tenant: self._back_on_loop(loop, f, done, tenant))

    def _back_on_loop(self, loop: asyncio.AbstractEventLoop, running: Future, done: asyncio.Future, tenant: str) -> None:
        try:
            loop.call_soon_threadsafe(self._finished, loop, running, done, tenant)
        except RuntimeError:  # the loop closed while the job ran: nobody waits for it
            pass

    def _finished(self, loop: asyncio.AbstractEventLoop, running: Future, done: asyncio.Future, tenant: str) -> None:
        self._free += 1
        self._running[tenant] -= 1
        if not self._running[tenant]:
            del self._running[tenant]
        if not done.done():
            if running.exception() is not None:
                done.set_exception(running.exception())
            else:
                done.set_result(running.result())
        self._dispatch(loop)

    def shutdown(self) -> None:
        for queue in self._queues.values():
            for _, done in queue:
                done.cancel()
        self._queues.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
