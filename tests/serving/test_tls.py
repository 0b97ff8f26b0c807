"""Mutual TLS (tandem/serving/tls.py) over real sockets and real handshakes: the standard gRPC
health service is the RPC, so no model is needed. Certificates come from `write_dev_certs`.

What must hold: a client with a certificate from the CA reaches the role it names; a client
without one, or with one from another CA, never reaches a handler; a server from another CA, or
holding another role's certificate, is refused by the client; replaced files are served on the
next connection without a restart; `tandem certs` writes what it says.
"""

from __future__ import annotations

import os
import ssl
import stat
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from typer.testing import CliRunner

from tandem.serving.tls import (
    DRAFTER_NAME,
    VERIFIER_NAME,
    TlsConfig,
    channel_credentials,
    channel_options,
    http_ssl_kwargs,
    server_credentials,
    write_dev_certs,
)
from tandem.tools.cli import app

ENV = {"COLUMNS": "200", "NO_COLOR": "1"}
# A fresh connection per channel: gRPC may otherwise share a subchannel (and its TLS session)
# between channels of the same process, and a rotation is only seen by a new connection.
LOCAL_POOL = [("grpc.use_local_subchannel_pool", 1)]


class CountingHealth(health.HealthServicer):
    """The health service, recording each call and the SANs of the client certificate it came with."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.client_names: list[bytes] = []

    def Check(self, request, context):
        self.calls += 1
        self.client_names = context.auth_context().get("x509_subject_alternative_name", [])
        return super().Check(request, context)


@pytest.fixture
def serve():
    """serve(tls, require_client_cert=True) -> (port, servicer): a TLS health server on 127.0.0.1."""
    servers = []

    def start(tls: TlsConfig, *, require_client_cert: bool = True) -> tuple[int, CountingHealth]:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)])
        servicer = CountingHealth()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_secure_port("127.0.0.1:0", server_credentials(tls, require_client_cert=require_client_cert))
        server.start()
        servers.append(server)
        return port, servicer

    yield start
    for server in servers:
        server.stop(None)


def check(port: int, creds: grpc.ChannelCredentials, server_name: str | None = VERIFIER_NAME):
    """One Health.Check on a new channel to 127.0.0.1:port."""
    with grpc.secure_channel(f"127.0.0.1:{port}", creds, options=channel_options(server_name) + LOCAL_POOL) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)


def refused(port: int, creds: grpc.ChannelCredentials, server_name: str | None = VERIFIER_NAME) -> None:
    with pytest.raises(grpc.RpcError) as err:
        check(port, creds, server_name)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value


@pytest.fixture
def pki(tmp_path):
    return write_dev_certs(tmp_path / "pki")


@pytest.fixture
def other_pki(tmp_path):
    return write_dev_certs(tmp_path / "other")


# --- who may talk to whom -------------------------------------------------------------------------


def test_a_client_of_the_same_ca_reaches_the_role_it_names(serve, pki) -> None:
    port, servicer = serve(pki["verifier"], require_client_cert=True)
    assert check(port, channel_credentials(pki["client"])).status == health_pb2.HealthCheckResponse.SERVING
    assert servicer.calls == 1
    assert b"tandem-client" in servicer.client_names  # the server saw (and checked) the client's certificate
    # Without a name the dialled address is checked: 127.0.0.1 is in every development certificate.
    assert check(port, channel_credentials(pki["client"]), None).status == health_pb2.HealthCheckResponse.SERVING


def test_a_client_without_a_certificate_never_reaches_a_handler(serve, pki) -> None:
    port, servicer = serve(pki["verifier"], require_client_cert=True)
    refused(port, channel_credentials(pki["client"], ca_only=True))
    assert servicer.calls == 0


def test_certificates_of_another_ca_are_refused_both_ways(serve, pki, other_pki) -> None:
    port, servicer = serve(pki["verifier"], require_client_cert=True)
    refused(port, channel_credentials(other_pki["client"]))  # the server refuses the client
    assert servicer.calls == 0
    # A server of another CA (mutual TLS would let the client in) is refused by the client.
    other_port, other_servicer = serve(other_pki["verifier"], require_client_cert=False)
    refused(other_port, channel_credentials(pki["client"]))
    assert other_servicer.calls == 0


def test_a_drafter_certificate_cannot_pose_as_a_verifier(serve, pki) -> None:
    port, servicer = serve(pki["drafter"], require_client_cert=True)
    refused(port, channel_credentials(pki["gateway"]), VERIFIER_NAME)
    assert servicer.calls == 0
    check(port, channel_credentials(pki["verifier"]), DRAFTER_NAME)  # the role it does hold
    assert servicer.calls == 1


# --- rotation -------------------------------------------------------------------------------------


def _replace(dst: Path, src: Path) -> None:
    """Rewrite `dst` in place with `src`'s bytes, its mtime moved a second on. Development PEMs
    have equal sizes and the inode stays: the mtime is all that tells the server."""
    before = dst.stat().st_mtime_ns
    dst.write_bytes(src.read_bytes())
    os.utime(dst, ns=(before + 1_000_000_000, before + 1_000_000_000))


def test_rotated_files_are_served_on_the_next_connection_without_a_restart(serve, tmp_path, pki, other_pki, caplog) -> None:
    live = tmp_path / "live"
    live.mkdir()
    files = {"cert": live / "verifier.pem", "key": live / "verifier-key.pem", "ca": live / "ca.pem"}
    old = pki["verifier"]
    for name, path in files.items():
        path.write_bytes(getattr(old, name).read_bytes())
    port, servicer = serve(TlsConfig(**files), require_client_cert=True)
    check(port, channel_credentials(pki["client"]))
    refused(port, channel_credentials(other_pki["client"]))  # the new CA's client: not yet

    # Halfway (the certificate written, its key not yet): not taken, the old pair keeps serving.
    new = other_pki["verifier"]
    _replace(files["cert"], new.cert)
    check(port, channel_credentials(pki["client"]))
    assert "keeping the current TLS certificate" in caplog.text

    _replace(files["key"], new.key)
    _replace(files["ca"], new.ca)
    check(port, channel_credentials(other_pki["client"]))  # a new channel: the new certificate and CA
    refused(port, channel_credentials(pki["client"]))  # the old CA no longer trusts the server
    assert servicer.calls == 3


# --- files and configuration ----------------------------------------------------------------------


def test_dev_certs_keys_are_private_and_the_ca_is_not_replaced_by_accident(tmp_path) -> None:
    configs = write_dev_certs(tmp_path, hosts=["gw.example.test", "10.1.2.3"], roles=("verifier", "client"))
    assert set(configs) == {"verifier", "client"}
    for key in [tmp_path / "ca-key.pem", *(c.key for c in configs.values())]:
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    cert = x509.load_pem_x509_certificate(configs["verifier"].cert.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["tandem-verifier", "localhost", "gw.example.test"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "::1", "10.1.2.3"]

    ca_before = (tmp_path / "ca.pem").read_bytes()
    with pytest.raises(FileExistsError, match="overwrite"):
        write_dev_certs(tmp_path)
    assert (tmp_path / "ca.pem").read_bytes() == ca_before
    (tmp_path / "ca-key.pem").chmod(0o644)  # replaced keys are created 0600 again, not inherit a mode
    write_dev_certs(tmp_path, overwrite=True)
    assert (tmp_path / "ca.pem").read_bytes() != ca_before
    assert stat.S_IMODE((tmp_path / "ca-key.pem").stat().st_mode) == 0o600


def test_bad_files_fail_early_naming_the_file(tmp_path, pki) -> None:
    with pytest.raises(ValueError, match="key file .*nope-key.pem does not exist"):
        TlsConfig(cert=pki["verifier"].cert, key=tmp_path / "nope-key.pem")
    with pytest.raises(ValueError, match="extra"):
        TlsConfig(cert=pki["verifier"].cert, key=pki["verifier"].key, bogus=1)
    mismatched = TlsConfig(cert=pki["verifier"].cert, key=pki["drafter"].key, ca=pki["verifier"].ca)
    with pytest.raises(ValueError, match="drafter-key.pem is not the private key of the certificate"):
        server_credentials(mismatched, require_client_cert=True)
    with pytest.raises(ValueError, match="needs a CA"):
        server_credentials(TlsConfig(cert=pki["verifier"].cert, key=pki["verifier"].key), require_client_cert=True)
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    with pytest.raises(ValueError, match="not.pem holds no PEM certificate"):
        channel_credentials(TlsConfig(cert=not_pem, key=pki["client"].key))


def test_channel_options_name_the_role_and_https_takes_uvicorns_arguments(pki) -> None:
    assert channel_options(None) == []
    assert channel_options(VERIFIER_NAME) == [("grpc.ssl_target_name_override", "tandem-verifier")]
    assert http_ssl_kwargs(None) == {}  # plain HTTP
    gw = pki["gateway"]
    assert http_ssl_kwargs(gw) == {"ssl_certfile": str(gw.cert), "ssl_keyfile": str(gw.key), "ssl_ca_certs": str(gw.ca)}
    assert http_ssl_kwargs(gw, client_cert=True)["ssl_cert_reqs"] == ssl.CERT_OPTIONAL
    with pytest.raises(ValueError, match="needs a CA"):
        http_ssl_kwargs(TlsConfig(cert=gw.cert, key=gw.key), client_cert=True)


# --- tandem certs ---------------------------------------------------------------------------------


def test_certs_command_writes_the_files_and_says_how_to_use_them(tmp_path) -> None:
    out = tmp_path / "certs"
    res = CliRunner().invoke(app, ["certs", str(out), "--host", "gw.example.test", "--days", "30"], env=ENV)
    assert res.exit_code == 0, res.output
    for role in ("gateway", "verifier", "drafter", "client"):
        TlsConfig(cert=out / f"{role}.pem", key=out / f"{role}-key.pem", ca=out / "ca.pem")
        assert role in res.stdout
    for flag in ("--tls-cert", "--tls-key", "--tls-ca"):
        assert flag in res.stdout
    assert f'http_client=httpx.Client(verify=ssl.create_default_context(cafile="{out / "ca.pem"}"))' in res.stdout
    cert = x509.load_pem_x509_certificate((out / "gateway.pem").read_bytes())
    assert "gw.example.test" in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert (cert.not_valid_after_utc - cert.not_valid_before_utc).days == 30

    again = CliRunner().invoke(app, ["certs", str(out)], env=ENV)
    assert again.exit_code == 2 and "--overwrite" in again.stderr
    assert CliRunner().invoke(app, ["certs", str(out), "--overwrite"], env=ENV).exit_code == 0


def test_certs_help_explains_what_and_what_for() -> None:
    res = CliRunner().invoke(app, ["certs", "--help"], env=ENV)
    assert res.exit_code == 0, res.output
    for words in ("ca.pem", "--tls-cert", "--tls-ca", "development", "cert-manager", "--host", "--overwrite"):
        assert words in res.stdout, words
