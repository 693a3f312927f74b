"""The one validator for bundle archives: every test that produces a bundle calls it.

It reads the archive with independent parts (zstandard's frame parameters, the standard
library's ``tarfile`` on the decompressed stream) and with packer's runtime reader, and checks
the format rules entry by entry: one zstd frame with its content size and checksum, POSIX
ustar headers only, regular files and directories only, names sorted with every parent
directory listed first, modes 0644/0755, uid/gid 0 with empty owner names, one mtime.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

import zstandard

from packer.runtime.bundle_reader import DEFAULT_MAX_WINDOW, Bundle, _fits_ustar


def validate_bundle(path: str | Path, *, mtime: int | None = None,
                    names: list[str] | None = None) -> dict[str, bytes]:
    """Assert that ``path`` is a well-formed packer bundle; return ``{file name: bytes}``.

    Args:
        path: the archive.
        mtime: expected mtime of every entry (default: SOURCE_DATE_EPOCH or 0).
        names: expected file names (sorted), when the caller knows them.
    """
    raw = Path(path).read_bytes()
    if mtime is None:
        mtime = int(os.environ.get("SOURCE_DATE_EPOCH", "0") or 0)
    params = zstandard.get_frame_parameters(raw)
    assert params.has_checksum, "zstd frame without a content checksum"
    assert params.content_size != zstandard.CONTENTSIZE_UNKNOWN, "zstd frame without its content size"
    assert params.window_size <= DEFAULT_MAX_WINDOW
    dobj = zstandard.ZstdDecompressor().decompressobj()
    tar = dobj.decompress(raw)
    assert dobj.eof and not dobj.unused_data, "more than one zstd frame, or trailing bytes"
    assert len(tar) == params.content_size
    assert len(tar) % 512 == 0 and tar.endswith(bytes(1024)), "tar stream does not end with two zero blocks"

    files: dict[str, bytes] = {}
    seen_dirs: set[str] = set()
    previous = ""
    with tarfile.open(fileobj=io.BytesIO(tar), mode="r:") as tf:
        for info in tf:
            block = tar[info.offset : info.offset + 512]
            assert block[257:265] == b"ustar\x0000", f"{info.name}: not a POSIX ustar header"
            # a PAX "path" record only for a name no ustar header can hold
            assert set(info.pax_headers) <= {"path"}, f"{info.name}: unexpected PAX records {info.pax_headers}"
            if info.pax_headers:
                assert not _fits_ustar(info.name.encode()), f"{info.name}: PAX path for a ustar-sized name"
            shown = info.name + "/" if info.isdir() else info.name
            assert shown > previous, f"entries not sorted: {previous!r} then {shown!r}"
            previous = shown
            assert info.isreg() or info.isdir(), f"{info.name}: type {info.type!r}"
            assert info.mode == (0o755 if info.isdir() else 0o644), f"{info.name}: mode {info.mode:#o}"
            assert (info.uid, info.gid, info.uname, info.gname) == (0, 0, "", ""), f"{info.name}: owner"
            assert info.mtime == mtime and isinstance(info.mtime, int), f"{info.name}: mtime {info.mtime}"
            assert not info.name.startswith("/") and ".." not in info.name.split("/")
            parent = info.name.rpartition("/")[0]
            assert not parent or parent in seen_dirs, f"{info.name}: parent directory not listed first"
            if info.isdir():
                seen_dirs.add(info.name)
            else:
                fh = tf.extractfile(info)
                assert fh is not None
                files[info.name] = fh.read()

    bundle = Bundle.from_bytes(raw)
    assert bundle.names() == sorted(files), "packer's reader and tarfile disagree on the members"
    assert all(bundle.read(n) == data for n, data in files.items())
    assert bundle.sha256 == hashlib.sha256(raw).hexdigest()
    if names is not None:
        assert sorted(files) == names, f"members {sorted(files)} != expected {names}"
    return files
