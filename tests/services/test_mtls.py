"""Mutual TLS inside the system, attacked over real sockets with real handshakes: every internal hop
(gateway -> verifier, verifier -> drafter) presents a certificate and checks its peer's role
certificate against the CA. Certificates come from `tandem certs` (write_dev_certs).

- the whole chain works with mTLS on, and its greedy output is still the target's own;
- a client without a certificate (or with one from another CA) cannot call a verifier or a drafter;
- a rogue verifier registered in Redis never receives a prompt, whether its certificate comes from
  another CA or is our CA's certificate of another role (a drafter's);
- probes reach the plaintext health port, which serves nothing else;
- the public ports speak HTTPS and gRPC over TLS to the official OpenAI client.
"""

from __future__ import annotations

import ssl
import threading
import time
from concurrent import futures

import grpc
import httpx
import openai
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig
from tandem.engine.model.tokenizer import apply_chat_template
from tandem.engine.scheduler.generate import Engine
from tandem.services.drafter.core import DrafterCore
from tandem.services.drafter.server import _build as build_drafter
from tandem.services.drafter.settings import DrafterSettings
from tandem.services.verifier.core import VerifierCore
from tandem.services.verifier.drafter_client import GrpcDrafterConnector
from tandem.services.verifier.server import build_server as build_verifier
from tandem.services.verifier.settings import VerifierSettings
from tandem.serving.residency import ResidencyPublisher, VerifierRecord
from tandem.serving.tls import VERIFIER_NAME, channel_credentials, channel_options, server_credentials, write_dev_certs
from tandem.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc

from test_gateway import MODEL, FakeVerifier, Gateway

MESSAGES = [{"role": "user", "content": "the answer is the answer is the answer is"}]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    root = tmp_path_factory.mktemp("certs")
    return write_dev_certs(root / "ours"), write_dev_certs(root / "rogue")


class _CountingVerifier(FakeVerifier):
    """A rogue: serves Verifier with a certificate of the attacker's choosing and counts what reaches it."""

    def __init__(self, vid, tokenizer, tls):
        self.verifier_id = vid
        self.script = list(tokenizer("the answer", add_special_tokens=False)["input_ids"])
        self.publisher, self.requests, self.cut_after, self.cut_mode = None, [], None, "abort"
        self.step_delay_s, self.kv_full, self.cancelled = 0.0, False, threading.Event()
        self.info_calls = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        verifier_pb2_grpc.add_VerifierServicer_to_server(self, self.server)
        self.port = self.server.add_secure_port("127.0.0.1:0", server_credentials(tls, require_client_cert=False))
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def GetInfo(self, request, context):
        self.info_calls += 1
        return super().GetInfo(request, context)


@pytest.fixture
def chain(certs, tiny_loaded, tiny_draft_loaded, redis_url):
    """drafter (mTLS, plaintext health port) <- verifier (mTLS) <- gateway (mTLS client, Redis)."""
    ours, _ = certs
    redis.Redis.from_url(redis_url).flushdb()
    dcore = DrafterCore(DrafterSettings(drafter_id="d0", draft_model=tiny_draft_loaded, tls=ours["drafter"]))
    dserver, dport, _ = build_drafter(dcore, "127.0.0.1:0", 16, "127.0.0.1:0")
    dserver.start()
    drafter = f"127.0.0.1:{dport}"
    publisher = ResidencyPublisher(redis_url, heartbeat_ttl_s=5, session_ttl_s=60)
    vcore = VerifierCore(VerifierSettings(verifier_id="v0", port=0, draft_wait_ms=200, drafters=(drafter,),
                                          tls=ours["verifier"]),
                         tiny_loaded, publisher=publisher, connector=GrpcDrafterConnector(tls=ours["verifier"]))
    vserver, vport, _ = build_verifier(vcore, tls=ours["verifier"])
    vserver.start()
    verifier = f"127.0.0.1:{vport}"
    vcore.start(verifier)
    gw = Gateway(tiny_loaded.tokenizer, model=MODEL, redis_url=redis_url, drafters=(drafter,), verifiers=(verifier,),
                 poll_interval_s=0.3, tls=ours["gateway"])
    time.sleep(0.4)  # one poll of the drafter's and the verifier's GetInfo, over mTLS
    yield gw, verifier, drafter, vcore
    gw.close()
    vserver.stop(None)
    vcore.stop()
    dserver.stop(None)


def _generate(gw, strategy=common_pb2.DRAFT_STRATEGY_MODEL, max_new=24):
    req = gateway_pb2.GenerateRequest(
        messages=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**m) for m in MESSAGES]),
        sampling=common_pb2.SamplingParams(max_new_tokens=max_new, ignore_eos=True),
        speculation=common_pb2.SpeculationParams(strategy=strategy, adaptive=False, max_draft_tokens=4),
    )
    out = list(gw.stub.Generate(req, timeout=30))
    return [t for m in out for t in m.token_ids], out[-1]


def test_the_chain_over_mtls_is_lossless(chain, tiny_loaded):
    gw, *_ = chain
    ctx = apply_chat_template(tiny_loaded.tokenizer, MESSAGES)
    expected = Engine(tiny_loaded).generate(ctx, SamplingParams(max_new_tokens=24, ignore_eos=True),
                                            SpecConfig(strategy=DraftStrategy.none)).token_ids
    tokens, last = _generate(gw)
    assert tokens == expected
    assert last.stats.drafted > 0, "the drafter was reached over mTLS and used"


def test_no_client_certificate_no_call(chain, certs):
    _, verifier, drafter, vcore = chain
    ours, rogue = certs
    attempts = [
        ("no certificate", channel_credentials(ours["client"], ca_only=True)),
        # The attacker trusts our CA (it is no secret) but holds a certificate of its own CA.
        ("another CA's certificate", channel_credentials(rogue["client"].model_copy(update={"ca": ours["client"].ca}))),
    ]
    served = vcore.metrics.value("tandem_requests_total", status="ok")
    for why, creds in attempts:
        for address, role, call in (
            (verifier, "tandem-verifier", lambda ch: verifier_pb2_grpc.VerifierStub(ch).GetInfo(verifier_pb2.InfoRequest(), timeout=5)),
            (drafter, "tandem-drafter", lambda ch: drafter_pb2_grpc.DrafterStub(ch).GetInfo(drafter_pb2.DrafterInfoRequest(), timeout=5)),
        ):
            with grpc.secure_channel(address, creds, options=channel_options(role)) as ch:
                with pytest.raises(grpc.RpcError) as err:
                    call(ch)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (why, address)
        with grpc.insecure_channel(verifier) as ch:  # plaintext to an mTLS port
            with pytest.raises(grpc.RpcError):
                verifier_pb2_grpc.VerifierStub(ch).GetInfo(verifier_pb2.InfoRequest(), timeout=5)
    assert vcore.metrics.value("tandem_requests_total", status="ok") == served
    # Our gateway's own certificate does work: the refusals above were about the certificate.
    with grpc.secure_channel(verifier, channel_credentials(ours["gateway"]), options=channel_options(VERIFIER_NAME)) as ch:
        assert verifier_pb2_grpc.VerifierStub(ch).GetInfo(verifier_pb2.InfoRequest(), timeout=5).verifier_id == "v0"


def test_probes_reach_a_plaintext_health_port_that_serves_nothing_else(certs, tiny_draft_loaded):
    ours, _ = certs
    dcore = DrafterCore(DrafterSettings(drafter_id="d1", tls=ours["drafter"]))
    server, port, _ = build_drafter(dcore, "127.0.0.1:0", 4, "127.0.0.1:0")
    health_port = server._health.add_insecure_port("127.0.0.1:0")  # a second, known port to probe
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as err:
                drafter_pb2_grpc.DrafterStub(ch).GetInfo(drafter_pb2.DrafterInfoRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(None)


@pytest.mark.parametrize("rogue_cert", ["another CA", "our CA, drafter role"])
def test_a_rogue_verifier_registered_in_redis_never_receives_a_prompt(chain, certs, tiny_loaded, redis_url, rogue_cert):
    gw, verifier, _, vcore = chain
    ours, rogue = certs
    tls = rogue["verifier"] if rogue_cert == "another CA" else ours["drafter"]
    evil = _CountingVerifier("v-evil", tiny_loaded.tokenizer, tls)
    try:
        # Anyone who can write to Redis can register: give the rogue the best claim there is, an
        # idle verifier of the right model holding the session already.
        pub = ResidencyPublisher(redis_url, heartbeat_ttl_s=30, session_ttl_s=60)
        pub.register(VerifierRecord("v-evil", evil.address, MODEL, 4096, 100_000, 0, 0))
        pub.publish_session("conv", "v-evil", [1, 2, 3])
        time.sleep(0.5)  # the gateway's poll reads the registration
        assert "v-evil" in {r.verifier_id for r in gw.core._registered}
        req = gateway_pb2.GenerateRequest(
            session_id="conv", prompt="the secret prompt is swordfish",
            sampling=common_pb2.SamplingParams(max_new_tokens=4, ignore_eos=True),
        )
        for _ in range(3):
            out = list(gw.stub.Generate(req, timeout=30))
            assert out[-1].verifier_id == "v0"
            gw.core.forget_session("conv")  # no affinity to the real one: routing reconsiders the rogue
        assert evil.requests == [], "the rogue verifier received a prompt"
        assert gw.core.stats.connect_failures >= 1, "the gateway tried the rogue and refused its handshake"
        pub.deregister("v-evil")
    finally:
        evil.stop()


def test_public_https_and_grpc_tls(certs, tiny_tokenizer):
    ours, _ = certs
    v = FakeVerifier("va", tiny_tokenizer)
    gw = Gateway(tiny_tokenizer, verifiers=(v.address,), public_tls=ours["gateway"].model_copy(update={"ca": None}))
    try:
        assert gw.url.startswith("https://")
        with httpx.Client(verify=ssl.create_default_context(cafile=ours["gateway"].ca)) as http:
            client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", http_client=http, max_retries=0)
            assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3).choices[0].message.content
        with pytest.raises(httpx.HTTPError):
            httpx.get(gw.url.replace("https", "http") + "/health", timeout=5)  # no plaintext
        with pytest.raises(httpx.ConnectError):
            httpx.get(gw.url + "/health", timeout=5)  # the system's CAs do not know ours
        creds = grpc.ssl_channel_credentials(root_certificates=ours["gateway"].ca.read_bytes())
        with grpc.secure_channel(f"localhost:{gw.grpc_port}", creds) as ch:
            models = gateway_pb2_grpc.GatewayStub(ch).ListModels(gateway_pb2.ListModelsRequest(), timeout=5)
            assert models.models[0].id == MODEL
    finally:
        gw.close()
        v.stop()


def _tls_stub(stub_class, address: str, role_tls, server_name: str):
    channel = grpc.secure_channel(address, channel_credentials(role_tls), options=channel_options(server_name))
    return channel, stub_class(channel)


@pytest.mark.parametrize("role", ["drafter", "client", "verifier"])
def test_only_a_gateway_certificate_gets_a_verifiers_answers(chain, certs, role):
    """Any certificate of the deployment's CA passes the handshake; the verifier serves Generate and
    GetInfo only to a gateway's. A drafter's or a client's certificate (or another verifier's) gets
    PERMISSION_DENIED before any handler runs: it chose a cache salt and another tenant's session id,
    and learns nothing of either (no session opened, no KV touched, no info returned)."""
    from tandem.serving.tls import GATEWAY_NAME

    _, verifier, _, vcore = chain
    ours, _ = certs
    before = vcore.info()
    channel, stub = _tls_stub(verifier_pb2_grpc.VerifierStub, verifier, ours[role], VERIFIER_NAME)
    with channel:
        with pytest.raises(grpc.RpcError) as info:
            stub.GetInfo(verifier_pb2.InfoRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "gateway" in info.value.details()
        probe = verifier_pb2.SessionGenerateRequest(
            session_id="acme/victim-session", cache_salt="acme-salt-guess", context_ids=[5, 17, 42, 99] * 40,
            sampling=common_pb2.SamplingParams(max_new_tokens=4))
        with pytest.raises(grpc.RpcError) as gen:
            list(stub.Generate(probe, timeout=10))
        assert gen.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # health stays open to any certificate of the CA (it reveals nothing)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    after = vcore.info()
    assert after["kv_used_tokens"] == before["kv_used_tokens"] and after["active_sessions"] == 0
    # the gateway's certificate is served
    channel, stub = _tls_stub(verifier_pb2_grpc.VerifierStub, verifier, ours["gateway"], VERIFIER_NAME)
    with channel:
        assert stub.GetInfo(verifier_pb2.InfoRequest(), timeout=10).verifier_id == "v0"
    assert GATEWAY_NAME == "tandem-gateway"


@pytest.mark.parametrize("role", ["gateway", "client", "drafter"])
def test_only_a_verifier_certificate_may_open_draft_streams(chain, certs, role):
    """A drafter drafts for verifiers only (a draft stream carries a session's tokens); a gateway's
    certificate may still read GetInfo (routing), a client's may not."""
    from tandem.serving.tls import DRAFTER_NAME

    _, _, drafter, _ = chain
    ours, _ = certs
    channel, stub = _tls_stub(drafter_pb2_grpc.DrafterStub, drafter, ours[role], DRAFTER_NAME)
    with channel:
        with pytest.raises(grpc.RpcError) as draft:
            list(stub.Draft(iter([drafter_pb2.DraftRequest()]), timeout=10))
        assert draft.value.code() == grpc.StatusCode.PERMISSION_DENIED
        if role == "gateway":
            assert stub.GetInfo(drafter_pb2.DrafterInfoRequest(), timeout=10).drafter_id == "d0"
        else:
            with pytest.raises(grpc.RpcError) as info:
                stub.GetInfo(drafter_pb2.DrafterInfoRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
