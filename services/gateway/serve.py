"""Run the gateway: the OpenAI HTTP API (uvicorn) and the gRPC Gateway service in one event loop,
over one GatewayCore. SIGTERM / SIGINT drain it: readiness turns 503 / NOT_SERVING and new requests
get 503 / UNAVAILABLE (ShuttingDown) while the ports stay open, in-flight requests get
`shutdown_grace_s` to finish, and those still running then end with an explicit error (an SSE
error event, or UNAVAILABLE on gRPC), never a silent truncation; then the servers stop."""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
from collections.abc import Callable

import uvicorn

from tandem.services.gateway.client import RpcClients
from tandem.services.gateway.core import GatewayCore
from tandem.services.gateway.http import create_app
from tandem.services.gateway.server import build_grpc_server
from tandem.services.gateway.settings import GatewaySettings
from tandem.serving.tls import http_ssl_kwargs

log = logging.getLogger("tandem.gateway")


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


async def run_gateway(
    core: GatewayCore,
    settings: GatewaySettings,
    stop: asyncio.Event,
    on_ready: Callable[[int, int], None] | None = None,
) -> None:
    """Serve until `stop` is set. `on_ready(http_port, grpc_port)` is called once both listen
    (the real ports, when the settings asked for port 0)."""
    await core.start()
    if settings.metrics_port is not None:
        core.metrics.serve(settings.metrics_port, settings.http_host)
    try:
        host = f"[{settings.grpc_host}]" if ":" in settings.grpc_host else settings.grpc_host  # IPv6
        grpc_server, grpc_port = build_grpc_server(core, f"{host}:{settings.grpc_port}")
        with _bind(settings.http_host, settings.http_port) as sock:
            http_port = sock.getsockname()[1]
            config = uvicorn.Config(
                create_app(core), lifespan="off", log_config=None, access_log=False,
                timeout_graceful_shutdown=max(1, int(settings.shutdown_grace_s)),
                **http_ssl_kwargs(settings.public_tls),
            )
            http = uvicorn.Server(config)
            await grpc_server.start()
            try:
                http_task = asyncio.create_task(http.serve(sockets=[sock]), name="gateway-http")
                while not http.started and not http_task.done():
                    await asyncio.sleep(0.01)
                if http_task.done():
                    http_task.result()  # uvicorn failed to start: raise its error
                log.info("gateway serving %s: HTTP on %d, gRPC on %d", core.model_name, http_port, grpc_port)
                if on_ready is not None:
                    on_ready(http_port, grpc_port)
                stop_task = asyncio.create_task(stop.wait())
                await asyncio.wait({http_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
                stop_task.cancel()
                await drain(core, settings.shutdown_grace_s)
                http.should_exit = True
                await asyncio.gather(http_task, grpc_server.stop(_CUT_WAIT_S), return_exceptions=True)
            finally:
                await grpc_server.stop(0)
    finally:
        core.metrics.close()
        await core.close()


_CUT_WAIT_S = 3.0  # after the cut, how long the cut requests get to send their error


async def drain(core: GatewayCore, grace_s: float) -> None:
    """Refuse new requests, wait up to `grace_s` for the running ones, cut what is left."""
    core.begin_drain()
    log.info("gateway draining: %d requests in flight (grace %.1f s)", core.in_flight, grace_s)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while core.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if core.in_flight:
        core.cut_streams()
        cut_at = loop.time()
        while core.in_flight and loop.time() - cut_at < _CUT_WAIT_S:
            await asyncio.sleep(0.05)
    log.info("gateway stopping")


def serve(settings: GatewaySettings) -> None:
    """Load the tokenizer, serve HTTP and gRPC until SIGTERM or SIGINT, then stop gracefully."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        core = GatewayCore.from_settings(settings, RpcClients(settings.tls))
        await run_gateway(core, settings, stop)

    try:
        asyncio.run(main())
    except OSError as exc:  # a port taken: one line that says which, not a traceback
        if exc.errno != errno.EADDRINUSE and "bind" not in str(exc):
            raise
        where = f"HTTP {settings.http_host}:{settings.http_port}, gRPC {settings.grpc_host}:{settings.grpc_port}"
        raise SystemExit(f"error: the gateway cannot listen ({where}): {exc.strerror or exc}; stop what holds "
                         "the port or choose another with --http-port / --grpc-port") from None
