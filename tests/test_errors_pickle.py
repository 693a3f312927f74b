"""Every public error class pickles and unpickles to the same class, message and attributes: an
error raised in a worker process (the sandbox, a pool) arrives as itself, never as a TypeError.

The classes are enumerated, not listed: every exception in ``packer.__all__``, every class of
``packer.errors`` and every exception class defined in a module of ``packer/runtime/``.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
from typing import Any

import pytest

import packer
import packer.errors
import packer.runtime
from packer.util.show import show

MSG = "packer: bad \x1b[31mthing\x07 in 'x.json'"


def _public_errors() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in packer.__all__:
        value = getattr(packer, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            found[f"packer.{name}"] = value
    modules = [packer.errors] + [importlib.import_module(f"packer.runtime.{m.name}")
                                 for m in pkgutil.iter_modules(packer.runtime.__path__)]
    for module in modules:
        for name, value in vars(module).items():
            if (isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == module.__name__
                    and not name.startswith("_")):
                found[f"{module.__name__}.{name}"] = value
    return found


ERRORS = _public_errors()


def _make(cls: type[BaseException]) -> BaseException:
    """An instance as its raisers make it: the message, and a sample for each further required argument."""
    params = [p for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
              if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    extra: list[Any] = [{"models/config.json": (12, "ab" * 32)}] * max(0, len(params) - 1)
    return cls(MSG, *extra)


def test_the_enumeration_finds_the_known_classes() -> None:
    names = {cls.__name__ for cls in ERRORS.values()}
    assert {"BlobDigestError", "WarmStateError", "ArtifactMismatchError", "BundleFormatError", "PlaceError",
            "RegistryError"} <= names and len(ERRORS) >= 25


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_every_public_error_pickles_to_the_same_type_and_message(name: str) -> None:
    cls = ERRORS[name]
    error = _make(cls)
    error.add_note("a cleanup also failed")
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(error, protocol))
        assert type(back) is cls and str(back) == str(error) and back.args == error.args
        assert str(error) in (MSG, show(MSG))  # EngineAdapterError escapes its message for the engine's log
        assert vars(back) == vars(error)  # attributes (BlobDigestError.found) and notes come along


def test_an_error_with_context_pickles_too() -> None:
    error = packer.errors.BlobDigestError(MSG, {"a": (1, "b" * 64)}).with_context("pushing")
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is packer.errors.BlobDigestError and str(back) == f"pushing: {MSG}"


# --- the emitted loader's errors show their public names -------------------------------------

def test_the_emitted_loaders_errors_show_the_name_users_import_them_by(tmp_path: Any) -> None:
    """In a build, ``ArtifactMismatchError`` and ``RegistryError`` show as ``packer_loader.<name>`` (a
    traceback's last line, repr), not as ``_packer_runtime_<hash>.…``; each still pickles to its own
    build's class where two builds are loaded, and is the class ``packer_loader`` hands out."""
    import traceback

    from packer.stub import LOADER_NAME, emit_loader
    from tests.test_stub import import_emitted

    a, b = tmp_path / "a", tmp_path / "b"
    emit_loader(a, {"name": "a", "runtime": {"device": "cpu", "warmup": []}})
    emit_loader(b, {"name": "b", "runtime": {"device": "cpu", "warmup": []}})
    ma, mb = import_emitted(a / LOADER_NAME), import_emitted(b / LOADER_NAME)
    for mod in (ma, mb):
        for cls in (mod.ArtifactMismatchError, mod.RegistryError):
            assert f"{cls.__module__}.{cls.__qualname__}" == f"packer_loader.{cls.__name__}"
            err = cls("w.safetensors: sha256 \x1b[31m")
            line = traceback.format_exception_only(err)[-1]
            assert line == f"packer_loader.{cls.__name__}: w.safetensors: sha256 \\x1b[31m\n"
            back = pickle.loads(pickle.dumps(err))
            assert type(back) is cls and back.args == err.args  # this build's class, message as made
        assert issubclass(mod.RegistryError, mod.ArtifactMismatchError)
    assert ma.ArtifactMismatchError is not mb.ArtifactMismatchError  # each build its own
    assert "_packer_runtime_" not in repr(ma.RegistryError("x")) + str(ma.RegistryError)
    with pytest.raises(AttributeError):
        ma.NoSuchName  # noqa: B018
    # the build side's runtime package keeps its own importable name
    assert packer.runtime.env.ArtifactMismatchError.__module__ == "packer.runtime.env"


def test_the_build_sides_errors_show_and_pickle_as_packer_names() -> None:
    """Each class of packer.errors is ``packer.<Name>`` (what the README's paragraph and a user's
    ``except`` name), in a traceback and through pickle; none is left under ``packer.errors.``."""
    import traceback

    classes = [v for v in vars(packer.errors).values() if isinstance(v, type) and issubclass(v, BaseException)]
    assert len(classes) >= 20
    for cls in classes:
        assert cls.__module__ == "packer" and cls.__name__ in packer.__all__
        assert getattr(packer, cls.__qualname__) is cls
        err = _make(cls)
        assert traceback.format_exception_only(err)[-1].startswith(f"packer.{cls.__name__}: ")
        assert type(pickle.loads(pickle.dumps(err))) is cls
