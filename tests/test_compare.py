"""compare(): the origin of a disagreement between traces, for each kind, on single-process traces."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tracer_cli import trace
from tracer_cli.compare import compare, relative_spread, values_differ


class Scale(torch.autograd.Function):
    """Identity forward; the backward multiplies by ``k`` (k=1 is the correct backward)."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.k, None


class Net(nn.Module):
    def __init__(self, forward_factor=1.0, backward_factor=1.0, extra_op=False):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.forward_factor = forward_factor
        self.backward_factor = backward_factor
        self.extra_op = extra_op

    def forward(self, x):
        h = torch.relu(self.first(x))
        h = self.second(h) * self.forward_factor
        if self.extra_op:
            h = h.exp()
        h = Scale.apply(h, self.backward_factor)
        return self.head(h)


X = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


def traced(model_changes=None, **kwargs):
    torch.manual_seed(0)
    model = Net(**kwargs)
    if model_changes:
        model_changes(model)
    return trace(model, X, forward_stats=True)


def test_identical_runs_agree():
    comparison = compare([traced(), traced()], labels=[0, 1])
    assert comparison["first_divergent"] is None
    assert comparison["unsynchronized_params"] == []
    assert all(entry["forward"] in (0.0, None) for entry in comparison["nodes"])
    assert [row["rank"] for row in comparison["ranks"]] == [0, 1]


def test_forward_origin_is_the_op_whose_output_changed():
    comparison = compare([traced(), traced(forward_factor=1.01)], labels=[0, 1])
    first = comparison["first_divergent"]
    assert first["kind"] == "forward"
    assert first["name"] == "MulBackward0" and first["module"] == ""  # the root's own `* factor`
    assert first["ranks"] == [1]


def test_a_changed_parameter_is_its_own_origin():
    def nudge(model):
        with torch.no_grad():
            model.second.weight[0, 0] += 0.1

    first = compare([traced(), traced(nudge)], labels=[0, 1])["first_divergent"]
    assert first["kind"] == "forward"
    assert first["param"] == "second.weight" and first["module"] == "second"


def test_backward_origin_is_the_node_that_sends_on_different_gradients():
    first = compare([traced(), traced(backward_factor=2.0)], labels=[0, 1])["first_divergent"]
    assert first["kind"] == "backward"
    assert first["name"] == "ScaleBackward"


def test_structure_origin_is_the_first_node_that_does_not_align():
    comparison = compare([traced(), traced(extra_op=True)], labels=[0, 1])
    first = comparison["first_divergent"]
    assert first["kind"] == "structure"
    assert first["name"] == "ExpBackward0"
    assert comparison["nodes"] == []  # values of different graphs are not compared
    assert "graphs differ" in comparison["note"]


def test_a_structure_origin_is_marked_only_in_the_tree_of_the_rank_whose_node_it_is():
    """The graphs differ, so its id on the other rank is another node (there: SigmoidBackward0's neighbour)."""
    from tracer_cli.render.comparison import divergence_marks

    a, b = traced(), traced(extra_op=True)
    comparison = compare([a, b], labels=[0, 1])
    first = comparison["first_divergent"]
    assert first["rank"] == 1 and b.nodes[first["id"]].name == "ExpBackward0"
    assert a.nodes[first["id"]].name != "ExpBackward0"  # the same id names another node of rank 0
    assert first["id"] in divergence_marks(comparison, 1)
    assert first["id"] not in divergence_marks(comparison, 0)
    assert "of rank 1's graph" in _comparison_text(comparison)
    # forward and backward origins: the graphs align, the id is the same node on every rank
    forward = compare([traced(), traced(forward_factor=1.01)], labels=[0, 1])
    assert forward["first_divergent"]["id"] in divergence_marks(forward, 0)


def test_majority_names_the_odd_rank_out():
    traces = [traced(), traced(backward_factor=3.0), traced()]
    first = compare(traces, labels=[0, 1, 2])["first_divergent"]
    assert first["kind"] == "backward" and first["ranks"] == [1]


def test_inputs_differ_compares_only_parameter_gradients():
    torch.manual_seed(0)
    model = Net()
    a = trace(model, X, forward_stats=True)
    b = trace(model, X * 2, forward_stats=True)
    comparison = compare([a, b], labels=[0, 1], inputs_differ=True)
    assert comparison["first_divergent"] is None
    assert "rank-seed" in comparison["note"]
    assert "head.bias" not in comparison["unsynchronized_params"]  # d(sum)/d(bias) does not depend on x
    assert "head.weight" in comparison["unsynchronized_params"]


def test_inputs_differ_still_compares_the_parameters():
    """Under --rank-seed the data differs by rank, the parameters must not (data parallelism keeps them equal)."""
    torch.manual_seed(0)
    model = Net()
    a = trace(model, X, forward_stats=True)
    with torch.no_grad():
        model.second.weight[0, 0] += 0.1  # one rank's copy of the weights went its own way
    b = trace(model, X * 2, forward_stats=True)
    first = compare([a, b], labels=[0, 1], inputs_differ=True)["first_divergent"]
    assert first is not None and first["kind"] == "forward"
    assert first["param"] == "second.weight" and first["ranks"] == [1]


@pytest.mark.parametrize(
    "values, expected",
    [
        ([1.0, 1.0], False),
        ([1.0, 1.0 + 1e-7], False),
        ([1.0, 1.001], True),
        ([0.0, 0.0], False),
        ([math.nan, math.nan], False),
        ([math.nan, 1.0], True),
        ([math.inf, math.inf], False),
        ([None, None], False),
        ([None, 1.0], True),
    ],
)
def test_values_differ(values, expected):
    assert values_differ(values, rtol=1e-5, atol=1e-12) is expected


def test_relative_spread():
    assert relative_spread([2.0, 1.0]) == pytest.approx(0.5)
    assert relative_spread([0.0, 0.0]) == 0.0
    assert relative_spread([math.nan, 1.0]) == math.inf
    assert relative_spread([None, None]) is None


def _comparison_text(comparison) -> str:
    from rich.console import Console

    from tracer_cli.render.comparison import render_comparison

    console = Console(width=300, color_system=None)
    with console.capture() as captured:
        console.print(render_comparison(comparison))
    return captured.get()


def test_the_comparison_says_agree_only_when_nothing_differs():
    agree = _comparison_text(compare([traced(), traced()], labels=[0, 1]))
    assert "ranks agree" in agree and "differ" not in agree
    # a weight that differs (no DDP to average it): the divergence, and the gradients it changed are listed too
    differ = compare([traced(), traced(lambda m: m.head.weight.data.mul_(2))], labels=[0, 1])
    assert differ["first_divergent"] is not None and "first.weight" in differ["unsynchronized_params"]
    text = _comparison_text(differ)
    assert "first divergence" in text and "first.weight" in text.split("after backward: ")[1]
    assert "ranks agree" not in text and "gradients agree across" not in text
    # --rank-seed: node values are not compared; parameter gradients that differ are not "agree"
    rank_seeded = compare([traced(), traced(lambda m: m.head.weight.data.mul_(2))], inputs_differ=True, labels=[0, 1])
    text = _comparison_text(rank_seeded)
    assert "ranks agree" not in text and "gradients agree across" not in text, text
    assert "first.weight" in text.split("after backward: ")[1]
    healthy = _comparison_text(compare([traced(), traced()], inputs_differ=True, labels=[0, 1]))
    assert "parameter gradients agree across ranks" in healthy and "ranks agree" not in healthy


def test_a_trace_without_forward_values_is_compared_by_its_gradients_only():
    """--json records forward values, trace() does not by default: not a difference of every node (inf)."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)), torch.randn(3, 4)
    comparison = compare([trace(model, x, forward_stats=True), trace(model, x)])
    assert comparison["first_divergent"] is None
    assert all(entry["forward"] is None for entry in comparison["nodes"])
    assert "forward values were not recorded" in comparison["note"]


class _Extra(nn.Module):
    def __init__(self, extra: bool):
        super().__init__()
        self.fc, self.extra = nn.Linear(4, 4), extra

    def forward(self, x):
        h = self.fc(x)
        if self.extra:
            h = h.sigmoid()
        return h.tanh()


def test_with_two_traces_the_one_with_the_extra_node_is_the_one_that_differs():
    """No majority to vote with: an op that one trace has and the other lacks is the origin, whichever comes first."""
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    plain, extra = _Extra(False), _Extra(True)
    extra.load_state_dict(plain.state_dict())
    with_extra, without = trace(extra, x), trace(plain, x)
    for traces, labels, owner in (([with_extra, without], [0, 1], 0), ([without, with_extra], [0, 1], 1)):
        first = compare(traces, labels=labels)["first_divergent"]
        assert (first["kind"], first["name"], first["ranks"], first["rank"]) == ("structure", "SigmoidBackward0", [owner], owner)


# a wrapper's prefix on parameter names (DDP, DataParallel, torch.compile, FSDP) -----------------------


class Wrapper(nn.Module):
    """Holds the model under one attribute, as DistributedDataParallel (``module``) or FSDP (``_fsdp_wrapped_module``)."""

    def __init__(self, inner: nn.Module, attribute: str):
        super().__init__()
        self.attribute = attribute
        setattr(self, attribute, inner)

    def forward(self, x):
        return getattr(self, self.attribute)(x)


def traced_wrapped(attributes, model_changes=None):
    torch.manual_seed(0)
    model = Net()
    if model_changes:
        model_changes(model)
    for attribute in attributes:
        model = Wrapper(model, attribute)
    return trace(model, X, forward_stats=True)


@pytest.mark.parametrize("attributes, prefix", [(["module"], "module."), (["_fsdp_wrapped_module", "module"], "module._fsdp_wrapped_module.")])
@pytest.mark.parametrize("wrapped_first", [True, False])
def test_a_wrapped_model_lines_up_with_the_bare_one(attributes, prefix, wrapped_first):
    """The same model, the same weights: the traces agree once the wrapper's prefix is set aside."""
    from tracer_cli.compare import strip_prefix, wrapper_prefix

    wrapped, bare = traced_wrapped(attributes), traced()
    assert wrapped.leaf(prefix + "second.weight")  # the tracer names the parameters as the wrapper holds them
    traces = [wrapped, bare] if wrapped_first else [bare, wrapped]
    side = 0 if wrapped_first else 1
    assert wrapper_prefix(*traces) == (side, prefix)
    traces[side] = strip_prefix(traces[side], prefix)
    assert traces[side].leaf("second.weight").module == "second"
    assert {n.module for n in traces[side].nodes} == {n.module for n in bare.nodes}  # the root's own ops: ""
    assert dict(traces[side].param_grads).keys() == dict(bare.param_grads).keys()
    comparison = compare(traces, labels=[0, 1])
    assert comparison["first_divergent"] is None and comparison["unsynchronized_params"] == []


def test_a_changed_weight_under_a_wrapper_is_named():
    from tracer_cli.compare import strip_prefix, wrapper_prefix

    def nudge(model):
        with torch.no_grad():
            model.second.weight[0, 0] += 0.1

    wrapped, bare = traced_wrapped(["module"], nudge), traced()
    assert wrapper_prefix(bare, wrapped) == (1, "module.")
    first = compare([bare, strip_prefix(wrapped, "module.")], labels=[0, 1])["first_divergent"]
    assert (first["kind"], first["param"], first["module"], first["ranks"]) == ("forward", "second.weight", "second", [1])


def test_no_wrapper_prefix_unless_every_name_has_it():
    from tracer_cli.compare import wrapper_prefix

    assert wrapper_prefix(traced(), traced()) is None
    torch.manual_seed(0)
    other = trace(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), X, forward_stats=True)
    assert wrapper_prefix(traced(), other) is None
    # one submodule's names are not a wrapper's: "first." is a prefix of some names only
    torch.manual_seed(0)
    first_only = trace(Net().first, X, forward_stats=True)
    assert wrapper_prefix(first_only, traced()) is None


def test_parameters_that_differ_by_name_are_named_not_paired_with_other_leaves():
    """Two graphs of the same shape whose parameter names differ: the structure difference says which names each
    trace alone has, rather than pairing one trace's input with the other's bias."""
    torch.manual_seed(0)
    numbered = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    named = nn.Sequential()
    for name, layer in zip(("fc1", "act", "fc2"), numbered):
        named.add_module(name, layer)
    comparison = compare([trace(numbered, X, forward_stats=True), trace(named, X, forward_stats=True)], labels=[0, 1])
    first = comparison["first_divergent"]
    assert first["kind"] == "structure" and first["param"] == "0.bias" and first["rank"] == 0
    assert first["params_only"] == [["0.bias", "0.weight", "2.bias", "2.weight"], ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]]
    assert "input:0" not in str(first["params_only"])
    from rich.console import Console

    from tracer_cli.render.diff import render_diff

    console = Console(width=300, color_system=None)
    with console.capture() as captured:
        console.print(render_diff(trace(numbered, X), trace(named, X), comparison, ("a.json", "b.json")))
    lines = captured.get().splitlines()
    assert lines[1] == "  parameters differ: 0.bias, 0.weight, 2.bias, 2.weight only in a.json; fc1.bias, fc1.weight, fc2.bias, fc2.weight only in b.json"


def test_a_graph_that_uses_one_more_parameter_is_placed_where_the_graphs_part():
    """One graph uses a parameter the other does not (an expert no token reached): the names still line up, and the
    structure difference is where the graphs part in creation order, the branch's first node, not a list of names."""

    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.expert = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x, use_expert=False):
            h = self.body(x).tanh()
            return (self.expert(h).sigmoid() if use_expert else h).sum()

    torch.manual_seed(0)
    model = Gated()
    plain, branched = trace(model, X, forward_stats=True), trace(model, X, {"use_expert": True}, forward_stats=True)
    first = compare([plain, branched], labels=[0, 1])["first_divergent"]
    assert first["kind"] == "structure" and "params_only" not in first
    assert first["module"] in ("", "expert") and first["rank"] == 1, first


def _nudged(model):
    with torch.no_grad():
        model.second.weight[0, 0] += 0.1


def test_forward_values_missing_on_one_side_are_not_a_difference():
    """A trace() without forward_stats against a --json file: the gradients still place the change, where they
    place it when neither trace has forward values (before, every node was skipped: no first difference)."""
    from rich.console import Console

    from tracer_cli.render.diff import render_diff

    def without_forward(model_changes=None):
        torch.manual_seed(0)
        model = Net()
        if model_changes:
            model_changes(model)
        return trace(model, X)

    neither = compare([without_forward(), without_forward(_nudged)], labels=[0, 1])
    assert neither["first_divergent"] is not None
    for a, b in ((traced(), without_forward(_nudged)), (without_forward(), traced(_nudged))):
        comparison = compare([a, b], labels=[0, 1])
        first = comparison["first_divergent"]
        assert first is not None and (first["id"], first["kind"]) == (neither["first_divergent"]["id"], neither["first_divergent"]["kind"])
        assert "only where" in comparison["note"]
        console = Console(width=300, color_system=None)
        with console.capture() as captured:
            console.print(render_diff(a, b, comparison, ("a.json", "b.json")))
        assert captured.get().startswith("first difference: backward at "), captured.get()
    assert compare([traced(), without_forward()], labels=[0, 1])["first_divergent"] is None
