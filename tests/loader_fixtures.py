"""Build small safetensors artifacts and the embedded manifest the loader expects."""

from __future__ import annotations

import hashlib
import io
import json
import struct
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from packer.runtime.engines import CpuEngine


def _entry(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header: dict[str, Any] = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def write_raw_safetensors(path: Path, tensors: list[tuple[str, str, list[int], bytes]],
                          pad: int = 0) -> None:
    """A safetensors file laid out exactly as given (no alignment), header padded by ``pad``."""
    header, data = {}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode() + b" " * pad
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def misaligned(root: Path, m: dict[str, Any], align: int = 64) -> set[str]:
    """The non-empty tensors of ``m`` whose file offset is not ``align``-aligned (a mapping's
    view of them would not be either: a mapping starts page aligned)."""
    starts = {}
    for rel in m["weights"]["files"]:
        entry = m["files"].get(rel, {})  # a build holds the file in its layer blob, at a page offset
        path, at = (root / entry["blob"], entry["offset"]) if entry.get("blob") else (root / rel, 0)
        with open(path, "rb") as f:
            f.seek(at)
            starts[rel] = 8 + struct.unpack("<Q", f.read(8))[0]
    return {n for n, t in m["weights"]["tensors"].items()
            if t["data_offsets"][1] > t["data_offsets"][0] and (starts[t["file"]] + t["data_offsets"][0]) % align}


def describe(root: Path, rels: list[str], *, aliases: dict[str, str] | None = None,
             index: str | None = None, device: str = "cpu") -> dict[str, Any]:
    """The embedded manifest for safetensors files already under ``root``."""
    tensors: dict[str, Any] = {}
    for rel in rels:
        for name, rec in _header(root / rel).items():
            tensors[name] = {"file": rel, **rec}
    files = {rel: _entry(root / rel) for rel in [*rels, *([index] if index else [])]}
    return {"name": "fixture", "version": "1",
            "files": files,
            "weights": {"files": rels, "index": index,
                        "total_size": sum(files[r]["size"] for r in rels), "tensors": tensors,
                        "aliases": aliases or {}, "skipped": [], "inputs": []},
            "bundle": None,
            "runtime": {"device": device, "warmup": []}}


def make_loader(root: Path, m: dict[str, Any], **opts: Any) -> Any:
    """A ``Loader`` over ``root`` with a private timeline; ``opts`` set attributes (slots, chunk…)."""
    from packer.runtime.loading import Loader
    from packer.runtime.timeline import Timeline

    ld = Loader(m, root, timeline=Timeline())
    for k, v in opts.items():
        setattr(ld, k, v)
    return ld


def write_aligned(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` in a safetensors file laid out as packer lays out its own (data 64-aligned,
    tensors in :func:`packer.weights.plan.file_order`)."""
    from packer.weights.plan import ALIGN, file_order

    raw = {n: t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
           for n, t in tensors.items()}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    data = b""
    for n in file_order(sorted(raw), {n: len(b) for n, b in raw.items()}):
        dtype = str(tensors[n].dtype).removeprefix("torch.")
        header[n] = {"dtype": _CODES[dtype], "shape": list(tensors[n].shape),
                     "data_offsets": [len(data), len(data) + len(raw[n])]}
        data += raw[n]
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
          "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def make_artifacts(root: Path, shards: list[dict[str, torch.Tensor]], *,
                   aliases: dict[str, str] | None = None, aligned: bool = True) -> dict[str, Any]:
    """Write ``shards`` as packer lays them out (``aligned``), else with the safetensors
    library (8-aligned), with a Hugging Face index when sharded; describe them."""
    (root / "weights").mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        rels = ["weights/model.safetensors"]
    else:
        rels = [f"weights/model-{i:05d}-of-{len(shards):05d}.safetensors"
                for i in range(1, len(shards) + 1)]
    weight_map = {}
    for rel, tensors in zip(rels, shards, strict=True):
        if aligned:
            write_aligned(root / rel, tensors)
        else:
            save_file(tensors, str(root / rel))
        weight_map.update({k: Path(rel).name for k in tensors})
    index = None
    if len(shards) > 1:
        index = "weights/model.safetensors.index.json"
        (root / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return describe(root, rels, aliases=aliases, index=index)


def sample_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """A handful of dtypes and shapes, including a scalar and an empty tensor."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=g),
        "layer.0.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16),
        "layer.0.bias": torch.randn(32, generator=g).to(torch.float16),
        "positions": torch.arange(17, dtype=torch.int64),
        "mask": torch.rand(5, 3, generator=g) > 0.5,
        "scale": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "bytes": torch.randint(0, 255, (13,), dtype=torch.uint8, generator=g),
    }


def make_bundle(path: Path, members: dict[str, bytes]) -> dict[str, Any]:
    """A tar.zst of ``members`` (written with tarfile and zstandard) and its manifest section."""
    import zstandard

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in sorted(members.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    blob = zstandard.ZstdCompressor(level=3).compress(raw.getvalue())
    path.write_bytes(blob)
    return {"file": path.name, "size": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
            "members": [{"name": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()}
                        for n, d in sorted(members.items())]}


def make_out(out: Path, *, bundle: bool = True) -> dict[str, Any]:
    """A small build output: two shards with an alias, a bundle, and the emitted loader."""
    from packer.stub import emit_loader

    big = {"big.weight": torch.randn(300, 70), "big.bias": torch.randn(70).to(torch.bfloat16)}
    m = make_artifacts(out, [sample_tensors(), big], aliases={"lm_head.weight": "embed.weight"})
    m["name"] = "tiny-\u00e9t\u00e9 'model'"  # quotes and non-ASCII survive embedding
    if bundle:
        m["bundle"] = make_bundle(out / "bundle.tar.zst", {"config.json": b'{"a":1}', "tok/vocab.txt": b"a\nb\n"})
        m["files"]["bundle.tar.zst"] = {k: m["bundle"][k] for k in ("size", "sha256")}
    emit_loader(out, m)
    return m


def _digest(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for _, src in pairs:
        h.update(src.numpy().tobytes())
    return h.hexdigest()


class WatchedEngine(CpuEngine):
    """The CPU engine, checking from its own side what the ring promises it.

    ``overwritten``: copies whose source bytes changed between the copy being issued (the
    slot's read done) and the copy running: a slot refilled while its copy waited.
    ``max_pending``: the most copies issued and not yet done at once (at most one per slot).
    """

    def __init__(self, copy_delay: float = 0.0) -> None:
        self.pending = self.max_pending = self.overwritten = self.copies = 0
        self._count = threading.Lock()
        super().__init__(copy_delay)

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> threading.Event:
        done = threading.Event()
        with self._count:
            self.pending += 1
            self.max_pending = max(self.max_pending, self.pending)
        self._q.put((pairs, done, _digest(pairs)))  # type: ignore[arg-type]
        return done

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            pairs, done, digest = item  # type: ignore[misc]
            try:
                if self.copy_delay:
                    time.sleep(self.copy_delay)
                if _digest(pairs) != digest:
                    self.overwritten += 1
                for dst, src in pairs:
                    dst.copy_(src)
            except BaseException as e:  # reported by wait()/finish()
                self._error = e
            with self._count:
                self.pending -= 1
                self.copies += 1
            done.set()
