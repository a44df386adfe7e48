"""Golden files for the terminal tree (fixed width, no colour) and JSON round trips.

Regenerate the golden files after an intended change of the output with
``GRADTRACE_UPDATE_GOLDEN=1 python -m pytest tests/test_render.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from rich.console import Console

from tracer_cli import trace
from tracer_cli.records import Trace
from tracer_cli.render.json import dumps, loads
from tracer_cli.render.tree import TreeOptions, render_trace

from .reference import load_sample

GOLDEN = Path(__file__).parent / "golden"
FIXED_TIMES = {"forward": 0.001, "backward": 0.002, "total": 0.004}


def sample_trace(name: str, **kwargs) -> Trace:
    module = load_sample(name)
    torch.manual_seed(0)
    model = module.build_model() if hasattr(module, "build_model") else module.model
    torch.manual_seed(0)
    inputs = module.example_inputs()
    args, kw = ((inputs,), {}) if isinstance(inputs, torch.Tensor) else ((), inputs) if isinstance(inputs, dict) else (inputs, {})
    result = trace(model, args, kw, loss_fn=getattr(module, "loss_fn", None), target=f"sample_models/{name}.py", **kwargs)
    return result.with_meta(timings_s=FIXED_TIMES, torch="2.x")


def render_text(result: Trace, options: TreeOptions) -> str:
    console = Console(width=120, color_system=None, record=True, file=open(os.devnull, "w"))
    console.print(render_trace(result, options))
    return console.export_text()


@pytest.mark.parametrize(
    "name, options, golden",
    [
        ("classic_mul_div", TreeOptions(), "classic_mul_div.modules.txt"),
        ("mlp", TreeOptions(), "mlp.modules.txt"),
        ("mlp", TreeOptions(view="graph"), "mlp.graph.txt"),
        ("nan_where", TreeOptions(view="graph"), "nan_where.graph.txt"),
        ("checkpointed", TreeOptions(view="graph"), "checkpointed.graph.txt"),
        ("cnn", TreeOptions(depth=1), "cnn.depth1.txt"),
    ],
)
def test_tree_golden(name, options, golden):
    text = render_text(sample_trace(name), options)
    path = GOLDEN / golden
    if os.environ.get("GRADTRACE_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text()


@pytest.mark.parametrize("name", ["mlp", "nan_where", "checkpointed", "custom_function", "transformer"])
def test_json_round_trip(name):
    result = sample_trace(name)
    text = dumps(result)
    json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c}"))
    again = loads(text)
    if not result.nonfinite_nodes():  # nan != nan, so compare those through to_dict only
        assert again == result
    assert again.to_dict() == result.to_dict()


def test_unknown_schema_is_refused():
    with pytest.raises(ValueError, match="gradtrace/1"):
        Trace.from_dict({"schema": "gradtrace/99", "meta": {}, "nodes": []})
