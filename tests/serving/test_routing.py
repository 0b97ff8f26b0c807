"""The routing policy (tandem/serving/routing.py) without Redis: what a gateway with no residency
store, or with Redis down, decides. The same policy over a real Valkey is in test_residency.py."""

from __future__ import annotations

from tandem.serving.residency import ResidencyConfig, ResidencyIndex, VerifierRecord
from tandem.serving.routing import RoutingPolicy, least_loaded


def rec(vid: str, active: int = 0, used: int = 0, model: str = "m") -> VerifierRecord:
    return VerifierRecord(verifier_id=vid, address=f"{vid}:1", model_id=model, kv_used_tokens=used,
                          active_sessions=active)


def test_without_residency_the_least_loaded_wins_and_ties_are_deterministic() -> None:
    policy = RoutingPolicy()
    d = policy.route(None, [1, 2, 3], [rec("b", 1), rec("a", 1, used=5), rec("c", 0, used=9)])
    assert (d.verifier_id, d.address, d.reason, d.matched_tokens) == ("c", "c:1", "load", 0)
    assert least_loaded([rec("b", 1), rec("a", 1)]).verifier_id == "a"  # same load: the smaller id
    # This gateway's own in-flight requests are a fresher lower bound on a verifier's sessions.
    d = policy.route(None, [1], [rec("a", 0), rec("b", 1)], inflight={"a": 3})
    assert d.verifier_id == "b"


def test_without_residency_affinity_keeps_a_session_in_place() -> None:
    policy = RoutingPolicy()
    d = policy.route("s", [1, 2], [rec("a", 0), rec("b", 5)], affinity=("b", 2))
    assert (d.verifier_id, d.reason, d.matched_tokens) == ("b", "session", 2)
    # ...unless that verifier is excluded (it just failed) or gone: then by load.
    d = policy.route("s", [1, 2], [rec("a", 0), rec("b", 5)], affinity=("b", 2), exclude={"b"})
    assert (d.verifier_id, d.reason) == ("a", "load")
    d = policy.route("s", [1, 2], [rec("a", 0)], affinity=("gone", 2))
    assert (d.verifier_id, d.reason) == ("a", "load")


def test_other_models_and_excluded_verifiers_are_never_chosen() -> None:
    policy = RoutingPolicy()
    assert policy.route(None, [1], [rec("a", model="other")], model_id="m") is None
    assert policy.route(None, [1], [rec("a")], exclude={"a"}) is None
    assert policy.route(None, [1], []) is None


def test_an_unreachable_store_routes_by_load_and_says_so() -> None:
    # Port 1 on loopback refuses at once: a real connection attempt that fails, no fake client.
    index = ResidencyIndex(ResidencyConfig(url="redis://127.0.0.1:1/0", retry_after_s=0.0))
    d = RoutingPolicy(index).route("s", [1, 2, 3], [rec("a", 2), rec("b", 0)], model_id="m")
    assert (d.verifier_id, d.reason) == ("b", "redis-unavailable")
    assert not index.redis_ok and index.errors == 1
