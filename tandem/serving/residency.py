"""KV residency in Redis: which verifier is alive, which holds a session, which holds a prompt prefix.

Verifiers publish (`ResidencyPublisher`), gateways read (`ResidencyIndex`) and route by the policy in
tandem.serving.routing. Redis holds
metadata only, never tensors. It is an optimization, never a dependency: every method catches Redis
errors, counts them and logs once per outage, so a verifier keeps serving and a gateway keeps
routing (by load) while Redis is down. While an outage lasts, calls skip Redis for `retry_after_s`
after each failure, so a dead server costs one short timeout per interval, not one per request.

Key schema (version `v1`; every key carries a TTL; every write is idempotent; a missing key means
"unknown", never an error):

    tandem:v1:verifier:{id}   hash  address, model_id, max_context_tokens, kv_capacity_tokens,
                                    kv_used_tokens, active_sessions, updated_at (unix seconds),
                                    draining ("1" while it shuts down: no new requests).
                                    TTL heartbeat_ttl_s, refreshed by every heartbeat: a verifier
                                    whose key expired is dead.
    tandem:v1:verifiers       zset  member = verifier id, score = its last heartbeat (unix seconds).
                                    An index so that readers need no SCAN; it only names candidates:
                                    a member is live only while its verifier hash exists. TTL
                                    heartbeat_ttl_s, refreshed by every heartbeat.
    tandem:v1:session:{sid}   hash  verifier_id, resident_tokens (context + generated tokens whose
                                    KV the verifier holds), last_used (unix seconds). TTL
                                    session_ttl_s, renewed by every publish (pinning while active);
                                    deleted on eviction.
    tandem:v1:prefix:{hash}   set   ids of the verifiers holding the KV of the token block that
                                    `hash` names. TTL session_ttl_s, renewed by every publish; a
                                    verifier is removed (SREM) when its last session holding the
                                    block is evicted.

Prefix hashes chain fixed-size blocks of token ids, so one hash names a whole prefix, not just a
block (only full blocks count; a trailing partial block is never published):

    h_0 = sha256(b"tandem")
    h_i = sha256(h_{i-1} || block_i as little-endian int32)      hex digest in the key

Worked example, block size 4: contexts [5 6 7 8 | 9 9 9 9 | 1] and [5 6 7 8 | 9 9 9 0] share h_1
and differ from h_2 on. A gateway routing the second context finds the first one's verifier under
h_1 and learns it already holds 4 tokens of the prompt.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TypeVar
from urllib.parse import urlsplit

import redis
from pydantic import BaseModel, ConfigDict, Field, model_validator
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger("tandem.serving.residency")

KEY_PREFIX = "tandem:v1:"
VERIFIER_INDEX_KEY = KEY_PREFIX + "verifiers"
_HASH_SEED = hashlib.sha256(b"tandem").digest()
_STALE_INDEX_S = 300.0  # heartbeats prune index members silent for this long (their hashes expired long ago)

T = TypeVar("T")

# Per-role Redis ACL users: exactly the commands each side sends, on the residency keys only. A
# gateway only reads (ResidencyIndex): a gateway's stolen credentials cannot forge a registration
# or a session's residency to steer traffic. A verifier publishes (ResidencyPublisher). A drafter
# has no Redis access at all. The Helm chart's Valkey and `tandem up`'s embedded one create these
# users (tests/deploy checks the chart against this table, tests/serving/test_redis_auth.py the
# rules against a real Valkey). CLIENT SETINFO: redis-py names itself on connect.
ACL_COMMANDS = {
    "gateway": ("hget", "hmget", "hgetall", "zrange", "smembers"),
    "verifier": ("hget", "hmget", "hgetall", "zrange", "smembers", "hset", "pexpire", "zadd", "zrem",
                 "zremrangebyscore", "sadd", "srem", "del", "scan"),
}
ACL_USERS = {"gateway": "tandem-gateway", "verifier": "tandem-verifier"}


def acl_rules(role: str) -> list[str]:
    """The ACL rules (after the user name, `on` and the password) of `role`'s Redis user."""
    return ["resetchannels", "resetkeys", f"~{KEY_PREFIX}*", "-@all", "+ping", "+client|setinfo",
            *(f"+{c}" for c in ACL_COMMANDS[role])]


def verifier_key(verifier_id: str) -> str:
    return f"{KEY_PREFIX}verifier:{verifier_id}"


def session_key(session_id: str) -> str:
    return f"{KEY_PREFIX}session:{session_id}"


def prefix_key(block_hash: str) -> str:
    return f"{KEY_PREFIX}prefix:{block_hash}"


def prefix_hashes(token_ids: Sequence[int], block_size: int = 32, salt: str = "") -> list[str]:
    """Chained hashes of the full blocks of `token_ids`: element i names the prefix of
    (i + 1) * block_size tokens. Equal prefixes give equal hashes; the first differing block and
    every block after it give different ones. `salt` (the tenant: SessionGenerateRequest.cache_salt)
    starts the chain, so equal prompts of different tenants share no hash and no routing hint."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    digest = hashlib.sha256(_HASH_SEED + salt.encode()).digest() if salt else _HASH_SEED
    out: list[str] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}i", *token_ids[start : start + block_size])
        digest = hashlib.sha256(digest + block).digest()
        out.append(digest.hex())
    return out


class ResidencyConfig(BaseModel):
    """Where Redis is and how residency keys live. Publishers and readers must agree on block_size."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)  # inputs hold the URL

    # redis://[user:password@]host:port/db, rediss://... (TLS), unix:///path.sock. The password
    # (an ACL user's or requirepass's) makes this a secret: kept out of reprs; log redact_url(url).
    url: str = Field(repr=False)
    # TLS of a rediss:// URL; the server's certificate and host name are always verified.
    ca_file: str | None = None  # CA bundle (PEM) that signed the server's certificate (default: the system's)
    cert_file: str | None = None  # client certificate (PEM), for a server that requires one
    key_file: str | None = None  # its private key, when cert_file does not hold it
    block_size: int = Field(32, ge=1, le=4096)  # tokens per prefix block
    heartbeat_ttl_s: float = Field(10.0, gt=0)  # a verifier silent this long is dead
    session_ttl_s: float = Field(600.0, gt=0)  # idle sessions' residency (and KV) lifetime
    socket_timeout_s: float = Field(0.2, gt=0)  # connect and read timeout of every Redis call
    retry_after_s: float = Field(1.0, ge=0)  # during an outage, skip Redis this long after a failure

    @model_validator(mode="after")
    def _tls_needs_rediss(self) -> "ResidencyConfig":
        # Over plain redis:// these files would be ignored (or fail at the first call): say so now.
        tls = [name for name in ("ca_file", "cert_file", "key_file") if getattr(self, name)]
        if tls and urlsplit(self.url).scheme.lower() != "rediss":
            raise ValueError(f"TLS options ({', '.join(tls)}) need a rediss:// URL, not {redact_url(self.url)}")
        if self.key_file and not self.cert_file:
            raise ValueError("key_file needs cert_file, the certificate it is the key of")
        return self


@dataclass(frozen=True)
class VerifierRecord:
    """A live verifier as routing sees it (the Redis hash, or the gateway's own GetInfo poll)."""

    verifier_id: str
    address: str  # host:port of its gRPC Verifier service
    model_id: str
    max_context_tokens: int = 0  # 0 = unknown
    kv_capacity_tokens: int = 0
    kv_used_tokens: int = 0
    active_sessions: int = 0
    updated_at: float = 0.0  # unix seconds of the information
    draining: bool = False  # shutting down: routes no new request here (running ones finish)
    precision: str = ""  # what its target computes in (VerifierInfo.precision); "" = not said

    @classmethod
    def coerce(cls, info: "VerifierRecord | Mapping") -> "VerifierRecord":
        """A record from itself or from a mapping with its field names (extra keys ignored)."""
        if isinstance(info, VerifierRecord):
            return info
        names = [f.name for f in fields(cls)]
        return cls(**{k: info[k] for k in names if k in info})

    def to_hash(self) -> dict[str, str]:
        return {
            "address": self.address,
            "model_id": self.model_id,
            "max_context_tokens": str(self.max_context_tokens),
            "kv_capacity_tokens": str(self.kv_capacity_tokens),
            "kv_used_tokens": str(self.kv_used_tokens),
            "active_sessions": str(self.active_sessions),
            "updated_at": repr(self.updated_at or time.time()),
            "draining": "1" if self.draining else "0",
            "precision": self.precision,
        }

    @classmethod
    def from_hash(cls, verifier_id: str, h: Mapping[str, str]) -> "VerifierRecord":
        return cls(
            verifier_id=verifier_id,
            address=h.get("address", ""),
            model_id=h.get("model_id", ""),
            max_context_tokens=int(h.get("max_context_tokens", 0) or 0),
            kv_capacity_tokens=int(h.get("kv_capacity_tokens", 0) or 0),
            kv_used_tokens=int(h.get("kv_used_tokens", 0) or 0),
            active_sessions=int(h.get("active_sessions", 0) or 0),
            updated_at=float(h.get("updated_at", 0) or 0),
            draining=h.get("draining", "0") == "1",
            precision=h.get("precision", ""),
        )


@dataclass(frozen=True)
class ResidencyView:
    """What Redis says about one request, read in one go (tandem.serving.routing decides with it)."""

    registered: list[VerifierRecord]  # live registered verifiers
    session_owner: str | None  # verifier id the session key names (None: no key)
    session_resident: int  # tokens of the session's KV resident there
    prefix_held: dict[str, int]  # verifier id -> tokens of the context's prefix whose KV it holds


class _RedisHealth:
    """Counts Redis errors, logs once per outage (its start and its end), and tells callers to skip
    Redis for `retry_after_s` after each failure while the outage lasts."""

    def __init__(self, role: str, url: str, retry_after_s: float):
        self._role, self._url, self._retry_after_s = role, url, retry_after_s
        self._lock = threading.Lock()
        self.errors = 0  # Redis errors since start (skipped calls not included)
        self.skipped = 0  # calls not attempted because an outage was in progress
        self._down_since: float | None = None
        self._next_try = 0.0

    @property
    def ok(self) -> bool:
        return self._down_since is None

    def call(self, fn: Callable[[], T], default: T) -> tuple[T, bool]:
        """Run fn against Redis; on failure (or while skipping) return (default, False)."""
        if self._down_since is not None and time.monotonic() < self._next_try:
            with self._lock:
                self.skipped += 1
            return default, False
        try:
            result = fn()
        except redis.RedisError as exc:
            now = time.monotonic()
            with self._lock:
                self.errors += 1
                self._next_try = now + self._retry_after_s
                first = self._down_since is None
                if first:
                    self._down_since = now
            if first:
                log.warning("%s: Redis at %s unavailable (%s); carrying on without residency", self._role, self._url, exc)
            return default, False
        if self._down_since is not None:
            with self._lock:
                down_for, self._down_since = time.monotonic() - self._down_since, None
            log.warning("%s: Redis at %s reachable again after %.1f s", self._role, self._url, down_for)
        return result, True


def _config(config: ResidencyConfig | str, overrides: dict) -> ResidencyConfig:
    if isinstance(config, str):
        return ResidencyConfig(url=config, **overrides)
    return config.model_copy(update=overrides) if overrides else config


def redact_url(url: str) -> str:
    """`url` fit for logs: its password (in the user info or a `password=` query argument) becomes
    ***. Example: redact_url("redis://tandem:s3cret@cache:6379/0") == "redis://tandem:***@cache:6379/0"."""
    if "://" not in url:  # not a URL redis-py accepts: nothing in it is safe to show
        return "***"
    try:
        parts = urlsplit(url)
    except ValueError:  # e.g. an unbalanced IPv6 bracket: show nothing after the scheme
        return url.partition("://")[0] + "://***"
    netloc = parts.netloc
    if parts.password is not None:
        userinfo, _, hostport = netloc.rpartition("@")
        netloc = f"{userinfo.partition(':')[0]}:***@{hostport}"
    query = "&".join(
        f"{key}=***" if key.lower() == "password" else arg
        for arg in parts.query.split("&") if arg
        for key in [arg.partition("=")[0]]
    )
    return (f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
            + (f"#{parts.fragment}" if parts.fragment else ""))


def _connect(config: ResidencyConfig) -> redis.Redis:
    # Credentials come with the URL (redis-py sends AUTH [user] password on every new connection);
    # rediss:// verifies the server by redis-py's defaults (certificate required, host name checked).
    # One retry covers a pooled connection that went stale when Redis restarted; no backoff, since
    # a caller on a request path must not wait.
    tls = {arg: path for arg, path in (("ssl_ca_certs", config.ca_file), ("ssl_certfile", config.cert_file),
                                       ("ssl_keyfile", config.key_file)) if path}
    return redis.Redis.from_url(
        config.url,
        socket_timeout=config.socket_timeout_s,
        socket_connect_timeout=config.socket_timeout_s,
        retry=Retry(NoBackoff(), 1),
        decode_responses=True,
        **tls,
    )


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class _RedisClient:
    """What both sides share: the typed config, one Redis client, and the outage bookkeeping."""

    ROLE = "residency"

    def __init__(self, config: ResidencyConfig | str, client: redis.Redis | None = None, **overrides):
        """`config`: a ResidencyConfig, or a Redis URL with ResidencyConfig fields as keywords."""
        self.config = config = _config(config, overrides)
        self._redis = client or _connect(config)
        self._health = _RedisHealth(self.ROLE, redact_url(config.url), config.retry_after_s)

    @property
    def redis_ok(self) -> bool:
        return self._health.ok

    @property
    def errors(self) -> int:
        return self._health.errors


class ResidencyPublisher(_RedisClient):
    """Verifier side: registration, heartbeat and the residency of its sessions' KV.

    It remembers locally which prefix blocks each session holds, so that evicting one session
    removes the verifier from a block's set only when no other session of it still holds the block
    (sessions sharing a system prompt share its blocks). Thread-safe. Never raises on Redis errors.
    """

    ROLE = "residency publisher"

    def __init__(self, config: ResidencyConfig | str, client: redis.Redis | None = None, **overrides):
        super().__init__(config, client, **overrides)
        self._lock = threading.Lock()
        self._verifier_id: str | None = None
        self._sessions: dict[str, tuple[str, list[str]]] = {}  # sid -> (verifier id, block hashes)
        self._block_refs: Counter[tuple[str, str]] = Counter()  # (verifier id, hash) -> sessions holding it
        self._resident: dict[str, int] = {}  # sid -> resident tokens (what publish_session wrote)
        self.republished = 0  # times Redis had lost our keys (restarted empty) and got them again

    def register(self, info: VerifierRecord | Mapping) -> bool:
        """Announce a verifier (idempotent; the same write as a heartbeat). True if Redis took it.
        `info`: a VerifierRecord or a mapping with its field names (e.g. a verifier's info dict)."""
        info = VerifierRecord.coerce(info)
        self._verifier_id = info.verifier_id
        ok = self.heartbeat(info)
        if ok:
            log.info("registered verifier %s (%s, %s) in Redis", info.verifier_id, info.address, info.model_id)
        return ok

    def forget_stale(self, verifier_id: str) -> int:
        """A verifier (re)starting holds no KV: remove every session key naming `verifier_id` and
        `verifier_id` from every prefix set, which an earlier process of the same id (killed, so
        it never deregistered) left behind. One SCAN over the residency keys, at start only.
        Returns the keys changed (0 when Redis does not answer)."""

        def clean() -> int:
            sessions = list(self._redis.scan_iter(match=f"{KEY_PREFIX}session:*", count=1000))
            prefixes = list(self._redis.scan_iter(match=f"{KEY_PREFIX}prefix:*", count=1000))
            pipe = self._redis.pipeline(transaction=False)
            for key in sessions:
                pipe.hget(key, "verifier_id")
            owners = pipe.execute() if sessions else []
            pipe = self._redis.pipeline(transaction=False)
            for key, owner in zip(sessions, owners):
                if owner == verifier_id:
                    pipe.delete(key)
            for key in prefixes:
                pipe.srem(key, verifier_id)
            return sum(pipe.execute())

        changed, _ = self._health.call(clean, 0)
        if changed:
            log.info("removed %d stale residency entries of an earlier %s", changed, verifier_id)
        return changed

    def heartbeat(self, info: VerifierRecord | Mapping) -> bool:
        """Refresh the verifier's record and TTL with its current load. True if Redis took it."""
        info = VerifierRecord.coerce(info)
        now = time.time()
        ttl = _ms(self.config.heartbeat_ttl_s)

        fields = info.to_hash()

        def write() -> int:
            pipe = self._redis.pipeline(transaction=False)
            key = verifier_key(info.verifier_id)
            pipe.hset(key, mapping=fields)
            pipe.pexpire(key, ttl)
            pipe.zadd(VERIFIER_INDEX_KEY, {info.verifier_id: now})
            pipe.zremrangebyscore(VERIFIER_INDEX_KEY, "-inf", now - _STALE_INDEX_S)
            pipe.pexpire(VERIFIER_INDEX_KEY, ttl)
            return pipe.execute()[0]  # fields HSET created: all of them when the key was missing

        created, ok = self._health.call(write, 0)
        if ok and created == len(fields):
            with self._lock:
                known = bool(self._sessions)
            if known:
                # Our record was gone (Redis restarted empty, or it expired while Redis was away):
                # the residency of our sessions is gone with it. Publish it again.
                self._republish()
        return ok

    def _republish(self) -> None:
        with self._lock:
            sessions = {sid: (vid, hashes, self._resident.get(sid, 0)) for sid, (vid, hashes) in self._sessions.items()}
        ttl = _ms(self.config.session_ttl_s)

        def write() -> None:
            pipe = self._redis.pipeline(transaction=False)
            for sid, (vid, hashes, tokens) in sessions.items():
                key = session_key(sid)
                pipe.hset(key, mapping={"verifier_id": vid, "resident_tokens": str(tokens), "last_used": repr(time.time())})
                pipe.pexpire(key, ttl)
                for h in hashes:
                    pipe.sadd(prefix_key(h), vid)
                    pipe.pexpire(prefix_key(h), ttl)
            pipe.execute()

        if self._health.call(write, None)[1]:
            self.republished += 1
            log.warning("%s: Redis had lost this verifier's keys; published %d sessions' residency again",
                        self._health._role, len(sessions))

    def publish_session(self, session_id: str, verifier_id: str, token_ids: Sequence[int], salt: str = "") -> bool:
        """Record that `verifier_id` holds the KV of `token_ids` (the session's whole history) and
        renew the session's and its blocks' TTLs. Blocks the session no longer holds (its history
        diverged) are released. `salt`: the session's cache salt (see prefix_hashes)."""
        hashes = prefix_hashes(token_ids, self.config.block_size, salt)
        with self._lock:
            released = self._track(session_id, verifier_id, hashes)
            self._resident[session_id] = len(token_ids)
        ttl = _ms(self.config.session_ttl_s)

        def write() -> None:
            pipe = self._redis.pipeline(transaction=False)
            key = session_key(session_id)
            pipe.hset(
                key,
                mapping={"verifier_id": verifier_id, "resident_tokens": str(len(token_ids)), "last_used": repr(time.time())},
            )
            pipe.pexpire(key, ttl)
            for h in hashes:
                pipe.sadd(prefix_key(h), verifier_id)
                pipe.pexpire(prefix_key(h), ttl)
            for vid, h in released:
                pipe.srem(prefix_key(h), vid)
            pipe.execute()

        return self._health.call(write, None)[1]

    def evict_session(self, session_id: str, token_ids: Sequence[int] | None = None, salt: str = "") -> bool:
        """The verifier dropped the session's KV: delete its key and release its blocks.
        `token_ids` is needed only for a session this publisher did not publish itself."""
        with self._lock:
            tracked = self._sessions.get(session_id)
            if tracked is None and token_ids is not None and self._verifier_id is not None:
                # Not ours to refcount: release the blocks outright.
                released = [(self._verifier_id, h) for h in prefix_hashes(token_ids, self.config.block_size, salt)]
            else:
                released = self._track(session_id, None, [])
            self._resident.pop(session_id, None)

        def write() -> None:
            pipe = self._redis.pipeline(transaction=False)
            pipe.delete(session_key(session_id))
            for vid, h in released:
                pipe.srem(prefix_key(h), vid)
            pipe.execute()

        return self._health.call(write, None)[1]

    def deregister(self, verifier_id: str | None = None) -> bool:
        """Graceful shutdown: remove the verifier (default: the last registered) and everything
        this publisher published."""
        with self._lock:
            sessions = list(self._sessions)
            blocks = list(self._block_refs)
            self._sessions.clear()
            self._block_refs.clear()
            self._resident.clear()
        verifier_id = verifier_id or self._verifier_id

        def write() -> None:
            pipe = self._redis.pipeline(transaction=False)
            if verifier_id is not None:
                pipe.delete(verifier_key(verifier_id))
                pipe.zrem(VERIFIER_INDEX_KEY, verifier_id)
            for sid in sessions:
                pipe.delete(session_key(sid))
            for vid, h in blocks:
                pipe.srem(prefix_key(h), vid)
            pipe.execute()

        return self._health.call(write, None)[1]

    def close(self) -> None:
        self._redis.close()

    def _track(self, session_id: str, verifier_id: str | None, hashes: list[str]) -> list[tuple[str, str]]:
        """Replace the session's blocks by `hashes` (none: forget it); return the blocks whose last
        holder this was. Caller holds the lock."""
        old_vid, old = self._sessions.pop(session_id, (None, []))
        if verifier_id is not None:
            self._sessions[session_id] = (verifier_id, hashes)
            for h in hashes:
                self._block_refs[(verifier_id, h)] += 1
        released = []
        for h in old:
            ref = (old_vid, h)
            self._block_refs[ref] -= 1
            if self._block_refs[ref] <= 0:
                del self._block_refs[ref]
                released.append(ref)
        return released


class ResidencyIndex(_RedisClient):
    """Gateway side: reads residency for the routing policy (tandem.serving.routing). Never raises on
    Redis errors: it answers "unknown" (empty results, or no view), with `redis_ok` False until Redis
    answers again."""

    ROLE = "residency index"

    def verifiers(self) -> list[VerifierRecord]:
        """Live registered verifiers (empty when Redis is unreachable)."""
        return self._health.call(self._verifiers, [])[0]

    def session_verifier(self, session_id: str) -> str | None:
        return self._health.call(lambda: self._redis.hget(session_key(session_id), "verifier_id"), None)[0]

    def longest_prefix(self, token_ids: Sequence[int], salt: str = "") -> dict[str, int]:
        """verifier id -> tokens of `token_ids` whose KV it holds (full blocks of the prefix)."""
        return self._health.call(lambda: self._longest_prefix(token_ids, salt), {})[0]

    def view(self, session_id: str | None, token_ids: Sequence[int], salt: str = "") -> ResidencyView | None:
        """Everything routing reads for one request; None when Redis does not answer. `salt`: the
        request's cache salt (its tenant): only that tenant's prefixes can match."""

        def read() -> ResidencyView:
            owner, resident = (None, None)
            if session_id:
                owner, resident = self._redis.hmget(session_key(session_id), ["verifier_id", "resident_tokens"])
            return ResidencyView(self._verifiers(), owner, int(resident or 0), self._longest_prefix(token_ids, salt))

        view, ok = self._health.call(read, None)
        return view if ok else None

    def close(self) -> None:
        self._redis.close()

    def _verifiers(self) -> list[VerifierRecord]:
        ids = self._redis.zrange(VERIFIER_INDEX_KEY, 0, -1)
        if not ids:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for vid in ids:
            pipe.hgetall(verifier_key(vid))
        return [VerifierRecord.from_hash(vid, h) for vid, h in zip(ids, pipe.execute()) if h]

    def _longest_prefix(self, token_ids: Sequence[int], salt: str = "") -> dict[str, int]:
        hashes = prefix_hashes(token_ids, self.config.block_size, salt)
        if not hashes:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        for h in hashes:
            pipe.smembers(prefix_key(h))
        held: dict[str, int] = {}
        holders: set[str] | None = None
        # A verifier holds the prefix up to block i only if it holds every block before it: walk
        # the chain, keeping those still present, and stop when none is left.
        for i, members in enumerate(pipe.execute()):
            holders = set(members) if holders is None else holders & set(members)
            if not holders:
                break
            for vid in holders:
                held[vid] = (i + 1) * self.config.block_size
        return held
