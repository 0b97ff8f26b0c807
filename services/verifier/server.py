"""The verifier's gRPC face: unpack, call VerifierCore, pack. Errors map to status codes here."""

from __future__ import annotations

import contextlib
import logging

import grpc

from tandem.contract.params import SpecConfig
from tandem.contract.results import GenerationResult
from tandem.serving.grpc_server import build_server as _build, wait_for_termination
from tandem.serving.protoconv import (
    result_to_proto,
    sampling_from_proto,
    spec_from_proto,
    step_to_proto,
    verifier_info_to_proto,
)
from tandem.serving.residency import VerifierRecord
from tandem.serving.telemetry import inject_metadata
from tandem.v1 import verifier_pb2, verifier_pb2_grpc

from .core import Cancelled, Draining, InvalidRequest, Overloaded, SessionBusy, VerifierCore
from .drafter_client import GrpcDrafterConnector

log = logging.getLogger("tandem.verifier.server")

SERVICE = "tandem.v1.Verifier"


@contextlib.contextmanager
def status_mapping(context: grpc.ServicerContext):
    """The one place where domain errors become gRPC status codes."""
    try:
        yield
    except (InvalidRequest, ValueError) as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    except SessionBusy as exc:
        context.abort(grpc.StatusCode.ABORTED, str(exc))
    except Draining as exc:
        context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    except Cancelled as exc:
        context.abort(grpc.StatusCode.CANCELLED, str(exc))
    except Overloaded as exc:
        context.set_trailing_metadata((("retry-after-ms", str(int(exc.retry_after_s * 1000))),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    except Exception:  # a bug, not the caller's doing: the whole story goes to our log, not to them
        log.exception("request failed")
        context.abort(grpc.StatusCode.INTERNAL, "internal error in the verifier (logged there)")


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
            steps = self.core.generate(
                request.session_id, list(request.context_ids), sampling, spec, request.drafter_address,
                is_active=context.is_active, headers=inject_metadata(), cache_salt=request.cache_salt,
                resumed_tokens=request.resumed_tokens, admission_wait_s=request.admission_wait_ms / 1000.0,
            )
            try:
                for item in steps:
                    if isinstance(item, GenerationResult):
                        yield result_to_proto(item)
                    elif item.tokens:
                        yield step_to_proto(item)
            finally:
                steps.close()

    def GetInfo(self, request, context):
        info = self.core.info()
        return verifier_info_to_proto(VerifierRecord.coerce(info), info["vocab_size"], info["eos_token_ids"])


HEADROOM_WORKERS = 16  # threads beyond the generations in flight: health checks, GetInfo, refusals


# Who may call what, with mutual TLS (docs/security.md, "Roles between services"): only a gateway
# holds prompts of every tenant and chooses cache salts and session ids, so only a gateway's
# certificate gets a verifier's answers. A drafter's or a client's certificate from the same CA gets
# PERMISSION_DENIED before any handler runs.
ROLES = {f"/{SERVICE}/Generate": ("gateway",), f"/{SERVICE}/GetInfo": ("gateway",)}


def server_workers(settings) -> int:
    """gRPC worker threads: one per generation that can be in flight (the sessions that may generate
    at once and the requests waiting for admission) plus headroom. Each Generate stream holds a thread while it runs; with
    fewer threads, streams past the count would queue inside gRPC and so would health checks,
    which is what made a supervisor kill a verifier serving 64 sessions on the old fixed 32."""
    return settings.generating_slots + settings.admission_queue + HEADROOM_WORKERS


def build_server(core: VerifierCore, address: str = "127.0.0.1:0", max_workers: int | None = None, *,
                 tls=None, health_address: str | None = None):
    """(server, port, health) for `core`; the caller starts it (tests use port 0). `tls`: mutual
    TLS (only clients with a certificate from tls.ca); `health_address`: plaintext health only.
    `max_workers`: default `server_workers(core.settings)`."""
    max_workers = max_workers or server_workers(core.settings)
    servicer = VerifierServicer(core)
    return _build(
        lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, s), [SERVICE], address,
        max_workers=max_workers, tls=tls, health_address=health_address, roles=ROLES,
    )


def serve(settings) -> None:
    """Load the target, register in Redis, serve until SIGTERM/SIGINT, then drain: refuse new
    requests (marked draining in Redis and GetInfo), let running ones finish for the drain grace,
    cut what is left with UNAVAILABLE (gateways resume those streams elsewhere), deregister."""
    import torch

    from tandem.engine.model.loading import load_model, resolve_device
    from tandem.engine.native.threads import in_passing_thread

    torch.set_num_threads(settings.threads or torch.get_num_threads())
    publisher = None
    residency = settings.residency_config()
    if residency is not None:
        from tandem.serving.residency import ResidencyPublisher

        publisher = ResidencyPublisher(residency)

    def build() -> VerifierCore:
        target = load_model(settings.model, device=resolve_device(settings.device), precision=settings.precision)
        return VerifierCore(settings, target, publisher=publisher, connector=GrpcDrafterConnector(tls=settings.tls))

    # The main thread runs no model work: the step loop's thread is the only one with an OpenMP
    # pool while serving (tandem.engine.native.threads: a second pool halves the step's speed).
    core = in_passing_thread(build)
    target = core.target
    if settings.metrics_port is not None:
        core.metrics.serve(settings.metrics_port, settings.host)
    health = None if settings.health_port is None else f"{settings.host}:{settings.health_port}"
    server, port, health_servicer = build_server(core, f"{settings.host}:{settings.port}", tls=settings.tls,
                                                 health_address=health)
    server.start()
    core.start(settings.advertise_address or f"{settings.host}:{port}")
    log.info("verifier %s serving %s (%s) on %s:%d", settings.verifier_id, target.model_id,
             core.engine.runner.precision, settings.host, port)
    wait_for_termination(server, health_servicer, grace_s=settings.drain_grace_s, on_drain=core.drain,
                         busy=core.running, on_cut=core.cut, on_stop=core.stop)
