"""Who is calling: API keys, the tenants they belong to, and each tenant's limits.

The key file (a JSON document; in Kubernetes a Secret mounted as a file) maps tenants to keys:

    {"tenants": {
        "acme":   {"keys": ["sk-acme-1", "sha256:9f86d0..."],
                   "max_input_tokens": 8192, "max_output_tokens": 1024,
                   "max_concurrent_requests": 8, "tokens_per_minute": 200000},
        "robots": {"keys": ["sk-robots"]}}}

A key is either the secret itself or `sha256:` and the hex SHA-256 of it (so the file need not hold
the secret). Lookup hashes the presented key and compares it with every entry in constant time
(`hmac.compare_digest`, no early exit), so timing says nothing about how much of a guess was right.
Keys are never logged; a refused call is logged by tenant-less reason only.

A tenant owns its sessions (the gateway scopes session ids by tenant) and its caches (the tenant
name salts every prefix hash, so KV reuse and prefix routing never cross tenants). With no key file
the gateway runs open: every caller is the one anonymous tenant "", which salts nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tandem.services.gateway.errors import InvalidRequest, Overloaded
from tandem.serving.logs import warn_if_exposed

log = logging.getLogger("tandem.gateway.auth")

TENANT_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # no "/": it separates tenant and session in ids


class TenantSpec(BaseModel):
    """One tenant as the key file describes it. A limit left out (None) is the gateway's own."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    keys: tuple[str, ...] = Field(min_length=1)
    max_input_tokens: int | None = Field(None, ge=1)  # prompt (whole session history) per request
    max_output_tokens: int | None = Field(None, ge=1)  # max_tokens per request
    max_concurrent_requests: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)  # prompt + completion tokens, token bucket

    @field_validator("keys")
    @classmethod
    def _keys(cls, keys: tuple[str, ...]) -> tuple[str, ...]:
        for key in keys:
            if key.startswith("sha256:"):
                digest = key.removeprefix("sha256:")
                if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest.lower()):
                    raise ValueError("a sha256: key must be followed by 64 hex digits")
            elif len(key) < 16:
                # Short keys are guessable; the message does not repeat the key.
                raise ValueError("an API key must be at least 16 characters")
        return keys


class KeyFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    tenants: dict[str, TenantSpec]

    @field_validator("tenants")
    @classmethod
    def _names(cls, tenants: dict[str, TenantSpec]) -> dict[str, TenantSpec]:
        import re

        for name in tenants:
            if not re.match(TENANT_NAME, name):
                raise ValueError(f"tenant name {name!r} must match {TENANT_NAME}")
        return tenants


@dataclass(frozen=True)
class Tenant:
    name: str  # "" = the anonymous caller of an open gateway
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    max_concurrent_requests: int | None = None
    tokens_per_minute: int | None = None


OPEN = Tenant("")


class KeyFileError(ValueError):
    """The key file is missing or malformed (raised at startup, never per request)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Keyring:
    """API key -> tenant, read once from the key file at startup."""

    def __init__(self, spec: KeyFile):
        self._entries: list[tuple[bytes, Tenant]] = []
        seen: dict[bytes, str] = {}
        for name, t in spec.tenants.items():
            tenant = Tenant(name, t.max_input_tokens, t.max_output_tokens, t.max_concurrent_requests,
                            t.tokens_per_minute)
            for key in t.keys:
                d = bytes.fromhex(key[7:]) if key.startswith("sha256:") else _digest(key)
                if d in seen and seen[d] != name:
                    raise KeyFileError(f"one key is listed for both tenants {seen[d]!r} and {name!r}")
                seen[d] = name
                self._entries.append((d, tenant))
        if not self._entries:
            raise KeyFileError("the key file lists no keys")
        self.tenants = {t.name: t for _, t in self._entries}

    @classmethod
    def load(cls, path: str | Path) -> "Keyring":
        warn_if_exposed(path, "API key file")
        try:
            raw = Path(path).read_text()
        except OSError as exc:
            raise KeyFileError(f"cannot read the API key file {path}: {exc.strerror}") from None
        try:
            return cls(KeyFile.model_validate(json.loads(raw)))
        except ValueError as exc:  # JSON or validation; the messages never include a key's value
            detail = exc.errors(include_input=False) if isinstance(exc, ValidationError) else str(exc)
            raise KeyFileError(f"the API key file {path} is malformed: {detail}") from None

    def authenticate(self, key: str) -> Tenant | None:
        """The tenant of `key`, or None. Every entry is compared, whatever matches."""
        d = _digest(key)
        found = None
        for entry, tenant in self._entries:
            if hmac.compare_digest(entry, d):
                found = tenant
        return found


class KeyringFile:
    """The key file, re-read when it changes (checked at most every `check_s`), so keys rotate
    without a restart: add the new key, move clients over, remove the old one. A file that does not
    load keeps the previous keys in force (logged), rather than locking everyone out."""

    def __init__(self, path: str | Path, check_s: float = 1.0):
        self.path, self._check_s = Path(path), check_s
        self._stamp = self._stat()
        self.keyring = Keyring.load(self.path)  # a bad file at startup is fatal: raise
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    def _stat(self) -> tuple:
        try:
            st = self.path.stat()
        except OSError:
            return ()
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def current(self) -> Keyring:
        now = time.monotonic()
        if now - self._checked < self._check_s:
            return self.keyring
        with self._lock:
            self._checked = now
            stamp = self._stat()
            if stamp and stamp != self._stamp:
                self._stamp = stamp
                try:
                    self.keyring = Keyring.load(self.path)
                    log.info("reloaded the API key file %s: %d tenants", self.path, len(self.keyring.tenants))
                except KeyFileError as exc:
                    log.error("%s; the previous keys stay in force", exc)
        return self.keyring


def bearer_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` value (scheme case-insensitive), else None."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip()


@dataclass
class _Bucket:
    tokens: float
    stamp: float = field(default_factory=time.monotonic)


class TenantLimiter:
    """Per-tenant admission: concurrent requests and a token bucket of tokens per minute.

    The bucket holds up to one minute's allowance and refills continuously. A request is admitted
    while the bucket is positive and charged its prompt tokens at admission and its completion
    tokens as it ends, so a tenant may overdraw by one request; the next ones wait for the refill
    (429 with Retry-After saying how long)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}

    def _refill(self, tenant: Tenant) -> _Bucket:
        rate = tenant.tokens_per_minute / 60.0
        b = self._buckets.setdefault(tenant.name, _Bucket(float(tenant.tokens_per_minute)))
        now = time.monotonic()
        b.tokens = min(float(tenant.tokens_per_minute), b.tokens + (now - b.stamp) * rate)
        b.stamp = now
        return b

    def enter(self, tenant: Tenant) -> "Slot":
        """Take one of the tenant's request slots at intake, before its body is read or tokenized:
        a tenant over its concurrency, or with its token bucket empty, is refused here (429) at no
        cost, and one tenant never holds more of the tokenizer pool than its slots. The transport
        releases the slot when the response ends (`Slot.release`)."""
        with self._lock:
            self._take(tenant)
        return Slot(self, tenant)

    def _leave(self, tenant: Tenant) -> None:
        with self._lock:
            n = self._active.get(tenant.name, 0) - 1
            if n > 0:
                self._active[tenant.name] = n
            else:
                self._active.pop(tenant.name, None)

    def _take(self, tenant: Tenant) -> None:
        """Count the tenant's request in, or raise Overloaded when it has no request slot left or its
        bucket is empty (lock held)."""
        cap = tenant.max_concurrent_requests
        active = self._active.get(tenant.name, 0)
        if cap is not None and active >= cap:
            raise Overloaded(
                f"this API key's tenant has {active} requests in flight (its limit is {cap}); retry later",
                retry_after_s=1.0,
            )
        if tenant.tokens_per_minute is not None:
            b = self._refill(tenant)
            if b.tokens <= 0:
                wait = (1 - b.tokens) / (tenant.tokens_per_minute / 60.0)
                raise Overloaded(
                    f"this API key's tenant used its {tenant.tokens_per_minute} tokens per minute; "
                    f"retry in {math.ceil(wait)} s",
                    retry_after_s=wait,
                )
        self._active[tenant.name] = active + 1

    def admit(self, tenant: Tenant, prompt_tokens: int, max_new_tokens: int = 0, *, held: bool = False) -> None:
        """Count one request in, or raise Overloaded (429) with a retry hint. A request that could
        spend more than a whole minute's allowance on its own (prompt + max_new_tokens) is refused
        (InvalidRequest, 400): admitted, it would overdraw the bucket and lock the tenant out for
        minutes; no wait makes it fit."""
        need = prompt_tokens + max_new_tokens
        if tenant.tokens_per_minute is not None and need > tenant.tokens_per_minute:
            raise InvalidRequest(
                f"this request may use {need} tokens ({prompt_tokens} of prompt + max_tokens {max_new_tokens}), more "
                f"than this API key's tenant may use in a minute ({tenant.tokens_per_minute}): send a shorter "
                "prompt or a lower max_tokens")
        with self._lock:
            if not held:  # a request without an intake slot (the core called directly) takes one now
                self._take(tenant)
            if tenant.tokens_per_minute is not None:
                self._refill(tenant).tokens -= prompt_tokens

    def release(self, tenant: Tenant, completion_tokens: int, *, held: bool = False) -> None:
        """The request's end: charge its completion tokens; give back its slot unless a transport
        holds it (`held`: the Slot is released there)."""
        if not held:
            self._leave(tenant)
        if tenant.tokens_per_minute is not None:
            with self._lock:
                self._refill(tenant).tokens -= completion_tokens


class Slot:
    """One request's place among its tenant's concurrent requests (TenantLimiter.enter), from intake
    to the end of its response. Released once, however often `release` is called."""

    def __init__(self, limiter: TenantLimiter, tenant: Tenant):
        self._limiter, self._tenant, self._held = limiter, tenant, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._limiter._leave(self._tenant)

    def __del__(self):  # a path that forgot it must not lock the tenant out for good
        self.release()
