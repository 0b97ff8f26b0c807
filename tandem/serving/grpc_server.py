"""What every Tandem gRPC server has in common: health checking, reflection, graceful stop."""

from __future__ import annotations

import sys

import logging
import signal
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.serving.tlsconfig import TlsConfig

log = logging.getLogger("tandem.grpc")


class _WithHealthPort:
    """A service's gRPC server plus a plaintext server carrying only grpc.health.v1 (the same
    HealthServicer), started and stopped together. With mTLS on the service port, this is what
    orchestrator probes reach: a Kubernetes gRPC probe cannot present a client certificate, and
    health answers reveal nothing but SERVING / NOT_SERVING."""

    def __init__(self, server: grpc.Server, health_server: grpc.Server):
        self._server, self._health = server, health_server

    def start(self) -> None:
        self._health.start()
        self._server.start()

    def stop(self, grace):
        done = self._server.stop(grace)
        self._health.stop(grace)
        return done

    def __getattr__(self, name):  # wait_for_termination, add_generic_rpc_handlers, ...
        return getattr(self._server, name)


def handler_thread() -> None:
    """A gRPC worker thread runs torch ops (if at all) on itself alone: with more than one thread it
    would grow an OpenMP pool of its own, and a second pool beside the step loop's throttles every
    region of every step (tandem.engine.native.threads; measured: the verifier's one-token step 9.7 ms
    with a handler's pool vs 6.7 ms without). Services without torch are not made to import it."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.get_num_threads()  # torch's lazy per-thread init first, or it would undo the next line
        torch.set_num_threads(1)


def build_server(
    register,  # callable(server) adding the service's servicers
    service_names: list[str],  # full names, e.g. "tandem.v1.Verifier", for health and reflection
    address: str,
    *,
    max_workers: int = 32,
    tls: TlsConfig | None = None,
    health_address: str | None = None,
    roles: dict[str, tuple[str, ...]] | None = None,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """A started-ready (not yet started) server bound to `address` ("host:0" = any free port).

    `tls`: mutual TLS on `address`: the server presents tls.cert and accepts only clients whose
    certificate chains to tls.ca (tandem.serving.tls; rotated files are picked up by new
    connections), and `roles` (method -> the certificate roles it serves) is enforced on every
    RPC of `service_names` (RoleCheck). `health_address`: also serve health checks, and only
    those, in plaintext there."""
    interceptors = []
    if tls is not None:
        from tandem.serving.tls import RoleCheck

        interceptors.append(RoleCheck(roles or {}, service_names))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, initializer=handler_thread),
        options=[("grpc.so_reuseport", 0)], interceptors=interceptors,
    )
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ["", *service_names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    if tls is not None:
        from tandem.serving.tls import server_credentials

        port = server.add_secure_port(address, server_credentials(tls, require_client_cert=True))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    if health_address:
        probe = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, probe)
        if probe.add_insecure_port(health_address) == 0:
            raise OSError(f"cannot bind the health server to {health_address}")
        server = _WithHealthPort(server, probe)
    return server, port, health_servicer


_CUT_WAIT_S = 3.0  # after the cut, how long the cut streams get to send their status


def wait_for_termination(server: grpc.Server, health_servicer, *, grace_s: float = 10.0, on_drain=None,
                         busy=None, on_cut=None, on_stop=None, stop: threading.Event | None = None) -> None:
    """Block until SIGINT/SIGTERM (or `stop`), then drain: report NOT_SERVING and call `on_drain`
    (so balancers and routers stop sending new work), let running calls finish for up to `grace_s`
    (`busy()`: how many are left; the wait ends early at 0), call `on_cut` (the service ends what
    is left with an explicit status), stop the server and call `on_stop`."""
    stop = stop or threading.Event()

    def handle(signum, _frame):
        log.info("received %s: draining (grace %.0f s)", signal.Signals(signum).name, grace_s)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, handle)
        signal.signal(signal.SIGTERM, handle)
    stop.wait()
    health_servicer.enter_graceful_shutdown()
    if on_drain is not None:
        on_drain()
    if busy is not None:
        deadline = time.monotonic() + grace_s
        while busy() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = busy()
        if on_cut is not None:
            on_cut()
        if left:
            waited = time.monotonic()
            while busy() and time.monotonic() - waited < _CUT_WAIT_S:
                time.sleep(0.05)
        server.stop(_CUT_WAIT_S).wait()
    else:
        server.stop(grace_s).wait()
    if on_stop is not None:
        on_stop()
    log.info("stopped")
