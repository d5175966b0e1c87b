"""Real TLS parts for the security tests, each started by the test and stopped by its own pid.

- ``TestCertificates``: a CA and a server certificate for 127.0.0.1/localhost (``trustme``);
- ``tls_redis``: a ``redis-server`` speaking TLS only, with a password and an ACL user;
- ``tls_terminator``: ``socat`` terminating TLS in front of a plain TCP port (Tansu, the simulator),
  because Tansu 0.6's own ``--cert``/``--key`` flags gave no TLS listener.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import trustme
from pydantic import SecretStr

from devstack.processes import free_port, port_open
from pipeline.kafka_security import KafkaSecurity, librdkafka_properties


@dataclass(frozen=True)
class TestCertificates:
    __test__ = False  # not a test class

    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path
    """The client's private key, encrypted with ``CLIENT_KEY_PASSWORD`` (PKCS#8 PEM)."""


CLIENT_KEY_PASSWORD = "client-key-Pw"


def mutual_tls(certs: TestCertificates) -> KafkaSecurity:
    """The runner's Kafka settings for a broker that wants a client certificate from ``certs``' CA."""
    return KafkaSecurity(
        protocol="SSL",
        ssl_ca_file=certs.ca,
        ssl_cert_file=certs.client_cert,
        ssl_key_file=certs.client_key,
        ssl_key_password=SecretStr(CLIENT_KEY_PASSWORD),
    )


def kafka_config(bootstrap: str, security: KafkaSecurity) -> dict[str, str | int | float | bool]:
    """A confluent-kafka client config for ``bootstrap`` with ``security``'s librdkafka keys."""
    return {"bootstrap.servers": bootstrap, **librdkafka_properties(security)}


def make_certificates(directory: Path) -> TestCertificates:
    """A fresh CA, a server certificate for ``127.0.0.1`` and ``localhost`` and a client certificate
    (for mutual TLS), as PEM files."""
    from cryptography.hazmat.primitives import serialization

    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("shopper-client@example.test")
    files = TestCertificates(
        directory / "ca.crt",
        directory / "server.crt",
        directory / "server.key",
        directory / "client.crt",
        directory / "client.key",
    )
    ca.cert_pem.write_to_path(str(files.ca))
    for leaf, cert in ((server, files.cert), (client, files.client_cert)):
        with cert.open("wb") as out:
            for pem in leaf.cert_chain_pems:
                out.write(pem.bytes())
    server.private_key_pem.write_to_path(str(files.key))
    key = serialization.load_pem_private_key(client.private_key_pem.bytes(), password=None)
    files.client_key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(CLIENT_KEY_PASSWORD.encode()),
        )
    )
    return files


@contextmanager
def _process(argv: Sequence[str], port: int, log: Path, timeout_s: float = 15.0) -> Iterator[None]:
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while not port_open(port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{argv[0]} did not listen on {port}: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def tls_redis(
    directory: Path, certs: TestCertificates, password: str, *, user: str, user_password: str
) -> Iterator[int]:
    """A TLS-only ``redis-server`` (no plain port) on a free port: ``default`` needs ``password``,
    and an ACL user ``user`` with ``user_password`` may do everything."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (Debian package redis-server)")
    port = free_port()
    argv = [
        binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
        "--tls-cert-file", str(certs.cert), "--tls-key-file", str(certs.key),
        "--tls-ca-cert-file", str(certs.ca), "--tls-auth-clients", "no",
        "--requirepass", password, "--user", user, "on", f">{user_password}", "~*", "&*", "+@all",
        "--save", "", "--appendonly", "no", "--dir", str(directory),
    ]  # fmt: skip
    with _process(argv, port, directory / f"redis-{port}.log"):
        yield port


@contextmanager
def tls_terminator(
    directory: Path,
    certs: TestCertificates,
    backend_port: int,
    port: int | None = None,
    *,
    require_client_cert: bool = False,
) -> Iterator[int]:
    """``socat`` accepting TLS on ``port`` (default: a free one) and forwarding plain TCP to
    ``backend_port``; with ``require_client_cert``, only clients with a certificate from the CA."""
    binary = shutil.which("socat")
    if binary is None:
        raise RuntimeError("socat is not installed (Debian package socat)")
    port = port or free_port()
    verify = f"verify=1,cafile={certs.ca}" if require_client_cert else "verify=0"
    listen = f"OPENSSL-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork,cert={certs.cert},key={certs.key},{verify}"
    with _process([binary, listen, f"TCP:127.0.0.1:{backend_port}"], port, directory / f"socat-{port}.log"):
        yield port


@contextmanager
def tansu_behind_tls(
    directory: Path, certs: TestCertificates, *, require_client_cert: bool = False
) -> Iterator[str]:
    """A Tansu broker (in-memory storage) reachable only through a TLS terminator: the broker
    advertises the terminator's port, so every client connection goes through TLS. Yields the
    bootstrap address ``127.0.0.1:<tls port>``."""
    from devstack.stack import tansu_binary

    broker_port, tls_port = free_port(), free_port()
    argv = [
        tansu_binary(), "broker",
        "--listener-url", f"tcp://127.0.0.1:{broker_port}",
        "--advertised-listener-url", f"tcp://127.0.0.1:{tls_port}",
    ]  # fmt: skip
    with (
        _process(argv, broker_port, directory / f"tansu-{broker_port}.log", timeout_s=30),
        tls_terminator(directory, certs, broker_port, tls_port, require_client_cert=require_client_cert),
    ):
        yield f"127.0.0.1:{tls_port}"
