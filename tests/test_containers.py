"""The image as a runtime and a cluster use it: real containers (podman with runc, buildah).

A base is built from Debian packages (mmdebstrap: python3; pip, offline, in its chroot: torch
CPU, zstandard, safetensors, transformers), the demo is built onto it with ``image.base``, and
the result runs: with no command, with the loader as the command, as a non-root user in group 0
on a read-only root, and mounted read-only as an image volume into a second container that
loads ``/models`` with the safetensors library and transformers. buildah builds
``OUT/Dockerfile`` and ``Dockerfile.runtime`` on the same local bases.

Opt-in (``pytest -m containers``, run by ``.ci/run``); about 10 minutes, most of it the base.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from packer.building import build
from packer.oci.modelpack import modelpack_tag
from packer.recipe import demo_recipe
from packer.runtime.bundle_reader import Bundle
from tests.built import weight_bytes
from tests.containers import ROOT, Podman, add_layer, build_base, download_wheels, require_root_tools, sh, torch_pin

pytestmark = pytest.mark.containers
TOOLS = ("mmdebstrap", "umoci", "skopeo", "podman", "runc", "buildah")
IMAGE = "localhost/packer-demo:0.1.0"
ZSTD = "zstandard==0.25.0"
# what the second container prints: every file's sha256, the tensors, the logits if it can
PROBE = r"""
import hashlib, json, os, sys, torch
from safetensors.torch import load_file
d = sys.argv[1]
files = {n: hashlib.sha256(open(os.path.join(d, n), "rb").read()).hexdigest()
         for n in sorted(os.listdir(d)) if os.path.isfile(os.path.join(d, n))}
tensors = load_file(os.path.join(d, "model.safetensors"))
out = {"files": files, "tensors": {k: [str(v.dtype), list(v.shape)] for k, v in sorted(tensors.items())}}
try:
    from transformers import AutoModelForCausalLM
except ImportError:
    out["logits"] = None
else:
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    with torch.no_grad():
        out["logits"] = m(torch.arange(1, 17).unsqueeze(0)).logits[0, -1].tolist()
print(json.dumps(out))
"""


@pytest.fixture(scope="session")
def bases(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``layout:base`` (the runtime) and ``layout:build`` (plus /wheels for Dockerfile.runtime's build stage)."""
    require_root_tools(*TOOLS)
    reuse = os.environ.get("PACKER_TEST_BASE_LAYOUT")  # a layout an earlier session built (local re-runs)
    if reuse and (Path(reuse) / "index.json").is_file():
        return Path(reuse)
    work = tmp_path_factory.mktemp("base")
    wheels = work / "wheels"
    download_wheels(wheels, torch_pin(), ZSTD, "safetensors", "numpy", "transformers")
    layout = build_base(work, wheels, [torch_pin(), ZSTD, "safetensors", "numpy", "transformers"])
    build_wheels = work / "build-wheels" / "wheels"
    download_wheels(build_wheels, "click", "huggingface-hub", "tqdm", "setuptools>=77", "wheel")
    for w in wheels.iterdir():  # everything but torch, which the base has installed
        if not w.name.startswith("torch-"):
            shutil.copy2(w, build_wheels / w.name)
    add_layer(layout, "base", "build", build_wheels.parent, "/")
    return layout


@pytest.fixture(scope="module")
def demo_out(bases: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "out"
    recipe = demo_recipe()
    build(replace(recipe, image=replace(recipe.image, base=f"oci:{bases}:base")), out)
    return out


@pytest.fixture(scope="module")
def podman(demo_out: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    p = Podman(tmp_path_factory.mktemp("podman"))
    try:
        p.load(f"oci:{demo_out / 'image'}:packer-demo:0.1.0", IMAGE)
        yield p
    finally:
        p.close()


def _passed(proc: Any) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "packer_loader: self-test passed" in proc.stderr, proc.stderr[-3000:]
    return str(proc.stderr)


def test_runs_the_self_test_with_no_command(podman: Podman) -> None:
    err = _passed(podman.run(IMAGE))
    assert "checking on cpu" in err  # the build's device is cuda; this node has none


def test_runs_the_loader_as_the_command_and_imports_it(podman: Podman) -> None:
    _passed(podman.run(IMAGE, "/models/packer_loader.py", "--selftest", "--verify"))
    proc = podman.run(IMAGE, "python3", "-c", "import packer_loader, os; print(packer_loader.__file__, os.getcwd())")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["/models/packer_loader.py", "/models"]


def test_runs_as_a_non_root_user_on_a_read_only_root(podman: Podman) -> None:
    _passed(podman.run("--user", "1000:0", "--read-only", IMAGE, "/models/packer_loader.py", "--selftest"))
    _passed(podman.run("--user", "123456:0", "--read-only", IMAGE))  # a random uid, as OpenShift runs it


def _host_logits(out: Path, tmp: Path) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = tmp / "host-model"
    Bundle.open(out / "bundle.tar.zst").extract(model_dir)
    (model_dir / "model.safetensors").write_bytes(weight_bytes(out))  # out of its layer blob
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [float(x) for x in m(torch.arange(1, 17).unsqueeze(0)).logits[0, -1].tolist()]


def test_the_image_mounted_as_a_volume_is_a_model_directory(podman: Podman, demo_out: Path, tmp_path: Path) -> None:
    mount = f"type=image,source={IMAGE},destination=/mnt/model"
    proc = podman.run("--mount", mount, "--user", "1000:0", "--read-only", IMAGE,
                      "python3", "-c", PROBE, "/mnt/model/models", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    from safetensors.torch import load

    weights = weight_bytes(demo_out)  # OUT holds the file in its layer blob
    want_files = {"model.safetensors": hashlib.sha256(weights).hexdigest()}
    bundle = Bundle.open(demo_out / "bundle.tar.zst")
    want_files |= {n: hashlib.sha256(bundle.read(n)).hexdigest() for n in bundle.names()}
    assert {k: got["files"][k] for k in want_files} == want_files
    tensors = load(weights)
    assert got["tensors"] == {k: [str(v.dtype), list(v.shape)] for k, v in sorted(tensors.items())}
    assert got["logits"] is not None, "transformers is in the base: the logits must come back"
    assert got["logits"] == _host_logits(demo_out, tmp_path)  # bit for bit


def _buildah(podman: Podman, *args: str, timeout: float = 900) -> None:
    sh(["buildah", *podman.store[:6], *args], timeout=timeout,
       env={**podman.env(), "BUILDAH_ISOLATION": "chroot"})


def test_buildah_builds_out_dockerfile_on_a_local_base(podman: Podman, demo_out: Path, bases: Path) -> None:
    tag = "localhost/from-out-dockerfile:1"
    _buildah(podman, "bud", "--isolation", "chroot", "--build-arg",
             f"BASE_IMAGE=oci:{bases}:base", "-f", str(demo_out / "Dockerfile"), "-t", tag, str(demo_out))
    _passed(podman.run("--user", "1000:0", "--read-only", tag))


def test_buildah_builds_dockerfile_runtime_with_local_bases(podman: Podman, bases: Path, tmp_path: Path) -> None:
    context = tmp_path / "context"
    for rel in ("requirements", "packer", "recipes"):
        shutil.copytree(ROOT / rel, context / rel, ignore=shutil.ignore_patterns("__pycache__"))
    for rel in ("pyproject.toml", "README.md", "Dockerfile.runtime"):
        shutil.copy2(ROOT / rel, context / rel)
    tag = "localhost/from-dockerfile-runtime:1"
    # the network steps, replaced: both bases are local layouts, pip installs offline from the
    # build base's /wheels, and the runtime base already has torch, zstandard and python3
    args = {"BUILD_IMAGE": f"oci:{bases}:build", "CUDA_IMAGE": f"oci:{bases}:base",
            "PIP_ARGS": "--no-index --find-links /wheels", "TORCH_VERSION": torch_pin().split("==")[1],
            "ZSTANDARD_VERSION": ZSTD.split("==")[1]}
    _buildah(podman, "bud", "--isolation", "chroot",
             *(f"--build-arg={k}={v}" for k, v in args.items()),
             "-f", str(context / "Dockerfile.runtime"), "-t", tag, str(context), timeout=1500)
    _passed(podman.run("--read-only", tag))
    proc = podman.run(tag, "sh", "-c", "id -u; stat -c %a /models/packer_loader.py; ls /models")
    lines = proc.stdout.split()
    assert lines[:2] == ["1000", "755"] and {"config.json", "model.safetensors", "tokenizer.json"} <= set(lines)
    # bytecode shipped for the venv, none beside /models: a start compiles no import of torch or zstandard
    proc = podman.run("--read-only", tag, "python3", "-c", NO_COMPILE_AT_START)
    assert proc.stdout.split() == ["compiled-at-start:", "0", "beside-models:", "0"], proc.stdout


NO_COMPILE_AT_START = """
import importlib.util, os, sys, zstandard, torch, packer_loader
venv = [m.__file__ for m in list(sys.modules.values()) if (getattr(m, "__file__", None) or "").endswith(".py")
        and m.__file__.startswith(sys.prefix)]
missing = [f for f in venv if not os.path.exists(importlib.util.cache_from_source(f))]
beside = [os.path.join(d, n) for d, _, names in os.walk("/models") for n in names if n.endswith(".pyc")]
print("compiled-at-start:", len(missing), "beside-models:", len(beside))
"""


def test_modelpack_tag_beside_the_runnable_image(demo_out: Path) -> None:
    index = json.loads((demo_out / "image" / "index.json").read_bytes())
    tags = [m["annotations"]["org.opencontainers.image.ref.name"] for m in index["manifests"]]
    assert tags == ["packer-demo:0.1.0", modelpack_tag("packer-demo:0.1.0")]
