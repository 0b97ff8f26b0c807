"""KV residency in Redis (tandem/serving/residency.py) against a real Valkey server: the key schema and its
TTLs, heartbeat expiry, the routing policy reading it (session / longest prefix / load), eviction, prefix hash
chaining, and an unreachable Redis (the publisher carries on, the index routes by load)."""

from __future__ import annotations

import socket
import time

import pytest
import redis

from tandem.serving.routing import RoutingPolicy, make_policy
from tandem.serving.residency import (
    KEY_PREFIX,
    VERIFIER_INDEX_KEY,
    ResidencyConfig,
    ResidencyIndex,
    ResidencyPublisher,
    VerifierRecord,
    prefix_hashes,
    prefix_key,
    session_key,
    verifier_key,
)

BLOCK = 4


@pytest.fixture
def rds(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def config(redis_url) -> ResidencyConfig:
    return ResidencyConfig(url=redis_url, block_size=BLOCK, heartbeat_ttl_s=5.0, session_ttl_s=60.0)


def record(vid: str, *, active: int = 0, used: int = 0, model: str = "tiny") -> VerifierRecord:
    return VerifierRecord(
        verifier_id=vid, address=f"{vid}.local:1", model_id=model, max_context_tokens=512,
        kv_capacity_tokens=10_000, kv_used_tokens=used, active_sessions=active,
    )


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


def test_prefix_hashes_chain() -> None:
    a = [5, 6, 7, 8, 9, 9, 9, 9, 1]
    b = [5, 6, 7, 8, 9, 9, 9, 0, 1, 2, 3, 4]
    ha, hb = prefix_hashes(a, BLOCK), prefix_hashes(b, BLOCK)
    assert len(ha) == 2 and len(hb) == 3  # full blocks only
    assert ha[0] == hb[0]  # same first block
    assert ha[1] != hb[1]  # divergence in block 2 ...
    # ... changes every later hash too, although block 3 alone equals block 3 of another context:
    assert prefix_hashes([0, 0, 0, 0] + b[4:], BLOCK)[2] != hb[2]
    assert prefix_hashes(a, BLOCK) == ha  # deterministic
    assert prefix_hashes(a[:3], BLOCK) == []
    # Token ids are hashed as int32: ids past 2**16 still differ.
    assert prefix_hashes([70000] * 4, BLOCK) != prefix_hashes([70001] * 4, BLOCK)


def test_every_key_has_a_ttl(rds, config) -> None:
    pub = ResidencyPublisher(config)
    assert pub.register(record("va"))
    assert pub.publish_session("s1", "va", list(range(10)))  # 2 full blocks
    keys = rds.keys(KEY_PREFIX + "*")
    assert set(keys) == {
        verifier_key("va"), VERIFIER_INDEX_KEY, session_key("s1"),
        *(prefix_key(h) for h in prefix_hashes(list(range(10)), BLOCK)),
    }
    for key in keys:
        assert rds.pttl(key) > 0, key
    assert 0 < rds.pttl(verifier_key("va")) <= 5000
    assert 5000 < rds.pttl(session_key("s1")) <= 60000
    assert rds.hgetall(session_key("s1"))["resident_tokens"] == "10"
    # Idempotent: publishing again changes nothing but the TTLs.
    before = {k: rds.dump(k) for k in keys if not k.startswith(KEY_PREFIX + "session:")}
    pub.publish_session("s1", "va", list(range(10)))
    assert {k: rds.dump(k) for k in before} == before


def test_heartbeat_expiry_makes_a_verifier_disappear(rds, redis_url) -> None:
    cfg = ResidencyConfig(url=redis_url, block_size=BLOCK, heartbeat_ttl_s=0.3)
    pub, index = ResidencyPublisher(cfg), ResidencyIndex(cfg)
    pub.register(record("va"))
    pub.register(record("vb"))
    assert {v.verifier_id for v in index.verifiers()} == {"va", "vb"}
    for _ in range(3):  # va keeps beating, vb went silent
        time.sleep(0.15)
        pub.heartbeat(record("va", active=2))
    assert [(v.verifier_id, v.active_sessions) for v in index.verifiers()] == [("va", 2)]
    pub.deregister()  # the publisher's own verifier (the last registered) leaves at once
    assert rds.exists(verifier_key("vb")) == 0


def test_route_by_session_then_prefix_then_load(rds, config) -> None:
    pub_a, pub_b = ResidencyPublisher(config), ResidencyPublisher(config)
    pub_a.register(record("va", active=5))  # busier
    pub_b.register(record("vb", active=1))
    index = ResidencyIndex(config)
    system = [11, 12, 13, 14, 15, 16, 17, 18]  # two full blocks shared by every conversation
    turn1 = system + [1, 2, 3, 4, 5]
    pub_a.publish_session("s1", "va", turn1 + [40, 41])  # its KV: context + generated

    # A fresh request with no residency anywhere goes to the least loaded.
    fresh = RoutingPolicy(index).route(None, [99] * 12)
    assert (fresh.verifier_id, fresh.reason, fresh.matched_tokens) == ("vb", "load", 0)
    # The session's next turn goes where its KV is, although that verifier is busier.
    turn2 = turn1 + [40, 41, 6, 7, 8]
    d = RoutingPolicy(index).route("s1", turn2)
    assert (d.verifier_id, d.address, d.reason, d.matched_tokens) == ("va", "va.local:1", "session", 15)
    # Another session sharing the system prompt goes where that prefix is resident, unless that
    # verifier is busier than the least loaded by more than PREFIX_SLACK (here 5 against 1)...
    d = RoutingPolicy(index).route("s2", system + [9, 9, 9, 9, 9])
    assert (d.verifier_id, d.reason, d.matched_tokens) == ("vb", "load", 0)
    pub_a.heartbeat(record("va", active=3))  # ...1 + 2 is within it
    d = RoutingPolicy(index).route("s2", system + [9, 9, 9, 9, 9])
    assert (d.verifier_id, d.reason, d.matched_tokens) == ("va", "prefix", 8)
    assert index.longest_prefix(turn2) == {"va": 12}
    # The longest prefix wins over a shorter one elsewhere.
    pub_b.publish_session("s3", "vb", system + [7, 7, 7, 7])
    d = RoutingPolicy(index).route("s4", turn1 + [40, 41, 0])
    assert (d.verifier_id, d.matched_tokens) == ("va", 12)  # vb holds only the first 8
    assert index.longest_prefix(system + [7, 7, 7, 7, 1]) == {"va": 8, "vb": 12}
    # The caller's memory of a session stands in for a session key Redis does not have (yet).
    d = RoutingPolicy(index).route("s9", turn2, affinity=("vb", 7))
    assert (d.verifier_id, d.reason, d.matched_tokens) == ("vb", "session", 7)
    # A session whose verifier is excluded (it failed to connect) falls back to prefix, then load.
    d = RoutingPolicy(index).route("s1", turn2, exclude={"va"})
    assert (d.verifier_id, d.reason) == ("vb", "prefix")
    # Another model's verifiers are never chosen.
    assert RoutingPolicy(index).route("s1", turn2, model_id="other") is None
    # The caller's in-flight counts are a lower bound on a verifier's load.
    assert RoutingPolicy(index).route(None, [99] * 12, inflight={"vb": 9}).verifier_id == "va"


def test_route_takes_static_candidates_and_skips_dead_sessions(rds, config) -> None:
    index = ResidencyIndex(config)
    static = [record("vs", active=0)]
    pub = ResidencyPublisher(config)
    pub.publish_session("s1", "vgone", list(range(8)))  # its verifier never registered (dead)
    d = RoutingPolicy(index).route("s1", list(range(8)), static)
    assert (d.verifier_id, d.reason) == ("vs", "load")
    assert index.session_verifier("s1") == "vgone"
    assert RoutingPolicy(index).route("s1", [1], []) is None


def test_eviction_removes_keys_but_keeps_shared_blocks(rds, config) -> None:
    pub = ResidencyPublisher(config)
    pub.register(record("va"))
    shared = [1, 2, 3, 4]
    pub.publish_session("s1", "va", shared + [5, 6, 7, 8])
    pub.publish_session("s2", "va", shared + [9, 9, 9, 9])
    h_shared, h_s1 = prefix_hashes(shared + [5, 6, 7, 8], BLOCK)
    assert pub.evict_session("s1")
    assert rds.exists(session_key("s1")) == 0
    assert rds.smembers(prefix_key(h_s1)) == set()  # only s1 held it
    assert rds.smembers(prefix_key(h_shared)) == {"va"}  # s2 still holds the shared block
    # A session's history that diverged releases the blocks it no longer holds.
    h_s2 = prefix_hashes(shared + [9, 9, 9, 9], BLOCK)[1]
    pub.publish_session("s2", "va", shared + [0, 0, 0, 0])
    assert rds.smembers(prefix_key(h_s2)) == set()
    pub.evict_session("s2")
    assert rds.keys(KEY_PREFIX + "prefix:*") == []
    assert ResidencyIndex(config).longest_prefix(shared * 2) == {}


def test_redis_unreachable(caplog) -> None:
    cfg = ResidencyConfig(url=closed_port_url(), block_size=BLOCK, retry_after_s=0.0)
    pub = ResidencyPublisher(cfg)
    t0 = time.monotonic()
    assert pub.register(record("va")) is False
    assert pub.heartbeat(record("va")) is False
    assert pub.publish_session("s1", "va", list(range(8))) is False
    assert pub.evict_session("s1") is False
    assert pub.deregister() is False
    assert pub.errors == 5 and not pub.redis_ok
    index = ResidencyIndex(cfg)
    assert index.verifiers() == [] and index.session_verifier("s1") is None and index.longest_prefix([1] * 8) == {}
    d = RoutingPolicy(index).route("s1", list(range(8)), [record("vb", active=3), record("vc", active=1)])
    assert (d.verifier_id, d.address, d.reason, d.matched_tokens) == ("vc", "vc.local:1", "redis-unavailable", 0)
    assert not index.redis_ok and index.errors == 4
    # The caller's own memory of the session still keeps it in place.
    d = RoutingPolicy(index).route("s1", list(range(8)), [record("vb", active=3), record("vc", active=1)], affinity=("vb", 6))
    assert (d.verifier_id, d.reason, d.matched_tokens) == ("vb", "session", 6)
    assert time.monotonic() - t0 < 2.0  # refused connections fail fast
    outage_logs = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(outage_logs) == 2  # once per outage per component, not once per call


def test_outage_skips_redis_then_recovers(rds, config, caplog) -> None:
    cfg = config.model_copy(update={"retry_after_s": 60.0})
    index = ResidencyIndex(cfg)
    real = index._redis
    index._redis = redis.Redis.from_url(closed_port_url(), socket_timeout=0.2)
    assert index.verifiers() == [] and index.errors == 1
    index.verifiers()  # within retry_after_s: not attempted
    assert index._health.skipped == 1 and index.errors == 1
    index._redis, index._health._next_try = real, 0.0  # Redis is back and it is time to retry
    ResidencyPublisher(cfg).register(record("va"))
    assert [v.verifier_id for v in index.verifiers()] == ["va"] and index.redis_ok
    assert any("reachable again" in r.getMessage() for r in caplog.records)


def test_publisher_takes_a_url_and_an_info_mapping(rds, redis_url) -> None:
    # The verifier hands its GetInfo fields as a dict (extra keys such as vocab_size are ignored).
    pub = ResidencyPublisher(redis_url, block_size=BLOCK, heartbeat_ttl_s=5.0)
    info = {**record("va", active=1).__dict__, "vocab_size": 512, "eos_token_ids": [2]}
    assert pub.register(info) and pub.heartbeat(info)
    (rec,) = ResidencyIndex(redis_url, block_size=BLOCK).verifiers()
    assert (rec.verifier_id, rec.address, rec.active_sessions, rec.max_context_tokens) == ("va", "va.local:1", 1, 512)
    assert pub.deregister("va") and rds.keys(KEY_PREFIX + "*") == []


def test_baselines_ignore_what_verifiers_hold(rds, config) -> None:
    """`--routing round-robin` / `least-loaded` (the baselines residency is measured against) send
    a session's next turn wherever their rule says, not where its KV is; they honour exclusions and
    the model like the residency policy."""
    pub_a, pub_b, pub_c = ResidencyPublisher(config), ResidencyPublisher(config), ResidencyPublisher(config)
    pub_a.register(record("va", active=5))
    pub_b.register(record("vb", active=1))
    pub_c.register(record("vc", active=3))
    index = ResidencyIndex(config)
    turn1 = [11, 12, 13, 14, 15, 16, 17, 18, 1, 2]
    pub_a.publish_session("s1", "va", turn1 + [40, 41])
    turn2 = turn1 + [40, 41, 6]
    assert make_policy("residency", index).route("s1", turn2).verifier_id == "va"
    rr = make_policy("round-robin", index)
    picks = [rr.route("s1", turn2) for _ in range(6)]
    assert [d.verifier_id for d in picks] == ["va", "vb", "vc"] * 2
    assert {(d.reason, d.matched_tokens) for d in picks} == {("round-robin", 0)}
    assert [rr.route("s1", turn2, exclude={"vb"}).verifier_id for _ in range(2)] in (["va", "vc"], ["vc", "va"])
    ll = make_policy("least-loaded", index)
    d = ll.route("s1", turn2)
    assert (d.verifier_id, d.reason, d.matched_tokens) == ("vb", "load", 0)  # not va, which holds s1
    assert ll.route("s1", turn2, affinity=("va", 12)).verifier_id == "vb"
    assert ll.route("s1", turn2, exclude={"vb"}).verifier_id == "vc"
    assert ll.route("s1", turn2, model_id="other") is None and rr.route("s1", turn2, model_id="other") is None
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_policy("random", index)
