"""A registry that lies on purpose, on 127.0.0.1: the hostile side of tests/test_registry_hostile.py.

It speaks just enough of the distribution API (``/v2/<repo>/manifests/<digest>``,
``/v2/<repo>/blobs/<digest>``) for the streamed load's client to walk in, over plain HTTP or
over TLS with the tests' own CA, and every route can misbehave: drip its answer, reset the
connection before the headers, name another realm, redirect elsewhere, lie in its reason
phrase. It records what arrived (path and headers), so a test can assert what the client sent.
"""

from __future__ import annotations

import gzip
import hashlib
import http.server
import json
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tests.registry_fixtures import LoopbackCA, QuietHTTPServer

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
GZIP_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
ZSTD_LAYER = "application/vnd.oci.image.layer.v1.tar+zstd"

Route = Callable[["Handler"], None]


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Seen:
    """One request as it arrived: its path (with the query) and its headers."""

    path: str
    headers: dict[str, str] = field(default_factory=dict)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a registry
    server: _Server

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        host = self.server.owner
        with host.lock:
            host.seen.append(Seen(self.path, {k.lower(): v for k, v in self.headers.items()}))
        route = host.routes.get(self.path.partition("?")[0])
        if route is None:
            self.answer(404, b'{"errors":[{"code":"MANIFEST_UNKNOWN"}]}')
        else:
            route(self)

    def answer(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
               reason: str | None = None) -> None:
        """One whole answer."""
        self.send_response(status, reason)
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def drip(self, body: bytes, every: float, until: float, status: int = 200,
             headers: dict[str, str] | None = None) -> None:
        """The headers at once, then the body a byte every ``every`` seconds for ``until``
        seconds, then the rest (a bound, so a client without a deadline still ends)."""
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.flush()
        end, sent = time.monotonic() + until, 0
        try:
            while sent < len(body) and time.monotonic() < end:
                self.wfile.write(body[sent: sent + 1])
                self.wfile.flush()
                sent += 1
                time.sleep(every)
            self.wfile.write(body[sent:])
        except OSError:
            self.close_connection = True  # the client gave up: what a deadline does

    def reset(self) -> None:
        """Drop the connection with a TCP reset, before any answer."""
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()


class _Server(QuietHTTPServer):
    owner: HostileRegistry


class HostileRegistry:
    """A registry on 127.0.0.1 serving what its ``routes`` say (``{path: route}``).

    Args:
        tls: serve HTTPS with this CA's certificate for 127.0.0.1 and localhost.
    """

    def __init__(self, tls: LoopbackCA | None = None) -> None:
        self.routes: dict[str, Route] = {}
        self.seen: list[Seen] = []
        self.lock = threading.Lock()
        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.httpd.owner = self
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(tls.cert), str(tls.key))
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"{'https' if tls else 'http'}://{self.address}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> HostileRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def blob(self, repo: str, data: bytes, route: Route | None = None) -> str:
        """Serve ``data`` as a blob (whole, or the ``Range`` asked: 206) unless ``route`` is
        given; its digest."""
        digest = sha256(data)
        self.routes[f"/v2/{repo}/blobs/{digest}"] = route or (lambda h: serve_bytes(h, data))
        return digest

    def image(self, repo: str, layers: list[tuple[bytes, str]], *, manifest_route: Route | None = None) -> str:
        """A runnable image of ``layers`` (``(blob, media type)``), every one packer's by its
        history; its manifest served by digest (by ``manifest_route`` if given). Returns the
        ``oci://`` reference pinned by digest."""
        descs = [{"mediaType": media, "digest": self.blob(repo, data), "size": len(data)} for data, media in layers]
        config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []},
                             "history": [{"created_by": "packer: ADD layer"} for _ in layers]}).encode()
        doc = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST,
                          "config": {"mediaType": CONFIG, "digest": self.blob(repo, config), "size": len(config)},
                          "layers": descs}).encode()
        digest = sha256(doc)
        self.routes[f"/v2/{repo}/manifests/{digest}"] = manifest_route or (
            lambda h: h.answer(200, doc, {"Content-Type": MANIFEST}))
        self.manifest_bytes = doc
        return f"oci://{self.address}/{repo}@{digest}"

    def paths(self) -> list[str]:
        with self.lock:
            return [s.path for s in self.seen]


def serve_bytes(h: Handler, data: bytes) -> None:
    """``data`` whole, or the ``Range`` asked (206 with its ``Content-Range``)."""
    want = h.headers.get("Range", "")
    if want.startswith("bytes="):
        a, _, b = want[6:].partition("-")
        lo, hi = int(a), min(int(b or len(data) - 1), len(data) - 1)
        h.answer(206, data[lo: hi + 1], {"Content-Range": f"bytes {lo}-{hi}/{len(data)}"})
    else:
        h.answer(200, data)


def tar_gz(files: dict[str, bytes]) -> bytes:
    """A small gzip tar layer holding ``files`` under ``models/``."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"models/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(buf.getvalue(), mtime=0)
