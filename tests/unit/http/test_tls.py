"""HTTPS through uvicorn: `serve` for real on 127.0.0.1 with a self-signed certificate made here (the fake engine)."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from cobali.http import serve as serve_module
from cobali.http.config import ServerConfig
from tests.unit.http.test_server_api import fake_app, fake_engine
from tests.unit.http.test_server_live import wait_for
from tests.unit.test_settings import clean_environment, cli_error  # noqa: F401 (the fixture: no COBALI_* leaks in)


def self_signed(directory: Path, name: str = "server") -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, signed by its own key: (certfile, keyfile), PEM."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    certfile, keyfile = directory / f"{name}.crt", directory / f"{name}.key"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return certfile, keyfile


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[serve_module.DrainingServer]]:
    """`serve` builds the fake engine's app instead of loading a model; the uvicorn servers it starts are kept."""
    started: list[serve_module.DrainingServer] = []

    class Kept(serve_module.DrainingServer):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            started.append(self)

    monkeypatch.setattr(serve_module, "DrainingServer", Kept)
    monkeypatch.setattr(serve_module, "build_app", lambda _spec, _server: fake_app(fake_engine(), "m"))
    monkeypatch.setattr(serve_module.signal, "signal", lambda *_args: None)  # not the main thread's to change
    yield started
    for server in started:
        server.should_exit = True


def test_serve_answers_https_that_verifies_against_its_certificate(tmp_path: Path, served: list) -> None:
    certfile, keyfile = self_signed(tmp_path)
    settings = ServerConfig(port=0, ssl_certfile=str(certfile), ssl_keyfile=str(keyfile))
    thread = threading.Thread(target=serve_module.serve, args=(None, settings), daemon=True)
    thread.start()
    wait_for(lambda: bool(served) and served[0].started)
    port = served[0].servers[0].sockets[0].getsockname()[1]
    trusted = ssl.create_default_context(cafile=str(certfile))
    with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=trusted, timeout=10) as client:
        wait_for(lambda: client.get("/health").status_code == 200)
        assert client.get("/v1/models").json()["data"][0]["id"] == "m"
    with pytest.raises(httpx.ConnectError), httpx.Client(timeout=10) as plain:
        plain.get(f"https://127.0.0.1:{port}/health")  # the system's CAs do not vouch for it: TLS really checked
    served[0].should_exit = True
    thread.join(15)
    assert not thread.is_alive()


def test_a_key_that_is_not_the_certificates_is_an_error_before_serving(tmp_path: Path, served: list) -> None:
    certfile, _ = self_signed(tmp_path, "one")
    _, other_key = self_signed(tmp_path, "two")
    with pytest.raises(ValueError, match=f"--ssl-certfile {certfile} with --ssl-keyfile {other_key}"):
        serve_module.serve(None, ServerConfig(ssl_certfile=str(certfile), ssl_keyfile=str(other_key)))
    assert not served, "nothing was bound"


@pytest.mark.parametrize(("flags", "fragment"), [
    (["--ssl-keyfile", "KEY"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-certfile", "CERT"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-certfile", "CERT", "--ssl-keyfile", "/nonexistent/k.pem"], "no such file '/nonexistent/k.pem'"),
    (["--ssl-certfile", "CERT", "--ssl-keyfile", "KEY", "--replicas", "2"], "Ray Serve's proxy serves HTTP"),
])
def test_tls_flags_are_checked_before_anything_loads(flags: list[str], fragment: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    certfile, keyfile = self_signed(tmp_path)
    argv = ["serve", *[{"KEY": str(keyfile), "CERT": str(certfile)}.get(flag, flag) for flag in flags]]
    assert fragment in cli_error(argv, capsys, monkeypatch)
