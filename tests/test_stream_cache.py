"""The streamed load through what fleets put in front of a registry (packer/runtime/blob_reader.py):
a pull-through cache (Debian's docker-registry in proxy mode, in front of the registry `packer push`
wrote to), whose cold answer to a ``Range`` request is the whole blob (HTTP 200), and a registry
whose blobs redirect to object storage on another host.
"""

from __future__ import annotations

import base64
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from tests import test_stream
from tests.registry_fixtures import blob_file, docker_registry
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
