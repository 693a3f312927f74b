"""The streamed load (packer/runtime/remote.py, registry.py): a build's weights read from its image
in a real registry (Debian's docker-registry on loopback), every chunk proven as it arrives.

One open registry holds the pushed builds; the registries behind htpasswd (over TLS with the
test's own CA) and behind a token server serve the same storage directory, so a build is
pushed once.
"""

from __future__ import annotations

import base64
import gc
import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hypothesis
import hypothesis.strategies as st
import pytest
import torch

from packer.oci.push import push
from packer.runtime.chunks import FileChunks, pieces
from packer.runtime.place import FilePlace
from packer.runtime.registry import RegistryError, parse_ref
from packer.runtime.remote import REQUEST, RemoteFile, RemoteImage
from tests.built import build_dir, open_build
from tests.hf_fixtures import llama
from tests.registry_fixtures import LoopbackCA, Proxy, TokenServer, blob_file, docker_registry, htpasswd_line
from tests.test_chunks import _ranks
from tests.test_tp import WIDE

REPO = Path(__file__).resolve().parents[1]
WEIGHTS = "weights/model.safetensors"
CHUNK = 32 * 1024
pytestmark = pytest.mark.skipif(shutil.which("skopeo") is None, reason="tool: skopeo is not installed")


@dataclass
class Pushed:
    """The open registry, its storage, and the builds pushed to it: ``{name: (OUT, digest)}``."""

    address: str
    data: Path
    builds: dict[str, tuple[Path, str]]

    def ref(self, name: str, address: str | None = None) -> str:
        return f"oci://{address or self.address}/models/{name}@{self.builds[name][1]}"


def stub(out: Path) -> Any:
    """The emitted ``packer_loader.py`` of ``out``, imported under a name of its own."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"packer_loader_{uuid.uuid4().hex[:8]}", out / "packer_loader.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def pushed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pushed]:
    tmp = tmp_path_factory.mktemp("stream")
    llama(tmp / "hf", **{**WIDE, "tied": False})  # 4 layers of width 512: 6.8 MB in bf16
    builds = {"plain": build_dir(tmp / "hf", tmp / "plain", weights={"chunk_size": "32KiB"}),
              "sharded": build_dir(tmp / "hf", tmp / "sharded",
                                   weights={"chunk_size": "32KiB", "max_shard_size": "2MB"})}
    assert len(json.loads((tmp / "sharded/manifest.json").read_bytes())["weights"]["files"]) >= 3
    with docker_registry(tmp / "registry") as address:
        digests = {name: push(tmp / name, f"{address}/models/{name}:1", tls_verify=False)[f"{address}/models/{name}:1"]
                   for name in builds}
        yield Pushed(address, tmp / "registry" / "registry-data", {n: (tmp / n, d) for n, d in digests.items()})


@pytest.fixture(autouse=True)
def _streaming_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Plain HTTP for loopback registries, no auth file of the machine's, a private temp dir."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var in ("PACKER_REGISTRY_INSECURE", "REGISTRY_AUTH_FILE", "XDG_RUNTIME_DIR", "DOCKER_CONFIG",
                "PACKER_REGISTRY_AUTH", "PACKER_REGISTRY_CA", "PACKER_STREAM_WHOLE", "PACKER_ARTIFACTS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PACKER_STARTUP_LOG", "off")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return tmp_path / "tmp"


def insecure(monkeypatch: pytest.MonkeyPatch, *addresses: str) -> None:
    monkeypatch.setenv("PACKER_REGISTRY_INSECURE", ",".join(addresses))


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in key order."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k].contiguous()
        h.update(f"{k}{t.dtype}{list(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def stage(pl: Any, name: str) -> dict[str, Any]:
    return [s for s in pl.report() if s["stage"] == name][-1]


def test_a_streamed_load_is_bitwise_the_local_build_and_writes_no_weight_byte(
        pushed: Pushed, monkeypatch: pytest.MonkeyPatch, _streaming_env: Path) -> None:
    insecure(monkeypatch, pushed.address)
    out, _ = pushed.builds["plain"]
    pl = stub(out)
    local = pl.load_weights("cpu", root=out)
    streamed = pl.load_weights("cpu", root=pushed.ref("plain"))
    assert equal(streamed, local)
    fetched = stage(pl, "fetch (registry, proven)")
    size = json.loads((out / "manifest.json").read_bytes())["files"][WEIGHTS]["size"]
    assert size <= fetched["bytes"] <= size + CHUNK  # each byte once (the header's chunk again at most)
    ringed = pl.load_weights("cpu", root=pushed.ref("plain"), pipeline=True)  # the CUDA path's scheduling
    assert equal(ringed, local)
    # nothing of the weights on disk: the small files only, in one private directory
    (made,) = list(_streaming_env.iterdir())
    files = [p for p in made.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < size / 4
    assert not any(p.suffix == ".safetensors" for p in files)
    assert (made / "config.json").is_file() and (made / "packer_loader.py").is_file()
    assert oct(made.stat().st_mode & 0o777) == "0o700"


def test_from_pretrained_streams_the_same_model(pushed: Pushed, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    insecure(monkeypatch, pushed.address)
    out, _ = pushed.builds["plain"]
    pl = stub(out)
    ids = torch.tensor([[1, 5, 9, 200, 33]])
    with torch.no_grad():
        want = pl.from_pretrained(AutoModelForCausalLM, device="cpu", root=out)(ids).logits
        got = pl.from_pretrained(AutoModelForCausalLM, device="cpu", root=pushed.ref("plain"))(ids).logits
        # load_into a module built without memory: its parameters filled from the registry
        from transformers import AutoConfig

        with pl.init_empty(dtype=torch.bfloat16):
            module = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(pl.bundle_dir(root=out)))
        pl.load_into(module, root=pushed.ref("plain"), device="cpu")
        into = module.eval()(ids).logits
    assert torch.equal(got, want)
    assert torch.equal(into, want)
    assert pl.model_dir(root=pushed.ref("plain")).joinpath("packer-stream.json").is_file()


def test_a_sharded_build_streams_bitwise(pushed: Pushed, monkeypatch: pytest.MonkeyPatch) -> None:
    insecure(monkeypatch, pushed.address)
    out, _ = pushed.builds["sharded"]
    pl = stub(out)
    assert equal(pl.load_weights("cpu", root=pushed.ref("sharded")), pl.load_weights("cpu", root=out))


@pytest.mark.parametrize("build", ["plain", "sharded"])
def test_a_lazily_proven_stream_is_bitwise_in_every_tensor(build: str, pushed: Pushed,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``proven=True`` (chunks fetched when first used, as vLLM's loaders use them): every tensor,
    used after the load returned, holds the build's bytes, not only those fetched at load time."""
    insecure(monkeypatch, pushed.address)
    out, _ = pushed.builds[build]
    pl = stub(out)
    local = pl.load_weights("cpu", root=out)
    streamed = pl.load_weights("cpu", root=pushed.ref(build), proven=True)
    assert {type(t).__name__ for t in streamed.values()} == {"Proven"}
    gc.collect()  # only the tensors hold the buffers now
    assert equal(streamed, local)
    copied = {k: torch.empty_like(t).copy_(t) for k, t in pl.load_weights("cpu", root=pushed.ref(build),
                                                                          proven=True).items()}
    assert equal(copied, local)


def test_a_tag_is_resolved_once_and_reported(pushed: Pushed, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    insecure(monkeypatch, pushed.address)
    out, digest = pushed.builds["plain"]
    pl = stub(out)
    assert equal(pl.load_weights("cpu", root=f"oci://{pushed.address}/models/plain:1"),
                 pl.load_weights("cpu", root=out))
    err = capsys.readouterr().err
    assert f"oci://{pushed.address}/models/plain:1 resolved to {digest}; pin it: " in err


def test_another_builds_image_is_refused_in_one_line(pushed: Pushed, monkeypatch: pytest.MonkeyPatch) -> None:
    insecure(monkeypatch, pushed.address)
    pl = stub(pushed.builds["plain"][0])
    with pytest.raises(pl.ArtifactMismatchError, match="the image holds another build than this loader's") as e:
        pl.load_weights("cpu", root=pushed.ref("sharded"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["oci://127.0.0.1:5000/m", "oci://Host/UPPER@sha256:" + "a" * 64,
                                  "oci://127.0.0.1:5000/m@md5:" + "a" * 32, "oci://h.example/m@sha256:" + "A" * 64])
def test_what_is_no_pinned_reference_is_refused(text: str) -> None:
    with pytest.raises(RegistryError) as e:
        parse_ref(text)
    assert "\n" not in str(e.value)


def test_an_upper_case_repository_is_told_to_be_lower_case() -> None:
    with pytest.raises(RegistryError) as e:
        parse_ref("oci://Registry.example.com:5000/Team/Model:V1")
    assert "write the repository (and a digest's hex) in lower case" in str(e.value)
    assert parse_ref("oci://Registry.example.com:5000/team/model:V1").tag == "V1"  # host and tag may


def test_a_missing_tag_is_named_as_a_tag(pushed: Pushed, monkeypatch: pytest.MonkeyPatch) -> None:
    insecure(monkeypatch, pushed.address)
    with pytest.raises(RegistryError) as e:
        RemoteImage.fetch(f"oci://{pushed.address}/models/plain:no-such-tag")
    assert "has no tag no-such-tag (check the tag `packer push` was given" in str(e.value)


def test_the_runtime_and_push_share_one_reference_grammar() -> None:
    from packer.oci import registry_ref
    from packer.runtime import registry

    assert registry_ref.REF is registry.REF


def test_a_flipped_blob_byte_in_the_registry_is_refused_in_one_line(pushed: Pushed, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    out, _ = pushed.builds["plain"]
    entry = json.loads((out / "manifest.json").read_bytes())["files"][WEIGHTS]
    blob = "sha256:" + entry["blob"].rpartition("/")[2]
    shutil.copytree(pushed.data, tmp_path / "registry" / "registry-data")
    at = entry["offset"] + entry["size"] // 2  # the middle of the weight file
    data = blob_file(tmp_path / "registry" / "registry-data", blob)
    raw = bytearray(data.read_bytes())
    raw[at] ^= 0x01
    data.write_bytes(raw)
    with docker_registry(tmp_path / "registry") as address:
        insecure(monkeypatch, address)
        pl = stub(out)
        with pytest.raises(pl.ArtifactMismatchError) as e:
            pl.load_weights("cpu", root=pushed.ref("plain", address))
    fc = open_build(out).chunk_table()[WEIGHTS]  # chunks cut at the tensors and the ranks' splits
    chunk = fc.holding(entry["size"] // 2)
    a, b = fc.bounds(chunk)
    text = str(e.value)
    assert "\n" not in text
    assert f"{WEIGHTS}: chunk {chunk} (bytes [{a}, {b})" in text, text
    assert "the registry's copy is corrupt or not this build's" in text


def test_a_dropped_connection_resumes(pushed: Pushed, monkeypatch: pytest.MonkeyPatch) -> None:
    out, _ = pushed.builds["plain"]
    proxy = Proxy(pushed.address, drop_after=100_000, drops=4)
    try:
        insecure(monkeypatch, proxy.address)
        pl = stub(out)
        got = pl.load_weights("cpu", root=pushed.ref("plain", proxy.address))
    finally:
        proxy.close()
    assert proxy.dropped == 4
    assert equal(got, pl.load_weights("cpu", root=out))
    assert stage(pl, "fetch (registry, proven)")["resumed"] >= 4


def test_a_registry_that_ignores_range_is_read_in_one_pass_or_whole_blobs(pushed: Pushed,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Every blob answered whole (HTTP 200) whatever the Range: read once, in order, each chunk
    proven, and said (tests/test_stream_cache.py: the pull-through cache this stands for)."""
    out, _ = pushed.builds["plain"]
    size = json.loads((out / "manifest.json").read_bytes())["files"][WEIGHTS]["size"]
    proxy = Proxy(pushed.address, strip_range=True)
    try:
        insecure(monkeypatch, proxy.address)
        pl = stub(out)
        got = pl.load_weights("cpu", root=pushed.ref("plain", proxy.address))
        fetch = stage(pl, "fetch (registry, proven)")
        assert fetch["range_ignored"] == 1 and size <= fetch["bytes"] <= 1.10 * size, fetch
        assert "the registry ignored Range for 1 blob(s)" in capsys.readouterr().err
        ringed = pl.load_weights("cpu", root=pushed.ref("plain", proxy.address), pipeline=True)
        monkeypatch.setenv("PACKER_STREAM_WHOLE", "1")
        pl = stub(out)
        whole = pl.load_weights("cpu", root=pushed.ref("plain", proxy.address))
    finally:
        proxy.close()
    local = pl.load_weights("cpu", root=out)
    assert equal(got, local) and equal(ringed, local) and equal(whole, local)
    assert "whole into memory (PACKER_STREAM_WHOLE=1)" in capsys.readouterr().err


def _auth_file(path: Path, host: str, user: str, password: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"auths": {host: {"auth": base64.b64encode(f"{user}:{password}".encode()).decode()}}}))
    return path


def test_htpasswd_over_tls_with_the_registrys_own_ca(pushed: Pushed, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    out, _ = pushed.builds["plain"]
    ca = LoopbackCA(tmp_path / "ca")
    (tmp_path / "registry").mkdir()
    os.symlink(pushed.data, tmp_path / "registry" / "registry-data")  # the same storage, another front
    with docker_registry(tmp_path / "registry", htpasswd=htpasswd_line("ci", "s3cret"), tls=ca) as address:
        pl = stub(out)
        ref = pushed.ref("plain", address)
        with pytest.raises(pl.ArtifactMismatchError, match="TLS certificate of .* not trusted") as e:
            pl.load_weights("cpu", root=ref)
        assert "PACKER_REGISTRY_CA" in str(e.value)
        monkeypatch.setenv("PACKER_REGISTRY_CA", str(ca.ca))
        with pytest.raises(pl.ArtifactMismatchError, match="asks for credentials; put credentials") as e:
            pl.load_weights("cpu", root=ref)
        monkeypatch.setenv("REGISTRY_AUTH_FILE", str(_auth_file(tmp_path / "bad.json", address, "ci", "wrong")))
        with pytest.raises(pl.ArtifactMismatchError, match="the credentials found for it are refused"):
            pl.load_weights("cpu", root=ref)
        # podman's auth file: a Kubernetes pull secret's .dockerconfigjson has the same shape
        _auth_file(tmp_path / "xdg" / "containers" / "auth.json", address, "ci", "s3cret")
        monkeypatch.delenv("REGISTRY_AUTH_FILE")
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
        got = pl.load_weights("cpu", root=ref)
    assert equal(got, pl.load_weights("cpu", root=out))


def test_a_bearer_token_registry(pushed: Pushed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out, _ = pushed.builds["plain"]
    tokens = TokenServer(tmp_path, "ci", "t0ken-pass")
    (tmp_path / "registry").mkdir()
    os.symlink(pushed.data, tmp_path / "registry" / "registry-data")
    try:
        with docker_registry(tmp_path / "registry", token=tokens) as address:
            # its realm is plain HTTP too: credentials go there only as it is listed (registry_hostile.py)
            insecure(monkeypatch, address, tokens.realm.split("/")[2])
            pl = stub(out)
            ref = pushed.ref("plain", address)
            with pytest.raises(pl.ArtifactMismatchError, match="the token server 127.0.0.1:[0-9]+ answered 401"):
                pl.load_weights("cpu", root=ref)
            monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))  # docker's config.json
            _auth_file(tmp_path / "docker" / "config.json", address, "ci", "t0ken-pass")
            got = pl.load_weights("cpu", root=ref)
    finally:
        tokens.close()
    assert tokens.issued >= 1 and tokens.refused >= 1
    assert equal(got, pl.load_weights("cpu", root=out))


# --- tensor parallel: each rank fetches its share, proven ---


def _tp_work(out: Path, tmp: Path, ref: str, address: str) -> Path:
    for r in range(2):
        shutil.copytree(out, tmp / f"rank{r}" / "out", symlinks=True, ignore=shutil.ignore_patterns("image"))
    os.environ["PACKER_TEST_ROOT"], os.environ["PACKER_REGISTRY_INSECURE"] = ref, address
    return tmp


@pytest.fixture
def _tp_env() -> Iterator[None]:
    yield
    os.environ.pop("PACKER_TEST_ROOT", None)


@pytest.mark.slow
def test_two_streamed_ranks_fetch_their_share(pushed: Pushed, tmp_path: Path, _tp_env: None) -> None:
    out, _ = pushed.builds["plain"]
    ours = _ranks(_tp_work(out, tmp_path, pushed.ref("plain"), pushed.address))
    size = json.loads((out / "manifest.json").read_bytes())["files"][WEIGHTS]["size"]
    for r in range(2):
        assert ours[r]["error"] == "", ours[r]["error"]
        share = ours[r]["sharded"] / 2 + ours[r]["replicated"]
        # issue 51: chunks cut at the ranks' splits, a rank fetches its share and its header
        assert share <= ours[r]["hashed"] <= 1.05 * share, (r, ours[r]["hashed"], share)
        print(f"rank {r}: fetched {ours[r]['hashed']} bytes; share {share:.0f} ({ours[r]['hashed'] / share:.3f}x), "
              f"file {size}")
    assert torch.equal(ours[0]["logits"], ours[1]["logits"])


@pytest.mark.slow
def test_a_flipped_byte_is_refused_by_the_streaming_rank_that_fetches_it(pushed: Pushed, tmp_path: Path,
                                                                         _tp_env: None) -> None:
    from tests.test_chunks import _rank1_first

    out, _ = pushed.builds["plain"]
    entry = json.loads((out / "manifest.json").read_bytes())["files"][WEIGHTS]
    shutil.copytree(pushed.data, tmp_path / "registry" / "registry-data")
    data = blob_file(tmp_path / "registry" / "registry-data", "sha256:" + entry["blob"].rpartition("/")[2])
    at = _rank1_first(out, "model.layers.3.mlp.gate_proj.weight")  # rank 0's span ends just before it
    raw = bytearray(data.read_bytes())
    raw[entry["offset"] + at] ^= 0x01
    data.write_bytes(raw)
    with docker_registry(tmp_path / "registry") as address:
        ours = _ranks(_tp_work(out, tmp_path / "work", pushed.ref("plain", address), address))
    chunk = open_build(out).chunk_table()[WEIGHTS].holding(at)
    assert ours[1]["error"].startswith("mismatch: "), ours[1]
    assert f"{WEIGHTS}: chunk {chunk} (bytes [{at}, " in ours[1]["error"], ours[1]
    assert "on rank 1 of 2; the registry's copy is corrupt" in ours[1]["error"]
    assert not ours[0]["error"].startswith("mismatch"), ours[0]["error"]


_CHILD = """
import multiprocessing, sys
sys.path.insert(0, sys.argv[1])
import packer_loader


def load(ref):
    assert len(packer_loader.load_weights("cpu", root=ref)) > 0


if __name__ == "__main__":
    import os, tempfile

    load(sys.argv[2])  # this process's private directory first: a forked child inherits its clean-up
    p = multiprocessing.get_context(sys.argv[3]).Process(target=load, args=(sys.argv[4],))  # a directory of its own
    p.start()
    p.join()
    left = os.listdir(tempfile.gettempdir())
    assert len(left) == 1, f"after the child: {left} (the parent's alone, the child's gone)"
    sys.exit(p.exitcode)
"""


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_every_process_that_streams_removes_its_small_files(pushed: Pushed, tmp_path: Path, method: str) -> None:
    """A multiprocessing child (a TP rank, an engine's worker) ends without running ``atexit``: the
    private copy of the image's small files it fetched is removed all the same, and a forked child
    never removes its parent's."""
    out, _ = pushed.builds["plain"]
    (tmp_path / "child.py").write_text(_CHILD)  # tmp_path / "tmp": made by _streaming_env
    env = {**os.environ, "PACKER_REGISTRY_INSECURE": pushed.address, "TMPDIR": str(tmp_path / "tmp")}
    by_tag = f"oci://{pushed.address}/models/plain:1"  # the same image: another loader's key
    got = subprocess.run([sys.executable, str(tmp_path / "child.py"), str(out), pushed.ref("plain"), method, by_tag],
                         capture_output=True, text=True, env=env, check=False)
    assert got.returncode == 0, got.stderr[-2000:]
    assert list((tmp_path / "tmp").iterdir()) == []


def test_the_stream_command_lays_out_a_model_directory(pushed: Pushed, tmp_path: Path) -> None:
    out, _ = pushed.builds["plain"]
    env = {**os.environ, "PACKER_REGISTRY_INSECURE": pushed.address}
    dest = tmp_path / "model"
    proc = subprocess.run([sys.executable, "-m", "packer", "stream", pushed.ref("plain"), "--dir", str(dest)],
                          capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(dest)
    assert json.loads((dest / "packer-stream.json").read_text()) == {"ref": pushed.ref("plain")}
    assert not list(dest.glob("*.safetensors"))
    # the directory's own loader streams (what the vLLM load format runs)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import packer_loader as pl, torch; "
            "t = pl.load_weights('cpu'); print(sys.modules['tests.test_stream'].digest(t))")
    got = subprocess.run([sys.executable, "-c", "import tests.test_stream; " + code, str(dest)],
                         capture_output=True, text=True, env={**env, "PYTHONPATH": str(REPO)}, check=False)
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.split()[-1] == digest(stub(out).load_weights("cpu", root=out))
    bad = subprocess.run([sys.executable, "-m", "packer", "stream", "oci://127.0.0.1:1/m:1", "--dir",
                          str(tmp_path / "x")], capture_output=True, text=True, env=env, check=False)
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert not (tmp_path / "x").exists()


def test_a_stream_file_planted_beside_local_weights_diverts_nothing(pushed: Pushed, tmp_path: Path) -> None:
    """Trust by proof, not by a file beside: a build directory that holds its weights loads them,
    whatever ``packer-stream.json`` a writer put there (no request goes out)."""
    out, _ = pushed.builds["plain"]
    planted = tmp_path / "out"
    shutil.copytree(out, planted, symlinks=True)
    (planted / "packer-stream.json").write_text(json.dumps({"ref": "oci://127.0.0.1:9/evil@sha256:" + "0" * 64}))
    pl = stub(planted)
    assert equal(pl.load_weights("cpu"), stub(out).load_weights("cpu", root=out))
    assert not [s for s in pl.report() if s["stage"].startswith("fetch")]


@pytest.mark.slow
def test_a_streamed_directory_checks_itself(pushed: Pushed, tmp_path: Path) -> None:
    """What a new user does next with a streamed directory: the self-test (in it, and of an
    ``oci://`` root), ``packer verify``'s answer; the private directory of a ``root="oci://..."``
    load is gone when its process ends; the signed serving gate leaves ``packer-stream.json``
    to the loader (it names where bytes come from, each proven)."""
    from packer.adapters.gate import _never_read

    out, _ = pushed.builds["plain"]
    env = {**os.environ, "PACKER_REGISTRY_INSECURE": pushed.address, "TMPDIR": str(tmp_path / "tmp")}
    dest = tmp_path / "model"
    made = subprocess.run([sys.executable, "-m", "packer", "stream", pushed.ref("plain"), "--dir", str(dest)],
                          capture_output=True, text=True, env=env, check=False)
    assert made.returncode == 0, made.stderr
    for args in ([str(dest / "packer_loader.py"), "--selftest"],
                 [str(out / "packer_loader.py"), "--selftest", "--root", pushed.ref("plain")]):
        r = subprocess.run([sys.executable, *args], capture_output=True, text=True, check=False, env=env)
        assert r.returncode == 0 and "self-test passed" in r.stderr, r.stderr[-2000:]
    assert not list((tmp_path / "tmp").iterdir())  # the oci:// root's private copy, removed at exit
    assert _never_read("packer-stream.json", "bundle.tar.zst")  # not a file the engine reads
    v = subprocess.run([sys.executable, "-m", "packer", "verify", str(dest)], capture_output=True, text=True,
                       env=env, check=False)
    assert v.returncode == 1 and "a model directory `packer stream` made, not a build output" in v.stderr


def test_the_wrong_digest_says_which_one_to_stream(pushed: Pushed, monkeypatch: pytest.MonkeyPatch) -> None:
    insecure(monkeypatch, pushed.address)
    pl = stub(pushed.builds["plain"][0])
    view = _manifest_digest(pushed.address, "models/plain", "1-modelpack")  # the second digest push prints
    with pytest.raises(pl.ArtifactMismatchError, match="not a runnable image .*the ModelPack view.*first one "):
        pl.load_weights("cpu", root=f"oci://{pushed.address}/models/plain@{view}")
    with pytest.raises(pl.ArtifactMismatchError, match="has no such image .*first one `packer push` prints"):
        pl.load_weights("cpu", root=f"oci://{pushed.address}/models/plain@sha256:" + "1" * 64)


def _manifest_digest(address: str, repo: str, tag: str) -> str:
    """The digest of the manifest ``repo:tag`` holds (as the registry serves it)."""
    import urllib.request

    req = urllib.request.Request(f"http://{address}/v2/{repo}/manifests/{tag}",
                                 headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return "sha256:" + hashlib.sha256(r.read()).hexdigest()


@pytest.mark.parametrize("digest", ["sha256:../../v2/_catalog", "sha256:" + "A" * 64, "md5:" + "0" * 32, 7])
def test_a_blob_digest_from_the_manifest_is_checked_before_it_names_a_request(digest: object) -> None:
    from packer.runtime.registry import Registry

    reg = Registry(parse_ref("oci://127.0.0.1:9/m@sha256:" + "0" * 64), auth=("u", "p"))
    with pytest.raises(RegistryError, match="not sha256:<64 hex>") as e:
        reg.blob(digest, 10)  # type: ignore[arg-type]
    assert "\n" not in str(e.value)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(chunk=st.sampled_from([1, 4096, 1 << 20, 3 << 20, REQUEST + 1]), size=st.integers(1, 1 << 30),
                  offset=st.integers(0, 1 << 20).map(lambda p: p * 4096), cut=st.booleans(), data=st.data())
def test_a_bulk_streamed_read_is_cut_into_requests_on_the_chunk_grid(chunk: int, size: int, offset: int, cut: bool,
                                                                      data: st.DataObject) -> None:
    """Every byte in exactly one request; every cut on a chunk's start (the fixed grid of a v1
    table, or a v2 table's chunks cut at the ranks' splits), so no chunk is fetched by two
    requests; no request over REQUEST bytes (and a chunk, where a cut moved back to one's start)
    unless one chunk is (then one chunk each)."""
    lo = data.draw(st.integers(0, size - 1))
    n = data.draw(st.integers(1, size - lo))
    cuts = sorted(data.draw(st.sets(st.integers(1, size - 1), max_size=30))) if cut and size > 1 else []
    fc = FileChunks(chunk, size, "0" * 64, "", *pieces(size, chunk, cuts)[:2])
    place = FilePlace("weights/model.safetensors", size, "0" * 64, "image/blobs/sha256/" + "0" * 64, offset)
    rf = RemoteFile(types.SimpleNamespace(ref="oci://h/r"), place, fc)  # type: ignore[arg-type]  # no registry: spans fetches nothing
    spans = rf.spans(offset + lo, n)
    assert [s for s, _ in spans] == [0, *itertools.accumulate(k for _, k in spans[:-1])]
    assert sum(k for _, k in spans) == n and all(k > 0 for _, k in spans)
    assert all(fc.bounds(fc.holding(lo + s))[0] == lo + s for s, _ in spans[1:])
    assert all(k <= max(REQUEST, chunk) + (chunk if cuts else 0) for _, k in spans)
    assert len(spans) <= n // max(REQUEST // chunk, 1) // chunk + 2
