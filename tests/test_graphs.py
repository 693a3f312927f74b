"""Graph warm-up on CPU: structure-preserving output clones, what a failed capture leaves."""

from __future__ import annotations

import collections
import dataclasses
import warnings
from typing import Any

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from packer.runtime.graphs import Captured, GraphPool, _clone_out


class Pair(collections.namedtuple("Pair", ["logits", "extra"])):
    pass


@dataclasses.dataclass
class Plain:
    hidden: torch.Tensor
    steps: int


def _fresh(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) and a.data_ptr() != b.data_ptr()


def test_clone_keeps_model_output_named_tuples_and_leaves() -> None:
    logits, past = torch.randn(2, 5), torch.randn(3)
    out = CausalLMOutputWithPast(logits=logits, past_key_values=((past, past),))
    got = _clone_out(out)
    assert type(got) is CausalLMOutputWithPast and _fresh(got.logits, logits) and _fresh(got["logits"], logits)
    assert got.logits is got["logits"] and got[0] is got.logits and got.loss is None
    assert _fresh(got.past_key_values[0][1], past) and list(got.keys()) == list(out.keys())

    pair = _clone_out(Pair(logits, {"n": 3, "name": "x", "t": past, "none": None}))
    assert type(pair) is Pair and _fresh(pair.logits, logits)
    assert pair.extra["n"] == 3 and pair.extra["name"] == "x" and pair.extra["none"] is None
    assert _fresh(pair.extra["t"], past)

    plain = _clone_out(Plain(logits, 7))
    assert type(plain) is Plain and _fresh(plain.hidden, logits) and plain.steps == 7
    mixed = _clone_out([logits, (past, 1.5), "s"])
    assert type(mixed) is list and type(mixed[1]) is tuple and mixed[1][1] == 1.5 and mixed[2] == "s"
    assert _fresh(mixed[0], logits)


def _fake_capture(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], pool: Any) -> Captured:
    static = [a.clone() for a in args]

    def replay() -> None:
        fresh = model(*static)
        captured.output.logits.copy_(fresh.logits)

    captured = Captured(replay, static, model(*static))
    return captured


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> CausalLMOutputWithPast:
        return CausalLMOutputWithPast(logits=self.lin(x))


def test_replayed_model_output_keeps_its_attributes() -> None:
    model = TinyLM()
    pool = GraphPool(model, capture=_fake_capture)
    x = torch.randn(2, 4)
    assert pool.capture((x,), {})
    with torch.inference_mode():
        want = model(x).logits
    got = pool(x)
    assert pool.replays == 1 and isinstance(got, CausalLMOutputWithPast)
    assert torch.equal(got.logits, want)  # .logits works after a replay, as it does eagerly
    again = pool(x + 1)
    assert not torch.equal(got.logits, again.logits)  # a later replay never overwrites it


def test_failed_capture_stops_capturing_and_warns() -> None:
    calls: list[tuple[int, ...]] = []

    def fails_once(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], pool: Any) -> Captured:
        calls.append(tuple(args[0].shape))
        raise RuntimeError("operation not permitted when stream is capturing")

    model = torch.nn.Linear(4, 3)
    pool = GraphPool(model, capture=fails_once)
    with pytest.warns(RuntimeWarning, match="capture failed .*runs eagerly"):
        assert not pool.capture((torch.randn(2, 4),), {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not pool.capture((torch.randn(5, 4),), {})  # not tried again, no second warning
    assert calls == [(2, 4)] and not pool.capturing and "not permitted" in pool.eager_reason
    out = pool(torch.randn(5, 4))
    assert out.shape == (5, 3) and pool.fallbacks == 1
