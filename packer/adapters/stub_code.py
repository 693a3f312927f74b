"""The emitted loader as an engine adapter runs it: from checked bytes, or not at all.

Python's import system would run a ``__pycache__/packer_loader.*.pyc`` that carries the
stub's mtime and size instead of the stub's source. So the adapter never imports the stub:
:func:`load_stub` reads its bytes once (through the runtime's reading module), checks them
against their anchor and runs them:

* the anchor is the build's ``manifest.json`` beside the stub, whose files map pins
  ``packer_loader.py`` by sha256 (the stub in turn pins ``packer_runtime/`` and the embedded
  manifest); a stub without a ``manifest.json`` beside it (a bare ``emit_loader`` output) is
  compiled from its bytes unpinned;
* under ``PACKER_REQUIRE_SIGNATURE`` no code of the build runs at all: ``model.sig`` signs the
  model's files (weights, config, tokenizer), not the loader. The embedded manifest is taken
  from the stub as a literal (``ast.literal_eval``: nothing is executed) and loaded by the
  installed packer's own runtime, which checks it against ``model.sig`` before anything else.

:func:`check_served` is the other half under a signature requirement: the model directory the
engine reads by itself holds only files the signature covers, byte for byte.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sys
import types
from pathlib import Path
from typing import Any

from packer.errors import EngineAdapterError
from packer.formats import LOADER_NAME, MANIFEST_NAME, PROVENANCE_NAME, SAFETENSORS_SUFFIX, SIGNATURE_NAME
from packer.runtime.reading import loads_json, read_bytes, read_json, resolve
from packer.runtime.settings import RuntimeSettings

RUNTIME_DIR = "packer_runtime"  # the stub's runtime folder (packer.stub.RUNTIME_DIR)
STUB_MODULE = "packer_loader"


def required_key() -> str:
    """``PACKER_REQUIRE_SIGNATURE`` (a public key's path), or "" when no signature is required."""
    return RuntimeSettings.from_sources(os.environ).require_signature


def embedded_manifest(source: bytes, where: str) -> str:
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

        build = loader.Build(embedded_manifest(source, where), path.parent, STUB_MODULE)
        module.__dict__.update({name: getattr(loader, name) for name in ("ArtifactMismatchError", "LoadResult",
                                                                          "report", "init_empty")})
        module.__dict__.update(load_weights=build.load_weights, load_into=build.load_into, manifest=build.manifest,
                               model_dir=build.model_dir, bundle_dir=build.bundle_dir, _build=build)
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
    return rel in (LOADER_NAME, MANIFEST_NAME, SIGNATURE_NAME, PROVENANCE_NAME, bundle_file) or top == RUNTIME_DIR


def check_served(model_dir: str | Path, stub: Path, public_key: str, *, tokenizer: Any = None) -> list[str]:
    """Refuse a model directory whose files are not the ones the build's signature covers.

    The engine reads ``model_dir`` itself (``config.json``, tokenizer files, chat template,
    generation config) before any weight is loaded; every file in it, but the loader's own
    (the stub, its runtime, the manifest, the bundle archive, the signature), must be one that
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
    from packer.runtime.signature import signed_files

    d = resolve(model_dir)
    if tokenizer not in (None, "") and resolve(tokenizer) != d:
        raise EngineAdapterError(f"--tokenizer {tokenizer}: under PACKER_REQUIRE_SIGNATURE the tokenizer is the "
                                 f"signed model directory's ({d}); leave --tokenizer out")
    root = resolve(stub).parent
    signed = signed_files(root, public_key)
    manifest = loads_json(embedded_manifest(read_bytes(stub, "stub"), str(stub)), str(stub))
    bundle_file = str((manifest.get("bundle") or {}).get("file") or "bundle.tar.zst")
    return check_signed_dir(d, signed, ignored=lambda rel: _never_read(rel, bundle_file),
                            hashed=lambda rel: not rel.endswith(SAFETENSORS_SUFFIX))
