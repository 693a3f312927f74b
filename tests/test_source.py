"""Sources: the deterministic demo, local paths, and hub repos read offline from the cache."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from packer.demo import write_demo
from packer.errors import SourceError
from packer.recipe import recipe_from_dict
from packer.source import hf_allow_patterns, parse_hf_uri, resolve_source
from tests.hf_cache import populate_cache

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"
DEMO_FILES = {"pytorch_model.bin", "config.json", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json"}


def _recipe(source: str, base: Path = Path("."), **sections: object):
    return recipe_from_dict({"name": "m", "version": "1", "source": source, **sections}, base_dir=base)


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in d.iterdir()}


def test_demo_is_deterministic_and_torch_reads_it(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    write_demo(a), write_demo(b)
    assert set(_digests(a)) == DEMO_FILES
    assert _digests(a) == _digests(b)
    size = (a / "pytorch_model.bin").stat().st_size
    assert 20e6 < size < 60e6  # "a few tens of MB"
    torch = pytest.importorskip("torch")
    sd = torch.load(a / "pytorch_model.bin", weights_only=True, mmap=True)  # oracle only
    emb, head = sd["model.embed_tokens.weight"], sd["lm_head.weight"]
    assert emb.dtype == torch.bfloat16 and emb.shape == (8192, 512)
    assert emb.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()  # tied
    assert torch.isfinite(emb.float()).all()


def test_demo_tokenizer_loads(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    write_demo(tmp_path)
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.encode("hello baba").ids[1] != 0


def test_demo_source_is_temporary() -> None:
    with resolve_source(_recipe("demo")) as snap:
        assert snap.kind == "demo" and (snap.root / "pytorch_model.bin").is_file()
        root = snap.root
    assert not root.exists()


def test_local_dir_and_file(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "w.pt").write_bytes(b"x")
    with resolve_source(_recipe("m", tmp_path)) as snap:
        assert snap.root == tmp_path / "m" and not snap.single_file and snap.identity()["uri"] == "m"
    with resolve_source(_recipe("m/w.pt", tmp_path)) as snap:
        assert snap.single_file and snap.weights == tmp_path / "m" / "w.pt"


def test_missing_local_source(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="'nope': .*does not exist"), resolve_source(_recipe("nope", tmp_path)):
        pass


@pytest.mark.parametrize("uri", ["hf://", "hf://a/b/c@x", "hf://org/name"])
def test_bad_hf_uris(uri: str) -> None:
    with pytest.raises(SourceError, match="hf://"):
        parse_hf_uri(uri)


@pytest.mark.parametrize(("uri", "reason"), [
    ("hf://acme/tiny@../../models--evil--other/snapshots/x", "neither a commit hash nor a branch"),
    ("hf://acme/tiny@main/.hidden", "neither a commit hash nor a branch"),
    ("hf://acme/tiny@v1.lock", "neither a commit hash nor a branch"),
    ("hf://acme/..@main", "not a hub repository id"),
    ("hf://acme--x/tiny@main", "not a hub repository id"),
])
def test_revision_and_repo_grammar(uri: str, reason: str) -> None:
    with pytest.raises(SourceError, match=reason):
        parse_hf_uri(uri)


def test_revision_forms_accepted() -> None:
    for rev in ("main", "v1.0", "refs/pr/1", COMMIT):
        assert parse_hf_uri(f"hf://acme/tiny@{rev}") == ("acme/tiny", rev)


def test_hf_offline_from_cache(tmp_path: Path) -> None:
    snap_dir = populate_cache(tmp_path, "acme/tiny", {"config.json": b"{}", "sub/x.txt": b"x"})
    with resolve_source(_recipe("hf://acme/tiny@main"), cache_dir=tmp_path) as snap:
        assert snap.kind == "hf" and snap.root == snap_dir
        assert snap.revision == "0123456789abcdef0123456789abcdef01234567"  # resolved commit
        assert (snap.root / "config.json").read_bytes() == b"{}"


def test_hf_offline_missing_revision_is_one_clear_line(tmp_path: Path) -> None:
    populate_cache(tmp_path, "acme/tiny", {"config.json": b"{}"})
    with pytest.raises(SourceError, match="not in the local cache.*HF_HUB_OFFLINE") as e, \
            resolve_source(_recipe("hf://acme/tiny@v9"), cache_dir=tmp_path):
        pass
    assert f"not in the local cache {tmp_path} " in str(e.value)  # names the cache it searched
    assert "hf download acme/tiny --revision v9" in str(e.value)


def test_allow_patterns_follow_the_recipe() -> None:
    r = _recipe("hf://a/b@main", weights={"files": ["*.bin"]}, bundle={"include": ["tok*.json"]})
    assert hf_allow_patterns(r) == ["*.bin", "tok*.json"]
    assert "*.safetensors" in hf_allow_patterns(_recipe("hf://a/b@main"))


@pytest.mark.parametrize("text", ["{commit}\n", "  {commit}\r\n", "{commit}"])
def test_ref_file_with_surrounding_whitespace(tmp_path: Path, text: str) -> None:
    """A cache copied between machines may carry a newline after the commit."""
    snap_dir = populate_cache(tmp_path, "acme/tiny", {"config.json": b"{}"})
    (tmp_path / "models--acme--tiny" / "refs" / "main").write_text(text.format(commit=COMMIT))
    with resolve_source(_recipe("hf://acme/tiny@main"), cache_dir=tmp_path) as snap:
        assert snap.root == snap_dir and snap.revision == COMMIT


@pytest.mark.parametrize("target", ["relative", "absolute", "garbage"])
def test_ref_file_holding_a_path_is_refused(tmp_path: Path, target: str) -> None:
    """refs/main naming another repository's snapshot must not build that model under this name."""
    populate_cache(tmp_path, "acme/tiny", {"config.json": b"{}"})
    other = populate_cache(tmp_path, "evil/other", {"config.json": b'{"evil": 1}'}, commit=OTHER)
    ref = tmp_path / "models--acme--tiny" / "refs" / "main"
    ref.write_text({"relative": f"../../models--evil--other/snapshots/{OTHER}", "absolute": str(other),
                    "garbage": "x" * 5000}[target])
    reason = rf"{re.escape(str(ref))} does not hold a commit hash .*download the model again"
    with pytest.raises(SourceError, match=reason), resolve_source(_recipe("hf://acme/tiny@main"), cache_dir=tmp_path):
        pass


def test_snapshot_folder_linked_to_another_repo_is_refused(tmp_path: Path) -> None:
    populate_cache(tmp_path, "acme/tiny", {"config.json": b"{}"})
    other = populate_cache(tmp_path, "evil/other", {"config.json": b"{}"}, commit=OTHER)
    (tmp_path / "models--acme--tiny" / "refs" / "main").write_text(OTHER)
    (tmp_path / "models--acme--tiny" / "snapshots" / OTHER).symlink_to(other)
    with pytest.raises(SourceError, match="the snapshot of hf://acme/tiny@main leads outside"), \
            resolve_source(_recipe("hf://acme/tiny@main"), cache_dir=tmp_path):
        pass


@pytest.fixture
def resetting_hub() -> Iterator[str]:
    """An HF_ENDPOINT whose every connection is reset after the request line (a proxy or a
    firewall cutting the reply), which huggingface_hub itself does not treat as offline."""
    with _faulty_hub("reset") as url:
        yield url


@pytest.mark.parametrize("revision", ["main", "v9"])
def test_a_reset_connection_to_the_hub_falls_back_to_the_cache(tmp_path: Path, resetting_hub: str,
                                                               revision: str) -> None:
    """Online (no HF_HUB_OFFLINE), a hub that resets the connection is no network: the cached
    snapshot builds; a revision the cache lacks is one line naming why, not a traceback."""
    populate_cache(tmp_path / "cache", "acme/tiny", {"config.json": b"{}", "pytorch_model.bin": b"x"})
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'name = "m"\nversion = "1"\nsource = "hf://acme/tiny@{revision}"\n')
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env |= {"HF_ENDPOINT": resetting_hub, "HF_HUB_CACHE": str(tmp_path / "cache")}
    code = ("import sys\nfrom packer.recipe import load_recipe\nfrom packer.source import resolve_source\n"
            "with resolve_source(load_recipe(sys.argv[1])) as snap:\n    print(snap.revision)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(recipe)], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    if revision == "main":
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == COMMIT
        return
    proc = subprocess.run([sys.executable, "-m", "packer", "build", str(recipe), "-o", str(tmp_path / "o"),
                           "--dry-run"], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: source hf://acme/tiny@v9: not in the local cache") and "ReadError" in line


def _serve_once(conn: socket.socket, fault: str, stop: threading.Event) -> None:
    conn.settimeout(2)
    if fault == "answers":  # main's commit is OTHER, its file list empty (the cache holds the files)
        request = b""
        with contextlib.suppress(OSError):
            request = conn.recv(65536)
        line = request.split(b"\r\n", 1)[0]
        body = b'{"id": "acme/tiny", "sha": "%s"}' % OTHER.encode() if b"/revision/main" in line else b"[]"
        status = "200 OK" if b"/revision/main" in line or b"/tree/" in line else "500 Oops"
        conn.sendall(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                     "Connection: close\r\n\r\n".encode() + body)
        return
    with contextlib.suppress(OSError):
        conn.recv(65536)
    if fault == "reset":
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
    elif fault == "truncated":  # promises 1000 bytes, sends a few, closes
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"sha\": \"01")
    elif fault in ("500", "404"):
        body = b'{"error": "boom"}'
        conn.sendall(f"HTTP/1.1 {fault} Oops\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                     "Connection: close\r\n\r\n".encode() + body)
    else:  # "silent": accepts, reads the request, never answers (until the test ends, 60 s at most)
        stop.wait(60)


@contextlib.contextmanager
def _faulty_hub(fault: str) -> Iterator[str]:
    """An HF_ENDPOINT on 127.0.0.1 answering every request with ``fault``; one thread per connection."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    stop = threading.Event()
    workers: list[threading.Thread] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue

            def handle(c: socket.socket = conn) -> None:
                with c:
                    _serve_once(c, fault, stop)

            workers.append(threading.Thread(target=handle, daemon=True))
            workers[-1].start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        for w in workers:
            w.join(5)
        srv.close()


def _hub_dry_run(tmp_path: Path, endpoint: str, *flags: str) -> subprocess.CompletedProcess[str]:
    import torch
    from safetensors.torch import save

    files = {"config.json": b"{}", "model.safetensors": save({"w": torch.ones(2)})}
    populate_cache(tmp_path / "cache", "acme/tiny", files)
    populate_cache(tmp_path / "cache", "acme/tiny", files, commit=OTHER, ref="other")  # what the hub calls main
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "m"\nversion = "1"\nsource = "hf://acme/tiny@main"\n')
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env |= {"HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_ETAG_TIMEOUT": "1"}
    return subprocess.run([sys.executable, "-m", "packer", "build", str(recipe), "-o", str(tmp_path / "o"),
                           "--dry-run", *(flags or ("--json",)), "--no-sandbox"], capture_output=True, text=True,
                          env=env, timeout=90, check=False)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["500", "reset"])
def test_a_quiet_build_prints_nothing_while_the_hub_fails(tmp_path: Path, fault: str) -> None:
    """``-q`` hides huggingface_hub's retry and warning lines too: a hub that fails leaves a quiet
    build of the cached commit silent, and quick (no retry back-off)."""
    import time

    t0 = time.monotonic()
    with _faulty_hub(fault) as endpoint:
        proc = _hub_dry_run(tmp_path, endpoint, "-q")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr  # stdout: the dry run's plan
    assert time.monotonic() - t0 < 30


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "why"), [("reset", "ReadError"), ("truncated", "RemoteProtocolError"),
                                            ("500", "the hub answered 500"), ("silent", "ReadTimeout")])
def test_a_hub_fault_builds_the_cached_commit_with_a_note_saying_so(tmp_path: Path, fault: str, why: str) -> None:
    """A hub that resets, cuts its reply short, fails or never answers (within HF_HUB_ETAG_TIMEOUT)
    leaves the cached commit of @main to build, and the --json summary's notes say which and why."""
    import json

    with _faulty_hub(fault) as endpoint:
        proc = _hub_dry_run(tmp_path, endpoint)
    assert proc.returncode == 0, proc.stderr
    notes = [n for n in json.loads(proc.stdout)["notes"] if n.startswith("source hf://acme/tiny@main")]
    assert len(notes) == 1, notes
    assert f"built the cached commit {COMMIT}" in notes[0] and "'main'" in notes[0] and why in notes[0]


def test_a_hub_that_says_no_such_revision_is_not_overruled_by_the_cache(tmp_path: Path) -> None:
    with _faulty_hub("404") as endpoint:
        proc = _hub_dry_run(tmp_path, endpoint)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: source hf://acme/tiny@main: ") and "404" in line


def test_the_hubs_commit_is_built_and_remembered_without_a_note(tmp_path: Path) -> None:
    """A hub that names another commit for main than the cache's refs/main wins, and refs/main follows it."""
    import json

    with _faulty_hub("answers") as endpoint:
        proc = _hub_dry_run(tmp_path, endpoint)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert f'"revision": "{OTHER}"' in proc.stdout
    assert not [n for n in summary["notes"] if n.startswith("source hf://")]
    assert (tmp_path / "cache" / "models--acme--tiny" / "refs" / "main").read_text() == OTHER
