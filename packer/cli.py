"""The ``packer`` command line: parse options, call one library function, print.

No logic lives here. Every error becomes an exit code in one place, :func:`_fail`: library
errors (:class:`PackerError`) one line on stderr and exit code 1 (a
:class:`~packer.errors.UsageError` 2), click's usage errors (an unknown option, a missing
argument) click's usage text and 2, anything unexpected one line and 1 (``--debug``: the
traceback). Under ``--json`` each of them also prints one JSON document on stdout, as every
success prints its summary: the command's ``Ctx`` says so once click parsed the options, and
:func:`_argv_ctx` reads the words themselves when click failed before that. Everything printed
goes through :meth:`Ctx.log`, :meth:`Ctx.emit` or :func:`_error`, which show input text escaped
(:mod:`packer.util.show`): a message built anywhere in the library cannot reach the terminal raw.
Library modules are imported inside the commands so that ``packer --help`` stays fast and never
imports torch.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import click

from packer.errors import PackerError, missing_dependency
from packer.reading import check_regular
from packer.util.formats import CAST_DTYPES, MANIFEST_NAME, WEIGHT_PATTERNS
from packer.util.show import show, show_json
from packer.version import __version__


class Ctx:
    """Options common to every command."""

    def __init__(self, quiet: bool, as_json: bool, debug: bool) -> None:
        self.quiet, self.json, self.debug = quiet, as_json, debug

    def log(self, text: str) -> None:
        """One line of human output (escaped: a newline in ``text`` shows as ``\\n``): stdout
        normally, stderr under --json, nothing under --quiet."""
        if not self.quiet:
            click.echo(show(text), err=self.json)

    def log_lines(self, block: str) -> None:
        """A block packer itself laid out in lines (a table, indented JSON), line by line."""
        for line in block.splitlines():
            self.log(line)

    def plan(self, plan: dict[str, Any], notes: Sequence[str], summary: dict[str, Any]) -> None:
        """A dry run's output: the plan alone on stdout as JSON (``--json``: the summary holding it),
        its notes on stderr (none under --quiet), so ``--dry-run | jq`` reads one document."""
        if not self.quiet:
            for note in notes:
                click.echo(show(f"note: {note}"), err=True)
        click.echo(json.dumps(show_json(summary if self.json else plan), indent=2, sort_keys=True))

    def emit(self, summary: dict[str, Any]) -> None:
        """The ``--json`` summary on stdout, every string in it escaped as :func:`packer.util.show.show_json`."""
        if self.json:
            click.echo(json.dumps(show_json(summary), indent=2, sort_keys=True))

    @contextlib.contextmanager
    def progress(self, desc: str) -> Iterator[Callable[[int], None] | None]:
        """A tqdm bar on stderr fed with byte increments (:data:`packer.stage.Progress`); None when
        quiet, JSON or not a terminal."""
        if self.quiet or self.json or not sys.stderr.isatty():
            yield None
            return
        from tqdm import tqdm

        with tqdm(desc=desc, unit="B", unit_scale=True, file=sys.stderr, leave=False) as bar:

            yield bar.update


class InputPath(click.ParamType):
    """A path argument that must exist: a missing or wrong-kind input is bad input (one line,
    exit 1, as docs/reference/cli.md's exit codes say), not a usage error (click's ``exists=True``: 2)."""

    name = "path"

    def __init__(self, *, file_okay: bool = True, dir_okay: bool = True) -> None:
        self.file_okay, self.dir_okay = file_okay, dir_okay

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        return Path(value)

    def check(self, path: Path) -> None:
        """Raises PackerError: ``path`` is missing or of the wrong kind (checked in the command)."""
        if not path.exists():
            raise PackerError(f"{path}: does not exist")
        if path.is_dir() and not self.dir_okay:
            raise PackerError(f"{path}: is a directory; expected a file")
        if not path.is_dir() and not self.file_okay:
            raise PackerError(f"{path}: is not a directory")
        if not path.is_dir():  # a FIFO or device would block the first open: refused before it
            check_regular(path)


class BuildRoot(InputPath):
    """A build's directory, or a registry image (``oci://HOST/REPO@sha256:...``, kept as text:
    a path would fold its ``//``), which only the runtime's view opens."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        from packer.runtime.env import is_ref

        return value if is_ref(value) else Path(value)

    def check(self, path: Path) -> None:
        if isinstance(path, Path):
            super().check(path)


class WeightFilePath(InputPath):
    """A file argument that may also be a build output's weight file held in its layer blob
    (``OUT/weights/model.safetensors``, listed by the manifest, not on disk by itself)."""

    def check(self, path: Path) -> None:
        """Checks an existing path as :class:`InputPath`; a missing one is left to the command,
        which looks for it in a build output's manifest (once) before calling it missing."""
        if path.is_dir() and not (path / ".metadata").is_file():  # a torch.distributed.checkpoint folder is one
            raise PackerError(f"{path}: is a directory; {_one_weight_file(path)}")
        if path.exists() and not path.is_dir():
            super().check(path)


def _one_weight_file(directory: Path) -> str:
    """What to pass instead of a directory: one of its weight files."""
    if (directory / MANIFEST_NAME).is_file():
        return (f"inspect reads one file: name one of this build's weight files, e.g. "
                f"{directory / 'weights' / 'model.safetensors'}")
    found = sorted(p.name for pattern in WEIGHT_PATTERNS for p in directory.glob(pattern))[:3]
    examples = " or ".join(str(directory / n) for n in found) or f"{directory / 'model.safetensors'}"
    return f"inspect reads one checkpoint file, e.g. {examples}"


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _traceback_lines(error: BaseException) -> list[str]:
    """The traceback of ``error`` and its causes, oldest first, as lines; each message (and
    note) is one line of its own, so a newline inside one cannot forge a line when shown."""
    chain: list[BaseException] = []
    exc: BaseException | None = error
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    lines: list[str] = []
    for exc in reversed(chain):
        lines.append("Traceback (most recent call last):")
        lines += [line for entry in traceback.format_tb(exc.__traceback__) for line in entry.splitlines()]
        lines.append(f"{type(exc).__qualname__}: {exc}")
        lines += [f"note: {note}" for note in getattr(exc, "__notes__", ())]
    return lines


def _error(error: BaseException, text: str, ctx: Ctx, code: int) -> None:
    """The one error line on stderr (with ``--debug`` the traceback first), escaped; under
    ``--json`` also ``{"error": text, "exit_code": code}`` on stdout, so that a job parsing
    the summary reads a document on failure too."""
    if ctx.debug:
        for line in _traceback_lines(error):
            click.echo(show(line), err=True)
    click.echo(f"error: {show(text)}", err=True)
    if ctx.json:
        click.echo(json.dumps(show_json({"error": text, "exit_code": code}), indent=2, sort_keys=True))


class _Reported(SystemExit):
    """An exit whose error :func:`_fail` has printed (and its ``--json`` document)."""


def _reason(error: BaseException) -> tuple[str, int]:
    """The one error line's text and the exit code for ``error``."""
    if isinstance(error, PackerError):
        return str(error), error.exit_code
    if isinstance(error, ImportError):  # a missing package is named as itself
        return str(missing_dependency(error)), 1
    if isinstance(error, OSError):  # the file system said no: still one line, still exit 1
        where = f"{error.filename}: " if getattr(error, "filename", None) else ""
        return f"{where}{error.strerror or error}", 1
    if isinstance(error, (click.exceptions.Abort, KeyboardInterrupt)):  # Ctrl-C: 128 + SIGINT, as shells do
        return "interrupted", 130
    if isinstance(error, SystemExit):  # SIGTERM (_terminated): 128 + the signal
        code = error.code if isinstance(error.code, int) else 1
        return f"stopped (exit code {code})", code
    return (f"internal error: {type(error).__qualname__}: {error} (a bug; --debug shows the traceback, "
            "please report it)"), 1


def _fail(error: BaseException, ctx: Ctx) -> NoReturn:
    """The one place an error becomes an exit code: its line (or click's usage text) on stderr,
    under ``--json`` ``{"error", "exit_code"}`` on stdout; then exit with that code."""
    if isinstance(error, BrokenPipeError):  # `packer inspect x | head`: the reader left; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise _Reported(1)
    if isinstance(error, click.ClickException):
        text, code = error.format_message(), error.exit_code
        if isinstance(error, click.exceptions.NoArgsIsHelpError):  # plain `packer`: the help is the message
            error.show()
        else:  # click's layout (usage line, hint, the error), the error escaped: it may quote any word
            usage = getattr(error, "ctx", None)
            if usage is not None:
                click.echo(f"{usage.get_usage()}\nTry '{usage.command_path} --help' for help.\n", err=True)
            click.echo(f"Error: {show(text)}", err=True)
        if ctx.json:
            click.echo(json.dumps(show_json({"error": text, "exit_code": code}), indent=2, sort_keys=True))
        raise _Reported(code)
    text, code = _reason(error)
    _error(error, text, ctx, code)
    raise _Reported(code)


def _argv_ctx(argv: Sequence[str]) -> Ctx:
    """The common flags as the words show them (up to ``--``), for an error click raises before
    it parsed them (an unknown option, a missing argument, ``packer --json verify``)."""
    words = list(argv[:argv.index("--")] if "--" in argv else argv)
    return Ctx(quiet="-q" in words or "--quiet" in words,
               as_json=any(w == "--json" or w.startswith("--json=") for w in words), debug="--debug" in words)


class _Main(click.Group):
    """The command group; its :meth:`main` leaves every error to :func:`_fail`."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        try:
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except _Reported:
            raise
        except SystemExit as e:
            if e.code in (0, None):
                raise
            _fail(e, _argv_ctx(argv))
        except BaseException as e:  # noqa: BLE001 - every exit is reported; Ctrl-C comes as Abort
            _fail(e, _argv_ctx(argv))
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)  # an int: click's Exit (--help, --version)


def _common(fn: Callable[..., Any]) -> Callable[..., Any]:
    @click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors.")
    @click.option("--json", "as_json", is_flag=True, help="Machine-readable summary on stdout; logs on stderr.")
    @click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
    @functools.wraps(fn)
    def wrapper(quiet: bool, as_json: bool, debug: bool, **kwargs: Any) -> None:
        ctx = Ctx(quiet, as_json, debug)
        # SIGTERM (a cancelled CI job, a pod stopped) unwinds like Ctrl-C, so that staging and
        # scratch directories are removed on the way out instead of left behind
        signal.signal(signal.SIGTERM, _terminated)
        try:
            for param in click.get_current_context().command.params:
                if isinstance(param.type, InputPath) and param.name and kwargs.get(param.name) is not None:
                    param.type.check(kwargs[param.name])
            fn(ctx, **kwargs)
        except click.ClickException:  # a usage error found by the command: click adds its usage line
            raise
        except Exception as e:  # noqa: BLE001 - reported with the flags as click parsed them
            _fail(e, ctx)

    return wrapper


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="packer")
def main() -> None:
    """packer: build deploy-ready model artifacts so inference servers start in seconds.

    \b
    Examples:
      packer build                          # the embedded demo model into ./dist
      packer build recipes/hf-model.toml -o out
      packer verify out
    """


_ALLOW_HELP = ("Read globals matching this 'module.Name' pattern (fnmatch) as inert plain-data "
               "placeholders: never imported or called, left out of the output (repeatable).")


@main.command()
@click.argument("recipe", required=False, type=InputPath())
@click.option("-o", "--out", type=click.Path(path_type=Path), default=Path("dist"), show_default=True,
              help="Output directory (replaced atomically when the build succeeds).")
@click.option("--dry-run", is_flag=True, help="Print the plan (files, bundle members, layers); write nothing.")
@click.option("--no-sandbox", is_flag=True, help="Read checkpoints in this process (no isolated subprocess).")
@click.option("--allow-global", "allow_globals", multiple=True, metavar="PATTERN", help=_ALLOW_HELP)
@click.option("--sign-key", type=click.Path(dir_okay=False, path_type=Path), metavar="KEY",
              help="PEM EC private key: write model.sig and the signed provenance (overrides [sign] key; "
                   "needs pip install 'model-packer[sign]').")
@_common
def build(ctx: Ctx, recipe: Path | None, out: Path, dry_run: bool, no_sandbox: bool,
          allow_globals: tuple[str, ...], sign_key: Path | None) -> None:
    """Build RECIPE (default: the embedded demo) into OUT.

    RECIPE may be a model directory instead: it is built with every recipe key at its default
    (the image named after the folder, version 0.0.0); write a recipe with source = "DIR" to
    change any of them.

    \b
    Examples:
      packer build
      packer build ./my-model -o out
      packer build recipes/demo.toml -o out --json
      packer build recipes/hf-model.toml --dry-run
      packer build recipes/hf-model.toml -o out --sign-key signing-key.pem
    """
    from packer.building import build as run_build
    from packer.recipe import recipe_from_options

    rec = recipe_from_options(recipe, allow_globals=allow_globals, sign_key=sign_key)
    with ctx.progress("weights") as bar:
        result = run_build(rec, out, dry_run=dry_run, sandbox=not no_sandbox, progress=bar)
    if dry_run:  # the plan is the output (stdout, pipeable to jq); notes go to stderr
        ctx.plan(result.manifest, result.notes, result.summary())
        return
    for note in result.notes:
        ctx.log(f"note: {note}")
    ctx.log_lines(result.timer.table())
    ctx.log(f"built {rec.name} {rec.version} into {result.out}")
    if result.warm is not None:
        ctx.log(warm_line(result.warm))
    ctx.emit(result.summary())


def _rename_pairs(renames: tuple[str, ...]) -> list[tuple[str, str]]:
    """Each ``--rename REGEX=REPLACEMENT`` as its pair; one without ``=`` is a usage error (exit 2),
    found after the input path's check, as a command finds it."""
    pairs = []
    for r in renames:
        pattern, sep, repl = r.partition("=")
        if not sep:
            raise click.BadParameter(f"{r!r}: expected REGEX=REPLACEMENT", param_hint="--rename")
        pairs.append((pattern, repl))
    return pairs


def _shard_size(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """A malformed size is a usage error (exit 2), like any other bad option value."""
    from packer.recipe import parse_size

    try:
        parse_size(value)
    except ValueError:
        raise click.BadParameter(f'expected a size like "5GB" or "4GiB", got {value!r}') from None
    return value


@main.command()
@click.argument("src", type=InputPath())
@click.option("-o", "--out", type=click.Path(path_type=Path), required=True, help="Output directory.")
@click.option("--key", help="Key of the nested dict holding the state dict (e.g. state_dict).")
@click.option("--strip-prefix", "strip_prefixes", multiple=True, help="Prefix to strip from names (repeatable).")
@click.option("--rename", "renames", multiple=True, metavar="REGEX=REPLACEMENT", help="Regex rename (repeatable).")
@click.option("--include", "include", multiple=True, metavar="GLOB",
              help="Convert only tensors whose name (as read) matches (repeatable).")
@click.option("--exclude", "exclude", multiple=True, metavar="GLOB",
              help="Leave out tensors whose name (as read) matches, e.g. n_averaged (repeatable).")
@click.option("--dtype", type=click.Choice(list(CAST_DTYPES)), help="Cast floats.")
@click.option("--max-shard-size", default="5GB", show_default=True, callback=_shard_size,
              help='Decimal ("5GB") or binary ("4GiB") size of one shard.')
@click.option("--tie-prefer", multiple=True, help="Name to keep for a tied group (repeatable).")
@click.option("--max-expansion", type=click.FloatRange(min=0, min_open=True), default=4.0, show_default=True,
              help="Expanded views may make the output this many times the input storages (+1 GiB).")
@click.option("--dry-run", is_flag=True, help="Print the plan; write nothing.")
@click.option("--no-sandbox", is_flag=True, help="Read the input in this process (no isolated subprocess).")
@click.option("--allow-global", "allow_globals", multiple=True, metavar="PATTERN", help=_ALLOW_HELP)
@_common
def convert(ctx: Ctx, src: Path, out: Path, key: str | None, strip_prefixes: tuple[str, ...],
            renames: tuple[str, ...], include: tuple[str, ...], exclude: tuple[str, ...], dtype: str | None,
            max_shard_size: str,
            tie_prefer: tuple[str, ...], max_expansion: float, dry_run: bool, no_sandbox: bool,
            allow_globals: tuple[str, ...]) -> None:
    """Convert pickle checkpoints (or safetensors) in SRC to safetensors in OUT.

    \b
    Examples:
      packer convert pytorch_model.bin -o out
      packer convert ckpt/ -o out --key state_dict --strip-prefix module. --dtype bfloat16
      packer convert last.ckpt -o out --key state_dict --allow-global 'mypkg.config.*'
    """
    from packer.recipe import weights_from_options
    from packer.weights.options import ConvertOptions
    from packer.weights.sandbox import convert_cli

    cfg = weights_from_options(key=key, strip_prefixes=strip_prefixes, renames=_rename_pairs(renames), dtype=dtype,
                               max_shard_size=max_shard_size, tie_prefer=tie_prefer, max_expansion=max_expansion,
                               allow_globals=allow_globals, include=include,
                               exclude=exclude)  # SRC is a file name, not a recipe string
    with ctx.progress("convert") as bar:
        result = convert_cli(src, out, cfg, ConvertOptions(dry_run=dry_run, sandbox=not no_sandbox, progress=bar))
    summary = {"files": [{"path": f.path, **f.as_json()} for f in result.files], "notes": list(result.notes),
               "tensors": len(result.section.get("tensors", {})), "dry_run": dry_run}
    if dry_run:
        ctx.plan(result.section, result.notes, {**summary, "plan": result.section})
        return
    for note in result.notes:
        ctx.log(f"note: {note}")
    for f in result.files:
        ctx.log(f"{f.sha256}  {out / f.path}  ({f.size} bytes)")
    ctx.emit(summary)


@main.command()
@click.argument("file", type=WeightFilePath(dir_okay=False))
@click.option("--allow-global", "allow_globals", multiple=True, metavar="PATTERN", help=_ALLOW_HELP)
@_common
def inspect(ctx: Ctx, file: Path, allow_globals: tuple[str, ...]) -> None:
    """List a checkpoint's tensors and other entries without converting or executing anything.

    A build output's weight file (OUT/weights/model.safetensors) is read where the build keeps
    it, inside its layer blob; --json then adds "blob" and "offset".

    \b
    Examples:
      packer inspect pytorch_model.bin
      packer inspect model.safetensors --json
      packer inspect out/weights/model.safetensors
    """
    from packer.checkpoint import inspect_checkpoint
    from packer.manifest import held_in_blob

    exists = file.exists()
    held = None if exists else held_in_blob(file)
    if held is None:
        if not exists:  # and in no build's manifest: InputPath's own message
            InputPath(dir_okay=False).check(file)
        report: dict[str, Any] = inspect_checkpoint(file, allow_globals=allow_globals)
    else:
        blob, offset, size = held
        report = {**inspect_checkpoint(blob, region=(offset, size)), "path": str(file), "blob": str(blob),
                  "offset": offset}
    if not ctx.json:
        n = len(report["tensors"])
        where = f" (held in {held[0]} at offset {held[1]})" if held else ""
        ctx.log(f"{file}{where}: {report['format']}, {n} tensor{'' if n == 1 else 's'}")
        if "hint" in report:  # a Lightning checkpoint: the recipe first, its training state in one line each
            ctx.log(f"  {report['hint']}")
        state = tuple(f"{k}." for k in report.get("training_state", ()))
        for k in state:
            c = sum(t["name"].startswith(k) for t in report["tensors"])
            ctx.log(f"  (training state) {k[:-1]}: {c} tensor{'' if c == 1 else 's'}, not model weights")
        for t in report["tensors"]:
            if state and t["name"].startswith(state):
                continue
            alias = f"  alias group {t['alias_group']}" if t.get("alias_group") is not None else ""
            attrs = t.get("dropped_attributes")
            dropped = f"  attributes dropped: {', '.join(attrs)}" if attrs else ""
            ctx.log(f"  {t['name']}  {t['dtype']}  {list(t['shape'])}  {t['nbytes']} B{alias}{dropped}")
        placeholders = {p["name"] for p in report.get("placeholders", [])}
        for name in report.get("skipped", []):  # a placeholder is listed once, as one, below
            if name not in placeholders and not (state and name.startswith(state)):
                ctx.log(f"  (not a tensor) {name}")
        for p in report.get("placeholders", []):
            ctx.log(f"  (placeholder) {p['name']}  {p['type']}")
        for key, value in sorted(report.get("metadata", {}).items()):
            ctx.log(f"  metadata {key} = {value}")
    ctx.emit(report)


@main.command()
@click.argument("src", type=InputPath(file_okay=False))
@click.option("-o", "--out", type=click.Path(path_type=Path), required=True, help="Archive to write.")
@click.option("--include", multiple=True, help="Glob of files to include (repeatable; overrides defaults).")
@click.option("--exclude", multiple=True, help="Glob of files to exclude (repeatable).")
@click.option("--dry-run", is_flag=True, help="List the members; write nothing.")
@_common
def bundle(ctx: Ctx, src: Path, out: Path, include: tuple[str, ...], exclude: tuple[str, ...], dry_run: bool) -> None:
    """Bundle SRC's tokenizer and config files into one tar.zst archive.

    \b
    Examples:
      packer bundle ./my-model -o bundle.tar.zst
      packer bundle ./my-model -o b.tar.zst --include '*.json' --dry-run
    """
    from packer.bundle import bundle_to_file
    from packer.recipe import BundleConfig

    section = bundle_to_file(src, out, BundleConfig(include=include, exclude=exclude), dry_run=dry_run)
    for m in section["members"]:
        ctx.log(f"{m['name']}  {m['size']}")
    if not dry_run:
        ctx.log(f"wrote {out} ({section['size']} bytes, sha256 {section['sha256']})")
    ctx.emit(section)


@main.command()
@click.argument("archive", type=InputPath(dir_okay=False))
@click.option("-o", "--out", type=click.Path(path_type=Path), required=True, help="New directory to extract into.")
@_common
def unbundle(ctx: Ctx, archive: Path, out: Path) -> None:
    """Safely extract a bundle archive into a new directory.

    \b
    Example:
      packer unbundle dist/bundle.tar.zst -o /tmp/tokenizer
    """
    from packer.bundle import unbundle as run_unbundle

    names = run_unbundle(archive, out)
    ctx.log(f"extracted {len(names)} files into {out}")
    ctx.emit({"out": str(out), "files": names})


@main.command("demo-model")
@click.argument("dir", type=click.Path(path_type=Path))
@_common
def demo_model(ctx: Ctx, dir: Path) -> None:
    """Write the embedded demo model into DIR as a model directory (no network).

    The files a published model has (pickle weights pytorch_model.bin as torch.save writes
    them, config.json, a working tokenizer), so a recipe with source = "DIR" walks the whole
    tutorial offline. DIR must not exist, or be empty; its parent must exist.

    \b
    Example:
      packer demo-model my-model && packer build my-model -o out
    """
    from packer.demo import write_demo_model

    names = write_demo_model(dir)
    ctx.log(f"wrote the demo model ({len(names)} files: {', '.join(names)}) into {dir}")
    ctx.emit({"dir": str(dir), "files": names})


@main.command()
@click.argument("out", type=BuildRoot(file_okay=False))
@click.option("--public-key", type=InputPath(dir_okay=False), metavar="PUB",
              help="PEM public key: model.sig and the provenance must verify with it.")
@_common
def verify(ctx: Ctx, out: Path | str, public_key: Path | None) -> None:
    """Check every file and image blob in OUT against its manifest (and its signatures).

    OUT may be a pushed image, oci://HOST/REPO@sha256:...: every chunk of its weights is
    proven as it arrives, nothing of them written to disk.

    \b
    Examples:
      packer verify dist
      packer verify dist --public-key signing-key.pub
      packer verify oci://registry.example/models/demo@sha256:...
    """
    from packer.verifying import verify as run_verify
    from packer.verifying import verify_ref

    if isinstance(out, str):
        summary = verify_ref(out, public_key=public_key)
        ctx.log(f"ok: {summary['files']} files, {summary['bytes']} bytes ({summary['chunks']} chunks) of "
                f"{summary['ref']} proven against its manifest")
    else:
        summary = run_verify(out, public_key=public_key)
        ctx.log(f"ok: {summary['files']} files, {summary['bytes']} bytes match {out / MANIFEST_NAME}")
    if public_key is not None:
        ctx.log(f"ok: model.sig and the provenance verify with {public_key} and match the manifest")
    elif summary["signed"]:
        ctx.log("note: the build is signed; pass --public-key to check the signatures")
    ctx.emit({"ok": True, **summary})


@main.command()
@click.argument("out", type=InputPath(file_okay=False))
@click.option("--device", default=None,
              help="cpu, cuda or cuda:N  [default: the recipe's, as the self-test takes it; cpu without CUDA]")
@click.option("--verify", "verify_", is_flag=True, help="Also check sha256 of every weight file.")
@_common
def profile(ctx: Ctx, out: Path, device: str | None, verify_: bool) -> None:
    """Run the emitted loader's self-test in a fresh process and print its stage table.

    \b
    Example:
      packer profile dist --device cuda
    """
    from packer.profiling import profile as run_profile

    result = run_profile(out, device=device, verify=verify_)
    ctx.log(f"{'stage':<16}{'seconds':>10}{'bytes':>14}{'GB/s':>8}")
    for s in result["stages"]:
        gbps = f"{s['gbps']:.2f}" if s.get("gbps") else ""
        ctx.log(f"{s['stage']:<16}{s['seconds']:>10.3f}{s['bytes'] or '':>14}{gbps:>8}")
    if result.get("slow_imports"):
        ctx.log("")
        ctx.log(f"{'slowest imports (python -X importtime)':<44}{'self ms':>10}{'total ms':>10}")
        for imp in result["slow_imports"]:
            ctx.log(f"{imp['module']:<44}{imp['self_us'] / 1000:>10.1f}{imp['cumulative_us'] / 1000:>10.1f}")
    ctx.log("")
    checked = "sizes, headers, every tensor and the bundle" + (", and every file's sha256" if verify_ else "")
    ctx.log(f"self-test passed on {result['device']}: {result['tensors']} tensors of {result['loader']} "
            f"({checked} checked)")
    ctx.emit(result)


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("out", type=InputPath(file_okay=False))
@click.argument("engine_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--engine", type=click.Choice(["vllm"]), default="vllm", show_default=True)
@click.option("--python", metavar="PY", help="The engine's interpreter (default: this one).")
@click.option("--model-dir", type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help="The existing model directory the server will be given (its path enters the engine's key). "
                   "Default: the one `packer_loader.py --model-dir` prints.")
@click.option("--timeout", type=float, default=1800.0, show_default=True, help="Seconds for the engine's run.")
@click.option("--sign-key", type=click.Path(dir_okay=False, path_type=Path), metavar="KEY",
              help="PEM EC private key (the build's): sign the state (state.sig), which PACKER_REQUIRE_SIGNATURE "
                   "requires.")
@click.option("--requests", "requests_file", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="JSON list of the requests to send, as the recipe's warm.requests (default: logprobs, sampling, "
                   "penalties, a short and a long prompt).")
@_common
def warm(ctx: Ctx, out: Path, engine_args: tuple[str, ...], engine: str, python: str | None,
         model_dir: Path | None, timeout: float, sign_key: Path | None, requests_file: Path | None) -> None:
    """Run the engine once against OUT and ship its start-up state in OUT/warm/ (after --: its flags).

    \b
    Examples:
      packer warm dist --engine vllm -- --dtype bfloat16 --max-model-len 4096
      packer warm dist --python /opt/vllm/bin/python --model-dir /models -- --max-num-seqs 8
    """
    from packer.warm.requests import load_requests
    from packer.warm_step import warm_output

    requests = load_requests(requests_file) if requests_file is not None else None
    summary = warm_output(out, engine=engine, engine_args=list(engine_args), python=python, model_dir=model_dir,
                          timeout=timeout, sign_key=sign_key, requests=requests,
                          progress=None if ctx.json else lambda line: ctx.log(f"warm: {line}"))
    for note in summary["notes"]:
        ctx.log(f"note: {note}")
    ctx.log(warm_line(summary))
    ctx.emit(summary)


def warm_line(summary: dict[str, Any]) -> str:
    """One line for a captured warm state (``packer warm``, ``packer build`` with ``[warm]``)."""
    image = f"; image {summary['image']['tag']}" if summary.get("image") else ""
    signed = ", signed" if summary.get("signed") else ""
    return (f"warm state {summary['name']}: {summary['files']} files, {summary['bytes']} bytes pinned in "
            f"{summary['state']}{signed}, keyed for the model path {show(str(summary['model_path']))} (serve exactly "
            f"that path) in {summary['seconds']:.1f} s{image}")


@main.command()
@click.argument("out", type=InputPath(file_okay=False))
@click.argument("ref")
@click.option("--tls-verify/--no-tls-verify", default=True, show_default=True,
              help="Check the registry's TLS certificate; --no-tls-verify also allows plain HTTP "
                   "(a local test registry).")
@_common
def push(ctx: Ctx, out: Path, ref: str, tls_verify: bool) -> None:
    """Verify OUT, then push its image to a registry REF (through skopeo).

    \b
    Example:
      packer push dist registry.example.com/team/model:1.0
    """
    from packer.oci.referrer import referrers_tag
    from packer.pushing import push as run_push

    pushed = run_push(out, ref, tls_verify=tls_verify)
    for where, digest in pushed.items():
        ctx.log(f"pushed {where}@{digest}")
    (first, digest), *rest = pushed.items()
    referrers = {k: v for k, v in rest if k.endswith(":" + referrers_tag(digest))}
    views = {k: v for k, v in rest if k not in referrers}
    ctx.emit({"ref": first, "digest": digest, "modelpack": views or None, "referrers": referrers or None})


@main.command()
@click.argument("ref")
@click.option("--dir", "dest", type=click.Path(path_type=Path), default=None,
              help="where to lay out the model directory (must not exist or be empty; default: a new "
                   "private directory in the temp directory)")
@_common
def stream(ctx: Ctx, ref: str, dest: Path | None) -> None:
    """Lay out the small files of the image REF (oci://HOST/REPO@sha256:...) as a model directory
    whose weights stream from the registry; print its path.

    The directory holds config, tokenizer, chunk table, loader and ``packer-stream.json``; no
    weight byte. Serve it with ``vllm serve DIR --load-format packer``, or load it with its
    ``packer_loader.py``: the weights are read from the registry, every chunk proven.

    \b
    Example:
      packer stream oci://registry.example.com/team/model@sha256:... --dir /srv/model
    """
    from packer.stream import lay_out

    where, digest = lay_out(ref, dest)
    ctx.log(str(where))
    ctx.emit({"dir": str(where), "ref": digest})
