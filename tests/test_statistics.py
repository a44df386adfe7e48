"""How statistics are taken: small gradients in batches, large ones at once, each compared with an
independent hooked backward that takes every norm in its hook (``reference.reference_backward``)."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tracer_cli import trace, tracing

from .reference import compare_with_hooks


@pytest.fixture(
    params=["cpu", "as-device", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
)
def device(request, monkeypatch):
    """Where a test's tensors lie: the CPU (a norm read at once, its range checked there), the CPU taken for a
    device (every norm queued and read back at the end, its range never read: the path a GPU's tensors take,
    run where CI runs), or a GPU."""
    if request.param == "as-device":
        monkeypatch.setattr(tracing._Stats, "_reads_at_once", lambda self, tensor: False)
        return torch.device("cpu")
    return torch.device(request.param)


def _mixed(x, y, z):
    """Small gradients of many shapes and dtypes, some of them expanded or transposed views."""
    a = (x * 2).sin()  # float32 (8,)
    b = (y.double() * 3).sum()  # float64
    c = z.to(torch.bfloat16).tanh().float()  # bfloat16 in the middle
    d = x.sum().expand(5, 8)  # SumBackward sends on an expanded (non-contiguous) gradient
    e = x.view(2, 4).t()  # a transposed gradient
    f = x[:3] * torch.arange(3.0, device=x.device)  # a slice
    return a.sum() + b + c.sum() + (d * 0.5).sum() + (e * e).sum() + f.sum() + (y[0] * z[:2]).prod()


def _inputs():
    torch.manual_seed(0)
    return torch.randn(8), torch.randn(5), torch.randn(6)


def _reference_loss(model, args):
    return model(*(a.detach().requires_grad_() for a in args))


def test_batched_norms_match_norms_taken_in_the_hook(device):
    args = tuple(a.to(device) for a in _inputs())
    result = trace(_mixed, args)
    compare_with_hooks(result, _reference_loss(_mixed, args))
    dtypes = {s.dtype for n in result.nodes for _, _, s in n.stats()}
    assert {"float32", "float64", "bfloat16"} <= dtypes


def _layouts():
    i = torch.tensor([[0, 1, 2], [1, 0, 2]])
    coo = torch.sparse_coo_tensor(i, torch.tensor([1.0, -2.0, 3.0]), (3, 3))
    cases = {"sparse_coo": [coo, coo * 2.0], "sparse_csr": [coo.to_sparse_csr(), (coo * 3.0).to_sparse_csr()]}
    if hasattr(torch, "jagged"):
        parts = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, -4.0, 5.0])]
        jagged = torch.nested.nested_tensor(parts, layout=torch.jagged)
        cases["jagged"] = [jagged, torch.nested.nested_tensor([p * 2.0 for p in parts], layout=torch.jagged)]
    return cases


@pytest.mark.filterwarnings("ignore:Sparse:UserWarning")  # torch's notes on sparse invariants and CSR's beta state
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"] + (["jagged"] if hasattr(torch, "jagged") else []))
def test_a_batch_of_tensors_of_another_layout_is_normed_one_by_one(layout):
    """Small gradients of one shape and dtype but not strided (a sparse embedding's, a jagged tensor's) are not
    stacked as one: each gets its own norm (of its stored values) and its layout."""
    tensors = _layouts()[layout]
    expected = [float(t.to_dense().norm()) if t.is_sparse or t.layout == torch.sparse_csr else float(t.values().norm()) for t in tensors]
    stats = tracing._Stats()
    slots = stats.batch(tensors)
    records = stats.records(stats.read())
    got = [records[slots[id(t)]] for t in tensors]
    assert [r.norm for r in got] == pytest.approx(expected, rel=1e-6)
    assert [r.layout for r in got] == [layout] * len(tensors)


def test_flushing_midway_changes_nothing(monkeypatch):
    """With room for only two pending hook calls, norms are taken in many batches during backward;
    with a tiny size limit, most are taken at once."""
    args = _inputs()
    monkeypatch.setattr(tracing, "PENDING_CALLS", 2)
    compare_with_hooks(trace(_mixed, args), _reference_loss(_mixed, args))
    monkeypatch.setattr(tracing, "SMALL_NUMEL", 4)
    compare_with_hooks(trace(_mixed, args), _reference_loss(_mixed, args))


class _HalvesGradInPlace(torch.autograd.Function):
    """A backward that changes the gradient it receives in place (bad style, but it happens)."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        grad.mul_(0.5)
        return grad


def _in_place(x):
    return (_HalvesGradInPlace.apply(x.sin()) * 3.0).sum()


def test_a_gradient_changed_in_place_later_keeps_the_value_its_node_sent():
    """The node before the custom Function sent the unchanged gradient; a deferred norm taken after
    the custom backward ran would see the halved one (the pending norms are taken before it runs). The custom
    node received it unchanged too (its norm is taken before its backward runs)."""
    args = (torch.randn(8),)
    result = trace(_in_place, args)
    compare_with_hooks(result, _reference_loss(_in_place, args))
    mul = result.find("MulBackward0")[0]
    assert mul.grad_inputs[0].norm == pytest.approx(3.0 * math.sqrt(8), rel=1e-6)
    (halves,) = result.find("_HalvesGradInPlaceBackward")
    assert halves.grad_outputs[0].norm == pytest.approx(3.0 * math.sqrt(8), rel=1e-6)


def test_large_gradients_norms_are_accurate(device):
    """Large float32 gradients are normed with a dot product (on a device, in float64): within float32 rounding
    of a float64 norm."""
    torch.manual_seed(0)
    x = (torch.randn(1 << 20) * 3 + 1).to(device)
    result = trace(lambda x: (x * x).sum(), (x,))
    expected = float((2 * x.double()).norm())
    assert result.leaf("input:0").grad_outputs[0].norm == pytest.approx(expected, rel=1e-5, abs=0)


def test_very_large_gradients_norms_are_accurate_where_one_float32_sum_is_not():
    """Past a few million elements a single float32 dot product loses digits (an embedding's gradient, a few
    large rows among many small ones: 1e-4 relative on 8M elements); the sums by chunks stay near float64's."""
    torch.manual_seed(0)
    x = torch.randn(1 << 23) * 1e-3
    x[: 1 << 16] *= 100
    expected = float((3 * x.double()).norm())
    one_sum = math.sqrt(float(torch.dot(3 * x, 3 * x)))
    assert abs(one_sum - expected) / expected > 2e-5  # what a single float32 sum gives here
    result = trace(lambda w: (w * 1.0).square().sum() / 2, (x * 3,), input_grad=True, forward_stats=True)
    assert result.leaf("input:0").grad_outputs[0].norm == pytest.approx(expected, rel=1e-5, abs=0)  # the gradient: w
    (mul,) = result.find("MulBackward0")
    assert mul.forward.norm == pytest.approx(expected, rel=1e-5, abs=0)  # a forward value: w * 1.0


def _heads(x):
    """Large gradients laid out as permutations of contiguous blocks (attention heads moved, as in a
    transformer), next to large ones that fill no block: expanded, and column slices with gaps."""
    h = x.view(4, 64, 4, 32).permute(0, 2, 1, 3)  # PermuteBackward0 sends on a permuted view
    scores = (h * 1.5).sin().transpose(-2, -1)  # a transposed 4-d gradient
    wide = x.sum(-1, keepdim=True).expand(256, 128)  # SumBackward0 sends on an expanded gradient
    halves = torch.cat([x * 2.0, x.cos()], dim=1)  # CatBackward0 sends on column slices, each with gaps
    return (scores * scores).sum() + (wide * 0.25).sum() + halves.square().sum()


def test_large_permuted_and_strided_gradients_match_norms_taken_in_the_hook(device):
    """Gradients that fill one block of memory in another order are normed as that block, flat, and share
    the norm of the contiguous gradient they are a view of; those that fill none (expanded, with gaps) are
    normed as they are. Every one is compared with an independent norm taken in a hook."""
    torch.manual_seed(0)
    args = (torch.randn(256, 128, device=device),)
    assert args[0].numel() > tracing.SMALL_NUMEL  # normed at once, one by one
    result = trace(_heads, args)
    compare_with_hooks(result, _reference_loss(_heads, args))
    assert result.find("PermuteBackward0") and result.find("TransposeBackward0") and result.find("CatBackward0")


@pytest.mark.parametrize("function, shape", [(_mixed, None), (_heads, (256, 128))], ids=["small", "large"])
def test_a_device_without_float64_gets_float32_norms(monkeypatch, function, shape):
    """Apple's MPS has no float64: a norm on such a device is taken in float32 (its range unchecked there), not
    left unknown. Simulated on the CPU taken for a device that has no float64."""
    monkeypatch.setattr(tracing._Stats, "_reads_at_once", lambda self, tensor: False)
    monkeypatch.setattr(tracing._Stats, "_exact_dtype", lambda self, device: torch.float32)
    torch.manual_seed(0)
    args = _inputs() if shape is None else (torch.randn(shape),)
    result = trace(function, args)
    compare_with_hooks(result, _reference_loss(function, args))
    assert all(s.norm is not None for n in result.nodes for _, _, s in n.stats())


def test_a_device_that_refuses_float64_is_known_by_trying_it(monkeypatch):
    """A device's norms are taken in float64 where it makes a float64 tensor, in float32 where it refuses to (as
    MPS does, with a TypeError)."""
    empty = torch.empty

    def refuse(*args, dtype=None, **kwargs):
        if dtype is torch.float64:
            raise TypeError("Cannot convert a MPS Tensor to float64 dtype as the MPS framework doesn't support float64")
        return empty(*args, dtype=dtype, **kwargs)

    assert tracing._Stats()._exact_dtype(torch.device("cpu")) is torch.float64
    monkeypatch.setattr(torch, "empty", refuse)
    assert tracing._Stats()._exact_dtype(torch.device("cpu")) is torch.float32


def test_small_parameter_gradients_are_normed_in_batches(monkeypatch, device):
    """A deep stack of small layers, whose gradients vanish on the way down (about 1e-20 at the first layers):
    each parameter's gradient, as it arrives and as ``.grad`` after backward, waits for a batched norm
    rather than taking one of its own (a dispatch per tensor, and a second norm in float64 for each tiny
    one: 25,000 such layers traced at 5 to 7 times a plain step). The norms are those of a hooked plain
    backward's gradients and of its ``.grad``, in float64."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(100)]).to(device)
    x = torch.randn(2, 4, device=device)
    one_by_one = []
    norm = tracing._Stats._norm
    monkeypatch.setattr(tracing._Stats, "_norm", lambda self, tensor: one_by_one.append(tensor.shape) or norm(self, tensor))
    result = trace(model, (x,))
    assert len(one_by_one) < 10, one_by_one  # (a group of one in a batch is normed alone)
    compare_with_hooks(result, model(x).sum())
    expected = {name: float(p.grad.double().norm()) for name, p in model.named_parameters()}
    assert min(expected.values()) < 1e-15  # tiny: their float32 squares underflow
    assert dict((name, stat.norm) for name, stat in result.param_grads) == pytest.approx(expected, rel=1e-5, abs=0)
    assert {name: result.leaf(name).grad_norm for name in expected} == pytest.approx(expected, rel=1e-5, abs=0)


class _Vanishing(torch.nn.Module):
    """A parameter whose gradient elements are about 1e-24: their float32 squares underflow to 0."""

    def __init__(self, size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(size, dtype=dtype))
        self.zero = torch.nn.Parameter(torch.randn(size, dtype=dtype))

    def forward(self, x):
        return (x * self.weight).sum() * 1e-24 + (x * self.zero * 0).sum()


# batched: a stack small enough to be normed in float64; a larger stack (float32 norms, their range checked); at once
# on the CPU (on a device, these wait too: one multi-tensor norm per dtype); at once on a device too, too large to
# wait, by the kernel that squares in float64 without a float64 copy (as those of 4M elements are)
SIZES = [8, 1 << 14, 1 << 16, "wide"]
SIZE_IDS = ["batched", "batched-large", "at-once", "at-once-wide"]


def _size(size, monkeypatch):
    """``(size, calls)``: the size of a test's gradients; for "wide", 64k elements taken for more than may wait
    (PENDING_NUMEL) and as many as WIDE_ON_DEVICE_NUMEL (where a device's norm is taken at once by
    torch._foreach_norm) and a list of that function's calls, else None."""
    if size != "wide":
        return size, None
    calls = []
    monkeypatch.setattr(tracing, "PENDING_NUMEL", 1 << 15)
    monkeypatch.setattr(tracing, "WIDE_ON_DEVICE_NUMEL", 1 << 16)
    foreach_norm = torch._foreach_norm

    def counted(*args, **kwargs):
        norms = foreach_norm(*args, **kwargs)
        calls.append(1)  # (once it has given norms)
        return norms

    monkeypatch.setattr(torch, "_foreach_norm", counted)
    return 1 << 16, calls


def _foreach_norm_takes_dtype():
    try:
        torch._foreach_norm([torch.ones(1)], 2, dtype=torch.float64)
    except TypeError:  # before torch 2.4
        return False
    return True


def _check_wide(calls, device, dtype):
    """The multi-tensor kernel normed the large gradients where it should: on a device (nothing read at once),
    for float32 and bf16 ones, where this torch's _foreach_norm takes a dtype; nowhere else."""
    if calls is not None:
        on_device = not tracing._Stats._reads_at_once(None, torch.empty(0, device=device))  # (patched for as-device)
        assert bool(calls) == (on_device and dtype != torch.float64 and _foreach_norm_takes_dtype())


@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_gradients_are_not_read_as_zero(size, dtype, device, monkeypatch):
    """Vanishing gradients keep their norms (against float64 norms of a plain backward's ``.grad``);
    a gradient that is exactly zero stays 0, and only it is reported as a dead parameter."""
    size, calls = _size(size, monkeypatch)
    torch.manual_seed(0)
    model = _Vanishing(size, dtype).to(device)
    x = torch.randn(size, dtype=dtype, device=device)
    result = trace(model, (x,), input_grad=False)
    model(x).backward()
    expected = {name: float(p.grad.double().norm()) for name, p in model.named_parameters()}
    assert 1e-25 < expected["weight"] < 1e-20 and expected["zero"] == 0.0
    assert dict((name, stat.norm) for name, stat in result.param_grads) == pytest.approx(expected, rel=1e-5, abs=0)
    assert result.leaf("weight").grad_norm == pytest.approx(expected["weight"], rel=1e-5, abs=0)
    assert result.leaf("zero").grad_norm == 0.0
    from tracer_cli.checks import trace_findings

    zero = [f.param for f in trace_findings(result) if f.kind == "zero"]
    assert zero == ["zero"]
    _check_wide(calls, device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale, rescaled", [(1e-24, True), (1e-33, False)], ids=["rescaled", "float64"])
def test_a_large_gradient_whose_squares_underflow_is_normed_again_exactly(monkeypatch, dtype, scale, rescaled):
    """A gradient normed at once whose squares underflow: its elements divided by the least norm are dotted
    again (float32 elements of 1e-24), or, where their squares underflow too (1e-33 in float32), it is normed
    in float64. Against float64 norms of a plain backward's ``.grad``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1 << 16, 1, bias=False).to(dtype)
    x = torch.randn(1, 1 << 16, dtype=dtype)
    assert model.weight.numel() > tracing.SMALL_NUMEL
    in_float64 = []
    scaled_norm = tracing._Stats._scaled_norm
    monkeypatch.setattr(tracing._Stats, "_scaled_norm", lambda self, *args: in_float64.append(1) or scaled_norm(self, *args))
    result = trace(model, (x,), loss_fn=lambda out: out.sum() * scale, input_grad=False)
    (model(x).sum() * scale).backward()
    expected = float(model.weight.grad.double().norm())
    assert 0 < expected < 1e-20
    assert result.leaf("weight").grad_norm == pytest.approx(expected, rel=1e-6, abs=0)
    assert dict(result.param_grads)["weight"].norm == pytest.approx(expected, rel=1e-6, abs=0)
    assert bool(in_float64) == (not rescaled and dtype == torch.float32)


@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)  # (see test_tiny_gradients_are_not_read_as_zero)
@pytest.mark.parametrize(
    "dtype, scale",
    [(torch.float32, 1e20), (torch.bfloat16, 1e34), (torch.float64, 1e200), (torch.float64, 1e-170)],
    ids=["float32-huge", "bf16-huge", "float64-huge", "float64-tiny"],
)
def test_gradients_whose_squares_leave_the_dtype_keep_their_norms(size, dtype, scale, device, monkeypatch):
    """Finite gradients whose squares overflow (an infinite norm: read as a NaN/inf finding) or underflow (a
    norm of 0: read as a dead parameter) keep their norms, against float64 norms of a plain backward's
    ``.grad`` taken without squares; the joint parameter norm too."""
    size, calls = _size(size, monkeypatch)


    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(size, dtype=dtype))
            self.zero = torch.nn.Parameter(torch.randn(size, dtype=dtype))

        def forward(self, x):  # the weight's gradient: x * scale, every element finite
            return (x * scale * self.weight).sum() + (x * self.zero * 0).sum()

    torch.manual_seed(0)
    model = Scaled().to(device)
    x = torch.rand(size, dtype=dtype, device=device) + 0.5
    result = trace(model, (x,), input_grad=False)
    model(x).backward()

    def exact(tensor):  # the norm without squares that leave float64: scaled by the largest element
        values = tensor.double()
        largest = values.abs().max()
        return float(largest * (values / largest).norm()) if largest > 0 else 0.0

    expected = exact(model.weight.grad)
    assert math.isfinite(expected) and expected > 0
    assert dict(result.param_grads)["weight"].norm == pytest.approx(expected, rel=1e-3, abs=0)
    assert result.leaf("weight").grad_norm == pytest.approx(expected, rel=1e-3, abs=0)
    assert result.summary()["param_grad_norm_total"] == pytest.approx(expected, rel=1e-3, abs=0)
    from tracer_cli.checks import trace_findings

    assert sorted({f.kind for f in trace_findings(result)}) == ["zero"]  # "zero" is the zero parameter's
    _check_wide(calls, device, dtype)


def test_tiny_and_infinite_gradients_in_one_batch_keep_their_norms(device):
    x, y = torch.randn(8, device=device), torch.randn(8, device=device)
    result = trace(lambda x, y: (x * 1e-24).sum() + (y * float("inf")).sum(), (x, y))
    assert result.leaf("input:0").grad_norm == pytest.approx(1e-24 * math.sqrt(8), rel=1e-6, abs=0)
    assert result.leaf("input:1").grad_norm == math.inf and result.leaf("input:1").nonfinite_kind == "inf"


def test_tiny_forward_values_of_a_multi_output_op_keep_their_norm():
    x = torch.randn(8)

    def model(x):
        a, b = (x * 1e-24).split(4)  # one node, two outputs: their joint norm
        return (a + b).sum()

    (split,) = trace(model, (x,), forward_stats=True).find("SplitBackward0")
    assert split.forward.norm == pytest.approx(float((x.double() * 1e-24).norm()), rel=1e-5, abs=0)


def test_large_gradients_are_not_kept_until_the_end():
    """A gradient too large to wait for a batched norm is normed at once and freed when backward is done
    with it, as in a plain backward; holding it would raise the peak memory of a traced step."""
    size = 1 << 16
    assert size > tracing.SMALL_NUMEL
    alive: list[bool] = []
    refs: list[weakref.ref] = []

    def model(x):
        a = x * 2.0
        b = a * 3.0
        c = b * 4.0
        c.register_hook(lambda g: refs.append(weakref.ref(g)))  # the gradient arriving at c
        a.register_hook(lambda g: alive.append(refs[0]() is not None))  # two nodes later
        return c.sum()

    x = torch.randn(size)
    x.requires_grad_()
    model(x).backward()  # the plain run frees it
    assert alive == [False]
    alive.clear()
    refs.clear()
    result = trace(model, (torch.randn(size),))
    assert alive == [False]
    assert all(n.order is not None for n in result.nodes)


@pytest.mark.parametrize("flushes", ["one", "some", "many"])
def test_a_large_gradient_a_hook_changes_in_place_is_not_read_as_what_was_sent(device, flushes, monkeypatch):
    """A tensor hook that changes a gradient in place (PyTorch asks hooks to return a new one instead): the next
    node received the changed gradient; the node before sent the unchanged one, whose norm is read at once on
    the CPU and, on a device, where the gradient waited for a batched norm, is left unknown, never read as the
    changed one, also after earlier flushes ("some": every two calls, one of them after the sending call and the
    hook); where batches are flushed at every call ("many"), before and after the hook, both are known."""
    monkeypatch.setattr(tracing, "PENDING_NUMEL", {"one": tracing.PENDING_NUMEL, "some": 1 << 18, "many": 1 << 17}[flushes])
    torch.manual_seed(0)
    x = torch.randn(1 << 16, device=device)

    def model(x):
        h = x * 3.0
        for _ in range(4):
            h = h * 1.0
        h.register_hook(lambda grad: grad.mul_(2.0))
        for _ in range(4):
            h = h * 1.0
        return h.sin().sum()

    result = trace(model, (x,))
    muls = sorted(result.find("MulBackward0"), key=lambda node: node.created)  # x * 3.0, then the eight
    sent = muls[5].grad_inputs[0]  # by the op that used the hooked tensor (made by muls[4])
    received = muls[4].grad_outputs[0]
    expected = float((x.double() * 3.0).cos().norm())  # what was sent: cos(3x), before the hook
    assert received.norm == pytest.approx(2.0 * expected, rel=1e-5)
    at_once = tracing._Stats._reads_at_once(None, x) or not _foreach_norm_takes_dtype()  # (patched for as-device)
    if at_once or flushes == "many":  # (before torch 2.4 a device's large gradients are normed at once, as on the CPU)
        assert sent.norm == pytest.approx(expected, rel=1e-5)  # read at once, or in a flush before the hook ran
    else:
        assert sent.norm is None and sent.shape == (1 << 16,)


def test_empty_gradients_have_norm_zero(device):
    """Empty gradients of every dtype (a model may make empty tensors: Hugging Face's caches concatenate them),
    small and taken at once, have norm 0 on every path: a device's float64 norm scales by a largest element
    that an empty tensor does not have."""
    wide = torch.randn(0, 1 << 15, device=device)  # empty, but its shape is past SMALL_NUMEL: normed at once

    def model(x):
        return (x * 2.0).sum() + (x.double() * 3.0).sum() + (x.to(torch.bfloat16) * 4.0).float().sum() + (wide * x.sum()).sum()

    result = trace(model, (torch.randn(0, device=device),))
    stats = [g for node in result.nodes for g in (*(node.grad_inputs or ()), *(node.grad_outputs or ())) if g is not None]
    empty = [g for g in stats if g.numel == 0]
    assert {g.dtype for g in empty} == {"float32", "float64", "bfloat16"}
    assert all(g.norm == 0.0 for g in empty)


def test_non_finite_values_survive_batching(device):
    def model(x):
        y = x * torch.tensor([1.0, 0.0, 2.0, 3.0], device=x.device)
        return (y.log() * 2.0).sum() + (x * float("inf")).sum()

    result = trace(model, (torch.ones(4, device=device),))
    kinds = {n.name: n.nonfinite_kind for n in result.nodes}
    assert kinds["LogBackward0"] == "inf"
    assert result.nonfinite_origin() is not None


@pytest.mark.parametrize("size", [16, 40000], ids=["small", "large"])
def test_a_post_accumulate_grad_hook_is_held_back_during_the_trace(size):
    """An optimizer step in backward (a hook that changes .grad and the parameter in place): the trace does not
    take it. The leaf's grad and param_grads are what arrived (a tensor hook's view of it); the hook is still
    there afterwards and runs in the user's own backward."""
    torch.manual_seed(0)
    model = torch.nn.Linear(size, 1)
    steps = []

    def optimizer_step(param):
        steps.append(1)
        param.grad.mul_(0.001)
        with torch.no_grad():
            param.sub_(param.grad)

    model.weight.register_post_accumulate_grad_hook(optimizer_step)
    weight = model.weight.detach().clone()
    x = torch.randn(2, size)
    result = trace(model, (x,), loss_fn=lambda out: out.pow(2).sum(), input_grad=False)
    assert steps == [] and torch.equal(model.weight, weight)
    arrived = []
    model.weight.register_hook(lambda grad: arrived.append(float(grad.double().norm())))
    model(x).pow(2).sum().backward()
    assert steps == [1]
    assert result.leaf("weight").grad_norm == pytest.approx(arrived[0], rel=1e-5, abs=0)
    assert dict(result.param_grads)["weight"].norm == pytest.approx(arrived[0], rel=1e-5, abs=0)
    assert float(model.weight.grad.double().norm()) == pytest.approx(arrived[0] * 0.001, rel=1e-5)


@pytest.mark.parametrize("size", [16, 40000], ids=["small", "large"])
def test_a_hook_on_the_accumulategrad_node_is_held_back_during_the_trace(size):
    """The older form of an optimizer or gradient buffer in backward (Megatron's and DeepSpeed's ``main_grad``): a
    post hook on the parameter's AccumulateGrad node that adds ``.grad`` into a buffer and clears it. Mid-training
    (after one micro-batch), a trace must leave the buffer as it was: the hook does not run during the trace, is
    still there afterwards, and runs in the user's own backward. The leaf and param_grads are what arrived."""
    torch.manual_seed(0)
    model = torch.nn.Linear(size, 4)
    weight = model.weight
    weight.main_grad = torch.zeros_like(weight)
    accumulator = weight.view_as(weight).grad_fn.next_functions[0][0]  # kept: the hook lives on it
    calls = []

    def into_main_grad(grad_inputs, grad_outputs):
        calls.append(1)
        weight.main_grad.add_(weight.grad)
        weight.grad = None

    accumulator.register_hook(into_main_grad)
    x = torch.randn(3, size)
    model(x).sum().backward()  # one micro-batch
    assert calls == [1] and weight.grad is None
    buffer = weight.main_grad.clone()
    result = trace(model, x)
    assert calls == [1] and torch.equal(weight.main_grad, buffer) and weight.grad is None
    arrived = []
    weight.register_hook(lambda grad: arrived.append(float(grad.double().norm())))
    model(x).sum().backward()  # the next micro-batch: the hook is still there
    assert calls == [1, 1] and torch.equal(weight.main_grad, 2 * buffer)
    assert result.leaf("weight").grad_norm == pytest.approx(arrived[0], rel=1e-5)
    assert dict(result.param_grads)["weight"].norm == pytest.approx(arrived[0], rel=1e-5)
    del accumulator


def test_post_accumulate_grad_hooks_of_a_reentrant_checkpoint_s_parameters_are_held_back_too():
    """The checkpointed segment's graph is made again during backward: its parameters' hooks must not step."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    inner, outer = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    steps = []
    for param in (*inner.parameters(), *outer.parameters()):
        param.register_post_accumulate_grad_hook(lambda p: steps.append(p))
    result = trace(lambda x: outer(checkpoint(inner, x, use_reentrant=True)).sum(), torch.randn(2, 4), input_grad=True)
    assert steps == [] and "inner.weight" in dict(result.param_grads)


def _written_in_place(x, values=None):
    """Small forward values, each changed in place by a later op, in every way the forward mode must see
    coming. With ``values``, the norm of what each op made, taken at once (the independent record)."""

    def made(tensor):
        if values is not None:
            values.append(float(tensor.detach().double().norm()))
        return tensor

    a = made(x * 2.0)
    made(a.add_(1.0))  # an in-place method
    b = made(a * 3.0)
    made(torch.nn.functional.relu(b, inplace=True))  # `inplace` by name, as nn.ReLU(inplace=True) passes it
    c = made(b - 1.5)
    made(torch.nn.functional.leaky_relu(c, 0.1, True))  # and by position
    d = made(c * 1.0)
    d[0] = 7.0  # __setitem__: the node is CopySlices
    made(d)
    e = made(d * 2.0)
    e.data.mul_(3.0)  # under .data: no node, no version change, but the mode sees the write
    f = made(e + 0.0)
    made(torch.ops.aten.add_.Tensor(f, torch.ones_like(f)))  # an operator's in-place overload
    g = made(f * 1.0)
    g += 1.0  # __iadd__
    made(g)
    return g.sum()


def test_forward_values_are_read_before_an_op_changes_them_in_place():
    """Small forward values wait for a batched norm: each must still be the value its op made, not what a
    later in-place op left in the tensor (compared with norms taken at once in a plain run)."""
    x = torch.randn(8)
    expected: list[float] = []
    with torch.no_grad():
        _written_in_place(x.clone(), expected)
    result = trace(_written_in_place, (x,), forward_stats=True)
    made = sorted((n for n in result.nodes if n.created is not None and n.forward is not None), key=lambda n: n.created)
    assert len(made) == len(expected) + 1  # and the loss's sum
    for node, value in zip(made, expected):
        assert node.forward.norm == pytest.approx(value, rel=1e-6), node.label()
    assert [n.name for n in made[:3]] == ["MulBackward0", "AddBackward0", "MulBackward0"]


def test_more_forward_values_than_wait_at_once_all_get_theirs():
    """Past PENDING_CALLS waiting values the batch is normed and a new one begins; every value is its own."""
    count = tracing.PENDING_CALLS * 2 + 7
    x = torch.randn(8)
    expected = [float(((x * 1.01**k) * 1.0).double().norm()) for k in range(1, count + 1)]

    def chain(x):
        for _ in range(count):
            x = x * 1.01
        return x.sum()

    result = trace(chain, (x,), forward_stats=True)
    muls = sorted(result.find("MulBackward0"), key=lambda n: n.created)
    assert [n.forward.norm for n in muls] == pytest.approx(expected, rel=1e-5)


def test_a_forward_value_changed_where_the_mode_cannot_see_is_left_unknown():
    """A waiting value changed in place out of the forward mode's sight (as a C++ extension's op would) is
    unknown: its version tells, and it is not read as changed."""

    def changes_its_input(t):
        with torch._C.DisableTorchFunction():  # what a C++ extension's op does, out of the mode's sight
            t.mul_(5.0)
        return t

    def model(x):
        a = x * 2.0
        changes_its_input(a)
        return (a * 1.0).sum()

    x = torch.randn(8)
    result = trace(model, (x,), forward_stats=True)
    made, unseen, last = sorted(result.find("MulBackward0"), key=lambda n: n.created)  # unseen: the mul_
    assert made.forward is None and unseen.forward is None
    assert last.forward.norm == pytest.approx(float((x * 10.0).norm()), rel=1e-6)


def test_forward_values_of_views_of_a_large_output_are_its_norm_until_it_changes():
    """A large output is normed once per block of memory: its transpose and its flat view share the norm,
    unless the block was written in place since (compared with norms taken independently)."""
    x = torch.randn(200, 100)  # more elements than SMALL_NUMEL: normed at once
    assert x.numel() > tracing.SMALL_NUMEL

    def model(x):
        y = x * 2.0
        t = y.t()  # the same block
        a = t * 1.0
        y.mul_(3.0)  # changed in place
        flat = y.view(-1)  # the same block, changed
        return a.sum() + flat.sum()

    result = trace(model, (x,), forward_stats=True)
    made = sorted((n for n in result.nodes if n.created is not None and n.forward is not None), key=lambda n: n.created)
    names = [n.name for n in made]
    assert names[:5] == ["MulBackward0", "TBackward0", "MulBackward0", "MulBackward0", "ViewBackward0"], names
    norm = float(x.double().norm())
    for node, value in zip(made, [2 * norm, 2 * norm, 2 * norm, 6 * norm, 6 * norm]):
        assert node.forward.norm == pytest.approx(value, rel=1e-5), node.label()


def _exact_norm(tensor):
    """The norm of a tensor's elements as it reads them, in float64 scaled by the largest (no square leaves
    float64), with an infinity or a NaN kept: computed from a contiguous copy, apart from tracing's code."""
    values = tensor.contiguous().double().reshape(-1)
    if values.numel() == 0:
        return 0.0
    if not values.isfinite().all():
        return float(values.abs().max()) if not values.isnan().any() else math.nan
    largest = values.abs().max()
    return float(largest * (values / largest).norm()) if largest > 0 else 0.0


@st.composite
def _strided_views(draw):
    """A view of a random base through random sizes and strides (stride 0 expands; strides may overlap or
    leave gaps), some permuted and sliced: the layouts a gradient or a forward value may come in."""
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    dims = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(0, 40), min_size=dims, max_size=dims))
    strides = draw(st.lists(st.sampled_from([0, 1, 2, 3, 7, 40, 41, 1600]), min_size=dims, max_size=dims))
    scale = draw(st.sampled_from([1.0, 1e-30, 1e25, math.inf]))
    span = 1 + sum((size - 1) * stride for size, stride in zip(sizes, strides) if size)
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    base = torch.randn(span + 5, generator=generator, dtype=torch.float64)
    if scale == math.inf:
        base[::7] = -math.inf  # a mask
    else:
        base *= scale
    base = base.to(dtype)
    view = base[draw(st.integers(0, 5)) :].as_strided(sizes, strides)
    order = draw(st.permutations(range(dims)))
    return view.permute(*order)


@given(_strided_views())
@settings(max_examples=300, deadline=None)
def test_norms_of_strided_views_match_an_exact_norm(view):
    """Any layout, normed by tracing's own route for it (one block flat, rows of a long innermost run, expanded
    dimensions counted, a mask of infinities), has the exact norm of its elements within float32 rounding;
    squares that leave float32 (elements of 1e-30, 1e25) are not lost."""
    stats = tracing._Stats()
    position = stats._norm(view)
    assert position != tracing.NO_VALUE
    got = stats.read()[position]
    expected = _exact_norm(view)
    if math.isnan(expected):
        assert math.isnan(got)
    else:
        # float32 sums over up to ~10^6 elements (a norm over every dimension at once rounds most)
        assert got == pytest.approx(expected, rel=1e-4, abs=0)


@given(_strided_views(), st.data())
@settings(max_examples=200, deadline=None)
def test_views_that_share_a_norm_read_the_same_elements(view, data):
    """Two views of one memory with the same key (``_elements_key``) have the same exact norm: the key is
    shared by reshapes and permutations over the same elements, never by views that read others."""
    session = tracing._TraceSession({}, {}, None)
    other = view.permute(*data.draw(st.permutations(range(view.dim()))))
    if data.draw(st.booleans()) and other.is_contiguous():
        other = other.reshape(-1)  # a flat view of the same elements
    if data.draw(st.booleans()) and view.dim() and view.shape[-1] > 1:
        other = view[..., 1:]  # a slice: other elements, another key
    key, other_key = session._elements_key(view), session._elements_key(other)
    if key == other_key:
        assert _exact_norm(view) == pytest.approx(_exact_norm(other), rel=1e-9, abs=0, nan_ok=True)
    elif view.numel() == other.numel() and view.stride() == other.stride() and view.shape == other.shape:
        raise AssertionError("the same layout got two keys")


def _attention(x, qkv, mask):
    """A chunked projection into heads, scores masked with -inf: views of column slices (not one block
    of memory), and a large forward value whose norm is infinite."""
    q, k, v = (x @ qkv).split(64, dim=-1)  # column slices of a (4, 128, 192) output
    heads = [t.view(4, 128, 4, 16).transpose(1, 2) for t in (q, k, v)]
    scores = (heads[0] @ heads[1].transpose(-2, -1)).masked_fill(mask, -math.inf)
    return (scores.softmax(-1) @ heads[2]).transpose(1, 2).reshape(4, 128, 64).square().sum()


def test_forward_values_and_gradients_of_sliced_heads_and_masked_scores(device):
    """Views of a column slice share the slice's norm; a masked output's forward value is infinite; every
    norm against a norm taken independently (forward values from the ops run again, gradients in a hook)."""
    torch.manual_seed(0)
    x, qkv = torch.randn(4, 128, 64, device=device), torch.randn(64, 192, device=device) / 8
    mask = torch.ones(128, 128, dtype=torch.bool, device=device).triu(1)
    result = trace(_attention, (x, qkv, mask), forward_stats=True)
    compare_with_hooks(result, _reference_loss(lambda x, qkv: _attention(x, qkv, mask), (x, qkv)))
    projected = x @ qkv
    q = projected.split(64, dim=-1)[0]
    assert q.numel() > tracing.SMALL_NUMEL  # normed at once, and shared by its views
    (split,) = result.find("SplitBackward0")
    assert split.forward.norm == pytest.approx(float(projected.double().norm()), rel=1e-5)
    views = [n for n in result.find("ViewBackward0") if n.forward is not None]
    norms = sorted(float(t.double().norm()) for t in projected.split(64, dim=-1))
    assert len(views) == 3
    assert sorted(n.forward.norm for n in views) == pytest.approx(norms, rel=1e-5)
    (masked,) = result.find("MaskedFillBackward0")
    assert masked.forward.norm == math.inf


def test_a_backend_that_refuses_a_strided_route_gets_a_norm_of_all(monkeypatch):
    """Where the runs' route fails (an op a backend lacks for a strided view), the norm of every element is
    taken as it is, not left unknown."""

    def refuse(*args, **kwargs):
        raise NotImplementedError("no strided dot here")

    monkeypatch.setattr(tracing._Stats, "_norm_of_runs", refuse)
    view = torch.randn(300, 200)[:, :150]
    stats = tracing._Stats()
    position = stats._norm(view)
    assert stats.read()[position] == pytest.approx(_exact_norm(view), rel=1e-4, abs=0)
