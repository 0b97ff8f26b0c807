"""`tandem up` and the gateway when a port is taken, and the supervisor's backoff for a child that
keeps exiting right after it came up. Real processes and sockets; no timings asserted.

The defect this guards: a second `tandem up` beside a running one printed "Tandem is up" (its
health check reached the first stack's gateway), then restarted its own gateway ten times with a
70-line traceback each, every second, instead of stopping with one line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from tandem.tools.stack import Child, PortTaken, Stack, StackConfig, free_port


@pytest.fixture
def held_port():
    """A port some other server listens on."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


def tandem(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.tools.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port"])
def test_up_stops_at_once_with_one_line_naming_the_port_and_its_flag(tiny_dir, held_port, flag) -> None:
    other = "--grpc-port" if flag == "--http-port" else "--http-port"
    res = tandem("up", "--model", str(tiny_dir), flag, str(held_port), other, str(free_port()))
    assert res.returncode == 2
    errors = [line for line in res.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and f"port {held_port}" in errors[0] and flag in errors[0], res.stderr
    assert "Traceback" not in res.stderr and "Tandem is up" not in res.stderr + res.stdout


def test_the_stack_checks_its_fixed_ports_before_it_starts_anything(held_port) -> None:
    s = Stack(StackConfig(http_port=held_port, grpc_port=free_port()))
    with pytest.raises(PortTaken, match=f"port {held_port} .*--http-port"):
        s.start()
    assert s.children == [] and s.valkey is None


def test_a_gateway_that_cannot_listen_says_so_in_one_line(tiny_dir, held_port) -> None:
    res = tandem("gateway", "--model", str(tiny_dir), "--verifier", f"127.0.0.1:{free_port()}",
                 "--http-port", str(held_port), "--grpc-port", str(free_port()))
    assert res.returncode != 0
    assert "Traceback" not in res.stderr, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the gateway cannot listen") and str(held_port) in last and "--http-port" in last


def test_a_child_exiting_right_after_it_came_up_waits_longer_each_time_then_stops_the_stack() -> None:
    s = Stack(StackConfig(restart_backoff_s=0.05, max_backoff_s=10.0, start_failures=4, stable_s=60.0,
                          liveness_timeout_s=0))
    delays: list[float] = []
    backoff = s._backoff
    s._backoff = lambda failures: delays.append(backoff(failures)) or delays[-1]
    # Exits by itself (code 1) at once, yet looks healthy for a moment: as a gateway whose port was
    # taken after the stack started looked through another process's health endpoint.
    child = Child("gateway", [sys.executable, "-c", "raise SystemExit(1)"], dict(os.environ), lambda proc: None)
    child.spawn()
    child.state = "up"
    child.up_since = time.monotonic()
    s.children.append(child)
    try:
        s.supervise(poll_s=0.02)
        s._supervisor.join(timeout=60)
        deadline = time.monotonic() + 60
        while s.fatal is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        s.stop(grace_s=1)
    assert s.fatal is not None and "gateway failed 4 times in a row" in s.fatal
    assert delays == sorted(delays) and len(set(delays)) == len(delays) >= 3, delays  # it grew every time


def test_a_killed_child_is_a_crash_and_its_backoff_does_not_grow() -> None:
    """A kill from outside (a signal) soon after the child came up is not a start failure."""
    s = Stack(StackConfig(restart_backoff_s=0.05, start_failures=2, stable_s=60.0, liveness_timeout_s=0))
    child = Child("drafter", [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                  dict(os.environ), lambda proc: None)
    child.spawn()
    child.proc.wait()
    child.up_since = time.monotonic()
    s.children.append(child)
    s._on_event = lambda text: None
    s._restart(child)  # one restart: the new process is healthy at once
    s.stop(grace_s=1)
    assert s.fatal is None and child.failed_starts == 0 and child.restarts == 1
