"""Trust boundaries at the command-line edge: `tandem up` starts its Valkey with a random password and
hands the URL to the services in their environment (never on a command line, never printed), gives
each verifier the stack's drafter as its allowlist; `tandem verifier` parses --drafter and the Redis
TLS options into its settings and refuses bad ones."""

from __future__ import annotations

import io
import logging
import subprocess
import types

import pytest
import redis
from typer.testing import CliRunner

import tandem.tools.cli as cli
import tandem.tools.stack as stack_module
from tandem.tools.stack import Stack, StackConfig, role_credentials

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}


class FakeProc:
    """subprocess.Popen for the services: records the command and the environment, runs nothing."""

    started: list["FakeProc"] = []

    def __init__(self, cmd, env=None, start_new_session=False, **pipes):
        self.cmd, self.env, self.returncode = cmd, env, None
        self.stderr = io.StringIO("")  # the stack forwards a child's stderr
        FakeProc.started.append(self)

    def poll(self):
        return self.returncode

    def send_signal(self, sig):
        self.returncode = -sig

    def wait(self, timeout=None):
        return self.returncode

    def kill(self):
        self.returncode = -9


@pytest.fixture
def fake_services(monkeypatch):
    """Stack.start with the services faked (the embedded Valkey is real); the started FakeProcs."""
    FakeProc.started = []
    monkeypatch.setattr(stack_module, "subprocess", types.SimpleNamespace(
        Popen=FakeProc, TimeoutExpired=subprocess.TimeoutExpired, PIPE=subprocess.PIPE))
    monkeypatch.setattr(stack_module, "wait_grpc_healthy", lambda *a, **k: None)
    monkeypatch.setattr(stack_module, "wait_http_healthy", lambda *a, **k: None)
    monkeypatch.delenv("TANDEM_REDIS_URL", raising=False)
    return FakeProc.started


def test_up_starts_valkey_with_a_password_and_wires_drafters_and_redis(fake_services, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="tandem.tools.stack")
    stack = Stack(StackConfig(model="tiny", verifiers=2, metrics=False))
    stack.start()
    try:
        url = stack.redis_url
        password = url.split("://", 1)[1].rpartition("@")[0].partition(":")[2]
        assert len(password) >= 32
        assert redis.Redis.from_url(url).ping() and redis.Redis.from_url(url).set("k", "v")
        host_port = url.rpartition("@")[2].rsplit("/", 1)[0]
        host, port = host_port.rsplit(":", 1)
        with pytest.raises(redis.exceptions.NoPermissionError):  # no password, no data
            redis.Redis(host=host, port=int(port)).get("k")

        by_role = {p.cmd[p.cmd.index("tandem.tools.cli") + 1]: [] for p in fake_services}
        for p in fake_services:
            by_role[p.cmd[p.cmd.index("tandem.tools.cli") + 1]].append(p)
        assert [len(by_role[r]) for r in ("drafter", "verifier", "gateway")] == [1, 2, 1]
        for p in by_role["verifier"]:
            assert p.cmd[p.cmd.index("--drafter") + 1] == stack.drafter_address, "the verifier allows the stack's drafter"
        for p in fake_services:
            assert "--redis-url" not in p.cmd and not any(password in arg for arg in p.cmd)
        for role in ("verifier", "gateway"):  # each as its own ACL user, never the administrator
            user, secret = role_credentials(password, role)
            for p in by_role[role]:
                assert p.env["TANDEM_REDIS_URL"] == url.replace(f"tandem:{password}@", f"{user}:{secret}@")
                assert password not in p.env["TANDEM_REDIS_URL"]
        assert "TANDEM_REDIS_URL" not in by_role["drafter"][0].env
        assert "starting verifier-0" in caplog.text and password not in caplog.text
    finally:
        stack.stop()


def test_up_prints_the_redis_url_without_its_password(monkeypatch, capsys) -> None:
    password = "s3cret-password-of-the-stack"

    def start(self):
        self.redis_url = f"redis://tandem:{password}@127.0.0.1:6379/0"
        self.drafter_address, self.verifier_addresses = "127.0.0.1:2", ["127.0.0.1:3"]
        return self

    monkeypatch.setattr(Stack, "start", start)
    monkeypatch.setattr(Stack, "stop", lambda self, grace_s=15.0: None)
    monkeypatch.setattr(cli, "_setup", lambda *a, **k: None)
    import tandem.tools.demo as demo

    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: True)
    cli._run_stack(StackConfig(model="tiny", draft_model="none"), demo_request=True)
    err = capsys.readouterr().err
    assert "redis://tandem:***@127.0.0.1:6379/0" in err and password not in err


def test_up_prints_each_restart_and_stops_with_the_reason_when_a_child_cannot_start(monkeypatch, capsys) -> None:
    """`tandem up` under supervision: what the supervisor does is printed as it happens; when it
    gives up on a child, the stack stops, naming the child and why, and the exit code is 1."""
    import typer

    def start(self):
        self.redis_url = "redis://127.0.0.1:6379/0"
        self.drafter_address, self.verifier_addresses = "127.0.0.1:2", ["127.0.0.1:3"]
        return self

    def supervise(self, on_event=None, poll_s=0.5):
        on_event("drafter killed by SIGKILL; restarting it in 1 s")
        on_event("drafter is back (restart 1)")
        self.fatal = "verifier-0 failed 3 times in a row at start; last: model not found"

    stopped = []
    monkeypatch.setattr(Stack, "start", start)
    monkeypatch.setattr(Stack, "supervise", supervise)
    monkeypatch.setattr(Stack, "stop", lambda self, grace_s=None: stopped.append(True))
    monkeypatch.setattr(cli, "_setup", lambda *a, **k: None)
    with pytest.raises(typer.Exit) as exit_:
        cli._run_stack(StackConfig(model="tiny", draft_model="none"), demo_request=False)
    assert exit_.value.exit_code == 1 and stopped
    err = " ".join(capsys.readouterr().err.split())  # rich wraps lines at the terminal's width
    assert "supervisor: drafter killed by SIGKILL; restarting it in 1 s" in err
    assert "supervisor: drafter is back (restart 1)" in err
    assert "stopping the stack: verifier-0 failed 3 times in a row at start; last: model not found" in err


@pytest.fixture
def served(monkeypatch):
    """Run `tandem verifier ...` up to serve(); returns the settings it would serve with."""
    import tandem.services.verifier.server as server

    got = []
    monkeypatch.setattr(server, "serve", got.append)
    monkeypatch.setattr(cli, "_setup", lambda *a, **k: None)
    for var in ("TANDEM_DRAFTERS", "TANDEM_REDIS_URL", "TANDEM_REDIS_CA", "TANDEM_REDIS_CERT", "TANDEM_REDIS_KEY"):
        monkeypatch.delenv(var, raising=False)

    def run(*args, env=None):
        res = CliRunner().invoke(cli.app, ["verifier", *args], env={**ENV, **(env or {})})
        return res, (got.pop() if got else None)

    return run


def test_verifier_drafter_options(served) -> None:
    res, settings = served("--drafter", "Drafter-A:50052", "--drafter", "b:1, c:2")
    assert res.exit_code == 0, res.output
    assert settings.drafters == ("drafter-a:50052", "b:1", "c:2")
    res, settings = served(env={"TANDEM_DRAFTERS": "x:1,y:2 z:3"})
    assert res.exit_code == 0, res.output
    assert settings.drafters == ("x:1", "y:2", "z:3")
    res, settings = served()
    assert settings.drafters == ()  # none unless configured
    res, settings = served("--drafter", "unix:/run/drafter.sock")
    assert res.exit_code == 2 and settings is None
    assert "HOST:PORT" in res.output


def test_verifier_redis_tls_options(served, tmp_path) -> None:
    ca, cert, key = (tmp_path / n for n in ("ca.pem", "cert.pem", "key.pem"))
    for f in (ca, cert, key):
        f.write_text("-")
    url = "rediss://tandem:s3cret@redis:6380/0"
    res, settings = served("--redis-ca", str(ca), "--redis-cert", str(cert), "--redis-key", str(key),
                           env={"TANDEM_REDIS_URL": url})
    assert res.exit_code == 0, res.output
    config = settings.residency_config()
    assert (config.url, config.ca_file, config.cert_file, config.key_file) == (url, str(ca), str(cert), str(key))
    res, settings = served("--redis-ca", str(ca), env={"TANDEM_REDIS_URL": "redis://tandem:s3cret@redis:6379/0"})
    assert res.exit_code == 2 and "rediss://" in res.output and "s3cret" not in res.output
    res, _ = served("--redis-ca", str(tmp_path / "missing.pem"), env={"TANDEM_REDIS_URL": url})
    assert res.exit_code == 2


@pytest.mark.slow
def test_up_end_to_end_with_the_password_and_the_allowlist(tiny_dir, monkeypatch) -> None:
    """The real processes: the verifier registers in the password-protected Valkey and drafts through
    the stack's drafter (its allowlist), and a request through the gateway works."""
    import httpx

    from tandem.tools.stack import free_port

    monkeypatch.delenv("TANDEM_REDIS_URL", raising=False)
    stack = Stack(StackConfig(model=str(tiny_dir), http_port=free_port(), grpc_port=free_port(), verifier_threads=1,
                              startup_timeout_s=120, log_level="warning"))
    stack.start()
    try:
        r = httpx.post(f"{stack.http_url}/v1/chat/completions", timeout=60, json={
            "model": "tiny-llama", "max_tokens": 16, "messages": [{"role": "user", "content": "the answer is the answer is"}],
            "speculation": {"strategy": "suffix"}})  # the drafter's (prompt lookup runs on the verifier)
        assert r.status_code == 200, r.text
        drafter_metrics = httpx.get(stack.metrics_urls["drafter"], timeout=10).text
        assert 'tandem_requests_total{service="drafter",status="ok"} 1.0' in drafter_metrics
        keys = redis.Redis.from_url(stack.redis_url, decode_responses=True).keys("tandem:v1:verifier:*")
        assert keys == ["tandem:v1:verifier:verifier-0"]
    finally:
        stack.stop()


@pytest.mark.slow
def test_up_with_tls_and_api_keys_end_to_end(tiny_dir, tmp_path, monkeypatch) -> None:
    """`tandem up --tls --api-keys`: HTTPS at the gateway with the stack's CA, a key required, and
    mTLS inside (the verifier refuses a caller without a certificate, while drafting through the
    drafter over mTLS works)."""
    import json
    import ssl

    import grpc
    import httpx

    from tandem.tools.stack import free_port
    from tandem.v1 import verifier_pb2, verifier_pb2_grpc

    monkeypatch.delenv("TANDEM_REDIS_URL", raising=False)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": {"me": {"keys": ["sk-stack-test-0123456789"]}}}))
    stack = Stack(StackConfig(model=str(tiny_dir), http_port=free_port(), grpc_port=free_port(), verifier_threads=1,
                              startup_timeout_s=120, log_level="warning", tls_dir=tmp_path / "certs",
                              api_keys_file=keys))
    stack.start()
    try:
        assert stack.http_url.startswith("https://") and stack.ca == tmp_path / "certs" / "ca.pem"
        body = {"model": "tiny-llama", "max_tokens": 16, "messages": [{"role": "user", "content": "the answer is the answer is"}],
                "speculation": {"strategy": "suffix"}}  # the drafter's (prompt lookup runs on the verifier)
        with httpx.Client(verify=ssl.create_default_context(cafile=stack.ca), timeout=60) as http:
            assert http.post(f"{stack.http_url}/v1/chat/completions", json=body).status_code == 401
            r = http.post(f"{stack.http_url}/v1/chat/completions", json=body,
                          headers={"Authorization": "Bearer sk-stack-test-0123456789"})
            assert r.status_code == 200, r.text
        drafter_metrics = httpx.get(stack.metrics_urls["drafter"], timeout=10).text
        assert 'tandem_requests_total{service="drafter",status="ok"} 1.0' in drafter_metrics
        creds = grpc.ssl_channel_credentials(root_certificates=stack.ca.read_bytes())  # no client certificate
        with grpc.secure_channel(stack.verifier_addresses[0], creds,
                                 options=[("grpc.ssl_target_name_override", "tandem-verifier")]) as ch:
            with pytest.raises(grpc.RpcError) as err:
                verifier_pb2_grpc.VerifierStub(ch).GetInfo(verifier_pb2.InfoRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        stack.stop()
