"""A local certificate authority for `berth up`: the servers it starts speak TLS only.

`prepare(<state>/tls)` makes, once, a CA (`ca.pem`, `ca.key`) and a certificate it signs
(`server.pem`, `server.key`) for 127.0.0.1, ::1, localhost and the `--listen` address, and reuses
them on every start (a new `--listen` address gets a new server certificate from the same CA), so
a client handed `ca.pem` keeps trusting the deployment. The server certificate is made again when
it is near its end or the CA changed. The one certificate serves every server and also acts as a
client: nats-server routes authenticate each other with it (route TLS always verifies the peer),
and Redis replicas and the cluster bus present it to their primary. Keys are ECDSA P-256 (a quick
handshake); every file is readable by its owner only, like berth/credentials.py's.

Clients trust `ca.pem`: `BERTH_TLS_CA=<state>/tls/ca.pem` (bus/connection.py, bus/redis.py).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from berth.credentials import write_private

CA_DAYS = 3650
SERVER_DAYS = 825
RENEW_BEFORE = datetime.timedelta(days=30)
HOSTS = ("127.0.0.1", "::1", "localhost")


@dataclass(frozen=True)
class TlsFiles:
    directory: Path

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca.key"

    @property
    def cert(self) -> Path:
        return self.directory / "server.pem"

    @property
    def key(self) -> Path:
        return self.directory / "server.key"


def prepare(directory: Path, hosts: tuple[str, ...] = ()) -> TlsFiles:
    """The deployment's CA and server certificate; `hosts`: more addresses or names the servers are
    reached at (`berth up --listen`), which the certificate must name too."""
    files = TlsFiles(Path(directory))
    files.directory.mkdir(parents=True, exist_ok=True)
    files.directory.chmod(0o700)
    names = [_name(host) for host in dict.fromkeys((*HOSTS, *hosts))]
    if not (files.ca.exists() and files.ca_key.exists()):
        _make_ca(files)
    if not _server_cert_valid(files, names):
        _make_server_cert(files, names)
    return files


def _name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    write_private(path, pem.decode())


def _make_ca(files: TlsFiles) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"berth local CA {files.directory}"[:64])])
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    _write_key(files.ca_key, key)
    write_private(files.ca, cert.public_bytes(serialization.Encoding.PEM).decode())


def _make_server_cert(files: TlsFiles, names: list[x509.GeneralName]) -> None:
    ca_cert = x509.load_pem_x509_certificate(files.ca.read_bytes())
    ca_key = serialization.load_pem_private_key(files.ca_key.read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "berth server")]))
        .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(minutes=5))
        .not_valid_after(_now() + datetime.timedelta(days=SERVER_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        # both: servers present it to clients, and to each other as clients (routes, replication)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(files.key, key)
    write_private(files.cert, cert.public_bytes(serialization.Encoding.PEM).decode())


def _server_cert_valid(files: TlsFiles, names: list[x509.GeneralName]) -> bool:
    """The server certificate exists, names every one of `names`, is signed by the current CA and
    is not near its end."""
    if not (files.cert.exists() and files.key.exists()):
        return False
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    ca_cert = x509.load_pem_x509_certificate(files.ca.read_bytes())
    try:
        cert.verify_directly_issued_by(ca_cert)
    except Exception:  # InvalidSignature, ValueError: another CA's (the CA was made again)
        return False
    named = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return set(names) <= set(named) and cert.not_valid_after_utc - RENEW_BEFORE > _now()
