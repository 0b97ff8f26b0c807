"""Bench target over a running stack: the same modes, through the gateway's gRPC `Generate`.

`tandem bench --endpoint HOST:PORT` uses this instead of an in-process engine, and writes the same
JSON, so in-process and distributed speculation can be compared side by side. Times are measured at
the client, end to end (gateway, verifier, drafter and the network between them included). Every
request is a one-off (no session id), so no run reuses another's KV cache.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import grpc

from tandem.engine.config import DraftStrategy, SamplingParams
from tandem.tools.datasets import PromptRecord, to_chat
from tandem.serving.protoconv import FINISH_FROM_PB, STRATEGY_TO_PB, sampling_to_proto, stats_from_proto
from tandem.engine.spec import FinishReason, GenerationResult
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

_MODE_STRATEGY = {"ar": DraftStrategy.none, "ngram": DraftStrategy.ngram, "suffix": DraftStrategy.suffix,
                  "model": DraftStrategy.model,
                  "hybrid": DraftStrategy.hybrid}


class GatewayTarget:
    def __init__(self, endpoint: str, *, timeout_s: float = 600.0, ca: Path | None = None, api_key: str | None = None):
        """`ca`: the gateway speaks TLS with a certificate from this CA; `api_key`: sent as
        `authorization: Bearer KEY` metadata."""
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.channel = grpc.insecure_channel(endpoint) if ca is None else grpc.secure_channel(
            endpoint, grpc.ssl_channel_credentials(root_certificates=Path(ca).read_bytes()))
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.tls = ca is not None
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        try:
            models = self.stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10, metadata=self.metadata).models
        except grpc.RpcError as exc:
            raise ValueError(f"no gateway answers at {endpoint}: {exc.code().name} {exc.details()}") from exc
        if not models:
            raise ValueError(f"the gateway at {endpoint} serves no model")
        default = next((m for m in models if m.is_default), models[0])
        self.model_id = default.id
        self.draft_id = "remote drafter" if common_pb2.DRAFT_STRATEGY_MODEL in default.strategies else None

    def prepare(self, rec: PromptRecord) -> tuple[gateway_pb2.ChatMessages, int | None]:
        msgs = [gateway_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in to_chat(rec, 0)]
        return gateway_pb2.ChatMessages(messages=msgs), None

    def generate(self, ctx: gateway_pb2.ChatMessages, sampling: SamplingParams, mode: str) -> GenerationResult:
        req = gateway_pb2.GenerateRequest(
            messages=ctx,
            sampling=sampling_to_proto(sampling),
            speculation=common_pb2.SpeculationParams(strategy=STRATEGY_TO_PB[_MODE_STRATEGY[mode]]),
        )
        start = time.perf_counter()
        first = None
        tokens: list[int] = []
        last = None
        for msg in self.stub.Generate(req, timeout=self.timeout_s, metadata=self.metadata):
            if msg.token_ids:
                first = first or time.perf_counter()
                tokens.extend(msg.token_ids)
            last = msg
        end = time.perf_counter()
        stats = stats_from_proto(last.stats)
        # The stream carries the output only: the stop token that ended it is not streamed (the
        # in-process engine's token_ids leave it out alike).
        return GenerationResult(
            token_ids=tokens, finish_reason=FINISH_FROM_PB.get(last.finish_reason, FinishReason.error), stats=stats,
            prompt_tokens=last.usage.prompt_tokens, seconds=end - start,
            first_token_seconds=(first or end) - start,
        )

    def machine(self) -> dict:
        return {
            "endpoint": self.endpoint,
            "tls": self.tls,
            "client_platform": platform.platform(),
            "python": sys.version.split()[0],
            "cpu_count": os.cpu_count(),
        }
