"""Session-wide test settings: never reach the hub, keep hypothesis quick and deterministic."""

from __future__ import annotations

import os

# Set before huggingface_hub is imported anywhere: tests only ever read a cache on disk.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ.setdefault("PACKER_STARTUP_LOG", "off")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile("long", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("PACKER_HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config: object, items: list) -> None:  # type: ignore[type-arg]
    """Skip ``@pytest.mark.cuda`` tests where there is no CUDA device (CI never has one), and
    ``@pytest.mark.vllm`` tests unless asked for (``pytest -m vllm``: minutes of vLLM start-ups)."""
    import pytest

    if "vllm" not in (getattr(config, "option", None) and config.option.markexpr or ""):  # type: ignore[attr-defined]
        skip_vllm = pytest.mark.skip(reason="a vLLM test: run with pytest -m vllm (.ci/run does)")
        for item in items:
            if item.get_closest_marker("vllm") is not None:
                item.add_marker(skip_vllm)
    marked = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in marked:
        item.add_marker(skip)
