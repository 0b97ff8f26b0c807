"""The verifier's gRPC face: unpack, call VerifierCore, pack. Errors map to status codes here."""

from __future__ import annotations

import contextlib
import logging

import grpc

from tandem.engine.config import SpecConfig
from tandem.serving.grpc_server import build_server as _build, wait_for_termination
from tandem.serving.protoconv import FINISH_TO_PB, STRATEGY_FROM_PB, sampling_from_proto
from tandem.engine.spec import GenerationResult, SpecStats
from tandem.serving.telemetry import inject_metadata
from tandem.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

from .core import InvalidRequest, Overloaded, SessionBusy, VerifierCore

log = logging.getLogger("tandem.verifier.server")

SERVICE = "tandem.v1.Verifier"

def spec_from_proto(msg: common_pb2.SpeculationParams, default: SpecConfig) -> SpecConfig:
    update: dict = {}
    if msg.strategy != common_pb2.DRAFT_STRATEGY_UNSPECIFIED:
        update["strategy"] = STRATEGY_FROM_PB[msg.strategy]
    if msg.max_draft_tokens:
        update["max_draft_tokens"] = msg.max_draft_tokens
    if msg.HasField("adaptive"):
        update["adaptive"] = msg.adaptive
    return SpecConfig.model_validate({**default.model_dump(), **update})


def stats_to_proto(s: SpecStats) -> common_pb2.SpeculationStats:
    return common_pb2.SpeculationStats(
        drafted=s.drafted, accepted=s.accepted, recovered=s.recovered, bonus=s.bonus, steps=s.steps,
        mean_accepted_len=s.mean_accepted_len, fallback_steps=s.fallback_steps,
        rejected_blocks=s.rejected_blocks, prefill_reused_tokens=s.prefill_reused_tokens,
        prefill_computed_tokens=s.prefill_computed_tokens, plain_steps=s.steps - s.spec_steps,
        decode_time_us=int((s.verify_seconds + s.draft_seconds) * 1e6),
    )


@contextlib.contextmanager
def status_mapping(context: grpc.ServicerContext):
    """The one place where domain errors become gRPC status codes."""
    try:
        yield
    except (InvalidRequest, ValueError) as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    except SessionBusy as exc:
        context.abort(grpc.StatusCode.ABORTED, str(exc))
    except Overloaded as exc:
        context.set_trailing_metadata((("retry-after-ms", str(int(exc.retry_after_s * 1000))),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, core: VerifierCore):
        self.core = core
        self.default_spec = SpecConfig(
            strategy=core.settings.default_strategy, max_draft_tokens=core.settings.max_draft_tokens
        )

    def Generate(self, request: verifier_pb2.SessionGenerateRequest, context: grpc.ServicerContext):
        with status_mapping(context):
            sampling = sampling_from_proto(request.sampling)
            spec = spec_from_proto(request.speculation, self.default_spec)
            # The trace context travels on to the drafter (the request's span is current here).
            metadata = inject_metadata()
            steps = self.core.generate(
                request.session_id, list(request.context_ids), sampling, spec, request.drafter_address,
                is_active=context.is_active, metadata=metadata,
            )
            try:
                for item in steps:
                    if isinstance(item, GenerationResult):
                        yield verifier_pb2.CommittedTokens(
                            first_index=len(item.token_ids),
                            finish_reason=FINISH_TO_PB[item.finish_reason],
                            stats=stats_to_proto(item.stats),
                        )
                    elif item.tokens:
                        yield verifier_pb2.CommittedTokens(
                            token_ids=item.tokens, first_index=item.first_index,
                            step=verifier_pb2.StepInfo(
                                drafted=item.drafted, accepted=item.accepted, block_len=item.drafted),
                        )
            finally:
                steps.close()

    def GetInfo(self, request, context):
        info = self.core.info()
        return verifier_pb2.VerifierInfo(
            verifier_id=info["verifier_id"], model_id=info["model_id"], vocab_size=info["vocab_size"],
            max_context_tokens=info["max_context_tokens"], kv_capacity_tokens=info["kv_capacity_tokens"],
            kv_used_tokens=info["kv_used_tokens"], active_sessions=info["active_sessions"],
            eos_token_ids=info["eos_token_ids"],
        )


def build_server(core: VerifierCore, address: str = "127.0.0.1:0", max_workers: int = 32):
    """(server, port, health) for `core`; the caller starts it (tests use port 0)."""
    servicer = VerifierServicer(core)
    return _build(
        lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, s), [SERVICE], address,
        max_workers=max_workers,
    )


def serve(settings) -> None:
    """Load the target, register in Redis, serve until SIGTERM/SIGINT, then drain and deregister."""
    import torch

    from tandem.engine.models import load_model, resolve_device

    torch.set_num_threads(settings.threads or torch.get_num_threads())
    target = load_model(settings.model, device=resolve_device(settings.device))
    publisher = None
    if settings.redis_url:
        from tandem.serving.residency import ResidencyPublisher

        publisher = ResidencyPublisher(settings.redis_url, heartbeat_ttl_s=settings.heartbeat_s * 5,
                                       session_ttl_s=settings.session_ttl_s)
    core = VerifierCore(settings, target, publisher=publisher)
    if settings.metrics_port is not None:
        core.metrics.serve(settings.metrics_port, settings.host)
    server, port, health_servicer = build_server(core, f"{settings.host}:{settings.port}")
    server.start()
    core.start(settings.advertise_address or f"{settings.host}:{port}")
    log.info("verifier %s serving %s on %s:%d", settings.verifier_id, target.model_id, settings.host, port)
    wait_for_termination(server, health_servicer, on_drain=core.drain, on_stop=core.stop)
