"""Every sample model, traced and checked against plain autograd.

For each file in ``sample_models/`` (seeded with ``torch.manual_seed(0)`` before
``build_model()`` and ``example_inputs()``), the trace is compared with an
independent forward and a plain ``loss.backward()`` computed by ``reference.py``:
the same graph (node names and edges), the same leaf gradients, a statistic for
every node that ran, and the model left as it was found.
"""

from __future__ import annotations

import collections
import functools
import json
import math
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from torch import nn

from .reference import (
    SAMPLE_NAMES,
    SAMPLES_DIR,
    as_call_args,
    canonical_order,
    load_sample,
    plain_grads,
    reference_loss,
    reference_backward,
    sample_model,
    with_input_grads,
)
from tracer_cli import trace

REL = 1e-4

CASES = [pytest.param(name, (), id=name) for name in SAMPLE_NAMES] + [
    pytest.param("checkpointed", (("use_reentrant", False),), id="checkpointed-nonreentrant"),
]


def test_every_expected_sample_exists():
    expected = {
        "classic_mul_div", "classic_exp_sum", "mlp", "cnn", "transformer",
        "custom_function", "nan_where", "dict_output", "checkpointed",
    }
    assert expected <= set(SAMPLE_NAMES)


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_sample_file_contract(name):
    """Docstring with the run command, the documented attributes, no seeding inside."""
    module = load_sample(name)
    doc = module.__doc__ or ""
    assert f"gradtrace run sample_models/{name}.py" in doc
    assert hasattr(module, "build_model") or callable(getattr(module, "model", None))
    assert callable(module.example_inputs)
    source = (SAMPLES_DIR / f"{name}.py").read_text()
    assert "manual_seed" not in source and "import tracer_cli" not in source


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_sample_is_deterministic(name):
    first, second = build(name), build(name)
    for p, q in zip(params_of(first.model).values(), params_of(second.model).values()):
        assert torch.equal(p, q)
    for a, b in zip(first.args, second.args):
        assert torch.equal(a, b)


@dataclass
class Built:
    model: Callable[..., Any]
    args: tuple
    kwargs: dict
    loss_fn: Callable[[Any], torch.Tensor] | None


def build(name: str, build_kwargs: tuple = ()) -> Built:
    """A fresh model and inputs for a sample, seeded with 0."""
    module = load_sample(name)
    torch.manual_seed(0)
    model = sample_model(module, **dict(build_kwargs))
    args, kwargs = as_call_args(module.example_inputs())
    return Built(model, args, kwargs, getattr(module, "loss_fn", None))


def params_of(model: Any) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters()) if isinstance(model, nn.Module) else {}


@dataclass
class Traced:
    built: Built
    result: Any  # tracer_cli.records.Trace
    training_before: bool | None
    grads_before: dict[str, Any]


@functools.lru_cache(maxsize=None)
def traced(name: str, build_kwargs: tuple = ()) -> Traced:
    """The sample traced once per test session (tracing is the expensive part)."""
    built = build(name, build_kwargs)
    params = params_of(built.model)
    training = built.model.training if isinstance(built.model, nn.Module) else None
    grads = {n: p.grad for n, p in params.items()}
    result = trace(built.model, built.args, built.kwargs, loss_fn=built.loss_fn, input_grad=True)  # as `gradtrace run` does
    return Traced(built, result, training, grads)


@functools.lru_cache(maxsize=None)
def reference_graph(name: str, build_kwargs: tuple = ()):
    """(loss value, nodes before backward, nodes created during backward, ReferenceBackward)."""
    built = build(name, build_kwargs)
    args, kwargs, _ = with_input_grads(built.args, built.kwargs)
    loss = reference_loss(built.model(*args, **kwargs), built.loss_fn)
    ref = reference_backward(loss)
    return float(loss.detach()), ref.before, ref.created, ref


def edge_signature(nodes: list[Any]) -> collections.Counter:
    """Multiset of (name, names of next_functions) of live autograd nodes."""
    return collections.Counter(
        (n.name(), tuple(None if f is None else f.name() for f, _ in n.next_functions)) for n in nodes
    )


def traced_edge_signature(result: Any, keep: Callable[[Any], bool]) -> collections.Counter:
    return collections.Counter(
        (n.name, tuple(None if j is None else result.nodes[j].name for j in n.next))
        for n in result.nodes
        if keep(n)
    )


def close(a: float, b: float, rel: float = REL) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-6)


# (a) the graph ---------------------------------------------------------------


@pytest.mark.parametrize("name, build_kwargs", CASES)
def test_node_names_match_independent_graph(name, build_kwargs):
    result = traced(name, build_kwargs).result
    _, before, created, _ = reference_graph(name, build_kwargs)

    forward_nodes = collections.Counter(n.name for n in result.nodes if n.created_in is None)
    assert forward_nodes == collections.Counter(n.name() for n in before)
    backward_nodes = collections.Counter(n.name for n in result.nodes if n.created_in is not None)
    assert backward_nodes == collections.Counter(n.name() for n in created)


@pytest.mark.parametrize("name, build_kwargs", CASES)
def test_edges_match_independent_graph(name, build_kwargs):
    result = traced(name, build_kwargs).result
    _, before, _, _ = reference_graph(name, build_kwargs)
    assert traced_edge_signature(result, lambda n: n.created_in is None) == edge_signature(before)


@pytest.mark.parametrize("name, build_kwargs", CASES)
def test_ids_are_dense_and_node_zero_is_the_loss(name, build_kwargs):
    result = traced(name, build_kwargs).result
    assert [n.id for n in result.nodes] == list(range(len(result.nodes)))
    _, before, _, _ = reference_graph(name, build_kwargs)
    assert result.nodes[0].name == before[0].name()
    assert result.nodes[0].order == 0
    for node in result.nodes:
        assert all(j is None or 0 <= j < len(result.nodes) for j in node.next)


def test_reentrant_checkpoint_inner_nodes_are_created_in_backward():
    result = traced("checkpointed").result
    checkpoint_ids = {n.id for n in result.find("CheckpointFunctionBackward")}
    assert len(checkpoint_ids) == 2
    inner = [n for n in result.nodes if n.created_in is not None]
    assert {n.created_in for n in inner} == checkpoint_ids
    names = collections.Counter(n.name for n in inner)
    # blocks[0]: fc1, fc2; blocks[1]: fc1, fc2, then the shared layer
    assert names["AddmmBackward0"] == 5
    assert names["NativeLayerNormBackward0"] == 2
    assert names["ReluBackward0"] == 2
    assert all(n.order is not None for n in inner)
    # the blocks' parameters are used only inside the checkpoints, so their
    # AccumulateGrad nodes did not exist before backward either
    created_in = {param: result.leaf(param).created_in for param in ("blocks.0.fc1.weight", "blocks.1.norm.bias")}
    assert all(c in checkpoint_ids for c in created_in.values()), created_in
    # shared's AccumulateGrad existed before backward (used outside the checkpoint)
    shared_created_in = result.leaf("shared.weight").created_in
    assert shared_created_in is None
    # before backward, only the checkpoint nodes stand for the blocks
    assert not any(n.name == "AddmmBackward0" and n.module and n.module.startswith("blocks")
                   for n in result.nodes if n.created_in is None)


def test_nodes_a_reentrant_checkpoint_makes_in_backward_get_the_line_of_the_op_they_repeat():
    """The recompute runs the checkpointed code again: each node it makes gets that code's line, the line
    the same op gets where the graph is made in forward (non-reentrant checkpointing)."""
    reentrant = traced("checkpointed").result
    in_forward = traced("checkpointed", (("use_reentrant", False),)).result
    code = (SAMPLES_DIR / "checkpointed.py").read_text().splitlines()
    checkpointed_lines = {  # Block.forward's and _last_block's lines: the code the checkpoints run
        f"sample_models/checkpointed.py:{number}"
        for number, line in enumerate(code, 1)
        if "return x + self.fc2(" in line or "return self.shared(self.blocks[1](h))" in line
    }
    assert len(checkpointed_lines) == 2

    def ops(result, keep):
        return collections.Counter((n.name, n.module, n.source) for n in result.nodes if not n.is_leaf and keep(n))

    made_in_backward = ops(reentrant, lambda n: n.created_in is not None)
    assert sum(made_in_backward.values()) >= 10
    assert made_in_backward == ops(in_forward, lambda n: n.source in checkpointed_lines)


def test_nonreentrant_checkpoint_graph_is_complete_before_backward():
    result = traced("checkpointed", (("use_reentrant", False),)).result
    assert all(n.created_in is None for n in result.nodes)
    assert not result.find("CheckpointFunctionBackward")
    # head, shared (outside), blocks.0 fc1/fc2, blocks.1 fc1/fc2, shared (inside)
    assert len(result.find("AddmmBackward0")) == 7
    assert result.leaf("shared.weight").runs == 1


# (b) leaf gradients ------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def reference_grads(name: str, build_kwargs: tuple = ()) -> dict[str, torch.Tensor]:
    built = build(name, build_kwargs)
    return plain_grads(built.model, built.args, built.kwargs, built.loss_fn)


@pytest.mark.parametrize("name, build_kwargs", CASES)
def test_leaf_norms_match_plain_backward(name, build_kwargs):
    result = traced(name, build_kwargs).result
    grads = reference_grads(name, build_kwargs)
    assert grads, "the sample should have at least one gradient"
    for param, grad in grads.items():
        leaf = result.leaf(param)
        assert leaf.is_leaf
        assert leaf.grad_inputs == ()
        stat = leaf.grad_outputs[0]
        assert stat.shape == tuple(grad.shape), param
        assert stat.dtype == str(grad.dtype).removeprefix("torch."), param
        expected = float(grad.norm())
        assert close(stat.norm, expected), (param, stat.norm, expected)


@pytest.mark.parametrize("name, build_kwargs", CASES)
def test_leaves_are_exactly_the_parameters_and_float_inputs(name, build_kwargs):
    t = traced(name, build_kwargs)
    named = [n.param for n in t.result.nodes if n.param is not None]
    assert len(named) == len(set(named)), "one AccumulateGrad per parameter"
    assert set(named) == set(reference_grads(name, build_kwargs))
    # parameters that require grad but get none from a plain backward (forgotten_layer plants two)
    requiring = {n for n, p in params_of(t.built.model).items() if p.requires_grad}
    assert set(t.result.params_without_grad) == requiring - set(reference_grads(name, build_kwargs))


def test_parameter_used_inside_and_outside_reentrant_checkpoint_runs_twice():
    result = traced("checkpointed").result
    for param in ("shared.weight", "shared.bias"):
        leaf = result.leaf(param)
        assert leaf.runs == 2
        assert [c.order for c in leaf.calls][0] == leaf.order
        assert leaf.calls[0].order < leaf.calls[1].order
    # the other parameters' leaves ran once
    for node in result.nodes:
        if node.param is not None and not node.param.startswith("shared."):
            assert node.runs == 1, node.param


def test_reentrant_double_run_calls_match_independent_hooks():
    built = build("checkpointed")
    model = built.model
    x = built.args[0].detach().requires_grad_()
    loss = reference_loss(model(x))
    calls: list[float] = []
    accumulate = model.shared.weight.view_as(model.shared.weight).grad_fn.next_functions[0][0]
    handle = accumulate.register_hook(lambda gi, go: calls.append(float(go[0].norm())))
    try:
        loss.backward()
    finally:
        handle.remove()
    leaf = traced("checkpointed").result.leaf("shared.weight")
    assert len(calls) == 2
    for call, expected in zip(leaf.calls, calls):
        assert close(call.grad_outputs[0].norm, expected)
    # the top-level statistic is the total accumulated, not either contribution
    assert close(leaf.grad_outputs[0].norm, float(model.shared.weight.grad.norm()))


def test_nan_where_sample_has_finite_loss_and_nan_grads():
    t = traced("nan_where")
    loss, _, _, _ = reference_graph("nan_where")
    assert math.isfinite(loss)
    assert math.isfinite(t.result.meta.loss)
    assert math.isnan(t.result.leaf("proj.weight").grad_outputs[0].norm)
    assert math.isfinite(t.result.leaf("head.weight").grad_outputs[0].norm)
    nonfinite = t.result.nonfinite_nodes()
    assert nonfinite and nonfinite[0].name == "SqrtBackward0"
    assert t.result.summary()["first_nonfinite"]["name"] == "SqrtBackward0"


# (c) statistics for every node that ran ------------------------------------------


@pytest.mark.parametrize("name, build_kwargs", CASES)
def test_every_executed_node_has_statistics(name, build_kwargs):
    result = traced(name, build_kwargs).result
    for node in result.nodes:
        if node.order is None:
            assert node.grad_inputs is None and node.grad_outputs is None, node
            continue
        assert node.grad_outputs is not None, node
        assert node.grad_inputs is not None, node
        assert len(node.grad_outputs) >= 1, node
        assert any(s is not None for s in node.grad_outputs), node


@pytest.mark.parametrize("name, build_kwargs", CASES)
def test_every_node_ran_in_a_topological_order(name, build_kwargs):
    result = traced(name, build_kwargs).result
    assert all(n.order is not None for n in result.nodes)
    orders = [c.order for n in result.nodes for c in n.calls] + [
        n.order for n in result.nodes if not n.calls
    ]
    assert sorted(orders) == list(range(len(orders))), "orders are dense and unique"
    for node in result.nodes:
        for j in node.next:
            if j is None:
                continue
            successor = result.nodes[j]
            last_run = max([c.order for c in successor.calls], default=successor.order)
            assert last_run > node.order, (node.label(), successor.label())


def same_stats(traced_stats, reference_stats) -> bool:
    """GradStat tuple vs reference (shape, dtype, norm) tuple, None where None."""
    if len(traced_stats) != len(reference_stats):
        return False
    for stat, ref in zip(traced_stats, reference_stats):
        if (stat is None) != (ref is None):
            return False
        if stat is not None:
            shape, dtype, norm = ref
            if stat.shape != shape or stat.dtype != dtype or not close(stat.norm, norm):
                return False
    return True


@pytest.mark.parametrize("name, build_kwargs", CASES)
def test_every_node_statistic_matches_independent_hooks(name, build_kwargs):
    """Pair trace nodes with reference nodes by breadth-first position; compare each run's stats."""
    result = traced(name, build_kwargs).result
    _, before, _, ref = reference_graph(name, build_kwargs)
    traced_order = canonical_order(
        result.nodes[0], lambda n: [None if j is None else result.nodes[j] for j in n.next], key=lambda n: n.id
    )
    reference_order = canonical_order(before[0], lambda n: [f for f, _ in n.next_functions])
    assert len(traced_order) == len(reference_order) == len(before)
    for node, ref_node in zip(traced_order, reference_order):
        assert node.name == ref_node.name()
        ref_calls = ref.calls[id(ref_node)]
        assert node.runs == len(ref_calls), node.label()
        runs = node.calls or ((node.grad_inputs, node.grad_outputs),)
        for run, (ref_in, ref_out) in zip(runs, ref_calls):
            grad_inputs, grad_outputs = (run.grad_inputs, run.grad_outputs) if node.calls else run
            assert same_stats(grad_inputs, ref_in), (node.label(), grad_inputs, ref_in)
            assert same_stats(grad_outputs, ref_out), (node.label(), grad_outputs, ref_out)


@pytest.mark.parametrize("name, build_kwargs", CASES)
def test_meta_loss_matches_independent_forward(name, build_kwargs):
    meta = traced(name, build_kwargs).result.meta
    loss, _, _, _ = reference_graph(name, build_kwargs)
    assert close(meta.loss, loss)
    assert isinstance(meta.loss_rule, str) and meta.loss_rule


@pytest.mark.parametrize("name, build_kwargs", CASES)
def test_json_round_trip_is_strict_and_lossless(name, build_kwargs):
    result = traced(name, build_kwargs).result
    document = result.to_dict()
    text = json.dumps(document, allow_nan=False, sort_keys=True)
    again = type(result).from_dict(json.loads(text))
    assert json.dumps(again.to_dict(), allow_nan=False, sort_keys=True) == text


# (d) the model is left as it was found ------------------------------------------


@pytest.mark.parametrize("name, build_kwargs", CASES)
def test_grads_and_mode_unchanged(name, build_kwargs):
    t = traced(name, build_kwargs)
    params = params_of(t.built.model)
    for n, p in params.items():
        assert p.grad is t.grads_before[n], n  # None stays None
    if isinstance(t.built.model, nn.Module):
        assert t.built.model.training == t.training_before
    for value in list(t.built.args) + list(t.built.kwargs.values()):
        if isinstance(value, torch.Tensor):
            assert not value.requires_grad and value.grad is None


@pytest.mark.parametrize("name", ["mlp", "cnn", "checkpointed"])
def test_existing_grads_and_eval_mode_are_restored(name):
    built = build(name)
    params = params_of(built.model)
    torch.manual_seed(1)
    existing = {n: torch.randn_like(p) for n, p in params.items()}
    for n, p in params.items():
        p.grad = existing[n].clone()
    built.model.eval()
    trace(built.model, built.args, built.kwargs, loss_fn=built.loss_fn, train=True)
    assert not any(m.training for m in built.model.modules())
    for n, p in params.items():
        assert torch.equal(p.grad, existing[n]), n


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_tracing_twice_gives_the_same_statistics(name):
    t = traced(name)
    again = trace(t.built.model, t.built.args, t.built.kwargs, loss_fn=t.built.loss_fn, input_grad=True)
    first = [(n.name, n.module, n.param, n.grad_inputs, n.grad_outputs) for n in t.result.nodes]
    second = [(n.name, n.module, n.param, n.grad_inputs, n.grad_outputs) for n in again.nodes]
    assert first == second


# module attribution on the samples ---------------------------------------------


def test_transformer_attribution_and_tied_weight():
    result = traced("transformer").result
    tied = [n for n in result.nodes if n.is_leaf and n.param in ("embed.weight", "lm_head.weight")]
    assert len(tied) == 1 and tied[0].param == "embed.weight"
    assert tied[0].module == "embed"
    assert tied[0].runs == 1
    assert [n.module for n in result.find("EmbeddingBackward0")] == ["embed"]
    assert [n.module for n in result.find("SoftmaxBackward0")] == ["block.attn"]
    assert [n.module for n in result.find("GeluBackward0")] == ["block.mlp.1"]
    assert sorted(n.module for n in result.find("NativeLayerNormBackward0")) == [
        "block.ln1", "block.ln2", "ln_f",
    ]
    # the loss is computed inside the root module's forward
    assert result.nodes[0].name == "NllLossBackward0"
    assert result.nodes[0].module == ""
    assert [n.module for n in result.find("MmBackward0")] == ["lm_head"]


def test_cnn_attribution_of_nested_modules():
    result = traced("cnn").result
    assert sorted(n.module for n in result.find("NativeBatchNormBackward0")) == [
        "blocks.0.bn1", "blocks.0.bn2", "blocks.1.bn1", "blocks.1.bn2", "stem.1",
    ]
    assert sorted(n.module for n in result.find("ConvolutionBackward0")) == [
        "blocks.0.conv1", "blocks.0.conv2", "blocks.1.conv1", "blocks.1.conv2", "stem.0",
    ]
    # the residual add is the block's own op, not its children's
    assert sorted(n.module for n in result.find("AddBackward0")) == ["blocks.0", "blocks.1"]
    assert [n.module for n in result.find("MeanBackward1")] == ["pool"]
    assert [n.module for n in result.find("ViewBackward0")] == [""]  # torch.flatten in forward
    assert [n.module for n in result.find("AddmmBackward0")] == ["head"]
    assert result.leaf("blocks.1.bn2.bias").module == "blocks.1.bn2"


def test_custom_function_node_is_recorded_like_a_builtin():
    result = traced("custom_function").result
    custom = result.find("MyLinearBackward")
    assert len(custom) == 2
    for node in custom:
        assert node.module == ""
        # x, weight, bias are tensors; scale and transpose are not, so 3 next functions
        assert len(node.grad_inputs) == len(node.next)
        assert all(s is not None for s in node.grad_outputs)
    first_layer = next(n for n in custom if any(
        j is not None and result.nodes[j].param == "input:0" for j in n.next))
    assert [s.shape for s in first_layer.grad_inputs] == [(4, 6), (5, 6), (5,)]
    assert first_layer.grad_outputs[0].shape == (4, 5)


def test_reentrant_checkpoint_inner_nodes_are_attributed():
    result = traced("checkpointed").result
    inner_addmm = sorted(n.module for n in result.find("AddmmBackward0") if n.created_in is not None)
    assert inner_addmm == [
        "blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2", "shared",
    ]
    outer_addmm = sorted(n.module for n in result.find("AddmmBackward0") if n.created_in is None)
    assert outer_addmm == ["head", "shared"]
    assert result.leaf("blocks.0.fc1.weight").module == "blocks.0.fc1"


def test_dict_output_sums_floating_outputs_only():
    t = traced("dict_output")
    root = t.result.nodes[0]
    assert root.name == "AddBackward0"
    assert root.module is None  # the tracer's own reduction, outside any module
    reductions = [t.result.nodes[j] for j in root.next]
    assert sorted(n.name for n in reductions) == ["SumBackward0", "SumBackward0"]
    assert all(n.module is None for n in reductions)


def test_double_run_total_ignores_grads_the_parameter_already_had():
    built = build("checkpointed")
    expected = reference_grads("checkpointed")["shared.weight"]
    for p in built.model.parameters():
        p.grad = torch.full_like(p, 100.0)
    result = trace(built.model, built.args, built.kwargs)
    leaf = result.leaf("shared.weight")
    assert leaf.runs == 2
    assert close(leaf.grad_outputs[0].norm, float(expected.norm()))
    assert torch.equal(built.model.shared.weight.grad, torch.full_like(expected, 100.0))
