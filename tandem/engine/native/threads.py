"""Which threads run model work: one per process, with the configured number of OpenMP threads.

Our kernels and torch's CPU ops parallelise with OpenMP (torch's bundled libgomp; quant.c, attend.c
and the others link the same one). libgomp keeps a pool of worker threads per thread that starts
parallel regions, and once all pools together hold more threads than the process may use cores, it
cuts its spin-wait between regions to about a hundred iterations: the workers go to sleep after
every region and the next one pays futex wake-ups. A decode step is hundreds of short regions (a
one-row GEMV is ~20 us), so the step slows by multiples. Measured on the 2-core EPYC host, SmolLM2
at precision gguf, 300 tokens of context: one-token step 7-9 ms from the only thread with a pool,
15 ms from a second thread while the first one's pool exists, 33 ms back in the first thread while
the second's exists; a single 1-row GEMV 17 us vs 69 us. A thread's pool goes away with the thread.

Hence the rule for services: the main thread runs no model work (loading happens in a passing
thread, `in_passing_thread`, whose pool leaves with it), and one long-lived thread runs every
forward: the verifier's step loop, the drafter's `ComputeThread`. Each sets its OpenMP thread
count itself (`torch.set_num_threads` is per thread under OpenMP: a new thread starts from the
default, or from whatever thread last set one: `use_threads`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import torch

T = TypeVar("T")


def use_threads(n: int) -> None:
    """Run this thread's torch and OpenMP work with `n` threads from now on, whatever other threads
    set later. torch initialises a thread's count lazily at its first parallel op, from the
    process-wide value of the last `torch.set_num_threads` anywhere (a gRPC handler's 1, say): so
    trigger that first, then set ours."""
    torch.get_num_threads()
    torch.set_num_threads(n)


def in_passing_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """`fn(*args, **kwargs)` on a new thread that ends when it returns (its OpenMP pool with it);
    its result, or its exception raised here. With the caller's torch thread count."""
    threads = torch.get_num_threads()
    out: Future = Future()

    def run() -> None:
        use_threads(threads)
        try:
            out.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the caller, who raises it
            out.set_exception(exc)

    worker = threading.Thread(target=run, name="load", daemon=True)
    worker.start()
    worker.join()
    return out.result()


class ComputeThread:
    """One thread that runs the model work other threads hand it, one call at a time, in order
    (so it also serialises them, as a lock would), with `threads` OpenMP threads."""

    def __init__(self, name: str, threads: int | None = None):
        self.threads = threads or torch.get_num_threads()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` on the compute thread; waits for it (directly when called from
        the compute thread itself)."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        done: Future = Future()
        self._calls.put((fn, args, kwargs, done))
        return done.result()

    def _run(self) -> None:
        use_threads(self.threads)
        while True:
            fn, args, kwargs, done = self._calls.get()
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(fn(*args, **kwargs))
            except BaseException as exc:
                done.set_exception(exc)
