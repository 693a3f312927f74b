"""The streamed load through what fleets put in front of a registry (packer/runtime/blob_reader.py):
a pull-through cache (Debian's docker-registry in proxy mode, in front of the registry `packer push`
wrote to), whose cold answer to a ``Range`` request is the whole blob (HTTP 200), and a registry
whose blobs redirect to object storage on another host.
"""

from __future__ import annotations

import base64
import http.server
import json
import shutil
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import test_stream
from tests.built import open_build
from tests.registry_fixtures import Proxy, QuietHTTPServer, blob_file, docker_registry
from tests.test_stream import CHUNK, WEIGHTS, Pushed, equal, insecure, stage, stub

# the streaming tests' fixtures: the registry with the builds pushed; no auth file of the
# machine's and a private temp dir (autouse); the tensor-parallel ranks' environment
pushed, _streaming_env, _tp_env = test_stream.pushed, test_stream._streaming_env, test_stream._tp_env
pytestmark = pytest.mark.skipif(shutil.which("skopeo") is None, reason="tool: skopeo is not installed")
FETCH = "fetch (registry, proven)"
USER, PASSWORD = "ci", "s3cret"
BASIC = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()


def _entry(out: Path) -> dict[str, Any]:
    return dict(json.loads((out / "manifest.json").read_bytes())["files"][WEIGHTS])


def _blob(entry: dict[str, Any]) -> str:
    return "sha256:" + str(entry["blob"]).rpartition("/")[2]


def _held(cache: Path, digest: str, size: int) -> None:
    """Wait until the cache's storage holds blob ``digest`` whole (it stores it as it serves it)."""
    path, deadline = blob_file(cache / "registry-data", digest), time.monotonic() + 30
    while not (path.is_file() and path.stat().st_size == size):
        assert time.monotonic() < deadline, f"the cache never stored {digest}"
        time.sleep(0.1)


def test_a_cold_cache_streams_the_whole_blob_once_and_a_warm_one_by_range(
        pushed: Pushed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _streaming_env: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = pushed.builds["plain"]
    entry = _entry(out)
    size = entry["size"]
    with docker_registry(tmp_path / "cache", proxy=pushed.address) as cache:
        insecure(monkeypatch, cache)
        pl = stub(out)
        local = pl.load_weights("cpu", root=out)
        cold = pl.load_weights("cpu", root=pushed.ref("plain", cache))  # no flag
        assert equal(cold, local)
        fetch = cold_fetch = stage(pl, FETCH)
        assert fetch["range_ignored"] == 1, fetch  # the cache did answer Range with the whole blob
        assert size <= fetch["bytes"] <= 1.10 * size, fetch
        err = capsys.readouterr().err
        assert "the registry ignored Range for 1 blob(s)" in err and "a load reads by Range again" in err, err
        # nothing of the weights on disk: the small files only, in one private directory
        (made,) = list(_streaming_env.iterdir())
        files = [p for p in made.rglob("*") if p.is_file()]
        assert sum(p.stat().st_size for p in files) < size / 4
        assert not any(p.suffix == ".safetensors" for p in files)

        blob = _blob(entry)
        _held(tmp_path / "cache", blob, blob_file(pushed.data, blob).stat().st_size)
        pw = stub(out)  # a later load (as another process: nothing is remembered)
        warm = pw.load_weights("cpu", root=pushed.ref("plain", cache))
        assert equal(warm, local)
        fetch = stage(pw, FETCH)
        assert "range_ignored" not in fetch, fetch  # by Range again
        assert size <= fetch["bytes"] <= size + CHUNK, fetch
        assert "ignored Range" not in capsys.readouterr().err
    print(f"weights {size} bytes; cold cache fetched {cold_fetch['bytes']} ({cold_fetch['seconds']:.3f} s), "
          f"warm {fetch['bytes']} ({fetch['seconds']:.3f} s)")


def _warm(cache: str, tmp: Path, pushed: Pushed, digest: str) -> None:
    """Have the cache fetch and store blob ``digest`` (one plain GET through it)."""
    url = f"http://{cache}/v2/models/plain/blobs/{digest}"
    with urllib.request.urlopen(url, timeout=30) as resp:
        while resp.read(1 << 20):
            pass
    _held(tmp, digest, blob_file(pushed.data, digest).stat().st_size)


def test_a_byte_flipped_in_the_caches_copy_is_refused_naming_the_chunk(
        pushed: Pushed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out, _ = pushed.builds["plain"]
    entry = _entry(out)
    with docker_registry(tmp_path / "cache", proxy=pushed.address) as cache:
        _warm(cache, tmp_path / "cache", pushed, _blob(entry))
        copy = blob_file(tmp_path / "cache" / "registry-data", _blob(entry))
        raw = bytearray(copy.read_bytes())
        at = entry["size"] // 2  # the middle of the weight file
        raw[entry["offset"] + at] ^= 0x01
        copy.write_bytes(raw)
        insecure(monkeypatch, cache)
        pl = stub(out)
        with pytest.raises(pl.ArtifactMismatchError) as e:
            pl.load_weights("cpu", root=pushed.ref("plain", cache))
    fc = open_build(out).chunk_table()[WEIGHTS]  # chunks cut at the tensors and the ranks' splits
    chunk, text = fc.holding(at), str(e.value)
    lo, hi = fc.bounds(chunk)
    assert "\n" not in text
    assert f"{WEIGHTS}: chunk {chunk} (bytes [{lo}, {hi})" in text, text
    assert "the registry's copy is corrupt or not this build's" in text


@pytest.mark.slow
def test_each_rank_behind_a_cold_cache_streams_the_blob_once_at_most(pushed: Pushed, tmp_path: Path,
                                                                     _tp_env: None) -> None:
    """Tensor parallel behind a cold cache: each rank's reads of its rows all wait on one pass of
    the whole blob (what the cache answers), so each fetches the file once, not its share."""
    from tests.test_chunks import _ranks

    out, _ = pushed.builds["plain"]
    size = _entry(out)["size"]
    with docker_registry(tmp_path / "cache", proxy=pushed.address) as cache:
        ours = _ranks(test_stream._tp_work(out, tmp_path / "work", pushed.ref("plain", cache), cache))
    for r in range(2):
        assert ours[r]["error"] == "", ours[r]["error"]
        share = ours[r]["sharded"] / 2 + ours[r]["replicated"]
        assert share <= ours[r]["hashed"] <= 1.10 * size, (r, ours[r]["hashed"], size)
        print(f"rank {r} behind a cold cache: fetched {ours[r]['hashed']} bytes; share {share:.0f}, file {size}")
    assert torch.equal(ours[0]["logits"], ours[1]["logits"])


class _Server:
    """A small HTTP server on 127.0.0.1 (a free port) whose ``handle(handler)`` answers each GET,
    recording ``(path, Range, Authorization)`` of every request it saw."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None, str | None]] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                owner.seen.append((self.path, self.headers.get("Range"), self.headers.get("Authorization")))
                owner.handle(self)

        self.httpd = QuietHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _answer(h: http.server.BaseHTTPRequestHandler, status: int, body: bytes, headers: dict[str, str]) -> None:
    h.send_response(status)
    for k, v in {**headers, "Content-Length": str(len(body))}.items():
        h.send_header(k, v)
    h.end_headers()
    h.wfile.write(body)


class ObjectStorage(_Server):
    """Answers as S3 or GCS do a presigned blob URL: ``/bucket/<hex>`` from the registry's
    storage, 206 for a ``Range`` (200 whole without one), 403 to a request carrying an
    ``Authorization`` (the registry's credentials have no business here). ``flip``: a blob
    offset whose byte it serves changed."""

    def __init__(self, data: Path) -> None:
        super().__init__()
        self.data, self.flip = data, -1

    def handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        if h.headers.get("Authorization"):
            _answer(h, 403, b"<Error><Code>AccessDenied</Code></Error>", {})
            return
        blob = bytearray(blob_file(self.data, "sha256:" + h.path.split("?")[0].rpartition("/")[2]).read_bytes())
        if 0 <= self.flip < len(blob):
            blob[self.flip] ^= 0x01
        asked = h.headers.get("Range")
        if asked is None:
            _answer(h, 200, bytes(blob), {})
            return
        first, last = (int(x) for x in asked.removeprefix("bytes=").split("-"))
        _answer(h, 206, bytes(blob[first: last + 1]), {"Content-Range": f"bytes {first}-{last}/{len(blob)}"})


class RedirectingRegistry(_Server):
    """A registry front that wants Basic credentials, serves manifests from ``upstream`` (a
    docker-registry) and answers every blob GET with a 307 to ``storage`` on another host
    (``localhost``, another port), as distribution's S3, GCS and Azure drivers do."""

    def __init__(self, upstream: str, storage: ObjectStorage) -> None:
        super().__init__()
        self.upstream, self.storage = upstream, storage

    def handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        if h.headers.get("Authorization") != BASIC:
            _answer(h, 401, b"", {"WWW-Authenticate": 'Basic realm="front"'})
        elif "/blobs/sha256:" in h.path:
            where = f"http://localhost:{self.storage.port}/bucket/{h.path.rpartition(':')[2]}?X-Amz-Signature=x"
            _answer(h, 307, b"", {"Location": where})
        else:
            req = urllib.request.Request(f"http://{self.upstream}{h.path}", headers={"Accept": h.headers["Accept"]})
            with urllib.request.urlopen(req, timeout=30) as resp:
                _answer(h, resp.status, resp.read(), {"Content-Type": resp.headers["Content-Type"]})


def test_a_redirect_to_object_storage_keeps_the_range_drops_the_credentials_and_is_proven(
        pushed: Pushed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out, _ = pushed.builds["plain"]
    entry = _entry(out)
    storage = ObjectStorage(pushed.data)
    front = RedirectingRegistry(pushed.address, storage)
    try:
        address = f"127.0.0.1:{front.port}"
        auth = tmp_path / "auth.json"
        auth.write_text(json.dumps({"auths": {address: {"auth": base64.b64encode(f"{USER}:{PASSWORD}".encode())
                                                        .decode()}}}))
        monkeypatch.setenv("PACKER_REGISTRY_AUTH", str(auth))
        insecure(monkeypatch, address)
        pl = stub(out)
        got = pl.load_weights("cpu", root=pushed.ref("plain", address))
        weight = [s for s in storage.seen if s[0].startswith(f"/bucket/{_blob(entry)[7:]}")]
        storage.flip = entry["offset"] + entry["size"] // 2
        with pytest.raises(pl.ArtifactMismatchError) as e:
            stub(out).load_weights("cpu", root=pushed.ref("plain", address))
    finally:
        front.close()
        storage.close()
    assert equal(got, pl.load_weights("cpu", root=out))
    assert weight and all(r is not None and r.startswith("bytes=") for _, r, _ in weight), weight  # Range kept
    assert storage.seen and all(a is None for _, _, a in storage.seen)  # no credential reached the storage
    assert any(a == BASIC for _, _, a in front.seen)  # the registry itself had them
    fc = open_build(out).chunk_table()[WEIGHTS]
    chunk = fc.holding(entry["size"] // 2)
    lo, hi = fc.bounds(chunk)
    assert "\n" not in str(e.value)
    assert f"{WEIGHTS}: chunk {chunk} (bytes [{lo}, {hi})" in str(e.value), str(e.value)


def test_reads_out_of_file_order_from_a_registry_that_never_serves_ranges(
        pushed: Pushed, monkeypatch: pytest.MonkeyPatch) -> None:
    """The paths a pull-through cache rarely takes, on a registry whose every answer is the whole
    blob: a read far ahead of the pass is sent back, asks again, then waits for the pass; a read
    behind it asks again, then reads an answer up to its end. Every byte is the blob's."""
    from packer.runtime import blob_reader
    from packer.runtime.remote import RemoteImage

    monkeypatch.setattr(blob_reader, "BEHIND_PAUSE", 0.01)
    out, _ = pushed.builds["plain"]
    digest = _blob(_entry(out))
    blob = blob_file(pushed.data, digest).read_bytes()
    proxy = Proxy(pushed.address, strip_range=True)
    try:
        insecure(monkeypatch, proxy.address)
        image = RemoteImage.fetch(pushed.ref("plain", proxy.address))
        reader = image.reader(digest)
        spans = [(20 << 20, 1 << 20), (22 << 20, 100), (1 << 20, 3 << 20), (0, 4096)]  # far, ahead, behind, behind
        for at, n in spans:
            view = memoryview(bytearray(n))
            reader.read(at, view)
            assert bytes(view) == blob[at: at + n], (at, n)
        assert reader.passes == 1
        assert image.stats.passed <= (22 << 20) + 100 + (4 << 20) + 4096 + (1 << 20)  # one pass, and up to a span
    finally:
        proxy.close()
