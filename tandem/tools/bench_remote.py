"""Bench target over a running stack: the same modes, through the gateway's gRPC `Generate`.

`tandem bench --endpoint HOST:PORT` uses this instead of an in-process engine, and writes the same
JSON, so in-process and distributed speculation can be compared side by side. Times are measured at
the client, end to end (gateway, verifier, drafter and the network between them included).

By default every request is a one-off (no session id), so no run reuses another's KV cache, and
only first turns run. With a tenant per mode (`mode_keys`: mode -> API key, each key another
tenant of the gateway's key file) every conversation is a session, as an agent's are: its later
turns reuse its KV on the verifier that holds it, and its first turn the KV of a prefix shared with
an earlier session of the same mode (a tool list). A verifier shares KV only within a tenant, so
one mode's run of a prompt never hands another mode that prompt's prefill, as the in-process
bench's prefix sharing never does; each mode's suffix store (the drafter's, per tenant) is fed by
its own earlier answers.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import uuid
from pathlib import Path

import grpc

from tandem.contract.params import DraftStrategy, SamplingParams
from tandem.contract.results import FinishReason
from tandem.contract.results import GenerationResult
from tandem.serving.protoconv import FINISH_FROM_PB, STRATEGY_TO_PB, sampling_to_proto, stats_from_proto
from tandem.tools.datasets import PromptRecord, to_chat
from tandem.tools.stack import grpc_channel
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

_MODE_STRATEGY = {"ar": DraftStrategy.none, "ngram": DraftStrategy.ngram, "suffix": DraftStrategy.suffix,
                  "model": DraftStrategy.model,
                  "hybrid": DraftStrategy.hybrid}


def mode_keys_from_file(path: Path, modes: list[str]) -> dict[str, str]:
    """Mode -> API key from a gateway key file (docs/security.md) whose tenants are named after the
    modes: each mode's tenant's first key given as the secret itself (a `sha256:` entry cannot be
    sent). Raises ValueError naming what is missing."""
    from tandem.services.gateway.auth import KeyFile  # the gateway's own reading of the file

    try:
        tenants = KeyFile.model_validate(json.loads(Path(path).read_text())).tenants
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        raise ValueError(f"cannot read tenants from {path}: {exc}") from None
    keys = {}
    for mode in modes:
        plain = [k for k in (tenants[mode].keys if mode in tenants else ()) if not k.startswith("sha256:")]
        if not plain:
            raise ValueError(f"{path} has no tenant {mode!r} with a key given in full: each mode needs a tenant "
                             f"of its own, named after it, with a key the client can send")
        keys[mode] = plain[0]
    if len(set(keys.values())) < len(keys):
        raise ValueError(f"{path}: two modes share a key, so they would share a tenant and its caches")
    return keys


def _chat(messages: list[dict]) -> gateway_pb2.ChatMessages:
    return gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role=m["role"], content=m["content"])
                                              for m in messages])


class GatewayTarget:
    def __init__(self, endpoint: str, *, timeout_s: float = 600.0, ca: Path | None = None, api_key: str | None = None,
                 mode_keys: dict[str, str] | None = None):
        """`ca`: the gateway speaks TLS with a certificate from this CA; `api_key`: sent as
        `authorization: Bearer KEY` metadata; `mode_keys`: a key per mode instead, each another
        tenant, and every conversation then a session (see the module docstring)."""
        if api_key and mode_keys:
            raise ValueError("give either one API key or a key per mode, not both")
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.channel = grpc_channel(endpoint, None if ca is None else Path(ca))
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.mode_metadata = {m: (("authorization", f"Bearer {k}"),) for m, k in (mode_keys or {}).items()}
        # run_bench: whether conversations are sessions (several turns, KV kept), or first turns only
        self.sessions = bool(mode_keys)
        self.tls = ca is not None
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        probe = next(iter(self.mode_metadata.values()), self.metadata)
        try:
            models = self.stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10, metadata=probe).models
        except grpc.RpcError as exc:
            raise ValueError(f"no gateway answers at {endpoint}: {exc.code().name} {exc.details()}") from exc
        if not models:
            raise ValueError(f"the gateway at {endpoint} serves no model")
        default = next((m for m in models if m.is_default), models[0])
        self.model_id = default.id
        self.draft_id = "remote drafter" if common_pb2.DRAFT_STRATEGY_MODEL in default.strategies else None

    def prepare(self, rec: PromptRecord) -> tuple[gateway_pb2.ChatMessages, int | None]:
        return _chat(to_chat(rec, 0)), None

    def generate(self, ctx: gateway_pb2.ChatMessages, sampling: SamplingParams, mode: str) -> GenerationResult:
        return self._generate(ctx, sampling, mode)[0]

    def _generate(self, ctx: gateway_pb2.ChatMessages, sampling: SamplingParams, mode: str,
                  session_id: str = "") -> tuple[GenerationResult, str]:
        """One request; the result and the reply's text."""
        req = gateway_pb2.GenerateRequest(
            session_id=session_id,
            messages=ctx,
            sampling=sampling_to_proto(sampling),
            speculation=common_pb2.SpeculationParams(strategy=STRATEGY_TO_PB[_MODE_STRATEGY[mode]]),
        )
        start = time.perf_counter()
        first = None
        tokens: list[int] = []
        text: list[str] = []
        last = None
        for msg in self.stub.Generate(req, timeout=self.timeout_s, metadata=self.mode_metadata.get(mode, self.metadata)):
            if msg.token_ids:
                first = first or time.perf_counter()
                tokens.extend(msg.token_ids)
            text.append(msg.text)
            last = msg
        end = time.perf_counter()
        stats = stats_from_proto(last.stats)
        # The stream carries the output only: the stop token that ended it is not streamed (the
        # in-process engine's token_ids leave it out alike).
        return GenerationResult(
            token_ids=tokens, finish_reason=FINISH_FROM_PB.get(last.finish_reason, FinishReason.error), stats=stats,
            prompt_tokens=last.usage.prompt_tokens, seconds=end - start,
            first_token_seconds=(first or end) - start,
        ), "".join(text)

    def conversation(self, rec: PromptRecord, mode: str) -> "RemoteConversation":
        if not self.sessions:
            raise ValueError("conversations through a stack need a tenant per mode (mode_keys)")
        return RemoteConversation(self, rec, mode)

    def machine(self) -> dict:
        return {
            "endpoint": self.endpoint,
            "tls": self.tls,
            "client_platform": platform.platform(),
            "python": sys.version.split()[0],
            "cpu_count": os.cpu_count(),
        }


class RemoteConversation:
    """One record's turns in one mode as one gateway session (a fresh id), in order: turn t sends
    the chat of the earlier turns with this mode's own replies, as the in-process Conversation
    does, and the gateway finds the session's KV where it left it."""

    def __init__(self, target: GatewayTarget, rec: PromptRecord, mode: str):
        self.target, self.rec, self.mode = target, rec, mode
        self.session_id = f"bench-{uuid.uuid4().hex[:16]}"
        self.history: list[dict] | None = None  # earlier turns' messages, no system message

    def turn(self, t: int, sampling: SamplingParams) -> GenerationResult:
        messages = to_chat(self.rec, t, self.history if t > 0 else None)
        res, reply = self.target._generate(_chat(messages), sampling, self.mode, self.session_id)
        head = 1 if self.rec.system else 0
        self.history = messages[head:] + [{"role": "assistant", "content": reply}]
        return res
