"""Real registries for the tests: Debian's ``docker-registry`` (distribution 2.8) on loopback,
open, behind htpasswd, behind a token server, over TLS with the test's own CA; a token server
and a TCP proxy that misbehaves on purpose (drops a connection, ignores ``Range``)."""

from __future__ import annotations

import base64
import datetime
import hashlib
import http.server
import json
import socket
import socketserver
import ssl
import subprocess
import threading
import time
import urllib.request
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REGISTRY = "/usr/bin/docker-registry"
SERVICE, ISSUER = "packer-test-registry", "packer-test-token-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def htpasswd_line(user: str, password: str) -> str:
    """A bcrypt htpasswd line (the only scheme the registry takes), by the C library's crypt."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt

        return f"{user}:{crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))}\n"


@dataclass
class LoopbackCA:
    """A CA and a server certificate for 127.0.0.1 signed by it (PEM files), and a signing key
    whose self-signed certificate a registry trusts for tokens."""

    dir: Path
    ca: Path = field(init=False)
    cert: Path = field(init=False)
    key: Path = field(init=False)

    def __post_init__(self) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        now = datetime.datetime.now(datetime.UTC)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "packer test CA")])
        ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
              .serial_number(1).not_valid_before(now - datetime.timedelta(days=1))
              .not_valid_after(now + datetime.timedelta(days=2))
              .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
              .sign(ca_key, hashes.SHA256()))
        key = ec.generate_private_key(ec.SECP256R1())
        import ipaddress

        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
        cert = (x509.CertificateBuilder().subject_name(subject)
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(2)
                .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=2))
                .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                            x509.DNSName("localhost")]),  # "another host"
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ca, self.cert, self.key = self.dir / "ca.pem", self.dir / "server.pem", self.dir / "server.key"
        self.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        self.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self.key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))


class TokenServer:
    """The registry token flow's server: checks Basic credentials, issues ES256 JWTs whose
    ``x5c`` holds a self-signed certificate the registry trusts (``rootcertbundle``)."""

    def __init__(self, tmp: Path, user: str, password: str) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        now = datetime.datetime.now(datetime.UTC)
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ISSUER)])
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(self.key.public_key())
                .serial_number(3).not_valid_before(now - datetime.timedelta(days=1))
                .not_valid_after(now + datetime.timedelta(days=2)).sign(self.key, hashes.SHA256()))
        self.bundle = tmp / "token-root.pem"
        self.bundle.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self.x5c = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()
        self.user, self.password = user, password
        self.issued = 0
        self.refused = 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                want = "Basic " + base64.b64encode(f"{server.user}:{server.password}".encode()).decode()
                if self.headers.get("Authorization") != want:
                    server.refused += 1
                    self.send_response(401)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                query = dict(p.split("=", 1) for p in self.path.partition("?")[2].split("&") if "=" in p)
                scope = urllib.request.unquote(query.get("scope", ""))
                body = json.dumps({"token": server.token(scope)}).encode()
                server.issued += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = QuietHTTPServer(("127.0.0.1", 0), Handler)
        self.realm = f"http://127.0.0.1:{self.httpd.server_address[1]}/token"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def token(self, scope: str) -> str:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

        def b64(data: bytes) -> str:
            return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

        kind, name, actions = (scope.split(":") + ["", "", ""])[:3]
        now = int(time.time())
        head = {"typ": "JWT", "alg": "ES256", "x5c": [self.x5c]}
        claims = {"iss": ISSUER, "sub": self.user, "aud": SERVICE, "exp": now + 300, "nbf": now - 10, "iat": now,
                  "jti": hashlib.sha256(str(time.time_ns()).encode()).hexdigest()[:16],
                  "access": [{"type": kind, "name": name, "actions": actions.split(",")}] if kind else []}
        signing = f"{b64(json.dumps(head).encode())}.{b64(json.dumps(claims).encode())}"
        r, s = decode_dss_signature(self.key.sign(signing.encode(), ec.ECDSA(hashes.SHA256())))
        return f"{signing}.{b64(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"

    def close(self) -> None:
        self.httpd.shutdown()


@contextmanager
def docker_registry(tmp: Path, *, htpasswd: str | None = None, token: TokenServer | None = None,
                    tls: LoopbackCA | None = None, htpasswd_path: Path | None = None,
                    proxy: str | None = None) -> Iterator[str]:
    """A running ``docker-registry`` on a free loopback port; yields ``127.0.0.1:PORT``.

    ``htpasswd_path``: an htpasswd section naming that path as it is (Debian's default config
    names a directory, ``/etc/docker/registry``), instead of a file written from ``htpasswd``.
    ``proxy``: the ``host:port`` of an upstream registry (plain HTTP): this one is its pull-through
    cache (``proxy: remoteurl:``), its storage the cache's copy.
    """
    if not Path(REGISTRY).exists():
        pytest.skip(f"{REGISTRY} is not installed (apt-get install docker-registry)")
    port = free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    text = ("version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
            f"    rootdirectory: {tmp / 'registry-data'}\nhttp:\n  addr: 127.0.0.1:{port}\n")
    if tls is not None:
        text += f"  tls:\n    certificate: {tls.cert}\n    key: {tls.key}\n"
    if htpasswd is not None:
        (tmp / "htpasswd").write_text(htpasswd)
        htpasswd_path = tmp / "htpasswd"
    if htpasswd_path is not None:
        text += f"auth:\n  htpasswd:\n    realm: packer-test\n    path: {htpasswd_path}\n"
    if token is not None:
        text += (f"auth:\n  token:\n    realm: {token.realm}\n    service: {SERVICE}\n    issuer: {ISSUER}\n"
                 f"    rootcertbundle: {token.bundle}\n")
    if proxy is not None:
        text += f"proxy:\n  remoteurl: http://{proxy}\n"
    (tmp / "registry.yml").write_text(text)
    # its log goes to a file: a pipe nobody drains fills up (64 KiB of error lines: a 404 per
    # unknown manifest, ...) and the registry then hangs on its next write, mid-request
    log = (tmp / "registry.log").open("ab")
    proc = subprocess.Popen([REGISTRY, "serve", str(tmp / "registry.yml")], stdout=subprocess.DEVNULL,
                            stderr=log)
    log.close()
    ctx = ssl.create_default_context(cafile=str(tls.ca)) if tls is not None else None
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                urllib.request.urlopen(f"{'https' if tls else 'http'}://127.0.0.1:{port}/v2/", timeout=1,
                                       context=ctx).close()
                break
            except urllib.error.HTTPError:  # 401: up, and asking for credentials
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = (tmp / "registry.log").read_text(errors="replace")
                    pytest.fail(f"docker-registry did not start: {err[-500:]}")
                time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


class QuietHTTPServer(http.server.ThreadingHTTPServer):
    """A threading HTTP server for the tests' servers on 127.0.0.1 whose failed request ends quietly.

    A client that goes away mid-answer (a deadline, a reset on purpose, a load that had what it
    needed) is expected here. socketserver's own ``handle_error`` prints the traceback to
    ``sys.stderr`` of the moment: from a thread that outlived its test, into whichever test holds
    it then, a ``CliRunner``'s capture included, where it reads as extra lines of that command.
    It serves any request handler, the proxy's raw TCP one too.
    """

    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass


def blob_file(data_dir: Path, digest: str) -> Path:
    """Where the registry's filesystem storage keeps blob ``sha256:<hex>``."""
    hexd = digest.removeprefix("sha256:")
    return data_dir / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


class Proxy:
    """A TCP proxy to ``target`` (``host:port``) that misbehaves on purpose.

    ``drop_after``: the first ``drops`` responses carrying a blob's bytes (``206``) are cut
    after that many bytes. ``strip_range``: ``Range`` headers are removed from requests, so the
    registry answers with whole blobs.
    """

    def __init__(self, target: str, *, drop_after: int = 0, drops: int = 0, strip_range: bool = False) -> None:
        self.target = target
        self.drop_after, self.drops, self.strip_range = drop_after, drops, strip_range
        self.dropped = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy.serve(self.request)

        self.server = QuietHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def serve(self, client: socket.socket) -> None:
        host, port = self.target.split(":")
        upstream = socket.create_connection((host, int(port)))
        try:
            f = client.makefile("rb")
            while True:
                head = b""
                while not head.endswith(b"\r\n\r\n"):
                    line = f.readline()
                    if not line:
                        return
                    head += line
                if self.strip_range:
                    head = b"".join(ln for ln in head.splitlines(keepends=True) if not ln.lower().startswith(b"range:"))
                upstream.sendall(head)
                if not self.relay(upstream, client):
                    return
        finally:
            upstream.close()
            client.close()

    def relay(self, upstream: socket.socket, client: socket.socket) -> bool:
        """One response back to the client; False when the connection was cut."""
        u = upstream.makefile("rb")
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            line = u.readline()
            if not line:
                return False
            head += line
        length = 0
        for ln in head.split(b"\r\n"):
            if ln.lower().startswith(b"content-length:"):
                length = int(ln.split(b":")[1])
        cut = None
        with self.lock:
            if head.startswith(b"HTTP/1.1 206") and self.dropped < self.drops and length > self.drop_after:
                self.dropped += 1
                cut = self.drop_after
        client.sendall(head)
        sent = 0
        while sent < length:
            data = u.read(min(1 << 16, length - sent) if cut is None else min(1 << 16, cut - sent, length - sent))
            if not data:
                return False
            client.sendall(data)
            sent += len(data)
            if cut is not None and sent >= cut:
                client.shutdown(socket.SHUT_RDWR)
                return False
        return True

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
