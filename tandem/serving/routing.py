"""The gateway's routing policy: which verifier serves a request, and why.

Policy, in order (the first that applies wins):

1. **session** — the verifier that holds the session's KV: Redis's session key names it, or, when
   Redis lacks the key (a verifier publishes a turn only as it ends, or Redis is down), the
   verifier this gateway last sent the session to (`affinity`).
2. **prefix** — the verifier holding the longest resident prefix of the context (full prefix
   blocks, Redis's prefix keys); ties go to the least loaded of them. Unless it is busier than the
   least loaded verifier by more than PREFIX_SLACK (a quarter, at least 2 sessions): then by load.
   Why: every session of an agent begins with the same tool list, so without the bound every new
   session went to the one verifier that held it (measured, 32 agent sessions on 3 verifiers:
   17 rows a step there against 8 under round-robin, TTFT p90 2.2 s against 1.9 s); the least
   loaded one computes the prefix once and holds it from then on.
3. **load** — the least loaded live verifier: fewest active sessions (this gateway's own in-flight
   requests count as a fresher lower bound), then least KV in use, then the smaller id.

Only verifiers of the served model that are live, not draining (shutting down) and not excluded
(just failed, or backing off) are candidates: the caller's static ones plus those registered in Redis. When Redis does not
answer, steps 1 (by affinity) and 3 still run, labelled `redis-unavailable`, so the gateway keeps
serving. Redis is the store this policy reads (`ResidencyIndex.view`), nothing more.

Worked example: verifiers A (2 active) and B (0 active); the context's first 64 tokens are
resident on A. A new session goes to A by `prefix` (64 matched tokens); with A excluded it goes to
B by `load`; its next turn goes to whichever served it, by `session`.

Two baselines, to measure what residency buys (`--routing`, docs/benchmarks.md "Routing"):
`round-robin` sends every request to the next live verifier in turn and `least-loaded` to the
least loaded one, both whatever it holds. They read the same view from Redis as the policy above
(the same cost per request) and honour the same exclusions.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from tandem.serving.residency import ResidencyIndex, ResidencyView, VerifierRecord

RoutingReason = Literal["session", "prefix", "load", "redis-unavailable", "round-robin"]
ROUTING_POLICIES = ("residency", "round-robin", "least-loaded")
RESIDENCY_HITS = frozenset({"session", "prefix"})  # reasons that found the request's KV resident
PREFIX_SLACK = (2, 1.25)  # a prefix holder may carry min + 2 sessions or 1.25 x min, whichever is more


@dataclass(frozen=True)
class RoutingDecision:
    verifier_id: str
    address: str
    reason: RoutingReason  # why this verifier: it holds the session, the longest prefix, or is least loaded
    matched_tokens: int  # prompt tokens expected resident there (0 when routed by load)


def least_loaded(
    candidates: Sequence[VerifierRecord], inflight: Mapping[str, int] | None = None
) -> VerifierRecord | None:
    """Fewest active sessions, then least KV in use; ties go to the smaller id (deterministic).
    `inflight` holds requests the caller itself has in flight per verifier: a lower bound on its
    active sessions that is fresher than the last heartbeat."""
    inflight = inflight or {}

    def load(rec: VerifierRecord) -> tuple[int, int, str]:
        return (sessions(rec, inflight), rec.kv_used_tokens, rec.verifier_id)

    return min(candidates, key=load, default=None)


def sessions(rec: VerifierRecord, inflight: Mapping[str, int] | None = None) -> int:
    """A verifier's active sessions as this caller knows them: its last heartbeat's count, or the
    caller's own requests in flight there where more (a fresher lower bound)."""
    return max(rec.active_sessions, (inflight or {}).get(rec.verifier_id, 0))


class RoutingPolicy:
    """Session > prefix > load, reading residency from `index` (None: no Redis configured)."""

    def __init__(self, index: ResidencyIndex | None = None):
        self.index = index

    def route(
        self,
        session_id: str | None,
        token_ids: Sequence[int],
        candidates: Sequence[VerifierRecord] = (),
        *,
        model_id: str | None = None,
        exclude: Collection[str] = (),
        inflight: Mapping[str, int] | None = None,
        affinity: tuple[str, int] | None = None,
        salt: str = "",
    ) -> RoutingDecision | None:
        """The verifier for a request, or None when no candidate is left.

        `candidates`: verifiers the caller knows without Redis (its static configuration); the
        registered ones are added. `affinity` = (verifier id, tokens of this context it holds):
        where the caller last sent this session. `salt`: the request's cache salt (its tenant);
        prefix residency of other salts never matches. May block on Redis (call it off the event loop)."""

        def usable(rec: VerifierRecord) -> bool:
            return (rec.verifier_id not in exclude and not rec.draining
                    and (model_id is None or rec.model_id == model_id))

        view = None if self.index is None else self.index.view(session_id, token_ids, salt)
        live = {c.verifier_id: c for c in candidates if usable(c)}
        if view is not None:
            live.update((r.verifier_id, r) for r in view.registered if usable(r))
        if not live:
            return None
        return self._pick(live, view, len(token_ids), affinity, inflight)

    def _pick(self, live: dict[str, VerifierRecord], view: ResidencyView | None, context_len: int,
              affinity: tuple[str, int] | None, inflight: Mapping[str, int] | None) -> RoutingDecision:
        if self.index is not None and view is None:
            return self._without_residency(live, affinity, inflight, "redis-unavailable")
        if view is None:
            return self._without_residency(live, affinity, inflight, "load")
        return self._with_residency(live, view, context_len, affinity, inflight)

    @staticmethod
    def _without_residency(live: dict[str, VerifierRecord], affinity: tuple[str, int] | None,
                           inflight: Mapping[str, int] | None, reason: RoutingReason) -> RoutingDecision:
        if affinity is not None and affinity[0] in live:
            return RoutingDecision(affinity[0], live[affinity[0]].address, "session", affinity[1])
        rec = least_loaded(list(live.values()), inflight)
        return RoutingDecision(rec.verifier_id, rec.address, reason, 0)

    @staticmethod
    def _with_residency(live: dict[str, VerifierRecord], view: ResidencyView, context_len: int,
                        affinity: tuple[str, int] | None, inflight: Mapping[str, int] | None) -> RoutingDecision:
        owner = view.session_owner
        if owner in live:
            return RoutingDecision(owner, live[owner].address, "session", min(view.session_resident, context_len))
        if affinity is not None and affinity[0] in live:
            return RoutingDecision(affinity[0], live[affinity[0]].address, "session", affinity[1])
        held = {vid: n for vid, n in view.prefix_held.items() if vid in live}
        rec = least_loaded(list(live.values()), inflight)
        if held:
            best_n = max(held.values())
            best = least_loaded([live[vid] for vid, n in held.items() if n == best_n], inflight)
            floor = sessions(rec, inflight)
            if sessions(best, inflight) <= max(floor + PREFIX_SLACK[0], floor * PREFIX_SLACK[1]):
                return RoutingDecision(best.verifier_id, best.address, "prefix", best_n)
        return RoutingDecision(rec.verifier_id, rec.address, "load", 0)


class RoundRobinPolicy(RoutingPolicy):
    """Baseline: each request to the next live verifier in turn (by id), whatever it holds."""

    def __init__(self, index: ResidencyIndex | None = None):
        super().__init__(index)
        self._turn = itertools.count()  # next() is atomic: routes run on several threads

    def _pick(self, live, view, context_len, affinity, inflight) -> RoutingDecision:
        ids = sorted(live)
        vid = ids[next(self._turn) % len(ids)]
        return RoutingDecision(vid, live[vid].address, "round-robin", 0)


class LeastLoadedPolicy(RoutingPolicy):
    """Baseline: each request to the least loaded live verifier (`least_loaded`), whatever it holds."""

    def _pick(self, live, view, context_len, affinity, inflight) -> RoutingDecision:
        rec = least_loaded(list(live.values()), inflight)
        return RoutingDecision(rec.verifier_id, rec.address, "load", 0)


def make_policy(name: str, index: ResidencyIndex | None = None) -> RoutingPolicy:
    """The policy called `name` (ROUTING_POLICIES)."""
    kinds = {"residency": RoutingPolicy, "round-robin": RoundRobinPolicy, "least-loaded": LeastLoadedPolicy}
    if name not in kinds:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(ROUTING_POLICIES)}")
    return kinds[name](index)
