"""Recipes: what to build, read from TOML and validated with key paths.

A recipe is plain data. Loading checks every key against the schema below: unknown keys are
errors (a typo must never be ignored), and each message names the key path and what was
expected, e.g. ``weights.max_shard_size: expected a size like "5GB", got 12``.
"""

from __future__ import annotations

import difflib
import posixpath
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from packer.errors import RecipeError
from packer.reading import open_regular
from packer.util.formats import CAST_DTYPES, LAYOUTS
from packer.util.show import show
from packer.warm.requests import check_requests

DTYPES = tuple(CAST_DTYPES)
COMPRESSIONS = ("gzip", "zstd", "none")
MAX_RECIPE_BYTES = 2**20  # a recipe is a page of TOML
WEIGHTS_PLACEMENT = ("layer", "external")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)\s*$", re.I)
_SIZE_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """Parse ``"5GB"`` (decimal) or ``"64MiB"`` (binary) into bytes; ValueError if malformed."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(text)
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


@dataclass(frozen=True)
class Rename:
    """One regex rename applied to tensor names, in recipe order."""

    pattern: str
    replace: str


@dataclass(frozen=True)
class WeightsConfig:
    """The ``[weights]`` section: which checkpoint files and how to map them."""

    files: tuple[str, ...] = ()  # globs relative to the source; empty = auto-detect
    key: str | None = None  # key of the nested dict holding the state dict
    strip_prefixes: tuple[str, ...] = ()
    renames: tuple[Rename, ...] = ()
    # tensor-name globs (fnmatch, on the names as read): only matching tensors / none matching
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    dtype: str | None = None  # cast floating tensors to this dtype
    max_shard_size: int = 5 * 10**9
    tie_prefer: tuple[str, ...] = ()  # names preferred as the kept name of a tied group
    # "module.Name" patterns (fnmatch) of plain-data classes read as inert placeholders
    allow_globals: tuple[str, ...] = ()
    # what the source is (packer.components): "auto" by its marker files, or forced
    layout: str = "auto"
    components: tuple[str, ...] = ()  # build only these components (empty: all)
    # weight files a library loads by name beside the model's ("model.int8.safetensors"): each
    # converted on its own and kept under its own name
    variants: tuple[str, ...] = ()
    # safetensors files beside a component's weights that the build leaves out: by default each one
    # ("model.int8.safetensors") is carried under its own name, as a library may load it by default
    leave_out: tuple[str, ...] = ()
    # expanded views are written out: the output may be this many times the input storages' bytes + 1 GiB
    max_expansion: float = 4.0
    # chunk digests (packer.runtime.chunks): each weight file hashed per chunk of this many bytes
    chunk_size: int = 1 << 20  # packer.chunks.DEFAULT_CHUNK: benchmarks/RESULTS.md says why


@dataclass(frozen=True)
class BundleConfig:
    """The ``[bundle]`` section: globs that override the default member selection."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    remote_code: bool = True  # carry the code files auto_map names (never imported or run by packer)


@dataclass(frozen=True)
class ImageConfig:
    """The ``[image]`` section: the OCI image packer writes."""

    base: str | None = None  # "oci:PATH[:TAG]"
    base_name: str | None = None  # the base's registry reference, for the base.name annotation
    prefix: str = "/models"
    compression: str = "gzip"
    owner: str = "0:0"
    weights: str = "layer"
    single_layer: bool = False
    platform: str = "linux/amd64"
    tag: str | None = None  # defaults to "<name>:<version>"
    # what the image runs (None: the base's entrypoint, packer's self-test command)
    entrypoint: tuple[str, ...] | None = None
    cmd: tuple[str, ...] | None = None
    user: str | None = None  # None: the base's user
    workdir: str | None = None  # None: the prefix
    env: tuple[tuple[str, str], ...] = ()  # set after the base's environment and PYTHONPATH


@dataclass(frozen=True)
class WarmupShape:
    """One example input for warm-up: a name, a shape and a dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "int64"


@dataclass(frozen=True)
class RuntimeConfig:
    """The ``[runtime]`` section: how the emitted loader runs by default."""

    device: str = "cuda"
    warmup: tuple[WarmupShape, ...] = ()


@dataclass(frozen=True)
class SignConfig:
    """The ``[sign]`` section: the build's signing key (``packer build --sign-key`` overrides it).

    Not recorded in the manifest as written (a path to a secret is not part of what was
    built): the manifest's ``signature`` section names the public key by its digest.
    """

    key: str | None = None  # PEM private key; relative paths are relative to the recipe


@dataclass(frozen=True)
class WarmConfig:
    """The ``[warm]`` table: ``packer warm`` run by ``packer build`` after the build.

    Not recorded in the build's manifest (the state lies beside the build, pinned by its own
    manifest, and is made only where the engine is installed).
    """

    engine: str | None = None  # "vllm"; None: no warm step
    args: tuple[str, ...] = ()  # the engine's flags, as the server will be given them
    model_dir: str | None = None  # the model directory the server will use (it enters the key)
    device: str | None = None  # "cpu" or "cuda": the device kind this build warms for
    python: str | None = None  # the engine's interpreter (default: packer's)
    # the request mix of the warm run (packer.warm.requests; None: its DEFAULT_REQUESTS)
    requests: tuple[dict[str, Any], ...] | None = None


@dataclass(frozen=True)
class Recipe:
    """A whole recipe. ``base_dir`` resolves relative local sources."""

    name: str
    version: str
    source: str
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    bundle: BundleConfig = field(default_factory=BundleConfig)
    image: ImageConfig = field(default_factory=ImageConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    sign: SignConfig = field(default_factory=SignConfig)
    warm: WarmConfig = field(default_factory=WarmConfig)
    base_dir: Path = field(default=Path("."), compare=False)

    def normalised(self) -> dict[str, Any]:
        """The recipe as canonical, JSON-able data (recorded in the manifest; ``sign`` is not)."""
        data = asdict(self)
        data.pop("base_dir")
        data.pop("sign")
        data.pop("warm")
        return data

    def sign_key(self) -> Path | None:
        """The signing key's path (relative to the recipe's directory), or None: unsigned."""
        return None if self.sign.key is None else self.base_dir / Path(self.sign.key).expanduser()


# ---------------------------------------------------------------------------------------
# validation helpers: each takes the key path and the raw value, returns the typed value


def _fail(path: str, expected: str, value: Any) -> RecipeError:
    return RecipeError(f"{path}: expected {expected}, got {value!r}")


def _str(path: str, v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise _fail(path, "a non-empty string", v)
    return v


def _bool(path: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise _fail(path, "true or false", v)
    return v


def _choice(choices: tuple[str, ...]) -> Callable[[str, Any], str]:
    def check(path: str, v: Any) -> str:
        if v not in choices:
            raise _fail(path, "one of " + ", ".join(repr(c) for c in choices), v)
        return str(v)

    return check


def _str_list(path: str, v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise _fail(path, "a list of non-empty strings", v)
    return tuple(v)


_GLOBAL_PATTERN = re.compile(r"^[A-Za-z0-9_*?\[\]!]+(\.[A-Za-z0-9_*?\[\]!]+)+$")


def _global_patterns(path: str, v: Any) -> tuple[str, ...]:
    items = _str_list(path, v)
    for item in items:
        if not _GLOBAL_PATTERN.match(item):
            raise _fail(path, "'module.Name' patterns such as 'mypkg.config.TrainConfig' or 'mypkg.config.*'", item)
    return items


def _size(path: str, v: Any) -> int:
    if isinstance(v, str):
        try:
            size = parse_size(v)
        except ValueError:
            size = 0
        if size > 0:
            return size
    raise _fail(path, 'a size like "5GB"', v)


def _chunk_size(path: str, v: Any) -> int:
    size = _size(path, v) if isinstance(v, str) else 0
    if size % 4096 == 0 and 4096 <= size <= 1 << 30:
        return size
    raise _fail(path, 'a multiple of 4 KiB up to 1 GiB, like "4MiB"', v)


def _ratio(path: str, v: Any) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf"):
        return float(v)
    raise _fail(path, "a positive number such as 4 or 100", v)


def _regex(path: str, v: Any) -> str:
    s = _str(path, v)
    try:
        re.compile(s)
    except re.error as e:
        raise RecipeError(f"{path}: invalid regular expression {s!r}: {e}") from e
    return s


def _owner(path: str, v: Any) -> str:
    if not isinstance(v, str) or not re.fullmatch(r"\d+:\d+", v):
        raise _fail(path, 'a numeric "uid:gid" such as "1000:0"', v)
    return v


def _platform(path: str, v: Any) -> str:
    if not isinstance(v, str) or not re.fullmatch(r"[a-z0-9]+/[a-z0-9_]+(/[a-z0-9]+)?", v):
        raise _fail(path, 'a platform "os/architecture[/variant]" such as "linux/arm64/v8"', v)
    return v


def _base(path: str, v: Any) -> str:
    if not isinstance(v, str) or not v.startswith("oci:") or len(v) <= 4:
        raise _fail(path, 'an OCI layout reference "oci:PATH[:TAG]"', v)
    return v


# a registry reference: a host (with a dot or a port, or localhost), a path, a tag and/or digest
_REGISTRY_REF = re.compile(
    r"^(?:[a-z0-9-]+(?:\.[a-z0-9-]+)+(?::\d+)?|localhost(?::\d+)?|[a-z0-9-]+:\d+)"
    r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)+"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def is_registry_reference(v: str) -> bool:
    """Whether ``v`` is a fully-qualified registry reference such as ``docker.io/library/debian:12``."""
    return bool(_REGISTRY_REF.match(v)) and ("@" in v or ":" in v.rpartition("/")[2])


def _base_name(path: str, v: Any) -> str:
    if not isinstance(v, str) or not is_registry_reference(v):
        raise _fail(path, 'a registry reference with a host and a tag or digest, such as '
                          '"docker.io/library/debian:12@sha256:..."', v)
    return v


def _argv(path: str, v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _fail(path, 'a list of strings such as ["python3", "serve.py"]', v)
    return tuple(v)


def _user(path: str, v: Any) -> str:
    if not isinstance(v, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(:[A-Za-z0-9_][A-Za-z0-9_.-]*)?", v):
        raise _fail(path, 'a user such as "1000:0" or "model"', v)
    return v


def _is_clean_abs(v: str) -> bool:
    """An absolute path as Docker's WORKDIR records it (``path.Clean``): no ``..``, ``.``,
    ``//`` or trailing ``/``, so the image config and the Dockerfile say the same."""
    return v.startswith("/") and not v.startswith("//") and posixpath.normpath(v) == v and ".." not in v.split("/")


def _abs_path(path: str, v: Any) -> str:
    if not isinstance(v, str) or not _is_clean_abs(v):
        raise _fail(path, "an absolute path, clean (no '..', '.', '//' or trailing '/'), such as /srv", v)
    return v


def _prefix(path: str, v: Any) -> str:
    if not isinstance(v, str) or not _is_clean_abs(v.rstrip("/") or "/"):
        raise _fail(path, "an absolute path, clean (no '..', '.' or '//'), such as /models", v)
    return v


def _env(path: str, v: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(v, dict):
        raise _fail(path, 'a table of strings such as {HF_HUB_OFFLINE = "1"}', v)
    for key, value in v.items():
        if not _ENV_NAME.match(key) or not isinstance(value, str):
            raise _fail(f"{path}.{key}", "a variable name (letters, digits, _) with a string value", value)
    return tuple(sorted(v.items()))


# What a recipe string may hold: printable text as show.py decides (str.isprintable: no C0 or
# C1 control, DEL, lone surrogate, format character such as a bidi override or BOM, line or
# paragraph separator, non-ASCII space), plus the few controls a key has a use for. Names,
# versions, tags and paths end up in the Dockerfile, annotations and terminals; an exec-form
# argument may be a multi-line `python -c` script, which JSON (the image config, the
# Dockerfile's CMD) carries exactly; an ENV value cannot hold a line break in a Dockerfile.
_ARGV_EXTRA = frozenset("\t\n")
_ENV_EXTRA = frozenset("\t")


def _extra_allowed(path: str) -> frozenset[str]:
    if re.fullmatch(r"image\.(entrypoint|cmd)\[\d+\]", path):
        return _ARGV_EXTRA
    if path.startswith("image.env.") and path.count(".") == 2:
        return _ENV_EXTRA
    return frozenset()


def _refuse_text(path: str, text: str) -> None:
    if text.isprintable():
        return
    allowed = _extra_allowed(path)
    bad = next((ch for ch in text if not ch.isprintable() and ch not in allowed), None)
    if bad is not None:
        raise RecipeError(f"{show(path)}: character '{show(bad)}' (U+{ord(bad):04X}) is not allowed here: "
                          "recipe strings hold printable text only")


def refuse_controls(path: str, value: Any) -> None:
    """Refuse, in every string (and table key) of a raw recipe, what :func:`show` would escape.

    Allowed besides printable text: tab in ``image.env`` values, tab and newline in
    ``image.entrypoint`` and ``image.cmd`` elements.

    Raises:
        RecipeError: ``<key path>: character '\\n' (U+000A) is not allowed here: ...``.
    """
    if isinstance(value, str):
        _refuse_text(path, value)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            sub = f"{path}.{key}" if path else str(key)
            if isinstance(key, str):
                _refuse_text(sub, key)
            refuse_controls(sub, item)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            refuse_controls(f"{path}[{i}]", item)


def _table(path: str, v: Any) -> Mapping[str, Any]:
    if not isinstance(v, dict):
        raise _fail(path, "a table", v)
    return v


def _fields(path: str, raw: Mapping[str, Any], spec: Mapping[str, Callable[[str, Any], Any]]) -> dict[str, Any]:
    unknown = sorted(set(raw) - set(spec))
    if unknown:
        key = f"{path}.{unknown[0]}" if path else unknown[0]
        close = difflib.get_close_matches(unknown[0], spec, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise RecipeError(f"{key}: unknown key (allowed: {', '.join(sorted(spec))}){hint}")
    return {k: spec[k](f"{path}.{k}" if path else k, v) for k, v in raw.items()}


def _renames(path: str, v: Any) -> tuple[Rename, ...]:
    if not isinstance(v, list):
        raise _fail(path, 'a list of {pattern = "...", replace = "..."} tables', v)
    out = []
    for i, item in enumerate(v):
        p = f"{path}[{i}]"
        t = _fields(p, _table(p, item), {"pattern": _regex, "replace": lambda _p, x: x})
        if "pattern" not in t or not isinstance(t.get("replace"), str):
            raise _fail(p, 'a table with string keys "pattern" and "replace"', item)
        out.append(Rename(t["pattern"], t["replace"]))
    return tuple(out)


def _warmup(path: str, v: Any) -> tuple[WarmupShape, ...]:
    if not isinstance(v, list):
        raise _fail(path, 'a list of {name, shape, dtype} tables', v)
    out = []
    for i, item in enumerate(v):
        p = f"{path}[{i}]"
        t = _fields(p, _table(p, item), {"name": _str, "shape": _shape, "dtype": _str})
        if "name" not in t or "shape" not in t:
            raise _fail(p, 'a table with "name" and "shape"', item)
        out.append(WarmupShape(**t))
    return tuple(out)


def _shape(path: str, v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v):
        raise _fail(path, "a list of positive integers", v)
    return tuple(v)


_WEIGHTS = {
    "files": _str_list, "key": _str, "strip_prefixes": _str_list, "renames": _renames,
    "include": _str_list, "exclude": _str_list,
    "dtype": _choice(DTYPES), "max_shard_size": _size, "tie_prefer": _str_list,
    "allow_globals": _global_patterns, "layout": _choice(LAYOUTS), "components": _str_list,
    "max_expansion": _ratio, "variants": _str_list, "leave_out": _str_list, "chunk_size": _chunk_size,
}
_BUNDLE = {"include": _str_list, "exclude": _str_list, "remote_code": _bool}
_IMAGE = {
    "base": _base, "prefix": _prefix, "compression": _choice(COMPRESSIONS), "owner": _owner,
    "weights": _choice(WEIGHTS_PLACEMENT), "single_layer": _bool, "platform": _platform, "tag": _str,
    "base_name": _base_name, "entrypoint": _argv, "cmd": _argv, "user": _user, "workdir": _abs_path,
    "env": _env,
}
_RUNTIME = {"device": _str, "warmup": _warmup}
_SIGN = {"key": _str}


def _engine_args(path: str, v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _fail(path, 'a list of strings (the engine\'s flags, e.g. ["--dtype", "bfloat16"])', v)
    return tuple(v)


def _warm_requests(path: str, v: Any) -> tuple[dict[str, Any], ...]:
    return check_requests(v, where=path, error=RecipeError)


_WARM = {"engine": _choice(("vllm",)), "args": _engine_args, "model_dir": _abs_path,
         "device": _choice(("cpu", "cuda")), "python": _str, "requests": _warm_requests}


def _warm_table(path: str, v: Any) -> WarmConfig:
    table = _fields(path, _table(path, v), _WARM)
    if "engine" not in table:
        raise RecipeError(f"{path}.engine: missing (\"vllm\"); the other keys say how to run it")
    return WarmConfig(**table)


def recipe_from_dict(raw: Mapping[str, Any], *, base_dir: Path = Path(".")) -> Recipe:
    """Validate raw recipe data and return a :class:`Recipe`.

    Raises:
        RecipeError: naming the key path and the expectation, or a character no string of
            that key may hold (see :func:`refuse_controls`).
    """
    refuse_controls("", raw)
    top = _fields("", raw, {
        "name": _str, "version": _str, "source": _str,
        "weights": lambda p, v: WeightsConfig(**_fields(p, _table(p, v), _WEIGHTS)),
        "bundle": lambda p, v: BundleConfig(**_fields(p, _table(p, v), _BUNDLE)),
        "image": lambda p, v: ImageConfig(**_fields(p, _table(p, v), _IMAGE)),
        "runtime": lambda p, v: RuntimeConfig(**_fields(p, _table(p, v), _RUNTIME)),
        "sign": lambda p, v: SignConfig(**_fields(p, _table(p, v), _SIGN)),
        "warm": _warm_table,
    })
    for required in ("name", "version", "source"):
        if required not in top:
            raise RecipeError(f"{required}: missing required key")
    return Recipe(**top, base_dir=base_dir)


def weights_from_options(*, key: str | None, strip_prefixes: Sequence[str], renames: Sequence[tuple[str, str]],
                         dtype: str | None, max_shard_size: str, tie_prefer: Sequence[str], max_expansion: float,
                         allow_globals: Sequence[str], include: Sequence[str] = (),
                         exclude: Sequence[str] = ()) -> WeightsConfig:
    """The ``[weights]`` table ``packer convert``'s options make, validated as a recipe's.

    The source is no part of it: a path named on the command line comes from the file system,
    not from a recipe, and may hold any character a file name holds (a no-break space, an
    ideographic space); it is shown escaped where it is printed, never refused here.

    Args:
        key, strip_prefixes, dtype, max_shard_size, tie_prefer, max_expansion: the
            ``[weights]`` keys of those names (an empty ``key`` or ``dtype``: none), the size as
            its text (``"5GB"``).
        renames: ``(pattern, replacement)`` pairs, in order (``weights.renames``).
        allow_globals: ``--allow-global`` patterns added to ``allow_globals``.
        include, exclude: ``weights.include`` / ``weights.exclude`` tensor-name globs.

    Raises:
        RecipeError: ``weights.<key>: ...`` as :func:`recipe_from_dict` says it, or a pattern
            of ``allow_globals`` that is not ``module.Name``.
    """
    raw: dict[str, Any] = {"max_shard_size": max_shard_size, "strip_prefixes": list(strip_prefixes),
                           "tie_prefer": list(tie_prefer), "max_expansion": max_expansion,
                           "include": list(include), "exclude": list(exclude),
                           **({"key": key} if key else {}), **({"dtype": dtype} if dtype else {}),
                           "renames": [{"pattern": pattern, "replace": repl} for pattern, repl in renames]}
    refuse_controls("weights", raw)
    cfg = WeightsConfig(**_fields("weights", _table("weights", raw), _WEIGHTS))
    extra = _global_patterns("--allow-global", list(allow_globals))
    return replace(cfg, allow_globals=cfg.allow_globals + extra)


def recipe_from_options(path: str | Path | None, *, allow_globals: Sequence[str],
                        sign_key: str | Path | None) -> Recipe:
    """The recipe ``packer build`` builds: the file at ``path`` (None: :func:`demo_recipe`), with
    ``--allow-global`` patterns added (:func:`with_allowed_globals`) and ``--sign-key`` in place of
    its ``[sign] key`` (:func:`with_sign_key`), each where given.

    Raises:
        RecipeError: as :func:`load_recipe`, or a pattern that is not ``module.Name``.
    """
    recipe = demo_recipe() if not path else directory_recipe(path) if Path(path).is_dir() else load_recipe(path)
    if allow_globals:
        recipe = with_allowed_globals(recipe, allow_globals)
    if sign_key:
        recipe = with_sign_key(recipe, sign_key)
    return recipe


def with_allowed_globals(recipe: Recipe, patterns: Sequence[str]) -> Recipe:
    """``recipe`` with ``patterns`` added to ``weights.allow_globals`` (``--allow-global``).

    Raises:
        RecipeError: a pattern that is not ``module.Name``.
    """
    extra = _global_patterns("--allow-global", list(patterns))
    weights = replace(recipe.weights, allow_globals=recipe.weights.allow_globals + extra)
    return replace(recipe, weights=weights)


def with_sign_key(recipe: Recipe, key: str | Path) -> Recipe:
    """``recipe`` signed with ``key`` (``--sign-key``, relative to the working directory)."""
    return replace(recipe, sign=SignConfig(key=str(Path(key).expanduser().absolute())))


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe file.

    Raises:
        RecipeError: unreadable file, TOML syntax error (with its line) or invalid content.
    """
    path = Path(path)
    try:
        with open_regular(path, RecipeError) as f:  # a FIFO is refused, never waited on
            data = f.read(MAX_RECIPE_BYTES + 1)
        if len(data) > MAX_RECIPE_BYTES:
            raise RecipeError(f"{path}: recipe larger than {MAX_RECIPE_BYTES >> 20} MiB")
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"{path}: cannot read recipe: {getattr(e, 'strerror', None) or e}") from e
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: invalid TOML: {e}") from e
    try:
        return recipe_from_dict(raw, base_dir=path.resolve().parent)
    except RecipeError as e:
        raise e.with_context(str(path)) from e.__cause__


DIRECTORY_VERSION = "0.0.0"


def directory_recipe(directory: str | Path) -> Recipe:
    """The recipe ``packer build DIR`` builds for a model directory: every key at its default,
    ``source`` the directory (absolute), ``name`` its folder's name as an image name takes it
    (lower case; each run of other characters one ``-``; ``model`` where nothing is left) and
    ``version`` :data:`DIRECTORY_VERSION`. A recipe file says anything else.
    """
    source = Path(directory).expanduser().absolute()
    name = re.sub(r"[^a-z0-9._]+", "-", source.name.lower()).strip("-._") or "model"
    return recipe_from_dict({"name": name, "version": DIRECTORY_VERSION, "source": str(source)})


def demo_recipe() -> Recipe:
    """The embedded default recipe: the deterministic demo model, default options."""
    warmup = (WarmupShape(name="input_ids", shape=(1, 128), dtype="int64"),)
    return Recipe(name="packer-demo", version="0.1.0", source="demo", runtime=RuntimeConfig(warmup=warmup))
