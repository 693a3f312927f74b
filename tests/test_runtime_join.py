"""packer.runtime_join: the runtime modules join into one file in which every name means what it did."""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from packer.errors import StubError
from packer.formats import LOADER_NAME
from packer.runtime_join import amalgamate, import_block, runtime_modules
from tests.loader_fixtures import make_out
from tests.test_stub import import_emitted

ROOT = Path(__file__).resolve().parents[1]


def test_runtime_modules_join_in_dependency_order() -> None:
    mods = runtime_modules()
    names = [m.name for m in mods]
    assert names[-1] == "loader" and "bundle_reader" not in names and len(set(names)) == len(names)
    for i, m in enumerate(mods):
        assert set(m.deps) <= set(names[:i]), m.name  # every dependency comes first
        lines = (ROOT / "packer" / "runtime" / f"{m.name}.py").read_text().count("\n")
        assert lines <= 400, f"packer/runtime/{m.name}.py has {lines} lines (style: at most 400)"
    text = amalgamate()
    assert text == amalgamate() and text.count("from __future__ import annotations") == 1
    assert "from packer" not in text and "import packer" not in text
    assert text.startswith(mods[-1].doc_source)


def _fake_runtime(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    return tmp_path


LOADER_USES_A = """
    \"\"\"Entry.\"\"\"

    from __future__ import annotations

    from pathlib import PurePath

    from packer.runtime.a import (
        HELPER,
        helper,
    )

    VALUE = helper(PurePath("x"))
"""


def test_amalgamate_a_small_runtime(tmp_path: Path) -> None:
    a = """
        \"\"\"Module a.\"\"\"
        import os
        from pathlib import Path
        HELPER = 1
        def helper(p: object) -> str:
            return str(Path(os.fspath(str(p)))) + str(HELPER)
    """
    text = amalgamate(_fake_runtime(tmp_path, {"loader": LOADER_USES_A, "a": a}))
    assert text.startswith('"""Entry."""\n\nfrom __future__ import annotations\n\n'
                           "import os\nfrom pathlib import Path, PurePath\n\n\n# --- packer/runtime/a.py\n"
                           "# Module a.\nHELPER = 1\n")
    ns: dict[str, Any] = {}
    exec(compile(text, "amalgamated", "exec"), ns)
    assert ns["VALUE"] == "x1" and ns["__doc__"] == "Entry."


@pytest.mark.parametrize(("a", "error"), [
    ("import torch\nHELPER = 1\ndef helper(p): pass\n", "top-level import of 'torch'"),
    ("from . import b\n", "only 'from packer.runtime.<module> import <names>'"),
    ("from packer.fsutil import canonical_json\n", "only 'from packer.runtime.<module> import <names>'"),
    ("from packer.runtime.loader import VALUE\n", "import cycle loader -> a -> loader"),
    ("from packer.runtime.nowhere import x\n", "nowhere.py: not a runtime module"),
    ("from packer.runtime.bundle_reader import Bundle\n", "bundle_reader.py: not a runtime module"),
    ("HELPER = 1\nVALUE = 2\ndef helper(p): pass\n", "'VALUE' is bound by both a.py and loader.py"),
    ("HELPER = 1\ndef helper(p): pass\nclass PurePath: pass\n",
     "'PurePath' is bound by both a standard-library import and a.py"),
])
def test_amalgamate_refuses_what_one_file_cannot_hold(tmp_path: Path, a: str, error: str) -> None:
    (tmp_path / "bundle_reader.py").write_text("class Bundle: pass\n")
    with pytest.raises(StubError, match=error.replace(".", "[.]").replace("(", "[(]").replace(")", "[)]")):
        amalgamate(_fake_runtime(tmp_path, {"loader": LOADER_USES_A, "a": a}))


def test_import_block_merges_and_sorts_as_isort() -> None:
    pairs = [("", "sys"), ("typing", "Any"), ("", "os"), ("collections.abc", "Iterator"),
             ("collections.abc", "Callable"), ("typing", "Any"), ("", "os.path as osp"),
             ("os", "SEEK_SET"), ("os", "PathLike"), ("os", "fspath")]
    assert import_block(pairs) == ("import os\nimport os.path as osp\nimport sys\n"
                                   "from collections.abc import Callable, Iterator\n"
                                   "from os import SEEK_SET, PathLike, fspath\nfrom typing import Any\n")
    long = import_block([("typing", f"Name{i:03d}") for i in range(12)])
    assert long.startswith("from typing import (\n    Name000,\n") and long.endswith("    Name011,\n)\n")


def test_every_runtime_module_is_joined() -> None:
    files = {p.stem for p in (ROOT / "packer" / "runtime").glob("*.py")} - {"__init__", "bundle_reader"}
    assert {m.name for m in runtime_modules()} == files  # a new module needs no list to be emitted


def _same(a: Any, b: Any) -> bool:
    """Whether ``b`` (from the emitted file) stands for what ``a`` (from the package) is."""
    if inspect.isfunction(a) or (inspect.isclass(a) and a.__module__.startswith("packer.")):
        return type(a) is type(b) and (a.__qualname__, inspect.getsource(a)) == (b.__qualname__, inspect.getsource(b))
    if inspect.ismodule(a) or inspect.isclass(a) or inspect.isbuiltin(a):
        return a is b  # the standard library's own object
    return type(a).__qualname__ == type(b).__qualname__ or a is None  # None: the embedded block


def test_each_runtime_name_means_the_same_in_the_emitted_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What ruff's undefined-name and redefinition checks would say, without ruff.
    make_out(tmp_path, bundle=False)
    module = import_emitted(tmp_path / LOADER_NAME)
    monkeypatch.setitem(sys.modules, module.__name__, module)  # for inspect.getsource of its classes
    emitted = vars(module)
    for m in runtime_modules():
        pkg = vars(importlib.import_module(f"packer.runtime.{m.name}"))
        for n in m.uses:  # builtins: never shadowed by another module's name
            assert n not in emitted or n.startswith("__"), f"{m.name}.py: {n}"
        for n, value in pkg.items():
            if not n.startswith("__"):
                assert n in emitted and _same(value, emitted[n]), f"{m.name}.py: {n}"


def _runtime(tmp_path: Path, files: dict[str, str]) -> Path:
    (tmp_path / "bundle_reader.py").write_text("class Bundle: pass\n")
    return _fake_runtime(tmp_path, {"loader": LOADER_USES_A, "a": "HELPER = 1\ndef helper(p): pass\n", **files})


A_USES_B = "from packer.runtime.b import HELPER\ndef helper(p): pass\n"


@pytest.mark.parametrize(("files", "error"), [
    # the four ways a plain join broke or shadowed at run time
    ({"a": "from packer.runtime.b import HELPER as HELPER\ndef helper(p): pass\n", "b": "HELPER = 1\n"},
     "a.py: line 1: 'from packer.runtime.b import HELPER as HELPER': the emitted file drops this line"),
    ({"a": "from packer.runtime.b import *\n", "b": "HELPER = 1\n"}, "b import [*]': the emitted file drops"),
    ({"a": "HELPER = 1\ndef helper(p):\n    from packer.runtime.b import X\n    return X\n", "b": "X = 1\n"},
     "a.py: line 3: imports packer code inside a function or block"),
    ({"a": "HELPER = 1\ndef helper(p):\n    import packer.fsutil\n"}, "a.py: line 3: imports packer code inside"),
    ({"a": "import sys\nif sys:\n    from packer.runtime.b import HELPER\ndef helper(p): pass\n", "b": "HELPER = 1\n"},
     "a.py: line 3: imports packer code inside a function or block"),
    ({"a": "HELPER = 1\nif HELPER:\n    VALUE = 3\ndef helper(p): pass\n"},
     "'VALUE' is bound by both a.py and loader.py"),
    ({"b": "try:\n    X = 1\nexcept ImportError:\n    X = 2\n", "c": "if True:\n    X = 1\n"},
     "'X' is bound by both b.py and c.py"),
    ({"b": "def f():\n    global HELPER\n    HELPER = 2\n"}, "'HELPER' is bound by both a.py and b.py"),
    ({"b": "import datetime\nA = datetime\n", "c": "from datetime import datetime\nB = datetime\n"},
     "'datetime' is bound by 'import datetime' in b.py and by 'from datetime import datetime' in c.py"),
    ({"b": "import sys\nif sys:\n    import datetime\n", "c": "from datetime import datetime\n"},
     "'datetime' is bound by 'import datetime' in b.py and by 'from datetime import datetime' in c.py"),
    ({"b": "import sys\nif sys:\n    import datetime\n", "c": "datetime = 1\n"},
     "'datetime' is bound by both an import in b.py and c.py"),
    ({"b": "from os import path\n", "c": "import os.path as path\nimport posixpath as path2\n",
      "d": "import posixpath as path\n"}, "'path' is bound by 'from os import path' in b.py and by 'import posixpath"),
    # names that resolved only because the modules shared one file
    ({"a": "def helper(p): pass\n"}, "loader.py: imports 'HELPER' from a.py, which does not bind it"),
    ({"a": "HELPER = 1\ndef helper(p): return PurePath(p)\n"}, "a.py: uses 'PurePath' but neither binds nor imports"),
    ({"b": "def open(p): pass\n", "c": "def g(p):\n    return open(p)\n"},
     "c.py: uses the builtin 'open', which b.py rebinds"),
    ({"a": A_USES_B, "b": "HELPER = 1\nif __name__ == '__main__':\n    pass\n"},
     "b.py: only loader.py may have an 'if __name__"),
    ({"a": "HELPER = (\n"}, "a.py: line 1: "),
    ({"a": "from os import *\nHELPER = 1\ndef helper(p): pass\n"}, "'import [*]' hides which names"),
])
def test_join_refuses_what_would_change_meaning(tmp_path: Path, files: dict[str, str], error: str) -> None:
    with pytest.raises(StubError, match=error.replace(".", "[.]").replace("(", "[(]").replace(")", "[)]")):
        amalgamate(_runtime(tmp_path, files))


def test_join_refuses_a_subpackage(tmp_path: Path) -> None:
    (tmp_path / "warm").mkdir()
    (tmp_path / "warm" / "pool.py").write_text("X = 1\n")
    with pytest.raises(StubError, match="warm/pool.py: the emitted loader joins only the modules directly in"):
        amalgamate(_runtime(tmp_path, {}))


def test_join_keeps_one_spelling_and_new_modules(tmp_path: Path) -> None:
    typing = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from torch import Tensor\n"
    files = {"b": "import os.path\nimport os\nfrom os import path\n\nEXTRA = (os, path)\n",
             "t1": typing + "def f(x: Tensor) -> None: pass\n", "t2": typing + "def g(x: Tensor) -> None: pass\n",
             "c": "from os import path\nfrom packer.runtime.b import EXTRA\n\nBOTH = EXTRA, path\n"}
    ns: dict[str, Any] = {}
    exec(compile(amalgamate(_runtime(tmp_path, files)), "joined", "exec"), ns)
    assert ns["BOTH"][0][1] is ns["BOTH"][1] and "VALUE" in ns  # modules the loader does not import too


def test_a_module_that_imports_the_entry_comes_after_it(tmp_path: Path) -> None:
    loader = textwrap.dedent(LOADER_USES_A) + "\n\nif __name__ == '__main__':\n    VALUE = 'main'\n"
    files = {"loader": loader, "z": "from packer.runtime.loader import VALUE\n\nDOUBLE = VALUE * 2\n",
             "m": "from packer.runtime.a import helper\n\nSIDE = helper\n",
             "a": "HELPER = 1\ndef helper(p): return str(p) + str(HELPER)\n"}
    text = amalgamate(_runtime(tmp_path, files))
    assert [x.split(".py")[0] for x in text.split("# --- packer/runtime/")[1:]] == ["a", "m", "loader", "z"]
    assert text.endswith("\n\n\nif __name__ == '__main__':\n    VALUE = 'main'\n")
    for name, value in (("joined", "x1x1"), ("__main__", "x1x1")):
        ns: dict[str, Any] = {"__name__": name}
        exec(compile(text, "joined", "exec"), ns)
        assert ns["DOUBLE"] == value  # the main block runs after every module is defined
