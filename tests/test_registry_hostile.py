"""The registry client against a hostile registry on 127.0.0.1 (tests/hostile_registry.py).

Each fault kind the client must hold against: where credentials go (a realm in plain HTTP, a
realm or a redirect on another host), a server that drips its answer (per request and per
load), an image that multiplies requests (layers, a request cap, a token too large), a layer
that decompresses without bound (gzip and zstd, over the cap and under a memory limit), a
reason phrase holding terminal escapes, a connection reset before the answer, and environment
values that are no values. Every refusal is one line, never a traceback.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from packer.runtime import remote
from packer.runtime.registry import Registry, RegistryError, parse_ref
from packer.runtime.remote import RemoteImage
from tests.hostile_registry import GZIP_LAYER, ZSTD_LAYER, Handler, HostileRegistry, Route, serve_bytes, tar_gz
from tests.registry_fixtures import LoopbackCA

REPO = Path(__file__).resolve().parents[1]
USER, PASSWORD = "ci", "s3cret"
BASIC = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
VARS = ("PACKER_REGISTRY_INSECURE", "REGISTRY_AUTH_FILE", "XDG_RUNTIME_DIR", "DOCKER_CONFIG", "PACKER_REGISTRY_AUTH",
        "PACKER_REGISTRY_CA", "PACKER_STREAM_WHOLE", "PACKER_REGISTRY_TIMEOUT", "PACKER_REGISTRY_DEADLINE",
        "PACKER_REGISTRY_MAX_REQUESTS")


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No auth file or registry variable of the machine's."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var in VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> LoopbackCA:
    return LoopbackCA(tmp_path_factory.mktemp("ca"))


@pytest.fixture
def hostile() -> Iterator[HostileRegistry]:
    with HostileRegistry() as h:
        yield h


def _auth_file(monkeypatch: pytest.MonkeyPatch, tmp: Path, *hosts: str) -> None:
    path = tmp / "auth.json"
    entry = {"auth": base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()}
    path.write_text(json.dumps({"auths": dict.fromkeys(hosts, entry)}))
    monkeypatch.setenv("PACKER_REGISTRY_AUTH", str(path))


def _one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text and "\x1b" not in text, text
    return text


def _small_image(h: HostileRegistry, repo: str = "m/hostile") -> str:
    return h.image(repo, [(tar_gz({"config.json": b"{}"}), GZIP_LAYER)])


def _bearer(realm: str) -> Route:
    """A route answering 401 with a Bearer challenge naming ``realm`` until a token arrives."""
    def route(h: Handler) -> None:
        if h.headers.get("Authorization") == "Bearer good-token":
            h.answer(200, b"{}")
        else:
            h.answer(401, b"", {"WWW-Authenticate": f'Bearer realm="{realm}",service="reg",scope="repository:m:pull"'})
    return route


# --- 1. credentials go only to the registry's own host, never in plain HTTP unless listed ---


def test_an_http_realm_named_by_a_tls_registry_receives_nothing(ca: LoopbackCA, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    with HostileRegistry(tls=ca) as reg, HostileRegistry() as realm:
        ref = _small_image(reg)
        digest = ref.rpartition("@")[2]
        reg.routes[f"/v2/m/hostile/manifests/{digest}"] = _bearer(f"{realm.url}/token")
        monkeypatch.setenv("PACKER_REGISTRY_CA", str(ca.ca))
        _auth_file(monkeypatch, tmp_path, reg.address)
        with pytest.raises(RegistryError) as e:
            RemoteImage.fetch(ref)
        assert realm.seen == []  # asked nothing: no credentials, not even a connection's request
        text = _one_line(e.value)
        assert f"{reg.address} names the token realm" in text and "plain HTTP" in text, text
        assert "PACKER_REGISTRY_INSECURE" in text and realm.address in text, text


def test_a_realm_on_another_https_host_gets_no_credentials_yet_a_public_image_loads(
        ca: LoopbackCA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``localhost`` is another host name than ``127.0.0.1`` (as auth.docker.io is for
    registry-1.docker.io): it is asked for a token anonymously."""
    with HostileRegistry(tls=ca) as reg, HostileRegistry(tls=ca) as realm:
        ref = _small_image(reg)
        data = reg.manifest_bytes
        digest = ref.rpartition("@")[2]

        def manifest(h: Handler) -> None:
            if h.headers.get("Authorization") == "Bearer good-token":
                h.answer(200, data, {"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
            else:
                _bearer(f"https://localhost:{realm.port}/token")(h)
        reg.routes[f"/v2/m/hostile/manifests/{digest}"] = manifest
        realm.routes["/token"] = lambda h: h.answer(200, b'{"token": "good-token"}')
        monkeypatch.setenv("PACKER_REGISTRY_CA", str(ca.ca))
        _auth_file(monkeypatch, tmp_path, reg.address)
        image = RemoteImage.fetch(ref)
    assert str(image.ref) == ref
    assert [s.headers.get("authorization") for s in realm.seen] == [None]
    assert "Bearer good-token" in [s.headers.get("authorization") for s in reg.seen]


def test_a_realm_on_another_host_that_wants_credentials_says_they_were_withheld(
        ca: LoopbackCA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with HostileRegistry(tls=ca) as reg, HostileRegistry(tls=ca) as realm:
        ref = _small_image(reg)
        reg.routes[f"/v2/m/hostile/manifests/{ref.rpartition('@')[2]}"] = _bearer(
            f"https://localhost:{realm.port}/token")
        realm.routes["/token"] = lambda h: h.answer(401, b"")
        monkeypatch.setenv("PACKER_REGISTRY_CA", str(ca.ca))
        _auth_file(monkeypatch, tmp_path, reg.address)
        with pytest.raises(RegistryError) as e:
            RemoteImage.fetch(ref)
    assert all("authorization" not in s.headers for s in realm.seen)
    assert f"credentials for {reg.address} were not sent to localhost:{realm.port}" in _one_line(e.value)


def test_a_realm_on_another_host_gets_the_credentials_given_for_that_host(
        ca: LoopbackCA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A token service on another host (auth.docker.io) is sent credentials when the auth file
    names that host itself: given there by the user, not routed there by the registry."""
    with HostileRegistry(tls=ca) as reg, HostileRegistry(tls=ca) as realm:
        ref = _small_image(reg)
        data = reg.manifest_bytes

        def manifest(h: Handler) -> None:
            if h.headers.get("Authorization") == "Bearer good-token":
                h.answer(200, data, {"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
            else:
                _bearer(f"https://localhost:{realm.port}/token")(h)
        reg.routes[f"/v2/m/hostile/manifests/{ref.rpartition('@')[2]}"] = manifest

        def token(h: Handler) -> None:
            ok = h.headers.get("Authorization") == BASIC
            h.answer(200 if ok else 401, b'{"token": "good-token"}' if ok else b"")
        realm.routes["/token"] = token
        monkeypatch.setenv("PACKER_REGISTRY_CA", str(ca.ca))
        _auth_file(monkeypatch, tmp_path, reg.address, f"localhost:{realm.port}")
        assert str(RemoteImage.fetch(ref).ref) == ref
    assert [s.headers.get("authorization") for s in realm.seen] == [BASIC]


def test_a_redirect_to_another_host_carries_the_range_but_no_credentials(
        hostile: HostileRegistry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = bytes(range(256)) * 64
    with HostileRegistry() as storage:
        digest = storage.blob("m/hostile", data)

        def blob(h: Handler) -> None:
            if h.headers.get("Authorization") != BASIC:
                h.answer(401, b"", {"WWW-Authenticate": 'Basic realm="reg"'})
            else:
                h.answer(307, b"", {"Location": f"http://localhost:{storage.port}/v2/m/hostile/blobs/{digest}"})
        hostile.routes[f"/v2/m/hostile/blobs/{digest}"] = blob
        monkeypatch.setenv("PACKER_REGISTRY_INSECURE", f"{hostile.address},localhost:{storage.port}")
        _auth_file(monkeypatch, tmp_path, hostile.address)
        reg = Registry(parse_ref(f"oci://{hostile.address}/m/hostile@{digest}"))
        view = memoryview(bytearray(1000))
        reg.read_range(digest, 100, view)
    assert bytes(view) == data[100:1100]
    assert [s.headers.get("range") for s in storage.seen] == ["bytes=100-1099"]
    assert all("authorization" not in s.headers for s in storage.seen)
    assert hostile.seen[-1].headers.get("authorization") == BASIC  # the registry itself had them


BAD_ADDRESSES = {
    "a port of escapes": "http://127.0.0.1:\x1bc\x9b2J/x",
    "an unbalanced bracket": "http://[::1/x",
    "a port out of range": "http://127.0.0.1:70000/x",
    "a port of zero": "http://127.0.0.1:0/x",
    "a host in other letters": "http://h\xe9st.example/x",
    "a path in other letters": "http://127.0.0.1:1/v2/m/\xe9vil",  # http.client can send ASCII alone
    "a space in the host": "http://127.0.0.1 .example/x",
    "credentials in it": "http://u:p@127.0.0.1:1/x",
    "no host": "https:///x",
    "another scheme": "file:///etc/passwd",
}


@pytest.mark.parametrize("where", ["redirect", "realm"])
@pytest.mark.parametrize("address", list(BAD_ADDRESSES.values()), ids=list(BAD_ADDRESSES))
def test_an_address_the_registry_names_is_checked_before_anything_is_sent(
        where: str, address: str, hostile: HostileRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    """A redirect's ``Location`` or a token realm that is no http(s) address of a host is refused in
    one line, escaped, as a RegistryError (never http.client's InvalidURL with the raw text)."""
    ref = _small_image(hostile)
    digest = ref.rpartition("@")[2]
    if where == "redirect":
        def route(h: Handler) -> None:
            h.answer(307, b"", {"Location": address})
    else:
        route = _bearer(address)
    hostile.routes[f"/v2/m/hostile/manifests/{digest}"] = route
    monkeypatch.setenv("PACKER_REGISTRY_INSECURE", hostile.address)
    with pytest.raises(RegistryError) as e:
        RemoteImage.fetch(ref)
    text = _one_line(e.value)
    assert "not an http(s) address of a host; refused, nothing sent" in text, text
    assert ("redirected to" if where == "redirect" else "names the token realm") in text, text
    assert "\x9b" not in text and len(hostile.seen) == 1, (text, hostile.seen)


# --- 2. deadlines: a drip is cut off, per request and per load ---


def test_a_dripped_manifest_is_cut_off_at_the_deadline(hostile: HostileRegistry,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _small_image(hostile)
    data = hostile.manifest_bytes
    hostile.routes[f"/v2/m/hostile/manifests/{ref.rpartition('@')[2]}"] = lambda h: h.drip(
        data, every=0.5, until=8, headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
    monkeypatch.setenv("PACKER_REGISTRY_INSECURE", hostile.address)
    monkeypatch.setenv("PACKER_REGISTRY_TIMEOUT", "1")
    started = time.monotonic()
    with pytest.raises(RegistryError) as e:
        RemoteImage.fetch(ref)
    took = time.monotonic() - started
    assert took < 3, took
    text = _one_line(e.value)
    assert re.search(r"the image manifest: cut off after 1\.[0-9] s, over its deadline", text), text
    assert "PACKER_REGISTRY_TIMEOUT=1" in text


def test_a_dripped_blob_span_is_cut_off_and_not_resumed(hostile: HostileRegistry,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(4096)
    digest = hostile.blob("m/hostile", data, lambda h: h.drip(data[:2048], every=0.5, until=8, status=206,
                                                              headers={"Content-Range": "bytes 0-2047/4096"}))
    monkeypatch.setenv("PACKER_REGISTRY_INSECURE", hostile.address)
    monkeypatch.setenv("PACKER_REGISTRY_TIMEOUT", "1")
    reg = Registry(parse_ref(f"oci://{hostile.address}/m/hostile@{digest}"))
    started = time.monotonic()
    with pytest.raises(RegistryError) as e:
        reg.read_range(digest, 0, memoryview(bytearray(2048)))
    assert time.monotonic() - started < 3
    assert f"bytes 0-2047 of blob {digest[:19]}...: cut off after 1." in _one_line(e.value)
    assert len(hostile.seen) == 1  # a drip is not resumed: that would be five deadlines


def test_a_blob_span_that_goes_silent_is_one_request_not_five(hostile: HostileRegistry,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Headers, then nothing: the socket's timeout ends it, and it is not resumed (each resume
    would bring a deadline of its own)."""
    data = os.urandom(4 << 20)  # a 2 MiB span's deadline is 3 s: the socket's timeout (1 s) ends it

    def silent(h: Handler) -> None:
        h.send_response(206)
        h.send_header("Content-Range", f"bytes 0-{(2 << 20) - 1}/{4 << 20}")
        h.send_header("Content-Length", str(2 << 20))
        h.end_headers()
        h.wfile.flush()
        time.sleep(6)
        h.close_connection = True
    digest = hostile.blob("m/hostile", data, silent)
    monkeypatch.setenv("PACKER_REGISTRY_INSECURE", hostile.address)
    monkeypatch.setenv("PACKER_REGISTRY_TIMEOUT", "1")
    reg = Registry(parse_ref(f"oci://{hostile.address}/m/hostile@{digest}"))
    started = time.monotonic()
    with pytest.raises(RegistryError) as e:
        reg.read_range(digest, 0, memoryview(bytearray(2 << 20)))
    assert time.monotonic() - started < 2.5
    assert _one_line(e.value).endswith(f"bytes 0-{(2 << 20) - 1} of blob {digest[:19]}...: no byte came for 1 s "
                                       "(PACKER_REGISTRY_TIMEOUT); the registry stalled")
    assert len(hostile.seen) == 1


def test_the_deadline_passing_while_a_connection_opens_still_ends_the_request(
        hostile: HostileRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry spends most of the request's 2 s, then redirects to an address whose connect
    takes a second (its accept queue is full: the SYN is sent again after 1 s, inside the
    socket's 2 s timeout) and which then drips its status line for 10 s: the timer fired with no
    socket to cut, and the request still ends at its deadline."""
    import socket
    import threading

    target = socket.socket()
    target.bind(("127.0.0.1", 0))
    target.listen(0)
    port = target.getsockname()[1]
    dripped: list[int] = []

    def drip_status() -> None:
        filler = socket.create_connection(("127.0.0.1", port))  # the accept queue is full from here
        time.sleep(0.5)
        target.accept()[0].close()  # the filler's: the queue frees, the client's SYN gets in again
        filler.close()
        conn = target.accept()[0]
        try:
            for byte in b"HTTP/1.1 200 OK":
                conn.sendall(bytes([byte]))
                dripped.append(byte)
                time.sleep(0.7)
        except OSError:
            pass
        finally:
            conn.close()

    ref = _small_image(hostile)

    def redirect(h: Handler) -> None:
        time.sleep(1.3)  # of the request's 2 s
        threading.Thread(target=drip_status, daemon=True).start()
        time.sleep(0.05)
        h.answer(307, b"", {"Location": f"http://127.0.0.1:{port}/v2/m/hostile/manifests/x"})
    hostile.routes[f"/v2/m/hostile/manifests/{ref.rpartition('@')[2]}"] = redirect
    monkeypatch.setenv("PACKER_REGISTRY_INSECURE", f"{hostile.address},127.0.0.1:{port}")
    monkeypatch.setenv("PACKER_REGISTRY_TIMEOUT", "2")
    started = time.monotonic()
    try:
        with pytest.raises(RegistryError) as e:
            RemoteImage.fetch(ref)
    finally:
        target.close()
    assert time.monotonic() - started < 4.5
    assert "the image manifest: cut off after" in _one_line(e.value)
    assert len(dripped) <= 3


def test_a_load_has_one_deadline_for_all_its_requests(hostile: HostileRegistry,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(1024)

    def slow(h: Handler) -> None:
        time.sleep(0.4)
        serve_bytes(h, data)
    digest = hostile.blob("m/hostile", data, slow)
    monkeypatch.setenv("PACKER_REGISTRY_INSECURE", hostile.address)
    monkeypatch.setenv("PACKER_REGISTRY_TIMEOUT", "1")
    monkeypatch.setenv("PACKER_REGISTRY_DEADLINE", "1.5")
    reg = Registry(parse_ref(f"oci://{hostile.address}/m/hostile@{digest}"))
    started = time.monotonic()
    with pytest.raises(RegistryError) as e:
        for i in range(20):
            reg.read_range(digest, i, memoryview(bytearray(10)))
    assert time.monotonic() - started < 2.5
    assert "PACKER_REGISTRY_DEADLINE=1.5" in _one_line(e.value)
    assert 3 <= len(hostile.seen) <= 5


def test_idle_time_between_reads_does_not_count_against_the_load(hostile: HostileRegistry,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Lazy reads come long after the load began: only time with requests in flight counts,
    also after a request that failed (its clock stopped with it)."""
    data = os.urandom(1024)
    digest = hostile.blob("m/hostile", data)
    hostile.routes["/v2/m/hostile/blobs/" + "sha256:" + "1" * 64] = _bearer("https://localhost:1/token")
    monkeypatch.setenv("PACKER_REGISTRY_INSECURE", hostile.address)
    monkeypatch.setenv("PACKER_REGISTRY_DEADLINE", "1")
    reg = Registry(parse_ref(f"oci://{hostile.address}/m/hostile@{digest}"))
    with pytest.raises(RegistryError, match="cannot reach localhost:1 after 5 tries"):
        reg.read_range("sha256:" + "1" * 64, 0, memoryview(bytearray(10)))
    busy = reg.budget.busy()
    time.sleep(1.1)
    assert reg.budget.busy() == busy < 1
    view = memoryview(bytearray(10))
    reg.read_range(digest, 5, view)
    assert bytes(view) == data[5:15]


# --- 3. caps: layers, requests, the token ---


def test_an_image_of_5000_layers_is_refused_before_a_layer_is_fetched(hostile: HostileRegistry,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    layer = tar_gz({})
    ref = hostile.image("m/hostile", [(layer, GZIP_LAYER)] * 5000)
    monkeypatch.setenv("PACKER_REGISTRY_INSECURE", hostile.address)
    with pytest.raises(RegistryError) as e:
        RemoteImage.fetch(ref).materialize()
    assert "lists 5000 layers, over the cap of 128" in _one_line(e.value)
    assert len(hostile.seen) == 1  # the manifest alone


def test_a_load_past_its_request_cap_is_refused(hostile: HostileRegistry, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    ref = hostile.image("m/hostile", [(tar_gz({f"f{i}": b"x"}), GZIP_LAYER) for i in range(6)])
    monkeypatch.setenv("PACKER_REGISTRY_INSECURE", hostile.address)
    monkeypatch.setenv("PACKER_REGISTRY_MAX_REQUESTS", "5")
    with pytest.raises(RegistryError) as e:
        RemoteImage.fetch(ref).materialize(tmp_path / "out")
    assert "made 5 requests already, its cap (PACKER_REGISTRY_MAX_REQUESTS)" in _one_line(e.value)
    assert len(hostile.seen) == 5


def test_a_token_answer_over_its_cap_is_refused(hostile: HostileRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _small_image(hostile)
    hostile.routes[f"/v2/m/hostile/manifests/{ref.rpartition('@')[2]}"] = _bearer(
        f"{hostile.url}/token")
    hostile.routes["/token"] = lambda h: h.answer(200, json.dumps({"token": "x" * 200_000}).encode())
    monkeypatch.setenv("PACKER_REGISTRY_INSECURE", hostile.address)
    with pytest.raises(RegistryError) as e:
        RemoteImage.fetch(ref)
    assert f"the token server {hostile.address}'s answer is over its cap of 65536 bytes" in _one_line(e.value)


# --- 4. decompression: bounded before allocation, one line whatever the memory ---


def _gzip_bomb(size: int) -> bytes:
    c = zlib.compressobj(1, zlib.DEFLATED, 31)  # fast to make; still ~230:1
    zeros = bytes(16 << 20)
    return b"".join(c.compress(zeros) for _ in range(size // len(zeros))) + c.flush()


def _zstd_bomb(size: int) -> bytes:
    import zstandard

    c = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    zeros = bytes(16 << 20)
    return b"".join(c.compress(zeros) for _ in range(size // len(zeros))) + c.flush()


@pytest.mark.parametrize("media", [GZIP_LAYER, ZSTD_LAYER])
def test_a_layer_over_the_decompression_cap_is_one_line(media: str, hostile: HostileRegistry, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    bomb = _gzip_bomb(64 << 20) if media == GZIP_LAYER else _zstd_bomb(64 << 20)
    ref = hostile.image("m/hostile", [(bomb, media)])
    monkeypatch.setenv("PACKER_REGISTRY_INSECURE", hostile.address)
    monkeypatch.setattr(remote, "MAX_SMALL_FILES", 8 << 20)
    with pytest.raises(RegistryError) as e:
        RemoteImage.fetch(ref).materialize(tmp_path / "out")
    assert "decompresses to more than the cap of 8388608 bytes" in _one_line(e.value)


@pytest.mark.parametrize("kind", ["gzip", "zstd", "zstd declaring its size"])
def test_a_layer_over_the_cap_a_memory_limit_lowered_says_so(kind: str, hostile: HostileRegistry, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """However the layer passes the lowered cap (found while inflating, or declared in its zstd
    frame), the line names the memory limit that lowered it: the refusal's kind, not its text."""
    import zstandard

    from packer.runtime import inflate

    size = 48 << 20
    bomb = {"gzip": lambda: _gzip_bomb(size), "zstd": lambda: _zstd_bomb(size),
            "zstd declaring its size": lambda: zstandard.ZstdCompressor(level=1).compress(bytes(size))}[kind]()
    ref = hostile.image("m/hostile", [(bomb, GZIP_LAYER if kind == "gzip" else ZSTD_LAYER)])
    monkeypatch.setenv("PACKER_REGISTRY_INSECURE", hostile.address)
    monkeypatch.setattr(remote, "memory_budget", lambda: 16 << 20)
    monkeypatch.setattr(inflate, "memory_budget", lambda: None)
    with pytest.raises(RegistryError) as e:
        RemoteImage.fetch(ref).materialize(tmp_path / "out")
    line = _one_line(e.value)
    assert "more than the cap of" in line or "over the cap of" in line, line
    assert line.endswith("what half this process's memory limit (its cgroup's) leaves beside the layer and the "
                         "files so far"), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("media", [GZIP_LAYER, ZSTD_LAYER])
def test_a_bomb_under_the_cap_but_over_the_memory_is_one_line(media: str, hostile: HostileRegistry, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """1 GiB of output, below the 2 GiB cap, in a process allowed 700 MiB more than it uses at rest."""
    bomb = _gzip_bomb(1 << 30) if media == GZIP_LAYER else _zstd_bomb(1 << 30)
    ref = hostile.image("m/hostile", [(bomb, media)])
    env = {**os.environ, "PACKER_REGISTRY_INSECURE": hostile.address, "PYTHONPATH": str(REPO)}
    limit = 700 << 20
    code = ("import resource, sys\n"
            "from packer.cli import main\n"
            "import packer.stream, packer.runtime.remote, packer.runtime.bundle_reader\n"
            "vm = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
            f"resource.setrlimit(resource.RLIMIT_AS, (vm + {limit}, vm + {limit}))\n"
            "sys.argv = ['packer', 'stream', sys.argv[1], '--dir', sys.argv[2]]\n"
            "main()\n")
    proc = subprocess.run([sys.executable, "-c", code, ref, str(tmp_path / "out")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "out of memory after" in lines[0] or "not enough memory" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def _memory_cgroup(limit: int) -> Path | None:
    """A new cgroup v1 memory cgroup below this process's, limited to ``limit`` bytes; None where
    this machine gives none (no v1 memory controller, not writable)."""
    from packer.runtime.reading import read_kernel_text

    for line in (read_kernel_text("/proc/self/cgroup") or "").splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            group = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / f"packer-test-{os.getpid()}"
            try:
                group.mkdir()
                (group / "memory.limit_in_bytes").write_text(str(limit))
            except OSError:
                return None
            return group
    return None


@pytest.mark.parametrize("media", [GZIP_LAYER, ZSTD_LAYER])
def test_a_bomb_in_a_container_under_its_memory_limit_is_one_line(media: str, hostile: HostileRegistry,
                                                                   tmp_path: Path) -> None:
    """A container's limit kills instead of raising MemoryError: 1 GiB of output, below the
    2 GiB cap, in a cgroup allowed 400 MiB, is refused in one line, not killed."""
    group = _memory_cgroup(400 << 20)
    if group is None:
        pytest.skip("no writable cgroup v1 memory controller here (the check reads v2 too)")
    try:
        bomb = _gzip_bomb(1 << 30) if media == GZIP_LAYER else _zstd_bomb(1 << 30)
        ref = hostile.image("m/hostile", [(bomb, media)])
        env = {**os.environ, "PACKER_REGISTRY_INSECURE": hostile.address, "PYTHONPATH": str(REPO)}
        code = ("import os, sys\n"
                "open(sys.argv[3] + '/cgroup.procs', 'w').write(str(os.getpid()))\n"
                "from packer.cli import main\n"
                "sys.argv = ['packer', 'stream', sys.argv[1], '--dir', sys.argv[2]]\n"
                "main()\n")
        proc = subprocess.run([sys.executable, "-c", code, ref, str(tmp_path / "out"), str(group)], env=env,
                              capture_output=True, text=True, timeout=120)
    finally:
        for _ in range(50):  # the child has exited; its charge leaves the group with it
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "decompresses to more than" in lines[0], lines[0]
    assert "half this process's memory limit (its cgroup's)" in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


# --- 5. the registry's words are escaped on every entry point ---


@pytest.fixture(scope="module")
def stub_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.built import build_dir
    from tests.hf_fixtures import llama

    tmp = tmp_path_factory.mktemp("stub")
    llama(tmp / "hf")
    build_dir(tmp / "hf", tmp / "out", image={"compression": "gzip"})
    return tmp / "out"


def test_a_reason_phrase_with_escapes_reaches_no_terminal_raw(hostile: HostileRegistry, stub_out: Path) -> None:
    evil = "Not Found \x1b]0;owned\x07\x1b[31mRED"
    ref = _small_image(hostile)
    hostile.routes[f"/v2/m/hostile/manifests/{ref.rpartition('@')[2]}"] = lambda h: h.answer(404, b"", reason=evil)
    env = {**os.environ, "PACKER_REGISTRY_INSECURE": hostile.address, "PACKER_STARTUP_LOG": "off",
           "PYTHONPATH": str(REPO)}
    for argv in ([sys.executable, str(stub_out / "packer_loader.py"), "--selftest", "--root", ref],
                 [sys.executable, str(stub_out / "packer_loader.py"), "--model-dir", "--root", ref],
                 [sys.executable, "-m", "packer", "stream", ref]):
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1, proc.stderr
        assert "\x1b" not in proc.stderr and "\x07" not in proc.stderr, (argv, proc.stderr)
        assert "404 Not Found \\x1b]0;owned\\x07\\x1b[31mRED" in proc.stderr, (argv, proc.stderr)


# --- 6. a connection reset before the answer is tried again, as documented (5 tries) ---


def test_a_reset_before_the_headers_is_retried_five_times(hostile: HostileRegistry,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _small_image(hostile)
    path = f"/v2/m/hostile/manifests/{ref.rpartition('@')[2]}"
    serve, resets = hostile.routes[path], list[int]()

    def flaky(h: Handler) -> None:
        if len(resets) < 4:
            resets.append(1)
            h.reset()
        else:
            serve(h)
    hostile.routes[path] = flaky
    monkeypatch.setenv("PACKER_REGISTRY_INSECURE", hostile.address)
    assert str(RemoteImage.fetch(ref).ref) == ref  # the fifth try answers
    hostile.routes[path] = lambda h: h.reset()
    with pytest.raises(RegistryError) as e:
        RemoteImage.fetch(ref)
    assert f"the image manifest: cannot reach {hostile.address} after 5 tries" in _one_line(e.value)


# --- 7. the environment, parsed strictly, once ---


def _raw(head: bytes, body_bytes: int = 0) -> Route:
    """A route writing ``head`` as it is (status line, headers, the body's start), then
    ``body_bytes`` of junk as long as the client reads; it counts what it sent in ``sent``."""
    def route(h: Handler) -> None:
        h.close_connection = True
        try:
            h.wfile.write(head)
            h.wfile.flush()
            block = b"x" * 65536
            while route.sent < body_bytes:  # type: ignore[attr-defined]
                h.wfile.write(block)
                route.sent += len(block)  # type: ignore[attr-defined]
        except OSError:
            pass
    route.sent = 0  # type: ignore[attr-defined]
    return route


def test_a_chunk_of_negative_size_reads_no_further(hostile: HostileRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    """``http.client`` reads a chunk sized "-1" to the end of the stream, past any cap asked:
    the answer is refused at that line, not after the 64 MiB the server goes on sending."""
    ref = _small_image(hostile)
    route = _raw(b"HTTP/1.1 200 OK\r\nContent-Type: application/vnd.oci.image.manifest.v1+json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n-1\r\n", 64 << 20)
    hostile.routes[f"/v2/m/hostile/manifests/{ref.rpartition('@')[2]}"] = route
    monkeypatch.setenv("PACKER_REGISTRY_INSECURE", hostile.address)
    with pytest.raises(RegistryError) as e:
        RemoteImage.fetch(ref)
    assert _one_line(e.value).endswith("the image manifest: the answer broke off after 0 bytes (HTTPException: "
                                       "the answer's chunked encoding names a negative chunk size)")
    time.sleep(0.5)
    assert route.sent < 16 << 20, route.sent  # type: ignore[attr-defined]


@pytest.mark.parametrize("what", ["the config", "an error's body", "the token answer"])
def test_an_answer_broken_off_mid_body_is_one_line(what: str, hostile: HostileRegistry,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunked body cut short is a RegistryError naming what was read, not http.client's IncompleteRead."""
    ref = _small_image(hostile)
    cut = _raw(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n100\r\nabc")
    doc = json.loads(hostile.manifest_bytes)
    if what == "the config":
        hostile.routes[f"/v2/m/hostile/blobs/{doc['config']['digest']}"] = cut
        said = f"blob {doc['config']['digest'][:19]}... ({doc['config']['size']} bytes): the answer broke off after"
    elif what == "an error's body":
        hostile.routes[f"/v2/m/hostile/manifests/{ref.rpartition('@')[2]}"] = _raw(
            b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n100\r\nabc")
        said = "the answer 404 to the image manifest: the answer broke off after"
    else:
        hostile.routes[f"/v2/m/hostile/manifests/{ref.rpartition('@')[2]}"] = _bearer(f"{hostile.url}/token")
        hostile.routes["/token"] = cut
        said = f"the token server {hostile.address}'s answer: the answer broke off after"
    monkeypatch.setenv("PACKER_REGISTRY_INSECURE", hostile.address)
    with pytest.raises(RegistryError) as e:
        RemoteImage.fetch(ref)
    assert said in _one_line(e.value), e.value


def _image_with(h: HostileRegistry, edit: dict[str, object], layer: dict[str, object] | None = None) -> str:
    """The small image, its manifest changed by ``edit`` (top-level keys) and its one layer's
    descriptor by ``layer``; served by its new digest."""
    _small_image(h)
    doc = json.loads(h.manifest_bytes)
    doc.update(edit)
    doc["layers"][0].update(layer or {})
    data = json.dumps(doc).encode()
    digest = "sha256:" + __import__("hashlib").sha256(data).hexdigest()
    h.routes[f"/v2/m/hostile/manifests/{digest}"] = lambda r: r.answer(
        200, data, {"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
    return f"oci://{h.address}/m/hostile@{digest}"


@pytest.mark.parametrize("size", [-2, "12", True, None])
def test_a_layer_size_that_is_no_count_of_bytes_is_refused_before_a_layer_is_fetched(
        size: object, hostile: HostileRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    """A size of -2 would reach ``read(-1)``: to the end of whatever the server sends."""
    ref = _image_with(hostile, {}, {"size": size})
    monkeypatch.setenv("PACKER_REGISTRY_INSECURE", hostile.address)
    with pytest.raises(RegistryError) as e:
        RemoteImage.fetch(ref)
    assert _one_line(e.value).endswith(f"the image manifest has a layer descriptor whose size is {size!r}, "
                                       "not a count of bytes")
    assert [p for p in hostile.paths() if "/blobs/" in p] == []


@pytest.mark.parametrize("edit", [{"config": "x"}, {"config": [1]}, {"annotations": ["x"]}, {"annotations": "x"}],
                         ids=["config a string", "config a list", "annotations a list", "annotations a string"])
def test_a_manifest_of_the_wrong_shape_is_one_line(edit: dict[str, object], hostile: HostileRegistry,
                                                   monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ref = _image_with(hostile, edit)
    monkeypatch.setenv("PACKER_REGISTRY_INSECURE", hostile.address)
    try:
        RemoteImage.fetch(ref).materialize(tmp_path / "d")  # annotations: the image's prefix, else /models
    except RegistryError as e:
        assert "config descriptor is malformed" in _one_line(e) or "annotations" not in edit, e
    else:
        assert "annotations" in edit and (tmp_path / "d" / "config.json").read_bytes() == b"{}"


def test_a_file_in_one_layer_and_a_folder_in_another_writes_nothing(
        hostile: HostileRegistry, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import tempfile

    ref = hostile.image("m/hostile", [(tar_gz({"0first": b"1", "a": b"x"}), GZIP_LAYER),
                                      (tar_gz({"a/b": b"y"}), GZIP_LAYER)])
    monkeypatch.setenv("PACKER_REGISTRY_INSECURE", hostile.address)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    image = RemoteImage.fetch(ref)
    for dest in (tmp_path / "d", None):
        with pytest.raises(RegistryError) as e:
            image.materialize(dest)
        assert _one_line(e.value).endswith(": a is a file in one layer and a folder in another")
    assert not (tmp_path / "d").exists() and list((tmp_path / "tmp").iterdir()) == []


def test_small_files_that_cannot_be_written_leave_nothing_behind(
        hostile: HostileRegistry, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ref = hostile.image("m/hostile", [(tar_gz({"config.json": b"{}", "z/deep": b"y"}), GZIP_LAYER)])
    monkeypatch.setenv("PACKER_REGISTRY_INSECURE", hostile.address)
    image = RemoteImage.fetch(ref)
    (tmp_path / "d").mkdir()
    real = os.open

    def refuse_deep(path: object, *args: object, **kwargs: object) -> int:
        if path == "deep":
            raise OSError(28, "No space left on device")
        return real(path, *args, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(os, "open", refuse_deep)
    with pytest.raises(RegistryError) as e:
        image.materialize(tmp_path / "d")
    assert _one_line(e.value).endswith(f"cannot write its small files into {tmp_path / 'd'}: No space left on device")
    assert list((tmp_path / "d").iterdir()) == []  # the given folder stays, emptied of what was written
    monkeypatch.undo()
    (tmp_path / "f").write_text("")
    with pytest.raises(RegistryError) as e:
        image.materialize(tmp_path / "f" / "d")  # under a file: no folder can be made
    assert _one_line(e.value).endswith(f"cannot make a folder for its small files ({tmp_path / 'f' / 'd'}): "
                                       "Not a directory")


@pytest.mark.parametrize(("var", "value"), [
    ("PACKER_REGISTRY_TIMEOUT", "inf"), ("PACKER_REGISTRY_TIMEOUT", "nan"), ("PACKER_REGISTRY_TIMEOUT", "-1"),
    ("PACKER_REGISTRY_TIMEOUT", "0"), ("PACKER_REGISTRY_TIMEOUT", "1e400"), ("PACKER_REGISTRY_TIMEOUT", "5s"),
    ("PACKER_REGISTRY_DEADLINE", "infinity"), ("PACKER_REGISTRY_MAX_REQUESTS", "-3"),
    ("PACKER_REGISTRY_MAX_REQUESTS", "1.5"), ("PACKER_STREAM_WHOLE", "yes"), ("PACKER_STREAM_WHOLE", "true"),
    ("PACKER_REGISTRY_INSECURE", "host/evil"), ("PACKER_REGISTRY_INSECURE", "a,,b"),
    ("PACKER_REGISTRY_CA", "ca.pem\n\x1b[2J"),
])
def test_a_registry_variable_that_is_no_value_is_one_line_naming_it(var: str, value: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(RegistryError) as e:
        RemoteImage.fetch("oci://127.0.0.1:1/m/x@sha256:" + "0" * 64)
    assert f"{var}: expected " in _one_line(e.value)


def test_a_bad_timeout_through_the_command_line_is_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PACKER_REGISTRY_TIMEOUT": "inf", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "packer", "stream", "oci://127.0.0.1:1/m/x@sha256:" + "0" * 64],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "PACKER_REGISTRY_TIMEOUT: expected seconds" in proc.stderr, proc.stderr


def test_registry_variables_are_read_in_settings_alone() -> None:
    for path in (REPO / "packer" / "runtime").glob("*.py"):
        if path.name != "settings.py":
            text = path.read_text()
            assert not re.search(r"environ(?:\.get)?\(?\[?[\"'](PACKER_REGISTRY_|PACKER_STREAM_WHOLE)", text), path
