"""The engine side's one trust gate: what runs or is served in an engine's process passes here.

Trust is decided by proof, never by where a file lies. Every byte of a build that an engine's
process executes or serves passes one of these doors, and a test (tests/test_trust_gate.py)
fails on any ``exec``, unpickle, ``dlopen`` or cache-variable assignment elsewhere:

* **the loader** (:func:`load_stub`): Python's import system would run a
  ``__pycache__/packer_loader.*.pyc`` that carries the stub's mtime and size instead of the
  stub's source, so the stub is never imported: its bytes are read once, checked against their
  anchor (the build's ``manifest.json`` beside it pins ``packer_loader.py`` by sha256; the stub
  in turn pins ``packer_runtime/`` and the embedded manifest) and compiled from those bytes. Under
  ``PACKER_REQUIRE_SIGNATURE`` no code of the build runs at all: ``model.sig`` signs the model's
  files, not the loader; the embedded manifest is taken from the stub as a literal
  (``ast.literal_eval``: nothing is executed) and loaded by the installed packer's own runtime,
  which checks it against ``model.sig`` before anything else;
* **the served files** (:func:`check_served`): under a signature requirement, every file of the
  model directory the engine reads by itself is one the signature covers, byte for byte; a warm
  state shipped in it (``warm/<name>/``, the warm image) only when its own ``state.sig`` verifies
  with the same key, for this build, and every file matches its pin;
* **the warm state** (:func:`open_state`, :func:`copy_state`, :class:`CacheRedirect`): compile
  caches are code. A state is opened only from a build whose stub is anchored
  (:func:`anchored_build`) or that the operator names (``PACKER_WARM=DIR``), signed by the
  required key where one is required, copied file by file against its pins into a private
  directory, and only then do the engine's cache variables point there; every variable changed
  is put back on a miss, before the engine looks for its cache.

Whether a warm state is consulted at all is the plugin's rule (:mod:`packer.adapters.vllm_warm`):
only where the operator serves a packer build as one (the ``packer`` load format, or
``PACKER_WARM`` naming the state); a plain ``vllm serve DIR`` reads ``DIR`` as data.
"""

from __future__ import annotations

import ast
import atexit
import hashlib
import os
import stat
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

from packer.errors import EngineAdapterError, WarmStateError
from packer.runtime.env import STREAM_FILE, ArtifactMismatchError
from packer.runtime.reading import is_regular, loads_json, read_bytes, read_json, resolve
from packer.runtime.settings import RuntimeSettings
from packer.util.formats import LOADER_NAME, MANIFEST_NAME, PROVENANCE_NAME, SAFETENSORS_SUFFIX, SIGNATURE_NAME
from packer.util.fsutil import quiet_cleanup, remove_tree
from packer.util.show import show
from packer.warm.key import STATE_ENV
from packer.warm.pins import WARM_DIR, read_state, verified_copy, verify_states
from packer.warm.roots import CACHE_ENV, ROOTS  # each root of a warm state, and the variable naming its directory
from packer.warm.trust import build_digest, check_signature

RUNTIME_DIR = "packer_runtime"  # the stub's runtime folder (packer.stub.RUNTIME_DIR)
STUB_MODULE = "packer_loader"
LOAD_FORMAT = "packer"  # vLLM's --load-format that serves a packer build through its loader


def required_key() -> str:
    """``PACKER_REQUIRE_SIGNATURE`` (a public key's path), or "" when no signature is required."""
    return RuntimeSettings.from_sources(os.environ).require_signature


def manifest_in_loader(source: bytes, where: str) -> str:
    """The stub's ``_MANIFEST_JSON``, read as a literal from its source (nothing executed).

    Raises:
        EngineAdapterError: the stub has no such assignment of a string literal.
    """
    try:
        tree = ast.parse(source, where)
    except (SyntaxError, ValueError) as e:
        raise EngineAdapterError(f"{where}: not Python source ({e})") from None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "_MANIFEST_JSON" and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            return node.value.value
    raise EngineAdapterError(f"{where}: no embedded manifest (_MANIFEST_JSON) in it; not an emitted loader")


def check_anchor(path: Path, source: bytes) -> None:
    """Refuse a stub whose sha256 is not the one the build's ``manifest.json`` beside it pins.

    Raises:
        EngineAdapterError: the manifest pins another sha256, or no ``packer_loader.py``.
        ArtifactMismatchError: the manifest is no regular file, too large or too deep, not JSON.
    """
    anchor = path.parent / MANIFEST_NAME
    try:
        manifest = read_json(anchor)
    except FileNotFoundError:
        return  # a bare emit_loader output: nothing pins the stub but its own bytes
    entry = (manifest.get("files") or {}).get(LOADER_NAME) if isinstance(manifest.get("files"), dict) else None
    want = entry.get("sha256") if isinstance(entry, dict) else None
    got = hashlib.sha256(source).hexdigest()
    if want != got:
        raise EngineAdapterError(f"{path}: sha256 {got[:16]}..., {anchor} pins "
                                 f"{str(want)[:16] + '...' if want else 'no ' + LOADER_NAME}; "
                                 "the loader is not the one this build wrote")


def check_stub(path: Path) -> None:
    """Refuse a stub at ``path`` that its build's ``manifest.json`` beside it does not pin
    (:func:`check_anchor`), before anything runs it in a process of its own (``packer profile``).

    Raises:
        EngineAdapterError: the manifest pins another sha256, or no ``packer_loader.py``.
        ArtifactMismatchError: the stub or its manifest is no regular file, too large, not JSON.
    """
    path = resolve(path)
    check_anchor(path, read_bytes(path, "stub"))


def load_stub(path: Path) -> types.ModuleType:
    """The emitted loader at ``path`` as module ``packer_loader``, from its checked bytes.

    Returns:
        the module, registered in ``sys.modules`` (with a signature required: the installed
        runtime's build of the stub's embedded manifest, with the same functions).

    Raises:
        EngineAdapterError: the stub is not pinned by its build's manifest or not an emitted loader.
        ArtifactMismatchError: the stub or its manifest is no regular file, too large, ...
        ImportError: the stub's own runtime check failed (a changed ``packer_runtime/``).
    """
    path = resolve(path)
    where = str(path)
    source = read_bytes(path, "stub")
    module = types.ModuleType(STUB_MODULE, "the emitted loader of a packer build")
    module.__file__ = where
    if required_key():
        from packer.runtime import loader

        build = loader.Build(manifest_in_loader(source, where), path.parent, STUB_MODULE)
        module.__dict__.update({name: getattr(loader, name) for name in ("ArtifactMismatchError", "LoadResult",
                                                                          "report", "init_empty")})
        module.__dict__.update(load_weights=build.load_weights, load_into=build.load_into, manifest=build.manifest,
                               model_dir=build.model_dir, bundle_dir=build.bundle_dir, proven_done=build.proven_done,
                               _build=build)
        sys.modules[STUB_MODULE] = module
        return module
    check_anchor(path, source)
    code = compile(source, where, "exec", dont_inherit=True)
    sys.modules[STUB_MODULE] = module
    try:
        exec(code, module.__dict__)  # noqa: S102 - the stub's own checked bytes, never a bytecode file
    except BaseException:
        del sys.modules[STUB_MODULE]
        raise
    return module


def _never_read(rel: str, bundle_file: str) -> bool:
    """Files of a build's model directory the engine does not read (the loader reads them)."""
    top = rel.split("/", 1)[0]
    return rel in (LOADER_NAME, MANIFEST_NAME, SIGNATURE_NAME, PROVENANCE_NAME, STREAM_FILE,
                   bundle_file) or top == RUNTIME_DIR


def check_served(model_dir: str | Path, stub: Path, public_key: str, *, tokenizer: Any = None) -> list[str]:
    """Refuse a model directory whose files are not the ones the build's signature covers.

    The engine reads ``model_dir`` itself (``config.json``, tokenizer files, chat template,
    generation config) before any weight is loaded; every file in it, but the loader's own
    (the stub, its runtime, the manifest, the bundle archive, the signature, a streamed directory's
    ``packer-stream.json``, which names where the loader fetches bytes it proves), must be one that
    ``model.sig`` beside ``stub`` signs, with the signed sha256 (the weights by name and type:
    the loader hashes them while it loads them).

    Args:
        model_dir: the directory the engine was given (``--model``).
        stub: the build's ``packer_loader.py`` (its folder holds ``model.sig``).
        public_key: ``PACKER_REQUIRE_SIGNATURE``.
        tokenizer: the engine's tokenizer directory, when given apart from the model.

    Returns:
        the signed names found in the directory.

    Raises:
        EngineAdapterError: a tokenizer elsewhere than the model directory.
        ArtifactMismatchError: ``model.sig`` does not verify, or a file is not signed or changed.
    """
    from packer.runtime.served import check_signed_dir
    from packer.runtime.signature import require_signature

    d = resolve(model_dir)
    if tokenizer not in (None, "") and resolve(tokenizer) != d:
        raise EngineAdapterError(f"--tokenizer {tokenizer}: under PACKER_REQUIRE_SIGNATURE the tokenizer is the "
                                 f"signed model directory's ({d}); leave --tokenizer out")
    root = resolve(stub).parent
    signed = require_signature(root, public_key)
    manifest = loads_json(manifest_in_loader(read_bytes(stub, "stub"), str(stub)), str(stub))
    bundle_file = str((manifest.get("bundle") or {}).get("file") or "bundle.tar.zst")
    warm = _signed_warm_files(d, root, public_key)
    return check_signed_dir(d, signed, ignored=lambda rel: _never_read(rel, bundle_file) or rel in warm,
                            hashed=lambda rel: not rel.endswith(SAFETENSORS_SUFFIX))


def _signed_warm_files(d: Path, root: Path, public_key: str) -> set[str]:
    """The files of the warm states shipped in the served directory ``d`` (``warm/<name>/...``),
    each state proven first: its ``state.sig`` verifies with ``public_key`` and names the build
    at ``root``, and every file is its pin. Only beside their own build (``d`` is ``root``, an
    image's model directory); elsewhere they stay files the signature does not cover."""
    if d != root or not os.path.lexists(d / WARM_DIR):
        return set()
    try:
        return verify_states(d, public_key=public_key)[0]
    except WarmStateError as e:
        raise ArtifactMismatchError(f"{e}; serve the signed build's warm state as `packer warm --sign-key` "
                                    "made it, or remove its warm/ folder") from None


# --- the warm state -----------------------------------------------------------------------------

def anchored_build(stub: Path) -> Path:
    """The build directory of ``stub``, when the build's ``manifest.json`` beside it pins its bytes.

    Raises:
        EngineAdapterError: no manifest beside the stub (not a build: a bare ``emit_loader``
            output), or one that pins another sha256.
        ArtifactMismatchError: the stub or the manifest is no regular file, too large, not JSON.
    """
    path = resolve(stub)
    if not is_regular(path.parent / MANIFEST_NAME):
        raise EngineAdapterError(f"{path}: no {MANIFEST_NAME} beside it pins it; a warm state is used only "
                                 "beside a build (packer build -o OUT)")
    check_anchor(path, read_bytes(path, "stub"))
    return path.parent


def open_state(state: Path, build: Path) -> dict[str, Any]:
    """The manifest of the warm state ``state`` as read, for the build at ``build``.

    Under ``PACKER_REQUIRE_SIGNATURE`` the state's own ``state.sig`` must verify with that key,
    sign exactly the manifest bytes read here, and name ``build``'s ``manifest.json``.

    Raises:
        WarmStateError: an unreadable or malformed manifest; a signature missing, not
            verifying, or for another manifest or build.
    """
    doc, digest = read_state(state)
    key = required_key()
    if key:  # served = signed: the state's own signature, by the build's key, for this build
        check_signature(state, digest, public_key=key, build_sha256=build_digest(build))
    unknown = sorted(set(doc["roots"]) - set(ROOTS))
    if unknown:
        raise WarmStateError(f"{state / MANIFEST_NAME}: roots: {unknown} are not cache roots packer knows "
                             f"({', '.join(ROOTS)})")
    return doc


class CacheRedirect:
    """A verified private copy of a warm state, and the engine's cache variables pointed at it.

    The copy is made file by file against the pins of the manifest the caller decided on
    (:func:`packer.warm.pins.verified_copy`), into a directory only this user can read, removed
    when this process exits; :meth:`point` is the one place the engine's cache variables are
    set, and :meth:`restore` puts back every variable it changed (and removes the copy).
    """

    def __init__(self, state: Path, doc: dict[str, Any]) -> None:
        """Raises WarmStateError: a changed, missing or unpinned file (nothing is left behind)."""
        self.dir = _private_dir()
        try:
            self.doc, self.nbytes = verified_copy(state, self.dir / "state", doc)
        except BaseException as e:
            quiet_cleanup(e, lambda: remove_tree(self.dir, ignore_errors=True))
            raise
        self._saved: dict[str, str | None] = {}

    def point(self) -> None:
        """Point each root's cache variable at the copy (and set what the state was captured with)."""
        wanted = {CACHE_ENV[root]: str(self.dir / "state" / root) for root in self.doc["roots"]}
        for name, value in {**wanted, **STATE_ENV}.items():
            self._saved.setdefault(name, os.environ.get(name))
            os.environ[name] = value

    def restore(self) -> None:
        """Every variable :meth:`point` changed back to what it was; the copy removed."""
        for name, value in self._saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self._saved.clear()
        remove_tree(self.dir, ignore_errors=True)


def _private_dir() -> Path:
    """A fresh directory only this user can read, removed when this process exits, made in a
    folder where no other user can rename it away and put another in its place.

    Raises:
        WarmStateError: ``PACKER_WARM_DIR`` (or the temp directory) is not such a folder: one
            of another user, or writable by others without the sticky bit (``/tmp``'s).
    """
    base = os.environ.get("PACKER_WARM_DIR") or tempfile.gettempdir()
    said = f"PACKER_WARM_DIR={show(base)}" if os.environ.get("PACKER_WARM_DIR") else f"the temp directory {show(base)}"
    try:
        st = os.stat(base)
    except OSError as e:
        raise WarmStateError(f"{said}: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (os.geteuid(), 0) or (
            st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX):
        raise WarmStateError(f"{said}: not a folder of this user or root that only they can "
                             "change (or with the sticky bit, as /tmp): another user could swap the checked copy "
                             "of the warm state after its check; refused")
    path = Path(tempfile.mkdtemp(prefix="packer-warm-", dir=base))
    atexit.register(_remove_if_owner, path, os.getpid())
    return path


def _remove_if_owner(path: Path, owner: int) -> None:
    if os.getpid() == owner:  # a forked child inherits atexit handlers: only the creator removes it
        remove_tree(path, ignore_errors=True)
