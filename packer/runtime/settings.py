"""The loader's settings: one frozen object from the environment and the recipe's ``[runtime]``.

Every knob the loader honours is a field of :class:`RuntimeSettings`, parsed here and nowhere
else. Two channels feed it:

* the environment, ``PACKER_<FIELD>`` (``PACKER_RING_SLOTS``, ``PACKER_CHUNK_MB``, ...): set
  per node or per container at deploy time;
* the ``runtime`` section of the manifest embedded in the loader, i.e. the recipe's
  ``[runtime]`` as built (today ``device`` and ``warmup``; a key named like a field below is
  honoured too).

**The environment wins over the recipe**: a deploy-time override beats the default the build
chose. A field with no environment variable (``device``, ``warmup``) comes from the recipe
only; an empty variable counts as unset. Defaults apply where neither channel says anything.

A :class:`~packer.runtime.loading.Loader` takes one snapshot when it is made. Two knobs act
before any build is known and so are read from the environment alone, through this parser:
``PACKER_EXPANDABLE_SEGMENTS`` when the loader is imported (before CUDA starts) and
``PACKER_STARTUP_LOG`` at each print of the process-wide stage table.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, NamedTuple


def _parse(name: str, value: Any) -> Any:
    """One field's value as given (a variable's text or a recipe value), parsed strictly.

    Raises:
        ValueError: one line naming the variable, what it accepts and what it got.
    """
    if name in _INTS:
        number = _integer(value)
        if number is None:
            raise _refused(name, "an integer", value)
        return max(1, number) if name == "readers" else number
    if name in _FLAGS:
        if value in (True, False, 0, 1) or value in ("0", "1"):  # a recipe's bool or int, a variable's text
            return bool(int(value))
        raise _refused(name, "0 or 1", value)
    if name in _CHOICES:
        text = str(value).lower()
        if text not in _CHOICES[name]:
            raise _refused(name, " or ".join(_CHOICES[name]), value)
        return text
    if name == "warmup":
        return tuple(value)
    return str(value)


def _integer(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _refused(name: str, accepts: str, value: Any) -> ValueError:
    return ValueError(f"packer_loader: {_ENV_PREFIX + name.upper()}: expected {accepts}, got {value!r}")


MIB = 2**20
DEFAULT_SLOTS = 4
DEFAULT_CHUNK = 64 * MIB
DEFAULT_READERS = 8  # at most this many reader threads by default (never more than the CPUs)
_ENV_PREFIX = "PACKER_"
_NO_ENV = ("device", "warmup")  # recipe-only fields: no PACKER_DEVICE, no PACKER_WARMUP
_INTS = ("ring_slots", "chunk_mb", "readers")
_FLAGS = ("hugepages", "expandable_segments", "debug")
_CHOICES = {"startup_log": ("text", "json", "off")}


def setting(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """One field from the environment alone (its default when unset), for the two knobs read
    before a build is known: ``expandable_segments`` and ``startup_log``."""
    value = (os.environ if environ is None else environ).get(_ENV_PREFIX + name.upper())
    return _parse(name, value) if value else getattr(RuntimeSettings(), name)


class RuntimeSettings(NamedTuple):
    """Every loader knob, resolved: environment over recipe over default. Immutable.

    A named tuple: immutable, cheap to build at every loader, and its fields are the knobs.

    Attributes:
        artifacts: ``PACKER_ARTIFACTS``: the artifact directory ("" = the loader's own).
        weights_dir: ``PACKER_WEIGHTS_DIR``: weights mounted elsewhere ("" = under artifacts).
        bundle_cache: ``PACKER_BUNDLE_CACHE``: where the bundle is extracted and ``model_dir()``
            is made ("" = a private directory under ``$XDG_CACHE_HOME/packer``, see ``bundle_cache``).
        startup_log: ``PACKER_STARTUP_LOG``: ``text``, ``json`` or ``off`` (any case).
        ring_slots: ``PACKER_RING_SLOTS``: staging slots of the ring (default 4).
        chunk_mb: ``PACKER_CHUNK_MB``: staging chunk in MiB before rounding (default 64).
        readers: ``PACKER_READERS``: reader threads, at least 1 (default min(8, CPUs)).
        hugepages: ``PACKER_HUGEPAGES=1``: private CPU copies on transparent huge pages.
        expandable_segments: ``PACKER_EXPANDABLE_SEGMENTS=1``: ask for expandable segments.
        debug: ``PACKER_DEBUG=1``: a failed self-test or command prints its traceback.
        (The flags take ``0`` or ``1``; every other value is refused, as is a startup log
        other than the three forms and a count that is not an integer.)
        require_signature: ``PACKER_REQUIRE_SIGNATURE``: path of a PEM public key; the build's
            ``model.sig`` must verify with it, and every file's sha256 is checked ("" = not asked).
        device: the recipe's ``runtime.device``, the self-test's default device.
        warmup: the recipe's ``runtime.warmup`` entries (``{name, shape, dtype}``).
    """

    artifacts: str = ""
    weights_dir: str = ""
    bundle_cache: str = ""
    startup_log: str = "text"
    ring_slots: int = DEFAULT_SLOTS
    chunk_mb: int = DEFAULT_CHUNK // MIB
    readers: int = min(DEFAULT_READERS, os.cpu_count() or 1)
    hugepages: bool = False
    expandable_segments: bool = False
    debug: bool = False
    require_signature: str = ""
    device: str = "cuda"
    warmup: tuple[dict[str, Any], ...] = ()

    @property
    def chunk_bytes(self) -> int:
        """The staging chunk in bytes (``chunk_mb`` MiB; the ring rounds it down)."""
        return self.chunk_mb * MIB

    @classmethod
    def from_sources(cls, environ: Mapping[str, str] | None = None,
                     runtime: Mapping[str, Any] | None = None) -> RuntimeSettings:
        """The settings from ``environ`` (default ``os.environ``) over ``runtime`` (a recipe's
        ``[runtime]`` as embedded in the manifest; default none) over the defaults.

        Raises:
            ValueError: a value the setting does not accept (one line: the variable, what it
                accepts, what it got).
        """
        env = os.environ if environ is None else environ
        rt = runtime or {}
        given: dict[str, Any] = {}
        for name in cls._fields:
            var = _ENV_PREFIX + name.upper()
            if name not in _NO_ENV and env.get(var):
                given[name] = _parse(name, env[var])
            elif name in rt:
                given[name] = _parse(name, rt[name])
        return cls(**given)


# ---------------------------------------------------------------------------------------
# the registry client's knobs (a streamed load): the environment alone, parsed strictly, once
# per load (:class:`~.registry.Registry` takes one snapshot when it is made)

DEFAULT_TIMEOUT = 60.0  # seconds for one request's answer (a blob span gets more, by its size)
DEFAULT_DEADLINE = 3600.0  # seconds a load may spend with requests in flight
DEFAULT_MAX_REQUESTS = 100_000  # a 1 TB model at 64 MiB a request needs ~16 000, plus edge chunks
MAX_SECONDS = 7 * 24 * 3600.0  # a week: more is a typo, not a deadline
# each name spelt out: tests/test_docs_reference.py finds the variables the code reads this way
_REGISTRY_VARS = {"auth": "PACKER_REGISTRY_AUTH", "ca": "PACKER_REGISTRY_CA",
                  "insecure": "PACKER_REGISTRY_INSECURE", "timeout": "PACKER_REGISTRY_TIMEOUT",
                  "deadline": "PACKER_REGISTRY_DEADLINE", "max_requests": "PACKER_REGISTRY_MAX_REQUESTS",
                  "stream_whole": "PACKER_STREAM_WHOLE"}
# patterns, compiled on first use (re's cache): a local load never parses these variables
_SECONDS = r"[0-9]{1,9}(?:\.[0-9]{1,9})?"  # no inf, nan, sign, exponent or "_"
_COUNT = r"[0-9]{1,12}"
_HOSTPORT = r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?"


class RegistrySettings(NamedTuple):
    """The registry client's knobs, from the environment alone. Immutable.

    Attributes:
        auth: ``PACKER_REGISTRY_AUTH``: the auth file looked at first ("" = none named).
        ca: ``PACKER_REGISTRY_CA``: a PEM CA bundle trusted besides the system's.
        insecure: ``PACKER_REGISTRY_INSECURE``: ``host[:port]`` entries spoken to in plain HTTP.
        timeout: ``PACKER_REGISTRY_TIMEOUT``: seconds one request may take (default 60): to
            connect, to the answer's headers and to a document's last byte; a blob span gets one
            more second per MiB asked.
        deadline: ``PACKER_REGISTRY_DEADLINE``: seconds a load may spend with requests in flight
            (default 3600; idle time between lazy reads does not count).
        max_requests: ``PACKER_REGISTRY_MAX_REQUESTS``: requests one load may make (default 100000).
        stream_whole: ``PACKER_STREAM_WHOLE=1``: whole weight blobs into memory, not ``Range``.
    """

    auth: str = ""
    ca: str = ""
    insecure: tuple[str, ...] = ()
    timeout: float = DEFAULT_TIMEOUT
    deadline: float = DEFAULT_DEADLINE
    max_requests: int = DEFAULT_MAX_REQUESTS
    stream_whole: bool = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> RegistrySettings:
        """The settings from ``environ`` (default ``os.environ``); an empty variable is unset.

        Raises:
            ValueError: one line naming the variable, what it accepts and what it got (``inf``,
                ``nan``, a negative or zero count, a malformed host, a flag other than 0 or 1).
        """
        env = os.environ if environ is None else environ
        given: dict[str, Any] = {}
        for name, var in _REGISTRY_VARS.items():
            text = env.get(var)
            if text:
                given[name] = _registry_value(name, var, text)
        return cls(**given)


def _registry_value(name: str, var: str, text: str) -> Any:
    if name in ("timeout", "deadline"):
        if not re.fullmatch(_SECONDS, text, re.ASCII) or not 0 < float(text) <= MAX_SECONDS:
            raise _refused_var(var, f"seconds above 0 and at most {MAX_SECONDS:.0f} (digits, a decimal point)", text)
        return float(text)
    if name == "max_requests":
        if not re.fullmatch(_COUNT, text, re.ASCII) or int(text) < 1:
            raise _refused_var(var, "a count of requests, at least 1", text)
        return int(text)
    if name == "stream_whole":
        if text not in ("0", "1"):
            raise _refused_var(var, "0 or 1", text)
        return text == "1"
    if name == "insecure":
        hosts = tuple(h.strip() for h in text.split(","))
        if not all(re.fullmatch(_HOSTPORT, h, re.ASCII) for h in hosts):
            raise _refused_var(var, "host[:port] entries separated by commas", text)
        return hosts
    if any(c < " " or c == "\x7f" for c in text):
        raise _refused_var(var, "a file path", text)
    return text


def _refused_var(var: str, accepts: str, value: str) -> ValueError:
    shown = repr(value) if len(value) <= 60 else repr(value[:60]) + "..."
    return ValueError(f"packer_loader: {var}: expected {accepts}, got {shown}")
