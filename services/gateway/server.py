"""The gateway's gRPC face: a thin `Gateway` servicer (unpack, call GatewayCore, pack) plus the
standard health service, and reflection only when asked (`grpc_reflection`: on a public port it
lists the whole API to anyone). Domain errors become status codes in `_STATUS`, the one place that
decides them. With API keys, Generate and ListModels need the metadata entry
`authorization: Bearer KEY`; health answers without one."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.services.gateway import tool_calls
from tandem.services.gateway import errors
from tandem.services.gateway.auth import OPEN, Tenant
from tandem.services.gateway.core import Chunk, GatewayCore, GenerationRequest
from tandem.serving.protoconv import grammar_from_proto, logprobs_to_proto
from tandem.serving.protoconv import FINISH_TO_PB, STRATEGY_FROM_PB, STRATEGY_TO_PB, stats_to_proto
from tandem.serving.tls import server_credentials
from tandem.v1 import gateway_pb2, gateway_pb2_grpc

_STATUS: dict[type[errors.GatewayError], grpc.StatusCode] = {
    errors.InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    # Another turn of the session is in flight: a concurrency conflict, which ABORTED means.
    errors.SessionConflict: grpc.StatusCode.ABORTED,
    errors.PayloadTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.UnknownSession: grpc.StatusCode.NOT_FOUND,
    errors.NoVerifierAvailable: grpc.StatusCode.UNAVAILABLE,
    errors.Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    # The stream was cut after tokens went out: the client should retry the turn (its history
    # already holds the streamed prefix), as ABORTED tells it.
    errors.UpstreamFailed: grpc.StatusCode.ABORTED,
}

_GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


def status_code(exc: errors.GatewayError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in _STATUS:
            return _STATUS[cls]
    return grpc.StatusCode.INTERNAL


def _grammar(s):
    if not s.HasField("grammar"):
        return None
    try:
        return grammar_from_proto(s.grammar)
    except ValueError as exc:
        raise errors.InvalidRequest(f"sampling.grammar: {exc}") from None


def tool_plan(msg: gateway_pb2.GenerateRequest, support: tool_calls.ToolSupport) -> tool_calls.ToolPlan:
    """What a request may call and how its calls are parsed, for the gateway's model."""
    if not msg.tools and not msg.HasField("tool_choice"):
        return tool_calls.NO_TOOLS
    listed = []
    for i, t in enumerate(msg.tools):
        try:
            params = json.loads(t.parameters_json) if t.parameters_json else None
        except ValueError:
            raise errors.InvalidRequest(f"tools[{i}].parameters_json is not JSON") from None
        listed.append({"type": "function", "function": {"name": t.name, "description": t.description,
                                                        "parameters": params}})
    which = msg.tool_choice.WhichOneof("choice") if msg.HasField("tool_choice") else None
    choice = (None if which is None else msg.tool_choice.mode if which == "mode"
              else {"type": "function", "function": {"name": msg.tool_choice.function}})
    fns, mode = tool_calls.chosen(listed, choice)
    parallel = not msg.HasField("parallel_tool_calls") or msg.parallel_tool_calls
    return tool_calls.ToolPlan(tuple(fns), mode, support.dialect, parallel)


def unpack_request(msg: gateway_pb2.GenerateRequest, time_remaining: float | None,
                   tenant: Tenant = OPEN, plan: tool_calls.ToolPlan = tool_calls.NO_TOOLS) -> GenerationRequest:
    which = msg.WhichOneof("input")
    fields: dict = {
        "session_id": msg.session_id or None,
        "model": msg.model or None,
        "timeout_s": time_remaining,
        "tenant": tenant,
    }
    if which == "prompt":
        fields["prompt"] = msg.prompt
    elif which == "messages":
        fields["messages"] = [{"role": m.role, "content": m.content} for m in msg.messages.messages]
    elif which == "prompt_ids":
        if not msg.prompt_ids.ids:
            raise errors.InvalidRequest("prompt_ids is empty")
        fields["prompt"] = list(msg.prompt_ids.ids)
    if msg.HasField("sampling"):
        s = msg.sampling
        fields.update(
            temperature=s.temperature,
            top_p=None if s.top_p in (0.0, 1.0) else s.top_p,  # 0 or 1 = off; anything else is checked
            top_k=s.top_k,
            seed=s.seed if s.HasField("seed") else None,
            max_tokens=s.max_new_tokens or None,  # 0 = server default
            stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty or None,  # 0 = off
            logit_bias=tuple(sorted(s.logit_bias.items())),
            min_p=s.min_p,
            stop=tuple(s.stop),
            top_logprobs=s.top_logprobs if s.HasField("top_logprobs") else None,
            grammar=_grammar(s),
        )
    if plan.fns:
        if which != "messages":
            raise errors.InvalidRequest("tools need a chat (messages), not a raw prompt")
        fields["tool_functions"] = plan.fns
        if plan.mode == "required":
            if fields.get("grammar") is not None:
                raise errors.InvalidRequest("a required tool call is its own grammar: drop sampling.grammar")
            fields["grammar"] = tool_calls.call_grammar(list(plan.fns), plan.dialect)
    if msg.HasField("speculation"):
        p = msg.speculation
        if p.strategy and p.strategy not in STRATEGY_FROM_PB:
            # An enum number this build does not know (a newer client, or garbage): refuse rather
            # than guess.
            raise errors.InvalidRequest(f"speculation.strategy {p.strategy} is not a known DraftStrategy")
        fields.update(
            strategy=STRATEGY_FROM_PB[p.strategy].value if p.strategy in STRATEGY_FROM_PB else None,  # UNSPECIFIED = default
            max_draft_tokens=p.max_draft_tokens or None,
            adaptive=p.adaptive if p.HasField("adaptive") else None,
        )
    return GenerationRequest(**fields)


def pack_chunk(chunk: Chunk) -> gateway_pb2.GenerateResponse:
    msg = gateway_pb2.GenerateResponse(
        text=chunk.text,
        token_ids=list(chunk.token_ids),
        first_index=chunk.first_index,
        finish_reason=FINISH_TO_PB[chunk.finish_reason],
        verifier_id=chunk.verifier_id,
        logprobs=logprobs_to_proto(chunk.logprobs),
        resumed=chunk.resumed,
    )
    if chunk.usage is not None:
        msg.usage.CopyFrom(
            gateway_pb2.Usage(
                prompt_tokens=chunk.usage.prompt_tokens,
                completion_tokens=chunk.usage.completion_tokens,
                cached_prompt_tokens=chunk.usage.cached_prompt_tokens,
            )
        )
    if chunk.stats is not None:
        msg.stats.CopyFrom(stats_to_proto(chunk.stats))
    return msg


@dataclass(frozen=True)
class _Undecodable:
    """A request whose bytes are not its message type (bad UTF-8 in a string, a truncated field)."""


def _decoder(message_type):
    """A request deserializer that never raises: gRPC's own answer to a DecodeError is UNKNOWN and
    a logged traceback per call (a log flood anyone can send); this lets the servicer answer
    INVALID_ARGUMENT instead."""

    def decode(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError:
            return _Undecodable()

    return decode


def _add_gateway(servicer: "GatewayServicer", server) -> None:
    """gateway_pb2_grpc.add_GatewayServicer_to_server, with deserializers that do not raise."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_decoder(gateway_pb2.GenerateRequest),
            response_serializer=gateway_pb2.GenerateResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, request_deserializer=_decoder(gateway_pb2.ListModelsRequest),
            response_serializer=gateway_pb2.ListModelsResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_GATEWAY_SERVICE, handlers),))
    server.add_registered_method_handlers(_GATEWAY_SERVICE, handlers)


_NOT_A_MESSAGE = "the request bytes are not a valid {} message"


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, core: GatewayCore):
        self._core = core

    def _tenant(self, context) -> Tenant:
        auth = [v for k, v in (context.invocation_metadata() or ()) if k == "authorization"]
        return self._core.authenticate(auth[0] if len(auth) == 1 else None)

    async def Generate(self, request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _NOT_A_MESSAGE.format("tandem.v1.GenerateRequest"))
        slot = None
        try:
            tenant = self._tenant(context)
            slot = self._core.limiter.enter(tenant)  # before the request is tokenized
            plan = tool_plan(request, self._core.tool_support)
            req = dataclasses.replace(unpack_request(request, context.time_remaining(), tenant, plan), slot=slot)
            n = max(1, request.n)
            texts: list[list[str]] = [[] for _ in range(min(n, self._core.MAX_CHOICES))]
            stream = (self._core.stream_choices(req, n) if n > 1
                      else ((0, c) async for c in self._core.generate(req)))
            async for i, chunk in stream:
                msg = pack_chunk(chunk)
                msg.choice = i
                texts[i].append(chunk.text)
                if chunk.finish_reason is not None and plan.mode != "none":
                    _, calls = tool_calls.parse("".join(texts[i]), plan)
                    msg.tool_calls.extend(gateway_pb2.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments)
                                          for c in calls)
                yield msg
        except errors.GatewayError as exc:
            await context.abort(status_code(exc), str(exc))
        finally:
            if slot is not None:
                slot.release()

    async def ListModels(self, request, context):
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _NOT_A_MESSAGE.format("tandem.v1.ListModelsRequest"))
        try:
            self._tenant(context)
        except errors.GatewayError as exc:
            await context.abort(status_code(exc), str(exc))
        return gateway_pb2.ListModelsResponse(
            models=[
                gateway_pb2.ModelInfo(
                    id=card.id,
                    is_default=card.is_default,
                    max_context_tokens=card.max_context_tokens,
                    verifier_count=card.verifier_count,
                    strategies=[STRATEGY_TO_PB[s] for s in card.strategies],
                    precision=card.precision,
                )
                for card in self._core.list_models()
            ]
        )


class _Health(health.aio.HealthServicer):
    """grpc.health.v1: service "" is the process (liveness, always SERVING until shutdown);
    "tandem.v1.Gateway" is SERVING while some verifier of the model is live (readiness)."""

    def __init__(self, core: GatewayCore):
        super().__init__()
        self._core = core

    async def Check(self, request, context):
        if request.service == _GATEWAY_SERVICE and not self._gracefully_shutting_down:
            live = bool(self._core.live_verifiers()) and not self._core.draining
            return health_pb2.HealthCheckResponse(
                status=health_pb2.HealthCheckResponse.SERVING if live else health_pb2.HealthCheckResponse.NOT_SERVING
            )
        return await super().Check(request, context)


def build_grpc_server(core: GatewayCore, address: str = "127.0.0.1:0") -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server with Gateway and health (and reflection if the settings ask), bound to
    `address` (port 0 = a free one) but not started: `await server.start()`, later
    `await server.stop(grace)`. Messages above `max_body_bytes` are refused by gRPC itself
    (RESOURCE_EXHAUSTED) before they reach the servicer."""
    limit = core.settings.max_body_bytes
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit)])
    _add_gateway(GatewayServicer(core), server)
    health_pb2_grpc.add_HealthServicer_to_server(_Health(core), server)
    if core.settings.grpc_reflection:
        names = (
            _GATEWAY_SERVICE,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, server)
    if core.settings.public_tls is not None:
        port = server.add_secure_port(address, server_credentials(core.settings.public_tls, require_client_cert=False))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind the gateway's gRPC server to {address}")
    return server, port
