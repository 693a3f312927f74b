"""Real containers for the ``containers`` tests: a base from Debian packages, podman with runc.

Facts of these machines (shared/notes/containers-and-vllm.md): crun fails (cgroups in hybrid
mode), so runc; podman's default rlimits are refused, so explicit ones; a private storage
per session; no network in the containers. pip in the base's chroot cannot see this machine's
package index, so the wheels are downloaded here with this machine's own pip configuration
(index and CA as configured; nothing is written into the repository) and installed offline.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE_TAG = "base"
# the base's Python (Debian 12's python3) decides which wheels fit
WHEEL_TARGET = ["--python-version", "3.11", "--implementation", "cp", "--only-binary=:all:",
                *(f"--platform={p}" for p in ("manylinux_2_36_x86_64", "manylinux_2_28_x86_64",
                                              "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                                              "manylinux2014_x86_64"))]
PATH_ENV = "PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def sh(cmd: list[str], *, timeout: float = 600, check: bool = True,
       env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a tool; on failure (with ``check``) fail the test with the end of its output."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)[:300]} exited {proc.returncode}: {(proc.stderr or proc.stdout)[-3000:]}")
    return proc


def require_root_tools(*tools: str) -> None:
    """Skip unless running as root with every tool installed (mmdebstrap's chroot, rootful podman)."""
    if os.geteuid() != 0:
        pytest.skip("container tests need root (mmdebstrap chroot hooks, rootful podman with runc)")
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (apt-get install {' '.join(missing)})")


def download_wheels(dest: Path, *specs: str) -> None:
    """Wheels for the base's Python, with this machine's pip configuration."""
    dest.mkdir(parents=True, exist_ok=True)
    sh([sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest), *WHEEL_TARGET, *specs])


def torch_pin() -> str:
    """The one torch pin (requirements/torch-cpu.txt)."""
    lines = (ROOT / "requirements" / "torch-cpu.txt").read_text().splitlines()
    return next(x.strip() for x in lines if x.strip().startswith("torch"))


def build_base(work: Path, wheels: Path, packages: list[str]) -> Path:
    """An OCI layout ``work/layout:base``: Debian 12 minbase, python3, a venv at /opt/venv with
    ``packages`` installed offline from ``wheels``. About 3 minutes; call once per session."""
    rootfs, layout = work / "rootfs", work / "layout"
    hooks = [
        'mkdir -p "$1/tmp/wheels"',
        f'sync-in {wheels} /tmp/wheels',
        'chroot "$1" python3 -m venv /opt/venv',
        'chroot "$1" /opt/venv/bin/pip install --quiet --no-index --no-cache-dir --find-links /tmp/wheels '
        + " ".join(packages),
        'rm -rf "$1/tmp/wheels"',
    ]
    sh(["mmdebstrap", "--quiet", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
        *(f"--customize-hook={h}" for h in hooks), "bookworm", str(rootfs)], timeout=1200)
    sh(["umoci", "init", "--layout", str(layout)])
    sh(["umoci", "new", "--image", f"{layout}:{BASE_TAG}"])
    sh(["umoci", "insert", "--image", f"{layout}:{BASE_TAG}", str(rootfs), "/"], timeout=900)
    sh(["umoci", "config", "--image", f"{layout}:{BASE_TAG}", "--config.env", PATH_ENV,
        "--config.cmd", "python3"])
    shutil.rmtree(rootfs)
    return layout


def add_layer(layout: Path, src_tag: str, dst_tag: str, directory: Path, at: str) -> None:
    """``layout:dst_tag`` = ``layout:src_tag`` plus ``directory``'s files at ``at``."""
    sh(["umoci", "config", "--image", f"{layout}:{src_tag}", "--tag", dst_tag])
    sh(["umoci", "insert", "--image", f"{layout}:{dst_tag}", str(directory), at], timeout=600)


@dataclass(frozen=True)
class Podman:
    """podman with private storage under ``root``, runc, no network, rlimits this VM accepts."""

    root: Path

    @property
    def store(self) -> list[str]:
        return ["--root", str(self.root / "storage"), "--runroot", str(self.root / "run"),
                "--storage-driver", "overlay", "--cgroup-manager", "cgroupfs", "--events-backend", "file",
                "--runtime", "runc"]

    def env(self) -> dict[str, str]:
        return {"TMPDIR": str(self.root / "tmp")}

    def load(self, layout_ref: str, name: str) -> None:
        """``oci:DIR:TAG`` into this storage as ``name`` (skopeo keeps the name; podman 4.3 would not)."""
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        dest = f"containers-storage:[overlay@{self.root / 'storage'}+{self.root / 'run'}]{name}"
        sh(["skopeo", "copy", "--quiet", layout_ref, dest], env=self.env())

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        cmd = ["podman", *self.store, "run", "--rm", "--network", "none",
               "--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768", *args]
        return sh(cmd, timeout=timeout, check=False, env=self.env())

    def podman(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return sh(["podman", *self.store, *args], timeout=timeout, env=self.env())

    def close(self) -> None:
        """Remove every image, then unmount what containers/storage left mounted, then the files."""
        sh(["podman", *self.store, "rmi", "--all", "--force"], check=False, env=self.env())
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
                  if line.split()[1].startswith(str(self.root))]
        for m in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", m], capture_output=True, check=False)
        shutil.rmtree(self.root, ignore_errors=True)
