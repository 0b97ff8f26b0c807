"""Transport security of every Tandem hop: mutual TLS between the services, HTTPS at the gateway.

Trust model. One CA signs every service's certificate. Each service presents its own certificate
and checks its peer's against that CA, in both directions (mutual TLS). Every certificate carries
the DNS name `tandem-<role>` (gateway, verifier, drafter, client), and a caller states the role it
expects with `channel_options(VERIFIER_NAME)`: TLS then checks that name instead of the dialled
address, so

- the gateway can dial a verifier's pod IP, which no certificate has to list, and
- a drafter's certificate, although signed by the same CA, cannot answer for a verifier.

A server checks that its client's certificate comes from the CA and, for every RPC of a Tandem
service, that it names a role allowed to call it (`RoleCheck`, the matrix in docs/security.md): a
verifier answers only gateways, a drafter drafts only for verifiers, whatever else the CA signed.

Certificates come from PEM files (`TlsConfig`) and are re-read when they change, so cert-manager or
a cron job can rotate them under a running server (`server_credentials`). `write_dev_certs` (the
`tandem certs DIR` command) makes a development CA and one certificate per role; production brings
its own CA.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import re
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from tandem.serving.logs import warn_if_exposed
from tandem.serving.tlsconfig import TlsConfig  # noqa: F401 (re-exported: the settings hold it)

log = logging.getLogger("tandem.tls")

GATEWAY_NAME = "tandem-gateway"
VERIFIER_NAME = "tandem-verifier"
DRAFTER_NAME = "tandem-drafter"
DEV_ROLES = ("gateway", "verifier", "drafter", "client")


@dataclass(frozen=True)
class _Identity:
    """The files' bytes, checked: a certificate, its own private key, a parseable CA bundle."""

    chain: bytes
    key: bytes
    ca: bytes | None


def _spki(public_key) -> bytes:
    return public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _read_identity(tls: TlsConfig) -> _Identity:
    """Read and check the files, so a wrong file fails here with its name rather than later as an
    anonymous handshake error (gRPC reports a key that does not match its certificate only as
    failed connections)."""
    warn_if_exposed(tls.key, "TLS private key")
    chain, key = tls.cert.read_bytes(), tls.key.read_bytes()
    ca = tls.ca.read_bytes() if tls.ca is not None else None
    try:
        leaf = x509.load_pem_x509_certificates(chain)[0]
    except ValueError as exc:
        raise ValueError(f"TLS cert file {tls.cert} holds no PEM certificate ({exc})") from None
    try:
        private = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as exc:  # TypeError: the key is encrypted
        raise ValueError(f"TLS key file {tls.key} is not an unencrypted PEM private key ({exc})") from None
    if _spki(leaf.public_key()) != _spki(private.public_key()):
        raise ValueError(f"TLS key file {tls.key} is not the private key of the certificate in {tls.cert}")
    if leaf.not_valid_after_utc < datetime.datetime.now(datetime.timezone.utc):
        raise ValueError(f"the certificate in {tls.cert} expired on {leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")
    if ca is not None:
        try:
            x509.load_pem_x509_certificates(ca)
        except ValueError as exc:
            raise ValueError(f"TLS ca file {tls.ca} holds no PEM certificate ({exc})") from None
    return _Identity(chain=chain, key=key, ca=ca)


class _CertificateReloader:
    """gRPC's certificate-configuration fetcher over `tls`'s files (see `server_credentials`)."""

    def __init__(self, tls: TlsConfig) -> None:
        self._tls = tls
        self._paths = [p for p in (tls.cert, tls.key, tls.ca) if p is not None]
        self._lock = threading.Lock()  # handshakes of concurrent connections call `fetch` concurrently
        # The stamp is taken before the read: files replaced in between only cause one more reload.
        self._stamp = self._stamp_now()
        self._failed: tuple | None = None  # stamp of files that did not load: warn once, not per connection
        self.initial = self._configuration(_read_identity(tls))

    def _stamp_now(self) -> tuple:
        # mtime alone can miss a replacement within the clock's resolution; an atomic rename (what
        # Kubernetes does to a mounted Secret) changes the inode, a rewrite usually the size.
        return tuple((st.st_mtime_ns, st.st_size, st.st_ino) for st in map(os.stat, self._paths))

    @staticmethod
    def _configuration(identity: _Identity):
        return grpc.ssl_server_certificate_configuration([(identity.key, identity.chain)], identity.ca)

    def fetch(self):
        """A new configuration when the files changed and load, else None (gRPC keeps the current one)."""
        with self._lock:
            try:
                stamp = self._stamp_now()
            except OSError:  # a file is being replaced right now: keep serving, look again next time
                return None
            if stamp in (self._stamp, self._failed):
                return None
            try:
                identity = _read_identity(self._tls)
            except (OSError, ValueError) as exc:
                # Typically a rotation caught halfway (new certificate, old key): not taken until whole.
                self._failed = stamp
                log.warning("keeping the current TLS certificate: the changed files do not load: %s", exc)
                return None
            self._stamp, self._failed = stamp, None
            log.info("reloaded the TLS certificate from %s", self._tls.cert)
            return self._configuration(identity)


def server_credentials(tls: TlsConfig, *, require_client_cert: bool) -> grpc.ServerCredentials:
    """Credentials of a gRPC server presenting `tls.cert`, accepting only clients whose certificate
    chains to `tls.ca` when `require_client_cert` (mutual TLS; `tls.ca` is then required).

    Rotation without restart: gRPC asks for the certificate configuration before every new
    connection's handshake, and the answer comes from the files, re-read whenever one of them has
    a new modification time (or size, or inode: an atomic rename counts). Replace the certificate,
    key and CA files and new connections use them; open connections keep the certificate they were
    made with until they close. Files that do not load together (a certificate written before its
    key) are not taken: the previous configuration serves until the set is whole again.

    Raises ValueError (naming the file) when the files do not load now.
    """
    if require_client_cert and tls.ca is None:
        raise ValueError("requiring client certificates needs a CA to check them against: set the TLS ca file (--tls-ca)")
    reloader = _CertificateReloader(tls)
    return grpc.dynamic_ssl_server_credentials(
        reloader.initial, reloader.fetch, require_client_authentication=require_client_cert
    )


def channel_credentials(tls: TlsConfig | None, *, ca_only: bool = False) -> grpc.ChannelCredentials:
    """Credentials of a gRPC client: present `tls.cert` (unless `ca_only`) and accept only a server
    whose certificate chains to `tls.ca` (to the system's roots when there is no CA or no `tls`).

    The files are read now: a channel made after a rotation uses the new ones. Pair it with
    `channel_options(role name)` so that the server's role, not its address, is what is checked.
    """
    if tls is None:
        return grpc.ssl_channel_credentials()
    if ca_only:
        return grpc.ssl_channel_credentials(root_certificates=tls.ca.read_bytes() if tls.ca else None)
    identity = _read_identity(tls)
    return grpc.ssl_channel_credentials(
        root_certificates=identity.ca, private_key=identity.key, certificate_chain=identity.chain
    )


def channel_options(server_name: str | None) -> list[tuple[str, str]]:
    """Channel options making TLS check the server's certificate for `server_name` (e.g.
    VERIFIER_NAME) instead of the dialled host: the peer must hold that role's certificate, and
    its address (a pod IP) need not be in it."""
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []


def http_ssl_kwargs(tls: TlsConfig | None, *, client_cert: bool = False) -> dict:
    """uvicorn's keyword arguments for the gateway's public HTTPS ({} = plain HTTP). With
    `client_cert`, clients may present a certificate, checked against `tls.ca` when they do (an
    OpenAI client usually presents none)."""
    if tls is None:
        return {}
    kwargs: dict = {"ssl_certfile": str(tls.cert), "ssl_keyfile": str(tls.key)}
    if tls.ca is not None:
        kwargs["ssl_ca_certs"] = str(tls.ca)
    if client_cert:
        if tls.ca is None:
            raise ValueError("checking HTTPS client certificates needs a CA: set the TLS ca file (--tls-ca)")
        kwargs["ssl_cert_reqs"] = ssl.CERT_OPTIONAL
    return kwargs


# -- development certificates ----------------------------------------------------------------------

_ROLE = re.compile(r"[a-z][a-z0-9-]*")


def _write_private(path: Path, data: bytes) -> None:
    """Write a private key readable by its owner only. The mode is set at creation (O_EXCL on a
    fresh inode): a chmod afterwards would leave a moment in which the key is world-readable."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def write_dev_certs(
    directory: Path,
    *,
    hosts: Sequence[str] = (),
    days: int = 365,
    roles: Sequence[str] = DEV_ROLES,
    overwrite: bool = False,
) -> dict[str, TlsConfig]:
    """Write a development CA and one certificate per role into `directory`; the TlsConfig of each role.

    Files: ca.pem / ca-key.pem (the CA; its key signs, no service needs it) and per role
    <role>.pem / <role>-key.pem. Keys are EC P-256, private key files mode 0600. Each role's
    certificate is valid for both ends of a connection (serverAuth and clientAuth) and for the
    names DNS tandem-<role>, localhost, 127.0.0.1, ::1 and every entry of `hosts` (an IP address
    when it parses as one, else a DNS name), for `days` days.

    Refuses (FileExistsError) to replace an existing CA key unless `overwrite`: a new CA makes
    every certificate the old one signed untrusted.
    """
    if days < 1:
        raise ValueError(f"days must be at least 1, not {days}")
    for role in roles:
        if not _ROLE.fullmatch(role) or role == "ca":
            raise ValueError(f"role {role!r} must be a lower-case DNS label other than 'ca'")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ca_key_path = directory / "ca-key.pem"
    if ca_key_path.exists() and not overwrite:
        raise FileExistsError(f"{ca_key_path} exists: refusing to replace the CA (every certificate it signed "
                              "would stop being trusted); pass --overwrite (overwrite=True) to replace it")

    sans: list[x509.GeneralName] = []
    for host in ("localhost", "127.0.0.1", "::1", *hosts):
        try:
            name: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            name = x509.DNSName(host)
        if name not in sans:
            sans.append(name)

    # Backdated a little: a peer whose clock runs behind would otherwise reject a fresh certificate.
    now = datetime.datetime.now(datetime.timezone.utc)
    not_before, not_after = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Tandem development CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_private(ca_key_path, _pem_key(ca_key))
    ca_path = directory / "ca.pem"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))

    configs: dict[str, TlsConfig] = {}
    for role in roles:
        key = ec.generate_private_key(ec.SECP256R1())
        role_name = f"tandem-{role}"
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, role_name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(role_name), *sans]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                              data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
                              encipher_only=False, decipher_only=False),
                critical=True,
            )
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        key_path, cert_path = directory / f"{role}-key.pem", directory / f"{role}.pem"
        _write_private(key_path, _pem_key(key))
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        configs[role] = TlsConfig(cert=cert_path, key=key_path, ca=ca_path)
    return configs


def peer_roles(context: grpc.ServicerContext) -> set[str]:
    """The roles the caller's verified certificate names: each DNS name `tandem-<role>` among its
    subject alternative names (empty without mutual TLS)."""
    names = context.auth_context().get("x509_subject_alternative_name", [])
    roles = set()
    for name in names:
        text = name.decode("ascii", "replace") if isinstance(name, bytes) else str(name)
        if text.startswith("tandem-"):
            roles.add(text[len("tandem-"):])
    return roles


class RoleCheck(grpc.ServerInterceptor):
    """PERMISSION_DENIED, before any handler runs, for a caller whose certificate names no role that
    `allowed` lists for the method ("/tandem.v1.Verifier/Generate" -> ("gateway",)). Every method of
    `services` (full names, "tandem.v1.Verifier") must be listed: one not listed is denied to all.
    Health checks and reflection stay open to any certificate of the CA (they reveal no data)."""

    def __init__(self, allowed: dict[str, tuple[str, ...]], services: Sequence[str]):
        self.allowed = allowed
        self.prefixes = tuple(f"/{name}/" for name in services)

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or not details.method.startswith(self.prefixes):
            return handler
        return _guarded(handler, details.method, self.allowed.get(details.method, ()))


def _guarded(handler: grpc.RpcMethodHandler, method: str, roles: tuple[str, ...]) -> grpc.RpcMethodHandler:
    """`handler` with the role check in front of its behaviour, whatever its streaming kind."""

    def check(context: grpc.ServicerContext) -> None:
        held = peer_roles(context)
        if not held & set(roles):
            log.warning("refused %s to a certificate of role(s) %s (allowed: %s)", method,
                        ", ".join(sorted(held)) or "none", ", ".join(roles) or "none")
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"{method} is served to {' or '.join(roles) or 'no'} certificates only")

    def wrap(behaviour):
        def guarded(request, context):
            check(context)
            return behaviour(request, context)
        return guarded

    kinds = {
        "unary_unary": grpc.unary_unary_rpc_method_handler,
        "unary_stream": grpc.unary_stream_rpc_method_handler,
        "stream_unary": grpc.stream_unary_rpc_method_handler,
        "stream_stream": grpc.stream_stream_rpc_method_handler,
    }
    for kind, make in kinds.items():
        behaviour = getattr(handler, kind)
        if behaviour is not None:
            return make(wrap(behaviour), request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
    return handler
