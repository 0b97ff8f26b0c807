"""A delaying TCP proxy: network delay, jitter and dropped connections on one link, where `tc netem`
is not available (these machines lack it). The chaos soak and the latency sweep put one on the
drafter-verifier and the gateway-verifier links (tandem/tools/netns.py).

    client ──► DelayProxy(listen) ──► target          each direction delayed by rtt/2 ± jitter/2

Bytes keep their order (TCP's promise): a chunk is delivered at max(its own due time, the previous
chunk's), so jitter spreads chunks in time but never reorders them. Delay and jitter can be changed
while connections are open (the next chunk sees the new values); `drop()` resets every open
connection, as a broken link would.

Worked example: rtt_ms=20, jitter_ms=4: a request leaves the proxy 8-12 ms after it arrived, its
answer 8-12 ms after the target sent it: 16-24 ms added to every exchange.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("tandem.tools.netem")

_CHUNK = 64 * 1024


@dataclass
class LinkStats:
    connections: int = 0  # accepted so far
    dropped: int = 0  # connections reset by drop()
    bytes_up: int = 0  # client -> target
    bytes_down: int = 0  # target -> client
    open: int = 0  # connections open now


@dataclass
class DelayProxy:
    """Forward `listen` to `target` (both "host:port") with delay; start() runs it on a thread."""

    target: str
    listen: str = "127.0.0.1:0"
    rtt_ms: float = 0.0
    jitter_ms: float = 0.0
    seed: int = 0
    name: str = ""
    stats: LinkStats = field(default_factory=LinkStats)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.address = ""  # where clients connect, once started

    # -- control (any thread) -------------------------------------------------------------------

    def set_delay(self, rtt_ms: float, jitter_ms: float = 0.0) -> None:
        if rtt_ms < 0 or jitter_ms < 0 or jitter_ms > rtt_ms:
            raise ValueError(f"need 0 <= jitter_ms <= rtt_ms, got rtt {rtt_ms}, jitter {jitter_ms}")
        self.rtt_ms, self.jitter_ms = rtt_ms, jitter_ms

    def drop(self) -> int:
        """Reset every open connection (both sides see the link break). Returns how many."""
        if self._loop is None:
            return 0
        done = threading.Event()
        count = [0]

        def reset() -> None:
            for w in list(self._writers):
                count[0] += 1
                sock = w.get_extra_info("socket")
                if sock is not None:  # RST, not FIN: a broken link, not a polite close
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    except OSError:
                        pass
                w.transport.abort()
            self.stats.dropped += count[0]
            done.set()

        self._loop.call_soon_threadsafe(reset)
        done.wait(5)
        return count[0] // 2  # two writers per connection

    def start(self) -> "DelayProxy":
        ready = threading.Event()
        error: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                host, port = self.listen.rsplit(":", 1)
                self._server = loop.run_until_complete(asyncio.start_server(self._serve, host.strip("[]"), int(port)))
                sock = self._server.sockets[0].getsockname()
                self.address = f"{host}:{sock[1]}"
            except BaseException as exc:  # bind failure: said to start()'s caller
                error.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, daemon=True, name=f"proxy-{self.name or self.target}")
        self._thread.start()
        ready.wait(10)
        if error:
            raise error[0]
        log.info("proxy %s: %s -> %s (rtt %.1f ms)", self.name, self.address, self.target, self.rtt_ms)
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        loop = self._loop

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for w in list(self._writers):
                w.transport.abort()

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(5)
        self._loop = None

    # -- the proxy (its loop) -------------------------------------------------------------------

    def _one_way_s(self) -> float:
        half, spread = self.rtt_ms / 2, self.jitter_ms / 2
        return max(0.0, half + (self._rng.uniform(-spread, spread) if spread else 0.0)) / 1000.0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        host, port = self.target.rsplit(":", 1)
        try:
            up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), int(port))
        except OSError as exc:
            log.debug("proxy %s: target %s refused: %s", self.name, self.target, exc)
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        self.stats.open += 1
        try:
            await asyncio.gather(self._pump(reader, up_writer, "bytes_up"), self._pump(up_reader, writer, "bytes_down"))
        finally:
            self.stats.open -= 1
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counter: str) -> None:
        """Read, hold each chunk until it is due, write; in order. Ends (and ends the other
        direction) when either side closes or breaks."""
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if data is None:
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        last_due = 0.0
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    break
                setattr(self.stats, counter, getattr(self.stats, counter) + len(data))
                last_due = max(last_due, time.monotonic() + self._one_way_s())
                queue.put_nowait((last_due, data))
            queue.put_nowait((last_due, None))
            await sender
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            pass
        finally:
            sender.cancel()
            writer.transport.abort()
