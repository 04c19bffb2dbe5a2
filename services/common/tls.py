"""TLS for Baton's gRPC ports: credentials from PEM files, and a throwaway CA for local clusters.

Every service serves TLS when given a certificate and key. Given a CA too, an internal service
(scheduler, kvindex, node agent) requires each client to present a certificate that CA signed
(mutual TLS), and every service presents its own certificate when it calls another. The router's
public port asks no client certificate: clients prove who they are with API keys (docs/security.md).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsFiles:
    """PEM paths: this process's certificate and key, and the CA its peers' certificates chain to."""

    cert: str = ""
    key: str = ""
    ca: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key: give both or neither")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path and not Path(path).is_file():
                raise ValueError(f"{flag}={path!r}: no such file")

    @property
    def enabled(self) -> bool:
        return bool(self.cert)


def server_credentials(files: TlsFiles, require_client_cert: bool) -> grpc.ServerCredentials | None:
    """What a server listens with; None: plaintext. With require_client_cert (and a CA), a client
    without a certificate the CA signed is refused during the handshake."""
    if not files.enabled:
        return None
    pair = (Path(files.key).read_bytes(), Path(files.cert).read_bytes())
    ca = Path(files.ca).read_bytes() if files.ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca,
                                       require_client_auth=require_client_cert and ca is not None)


def server_ssl_context(files: TlsFiles) -> ssl.SSLContext | None:
    """What an HTTP server (the router's OpenAI-compatible API) serves HTTPS with: files' certificate
    and key; None (plaintext HTTP) without them. It asks no client certificate: the public HTTP API,
    like the router's gRPC port, authenticates callers with API keys."""
    if not files.enabled:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(files.cert, files.key)
    return context


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials | None:
    """What a process calls services with: the CA to check them by, and its own certificate to show
    them when it has one; None (plaintext) without a CA."""
    if not files.ca:
        return None
    return grpc.ssl_channel_credentials(root_certificates=Path(files.ca).read_bytes(),
                                        private_key=Path(files.key).read_bytes() if files.key else None,
                                        certificate_chain=Path(files.cert).read_bytes() if files.cert else None)


@dataclass(frozen=True)
class ThrowawayPki:
    """A CA and the certificates it issued, as files under one directory."""

    ca: Path
    # Served by every service and shown by each when it calls another (server and client use).
    service: TlsFiles
    # A client certificate for operators and tests (client use only).
    client: TlsFiles


def generate_throwaway_pki(directory: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
                           days: int = 7) -> ThrowawayPki:
    """A new CA, a service certificate for hosts and a client certificate, written under directory
    (keys readable by their owner alone). For local clusters and tests, never for production."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    # A little back in time: a clock a few minutes slow still accepts the certificates.
    valid_from, valid_to = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def write_key(name: str, key: ec.EllipticCurvePrivateKey) -> Path:
        path = directory / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # an older file of that name may have been readable by others
        with os.fdopen(fd, "wb") as out:
            out.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()))
        return path

    def write_cert(name: str, cert: x509.Certificate) -> Path:
        path = directory / name
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return path

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Baton throwaway CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(valid_from).not_valid_after(valid_to)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, encipher_only=False,
                                            decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    ca_path = write_cert("ca.pem", ca_cert)

    def issue(stem: str, common_name: str, usages: list[x509.ObjectIdentifier], with_hosts: bool) -> TlsFiles:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
                   .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(valid_from).not_valid_after(valid_to)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
        if with_hosts:
            names: list[x509.GeneralName] = []
            for host in hosts:
                try:
                    names.append(x509.IPAddress(ipaddress.ip_address(host)))
                except ValueError:
                    names.append(x509.DNSName(host))
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return TlsFiles(cert=str(write_cert(f"{stem}.pem", cert)), key=str(write_key(f"{stem}-key.pem", key)),
                        ca=str(ca_path))

    service = issue("service", "baton-service", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                    with_hosts=True)
    client = issue("client", "baton-operator", [ExtendedKeyUsageOID.CLIENT_AUTH], with_hosts=False)
    return ThrowawayPki(ca=ca_path, service=service, client=client)
