"""packer_loader: this build's loader for a serving container. Import it before CUDA starts.

The code is the ``packer_runtime/`` package beside this file: packer's runtime modules as they
are in packer (names, docstrings, line numbers), so a traceback names their files and lines.
This file pins the build: its manifest is embedded below with the sha256 of every runtime
file, and a runtime that does not match is refused before any of it runs. Needs the standard
library and torch (zstandard for the bundle).

The public functions are ``__all__``, documented in packer's docs/reference/loader.md (its API
table). ``python packer_loader.py --selftest [--device cpu|cuda] [--verify]``
checks a node; ``python packer_loader.py --model-dir`` prints a model directory for engines.
"""

# No ``from __future__`` import: nothing is imported before the next lines (sys and os are
# loaded before any script runs, so they come from the interpreter, never from a file here).
import os
import sys

if __name__ == "__main__":  # a script: its folder is sys.path[0], where a torch.py would shadow torch
    _HERE = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _HERE]

import hashlib  # noqa: E402 (after the line above on purpose)
import stat  # noqa: E402
from contextlib import suppress  # noqa: E402
from importlib.machinery import FileFinder, SourceFileLoader  # noqa: E402
from importlib.util import module_from_spec, spec_from_file_location  # noqa: E402
from pathlib import Path  # noqa: E402
from types import CodeType, ModuleType  # noqa: E402

# >>> packer:embedded (replaced by packer.stub when the loader is emitted)
_MANIFEST_JSON = "{}"
_RUNTIME_DIR = "packer_runtime"
_RUNTIME_SHA256: dict[str, str] = {}
# <<< packer:embedded

__all__ = [
    "ArtifactMismatchError", "LoadResult", "bundle_dir", "from_pretrained", "init_empty", "load_into",
    "load_weights", "main", "manifest", "model_dir", "prefetch", "prepare", "release_ring", "report",
    "warm_context", "warmup", "warmup_inputs",
]


class _RuntimeMismatchError(ImportError):
    """The runtime beside this file is not the one this build wrote."""


class _CheckedSource(SourceFileLoader):
    """Runs a runtime module from the very bytes whose sha256 was checked; no bytecode is read
    or written (nothing appears beside the artifacts, and no stale cache can stand in)."""

    checked: dict[str, bytes] = {}

    def get_data(self, path: str) -> bytes:
        try:
            return self.checked[path]
        except KeyError:
            raise OSError(f"{path}: not a file of this build's runtime") from None

    def get_code(self, fullname: str) -> CodeType:
        path = self.get_filename(fullname)
        return compile(self.get_data(path), path, "exec", dont_inherit=True)


_MAX_RUNTIME_FILE = 4 * 2**20  # packer_runtime/*.py: a few hundred lines each


def _read_runtime_file(path: Path) -> bytes:
    """One runtime file, a regular file of at most ``_MAX_RUNTIME_FILE`` bytes (the runtime's
    reading module is not verified yet: this is its one rule, written out)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO cannot block the open
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(0, "not a regular file")
        if st.st_size > _MAX_RUNTIME_FILE:
            raise OSError(0, f"{st.st_size} bytes, over the cap of {_MAX_RUNTIME_FILE}")
        data = os.pread(fd, st.st_size, 0)
        if len(data) != st.st_size:
            raise OSError(0, "shrank while being read")
        return data
    finally:
        os.close(fd)


def _checked_runtime(root: Path) -> dict[str, bytes]:
    """Every runtime file's bytes by absolute path, each checked against the manifest."""
    fix = f"ship the {_RUNTIME_DIR}/ directory this build wrote beside {Path(__file__).name}"
    checked = {}
    for rel, want in sorted(_RUNTIME_SHA256.items()):
        try:
            data = _read_runtime_file(root / rel)
        except OSError as e:
            raise _RuntimeMismatchError(f"packer_loader: {root / rel}: {e.strerror}; {fix}") from None
        got = hashlib.sha256(data).hexdigest()
        if got != want:
            raise _RuntimeMismatchError(f"packer_loader: {root / rel}: sha256 {got[:16]}..., this "
                                        f"build's manifest says {want[:16]}...; {fix}")
        checked[str(root / rel)] = data
    return checked


def _import_runtime() -> ModuleType:
    """The runtime package beside this file, checked, under a name of its own (never an
    installed ``packer`` nor another build's runtime); its ``loader`` module."""
    root = Path(__file__).resolve().parent / _RUNTIME_DIR
    checked = _checked_runtime(root)
    key = "\n".join([str(root), *(f"{p} {d}" for p, d in sorted(_RUNTIME_SHA256.items()))])
    name = f"_packer_runtime_{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if name not in sys.modules:
        _CheckedSource.checked.update(checked)
        for folder in sorted({str(Path(p).parent) for p in checked}):  # relative imports resolve here
            sys.path_importer_cache[folder] = FileFinder(folder, (_CheckedSource, [".py"]))
        init = str(root / "__init__.py")
        spec = spec_from_file_location(name, init, loader=_CheckedSource(name, init),
                                       submodule_search_locations=[str(root)])
        if spec is None or spec.loader is None:
            raise _RuntimeMismatchError(f"packer_loader: {init}: not importable")
        sys.modules[name] = module_from_spec(spec)
        try:
            spec.loader.exec_module(sys.modules[name])
        except BaseException:
            del sys.modules[name]
            raise
    return __import__(f"{name}.loader", fromlist=["loader"])


def _drop_own_bytecode() -> None:
    """Remove the bytecode file ``import packer_loader`` wrote beside this file just now, so the
    build stays as it was made (``packer verify`` refuses any file it did not write)."""
    cached = globals().get("__cached__")
    if __name__ == "__main__" or not cached:
        return
    folder = Path(__file__).resolve().parent / "__pycache__"
    if Path(cached).resolve().parent != folder:  # PYTHONPYCACHEPREFIX: not beside the build
        return
    for step in (Path(cached).unlink, folder.rmdir):  # the folder only when nothing else is in it
        with suppress(OSError):  # a read-only mount, or nothing was written
            step()


_drop_own_bytecode()
try:
    _loader = _import_runtime()
except _RuntimeMismatchError as _e:
    if __name__ != "__main__":
        raise
    sys.stderr.write(f"{_e}\n")  # a script: one line, exit 1
    raise SystemExit(1) from None

_build = _loader.Build(_MANIFEST_JSON, Path(__file__).resolve().parent, __name__)

ArtifactMismatchError = _loader.ArtifactMismatchError
LoadResult = _loader.LoadResult
init_empty = _loader.init_empty
warmup = _loader.warmup
report = _loader.report
release_ring = _loader.release_ring
manifest = _build.manifest
load_weights = _build.load_weights
load_into = _build.load_into
from_pretrained = _build.from_pretrained
model_dir = _build.model_dir
bundle_dir = _build.bundle_dir
prepare = _build.prepare
prefetch = _build.prefetch
warm_context = _build.warm_context
warmup_inputs = _build.warmup_inputs
proven_done = _build.proven_done  # the vLLM load format's: after load_weights(proven=True)
main = _build.main
__getattr__ = _loader.stub_attribute  # RegistryError on first use: a local load imports no HTTP module

_build.serve_pool()  # a no-op unless this process is the fork server warm_context starts

if __name__ == "__main__":
    sys.exit(main())
