"""Exact checks of the tracer on small graphs whose gradients are known by hand,
on the corners of autograd (None gradients, sparse, complex, bf16, in-place,
tied weights, checkpoint side branches), on the loss rule, on cleanup after a
failure, and on module attribution.

Expected values come from arithmetic or from an independent ``register_hook``
run (``reference.py``), never from the tracer itself.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tracer_cli import trace
from tracer_cli.errors import ModelError, UserCodeError

from .reference import (
    as_call_args,
    compare_with_hooks,
    grad_norm,
    graph_signature,
    load_sample,
    plain_grads,
    reference_loss,
    sample_model,
    with_input_grads,
)


def one(result, name, **criteria):
    """The single node called ``name`` (matching ``criteria``)."""
    found = result.find(name, **criteria)
    assert len(found) == 1, (name, criteria, [n.label() for n in result.nodes])
    return found[0]


def norms(stats):
    return tuple(None if s is None else s.norm for s in stats)


def shapes(stats):
    return tuple(None if s is None else s.shape for s in stats)


def approx_tuple(values, rel=1e-5):
    return tuple(None if v is None else pytest.approx(v, rel=rel, abs=1e-7) for v in values)


# The classic examples --------------------------------------------------------------


def test_classic_mul_div_by_hand():
    x, y = torch.tensor(4.0), torch.tensor(2.0)
    result = trace(lambda x, y: x * y + x / y, (x, y))
    assert result.meta.loss == pytest.approx(4 * 2 + 4 / 2)
    add = result.nodes[0]
    assert add.name == "AddBackward0" and add.order == 0
    assert norms(add.grad_outputs) == approx_tuple((1.0,))
    assert norms(add.grad_inputs) == approx_tuple((1.0, 1.0))
    div = one(result, "DivBackward0")
    assert norms(div.grad_outputs) == approx_tuple((1.0,))
    assert norms(div.grad_inputs) == approx_tuple((1 / 2, 4 / 2**2))  # |1/y|, |-x/y^2|
    mul = one(result, "MulBackward0")
    assert norms(mul.grad_outputs) == approx_tuple((1.0,))
    assert norms(mul.grad_inputs) == approx_tuple((2.0, 4.0))  # (y, x)
    for stat in (*div.grad_inputs, *div.grad_outputs, *mul.grad_inputs):
        assert stat.shape == () and stat.dtype == "float32" and stat.finite
    assert norms(result.leaf("input:0").grad_outputs) == approx_tuple((2 + 1 / 2,))  # y + 1/y
    assert norms(result.leaf("input:1").grad_outputs) == approx_tuple((4 - 4 / 4,))  # x - x/y^2
    # the caller's tensors were not made to require grad
    assert not x.requires_grad and not y.requires_grad


def test_classic_exp_sum_shapes():
    result = trace(lambda x: x.exp().sum(), (torch.zeros(15),))
    total = result.nodes[0]
    assert total.name == "SumBackward0"
    assert shapes(total.grad_inputs) == ((15,),)
    assert shapes(total.grad_outputs) == ((),)
    exp = one(result, "ExpBackward0")
    assert shapes(exp.grad_inputs) == ((15,),)
    assert shapes(exp.grad_outputs) == ((15,),)
    assert norms(exp.grad_inputs) == approx_tuple((math.sqrt(15),))
    leaf = result.leaf("input:0")
    assert leaf.name == "torch::autograd::AccumulateGrad"
    assert leaf.grad_inputs == ()
    assert leaf.grad_outputs[0].shape == (15,)
    assert leaf.grad_outputs[0].norm == pytest.approx(math.sqrt(15))
    assert [n.name for n in result.executed()] == [
        "SumBackward0", "ExpBackward0", "torch::autograd::AccumulateGrad",
    ]


def test_classic_samples_match_the_inline_versions():
    for name, expected_nodes in (("classic_mul_div", 5), ("classic_exp_sum", 3)):
        module = load_sample(name)
        args, kwargs = as_call_args(module.example_inputs())
        result = trace(sample_model(module), args, kwargs)
        assert len(result.nodes) == expected_nodes


# None gradients --------------------------------------------------------------------


class ScaleByParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
        self.register_buffer("constant", torch.tensor([0.5, 0.25, 2.0]))

    def forward(self, x):
        return (x * self.w).sum() + (self.constant * self.w).sum()


def test_none_in_grad_inputs_for_input_without_grad():
    model = ScaleByParameter()
    x = torch.tensor([2.0, 3.0, 4.0])
    result = trace(model, (x,), input_grad=False)
    muls = result.find("MulBackward0")
    assert len(muls) == 2
    for mul in muls:
        # x (no grad) or the buffer (no grad) first, the parameter second
        assert mul.grad_inputs[0] is None
        assert mul.grad_inputs[1] is not None and mul.grad_inputs[1].shape == (3,)
        assert mul.next[0] is None
    by_norm = sorted(mul.grad_inputs[1].norm for mul in muls)
    assert by_norm == pytest.approx(sorted([float(x.norm()), float(model.constant.norm())]))
    # and exactly what an independent hook sees
    loss = ScaleByParameter()(x)
    compare_with_hooks(result, loss)
    assert not any(n.param == "input:0" for n in result.nodes)


def test_input_grad_true_fills_the_none():
    model = ScaleByParameter()
    x = torch.tensor([2.0, 3.0, 4.0])
    result = trace(model, (x,), input_grad=True)
    input_mul = next(n for n in result.find("MulBackward0") if n.next[0] is not None)
    assert result.nodes[input_mul.next[0]].param == "input:0"
    assert input_mul.grad_inputs[0].norm == pytest.approx(float(model.w.detach().norm()))



def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))


def test_by_default_a_models_inputs_are_taken_as_the_caller_gave_them():
    """A model with parameters that require grad: the trace computes the step the caller's own
    backward would, no input gradient (the graph and every statistic as an independent hook sees them)."""
    model, x = _mlp(), torch.randn(5, 4)
    result = trace(model, (x,))
    assert not any(n.param == "input:0" for n in result.nodes)
    loss = model(x).sum()
    assert collections.Counter(n.name for n in result.nodes) == graph_signature(loss)
    compare_with_hooks(result, loss)
    assert {n.param for n in result.nodes if n.param} == {name for name, _ in model.named_parameters()}
    # an input the caller made require grad is a leaf, with the gradient a plain backward gives it
    x_grad = x.clone().requires_grad_()
    model(x_grad).sum().backward()
    model.zero_grad(set_to_none=True)
    leaf = trace(model, (x.clone().requires_grad_(),)).leaf("input:0")
    assert leaf.grad_outputs[0].norm == pytest.approx(float(x_grad.grad.norm()), rel=1e-6)


@pytest.mark.parametrize("case", ["function", "frozen"])
def test_by_default_inputs_require_grad_where_no_parameter_does(case):
    """Without a parameter that requires grad there would be no backward: floating inputs get one."""
    x = torch.randn(5, 4)
    if case == "function":
        model = lambda t: (t * t).sum()
        expected = float((2 * x).norm())
    else:
        model = _mlp().requires_grad_(False)
        x_grad = x.clone().requires_grad_()
        model(x_grad).sum().backward()
        expected = float(x_grad.grad.norm())
    result = trace(model, (x,))
    assert result.leaf("input:0").grad_outputs[0].norm == pytest.approx(expected, rel=1e-6)
    assert not x.requires_grad  # through an alias: the caller's tensor is as it was


def test_input_grad_false_says_how_to_get_input_gradients_when_nothing_requires_grad():
    with pytest.raises(ModelError, match="does not require grad") as raised:
        trace(lambda t: (t * t).sum(), (torch.randn(3),), input_grad=False)
    assert "input_grad=True" in raised.value.hint


def test_unused_split_chunk_gives_none_grad_output():
    def model(x):
        a, b, c = x.split(2)
        return (a * 2).sum() + c.sum()

    x = torch.arange(6.0)
    result = trace(model, (x,))
    split = one(result, "SplitBackward0")
    assert len(split.grad_outputs) == 3
    assert split.grad_outputs[1] is None
    assert norms(split.grad_outputs) == approx_tuple((math.sqrt(8), None, math.sqrt(2)))
    assert shapes(split.grad_inputs) == ((6,),)
    compare_with_hooks(result, model(x.detach().requires_grad_()))


# Gradient kinds -----------------------------------------------------------------------


def test_sparse_embedding_norm_is_of_the_coalesced_gradient():
    torch.manual_seed(0)
    model = nn.Embedding(10, 4, sparse=True)
    ids = torch.tensor([[1, 2, 1, 1], [2, 5, 1, 9]])  # repeats: uncoalesced != coalesced
    weights = torch.randn(2, 4, 4)

    def loss_fn(out):
        return (out * weights).sum()

    result = trace(model, (ids,), loss_fn=loss_fn)
    loss_fn(model(ids)).backward()
    grad = model.weight.grad
    assert grad.layout == torch.sparse_coo
    expected = float(grad.coalesce().values().norm())
    assert expected != pytest.approx(float(grad._values().norm()))
    stat = result.leaf("weight").grad_outputs[0]
    assert stat.norm == pytest.approx(expected, rel=1e-5)
    assert stat.shape == (10, 4) and stat.dtype == "float32"
    assert stat.layout == "sparse_coo"
    embedding = one(result, "EmbeddingBackward0")
    assert embedding.grad_inputs[0].norm == pytest.approx(expected, rel=1e-5)


class ComplexScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1 + 2j, -0.5 + 0.25j, 3 - 1j], dtype=torch.complex64))

    def forward(self, x):
        return (x * self.w).abs().pow(2).sum()


def test_complex_parameter_has_a_real_norm():
    model = ComplexScale()
    x = torch.tensor([1.0, 2.0, -1.0])
    result = trace(model, (x,), input_grad=True)
    grads = plain_grads(model, (x,))
    stat = result.leaf("w").grad_outputs[0]
    assert stat.dtype == "complex64"
    assert isinstance(stat.norm, float) and stat.finite
    assert stat.norm == pytest.approx(grad_norm(grads["w"]), rel=1e-5)
    assert result.leaf("input:0").grad_outputs[0].norm == pytest.approx(grad_norm(grads["input:0"]), rel=1e-5)
    compare_with_hooks(result, model(x.detach().requires_grad_()))


class AutocastMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.fc2(torch.relu(self.fc1(x)))


def test_bf16_autocast_gradients():
    torch.manual_seed(0)
    model = AutocastMLP()
    x = torch.randn(8, 16) * 100  # large values: bf16 sums of squares would lose precision
    result = trace(model, (x,), input_grad=True)
    names = collections.Counter(n.name for n in result.nodes)
    assert names["ToCopyBackward0"] >= 4  # x, fc1.weight/bias, fc2.weight/bias cast to bf16
    dtypes = {stat.dtype for node in result.nodes for _, _, stat in node.stats()}
    assert "bfloat16" in dtypes
    assert all(stat.finite for node in result.nodes for _, _, stat in node.stats())
    assert result.leaf("fc1.weight").grad_outputs[0].dtype == "float32"
    grads = plain_grads(model, (x,))
    for name, grad in grads.items():
        assert result.leaf(name).grad_outputs[0].norm == pytest.approx(grad_norm(grad), rel=1e-3), name
    # every bf16 statistic equals a float32-accumulated norm taken by an independent hook
    compare_with_hooks(result, reference_loss(model(x.detach().requires_grad_())))  # the bf16 output summed in float32


def test_inplace_op_on_a_view_shows_copyslices():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.tensor([2.0, -1.0, 0.5]))

        def forward(self, x):
            h = x * 3
            h[:, 0].mul_(self.w)  # in-place on a view of h
            return h.pow(2).sum()

    torch.manual_seed(0)
    model = InPlace()
    x = torch.randn(3, 4)
    result = trace(model, (x,), input_grad=True)
    args, _, _ = with_input_grads((x,), {})
    loss = model(*args)
    expected_names = graph_signature(loss)
    assert "torch::autograd::CopySlices" in expected_names
    assert collections.Counter(n.name for n in result.nodes) == expected_names
    assert one(result, "torch::autograd::CopySlices").module == ""
    compare_with_hooks(result, loss)
    for name, grad in plain_grads(model, (x,)).items():
        assert result.leaf(name).grad_outputs[0].norm == pytest.approx(grad_norm(grad), rel=1e-5)


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return F.cross_entropy(self.head(torch.tanh(self.embed(ids))), ids)


def test_tied_weight_has_one_accumulategrad():
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.tensor([1, 4, 4, 10, 0])
    result = trace(model, (ids,))
    leaves = [n for n in result.nodes if n.is_leaf]
    assert len(leaves) == 1
    leaf = leaves[0]
    assert leaf.param == "embed.weight"
    assert leaf.runs == 1
    # fed by both uses: the embedding lookup and the head's matmul
    feeders = {result.nodes[i].name for i, n in enumerate(result.nodes) if leaf.id in n.next}
    assert feeders == {"EmbeddingBackward0", "TBackward0"}
    expected = plain_grads(model, (ids,))["embed.weight"]
    assert leaf.grad_outputs[0].norm == pytest.approx(float(expected.norm()), rel=1e-5)


def test_int_inputs_get_no_leaf_and_are_listed():
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.tensor([1, 4, 4, 10, 0])
    result = trace(model, (ids,))
    assert not any(n.param is not None and n.param.startswith("input:") for n in result.nodes)
    assert [(i.shape, i.dtype) for i in result.meta.inputs] == [((5,), "int64")]


class InputOnlyRecompute(torch.autograd.Function):
    """A hand-rolled checkpoint that recomputes ``layer`` in backward but returns
    only the input's gradient (``autograd.grad`` w.r.t. the input alone): the
    layer's weight path is in the recomputed graph but never runs."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.save_for_backward(x)
        ctx.layer = layer
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            detached = x.detach().requires_grad_()
            (grad_x,) = torch.autograd.grad(ctx.layer(detached), [detached], grad)
        return grad_x, None


class ForgetsWeightGrads(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x):
        return self.out(InputOnlyRecompute.apply(x, self.inner))


def test_nodes_that_never_run_have_no_statistics():
    torch.manual_seed(0)
    model = ForgetsWeightGrads()
    result = trace(model, (torch.randn(2, 4),), input_grad=True)
    never_ran = [n for n in result.nodes if n.order is None]
    assert {n.param for n in never_ran if n.param} == {"inner.weight", "inner.bias"}
    assert [n.module for n in never_ran if n.name == "TBackward0"] == ["inner"]
    for node in result.nodes:
        if node.order is None:
            assert node.grad_inputs is None and node.grad_outputs is None, node.label()
            assert node.runs == 0 and not node.executed
        else:
            assert node.grad_outputs is not None and node.grad_inputs is not None, node.label()
    # the recomputed layer's matmul did run (for the input's gradient)
    inner_addmm = one(result, "AddmmBackward0", module="inner")
    assert inner_addmm.order is not None
    assert inner_addmm.created_in == one(result, "InputOnlyRecomputeBackward").id
    assert set(result.params_without_grad) == {"inner.weight", "inner.bias"}
    summary = result.summary()
    assert summary["executed"] == len(result.nodes) - len(never_ran)
    assert model.inner.weight.grad is None


def test_unused_side_branch_of_a_reentrant_checkpoint():
    """The recompute also builds a side branch the loss never used: it must not count as run."""

    class SideBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.main = nn.Linear(4, 4)
            self.side = nn.Linear(4, 4)

        def block(self, h):
            self.last_side = self.side(h).exp()  # computed, never used by the loss
            return torch.tanh(self.main(h))

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=True).sum()

    torch.manual_seed(0)
    model = SideBranch()
    result = trace(model, (torch.randn(2, 4),), input_grad=True)
    for node in result.nodes:
        assert (node.order is None) == (node.grad_outputs is None) == (node.grad_inputs is None), node.label()
    assert result.leaf("main.weight").order is not None
    assert result.leaf("main.weight").module == "main"
    assert set(result.params_without_grad) == {"side.weight", "side.bias"}
    assert all(n.order is None for n in result.nodes if n.module == "side")


# Loss rule --------------------------------------------------------------------------


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(3, 1)

    def forward(self, x):
        return self.a(x), self.b(x), x.argmax(-1)


@dataclasses.dataclass
class DataclassOut:
    logits: torch.Tensor
    aux: torch.Tensor
    count: int = 0


class WithLossAttr:
    def __init__(self, logits, loss):
        self.logits = logits
        self.loss = loss


@pytest.fixture
def x3():
    torch.manual_seed(0)
    return torch.randn(5, 3)


def test_loss_fn_is_used(x3):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    result = trace(model, (x3,), loss_fn=lambda out: out.pow(2).mean())
    assert result.nodes[0].name == "MeanBackward0"
    assert result.nodes[0].module is None
    assert result.meta.loss == pytest.approx(float(model(x3).detach().pow(2).mean()))
    assert "loss_fn" in result.meta.loss_rule


def test_tuple_output_sums_floating_tensors(x3):
    torch.manual_seed(0)
    model = Pair()
    result = trace(model, (x3,))
    with torch.no_grad():
        a, b, _ = model(x3)
    assert result.meta.loss == pytest.approx(float(a.sum() + b.sum()), rel=1e-5)
    root = result.nodes[0]
    assert root.name == "AddBackward0"
    assert [result.nodes[j].name for j in root.next] == ["SumBackward0", "SumBackward0"]
    assert {result.nodes[j].module for j in root.next} == {None}


class ReturnsDataclass(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x):
        logits = self.linear(x)
        return DataclassOut(logits=logits, aux=logits.tanh(), count=3)


class ReturnsLossAttr(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x):
        logits = self.linear(x)
        return WithLossAttr(logits, F.mse_loss(logits, torch.zeros_like(logits)))


class ReturnsLossKey(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x):
        logits = self.linear(x)
        return {"logits": logits, "loss": logits.pow(2).mean()}


def test_dataclass_output(x3):
    torch.manual_seed(0)
    model = ReturnsDataclass()
    result = trace(model, (x3,))
    with torch.no_grad():
        out = model(x3)
    assert result.meta.loss == pytest.approx(float(out.logits.sum() + out.aux.sum()), rel=1e-5)
    assert collections.Counter(n.name for n in result.nodes)["SumBackward0"] == 2
    grads = plain_grads(model, (x3,))
    assert grads["linear.weight"].norm() > 0
    assert result.leaf("linear.weight").grad_outputs[0].norm == pytest.approx(
        float(grads["linear.weight"].norm()), rel=1e-5)


def test_loss_attribute_is_used(x3):
    torch.manual_seed(0)
    model = ReturnsLossAttr()
    result = trace(model, (x3,))
    assert result.nodes[0].name == "MseLossBackward0"
    assert result.nodes[0].module == ""
    assert not result.find("SumBackward0")
    assert result.meta.loss == pytest.approx(float(model(x3).loss.detach()))
    assert "loss" in result.meta.loss_rule


def test_loss_key_is_used(x3):
    torch.manual_seed(0)
    model = ReturnsLossKey()
    result = trace(model, (x3,))
    assert result.nodes[0].name == "MeanBackward0"
    assert result.nodes[0].module == ""
    assert not result.find("SumBackward0")
    assert result.meta.loss == pytest.approx(float(model(x3)["loss"].detach()))


def test_namedtuple_output_is_reduced_by_field_name():
    """torchvision's Inception returns InceptionOutputs(logits, aux_logits) in train mode."""
    import collections

    Outputs = collections.namedtuple("Outputs", ["logits", "aux_logits"])
    x = torch.randn(3)
    result = trace(lambda x: Outputs(x * 2, x * 3), (x,))
    assert result.meta.loss_rule == "sum of .sum() over output.logits, output.aux_logits"
    assert result.meta.loss == pytest.approx(float(5 * x.sum()), rel=1e-6)


def test_complex_output_without_loss_fn_says_so():
    from tracer_cli.errors import ModelError

    weight = nn.Parameter(torch.randn(4, dtype=torch.complex64))
    with pytest.raises(ModelError) as caught:
        trace(lambda x: torch.fft.fft(x) * weight, torch.randn(4), input_grad=True)
    assert "complex" in caught.value.message and "real scalar" in caught.value.hint
    result = trace(lambda x: torch.fft.fft(x) * weight, torch.randn(4), loss_fn=lambda out: out.abs().pow(2).sum(), input_grad=True)
    assert result.leaf("input:0").grad_norm > 0


def test_a_complex_output_beside_a_real_one_is_left_out_and_said_so():
    from tracer_cli.checks import trace_findings

    weight = nn.Parameter(torch.randn(4, dtype=torch.complex64))
    result = trace(lambda x: (torch.fft.fft(x) * weight, x * 2), torch.randn(4), input_grad=True)
    assert result.meta.loss_rule.startswith("output[1].sum(); left out: complex output[0]")
    (nograd,) = [f for f in trace_findings(result) if f.kind == "nograd"]
    assert "complex output, which the loss leaves out" in nograd.detail
    result = trace(lambda x: (torch.fft.fft(x).detach(), x * 2), torch.randn(4), input_grad=True)  # nothing requires grad there
    assert result.meta.loss_rule == "output[1].sum()"


def test_one_input_tensor_passed_twice_is_one_leaf_named_where_it_comes_first():
    x = torch.randn(3, 4, requires_grad=True)
    result = trace(lambda a, b: (a * b).sum(), (x, x))
    (leaf,) = [n for n in result.nodes if n.param is not None]
    assert leaf.param == "input:0"
    assert leaf.grad_norm == pytest.approx(float((2 * x).detach().norm()), rel=1e-6)


def test_a_loss_that_is_a_parameter_as_it_is_is_said_to_be_a_leaf():
    """A forward that returns a parameter: its loss requires grad but no op made it, so no graph; not "does not
    require grad", which would be false."""
    from tracer_cli.errors import ModelError

    class ReturnsItsWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.tensor(2.0))

        def forward(self, x):
            return self.w

    with pytest.raises(ModelError) as caught:
        trace(ReturnsItsWeight(), torch.randn(3))
    assert "is a leaf tensor" in caught.value.message and "does not require grad" not in caught.value.message


@pytest.mark.parametrize("dtype, said", [(torch.int64, "an int64 tensor"), (torch.bool, "a bool tensor")])
def test_an_output_of_integers_names_its_dtype(dtype, said):
    from tracer_cli.errors import ModelError

    layer = nn.Linear(4, 3)
    with pytest.raises(ModelError) as caught:
        trace(lambda x: layer(x).argmax(-1).to(dtype), torch.randn(2, 4))
    assert f"the model returned {said}, which holds no floating-point tensor" in caught.value.message


def test_a_loss_that_is_not_a_single_value_has_a_hint_that_helps():
    from tracer_cli.errors import ModelError

    with pytest.raises(ModelError) as caught:
        trace(lambda x: {"loss": x * 2}, torch.randn(3))
    assert "shape (3,)" in caught.value.message
    assert "--loss" not in caught.value.hint and "loss_fn" in caught.value.hint


@pytest.mark.filterwarnings("ignore::UserWarning")  # nested tensors are a prototype
def test_an_output_the_rule_cannot_reduce_is_a_model_error_with_a_hint():
    from tracer_cli.errors import ModelError

    with pytest.raises(ModelError) as caught:
        trace(lambda x: torch.nested.nested_tensor([x[:2], x[2:]]), torch.randn(5, 4))
    assert "could not be reduced to a loss" in caught.value.message and "loss_fn" in caught.value.hint
    assert len(caught.value.message) < 400


def test_the_input_hint_comes_only_with_errors_that_inputs_can_cause():
    def misspelled(x):
        return x.sum() + undefined_name  # noqa: F821

    with pytest.raises(UserCodeError) as caught:
        trace(misspelled, torch.randn(2, 4))
    assert caught.value.hint is None
    with pytest.raises(UserCodeError) as caught:
        trace(nn.Linear(3, 2), torch.randn(2, 4))
    assert "input:0 float32[2,4]" in caught.value.hint


def test_zero_dim_output_is_the_loss():
    result = trace(lambda x: (x * 3).mean(), (torch.ones(4),))
    assert result.nodes[0].name == "MeanBackward0"
    assert result.meta.loss == pytest.approx(3.0)


def test_one_element_output_gets_a_sum_node():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x = torch.randn(1, 3)
    result = trace(model, (x[0],), input_grad=True)  # output shape [1]
    root = result.nodes[0]
    assert root.name == "SumBackward0"
    assert shapes(root.grad_inputs) == ((1,),)
    assert shapes(root.grad_outputs) == ((),)
    args, _, _ = with_input_grads((x[0],), {})
    assert collections.Counter(n.name for n in result.nodes) == graph_signature(model(*args).sum())


def test_mean_reduction(x3):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    result = trace(model, (x3,), loss_reduction="mean")
    assert result.nodes[0].name == "MeanBackward0"
    assert result.meta.loss == pytest.approx(float(model(x3).detach().mean()), rel=1e-5)
    grads = plain_grads(model, (x3,), reduction="mean")
    assert result.leaf("weight").grad_outputs[0].norm == pytest.approx(float(grads["weight"].norm()), rel=1e-5)


def test_keyword_inputs_are_named(x3):
    torch.manual_seed(0)
    model = nn.Bilinear(3, 3, 2)
    y = torch.randn(5, 3)
    result = trace(lambda *, left, right: model(left, right), kwargs={"left": x3, "right": y}, input_grad=True)
    assert {"input:left", "input:right"} <= {n.param for n in result.nodes}
    grads = plain_grads(lambda *, left, right: model(left, right), kwargs={"left": x3, "right": y})
    for key in ("input:left", "input:right"):
        assert result.leaf(key).grad_outputs[0].norm == pytest.approx(float(grads[key].norm()), rel=1e-5)


# Cleanup after failures -----------------------------------------------------------------


def global_hook_counts():
    from torch.nn.modules import module as module_mod

    counts = {
        name: len(getattr(module_mod, name))
        for name in dir(module_mod)
        if name.startswith("_global_") and name.endswith("hooks")
    }
    counts["function_modes"] = torch._C._len_torch_function_stack()
    counts["grad_enabled"] = torch.is_grad_enabled()
    return counts


def module_hook_counts(model):
    return [
        (len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks), len(m._backward_pre_hooks))
        for m in model.modules()
    ]


class Faulty(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 2)
        self.fail = True

    def forward(self, x):
        h = self.fc1(x)
        if self.fail:
            raise RuntimeError("boom in forward")
        return self.fc2(h)


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom in backward")


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_trace_called_inside_no_grad_or_inference_mode(mode):
    """Called from an evaluation loop, trace() still runs a training step's forward and backward (the
    inputs made there too), and the caller's mode is as it was afterwards."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(2, 4)
    model(x).sum().backward()
    expected = {name: p.grad.norm().item() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with getattr(torch, mode)():
        inputs = x.clone()  # an inference tensor under inference_mode
        result = trace(model, inputs, input_grad=True)
        assert not torch.is_grad_enabled()
        assert torch.is_inference_mode_enabled() == (mode == "inference_mode")
    for name, norm in expected.items():
        assert result.leaf(name).grad_norm == pytest.approx(norm, rel=1e-6)
    assert result.leaf("input:0").grad_norm is not None


class _SharedCounter(nn.Module):
    def __init__(self, shared: torch.Tensor, replace: bool):
        super().__init__()
        self.register_buffer("count", shared)
        self.replace = replace

    def forward(self, x):
        if self.replace:
            self.count = self.count + 1  # a new object in place of the buffer
        return x * 2


class _SparseHits(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)
        self.register_buffer("hits", torch.zeros(4).to_sparse())

    def forward(self, x):
        self.hits.add_(torch.ones(4).to_sparse())
        return self.fc(x)


def test_shared_and_sparse_buffers_are_put_back():
    shared = torch.zeros(4)
    model = nn.Sequential(_SharedCounter(shared, False), _SharedCounter(shared, True), nn.Linear(4, 1))
    trace(model, torch.randn(2, 4))
    assert model[0].count is shared and model[1].count is shared and not shared.any()
    sparse = _SparseHits()
    trace(sparse, torch.randn(2, 4))
    assert not sparse.hits.to_dense().any()


class _ReadOnlyBuffers(nn.Module):
    """Buffers that no copy can be written into, beside a BatchNorm whose running statistics a forward changes."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(1).expand(4))  # every element one memory location
        with torch.inference_mode():
            self.register_buffer("offset", torch.full((4,), 0.5))  # written to only in inference mode
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.norm(x * self.scale + self.offset)


def test_buffers_that_cannot_be_written_are_left_and_the_others_put_back():
    torch.manual_seed(0)
    model = _ReadOnlyBuffers()
    before = {name: (buffer, buffer.clone()) for name, buffer in model.named_buffers()}
    trace(model, torch.randn(8, 4))
    for name, (buffer, copy) in before.items():
        assert model.get_buffer(name) is buffer and torch.equal(buffer, copy), name
    assert int(model.norm.num_batches_tracked) == 0


def test_lazy_modules_are_traced():
    """Lazy modules have no parameter or buffer values until their first call: traced on that call, the
    gradients are those of a plain backward of an identical model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(4), nn.LazyBatchNorm1d(), nn.Tanh(), nn.LazyLinear(1))
    x = torch.randn(6, 5)
    result = trace(model, (x,), input_grad=False)
    reference = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1))
    reference.load_state_dict(model.state_dict())
    reference.train()
    reference(x).sum().backward()
    for name, param in reference.named_parameters():
        assert result.leaf(name).grad_norm == pytest.approx(param.grad.norm().item(), rel=1e-5), name
    assert all(p.grad is None for p in model.parameters())


def test_model_raising_in_forward_leaves_no_trace():
    torch.manual_seed(0)
    model = Faulty()
    model.eval()
    before = global_hook_counts()
    x = torch.randn(3, 4)
    with pytest.raises(UserCodeError) as info:
        trace(model, (x,), train=True)
    assert "boom in forward" in repr(info.value.__cause__)
    assert global_hook_counts() == before
    assert module_hook_counts(model) == [(0, 0, 0, 0)] * 3
    assert not model.training and not any(m.training for m in model.modules())
    assert all(p.grad is None for p in model.parameters())
    # a plain backward afterwards works and gives the ordinary gradients
    model.fail = False
    model(x).sum().backward()
    reference = Faulty()
    reference.load_state_dict(model.state_dict())
    reference.fail = False
    reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    # and a trace afterwards works
    model.zero_grad(set_to_none=True)
    result = trace(model, (x,))
    assert len(result.find("AddmmBackward0")) == 2


def test_model_raising_in_backward_leaves_no_trace():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    model.train()
    before = global_hook_counts()
    with pytest.raises(UserCodeError) as info:
        trace(lambda x: FailingBackward.apply(model(x)), (torch.randn(3, 4),), train=False)
    assert "boom in backward" in repr(info.value.__cause__)
    assert global_hook_counts() == before
    assert module_hook_counts(model) == [(0, 0, 0, 0)]
    assert model.training
    assert model.weight.grad is None
    # the AccumulateGrad node is shared by later graphs: it must carry no hook
    out = model(torch.randn(3, 4)).sum()
    out.backward()
    assert model.weight.grad is not None


def test_loss_fn_raising_leaves_no_trace():
    model = nn.Linear(4, 2)
    before = global_hook_counts()

    def bad_loss(out):
        raise ValueError("bad loss")

    with pytest.raises(UserCodeError) as info:
        trace(model, (torch.randn(3, 4),), loss_fn=bad_loss)
    assert isinstance(info.value.__cause__, ValueError)
    assert global_hook_counts() == before
    assert module_hook_counts(model) == [(0, 0, 0, 0)]


def test_hooks_removed_after_success_too():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    before = global_hook_counts()
    x = torch.randn(2, 4)
    trace(model, (x,))
    assert global_hook_counts() == before
    assert module_hook_counts(model) == [(0, 0, 0, 0)] * 4
    assert all(p.grad is None for p in model.parameters())


# Module attribution --------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlp_trace():
    module = load_sample("mlp")
    torch.manual_seed(0)
    model = sample_model(module)
    x = module.example_inputs()
    return model, trace(model, (x,))


def test_mlp_attribution(mlp_trace):
    model, result = mlp_trace
    names = {name for name, _ in model.named_modules()}
    loss = result.nodes[0]
    assert loss.name == "SumBackward0" and loss.module is None
    for node in result.nodes[1:]:
        if node.param == "input:0":
            continue  # the input exists before any module runs
        assert node.module in names, node.label()
    addmms = result.find("AddmmBackward0")
    assert sorted(n.module for n in addmms) == ["fc1", "fc2", "fc3"]
    for addmm in addmms:
        transposes = [result.nodes[j] for j in addmm.next if j is not None and result.nodes[j].name == "TBackward0"]
        assert len(transposes) == 1
        assert transposes[0].module == addmm.module
        weight_leaf = result.nodes[transposes[0].next[0]]
        assert weight_leaf.param == f"{addmm.module}.weight"
    assert sorted(n.module for n in result.find("ReluBackward0")) == ["act1", "act2"]
    assert result.leaf("fc1.weight").module == "fc1"
    assert result.leaf("fc1.bias").module == "fc1"
    assert result.leaf("fc3.weight").module == "fc3"


def test_sequential_attribution():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Sequential(nn.Linear(6, 3), nn.Tanh()))
    result = trace(model, (torch.randn(2, 5),))
    assert result.nodes[0].module is None
    assert {n.name: n.module for n in result.nodes if n.name in ("ReluBackward0", "TanhBackward0")} == {
        "ReluBackward0": "1", "TanhBackward0": "2.1",
    }
    assert sorted(n.module for n in result.find("AddmmBackward0")) == ["0", "2.0"]
    assert sorted(n.module for n in result.find("TBackward0")) == ["0", "2.0"]
    assert result.leaf("0.weight").module == "0"
    assert result.leaf("2.0.bias").module == "2.0"


def test_root_functional_ops_belong_to_the_root():
    class Root(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return torch.sigmoid(self.fc(x)) * 2

    torch.manual_seed(0)
    result = trace(Root(), (torch.randn(2, 3),))
    assert one(result, "SigmoidBackward0").module == ""
    assert one(result, "MulBackward0").module == ""
    assert one(result, "AddmmBackward0").module == "fc"


def test_module_called_twice_attributes_both_uses():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.out = nn.Linear(3, 1)

        def forward(self, x):
            return self.out(torch.relu(self.fc(torch.relu(self.fc(x)))))

    torch.manual_seed(0)
    model = Twice()
    x = torch.randn(2, 3)
    result = trace(model, (x,))
    assert sorted(n.module for n in result.find("AddmmBackward0")) == ["fc", "fc", "out"]
    assert sorted(n.module for n in result.find("ReluBackward0")) == ["", ""]
    leaf = result.leaf("fc.weight")
    assert leaf.runs == 1  # one backward: both uses are summed before AccumulateGrad runs
    assert leaf.grad_outputs[0].norm == pytest.approx(float(plain_grads(model, (x,))["fc.weight"].norm()), rel=1e-5)


class _Watched(nn.Module):
    """Notes, as forward runs, whether its submodules hold a call function put there for the trace."""

    def __init__(self, inner_fails: bool = False):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.fails = _Failing() if inner_fails else nn.Identity()
        self.out = nn.Linear(3, 1)
        self.held: list[bool] = []

    def forward(self, x):
        self.held = [m.__dict__.get("_compiled_call_impl") for m in (self.fc, self.out)]
        h = torch.tanh(self.fc(x))
        try:
            h = self.fails(h)
        except ValueError:
            h = h * 2  # the parent's op, after a submodule raised and the parent went on
        return self.out(h)


class _Failing(nn.Module):
    def forward(self, x):
        raise ValueError("caught by the parent")


def test_modules_called_directly_during_a_trace_are_put_back_even_when_forward_raises():
    """Each module is called through a function of the trace's (torch's _compiled_call_impl slot) while it
    runs; none is left behind, after a trace that succeeds or one whose forward raises; a module compiled in
    place keeps its own."""
    torch.manual_seed(0)
    model = _Watched(inner_fails=True)
    model.out._compiled_call_impl = None  # as torch leaves it, in the instance: kept so
    result = trace(model, (torch.randn(2, 3),))
    assert all(callable(call) for call in model.held)
    assert "_compiled_call_impl" not in model.fc.__dict__ and model.out.__dict__["_compiled_call_impl"] is None
    assert one(result, "MulBackward0").module == ""  # the submodule that raised closed its boundary
    assert one(result, "TanhBackward0").module == ""
    assert sorted(n.module for n in result.find("AddmmBackward0")) == ["fc", "out"]

    def own(*args, **kwargs):  # Module.compile()'s: called through a wrapper meanwhile, and put back as it was
        return model.out._call_impl(*args, **kwargs)

    model.out.__dict__["_compiled_call_impl"] = own
    model.fc.forward = lambda x: (_ for _ in ()).throw(RuntimeError("forward failed"))
    with pytest.raises(UserCodeError):
        trace(model, (torch.randn(2, 3),))
    assert callable(model.held[1]) and model.held[1] is not own
    assert "_compiled_call_impl" not in model.fc.__dict__ and model.out.__dict__["_compiled_call_impl"] is own
    assert all("_compiled_call_impl" not in m.__dict__ for m in (model, model.fails))


def test_a_hook_registered_during_forward_runs_and_its_module_keeps_its_nodes():
    """A module that has hooks by the time it is called goes through torch's own call, hooks and all."""
    torch.manual_seed(0)
    model = _Watched()
    seen = []

    def forward(x):
        handle = model.out.register_forward_hook(lambda module, args, output: seen.append(output.shape))
        try:
            return _Watched.forward(model, x)
        finally:
            handle.remove()

    model.forward = forward
    result = trace(model, (torch.randn(2, 3),))
    assert seen == [torch.Size([2, 1])]
    assert sorted(n.module for n in result.find("AddmmBackward0")) == ["fc", "out"]
    assert one(result, "TanhBackward0").module == ""


def test_global_module_hooks_of_the_users_run_on_every_module_call_during_a_trace():
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )

    torch.manual_seed(0)
    model = _Watched()
    calls = collections.Counter()
    handles = [
        register_module_forward_pre_hook(lambda module, args: calls.update(["pre"])),
        register_module_forward_hook(lambda module, args, output: calls.update(["post"])),
    ]
    try:
        result = trace(model, (torch.randn(2, 3),))
    finally:
        for handle in handles:
            handle.remove()
    assert calls == {"pre": 4, "post": 4}  # the model, fc, the identity, out
    assert model.held == [None, None]  # torch's call, which runs them
    assert sorted(n.module for n in result.find("AddmmBackward0")) == ["fc", "out"]


def test_a_global_hook_registered_during_forward_runs_on_the_modules_called_after_it():
    """As another thread's trace would register its own: from then on, modules go through torch's call."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    torch.manual_seed(0)
    model = _Watched()
    seen = []

    def forward(x):
        h = torch.tanh(model.fc(x))
        handle = register_module_forward_pre_hook(lambda module, args: seen.append(type(module).__name__))
        try:
            return model.out(model.fails(h))
        finally:
            handle.remove()

    model.forward = forward
    result = trace(model, (torch.randn(2, 3),))
    assert seen == ["Identity", "Linear"]
    assert sorted(n.module for n in result.find("AddmmBackward0")) == ["fc", "out"]


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.scale = 1.0

    def forward(self, x):
        return self.fc(x) * self.scale


class _Replicating(nn.Module):
    """Calls a replica of its submodule made as nn.DataParallel makes them on several GPUs (a copy of the
    module's __dict__), with an attribute of its own."""

    def __init__(self):
        super().__init__()
        self.inner = _Scaled()

    def forward(self, x):
        replica = self.inner._replicate_for_data_parallel()
        replica.scale = 3.0
        return replica(x)


def test_a_data_parallel_replica_runs_its_own_forward_during_a_trace():
    torch.manual_seed(0)
    # without GPUs, DataParallel calls its module; with one, it wants the module there and calls it too
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.DataParallel(_Replicating().to(device))
    x = torch.randn(2, 3, device=device)
    result = trace(model, (x,))
    with torch.no_grad():
        expected = float((model.module.inner.fc(x) * 3.0).sum())
    assert result.meta.loss == pytest.approx(expected, rel=1e-6)
    assert one(result, "AddmmBackward0").module == "module.inner.fc"  # the replica's submodule is the original's
    assert one(result, "MulBackward0").module == "module"  # the replica is no module of the model's


def test_a_loss_fn_that_runs_a_backward_of_its_own_leaves_grad_as_found():
    """.grad is kept from before forward: a loss_fn's own backward(retain_graph=True) does not stay in it."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)

    def loss_fn(out):
        loss = out.pow(2).sum()
        loss.backward(retain_graph=True)
        return loss

    result = trace(model, (torch.randn(3, 4),), loss_fn=loss_fn)
    assert model.weight.grad is None and model.bias.grad is None
    assert result.leaf("weight").grad_norm > 0


def test_a_packed_sequence_input_is_one_argument_and_its_data_an_input_leaf():
    """example_inputs() returning a PackedSequence (a namedtuple): one argument, not four; its data gets
    requires_grad and a name, and its gradient matches a plain backward."""
    from torch.nn.utils.rnn import pack_padded_sequence

    from tracer_cli.loading import split_inputs

    torch.manual_seed(0)
    lstm = nn.LSTM(4, 3)
    packed = pack_padded_sequence(torch.randn(5, 3, 4), torch.tensor([5, 3, 2]))
    args, kwargs = split_inputs(packed, "example_inputs()")
    assert len(args) == 1 and args[0] is packed and kwargs == {}

    def model(sequence):
        return lstm(sequence)[0].data

    result = trace(model, args, kwargs, input_grad=True)
    data = packed.data.detach().requires_grad_()
    model(packed._replace(data=data)).sum().backward()
    leaf = result.leaf("input:0.data")
    assert leaf.grad_norm == pytest.approx(float(data.grad.norm()), rel=1e-5)
    assert [info.name for info in result.meta.inputs] == ["input:0.data", "input:0.batch_sizes"]


def test_a_full_backward_hook_s_nodes_belong_to_its_module():
    """register_full_backward_hook wraps a module's inputs (before its forward) and its output (after every
    forward hook, so after gradtrace's) in BackwardHookFunctionBackward nodes: both are the module's, and the
    parent's next op is the parent's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Tanh())
    seen = []
    handle = model[1].register_full_backward_hook(lambda module, grad_in, grad_out: seen.append(len(grad_out)))
    try:
        result = trace(model, (torch.randn(2, 4),))
    finally:
        handle.remove()
    hooked = [n for n in result.nodes if n.name == "BackwardHookFunctionBackward"]
    assert len(hooked) == 2 and {n.module for n in hooked} == {"1"}, [(n.name, n.module) for n in result.nodes]
    assert next(n for n in result.nodes if n.name == "TanhBackward0").module == "2"
    assert seen == [1]  # the user's hook ran, once


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # torch's: the first module's input needs no grad
@pytest.mark.parametrize("kind", ["full", "pre"])
def test_a_global_backward_hook_s_nodes_belong_to_each_module(kind):
    """The same with a hook for every module (register_module_full_backward_hook, a gradient logger for each
    layer; or its pre-hook twin): each module's output wrapper is its own, not its parent's."""
    from torch.nn.modules import module as torch_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Tanh())
    register = torch_module.register_module_full_backward_hook if kind == "full" else torch_module.register_module_full_backward_pre_hook
    handle = register(lambda module, *grads: None)
    try:
        result = trace(model, (torch.randn(2, 4),))
    finally:
        handle.remove()
    hooked = [n for n in result.nodes if n.name == "BackwardHookFunctionBackward"]
    # every module wraps its output (the root's too), and each module but the first its input
    by_module = collections.Counter(n.module for n in hooked)
    assert by_module == {"": 1, "0": 1, "1": 2, "2": 2}, [(n.name, n.module) for n in result.nodes]
    assert next(n for n in result.nodes if n.name == "TanhBackward0").module == "2"


class _FrozenThenScaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.frozen(x) * self.scale


def test_a_hooked_module_whose_output_needs_no_gradient_does_not_take_the_next_op():
    """No output node is made there (nothing requires grad): the parent's next op stays the parent's."""
    model = _FrozenThenScaled()
    model.frozen.register_full_backward_hook(lambda *args: None)
    result = trace(model, (torch.randn(2, 4),), input_grad=False)
    assert next(n for n in result.nodes if n.name == "MulBackward0").module == ""


class _MakesALeaf(nn.Module):
    """Makes a tensor that requires grad in its forward (Hugging Face T5's position bias when training)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        bias = torch.zeros(3, requires_grad=True)
        return self.fc(x) + bias


def test_a_leaf_made_inside_a_module_belongs_to_the_module_that_used_it():
    model = nn.Sequential(nn.Linear(3, 3), _MakesALeaf())
    result = trace(model, (torch.randn(2, 3),), input_grad=False)
    unnamed = [n for n in result.nodes if n.is_leaf and n.param is None]
    assert len(unnamed) == 1 and unnamed[0].module == "1", [(n.name, n.param, n.module) for n in result.nodes]
    assert unnamed[0].grad_outputs[0].norm == pytest.approx((3 * 2.0**2) ** 0.5)  # d(sum)/d(bias) = 2 per element (2 rows)


class _Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return torch.where(h > 0, h.sqrt(), torch.zeros_like(h))  # sqrt of a negative: nan in backward


class _ExpertsInThreads(nn.Module):
    """Runs its experts in a thread pool's threads, whose sequence numbers count apart from the tracing thread's."""

    def __init__(self, pool):
        super().__init__()
        self.pool = pool
        self.experts = nn.ModuleList([_Expert(), nn.Sequential(nn.Linear(4, 4), nn.Tanh())])
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        outs = list(self.pool.map(lambda expert: expert(x), self.experts))
        return self.head(outs[0] + outs[1]).sum()


def test_nodes_made_in_other_threads_belong_to_the_module_that_made_them(tmp_path):
    """Sequence numbers count per thread: an expert run in a pool's thread numbers its nodes with that thread's
    counter, which overlaps the tracing thread's (all fresh threads here, counting from about 0). Its nodes
    belong to the expert, not to a module the tracing thread ran under the same numbers (head), and their
    creation site is never the tracing thread's line."""
    import inspect
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from tracer_cli.checks import trace_findings

    torch.manual_seed(0)
    results = []
    with ThreadPoolExecutor(2) as pool:
        model = _ExpertsInThreads(pool)
        x = torch.randn(3, 4)
        tracing = threading.Thread(target=lambda: results.append(trace(model, (x,))))  # a fresh counter too
        tracing.start()
        tracing.join()
    (result,) = results
    labels = [(n.name, n.param, n.module, n.source) for n in result.nodes]
    for addmm in result.find("AddmmBackward0"):
        (transpose,) = [result.nodes[j] for j in addmm.next if j is not None and result.nodes[j].name == "TBackward0"]
        owner = result.nodes[transpose.next[0]].param.rsplit(".", 1)[0]
        assert addmm.module == transpose.module == owner, labels
    assert one(result, "SqrtBackward0").module == "experts.0", labels
    assert one(result, "WhereBackward0").module == "experts.0", labels
    assert one(result, "TanhBackward0").module == "experts.1.1", labels
    assert one(result, "AddBackward0").module == "", labels
    assert one(result, "SumBackward0").module == "", labels
    expert_lines = inspect.getsourcelines(_Expert.forward)
    expert_lines = range(expert_lines[1], expert_lines[1] + len(expert_lines[0]))
    for node in result.nodes:
        if node.module and node.module.startswith("experts") and node.source is not None:
            assert int(node.source.rsplit(":", 1)[1]) in expert_lines, labels  # not the line that ran the pool
    origin = result.nonfinite_origin()
    assert origin.name == "SqrtBackward0" and origin.module == "experts.0"
    (nonfinite,) = [f for f in trace_findings(result) if f.kind == "nonfinite"]
    assert nonfinite.module == "experts.0"


class _KeywordExperts(nn.Module):
    """Computes in the tracing thread first (``pre``, then ``h * 2``), then runs its experts in a pool's threads
    with keyword arguments (``expert(x=h)``, as Hugging Face-style code calls modules)."""

    def __init__(self, pool):
        super().__init__()
        self.pool = pool
        self.pre = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
        self.experts = nn.ModuleList([_Expert(), nn.Sequential(nn.Linear(4, 4), nn.Tanh())])

    def forward(self, x):
        h = self.pre(x) * 2
        futures = [self.pool.submit(lambda expert=expert: expert(x=h) if isinstance(expert, _Expert) else expert(h))
                   for expert in self.experts]
        outs = [future.result() for future in futures]
        return (outs[0] + outs[1]).sum()


class _KeywordExpert(_Expert):
    def forward(self, x=None):
        y = self.fc(x)
        for _ in range(60):  # more numbers than the tracing thread took before it: the ranges overlap
            y = y * 1.0
        return torch.where(y > 0, y.sqrt(), torch.zeros_like(y))


@pytest.mark.parametrize("hooks", ["direct calls", "module hooks", "global hooks"])
def test_a_module_another_thread_calls_with_keyword_arguments_claims_its_nodes_alone(hooks):
    """The walk back from a pool thread's module output stops at its inputs, keyword arguments too: it took the
    tracing thread's nodes under the same numbers (``pre``'s layers, ``h * 2``) for the expert's, whichever way
    gradtrace sees module calls (called directly; through hooks of the model's own; through global hooks)."""
    import inspect
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from torch.nn.modules.module import register_module_forward_hook

    if hooks == "global hooks" and "with_kwargs" not in inspect.signature(register_module_forward_hook).parameters:
        pytest.skip("this torch gives global module hooks no keyword arguments (the README says so)")
    torch.manual_seed(0)
    results = []
    with ThreadPoolExecutor(2) as pool, contextlib.ExitStack() as stack:
        model = _KeywordExperts(pool)
        model.experts[0] = _KeywordExpert()
        if hooks == "module hooks":
            stack.enter_context(model.pre.register_forward_hook(lambda *args: None))
        elif hooks == "global hooks":
            stack.enter_context(register_module_forward_hook(lambda *args: None))
        x = torch.randn(3, 4)
        tracing = threading.Thread(target=lambda: results.append(trace(model, (x,))))  # a fresh counter too
        tracing.start()
        tracing.join()
    (result,) = results
    labels = [(n.name, n.param, n.module) for n in result.nodes]
    for addmm in result.find("AddmmBackward0"):
        (transpose,) = [result.nodes[j] for j in addmm.next if j is not None and result.nodes[j].name == "TBackward0"]
        owner = result.nodes[transpose.next[0]].param.rsplit(".", 1)[0]
        assert addmm.module == transpose.module == owner, labels
    assert {n.module for n in result.find("ReluBackward0")} == {"pre.1", "pre.3"}, labels
    (doubled,) = [n for n in result.find("MulBackward0") if any(j is not None and result.nodes[j].name == "ReluBackward0" for j in n.next)]
    assert doubled.module == "", labels  # h * 2, in the tracing thread
    assert {n.module for n in result.find("MulBackward0") if n is not doubled} == {"experts.0"}, labels
    assert one(result, "SqrtBackward0").module == "experts.0", labels


class _ExpertWithASideLoss(_Expert):
    def forward(self, x):
        out = super().forward(x)
        self.side = (out * out).mean()  # made in the pool's thread, out of reach of the expert's output
        return out


def test_nodes_another_thread_made_out_of_its_outputs_reach_are_in_no_module_rather_than_a_wrong_one():
    import threading
    from concurrent.futures import ThreadPoolExecutor

    torch.manual_seed(0)
    results = []
    with ThreadPoolExecutor(2) as pool:
        model = _ExpertsInThreads(pool)
        model.experts[0] = _ExpertWithASideLoss()
        x = torch.randn(3, 4)
        with_side = lambda out: out + model.experts[0].side
        tracing = threading.Thread(target=lambda: results.append(trace(model, (x,), loss_fn=with_side)))
        tracing.start()
        tracing.join()
    (result,) = results
    labels = [(n.name, n.param, n.module, n.source) for n in result.nodes]
    assert one(result, "MeanBackward0").module is None, labels
    assert one(result, "MulBackward0").module is None, labels
    assert one(result, "SqrtBackward0").module == "experts.0", labels
    assert one(result, "TanhBackward0").module == "experts.1.1", labels
    # the tracing thread's nodes are in their own modules, or, under a number the side loss took, in none
    assert one(result, "AddBackward0", module="").module == ""
    (head_t,) = [n for n in result.find("TBackward0") if result.nodes[n.next[0]].param == "head.weight"]
    assert head_t.module in ("head", None), labels


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_loss_rule_reduces_half_precision_outputs_in_float32(dtype):
    """The sum of 20,480 values around 10 is 204,800: past float16's largest value, although the model is fine."""

    class Affine(nn.Module):  # nn.Linear's elementwise form: older torch has no float16 matmul on the CPU
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(256, 8, dtype=dtype))
            self.bias = nn.Parameter(torch.full((256,), 10.0, dtype=dtype))

        def forward(self, x):
            return (x.unsqueeze(1) * self.weight).sum(-1) + self.bias

    result = trace(Affine(), torch.randn(80, 8, dtype=dtype))
    assert result.meta.loss == pytest.approx(204800.0, rel=1e-2)
    assert "float32" in result.meta.loss_rule and not result.nonfinite_nodes()
    assert result.leaf("bias").grad_norm == pytest.approx(80.0 * 16.0, rel=1e-2)  # 80 ones in each of 256 places


def test_example_inputs_may_be_any_mapping_of_keyword_arguments():
    """A tokenizer's BatchEncoding is a UserDict, not a dict: its items are the keyword arguments."""
    from collections import UserDict

    from tracer_cli.loading import split_inputs

    ids = torch.tensor([[1, 2, 3]])
    args, kwargs = split_inputs(UserDict(input_ids=ids, attention_mask=torch.ones(1, 3)), "example_inputs()")
    assert args == () and set(kwargs) == {"input_ids", "attention_mask"} and kwargs["input_ids"] is ids


def test_functional_call_with_tensors_of_ones_own_reports_their_gradients():
    """``torch.func.functional_call(base, params, x)``: the tensors in ``params`` fill the module's slots while
    it runs; their gradients are the parameters' gradients under those slots' names."""
    from torch.func import functional_call

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    params = {k: v.detach().clone().requires_grad_(True) for k, v in base.named_parameters()}
    x = torch.randn(3, 4)
    result = trace(lambda x: functional_call(base, params, (x,)), x)
    functional_call(base, params, (x.clone().requires_grad_(),)).sum().backward()
    norms = dict(result.param_grads)
    assert set(norms) == {f"base.{name}" for name in params}
    for name, tensor in params.items():
        assert norms[f"base.{name}"].norm == pytest.approx(float(tensor.grad.norm()), rel=1e-5)


def test_functional_call_with_non_leaf_stand_ins_reads_their_grad_without_a_warning():
    """Stand-ins made by an op (``v * scale``) are not leaves and have no ``.grad``; reading it must not make
    torch warn about a non-leaf's ``.grad`` from inside gradtrace."""
    import warnings

    from torch.func import functional_call

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 2)
            self.scale = nn.Parameter(torch.tensor(2.0))

        def forward(self, x):
            return functional_call(self.inner, {k: v * self.scale for k, v in self.inner.named_parameters()}, (x,))

    torch.manual_seed(0)
    model = Scaled()
    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = trace(model, x)
    assert [str(w.message) for w in caught] == []
    expected = plain_grads(model, (x,))
    del expected["input:0"]  # the input needs no gradient here: the parameters do
    norms = dict(result.param_grads)
    assert set(norms) == set(expected)
    for name, grad in expected.items():
        assert norms[name].norm == pytest.approx(float(grad.norm()), rel=1e-5)


class _GradOfLinear(nn.Module):
    """Per-sample input gradients made inside forward by torch.func transforms, in three spellings."""

    def __init__(self, how: str):
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.how = how

    def forward(self, x):
        from torch.func import functional_call, grad, jacrev, vmap

        if self.how == "grad":
            gx = vmap(grad(lambda xi: self.lin(xi).squeeze()))(x)
        elif self.how == "jacrev":
            gx = vmap(jacrev(lambda xi: self.lin(xi)))(x)
        else:
            params = dict(self.lin.named_parameters())
            gx = vmap(grad(lambda xi: functional_call(self.lin, params, (xi,)).squeeze()))(x)
        return gx.pow(2).sum()


@pytest.mark.parametrize("how", ["grad", "jacrev", "functional_call"])
def test_forward_values_under_vmap_of_grad_are_recorded_outside_the_transform_and_the_trace_is_whole(how):
    """Tensors inside a torch.func transform are wrappers (batched, grad-tracking) whose nodes belong to the
    transform's own graph, and whose norms cannot be read back outside it: they are not recorded. The traced
    graph's nodes made outside the transform have their values; the gradients are those of a plain backward."""
    torch.manual_seed(0)
    model = _GradOfLinear(how)
    x = torch.randn(5, 4)
    result = trace(model, x, forward_stats=True)
    expected = plain_grads(model, (x,))
    expected.pop("input:0", None)  # x's gradient (none: gx does not depend on it) is not asked for
    norms = dict(result.param_grads)
    assert set(norms) == set(expected) == {"lin.weight"}  # the bias moves no input gradient
    for name, grad in expected.items():
        assert norms[name].norm == pytest.approx(float(grad.norm()), rel=1e-5)
    with torch.no_grad():
        squares = model.lin.weight.expand(5, -1).pow(2)  # each sample's input gradient is the weight row
    (power,) = result.find("PowBackward0")
    assert power.forward.norm == pytest.approx(float(squares.norm()), rel=1e-5)
    (total,) = result.find("SumBackward0")
    assert total.forward.norm == pytest.approx(float(squares.sum()), rel=1e-5)
    assert result.leaf("lin.weight").forward.norm == pytest.approx(float(model.lin.weight.detach().norm()), rel=1e-6)


def test_a_nan_made_after_vmap_of_grad_is_found_by_its_forward_value():
    """The log of a negative number beside a vmap(grad(...)): the NaN's origin is the log."""
    torch.manual_seed(0)
    model = _GradOfLinear("grad")
    x = torch.randn(5, 4)

    def with_log(x):
        return model(x) + torch.log(-x.abs()).sum()

    result = trace(with_log, x, forward_stats=True, input_grad=True)  # as the CLI's run: the log has a node
    assert math.isnan(result.meta.loss)
    assert result.forward_nonfinite_origin().name == "LogBackward0"
    with torch.no_grad():
        assert torch.isnan(torch.log(-x.abs())).all() and math.isfinite(float(model(x)))


def test_forward_values_of_an_in_place_op_on_a_subclass_without_a_base_do_not_break_forward():
    """Forward values look at the view an in-place op changed (its ``_base``): a tensor subclass whose ``_base``
    raises is recorded as itself, and the user's forward runs on (it raised from gradtrace's mode)."""

    class NoBase(torch.Tensor):
        @property
        def _base(self):
            raise RuntimeError("this tensor keeps no base")

    def model(w):
        h = (w * 2).as_subclass(NoBase)
        h.add_(1)
        return h.sum()

    w = torch.randn(3, requires_grad=True)
    result = trace(model, (w,), forward_stats=True)
    plain = w.detach().clone().requires_grad_(True)
    (plain * 2 + 1).sum().backward()
    assert result.meta.loss == pytest.approx(float((w.detach() * 2 + 1).sum()))
    assert result.leaf("input:0").grad_outputs[0].norm == pytest.approx(plain.grad.norm().item())


# Modes of the user's around a trace, or in forward: they see the step, not gradtrace's own work -----------------


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops that reach the dispatcher, by name; with ``refuse``, an op that reads a value to the host raises
    (as a guard of code meant for CUDA graphs does)."""

    def __init__(self, refuse: bool = False):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.refuse = refuse

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.refuse and func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("a host read inside the step")
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class _CallLog(torch.overrides.TorchFunctionMode):
    """The torch calls of Python code (functions, methods, properties), by name."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


class _Doubled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _DoublesInForward(nn.Module):
    def forward(self, x):
        return _Doubled.apply(x)


def _guarded_step_model():
    torch.manual_seed(0)
    # large gradients and small, and a custom Function (recorded for --replay and --gradcheck)
    return nn.Sequential(nn.Linear(8, 300), nn.Tanh(), nn.Linear(300, 80), _DoublesInForward(), nn.ReLU(), nn.Linear(80, 1))


@pytest.mark.parametrize("forward_stats", [False, True])
@pytest.mark.parametrize("replay", [False, True])
def test_modes_around_a_trace_see_the_steps_ops_and_none_of_gradtraces(forward_stats, replay):
    """A dispatch mode and a function mode wrapped around trace() (a FLOP counter's way, an op log, a guard that
    refuses host reads): the trace passes the guard, and they log the same ops as around a plain step, not the
    norms, copies, reads and attribute lookups gradtrace adds."""
    model, x = _guarded_step_model(), torch.randn(4, 8)

    def loss_fn(out):
        return out.pow(2).mean()

    expected = plain_grads(model, (x,), loss_fn=loss_fn)
    with _OpLog(refuse=True) as plain_ops, _CallLog() as plain_calls:
        loss_fn(model(x)).backward()
    model.zero_grad(set_to_none=True)
    with _OpLog(refuse=True) as traced_ops, _CallLog() as traced_calls:
        result = trace(model, (x,), loss_fn=loss_fn, forward_stats=forward_stats, replay=replay)
    # where AccumulateGrad takes a gradient as .grad, it detaches it if nothing else holds it, and copies it
    # otherwise (into new_empty_strided): gradtrace holds small gradients for a batched norm
    taken = ("detach", "copy_", "new_empty_strided")
    assert collections.Counter({k: v for k, v in traced_ops.ops.items() if k not in taken}) == collections.Counter(
        {k: v for k, v in plain_ops.ops.items() if k not in taken}
    )
    # (how AccumulateGrad takes it varies with torch's version: at most one copy per parameter more)
    assert traced_ops.ops["copy_"] <= plain_ops.ops["copy_"] + len(list(model.parameters()))
    assert traced_calls.calls == plain_calls.calls
    for name, grad in expected.items():
        if name.startswith("input:"):
            continue
        assert dict(result.param_grads)[name].norm == pytest.approx(float(grad.double().norm()), rel=1e-5)
    assert torch._C._len_torch_dispatch_stack() == 0 and torch._C._len_torch_function_stack() == 0


def test_a_mode_the_models_forward_enters_does_not_see_forward_values_taken():
    """The forward of a model runs under a guard of its own that refuses host reads; its step passes it. With
    forward values (--json, torchrun), their norms, read at once on the CPU, must not run inside the guard."""

    class Guarded(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _guarded_step_model()

        def forward(self, x):
            with _OpLog(refuse=True):
                return self.body(x)

    model, x = Guarded(), torch.randn(64, 8)  # 64 x 300 activations: normed at once (read) on the CPU

    def loss_fn(out):
        return out.sum()

    expected = plain_grads(model, (x,), loss_fn=loss_fn)
    result = trace(model, (x,), loss_fn=loss_fn, forward_stats=True)
    assert all(n.forward is not None for n in result.nodes if n.name == "AddmmBackward0")
    for name, grad in expected.items():
        if name.startswith("input:"):
            continue
        assert dict(result.param_grads)[name].norm == pytest.approx(float(grad.double().norm()), rel=1e-5)


def test_a_custom_backward_under_a_mode_of_the_users_still_makes_hooked_nodes():
    """A custom Function whose backward runs ops that make nodes (create_graph) while the user's function mode is
    active: gradtrace's own mode for such nodes is entered and left around the user's, which stays."""

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4), _DoublesInForward()), torch.randn(3, 4)
    expected = plain_grads(model, (x,))
    with _CallLog() as calls:
        result = trace(model, (x,))
        assert torch._C._len_torch_function_stack() == 1
    assert calls.calls["backward"] == 1 and calls.calls["linear"] == 1
    assert result.find("_DoubledBackward") and result.find("_DoubledBackward")[0].order is not None
    assert dict(result.param_grads)["0.weight"].norm == pytest.approx(float(expected["0.weight"].double().norm()), rel=1e-5)


def _passes(h):
    return h


def test_a_trace_function_set_in_forward_stays_set():
    """A debugger started inside forward (``breakpoint()``: pdb sets its trace function) keeps tracing: the line
    tracing gradtrace uses for creation sites steps aside, neither turned off and on around a module call with no
    user code (the debugger's calls after it would be missed) nor removed at the end of forward."""
    calls = []

    def debugger(frame, event, arg):  # (no local trace function: None)
        if event == "call":
            calls.append(frame.f_code.co_name)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            sys.settrace(debugger)
            h = self.a(x)  # torch's module: no user code in it
            return self.b(_passes(h)).sum()

    try:
        result = trace(Model(), torch.randn(2, 4))
        assert sys.gettrace() is debugger
    finally:
        sys.settrace(None)
    assert "_passes" in calls
    assert result.find("AddmmBackward0")


def test_a_model_built_under_inference_mode_is_told_so():
    """Parameters made under inference_mode() cannot take part in autograd: the hint names them, not the inputs."""
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    with pytest.raises(UserCodeError) as raised:
        trace(model, torch.randn(2, 3))
    assert "Inference tensors" in str(raised.value)
    assert "0.weight, 0.bias, 1.weight and 1 more were made under torch.inference_mode()" in raised.value.hint


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
@pytest.mark.parametrize("scripted", ["whole", "part"])
def test_a_torchscript_model_s_batchnorm_statistics_are_put_back(scripted):
    """A TorchScript module (all of the model, or one block of it) in train mode: its running statistics are
    put back after the trace, as an eager module's are (its buffer mapping is TorchScript's own)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4)))
    if scripted == "whole":
        model = torch.jit.script(model)
    else:
        model[3] = torch.jit.script(model[3])
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    result = trace(model.train(), torch.randn(2, 3, 8, 8))
    assert len(result.param_grads) == 8
    after = dict(model.named_buffers())
    assert before.keys() == after.keys() and len(before) == 6
    for name, buffer in before.items():
        assert torch.equal(after[name], buffer), name


def test_a_loss_that_needs_no_grad_while_parameters_do_says_what_may_cut_them_off():
    """Trainable parameters that do not reach the loss (a reentrant checkpoint whose inputs need no grad, as a
    fine-tuned model with frozen embeddings has): the hint counts them and names the usual causes."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(3, 4).requires_grad_(False)
            self.block = nn.Linear(4, 4)

        def forward(self, x):
            return checkpoint(self.block, self.embed(x), use_reentrant=True).sum()

    with pytest.warns(UserWarning, match="requires_grad=True"), pytest.raises(ModelError) as raised:
        trace(Model(), torch.randn(2, 3), input_grad=False)
    assert "does not require grad" in str(raised.value)
    assert raised.value.hint.startswith("2 parameters require grad but none reached the loss")
    assert "use_reentrant" in raised.value.hint


def test_mistakes_in_a_loss_fn_get_hints_about_the_loss_fn():
    """A loss_fn that returns an unreduced loss is told to reduce it (not to define a loss_fn); one that runs
    backward itself is told to return the loss."""
    model, x = nn.Linear(3, 2), torch.randn(4, 3)
    with pytest.raises(ModelError) as raised:
        trace(model, x, loss_fn=lambda out: out.pow(2))
    assert raised.value.hint == "reduce it in loss_fn (e.g. with .mean())"

    def runs_backward(out):
        loss = out.sum()
        loss.backward()
        return loss

    with pytest.raises(UserCodeError) as raised:
        trace(model, x, loss_fn=runs_backward)
    assert "return the loss instead" in raised.value.hint
    assert model.weight.grad is None  # as it was


def test_asking_for_the_leaf_of_a_frozen_or_unused_parameter_says_why_there_is_none():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.frozen = nn.Linear(3, 3).requires_grad_(False)
            self.used, self.unused = nn.Linear(3, 1), nn.Linear(3, 1)

        def forward(self, x):
            return self.used(self.frozen(x))

    result = trace(Model(), torch.randn(2, 3))
    assert result.leaf("used.weight").grad_norm > 0
    with pytest.raises(KeyError, match="does not require grad"):
        result.leaf("frozen.weight")
    with pytest.raises(KeyError, match="requires grad but no op of this backward's graph used it"):
        result.leaf("unused.weight")


def test_a_trace_nested_in_another_does_not_take_its_call_functions_for_compiled_modules():
    """A loss_fn that traces the same model again (or another thread's trace of a model sharing a module): the
    outer trace's call functions in the modules' _compiled_call_impl are not module.compile()'s, so the inner
    trace neither wraps them nor records sites by the slower per-op mode; nothing is left in the modules after."""
    from tracer_cli import tracing

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    compiled_seen = []
    original = tracing._ModuleTracker.install

    def install(self):
        original(self)
        compiled_seen.append(self.compiled)

    def loss_fn(out):
        inner = trace(model, torch.randn(2, 3))
        assert [n.module for n in inner.find("TanhBackward0")] == ["1"]
        return out.sum()

    tracing._ModuleTracker.install = install
    try:
        trace(model, torch.randn(2, 3), loss_fn=loss_fn)
    finally:
        tracing._ModuleTracker.install = original
    assert compiled_seen == [False, False]
    assert all("_compiled_call_impl" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("options", [{"forward_stats": True}, {"stacks": True}], ids=["forward-values", "stacks"])
def test_a_mode_the_forward_leaves_active_stays_and_gradtraces_own_is_gone(options):
    """A forward that enters a function mode and leaves it active (as a plain step would): after the trace the
    user's mode is on the stack, as after a plain step, and gradtrace's own per-op mode is not."""
    from torch.overrides import _get_current_function_mode_stack

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 1)

        def forward(self, x):
            self.log = _CallLog()
            self.log.__enter__()
            return self.fc(x)

    model = Model()
    try:
        result = trace(model, torch.randn(2, 3), **options)
        assert [type(mode) for mode in _get_current_function_mode_stack()] == [_CallLog]
    finally:
        while torch._C._len_torch_function_stack():
            torch._C._pop_torch_function_stack()
    assert len(result.param_grads) == 2
