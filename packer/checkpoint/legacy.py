"""The legacy torch format (torch.save before 1.6, or ``_use_new_zipfile_serialization=False``).

Layout: five pickles back to back -- the magic number, the protocol version, sys_info, the
object (storages as persistent ids), the list of storage keys -- then, for each key in that
order, an 8-byte little-endian element count and the storage's raw bytes. Storages are
located by walking that layout; their bytes are never read.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from packer.checkpoint.allowlist import STORAGE_MODULES, STORAGE_TYPES, TORCH_DTYPES
from packer.checkpoint.pickle_vm import DEFAULT_POLICY, NO_GLOBALS, run_pickle
from packer.checkpoint.placeholders import GlobalPolicy
from packer.checkpoint.records import StorageRange
from packer.checkpoint.tree import Global, StorageRef, short
from packer.errors import CheckpointError, PayloadError, TruncatedPickle, UnsafeInputError

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001
MAX_PICKLE_BYTES = 256 << 20
_FIRST_READ = 1 << 20


class _Pickles:
    """The file's leading bytes, read in growing chunks as the pickles need them."""

    def __init__(self, f: BinaryIO, path: Path, size: int) -> None:
        self.f, self.path, self.size = f, path, size
        self.buf = b""
        self._grow(min(size, _FIRST_READ))

    def _grow(self, n: int) -> None:
        self.f.seek(0)
        self.buf = self.f.read(n)

    def run(self, start: int, what: str, **kw: object) -> tuple[object, int]:
        while True:
            try:
                return run_pickle(self.buf, where=f"{self.path}: {what}", start=start,
                                  to_end=False, **kw)  # type: ignore[arg-type]
            except TruncatedPickle:
                if len(self.buf) >= min(self.size, MAX_PICKLE_BYTES):
                    raise
                self._grow(min(self.size, MAX_PICKLE_BYTES, 4 * len(self.buf)))


class _Storages:
    """Persistent-id handler: one StorageRef per key, located once the keys are known."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.roots: dict[str, StorageRef] = {}
        self.views: list[tuple[StorageRef, StorageRef, int]] = []
        self.view_refs: dict[str, StorageRef] = {}

    def fail(self, reason: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: main pickle: {reason}")

    def __call__(self, pid: object) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage"):
            kind = pid[0] if isinstance(pid, tuple) and pid and isinstance(pid[0], str) else "?"
            raise UnsafeInputError(f"{self.path}: main pickle: persistent id '{kind}' is not a storage")
        _, stype, key, _, numel, view = pid
        if not isinstance(stype, Global) or stype.module not in STORAGE_MODULES or stype.name not in STORAGE_TYPES:
            raise self.fail("persistent id has no storage type")
        if not isinstance(key, str) or type(numel) is not int or numel < 0:
            raise self.fail(f"malformed storage id {short(pid)}")
        dtype = STORAGE_TYPES[stype.name]
        root = self.roots.get(key)
        if root is None:
            nbytes = numel * TORCH_DTYPES[dtype][1]
            root = StorageRef(key, dtype, numel, StorageRange(key, self.path, -1, nbytes))
            self.roots[key] = root
        elif root.dtype != dtype or root.numel != numel:
            raise self.fail(f"storage {key} declared as both {root.dtype}[{root.numel}] and {dtype}[{numel}]")
        return root if view is None else self._view(root, view)

    def _view(self, root: StorageRef, view: object) -> StorageRef:
        if not (isinstance(view, tuple) and len(view) == 3 and isinstance(view[0], str)
                and type(view[1]) is int and type(view[2]) is int):
            raise self.fail(f"storage {root.key}: malformed view metadata")
        vkey, offset, vsize = view
        if offset < 0 or vsize < 0 or offset + vsize > root.numel:
            raise self.fail(f"storage view {vkey} lies outside storage {root.key}")
        ref = self.view_refs.get(vkey)
        if ref is None:
            ref = StorageRef(vkey, root.dtype, vsize, root.range)
            self.view_refs[vkey] = ref
            self.views.append((ref, root, offset))
        return ref

    def locate(self, f: BinaryIO, keys: object, start: int, size: int) -> None:
        """Walk the storage area from ``start``; fill in every StorageRef's byte range."""
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise CheckpointError(f"{self.path}: storage key list: not a list of strings")
        if len(set(keys)) != len(keys) or set(keys) != set(self.roots):
            missing = sorted(set(self.roots) - set(keys))[:5]
            raise CheckpointError(
                f"{self.path}: storage key list: does not match the storages used (duplicates, or missing {missing})"
            )
        pos = start
        for key in keys:
            ref = self.roots[key]
            f.seek(pos)
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{self.path}: storage {key}: truncated at byte {pos}")
            (count,) = struct.unpack("<q", head)
            if count != ref.numel:
                raise CheckpointError(
                    f"{self.path}: storage {key}: holds {count} elements, the pickle declares {ref.numel}"
                )
            if ref.range.nbytes > size - pos - 8:
                raise CheckpointError(
                    f"{self.path}: storage {key}: {ref.range.nbytes} bytes declared but only "
                    f"{size - pos - 8} remain in the file"
                )
            ref.range = dataclasses.replace(ref.range, offset=pos + 8)
            pos += 8 + ref.range.nbytes
        if pos != size:
            raise CheckpointError(f"{self.path}: {size - pos} bytes of junk after the last storage")
        for view, root, offset in self.views:
            item = TORCH_DTYPES[root.dtype][1]
            view.range = StorageRange(view.key, self.path, root.range.offset + offset * item,
                                      view.numel * item)


def _expect(path: Path, what: str, value: object, ok: Callable[[object], bool]) -> None:
    if not ok(value):
        raise CheckpointError(f"{path}: {what}: unexpected value {short(value, 60)}")


RAW_PICKLE = ("if the file was written with pickle.dump, not torch.save, re-save it where it was made with "
              "torch.save(obj, path) (or safetensors.torch.save_file(state_dict, path)): packer reads "
              "torch.save's formats and safetensors")


def load_legacy(f: BinaryIO, path: Path, size: int, *, policy: GlobalPolicy = DEFAULT_POLICY) -> object:
    """Parse a legacy stacked-pickle checkpoint; return the main pickle's root object.

    Raises:
        CheckpointError / UnsafeInputError: a malformed layout or a disallowed pickle.
    """
    pickles = _Pickles(f, path, size)
    try:
        magic, pos = pickles.run(0, "magic number pickle", policy=NO_GLOBALS)
    except UnsafeInputError as e:  # a first pickle holding objects: pickle.dump's, not torch.save's
        if isinstance(e, PayloadError):  # a payload, not a pickle.dump of data: no re-save advice
            raise
        raise UnsafeInputError(f"{e}; {RAW_PICKLE}") from e
    if type(magic) is not int or magic != MAGIC_NUMBER:
        raise CheckpointError(f"{path}: magic number pickle: not the torch legacy magic number; {RAW_PICKLE}")
    version, pos = pickles.run(pos, "protocol version pickle", policy=NO_GLOBALS)
    _expect(path, "protocol version", version, lambda v: type(v) is int and v == PROTOCOL_VERSION)
    info, pos = pickles.run(pos, "sys_info pickle", policy=NO_GLOBALS)
    _expect(path, "sys_info", info, lambda v: isinstance(v, dict) and v.get("little_endian", True) is True)
    storages = _Storages(path)
    root, pos = pickles.run(pos, "main pickle", persistent_load=storages, policy=policy)
    keys, pos = pickles.run(pos, "storage key list", policy=NO_GLOBALS)
    storages.locate(f, keys, pos, size)
    return root
