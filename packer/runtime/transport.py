"""HTTP for the registry client under limits a hostile server cannot stretch.

A socket timeout bounds one operation, not a request: a server that sends a byte every half
second never trips it. So every request here runs under a :class:`Deadline` fixed when it
starts (``PACKER_REGISTRY_TIMEOUT``, plus one second per MiB of a blob span asked for, at
most what is left of the load's time), enforced by a timer that shuts the connection's socket
down when it passes, whatever the server does. One load (a :class:`Budget`) has a number of
requests (``PACKER_REGISTRY_MAX_REQUESTS``) and a time with requests in flight
(``PACKER_REGISTRY_DEADLINE``; idle time between lazy reads does not count). Each refusal is
one :class:`RegistryError` line naming what was being read and how long it took.

A connection that fails before the answer's headers (refused, reset, closed) is tried again,
:data:`TRIES` times in all, inside the request's deadline; the last error names the count.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, TypeVar

from .env import ArtifactMismatchError, printable
from .settings import RegistrySettings

_T = TypeVar("_T")
TRIES = 5  # attempts of one request, and of one ranged read (the first and the resumes after a drop)
RATE = 1 << 20  # bytes a second a blob span must average, beyond the timeout, before its deadline
STEP = 1 << 20  # a document's body is read in pieces of this size, never allocated whole up front


class RegistryError(ArtifactMismatchError):
    """The registry cannot serve the streamed load: one line naming the reference and why."""


def named_address(url: str, what: str) -> urllib.parse.SplitResult:
    """``url``, an address a registry named (a redirect's ``Location``, a token realm), split and
    checked before a connection is opened to it.

    ``what`` starts the message (``"<ref>: <request>: redirected to"``).

    Raises:
        RegistryError: not http(s); no host; credentials in it; a port that is no number from 1
            to 65535; anything but printable ASCII (no space) anywhere in it (a server
            percent-encodes a path; ``http.client`` cannot send another): one line, the address
            escaped.
    """
    try:
        u = urllib.parse.urlsplit(url)
        port = u.port  # ValueError: not a number, or out of range
    except ValueError:
        u, port = None, None
    if (u is None or u.scheme not in ("http", "https") or not u.hostname or "@" in u.netloc or port == 0
            or not url.isascii() or not url.isprintable() or " " in url):
        raise RegistryError(f"{what} {printable(url[:100])!r}: not an http(s) address of a host; refused, "
                            "nothing sent")
    return u


class Budget:
    """One load's limits: the requests it made, and its time with requests in flight.

    Args:
        settings: the load's snapshot of the registry knobs.
        label: the image reference, first in every message.
    """

    def __init__(self, settings: RegistrySettings, label: str) -> None:
        self.settings, self.label = settings, label
        self.requests = 0  # HTTP requests made (redirects, retries and token requests included)
        self._busy, self._since, self._active = 0.0, 0.0, 0
        self._lock = threading.Lock()

    def busy(self) -> float:
        """Seconds so far with at least one request of this load in flight."""
        with self._lock:
            return self._busy + (time.monotonic() - self._since if self._active else 0.0)

    def count(self, what: str) -> None:
        """One more request, for ``what``.

        Raises:
            RegistryError: over ``PACKER_REGISTRY_MAX_REQUESTS``.
        """
        with self._lock:
            self.requests += 1
            over = self.requests > self.settings.max_requests
        if over:
            raise RegistryError(f"{self.label}: {what}: this load made {self.settings.max_requests} requests "
                                "already, its cap (PACKER_REGISTRY_MAX_REQUESTS); refused")

    def _enter(self) -> None:
        with self._lock:
            if not self._active:
                self._since = time.monotonic()
            self._active += 1

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1
            if not self._active:
                self._busy += time.monotonic() - self._since


class Deadline:
    """The time one request (its redirects, retries and body) may take, fixed when it starts.

    Args:
        budget: the load it counts against (in flight from here until :meth:`end`).
        what: what is asked for, in messages ("the image manifest", "blob sha256:...").
        size: the bytes of a blob span asked for (0 for a document): one more second per MiB.

    Raises:
        RegistryError: the load's time is spent already.
    """

    def __init__(self, budget: Budget, what: str, size: int = 0) -> None:
        s = budget.settings
        self.budget, self.what, self.start = budget, what, time.monotonic()
        own = s.timeout + size / RATE
        left = s.deadline - budget.busy()
        if left <= 0:
            raise RegistryError(f"{budget.label}: {what}: not asked; this load has had requests in flight for "
                                f"{budget.busy():.1f} s, its deadline (PACKER_REGISTRY_DEADLINE={s.deadline:g})")
        self.by_load = left < own
        self.seconds = min(own, left)
        self.fired = False
        self._conn: http.client.HTTPConnection | None = None
        self._timer: threading.Timer | None = None
        self._ended = False
        budget._enter()

    def left(self) -> float:
        return self.start + self.seconds - time.monotonic()

    def watch(self, conn: http.client.HTTPConnection) -> None:
        """Shut ``conn``'s socket down when the deadline passes (a blocked read then returns)."""
        self._cancel()
        self._conn = conn
        self.check()
        self._timer = threading.Timer(max(self.left(), 0.0), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        self.fired = True
        conn = self._conn
        sock = getattr(conn, "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed: nothing left to cut
                sock.shutdown(socket.SHUT_RDWR)

    def check(self) -> None:
        """Raises:
            RegistryError: the deadline has passed."""
        if self.fired or self.left() <= 0:
            self.fired = True
            raise self.error()

    def error(self) -> RegistryError:
        s, took = self.budget.settings, time.monotonic() - self.start
        if self.by_load:
            why = (f"this load's time with requests in flight reached its deadline "
                   f"(PACKER_REGISTRY_DEADLINE={s.deadline:g})")
        else:
            why = (f"over its deadline of {self.seconds:.1f} s (PACKER_REGISTRY_TIMEOUT={s.timeout:g}, plus a "
                   "second per MiB of a blob span): the registry is too slow or drips its answer")
        return RegistryError(f"{self.budget.label}: {self.what}: cut off after {took:.1f} s, {why}")

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def end(self) -> None:
        """The request is over (answered, read, or failed): its timer stops, the load's clock
        counts it no more. Idempotent."""
        self._cancel()
        if not self._ended:
            self._ended = True
            self.budget._leave()


class _BoundedBody:
    """An answer's socket file that refuses a read of no bound.

    ``http.client`` reads a chunk whose size line says ``-1`` with ``read(-1)``: to the end of
    the stream, whatever bound its caller asked for (a hostile chunked answer to a 4 MiB
    document then fills memory for as long as the deadline lasts). Every other read passes.
    """

    def __init__(self, fp: Any) -> None:
        self._fp = fp

    def read(self, n: int | None = -1) -> bytes:
        if n is None or n < 0:
            raise http.client.HTTPException("the answer's chunked encoding names a negative chunk size")
        return self._fp.read(n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fp, name)


class Response:
    """An answer whose status was taken: its headers, a body read under the request's deadline.

    A context manager: leaving it ends the request (:meth:`Deadline.end`).
    """

    def __init__(self, resp: http.client.HTTPResponse, conn: http.client.HTTPConnection, deadline: Deadline) -> None:
        self.resp, self.conn, self.deadline, self.status = resp, conn, deadline, resp.status

    def __enter__(self) -> Response:
        return self

    def __exit__(self, *exc: object) -> None:
        self.deadline.end()

    def header(self, name: str) -> str:
        return self.resp.getheader(name) or ""

    def reason(self) -> str:
        return printable(str(self.resp.reason)[:80])  # the server's words: escaped, every entry point

    def read(self, cap: int, what: str) -> bytes:
        """The whole body, at most ``cap`` bytes, in pieces (never ``cap`` allocated up front).

        Raises:
            RegistryError: over ``cap``, past the deadline, silent for the timeout, broken off
                (the bytes it got named), or out of memory.
        """
        if cap < 0:
            raise ValueError(f"Response.read: a cap of {cap} bytes")
        out = bytearray()
        try:
            while True:
                want = min(STEP, cap + 1 - len(out))
                piece = self._io(lambda: self.resp.read(want))  # noqa: B023 - called at once
                if not piece:
                    break
                out += piece
                if len(out) > cap:
                    self.conn.close()
                    raise RegistryError(f"{self.deadline.budget.label}: {what} is over its cap of {cap} bytes")
        except MemoryError:
            self.conn.close()
            raise RegistryError(f"{self.deadline.budget.label}: {what}: out of memory after {len(out)} bytes "
                                "of the answer") from None
        except (OSError, http.client.HTTPException) as e:  # a reset, a body cut short, a bad chunk
            self.conn.close()
            raise RegistryError(f"{self.deadline.budget.label}: {what}: the answer broke off after {len(out)} "
                                f"bytes ({type(e).__name__}: {printable(str(e))[:120]})") from None
        return bytes(out)

    def readinto(self, view: memoryview) -> int:
        """Bytes of the body into ``view`` (as many as came; 0 at its end).

        Raises:
            RegistryError: past the deadline, or no byte for ``PACKER_REGISTRY_TIMEOUT``
                (not resumed: that would multiply the deadline); OSError, HTTPException: the
                connection failed.
        """
        return self._io(lambda: self.resp.readinto(view))

    def _io(self, read: Callable[[], _T]) -> _T:
        try:
            got = read()
        except Exception as e:
            if self.deadline.fired or self.deadline.left() <= 0:
                self.conn.close()
                raise self.deadline.error() from None
            if isinstance(e, TimeoutError):  # the socket's timeout: the server went silent
                self.conn.close()
                raise RegistryError(f"{self.deadline.budget.label}: {self.deadline.what}: no byte came for "
                                    f"{self.deadline.budget.settings.timeout:g} s (PACKER_REGISTRY_TIMEOUT); "
                                    "the registry stalled") from None
            raise
        if self.deadline.fired or self.deadline.left() <= 0:  # a short read: the timer cut it
            self.conn.close()
            raise self.deadline.error()
        return got


class Connections:
    """One registry's connections: one per thread and origin, opened with the TLS context.

    Args:
        budget: the load's limits (every request counted).
        context: the TLS context, made on first use.
        advice: a hint for a TLS failure that plain HTTP might explain ("" for none).
    """

    def __init__(self, budget: Budget, context: Callable[[], ssl.SSLContext], advice: str) -> None:
        self.budget, self._context, self._advice = budget, context, advice
        self._ctx: ssl.SSLContext | None = None
        self._local = threading.local()

    def _conn(self, scheme: str, netloc: str) -> http.client.HTTPConnection:
        conns: dict[tuple[str, str], http.client.HTTPConnection] = self._local.__dict__.setdefault("conns", {})
        key = (scheme, netloc)
        if key not in conns:
            timeout = self.budget.settings.timeout
            if scheme == "https":
                if self._ctx is None:
                    self._ctx = self._context()
                conns[key] = http.client.HTTPSConnection(netloc, timeout=timeout, context=self._ctx)
            else:
                conns[key] = http.client.HTTPConnection(netloc, timeout=timeout)
        return conns[key]

    def drop(self, scheme: str, netloc: str) -> None:
        conn = self._local.__dict__.get("conns", {}).pop((scheme, netloc), None)
        if conn is not None:
            conn.close()

    def release(self, conn: http.client.HTTPConnection) -> None:
        """Hand ``conn`` (one of this thread's, whose answer is still being read) to its caller:
        this thread opens another for its next request."""
        conns = self._local.__dict__.get("conns", {})
        for key, c in list(conns.items()):
            if c is conn:
                del conns[key]

    def drop_all(self) -> None:
        for conn in self._local.__dict__.pop("conns", {}).values():
            conn.close()

    def send(self, url: str, headers: dict[str, str], deadline: Deadline) -> Response:
        """One GET of ``url`` under ``deadline``; a connection that fails before the answer's
        headers is opened again, :data:`TRIES` attempts in all.

        Raises:
            RegistryError: an untrusted certificate, the deadline or the request cap passed, or
                every attempt failed (the count and the last reason named).
        """
        u = urllib.parse.urlsplit(url)
        path = u.path + (f"?{u.query}" if u.query else "")
        label = self.budget.label
        for attempt in range(1, TRIES + 1):
            self.budget.count(deadline.what)
            conn = self._conn(u.scheme, u.netloc)
            try:
                deadline.watch(conn)
                if conn.sock is None:
                    conn.connect()
                if deadline.fired:  # it passed while the connection opened: its timer had no socket to cut
                    self.drop(u.scheme, u.netloc)
                    raise deadline.error()
                conn.request("GET", path, headers=headers)
                resp = conn.getresponse()
                resp.fp = _BoundedBody(resp.fp)  # type: ignore[assignment]  # the file http.client reads
                return Response(resp, conn, deadline)
            except ssl.SSLCertVerificationError as e:
                self.drop(u.scheme, u.netloc)
                raise RegistryError(f"{label}: TLS certificate of {u.netloc} not trusted ({e.verify_message}); "
                                    f"give its CA in PACKER_REGISTRY_CA or /etc/containers/certs.d/"
                                    f"{u.netloc}/ca.crt") from None
            except (ConnectionError, http.client.HTTPException, TimeoutError, OSError) as e:
                self.drop(u.scheme, u.netloc)
                if deadline.fired or deadline.left() <= 0:
                    raise deadline.error() from None
                deterministic = isinstance(e, ssl.SSLError)  # plain HTTP on a TLS port: the same every time
                if attempt == TRIES or deterministic:
                    hint = self._advice if deterministic else ""
                    tries = "1 try" if attempt == 1 else f"{attempt} tries"
                    raise RegistryError(f"{label}: {deadline.what}: cannot reach {u.netloc} after {tries} "
                                        f"({printable(str(e))[:200] or type(e).__name__}){hint}") from None
                time.sleep(min(0.05 * attempt, max(deadline.left(), 0.0)))
        raise AssertionError("unreachable")
