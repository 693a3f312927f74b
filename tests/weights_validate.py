"""The one validator for packer's safetensors output; every test that writes weights calls it.

It checks what any consumer relies on, using the safetensors library for the reading:
the file set (one ``model.safetensors`` or HF-named shards plus an index), canonical headers
(sorted compact JSON, space padding so the data starts 64-byte aligned, offsets packed with no
holes, every tensor whose size is a multiple of 64 at a 64-byte aligned offset), file modes from the
umask, no temporary files left, and an index consistent with the shards.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from safetensors import safe_open

from packer.checkpoint.records import DTYPE_SIZES, PACKED
from packer.util.fsutil import umask

_SHARD = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")


def _header(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    text = raw[8:8 + n]
    assert n % 8 == 0 and (8 + n) % 64 == 0, f"{path}: header length {n}: data does not start 64-aligned"
    body = text.rstrip(b" ")
    assert text == body + b" " * (n - len(body)), f"{path}: padding is not spaces"
    header = json.loads(body)
    canonical = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert body == canonical.encode(), f"{path}: header JSON is not canonical"
    return header, raw[8 + n:]


def _check_file(path: Path) -> dict[str, dict[str, Any]]:
    header, data = _header(path)
    meta = header.pop("__metadata__")
    assert meta["format"] == "pt" and all(isinstance(v, str) for v in meta.values()), meta
    pos = 0
    for name in sorted(header, key=lambda n: (header[n]["data_offsets"], n)):  # packed, no holes
        info = header[name]
        begin, end = info["data_offsets"]
        assert begin == pos, f"{path}: {name} starts at {begin}, expected {pos}"
        assert (end - begin) % 64 or begin % 64 == 0, f"{path}: {name} ({end - begin} B) at {begin}: not 64-aligned"
        numel = 1
        for d in info["shape"]:
            numel *= d
        per = PACKED.get(info["dtype"], 1)  # packed float4: the header counts single values
        assert end - begin == -(-numel // per) * DTYPE_SIZES[info["dtype"]], f"{path}: {name} size"
        pos = end
    assert pos == len(data), f"{path}: {len(data)} data bytes, header covers {pos}"
    with safe_open(str(path), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(header)
        assert (f.metadata() or {}) == meta
        for name in f.keys():  # noqa: SIM118
            part = f.get_slice(name)
            assert (part.get_dtype(), list(part.get_shape())) == (
                header[name]["dtype"], header[name]["shape"]), name
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        out[name] = {**info, "file": path.name, "bytes": data[begin:end]}
    if "packer.aliases" in meta:
        aliases = json.loads(meta["packer.aliases"])
        assert all(k in header for k in aliases.values()), aliases
    return out


def validate_output(out_dir: Path) -> dict[str, dict[str, Any]]:
    """Check a weights output directory; return {tensor: header info + file + bytes}."""
    names = sorted(p.name for p in out_dir.iterdir())
    assert not [n for n in names if n.startswith(".")], f"temporary files left: {names}"
    mode = 0o666 & ~umask()
    for n in names:
        assert (os.stat(out_dir / n).st_mode & 0o777) == mode, f"{n}: mode"
    shards = [n for n in names if _SHARD.match(n)]
    tensors: dict[str, dict[str, Any]] = {}
    if "model.safetensors" in names:
        assert not shards and "model.safetensors.index.json" not in names, names
        return _check_file(out_dir / "model.safetensors")
    assert shards, f"no safetensors output in {names}"
    count = int(_SHARD.match(shards[0]).group(2))  # type: ignore[union-attr]
    assert [int(_SHARD.match(s).group(1)) for s in shards] == list(range(1, count + 1))  # type: ignore[union-attr]
    for s in shards:
        part = _check_file(out_dir / s)
        assert not set(part) & set(tensors), "tensor in two shards"
        tensors.update(part)
    raw = (out_dir / "model.safetensors.index.json").read_bytes()
    index = json.loads(raw)
    assert list(index["weight_map"]) == sorted(index["weight_map"]), "weight_map not sorted"
    assert index["weight_map"] == {n: t["file"] for n, t in tensors.items()}
    assert index["metadata"]["total_size"] == sum(len(t["bytes"]) for t in tensors.values())
    for alias, kept in index["metadata"].get("packer.aliases", {}).items():
        assert kept in tensors and alias not in tensors, alias
    return tensors


def aliases_of(out_dir: Path) -> dict[str, str]:
    """The removed-alias -> kept-name map recorded in the output."""
    index = out_dir / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_bytes())["metadata"].get("packer.aliases", {}))
    header, _ = _header(out_dir / "model.safetensors")
    return dict(json.loads(header["__metadata__"].get("packer.aliases", "{}")))
