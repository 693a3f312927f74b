"""Session-wide test settings: never reach the hub, keep hypothesis quick and deterministic."""

from __future__ import annotations

import os

# Set before huggingface_hub is imported anywhere: tests only ever read a cache on disk.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ.setdefault("PACKER_STARTUP_LOG", "off")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile("long", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("PACKER_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def build_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The environment of a test that builds and loads: no start-up log, and the bundle cache in
    the test's own directory (never the user's). A module takes it with
    ``pytestmark = pytest.mark.usefixtures("build_env")``. Returns the cache directory."""
    monkeypatch.setenv("PACKER_STARTUP_LOG", "off")
    monkeypatch.setenv("PACKER_BUNDLE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# Under PACKER_TOOLS_REQUIRED=1 (.ci/run sets it) a skip is a failure unless its reason says the
# skip is about the hardware (no CUDA device here, too few cores) or about a marker that was not
# selected: a test guarded by a tool or package (skopeo, umoci, strace, ruff, an importorskip...)
# must not vanish with exit 0 because a package was renamed or an install step went missing.
TOOLS_REQUIRED = os.environ.get("PACKER_TOOLS_REQUIRED") == "1"
HARDWARE = "hardware: "  # the prefix of every skip reason that no install can fix
VLLM_NOT_SELECTED = "a vLLM test: run with pytest -m vllm (.ci/run does)"
CUDA_MISSING = HARDWARE + "needs a CUDA device (torch.cuda.is_available() is False)"


def _skip_reason(longrepr: object) -> str:
    # a skip's longrepr is (file, line, "Skipped: reason")
    return str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def _required_but_skipped(report: object) -> str | None:
    """The reason of a skip that PACKER_TOOLS_REQUIRED turns into a failure, else None."""
    if not TOOLS_REQUIRED or not getattr(report, "skipped", False) or hasattr(report, "wasxfail"):
        return None
    reason = _skip_reason(getattr(report, "longrepr", ""))
    if reason.removeprefix("Skipped: ").startswith((HARDWARE, VLLM_NOT_SELECTED)):
        return None
    return reason


def _fail_required(report: object, reason: str) -> None:
    report.outcome = "failed"  # type: ignore[attr-defined]
    report.longrepr = (f"PACKER_TOOLS_REQUIRED=1: this test was skipped ({reason}); "  # type: ignore[attr-defined]
                       "install what it names (.ci/run installs everything) or fix its guard")


def pytest_configure(config: object) -> None:
    import pytest

    class RequiredTools:
        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_makereport(self, item: object, call: object):  # type: ignore[no-untyped-def]
            outcome = yield
            report = outcome.get_result()
            if (reason := _required_but_skipped(report)) is not None:
                _fail_required(report, reason)

        @pytest.hookimpl(hookwrapper=True)
        def pytest_make_collect_report(self, collector: object):  # type: ignore[no-untyped-def]
            outcome = yield
            report = outcome.get_result()
            if (reason := _required_but_skipped(report)) is not None:  # a module-level importorskip
                _fail_required(report, reason)

    if TOOLS_REQUIRED:
        config.pluginmanager.register(RequiredTools(), "packer-tools-required")  # type: ignore[attr-defined]


def pytest_collection_modifyitems(config: object, items: list) -> None:  # type: ignore[type-arg]
    """Skip ``@pytest.mark.cuda`` tests where there is no CUDA device (CI never has one), and
    ``@pytest.mark.vllm`` tests unless asked for (``pytest -m vllm``: minutes of vLLM start-ups)."""
    import pytest

    if "vllm" not in (getattr(config, "option", None) and config.option.markexpr or ""):  # type: ignore[attr-defined]
        skip_vllm = pytest.mark.skip(reason=VLLM_NOT_SELECTED)
        for item in items:
            if item.get_closest_marker("vllm") is not None:
                item.add_marker(skip_vllm)
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=CUDA_MISSING)
    for item in marked:
        item.add_marker(skip)
