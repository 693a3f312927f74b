"""Small file-system helpers every stage shares: atomic writes, canonical JSON, a file's record.

Nothing here opens an input (that is :mod:`packer.reading`'s, and the helpers that read files,
:mod:`packer.hashing` and :mod:`packer.filetree`, sit above it), so ``packer/util`` stays a
leaf: :class:`FileEntry` reads its place by the runtime's one rule (:mod:`packer.runtime.place`),
which is below everything.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import queue
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from packer.runtime.place import FilePlace, parse_place


@dataclass(frozen=True)
class FileEntry:
    """One output file: its path relative to OUT, size and sha256 (hex).

    ``blob`` (a path relative to OUT, ``image/blobs/sha256/<hex>``) says the file's bytes are
    not a file of their own but bytes ``offset:offset + size`` of that image layer blob: the
    one copy of a weight file (in the weights stage's reply, before the build names the blob,
    ``image/unnamed/<path>``: :mod:`packer.oci.reread`).
    """

    path: str
    size: int
    sha256: str
    blob: str = ""
    offset: int = 0

    def place(self) -> FilePlace:
        """Where the file's bytes are, made by the rule its readers read the manifest with
        (:func:`packer.runtime.place.parse_place`).

        Raises:
            PlaceError: (a ValueError) a place no reader would take: a bug in the build.
        """
        where = {"blob": self.blob, "offset": self.offset} if self.blob else {}
        return parse_place(self.path, {"size": self.size, "sha256": self.sha256, **where})

    def as_json(self) -> dict[str, Any]:
        """The manifest's files entry; one held in a layer blob through :meth:`place`, so the
        build never writes a place its readers refuse."""
        return self.place().as_json() if self.blob else {"size": self.size, "sha256": self.sha256}


def canonical_json(data: Any) -> bytes:
    """Sorted keys, no insignificant whitespace except a trailing newline, UTF-8."""
    return (json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


# a final manifest's parts that only the image has (its own digests): the rest is the artifact manifest
IMAGE_KEYS = ("image", "image_files")


def split_artifact(manifest: dict[str, Any]) -> bytes:
    """The canonical artifact-manifest bytes contained in a final manifest: what the image ships
    as ``<prefix>/manifest.json`` (the same bytes for the image's own artifact manifest)."""
    return canonical_json({k: v for k, v in manifest.items() if k not in IMAGE_KEYS})


Identity = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns


def identity(st: os.stat_result) -> Identity:
    """What tells that a file is the one seen before and that stat shows no write to it since
    (a write that puts the mtime back, or lands within the same timestamp tick, does not show)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class HashThread(threading.Thread):
    """sha256 of a byte stream on a thread of its own (hashlib releases the GIL).

    ``update`` queues a buffer (at most ``depth`` wait, which bounds memory); the caller must
    not change a buffer after handing it over. ``hexdigest`` waits for the queue to drain.
    """

    def __init__(self, initial: bytes = b"", depth: int = 4) -> None:
        super().__init__(daemon=True, name="packer-hash")
        self.sha = hashlib.sha256(initial)
        self.error: BaseException | None = None
        self._jobs: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._closed = False
        self.start()

    def update(self, data: bytes | memoryview) -> None:
        self._jobs.put(data)

    def run(self) -> None:
        # Always drain the queue: a hasher that stopped would block its feeder forever.
        while (data := self._jobs.get()) is not None:
            if self.error is None:
                try:
                    self.sha.update(data)
                except Exception as e:  # noqa: BLE001 - raised by hexdigest in the caller's thread
                    self.error = e

    def close(self) -> None:
        """Stop taking data and wait for what is queued (idempotent)."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
            self.join()

    def hexdigest(self) -> str:
        self.close()
        if self.error is not None:
            raise self.error
        return self.sha.hexdigest()


def umask() -> int:
    """The process umask (read without changing it for longer than one call)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class TempFile:
    """A new file under a temporary name beside ``dest``, renamed into place by :meth:`commit`.

    The writer behind :func:`atomic_open`, and for writers that learn the final name only at
    the end (a blob named by its digest: :meth:`commit` takes another name in the same
    directory). A context manager: leaving it without a commit closes and removes the
    temporary file, and a failure of that cleanup is noted on the error that caused it, never
    raised over it.

    Args:
        dest: the final path (``.NAME.XXXX.tmp`` beside it until the commit).
        mode: the final file's mode, minus the umask (mkstemp alone would leave 0600).
        buffering: as for :func:`open`; 0 for writers that use :attr:`fd` directly.
    """

    def __init__(self, dest: str | Path, mode: int = 0o666, *, buffering: int = -1) -> None:
        self.dest = Path(dest)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.dest.name}.", suffix=".tmp", dir=self.dest.parent)
        self.path = Path(tmp)
        self._committed = False
        try:
            os.fchmod(fd, mode & ~umask())
            self.file: IO[bytes] = os.fdopen(fd, "wb", buffering=buffering)
        except BaseException as e:
            quiet_cleanup(e, functools.partial(os.close, fd), functools.partial(os.unlink, tmp))
            raise

    @property
    def fd(self) -> int:
        return self.file.fileno()

    def commit(self, dest: str | Path | None = None, *, fsync: bool = True,
               check: Callable[[Path], object] | None = None) -> None:
        """Flush and close the file, then ``check`` it (if given) and rename it into place.

        Args:
            dest: the final path, when not the one given at creation (the same directory).
            fsync: sync before the rename; False for a writer whose caller syncs a whole tree once.
            check: called with the complete, closed temporary file; what it raises leaves the
                destination untouched.
        """
        self.file.flush()
        if fsync:
            os.fsync(self.fd)
        self.file.close()
        if check is not None:
            check(self.path)
        os.replace(self.path, self.dest if dest is None else dest)
        self._committed = True

    def __enter__(self) -> TempFile:
        return self

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        if self._committed:
            return
        steps = (self.file.close, functools.partial(os.unlink, self.path))
        if error is None:
            for step in steps:
                with contextlib.suppress(FileNotFoundError):
                    step()
        else:
            quiet_cleanup(error, *steps)


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: int = 0o666, *,
                check: Callable[[Path], object] | None = None) -> Iterator[IO[bytes]]:
    """Open a temporary file next to ``path``; on success fsync and rename it into place.

    The final file gets ``mode`` minus the umask. ``check``, if given, is called with the
    complete, closed temporary file before the rename; whatever it raises leaves ``path``
    untouched. On any error the temporary file is removed (see :class:`TempFile`).
    """
    with TempFile(path, mode) as tmp:
        yield tmp.file
        tmp.commit(check=check)


def quiet_cleanup(error: BaseException, *steps: Callable[[], object]) -> None:
    """Run cleanup ``steps`` after ``error``; a step's own failure never replaces ``error``.

    Every step runs. A missing file counts as cleaned up; any other failure is chained onto
    ``error`` as a note ("cleanup also failed: ..."), so the one-line message the user sees
    stays the one that caused the cleanup and ``--debug`` still shows both.
    """
    for step in steps:
        try:
            step()
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001 - reported on the error that matters
            error.add_note(f"cleanup also failed: {type(e).__name__}: {e}")


def remove_tree(root: str | Path, *, ignore_errors: bool = False) -> None:
    """Remove the folder ``root`` and everything below it, links as links, iteratively.

    ``shutil.rmtree`` recurses once per level (Python 3.11), so a tree 1,100 levels deep ends in
    RecursionError and stays on disk; this walks with a list instead, at any depth.

    Raises:
        OSError: an entry cannot be removed (the tree is left partly removed); never with
            ``ignore_errors`` (a cleanup that must not replace the error behind it).
    """
    if ignore_errors:
        with contextlib.suppress(OSError):
            remove_tree(root)
        return
    stack: list[tuple[str, bool]] = [(os.fspath(root), False)]
    while stack:
        path, emptied = stack.pop()
        if emptied:
            os.rmdir(path)
            continue
        stack.append((path, True))
        with os.scandir(path) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    stack.append((entry.path, False))
                else:
                    os.unlink(entry.path)


def atomic_write_bytes(path: str | Path, data: bytes, mode: int = 0o666) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_open(path, mode) as f:
        f.write(data)
