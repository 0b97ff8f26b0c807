"""The gRPC contract (protos/tandem/v1/*.proto) and its generated stubs (tandem/v1/).

Checks that the committed stubs match the .proto files, that every message and field carries the
comment the style asks for, that messages of each service survive serialization, and that a real
server built on port 0 carries the drafter's bidirectional Draft stream end to end.
"""

from __future__ import annotations

import importlib
import queue
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from tandem.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, gateway_pb2, verifier_pb2

REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "protos"
PROTO_NAMES = ("common", "gateway", "verifier", "drafter")


def test_committed_stubs_are_up_to_date() -> None:
    pytest.importorskip("grpc_tools")
    pytest.importorskip("mypy_protobuf")
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_protos.py"), "--check"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, f"stale stubs:\n{result.stdout}{result.stderr}"


def _uncommented_elements(proto: str, scratch: Path) -> list[str]:
    """Names of the messages, fields, oneofs, enums, values, services and methods of `proto` that
    have no leading comment, read from protoc's source info."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    descriptor_path = scratch / f"{proto}.desc"
    well_known = Path(protoc.__file__).parent / "_proto"
    code = protoc.main([
        "protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", "--include_source_info",
        f"--descriptor_set_out={descriptor_path}", f"tandem/v1/{proto}.proto",
    ])
    assert code == 0
    file = descriptor_pb2.FileDescriptorSet.FromString(descriptor_path.read_bytes()).file[0]
    commented = {
        tuple(loc.path) for loc in file.source_code_info.location if loc.leading_comments.strip()
    }

    missing: list[str] = []

    def check(path: tuple[int, ...], name: str) -> None:
        if path not in commented:
            missing.append(name)

    def check_enum(enum: descriptor_pb2.EnumDescriptorProto, path: tuple[int, ...]) -> None:
        check(path, enum.name)
        for i, value in enumerate(enum.value):
            check((*path, 2, i), f"{enum.name}.{value.name}")

    def check_message(message: descriptor_pb2.DescriptorProto, path: tuple[int, ...]) -> None:
        check(path, message.name)
        for i, field in enumerate(message.field):
            check((*path, 2, i), f"{message.name}.{field.name}")
        for i, oneof in enumerate(message.oneof_decl):
            if not oneof.name.startswith("_"):  # synthetic oneof of a proto3 `optional` field
                check((*path, 8, i), f"{message.name}.{oneof.name}")
        for i, nested in enumerate(message.nested_type):
            if nested.options.map_entry:  # protoc's synthetic entry of a map field: the field is commented
                continue
            check_message(nested, (*path, 3, i))
        for i, enum in enumerate(message.enum_type):
            check_enum(enum, (*path, 4, i))

    for i, message in enumerate(file.message_type):
        check_message(message, (4, i))
    for i, enum in enumerate(file.enum_type):
        check_enum(enum, (5, i))
    for i, service in enumerate(file.service):
        check((6, i), service.name)
        for j, method in enumerate(service.method):
            check((6, i, 2, j), f"{service.name}.{method.name}")
    return missing


@pytest.mark.parametrize("proto", PROTO_NAMES)
def test_every_element_of_the_contract_is_commented(proto: str, tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    assert _uncommented_elements(proto, tmp_path) == []


def test_all_generated_modules_import() -> None:
    for name in PROTO_NAMES:
        for suffix in ("_pb2", "_pb2_grpc"):
            importlib.import_module(f"tandem.v1.{name}{suffix}")


def test_services_have_the_algorithm_steps_as_rpcs() -> None:
    def rpcs(module, service: str) -> dict[str, tuple[bool, bool]]:
        methods = module.DESCRIPTOR.services_by_name[service].methods
        return {m.name: (m.client_streaming, m.server_streaming) for m in methods}

    assert rpcs(gateway_pb2, "Gateway") == {"Generate": (False, True), "ListModels": (False, False)}
    assert rpcs(verifier_pb2, "Verifier") == {"Generate": (False, True), "GetInfo": (False, False)}
    assert rpcs(drafter_pb2, "Drafter") == {"Draft": (True, True), "GetInfo": (False, False)}
    assert common_pb2.DESCRIPTOR.services_by_name == {}


def _roundtrip(message):
    copy = type(message).FromString(message.SerializeToString())
    assert copy == message
    return copy


def test_gateway_messages_roundtrip() -> None:
    request = _roundtrip(gateway_pb2.GenerateRequest(
        session_id="agent-7",
        messages=gateway_pb2.ChatMessages(messages=[
            gateway_pb2.ChatMessage(role="system", content="You are terse."),
            gateway_pb2.ChatMessage(role="user", content="2+2?"),
        ]),
        sampling=common_pb2.SamplingParams(temperature=0.7, top_p=0.9, seed=0, max_new_tokens=64),
        speculation=common_pb2.SpeculationParams(
            strategy=common_pb2.DRAFT_STRATEGY_NGRAM, max_draft_tokens=8, adaptive=False),
    ))
    assert request.WhichOneof("input") == "messages"
    assert request.sampling.HasField("seed") and request.sampling.seed == 0  # presence matters
    assert not gateway_pb2.GenerateRequest(prompt="x").sampling.HasField("seed")
    assert request.speculation.HasField("adaptive") and not request.speculation.adaptive

    last = _roundtrip(gateway_pb2.GenerateResponse(
        text="4", token_ids=[19, 2], first_index=3, finish_reason=common_pb2.FINISH_REASON_STOP,
        usage=gateway_pb2.Usage(prompt_tokens=20, completion_tokens=5, cached_prompt_tokens=16),
        stats=common_pb2.SpeculationStats(drafted=8, accepted=3, recovered=1, bonus=1, steps=2),
        verifier_id="v0",
    ))
    assert last.stats.accepted + last.stats.recovered + last.stats.bonus == last.usage.completion_tokens
    _roundtrip(gateway_pb2.ListModelsResponse(models=[gateway_pb2.ModelInfo(
        id="smollm2-135m", is_default=True, strategies=[common_pb2.DRAFT_STRATEGY_MODEL])]))


def test_verifier_messages_roundtrip() -> None:
    request = _roundtrip(verifier_pb2.SessionGenerateRequest(
        session_id="s", context_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(top_k=50),
        drafter_address="127.0.0.1:50052",
    ))
    assert list(request.context_ids) == [1, 2, 3]
    step = _roundtrip(verifier_pb2.CommittedTokens(
        token_ids=[7, 8, 9], first_index=10,
        step=verifier_pb2.StepInfo(drafted=4, accepted=2, block_len=4),
    ))
    assert step.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED and not step.HasField("stats")
    _roundtrip(verifier_pb2.VerifierInfo(verifier_id="v0", vocab_size=49152, eos_token_ids=[2]))


def test_drafter_messages_roundtrip() -> None:
    commit = _roundtrip(drafter_pb2.DraftRequest(
        session_id="s",
        commit=drafter_pb2.Commit(committed_len=13, appended_ids=[4, 5, 6], next_block_len=4),
    ))
    assert commit.WhichOneof("kind") == "commit"
    block = _roundtrip(drafter_pb2.DraftBlock(
        session_id="s", base_len=13, token_ids=[4, 5], proposer="model", draft_time_us=900,
        proposals=[
            drafter_pb2.SparseDistribution(token_ids=[4, 9], probs=[0.75, 0.25]),
            drafter_pb2.SparseDistribution(token_ids=[5], probs=[1.0]),
        ],
    ))
    assert len(block.proposals) == len(block.token_ids)
    _roundtrip(drafter_pb2.DrafterInfo(
        drafter_id="d0", strategies=[common_pb2.DRAFT_STRATEGY_NGRAM], active_sessions=1))


class RepeatLastDrafter(drafter_pb2_grpc.DrafterServicer):
    """Drafts copies of each session's last token: just enough of a drafter to drive the stream."""

    def Draft(self, request_iterator, context) -> Iterator[drafter_pb2.DraftBlock]:
        sessions: dict[str, list[int]] = {}  # session id -> every token of the sequence so far
        for request in request_iterator:
            kind = request.WhichOneof("kind")
            if kind == "close":
                sessions.pop(request.session_id, None)
                continue
            if kind == "open":
                tokens = sessions[request.session_id] = list(request.open.context_ids)
                wanted = request.open.next_block_len
            else:
                tokens = sessions[request.session_id]
                tokens.extend(request.commit.appended_ids)
                if len(tokens) != request.commit.committed_len:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "committed_len mismatch")
                wanted = request.commit.next_block_len
            if wanted:
                yield drafter_pb2.DraftBlock(
                    session_id=request.session_id, base_len=len(tokens),
                    token_ids=[tokens[-1]] * wanted, proposer="repeat-last",
                )

    def GetInfo(self, request, context) -> drafter_pb2.DrafterInfo:
        return drafter_pb2.DrafterInfo(drafter_id="test", strategies=[common_pb2.DRAFT_STRATEGY_NGRAM])


@pytest.fixture
def drafter_address() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    drafter_pb2_grpc.add_DrafterServicer_to_server(RepeatLastDrafter(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=1.0).wait(timeout=5.0)


def test_draft_stream_over_a_real_channel(drafter_address: str) -> None:
    requests: queue.Queue[drafter_pb2.DraftRequest | None] = queue.Queue()
    with grpc.insecure_channel(drafter_address) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        assert stub.GetInfo(drafter_pb2.DrafterInfoRequest(), timeout=5).drafter_id == "test"

        blocks = stub.Draft(iter(requests.get, None), timeout=5)
        requests.put(drafter_pb2.DraftRequest(session_id="s", open=drafter_pb2.OpenSession(
            context_ids=[5, 6, 7], strategy=common_pb2.DRAFT_STRATEGY_NGRAM, max_draft_tokens=4,
            vocab_size=100, next_block_len=3)))
        first = next(blocks)
        assert (first.session_id, first.base_len, list(first.token_ids)) == ("s", 3, [7, 7, 7])

        # The target accepted one draft and recovered token 9: the sequence is 5 6 7 7 9.
        requests.put(drafter_pb2.DraftRequest(session_id="s", commit=drafter_pb2.Commit(
            committed_len=5, appended_ids=[7, 9], next_block_len=2)))
        second = next(blocks)
        assert (second.base_len, list(second.token_ids)) == (5, [9, 9])

        requests.put(drafter_pb2.DraftRequest(
            session_id="s", close=drafter_pb2.CloseSession(reason="finished")))
        requests.put(None)  # half-close: the drafter ends its side of the stream
        assert list(blocks) == []
        assert blocks.code() == grpc.StatusCode.OK
