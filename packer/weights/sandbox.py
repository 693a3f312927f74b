"""Run the untrusted-input stage (``packer convert``) in an isolated subprocess.

The child gets limits on address space, CPU time and file size, no core dumps, and no
network: it leaves the network namespace where the kernel allows it and, in any case, an audit
hook refuses every socket operation. Arguments and results cross the process boundary as JSON,
never as pickles. A child killed by a limit becomes one clear :class:`PackerError`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import stat
import subprocess
import sys
import threading
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packer import errors
from packer.reading import REPORT, parse_json, walk_tree
from packer.recipe import ImageConfig, Rename, WeightsConfig
from packer.stage import Progress, StageOutput
from packer.util.fsutil import FileEntry
from packer.util.jsonshape import ANY, SIZE, STR, ListOf, MapOf, Obj, check_shape
from packer.weights.options import ConvertOptions

if TYPE_CHECKING:  # the convert machinery is imported where it runs (the child), not here
    from packer.weights.convert import LayerFraming

_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1
_GIB = 2**30


def _limits(total_input: int, expansion: float) -> dict[str, int]:
    # Address space includes the read-only maps of the inputs and torch's reservations when a
    # cast needs it, so the cap grows with the input; anonymous memory stays bounded anyway.
    # A file may grow as far as the planner lets expanded views make it (weights.max_expansion).
    return {
        "as": _env_limit("PACKER_SANDBOX_AS", "bytes", 16 * _GIB + 2 * total_input),
        "cpu": _env_limit("PACKER_SANDBOX_CPU", "seconds", 3600),
        "fsize": _env_limit("PACKER_SANDBOX_FSIZE", "bytes", int(max(4.0, expansion) * total_input) + 2 * _GIB),
    }


def _env_limit(var: str, unit: str, default: int) -> int:
    """``var`` as a whole number of ``unit`` (digits only, above 0; unset or empty: ``default``).

    Raises:
        PackerError: one line naming the variable and what it got (``inf``, a sign, junk).
    """
    text = os.environ.get(var, "")
    if not text:
        return default
    if not (text.isascii() and text.isdigit() and len(text) <= 19 and int(text) > 0):
        shown = repr(text) if len(text) <= 40 else repr(text[:40]) + "..."
        raise errors.PackerError(f"{var}: expected a whole number of {unit} above 0, got {shown}")
    return int(text)


def _input_size(src: Path) -> int:
    if src.is_file():
        return src.stat().st_size
    total = 0
    for _rel, path, _mode in walk_tree(src, error=errors.WeightsError):  # a hub snapshot's files are links
        with contextlib.suppress(OSError):
            st = os.stat(path)
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def _deny_sockets(event: str, _args: tuple[Any, ...]) -> None:
    if event.startswith("socket."):
        raise PermissionError(f"network access is disabled while reading untrusted input ({event})")


def _isolate(limits: dict[str, int]) -> None:
    """Applied in the child before anything reads the input."""
    # the C library this process runs on (find_library would run /sbin/ldconfig in a subprocess)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # die with the build that started us
    libc.unshare(_CLONE_NEWNET)  # needs CAP_SYS_ADMIN or user namespaces; the hook covers the rest
    sys.addaudithook(_deny_sockets)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for which, value in ((resource.RLIMIT_AS, limits["as"]), (resource.RLIMIT_CPU, limits["cpu"]),
                         (resource.RLIMIT_FSIZE, limits["fsize"])):
        soft, hard = resource.getrlimit(which)
        # never loosen a limit the caller already set (a CI job's own caps stay in force)
        value = min([value, *(v for v in (soft, hard) if v != resource.RLIM_INFINITY)])
        resource.setrlimit(which, (value, value))


def _cfg_from_json(data: dict[str, Any]) -> WeightsConfig:
    data = dict(data)
    data["renames"] = tuple(Rename(**r) for r in data["renames"])
    for key in ("files", "strip_prefixes", "include", "exclude",
                "tie_prefer", "allow_globals", "components", "variants", "leave_out"):
        data[key] = tuple(data[key])
    return WeightsConfig(**data)


def _framing(image: ImageConfig | None, mtime: int | None) -> LayerFraming | None:
    """The weight layers' framing for :func:`convert` (packer.oci is imported only then)."""
    if image is None:
        return None
    from packer.oci.plan import weight_layer_framing

    return lambda rel_path, size: weight_layer_framing(image, rel_path, size, mtime=mtime)


def _resolved(options: ConvertOptions) -> ConvertOptions:
    """``options`` with the layer mtime left to its default read here (``SOURCE_DATE_EPOCH``, as
    the image stage reads it), so a malformed value fails in the process that started the conversion."""
    if options.layer_image is None or options.layer_mtime is not None:
        return options
    from packer.util.tarfmt import source_date_epoch

    return replace(options, layer_mtime=source_date_epoch(errors.ImageError))


def _convert_here(src: Path, out: Path, cfg: WeightsConfig, rel_root: Path | None,
                  options: ConvertOptions) -> StageOutput:
    """:func:`packer.weights.convert.convert` in this process, with ``options`` (resolved)."""
    from packer.weights.convert import convert

    return convert(src, out, cfg, rel_root=rel_root, dry_run=options.dry_run, progress=options.progress,
                   verify=options.verify, layer_framing=_framing(options.layer_image, options.layer_mtime),
                   layer_blobs=options.layer_blobs)


def _request(src: Path, out: Path, cfg: WeightsConfig, rel_root: Path | None, options: ConvertOptions) -> str:
    """What the child is asked to do, as JSON (``options`` resolved; ``progress`` as a yes or no)."""
    return json.dumps({
        "src": str(src), "out": str(out), "cfg": asdict(cfg), "rel_root": str(rel_root) if rel_root else None,
        "dry_run": options.dry_run, "verify": options.verify, "progress": options.progress is not None,
        "image": asdict(options.layer_image) if options.layer_image else None, "blobs": options.layer_blobs,
        "mtime": options.layer_mtime, "limits": _limits(_input_size(src), cfg.max_expansion),
    })


def _options_from_request(request: dict[str, Any]) -> ConvertOptions:
    """The options :func:`_request` sent, as the child runs them (in itself; progress on stderr)."""
    return ConvertOptions(dry_run=request["dry_run"], sandbox=False, progress=_report if request["progress"] else None,
                          verify=request["verify"], layer_blobs=request["blobs"], layer_mtime=request["mtime"],
                          layer_image=ImageConfig(**request["image"]) if request["image"] else None)


def _child_main() -> int:
    request = parse_json(sys.stdin.buffer.read(), REPORT, where="the sandbox request", error=errors.CheckpointError)
    _isolate(request["limits"])
    import packer.weights.convert  # noqa: F401  (outside the try: a broken install is not the input's error)

    try:
        rel_root = Path(request["rel_root"]) if request["rel_root"] else None
        result = _convert_here(Path(request["src"]), Path(request["out"]), _cfg_from_json(request["cfg"]),
                               rel_root, _options_from_request(request))
    except errors.PackerError as e:
        json.dump({"error": str(e), "type": type(e).__name__}, sys.stdout)
        return 1
    except ImportError as e:  # the environment, not the input: name the package
        json.dump({"error": str(errors.missing_dependency(e)), "type": "DependencyError"}, sys.stdout)
        return 1
    except MemoryError:
        json.dump({"error": "out of memory (address-space limit reached)", "type": "CheckpointError"}, sys.stdout)
        return 1
    except OSError as e:  # a full disk or the file-size limit: still one line
        where = e.filename or request["out"]
        json.dump({"error": f"{where}: {e.strerror or e}", "type": "WeightsError"}, sys.stdout)
        return 1
    json.dump({"files": [asdict(f) for f in result.files], "section": result.section,
               "bytes": result.bytes_processed, "notes": list(result.notes),
               "digests": result.digests}, sys.stdout)
    return 0


# the child's reply, whose every field is checked before use: it comes from the process that read the input
_FILE = Obj(required={"path": STR, "size": SIZE, "sha256": STR}, optional={"blob": STR, "offset": SIZE})
_FAILED = Obj(required={"error": STR, "type": STR})
_DONE = Obj(required={"files": ListOf(_FILE), "section": MapOf(ANY), "bytes": SIZE, "notes": ListOf(STR)},
            optional={"digests": MapOf(STR)})


def _reply_files(reply: dict[str, Any]) -> tuple[FileEntry, ...]:
    """The files of a checked reply (only the fields a file entry has), each path once."""
    files = tuple(FileEntry(f["path"], f["size"], f["sha256"], f.get("blob", ""), f.get("offset", 0))
                  for f in reply["files"])
    if len({f.path for f in files}) != len(files):
        raise errors.CheckpointError("the reader's reply: names a file twice")
    return files


def error_class(name: str) -> type[errors.PackerError]:
    """The class in :mod:`packer.errors` named ``name`` (the child's error), else PackerError."""
    cls = getattr(errors, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, errors.PackerError) else errors.PackerError


def _killed_reason(rc: int) -> str:
    sig = -rc
    if sig == signal.SIGXCPU:
        return "CPU time limit reached (PACKER_SANDBOX_CPU)"
    if sig == signal.SIGXFSZ:
        return "output file size limit reached (PACKER_SANDBOX_FSIZE)"
    name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
    return f"reader process killed by {name}"


PROGRESS = "packer-progress "  # a line of the child's stderr: bytes just written


def _report(n: int) -> None:
    """The child's progress: one line on stderr per increment, read by the parent as it comes."""
    sys.stderr.write(f"{PROGRESS}{n}\n")
    sys.stderr.flush()


def _run_child(request: str, progress: Progress | None) -> tuple[subprocess.CompletedProcess[str], int]:
    """Run the child; pass on the increments it reports as it writes; return the bytes passed on.

    Its stderr is read line by line (progress lines apart), its stdout whole on a thread.
    """
    reported = 0
    lines: list[str] = []
    with subprocess.Popen([sys.executable, "-m", "packer.weights.sandbox"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        stdout, result = proc.stdout, []
        talker = threading.Thread(target=lambda: result.append(stdout.read()), daemon=True)
        talker.start()
        try:
            try:
                proc.stdin.write(request)
                proc.stdin.close()
            except BrokenPipeError:  # the child died first: its exit status says why
                pass
            for line in proc.stderr:
                if line.startswith(PROGRESS) and line[len(PROGRESS):].strip().isdigit():
                    n = int(line[len(PROGRESS):])
                    if progress is not None and n > 0:
                        progress(n)
                        reported += n
                else:
                    lines.append(line)
            talker.join()
            proc.wait()
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): the child's work is no longer wanted
            proc.kill()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, result[0] if result else "", "".join(lines))
    return done, reported


def convert_sandboxed(src: Path, out: Path, cfg: WeightsConfig, options: ConvertOptions, *,
                      rel_root: Path | None = None) -> StageOutput:
    """Run :func:`packer.weights.convert.convert` in an isolated child process.

    Args:
        src, out, cfg: as :func:`packer.weights.convert.convert`'s ``src``, ``dest_dir``, ``cfg``.
        rel_root: what file paths in the result are relative to (default ``out``).
        options: how it runs (:class:`~packer.weights.options.ConvertOptions`; ``sandbox`` is
            not read: this is the sandbox).

    Raises:
        PackerError: the child's own error, or why the child was stopped.
    """
    proc, reported = _run_child(_request(src, out, cfg, rel_root, _resolved(options)), options.progress)
    if proc.returncode < 0:
        raise errors.CheckpointError(f"converting {src}: {_killed_reason(proc.returncode)}")
    try:
        reply = parse_json(proc.stdout, REPORT, where="the reader's reply", error=errors.CheckpointError)
    except errors.CheckpointError:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise errors.CheckpointError(f"converting {src}: reader process failed: {last}") from None
    if "error" in reply:
        check_shape(reply, _FAILED, where="the reader's reply", error=errors.CheckpointError)
        raise error_class(reply["type"])(reply["error"])
    check_shape(reply, _DONE, where="the reader's reply", error=errors.CheckpointError)
    files = _reply_files(reply)
    if options.progress is not None and (rest := sum(f.size for f in files) - reported) > 0:
        options.progress(rest)  # the headers and the index: the child reports tensor bytes as it writes them
    return StageOutput(files=files, section=reply["section"], bytes_processed=reply["bytes"],
                       notes=tuple(reply["notes"]), digests=dict(reply.get("digests", {})))


def convert_cli(src: Path, out: Path, cfg: WeightsConfig, options: ConvertOptions, *,
                rel_root: Path | None = None) -> StageOutput:
    """The weights stage for ``packer convert`` and ``packer build``: isolated unless ``options.sandbox`` is false.

    Args:
        src, out, cfg, rel_root: as :func:`convert_sandboxed`.
        options: how it runs (:class:`~packer.weights.options.ConvertOptions`: progress, layer
            framing and blobs, the writer's read-back), the same with or without the sandbox.

    Raises:
        PackerError: from the conversion, sandboxed or not.
    """
    if options.sandbox:
        return convert_sandboxed(src, out, cfg, options, rel_root=rel_root)
    return _convert_here(src, out, cfg, rel_root, _resolved(options))


if __name__ == "__main__":
    sys.exit(_child_main())
