"""A layer blob's bytes for the streamed load: by ``Range``, or by one pass of a whole answer.

A registry answers a span of a blob asked by ``Range`` with 206 and the span. A pull-through
cache that does not hold the blob yet (distribution's proxy mode, distribution issue #4667;
Harbor's proxy cache) and some P2P mirrors answer 200 with the whole blob instead. Rather than
refuse, :class:`BlobReader` makes the first such answer the blob's **pass**: its body is read
once, in order, and every span read waiting on the blob is filled as the body passes it, straight
into the reader's own buffer; bytes no waiting read wants are read into one piece of
:data:`PIECE` bytes and dropped. Memory stays the readers' buffers plus that piece; nothing is
written to disk. Proof is the caller's (:class:`~.remote.RemoteFile` proves every chunk it asked
for, whoever filled it), so a cache's corrupt copy is refused as a registry's is.

Which reads the pass serves:

* a read that starts at or past the body's position joins the pass and makes no request; the
  readers waiting take turns reading the body (one at a time, each until its own span is full),
  so the pass pauses when nobody waits and its idle time counts against no deadline;
* the pass does not start reading while a ``Range`` request of the blob awaits its answer, so
  the first reads of a load, sent together and all answered 200 by a cold cache, all join it;
* a read whose bytes the body has passed asks by ``Range`` again: a cache that has stored the
  blob meanwhile answers 206. One that answers 200 again is asked again after a pause
  (:data:`BEHIND_TRIES` times: a cold cache stores the blob while it serves it); then that
  answer is read up to the read's end and closed (part of the blob fetched a second time: the
  one case where a blob passes more than once, counted in ``unused``), and the blob's later
  reads wait no more (a registry that never serves ranges: reads out of file order, as a
  tensor-parallel rank's, each read the blob up to them: pull such an image instead);
* the pass drops at most :data:`SKIP` bytes to reach the nearest waiting read: reads further
  ahead are sent back to ask by ``Range`` (at once, then after pauses), so that a rank reading
  out of file order is served by ranges as soon as a cold cache has stored the blob.

A pass whose connection drops, or whose body ends early, is dropped; its waiting reads ask by
``Range`` again (a new pass if the answer is 200 once more: :data:`TRIES` in all per read).
A later load (this process's next one, or another process's) asks by ``Range`` first: a
blob's reader lives for one load (:meth:`~.remote.RemoteImage.end_load`).

Standard library only, below :mod:`.remote`; HTTP is :mod:`.registry`'s.
"""

from __future__ import annotations

import http.client
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .transport import TRIES, Deadline, RegistryError, Response

if TYPE_CHECKING:
    from .registry import Registry

PIECE = 1 << 20  # bytes of a pass no read wants: read into one buffer of this size and dropped
# the most bytes a pass drops to reach the nearest waiting read before it sends the reads back to
# Range once (a cold cache stores the blob meanwhile): a read out of file order (a tensor-parallel
# rank reads in the model's order) would otherwise leave every read before it behind the pass
SKIP = 4 << 20
TURN = 64 << 20  # the most one read of the body asks for at once, straight into a reader's buffer
BEHIND_TRIES = 3  # a read the pass has gone by (or sent back), answered 200 again: asked again this many times
BEHIND_PAUSE = 0.25  # seconds before the first ask again (doubled each time)


class _Wait:
    """A read waiting on the pass: blob bytes ``[start, start + len(view))``, ``got`` of them in;
    ``patient``: the pass may drop any number of bytes to reach it; ``lost``: why it was sent
    back to ``Range`` ("broke", "far"), "" while it waits."""

    __slots__ = ("got", "lost", "patient", "start", "view")

    def __init__(self, start: int, view: memoryview, patient: bool) -> None:
        self.start, self.view, self.got, self.lost, self.patient = start, view, 0, "", patient

    @property
    def end(self) -> int:
        return self.start + len(self.view)


class _Again(Exception):  # noqa: N818 - a signal inside this module, never raised out of it
    """A read the pass has gone by was answered 200 again: ask again after a pause."""


class BlobReader:
    """The bytes of one layer blob, by ``Range`` while the registry honours it, else from one
    pass of its whole answer (see the module's text).

    Args:
        registry: the image's registry client.
        digest: the blob (``sha256:...``), pinned by the image manifest.
        size: its size, from the image manifest.
        on_bytes: called with every count of bytes read off the network (the load's stats).
        on_pass: called with ``(bytes read, bytes no read wanted)`` of whole answers.
    """

    def __init__(self, registry: Registry, digest: str, size: int, on_bytes: Callable[[int], None],
                 on_pass: Callable[[int, int], None]) -> None:
        self.registry, self.digest, self.size = registry, digest, size
        self._on_bytes, self._on_pass = on_bytes, on_pass
        self._cond = threading.Condition()
        self._body: tuple[http.client.HTTPResponse, http.client.HTTPConnection] | None = None
        self._pos = 0  # the body's position: every byte before it has passed
        self._over = False  # a pass reached the blob's end
        self._waits: list[_Wait] = []
        self._pumping = False
        self._asking = 0  # Range requests of this blob awaiting their answer's status
        self.passes = 0  # whole answers taken as the blob's pass
        self._stubborn = False  # 200 again after pauses: the registry will not serve this blob's ranges

    def read(self, at: int, view: memoryview) -> None:
        """Fill ``view`` with the blob's bytes at ``at`` (unproven: the caller proves them).

        Raises:
            RegistryError: the registry cannot serve them (what :meth:`Registry.read_range`
                raises), or passes of the whole blob failed :data:`TRIES` times.
        """
        behind, w = 0, None
        for _ in range(TRIES + 2 * BEHIND_TRIES):
            patient = behind >= BEHIND_TRIES or self._stubborn
            if patient:
                self._stubborn = True  # asking again did not help: the next reads wait no more
            # a read sent back by the pass asks by Range at once, then after pauses while it gets 200
            w = self._join(at, view, patient) if w is None or w.lost != "far" else None
            if w is None:
                try:
                    w = self._ask(at, view, patient)
                except _Again:
                    behind += 1
                    time.sleep(BEHIND_PAUSE * 2 ** behind)
                    continue
            if w is None or self._await(w):
                return
            if w.lost == "far":
                behind += 1
                time.sleep(BEHIND_PAUSE * (2 ** behind - 2))
        raise RegistryError(f"{self.registry.ref}: blob {self.digest[:19]}...: the registry answered Range requests "
                            f"with the whole blob, and its whole answer broke off {self.passes} times; giving up")

    def _join(self, at: int, view: memoryview, patient: bool) -> _Wait | None:
        """A wait on the open pass, if there is one and it has not passed ``at``."""
        with self._cond:
            if self._body is None or at < self._pos:
                return None
            w = _Wait(at, view, patient)
            self._waits.append(w)
            return w

    def _ask(self, at: int, view: memoryview, last: bool) -> _Wait | None:
        """One ranged read; a 200 answer becomes the pass or a wait on it. None: ``view`` is full."""
        joined: list[_Wait] = []

        def answer(resp: Response, first: int) -> bool:
            if resp.status == 206:
                self._answered(counted)
                self._retire()
                return False
            sub = view[first - at:]
            w = self._take(resp, first, sub, last)
            if w is not None:
                joined.append(w)
            return True

        counted = [True]
        with self._cond:
            self._asking += 1
        try:
            self.registry.read_range(self.digest, at, view, self._on_bytes, on_answer=answer)
        finally:
            self._answered(counted)  # after the answer's request ended: its deadline is not the pass's
        return joined[0] if joined else None

    def _answered(self, counted: list[bool]) -> None:
        with self._cond:
            if counted[0]:
                counted[0] = False
                self._asking -= 1
                self._cond.notify_all()

    def _take(self, resp: Response, first: int, sub: memoryview, last: bool) -> _Wait | None:
        """A 200 to a Range request: the blob's pass, a wait on it, or (``last``) read up to the
        span here; None when ``sub`` is filled already.

        Raises:
            _Again: the pass has gone by ``first``: ask again after a pause.
        """
        w: _Wait | None = None
        with self._cond:
            if self._body is None and not self._over:
                self._adopt(resp)
                w = _Wait(first, sub, last)
                self._waits.append(w)
                return w
            if self._body is not None and first >= self._pos:
                w = _Wait(first, sub, last)
                self._waits.append(w)
        if w is not None or not last:
            resp.conn.close()
            self.registry.conns.release(resp.conn)
            if w is None:
                raise _Again
            return w
        self._read_up_to(resp, first, sub)
        return None

    def _adopt(self, resp: Response) -> None:
        """Make ``resp`` (a whole answer) the pass: its connection is no thread's to reuse."""
        self.registry.conns.release(resp.conn)
        self._body, self._pos, self.passes = (resp.resp, resp.conn), 0, self.passes + 1
        if self.passes == 1:
            sys.stderr.write(f"packer: {self.registry.ref}: the registry answered a Range request for blob "
                             f"{self.digest[:19]}... with the whole blob (HTTP 200; a pull-through cache that does "
                             "not hold it yet?): reading it once, in order, keeping only the spans this load reads, "
                             "each chunk proven\n")

    def _read_up_to(self, resp: Response, first: int, sub: memoryview) -> None:
        """Read a whole answer up to the end of ``sub`` (blob bytes at ``first``), then close it."""
        body: Response | None = None
        try:
            body = Response(resp.resp, resp.conn, Deadline(self.registry.budget,
                                                           f"blob {self.digest[:19]}... (whole)", first + len(sub)))
            body.deadline.watch(resp.conn)
            scratch, pos = memoryview(bytearray(min(PIECE, max(first, 1)))), 0
            while pos < first + len(sub):
                dst = scratch[: min(len(scratch), first - pos)] if pos < first else sub[pos - first:]
                n = body.readinto(dst)
                if not n:
                    raise RegistryError(f"{self.registry.ref}: blob {self.digest[:19]}...: the whole answer ended "
                                        f"at byte {pos}")
                self._on_bytes(n)
                self._on_pass(n, n if pos < first else 0)
                pos += n
        finally:
            if body is not None:
                body.deadline.end()
            resp.conn.close()
            self.registry.conns.release(resp.conn)

    def _retire(self) -> None:
        """A Range request was answered 206: the registry serves ranges now (a cache that has
        stored the blob), so a pass nobody waits on is closed, never to be opened again."""
        with self._cond:
            if self._body is not None and not self._waits and not self._pumping:
                self._over = True
                self._close()

    def _await(self, w: _Wait) -> bool:
        """Wait until ``w`` is filled, reading the body in turn; False: it was sent back to
        ``Range`` (``w.lost``: the pass broke, or would have dropped too much to reach it)."""
        with self._cond:
            while w.got < len(w.view) and not w.lost:
                if not self._pumping and not self._asking and self._body is not None:
                    self._pumping = True
                    break
                self._cond.wait(1.0)
            else:
                return not w.lost
        try:
            self._pump(w)
        finally:
            with self._cond:
                self._pumping = False
                self._cond.notify_all()
        return not w.lost

    def _pump(self, w: _Wait) -> None:
        """Read the body until ``w`` is filled (or the pass ends, or breaks: its waits lost)."""
        assert self._body is not None
        resp, conn = self._body
        body = Response(resp, conn, Deadline(self.registry.budget, f"blob {self.digest[:19]}... (whole, from byte "
                                             f"{self._pos})", self.size - self._pos))
        body.deadline.watch(conn)  # a body that drips is cut off, as any request's
        scratch = memoryview(bytearray(PIECE))
        try:
            while w.got < len(w.view) and not w.lost:
                dst, into = self._next(scratch)
                if not len(dst):
                    break  # the waits were sent back to Range
                n = body.readinto(dst)
                if not n:
                    raise http.client.IncompleteRead(b"")
                self._on_bytes(n)
                self._passed(dst[:n], into)
        except (OSError, http.client.HTTPException, RegistryError):
            self._drop()
        finally:
            body.deadline.end()

    def _next(self, scratch: memoryview) -> tuple[memoryview, _Wait | None]:
        """Where the body's next bytes go: the buffer of the wait they begin (and that wait), or
        ``scratch`` up to the nearest wait (None: dropped unless a read joins meanwhile); empty
        when the nearest is over :data:`SKIP` bytes ahead and none is patient: the waits are
        sent back to ``Range``."""
        with self._cond:
            pos, nearest = self._pos, self.size
            for x in self._waits:
                if x.start <= pos < x.end:
                    return x.view[pos - x.start: pos - x.start + TURN], x
                nearest = min(nearest, x.start)
            if nearest - pos > SKIP and not any(x.patient for x in self._waits):
                for x in self._waits:
                    x.lost = "far"
                self._waits = []
                self._cond.notify_all()
                return scratch[:0], None
            return scratch[: max(min(nearest - pos, len(scratch)), 1)], None

    def _passed(self, data: memoryview, into: _Wait | None) -> None:
        """``data`` passed at the body's position: copied to every wait it overlaps but ``into``
        (read straight into its buffer), the position moved, the filled waits woken."""
        with self._cond:
            pos, end, used = self._pos, self._pos + len(data), 0
            for x in self._waits:
                lo, hi = max(pos, x.start), min(end, x.end)
                if lo < hi:
                    used += hi - lo
                    if x is not into:
                        x.view[lo - x.start: hi - x.start] = data[lo - pos: hi - pos]
                    x.got = hi - x.start
            self._waits = [x for x in self._waits if x.got < len(x.view)]
            self._on_pass(len(data), max(len(data) - used, 0))
            self._pos = end
            if end >= self.size:
                self._over = True
                self._close()
            self._cond.notify_all()

    def _drop(self) -> None:
        """The pass broke: closed, its waits lost (they ask by Range again)."""
        with self._cond:
            for x in self._waits:
                x.lost = "broke"
            self._waits, self._pos = [], 0
            self._close()
            self._cond.notify_all()

    def close(self) -> None:
        """The load is over: a paused pass is closed (the next load asks by Range first)."""
        with self._cond:
            if not self._waits and not self._pumping:
                self._close()

    def _close(self) -> None:
        if self._body is not None:
            self._body[1].close()
            self._body = None
