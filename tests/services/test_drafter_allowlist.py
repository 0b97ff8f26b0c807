"""The verifier connects only to drafters on its allowlist (docs/design.md, trust boundaries): a caller
of Generate names a drafter, but cannot make the verifier dial anything else, TCP or unix socket,
however the address is spelled. Real gRPC over sockets; the "attacker's" listeners count every
connection they see."""

from __future__ import annotations

import socket
import time

import grpc
import pytest

from acceptor import Acceptor
from tandem.contract.params import DraftStrategy, SamplingParams, SpecConfig
from tandem.engine.scheduler.generate import Engine
from tandem.services.drafter.core import DrafterCore
from tandem.services.drafter.server import build_server as build_drafter
from tandem.services.drafter.settings import DrafterSettings
from tandem.services.verifier.core import VerifierCore
from tandem.services.verifier.drafter_client import GrpcDrafterConnector
from tandem.services.verifier.server import build_server as build_verifier
from tandem.services.verifier.settings import VerifierSettings, drafter_address
from tandem.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

CONTEXT = [5, 17, 42, 99, 17, 42, 7, 250, 17, 42, 99, 3, 11, 5, 17, 42]
NEW_TOKENS = 24


class Listener(Acceptor):
    """A socket that is not a drafter: it accepts and counts connections."""

    def __init__(self, family: int = socket.AF_INET, path: str | None = None):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind(path if path is not None else ("127.0.0.1", 0))
        sock.listen(16)
        self.accepted = 0
        super().__init__(sock)

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def handle(self, conn: socket.socket) -> None:
        self.accepted += 1
        conn.close()


class SpyConnector(GrpcDrafterConnector):
    """The real connector, recording every address it is asked to open."""

    def __init__(self) -> None:
        super().__init__()
        self.opened: list[str] = []

    def open(self, address, request, **kw):
        self.opened.append(address)
        return super().open(address, request, **kw)


@pytest.fixture
def drafter():
    core = DrafterCore(DrafterSettings(drafter_id="d-allow", draft_int8=False))
    server, port = build_drafter(core, "127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture
def verifier_factory(tiny_loaded):
    """verifier_factory(drafters) -> (stub, connector): a verifier served over gRPC on port 0."""
    made = []

    def make(drafters=()):
        connector = SpyConnector()
        settings = VerifierSettings(verifier_id="v-allow", port=0, draft_wait_ms=200, drafters=drafters)
        core = VerifierCore(settings, tiny_loaded, connector=connector)
        server, port, _ = build_verifier(core)
        server.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        made.append((server, channel, core))
        return verifier_pb2_grpc.VerifierStub(channel), connector

    yield make
    for server, channel, core in made:
        channel.close()
        server.stop(None)
        core.stop()


def _generate(stub, drafter: str, strategy=common_pb2.DRAFT_STRATEGY_SUFFIX, session: str = ""):
    """(tokens, final message) of one Generate call, fixed block lengths so that drafts are verified."""
    request = verifier_pb2.SessionGenerateRequest(
        session_id=session, context_ids=CONTEXT, drafter_address=drafter,
        sampling=common_pb2.SamplingParams(max_new_tokens=NEW_TOKENS),
        speculation=common_pb2.SpeculationParams(strategy=strategy, max_draft_tokens=4, adaptive=False),
    )
    messages = list(stub.Generate(request, timeout=60))
    return [t for m in messages for t in m.token_ids], messages[-1]


def _refused(stub, drafter: str, strategy=common_pb2.DRAFT_STRATEGY_SUFFIX) -> str:
    with pytest.raises(grpc.RpcError) as info:
        _generate(stub, drafter, strategy)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    return info.value.details()


def _reference(loaded) -> list[int]:
    return Engine(loaded).generate(CONTEXT, SamplingParams(max_new_tokens=NEW_TOKENS),
                                   SpecConfig(strategy=DraftStrategy.none)).token_ids


def test_a_caller_cannot_make_the_verifier_dial_its_socket(verifier_factory, drafter, tmp_path):
    stub, connector = verifier_factory(drafters=(drafter,))
    trap = Listener()
    unix_trap = Listener(socket.AF_UNIX, str(tmp_path / "trap.sock"))
    try:
        addresses = [
            f"127.0.0.1:{trap.port}", f"localhost:{trap.port}", f" 127.0.0.1:{trap.port}\n",
            f"dns:///127.0.0.1:{trap.port}", f"ipv4:127.0.0.1:{trap.port}", f"ipv4:///127.0.0.1:{trap.port}",
            f"unix:{tmp_path}/trap.sock", f"unix://{tmp_path}/trap.sock", f"unix:///{tmp_path}/trap.sock",
            "unix-abstract:trap", f"{drafter},127.0.0.1:{trap.port}", f"{drafter}/../x",
        ]
        for address in addresses:
            details = _refused(stub, address)
            assert "not on this verifier's allowlist" in details, details
        # a refused request is refused whatever its strategy (a drafter named is a drafter asked for)
        _refused(stub, f"127.0.0.1:{trap.port}", common_pb2.DRAFT_STRATEGY_NONE)
        time.sleep(0.3)  # any connection attempt would have reached the listeners by now
        assert trap.accepted == 0 and unix_trap.accepted == 0
        assert connector.opened == [], "the connector was never asked"
    finally:
        trap.close()
        unix_trap.close()


def test_an_allowlisted_drafter_is_used_and_the_output_is_exact(verifier_factory, drafter, tiny_loaded):
    host, port = drafter.rsplit(":", 1)
    stub, connector = verifier_factory(drafters=(drafter,))
    # Spellings of the same address: surrounding whitespace, leading zeros in the port.
    for i, spelling in enumerate([drafter, f"  {host}:{port} ", f"{host}:0{port}"]):
        tokens, last = _generate(stub, spelling, session=f"s{i}")
        assert tokens == _reference(tiny_loaded)
        assert last.stats.drafted > 0, "speculation went through the drafter"
    assert connector.opened == [drafter] * 3, "the verifier dials its allowlist's entry, not the caller's string"


def test_host_names_compare_case_insensitively(verifier_factory, drafter, tiny_loaded):
    port = drafter.rsplit(":", 1)[1]
    stub, connector = verifier_factory(drafters=(f"LocalHost:{port}",))
    tokens, last = _generate(stub, f"LOCALHOST:{port}")
    assert tokens == _reference(tiny_loaded) and last.stats.drafted > 0
    assert connector.opened == [f"localhost:{port}"]
    # ... but names are never resolved: 127.0.0.1 is not "localhost" to the allowlist
    assert "allowlist" in _refused(stub, drafter)


def test_without_an_allowlist_no_drafter_may_be_named(verifier_factory, drafter, tiny_loaded):
    stub, connector = verifier_factory(drafters=())
    details = _refused(stub, drafter)
    assert "allows no drafter" in details and "--drafter" in details
    # naming none still works: the verifier's own prompt lookup drafts
    tokens, last = _generate(stub, "")
    assert tokens == _reference(tiny_loaded)
    assert connector.opened == []


def test_drafter_addresses_are_validated_and_canonical():
    assert drafter_address(" Drafter-0.Tandem.svc:050052\t") == "drafter-0.tandem.svc:50052"
    assert drafter_address("[::1]:7") == "[::1]:7"
    for bad in ["unix:/tmp/x", "unix:///tmp/x", "dns:///h:1", "ipv4:127.0.0.1:1", "h", "h:0", "h:65536", "::1:5",
                "h:1/x", "a b:1", "h:+1", "\u212aey:1", ""]:
        with pytest.raises(ValueError):
            drafter_address(bad)
    settings = VerifierSettings(drafters=["A:1", "a:01", "b:2"])
    assert settings.drafters == ("a:1", "b:2")
    with pytest.raises(ValueError, match="HOST:PORT"):
        VerifierSettings(drafters=["unix:/run/drafter.sock"])


def test_the_channel_pool_is_bounded_least_recently_used_first():
    connector = GrpcDrafterConnector(max_channels=2)
    a = connector._channel("127.0.0.1:1")
    connector._channel("127.0.0.1:2")
    assert connector._channel("127.0.0.1:1") is a  # reused, and now the most recently used
    connector._channel("127.0.0.1:3")  # one too many: 127.0.0.1:2 goes
    assert list(connector._channels) == ["127.0.0.1:1", "127.0.0.1:3"]
    connector._channel("127.0.0.1:4")
    assert list(connector._channels) == ["127.0.0.1:3", "127.0.0.1:4"]
    with pytest.raises(ValueError):  # grpc refuses calls on a closed channel
        a.unary_unary("/x.Y/Z")(b"", timeout=0.1)
    connector.close()
    assert connector._channels == {}
