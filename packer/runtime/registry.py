"""An OCI registry client for the streamed load: references, auth, TLS, ranged blob reads.

What :mod:`.remote` needs from a registry (the distribution API's ``GET /v2/<repo>/manifests``
and ``/blobs``), on the standard library alone: the runtime ships into serving images that
hold torch and nothing else, so a client library (``requests``, ``oras``) would be a new
dependency of every one of them for four requests. What such libraries get right is kept:

* **References**: ``oci://HOST[:PORT]/REPO[:TAG][@sha256:HEX]``, the distribution project's
  grammar (:data:`REF`, shared with ``packer push``); a tag is resolved once, and the digest
  reported.
* **Auth** as users have it: anonymous; HTTP Basic; the token flow (a ``401`` with
  ``WWW-Authenticate: Bearer realm=...,service=...,scope=...`` → a token from the realm,
  with the credentials when there are some), refreshed once when a token expires mid-load.
  Credentials come from the first auth file holding the registry (``PACKER_REGISTRY_AUTH``,
  ``REGISTRY_AUTH_FILE``, ``$XDG_RUNTIME_DIR/containers/auth.json``,
  ``~/.config/containers/auth.json``, ``$DOCKER_CONFIG/config.json``,
  ``~/.docker/config.json``: a Kubernetes ``dockerconfigjson`` pull secret mounted as a file is
  one), by ``host/repo`` prefix then host, as podman and skopeo look them up. Credential helpers
  are not run (no program named by a file runs here).
* **TLS** with the system's CAs plus ``PACKER_REGISTRY_CA`` (a PEM file) and the registry's
  own folder of ``/etc/containers/certs.d/HOST[:PORT]/*.crt`` or ``/etc/docker/certs.d/...``;
  plain HTTP only for hosts listed in ``PACKER_REGISTRY_INSECURE`` (``host:port,...``).
* **Redirects** (a blob served from object storage): followed, at most 5, the credentials
  dropped when the host changes.
* **Ranged reads** that resume: :meth:`Registry.read_range` reads into the caller's buffer
  and re-asks from the byte it reached when the connection drops (5 tries); an answer of the
  whole blob to a ``Range`` request (a cold pull-through cache) goes to the caller's
  ``on_answer`` (:class:`~.blob_reader.BlobReader` reads it once, in order), else it is one
  line of :class:`RegistryError`.

Every byte read here is proven by the caller (a digest it pins); nothing here is trusted.
"""

from __future__ import annotations

import base64
import glob
import hashlib
import http.client
import os
import re
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .env import STREAM_SCHEME, ArtifactMismatchError, is_ref, printable
from .reading import loads_json, read_bytes
from .settings import RegistrySettings
from .transport import TRIES, Budget, Connections, Deadline, RegistryError, Response, named_address

_DOMAIN_PART = r"(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])"
_HOST = rf"(?:{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*|\[[0-9A-Fa-f:.]+\])"
DOMAIN = rf"{_HOST}(?::[0-9]{{1,5}})?"
COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
TAG = r"[\w][\w.-]{0,127}"
DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
# the distribution project's reference grammar (reference/regexp.go) with the host required
REF = re.compile(rf"(?P<domain>{DOMAIN})/(?P<path>{COMPONENT}(?:/{COMPONENT})*)"
                 rf"(?::(?P<tag>{TAG}))?(?:@(?P<digest>{DIGEST}))?", re.ASCII)
MAX_NAME = 255  # the distribution's limit on host/repository
_SHA256 = re.compile(r"sha256:[0-9a-f]{64}")
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v2+json")
MAX_DOC = 4 * 2**20  # a manifest or config: the size the distribution spec has registries accept
MAX_TOKEN_ANSWER = 64 * 2**10  # a token server's answer: real ones are a few KiB of JWT
MAX_LAYERS = 128  # layers of one image: Docker's overlay storage refuses more (125), no runnable image has them

__all__ = ["MAX_DOC", "MAX_LAYERS", "TRIES", "OciRef", "Registry", "RegistryError", "credentials", "parse_ref",
           "tls_context"]


@dataclass(frozen=True)
class OciRef:
    """A parsed ``oci://`` reference: ``host`` (with its port), ``repo``, ``tag`` and/or ``digest``."""

    host: str
    repo: str
    tag: str | None
    digest: str | None

    def __str__(self) -> str:
        at = f"@{self.digest}" if self.digest else ""
        return f"{STREAM_SCHEME}{self.host}/{self.repo}{':' + self.tag if self.tag and not at else ''}{at}"


def parse_ref(text: str) -> OciRef:
    """``oci://HOST[:PORT]/REPO[:TAG][@sha256:HEX]`` as an :class:`OciRef`.

    Raises:
        RegistryError: not that grammar, no tag nor digest, a digest other than sha256, or a
            name over 255 characters.
    """
    body = text[len(STREAM_SCHEME):] if is_ref(text) else ""
    m = REF.fullmatch(body)
    shown = repr(text)[:100]
    if m is None:
        case = ("; write the repository (and a digest's hex) in lower case, as OCI distribution names them: "
                "only the host and the tag may hold capitals" if REF.fullmatch(body.lower()) else "")
        raise RegistryError(f"{shown} is not a registry reference; expected "
                            f"oci://HOST[:PORT]/REPO@sha256:<64 hex> (or :TAG, resolved once){case}")
    digest = m.group("digest")
    if digest is not None and not _SHA256.fullmatch(digest):
        raise RegistryError(f"{shown}: only sha256 digests (64 lowercase hex digits) are taken")
    if digest is None and m.group("tag") is None:
        raise RegistryError(f"{shown}: name the image by digest (@sha256:...) or by tag (:TAG)")
    if len(f"{m.group('domain')}/{m.group('path')}") > MAX_NAME:
        raise RegistryError(f"{shown}: the repository name is longer than {MAX_NAME} characters")
    return OciRef(m.group("domain"), m.group("path"), m.group("tag"), digest)


# ---------------------------------------------------------------------------------------
# credentials and TLS


def _auth_files(settings: RegistrySettings) -> list[Path]:
    env, home = os.environ, Path.home()
    named = [settings.auth, env.get("REGISTRY_AUTH_FILE")]
    if env.get("XDG_RUNTIME_DIR"):
        named.append(str(Path(env["XDG_RUNTIME_DIR"]) / "containers" / "auth.json"))
    named.append(str(home / ".config" / "containers" / "auth.json"))
    named.append(str(Path(env.get("DOCKER_CONFIG") or home / ".docker") / "config.json"))
    return [Path(p) for p in named if p]


def _entry_keys(ref: OciRef) -> list[str]:
    """Auth-file keys for ``ref``, most specific first: ``host/a/b``, ``host/a``, ``host``."""
    parts = ref.repo.split("/")
    keys = [f"{ref.host}/{'/'.join(parts[:i])}" for i in range(len(parts), 0, -1)] + [ref.host]
    return keys + [f"https://{ref.host}", f"http://{ref.host}", f"https://{ref.host}/v1/", f"https://{ref.host}/v2/"]


def credentials(ref: OciRef, settings: RegistrySettings | None = None) -> tuple[str, str] | None:
    """``(user, password)`` for ``ref`` from the first auth file that names its registry.

    Raises:
        RegistryError: an auth file that names the registry but cannot be read, or whose
            entry is not ``{"auth": base64("user:password")}``.
    """
    for path in _auth_files(settings or _settings(ref)):
        try:
            doc = loads_json(read_bytes(path, "json"), str(path))
        except (OSError, ArtifactMismatchError) as e:
            if isinstance(e, FileNotFoundError) or not path.exists():
                continue
            raise RegistryError(f"{path}: not an auth file ({printable(str(e))})") from None
        auths = doc.get("auths") if isinstance(doc, dict) else None
        if not isinstance(auths, dict):
            raise RegistryError(f"{path}: not an auth file (JSON with \"auths\")")
        for key in _entry_keys(ref):
            if key in auths:
                return _decode_entry(path, key, auths[key])
    return None


def _decode_entry(path: Path, key: str, entry: Any) -> tuple[str, str]:
    try:
        if entry.get("username") is not None:
            return str(entry["username"]), str(entry.get("password", ""))
        user, sep, password = base64.b64decode(entry["auth"], validate=True).decode().partition(":")
    except (AttributeError, KeyError, TypeError, ValueError):
        user, sep, password = "", "", ""
    if not sep:
        raise RegistryError(f"{path}: auths[{key!r}] has no \"auth\" of base64 user:password "
                            "(credential helpers and identity tokens are not used by the streamed load)")
    return user, password


def tls_context(host: str, ca: str = "") -> ssl.SSLContext:
    """The system's CAs, plus ``ca`` (``PACKER_REGISTRY_CA``) and the registry's certs.d folder."""
    ctx = ssl.create_default_context()
    extra = [ca]
    for base in ("/etc/containers/certs.d", "/etc/docker/certs.d"):
        extra += sorted(glob.glob(os.path.join(base, glob.escape(host), "*.crt")))
    for path in filter(None, extra):
        try:
            ctx.load_verify_locations(cafile=path)
        except (OSError, ssl.SSLError) as e:
            raise RegistryError(f"{path}: cannot be read as a PEM CA bundle ({printable(str(e))})") from None
    return ctx


def _settings(ref: OciRef) -> RegistrySettings:
    """The registry knobs from the environment, a bad value one line naming the variable."""
    try:
        return RegistrySettings.from_environ()
    except ValueError as e:
        raise RegistryError(f"{ref}: {str(e).removeprefix('packer_loader: ')}") from None


def _hostname(netloc: str) -> str:
    return (urllib.parse.urlsplit(f"//{netloc}").hostname or "").lower()


# ---------------------------------------------------------------------------------------
# the client


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    """``(scheme, params)`` of a ``WWW-Authenticate`` header (RFC 7235, one challenge)."""
    scheme, _, rest = header.strip().partition(" ")
    params = {k.lower(): v for k, v in re.findall(r'(\w+)="([^"]*)"', rest)}
    params.update({k.lower(): v for k, v in re.findall(r'(\w+)=([^",\s]+)', rest) if k.lower() not in params})
    return scheme.lower(), params


class Registry:
    """One repository of one registry for one load: its settings (read from the environment
    once, here), connections, token, and limits (:class:`~.transport.Budget`).

    Where credentials go: the Authorization this repository takes (Basic, or a token) is sent
    only to the registry's own scheme and host:port, never after a redirect elsewhere; Basic
    credentials go to a token realm only on the registry's own host name, over HTTPS or over
    plain HTTP to a ``host:port`` listed in ``PACKER_REGISTRY_INSECURE``; a realm elsewhere over
    HTTPS is asked for a token with no credentials; one over plain HTTP not listed is refused
    and asked nothing.

    Args:
        ref: the image reference (its ``host`` and ``repo``).
        auth: ``(user, password)``, else looked up in the auth files (:func:`credentials`).

    Raises:
        RegistryError: a registry variable of the environment that is malformed.
    """

    def __init__(self, ref: OciRef, auth: tuple[str, str] | None = None) -> None:
        self.settings = _settings(ref)
        self.ref = ref
        self.scheme = "http" if ref.host in self.settings.insecure else "https"
        self.base = f"{self.scheme}://{ref.host}"
        self._auth = auth if auth is not None else credentials(ref, self.settings)
        self._header: str | None = None  # the Authorization this repository takes
        self._lock = threading.Lock()
        self.budget = Budget(self.settings, str(ref))
        self.conns = Connections(self.budget, lambda: tls_context(self.ref.host, self.settings.ca),
                                 f"; if it answers in plain HTTP (a test registry), set PACKER_REGISTRY_INSECURE="
                                 f"{ref.host} (now {','.join(self.settings.insecure)!r})")
        self.resumed = 0  # ranged reads re-asked after a dropped connection

    @property
    def requests(self) -> int:
        """HTTP requests made so far (redirects, retries and token requests included)."""
        return self.budget.requests

    def _own(self, url: str) -> bool:
        """Whether ``url`` is the registry itself (scheme and host:port): the one place its
        Authorization goes."""
        u = urllib.parse.urlsplit(url)
        return (u.scheme, u.netloc) == (self.scheme, self.ref.host)

    def get(self, path: str, headers: dict[str, str] | None = None, *, what: str = "", size: int = 0) -> Response:
        """``GET base+path`` with the repository's auth, following redirects (5 at most), under
        one deadline (:class:`~.transport.Deadline`; ``size``: the bytes of a blob span asked).

        Returns:
            a response of status 200 or 206 whose body is still to be read: use it in ``with``.

        Raises:
            RegistryError: another status (its code and reason, escaped), no credentials where
                the registry asks for them, or a limit passed.
        """
        what = what or f"GET {path}"
        self.budget.label = str(self.ref)  # a tag resolved: messages name the pinned digest
        deadline = Deadline(self.budget, what, size)
        try:
            return self._follow(self.base + path, dict(headers or {}), deadline)
        except BaseException:
            deadline.end()
            raise

    def _follow(self, url: str, headers: dict[str, str], deadline: Deadline) -> Response:
        hops, renewed = 0, False
        while True:
            own = self._own(url)
            sent = dict(headers)
            if own and self._header:
                sent["Authorization"] = self._header
            resp = self.conns.send(url, sent, deadline)
            if resp.status in (200, 206):
                return resp
            body = resp.read(64 * 1024, f"the answer {resp.status} to {deadline.what}")  # drained: reused
            if resp.status in (301, 302, 303, 307, 308) and hops < 5:
                where, hops = resp.header("Location"), hops + 1
                try:
                    url = urllib.parse.urljoin(url, where)
                except ValueError:  # an unbalanced "[" (an IPv6 host): checked below as it was given
                    url = where
                named_address(url, f"{self.ref}: {deadline.what}: redirected to")
                continue
            if resp.status == 401 and own and not renewed:
                self._authorize(resp.header("WWW-Authenticate"))
                renewed = True
                continue
            raise RegistryError(f"{self.ref}: {deadline.what} answered {resp.status} {resp.reason()}"
                                f"{_why(body)}{self._advice(resp.status)}")

    def _advice(self, status: int, elsewhere: str = "") -> str:
        if status == 404 and self.ref.digest is None:
            return (f"; {self.ref.repo} on {self.ref.host} has no tag {self.ref.tag} (check the tag `packer push` "
                    "was given, or stream the digest it printed)")
        if status == 404:
            return (f"; {self.ref.repo} on {self.ref.host} has no such image (the digest to stream is the "
                    "first one `packer push` prints)")
        if status in (401, 403):
            if elsewhere and self._auth is not None:
                return (f"; the credentials for {self.ref.host} were not sent to {elsewhere}, another host "
                        "(credentials go only to the registry's own host)")
            return ("; put credentials for the registry in an auth file (podman login, docker login, "
                    "or a pull secret's .dockerconfigjson in PACKER_REGISTRY_AUTH)" if self._auth is None
                    else "; the credentials found for it are refused")
        return ""

    def _authorize(self, header: str) -> None:
        scheme, params = _challenge(header)
        basic = _basic(self._auth)
        if scheme == "basic":
            if basic is None:
                raise RegistryError(f"{self.ref}: the registry asks for credentials{self._advice(401)}")
            with self._lock:
                self._header = basic
            return
        if scheme != "bearer" or not params.get("realm"):
            raise RegistryError(f"{self.ref}: the registry asks for {printable(header[:80])!r}, "
                                "neither Basic nor a Bearer token challenge")
        realm = params["realm"]
        same_host = self._realm_allowed(realm)
        if not same_host:  # another host gets only the credentials given for that host itself
            given = credentials(OciRef(urllib.parse.urlsplit(realm).netloc, self.ref.repo, None, None), self.settings)
            basic = _basic(given)
        query = {"scope": params.get("scope") or f"repository:{self.ref.repo}:pull"}
        if params.get("service"):
            query["service"] = params["service"]
        url = realm + ("&" if "?" in realm else "?") + urllib.parse.urlencode(query)
        netloc = urllib.parse.urlsplit(url).netloc
        deadline = Deadline(self.budget, f"a token from {netloc}")
        try:
            resp = self.conns.send(url, {"Authorization": basic} if basic else {}, deadline)
            body = resp.read(MAX_TOKEN_ANSWER, f"the token server {netloc}'s answer")
        finally:
            deadline.end()
        if resp.status != 200:
            raise RegistryError(f"{self.ref}: the token server {netloc} answered {resp.status} {resp.reason()}"
                                f"{_why(body)}{self._advice(401, '' if same_host or basic else netloc)}")
        try:
            doc = loads_json(body, "the token server's answer")
            token = doc.get("token") or doc.get("access_token")
        except (ArtifactMismatchError, AttributeError):
            token = None
        if not isinstance(token, str) or not token or not token.isascii() or not token.isprintable():
            raise RegistryError(f"{self.ref}: the token server {netloc}'s answer holds no token")
        with self._lock:
            self._header = f"Bearer {token}"

    def _realm_allowed(self, realm: str) -> bool:
        """Whether the token realm ``realm`` is on the registry's own host name (it may then get
        the Basic credentials); a realm that may be asked nothing is refused.

        Raises:
            RegistryError: not an http(s) address, credentials in the address, or plain HTTP to
                a host:port not listed in ``PACKER_REGISTRY_INSECURE``: one line naming the
                host that asked, the realm and why.
        """
        u = named_address(realm, f"{self.ref}: {self.ref.host} names the token realm")
        shown = printable(realm[:100])
        if u.scheme == "http" and u.netloc not in self.settings.insecure:
            raise RegistryError(f"{self.ref}: {self.ref.host} names the token realm {shown!r} in plain HTTP; "
                                f"refused, nothing sent: credentials and tokens go in plain HTTP only to a "
                                f"host:port listed in PACKER_REGISTRY_INSECURE ({u.netloc} is not)")
        return (u.hostname or "").lower() == _hostname(self.ref.host)

    # -- documents and blobs

    def manifest(self) -> tuple[bytes, str]:
        """The image manifest's bytes and digest: proven against the reference's digest, or
        the tag resolved (its digest computed here from the bytes).

        Raises:
            RegistryError: not an image manifest (an index: name the platform's manifest by
                digest), over 4 MiB, or bytes whose sha256 is not the pinned digest.
        """
        which = self.ref.digest or self.ref.tag
        with self.get(f"/v2/{self.ref.repo}/manifests/{which}", {"Accept": ", ".join(MANIFEST_TYPES)},
                      what="the image manifest") as resp:
            data = resp.read(MAX_DOC, "the image manifest")
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if self.ref.digest and digest != self.ref.digest:
            raise RegistryError(f"{self.ref}: the registry's manifest has digest {digest}; not the pinned image")
        media = printable(resp.header("Content-Type").split(";")[0].strip()[:80])
        if media not in MANIFEST_TYPES:
            raise RegistryError(f"{self.ref}: a {media or 'document'} of no known type, not an image manifest "
                                "(for an index, name the platform's manifest by its digest)")
        return data, digest

    def _blob_path(self, digest: object) -> str:
        """The API path of blob ``digest``, a digest from a document checked before it names anything.

        Raises:
            RegistryError: not ``sha256:`` and 64 lowercase hex digits.
        """
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise RegistryError(f"{self.ref}: the image names a blob {printable(str(digest)[:80])!r}, "
                                "not sha256:<64 hex>")
        return f"/v2/{self.ref.repo}/blobs/{digest}"

    def blob(self, digest: str, size: int) -> bytes:
        """A whole small blob (config, compressed layer) of ``size`` bytes, proven by its digest."""
        path = self._blob_path(digest)
        what = f"blob {digest[:19]}... ({size} bytes)"
        with self.get(path, what=what, size=size) as resp:
            data = resp.read(size, what)
        if len(data) != size or "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise RegistryError(f"{self.ref}: blob {digest} as served ({len(data)} bytes) is not the one the "
                                "image manifest pins; the registry's copy is corrupt")
        return data

    def read_range(self, digest: str, at: int, view: memoryview, on_bytes: Callable[[int], None] | None = None, *,
                   on_answer: Callable[[Response, int], bool] | None = None) -> None:
        """Bytes ``at:at+len(view)`` of blob ``digest`` into ``view``, resumed after a drop.

        Args:
            digest: the blob.
            at: its first byte asked.
            view: where the bytes go.
            on_bytes: called with each count of bytes read.
            on_answer: called with each answer (status 200 or 206) and the first byte it was
                asked for, before its body is read: True when it took the answer (read here no
                further). :class:`~.blob_reader.BlobReader` takes a whole answer (200) this way.

        Raises:
            RegistryError: the registry ignores ``Range`` (answers 200 with the whole blob) and
                ``on_answer`` did not take it, answers another range, the connection drops 5
                times, or a limit passed.
        """
        got, tries = 0, 0
        path = self._blob_path(digest)
        while got < len(view):
            first = at + got
            what = f"bytes {first}-{at + len(view) - 1} of blob {digest[:19]}..."
            try:
                with self.get(path, {"Range": f"bytes={first}-{at + len(view) - 1}"}, what=what,
                              size=len(view) - got) as resp:
                    if on_answer is not None and on_answer(resp, first):
                        return
                    got = self._take_range(resp, digest, first, view, got, on_bytes)
            except (ConnectionError, http.client.HTTPException, TimeoutError, OSError) as e:
                self.conns.drop_all()
                tries += 1
                if tries >= TRIES:
                    raise RegistryError(f"{self.ref}: blob {digest[:19]}... dropped {tries} times at byte "
                                        f"{at + got} ({type(e).__name__}); giving up") from None
                with self._lock:
                    self.resumed += 1
                time.sleep(0.05 * tries)

    def _take_range(self, resp: Response, digest: str, first: int, view: memoryview, got: int,
                    on_bytes: Callable[[int], None] | None) -> int:
        if resp.status != 206:
            resp.conn.close()
            self.conns.drop_all()
            raise RegistryError(f"{self.ref}: the registry answered a Range request for blob {digest[:19]}... "
                                "with the whole blob (HTTP 200): it cannot stream; pull the image "
                                "(skopeo copy --preserve-digests) and load it from disk, or set "
                                "PACKER_STREAM_WHOLE=1 to fetch whole blobs into memory")
        span = resp.header("Content-Range")
        if not span.startswith(f"bytes {first}-"):
            raise RegistryError(f"{self.ref}: asked bytes {first}- of blob {digest[:19]}..., "
                                f"the registry sent {printable(span[:60])!r}")
        while got < len(view):
            n = resp.readinto(view[got:])
            if not n:
                raise http.client.IncompleteRead(b"")
            got += n
            if on_bytes is not None:
                on_bytes(n)
        return got

    def read_whole(self, digest: str, size: int) -> bytearray:
        """A whole weight blob into memory (``PACKER_STREAM_WHOLE=1``), proven by its digest."""
        path = self._blob_path(digest)
        what = f"blob {digest[:19]}... ({size} bytes, whole)"
        try:
            buf = bytearray(size)
        except MemoryError:
            raise RegistryError(f"{self.ref}: {what}: not enough memory to hold it whole") from None
        with self.get(path, what=what, size=size) as resp:
            view, got, h = memoryview(buf), 0, hashlib.sha256()
            try:
                while got < size:
                    n = resp.readinto(view[got:])
                    if not n:
                        break
                    h.update(view[got: got + n])
                    got += n
            except (OSError, http.client.HTTPException) as e:  # not resumed: a whole blob is asked once
                raise RegistryError(f"{self.ref}: {what}: the answer broke off after {got} bytes "
                                    f"({type(e).__name__})") from None
        if got != size or "sha256:" + h.hexdigest() != digest:
            raise RegistryError(f"{self.ref}: blob {digest} as served is not the one the image manifest pins")
        return buf


def _basic(auth: tuple[str, str] | None) -> str | None:
    """The Basic ``Authorization`` value of ``(user, password)``, or None without credentials."""
    return "Basic " + base64.b64encode(":".join(auth).encode()).decode() if auth else None


def _why(body: bytes) -> str:
    """The registry's own error code, when its body is the distribution's error document."""
    try:
        errors = loads_json(body, "the registry's error").get("errors") or []
        code = str(errors[0].get("code", ""))[:40]
    except (ArtifactMismatchError, AttributeError, IndexError, TypeError):
        return ""
    return f" ({code})" if re.fullmatch(r"[A-Z_]+", code) else ""
