"""Library-level guarantees of trace(): interrupts, no retained tensors, GC state, create_graph, host reads (CUDA syncs)."""

from __future__ import annotations

import contextlib
import gc
import sys
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tracer_cli import trace
from tracer_cli.errors import ModelError

from .reference import plain_grads


class Interrupting(nn.Module):
    def __init__(self, where: str):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.where = where

    def forward(self, x):
        if self.where == "forward":
            raise KeyboardInterrupt
        return Interrupt.apply(self.fc(x)).sum()


class Interrupt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise KeyboardInterrupt


def _engine_entry():
    """What a trace replaces while forward runs, to see the nodes a backward run in forward makes in another
    thread (tracing._renumbering_inner_backwards)."""
    from torch.autograd.variable import Variable

    return Variable._execution_engine


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_interrupt_propagates_and_leaves_the_model_clean(where):
    from torch.autograd.function import _HookMixin

    torch_register = _HookMixin.__dict__["_register_hook"]
    engine_entry = _engine_entry()
    model = Interrupting(where)
    model.eval()
    modes_before = torch._C._len_torch_function_stack()
    with pytest.raises(KeyboardInterrupt):
        trace(model, torch.randn(2, 3), train=True)
    assert _HookMixin.__dict__["_register_hook"] is torch_register  # torch's hook registration is back
    assert _engine_entry() is engine_entry
    assert not model.training
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert torch._C._len_torch_function_stack() == modes_before
    assert model.fc.weight.grad is None
    assert gc.isenabled()


def test_no_tensor_or_graph_is_retained():
    activations: list[weakref.ref] = []

    class Remember(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = torch.tanh(self.fc(x))
            activations.append(weakref.ref(h))
            return h.sum()

    model = Remember()
    result = trace(model, torch.randn(8, 4))
    gc.collect()
    assert activations and activations[0]() is None
    assert len(result.nodes) > 0
    # the record is plain data: nothing in it is a tensor
    stack = [result.to_dict()]
    while stack:
        value = stack.pop()
        assert not isinstance(value, torch.Tensor)
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)


def test_a_trace_leaves_no_reference_cycles_for_the_garbage_collector():
    """What a trace made is freed when it drops it (by reference counts), not by a later collection that walks
    every object made since: the creation-site recorder and its table, and the helpers that recurse."""
    from dataclasses import dataclass

    @dataclass
    class Batch:
        x: torch.Tensor

    layer = nn.Linear(4, 4)

    def model(batch):  # a plain function (its modules found through its code), an input to walk
        h = batch.x
        for _ in range(3):
            h = torch.tanh(layer(h))
        return h.sum()

    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector would free lands in gc.garbage
    try:
        result = trace(model, Batch(torch.randn(2, 4)))
        gc.collect()
        left = [o for o in gc.garbage if "tracer_cli" in f"{getattr(o, '__module__', '')} {type(o).__module__}"]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert len(result.nodes) > 10 and not left, left


def test_gc_state_is_restored():
    model = nn.Linear(2, 2)
    gc.disable()
    try:
        trace(model, torch.randn(1, 2))
        assert not gc.isenabled()
    finally:
        gc.enable()
    trace(model, torch.randn(1, 2))
    assert gc.isenabled()


def test_no_collection_runs_inside_a_trace():
    """Collection is off while trace() runs and back on as the last thing before it returns: the first
    collection after it comes with the caller's next allocation (it walks the Trace only if the caller keeps
    it), not with trace()'s own exits, where the whole Trace is still alive."""

    def chain(x):
        for _ in range(300):
            x = x.sin()
        return x.sum()

    started: list[int] = []

    def record(phase, info):
        if phase == "start":
            started.append(info["generation"])

    threshold, was_enabled = gc.get_threshold(), gc.isenabled()
    gc.set_threshold(700, 10, 10)
    gc.enable()
    gc.callbacks.append(record)
    try:
        for _ in range(3):
            x = torch.ones(4)
            gc.collect()
            started.clear()
            result = trace(chain, x)
            assert not started, started  # (a comparison with a new list would allocate, and collect)
            assert gc.isenabled() and len(result.nodes) > 300
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*threshold)
        if not was_enabled:
            gc.disable()


def test_gradient_penalty_with_create_graph_inside_forward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def penalised(x):
        x = x.detach().requires_grad_()
        out = model(x)
        (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return out.sum() + grad_x.pow(2).sum()

    x = torch.randn(5, 3)
    result = trace(penalised, x)
    assert all(p.grad is None for p in model.parameters())
    penalised(x).backward()  # the plain run
    for name, param in model.named_parameters():
        leaf = result.leaf(f"model.{name}")  # a plain function's modules are named by variable
        assert leaf.grad_outputs[0].norm == pytest.approx(float(param.grad.norm()), rel=1e-4)
        assert leaf.module == f"model.{name}".rpartition(".")[0]


def test_loss_without_grad_is_a_model_error():
    class Frozen(nn.Module):  # its own forward runs under no_grad (the caller's no_grad is lifted: see test_edge_cases)
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x):
            with torch.no_grad():
                return self.linear(x)

    model = Frozen()
    with pytest.raises(ModelError, match="does not require grad"):
        trace(model, torch.randn(1, 2))
    assert all(not m._forward_hooks for m in model.modules())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("forward_stats", [False, True])
@pytest.mark.parametrize("wide", [False, True], ids=["", "wide"])
def test_no_host_sync_per_node_on_cuda(monkeypatch, forward_stats, dtype, wide):  # pragma: no cover - runs where a GPU is available
    """Forward, hooks and backward never synchronise; statistics are read back once, at the end.

    The first layer's gradients are large (normed one by one as they arrive), the others small
    (normed in batches); so are its outputs, with forward values (as --json and torchrun record them).
    float32 and bf16 tensors are normed in float64 there (``wide``: the large ones as those of 4M elements
    are, by torch._foreach_norm), float64 ones scaled by their largest element."""
    from tracer_cli import tracing

    if wide:
        monkeypatch.setattr(tracing, "WIDE_ON_DEVICE_NUMEL", tracing.SMALL_NUMEL + 1)
    torch.manual_seed(0)
    small = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(20)]
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64), *small).to("cuda", dtype)
    x = torch.randn(128, 256, device="cuda", dtype=dtype)
    assert x.numel() > tracing.SMALL_NUMEL >= 128 * 64
    reads = []
    original = tracing._Stats.read

    def read(self):
        torch.cuda.set_sync_debug_mode("default")  # the one transfer
        reads.append(self)
        return original(self)

    monkeypatch.setattr(tracing._Stats, "read", read)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call before the read-back raises
    try:
        result = trace(model, x, loss_fn=lambda out: out.pow(2).mean(), forward_stats=forward_stats)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(reads) == 1
    assert result.meta.device.startswith("cuda")
    assert all(n.order is not None for n in result.nodes)
    expected = plain_grads(model, (x,), loss_fn=lambda out: out.pow(2).mean())
    for name in ("0.weight", "3.0.weight", "22.0.weight"):
        assert result.leaf(name).grad_outputs[0].norm == pytest.approx(float(expected[name].double().norm()), rel=1e-4)
    if forward_stats:
        _check_forward_values(model, x, result)


def _check_forward_values(model, x, result):
    """The forward values of the first layer (a large output) and of the last block's (small ones), against
    the same layers run again."""
    with torch.no_grad():
        first = model[0](x)
        last = model[:-1](x)
        outputs = {"0": first, "22.0": model[-1][0](last), "22.1": model[-1](last)}
    for module, value in outputs.items():
        (node,) = [n for n in result.nodes if n.module == module and n.forward is not None and n.param is None]
        assert node.forward.norm == pytest.approx(float(value.double().norm()), rel=1e-4), node.label()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("forward_stats", [False, True])
def test_no_host_read_per_node_on_cpu(monkeypatch, forward_stats, dtype):
    """What would synchronise with a GPU, checked on the CPU: no value is read to the host (``item()``,
    ``bool()``, ``tolist()``, ``.cpu()``...) before the one read-back of every statistic at the end.

    The CUDA test above checks the same with the driver's own sync detection; this one runs everywhere.
    Reads are caught in two places: ops that read a tensor's value (by a dispatch mode, which also sees
    the ops run by hooks during backward), and Tensor methods that copy to the host without an op on CPU.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    from tracer_cli import tracing

    reading = []  # non-empty while _Stats.read runs
    reads = []
    early: list[str] = []  # host reads before the read-back

    class HostReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not reading and func.overloadpacket.__name__ in READING_OPS:
                early.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    def host_method(name):
        original = getattr(torch.Tensor, name)

        def method(self, *args, **kwargs):
            if not reading and (name != "to" or _names_a_device(args, kwargs)):
                early.append(name)
            return original(self, *args, **kwargs)

        return method

    for name in ("tolist", "cpu", "numpy", "to"):
        monkeypatch.setattr(torch.Tensor, name, host_method(name))
    # gradtrace's own ops are kept out of the modes of the user's: here the mode is to see them
    monkeypatch.setattr(tracing, "_modes_set_aside", lambda torch: contextlib.nullcontext())
    original_read = tracing._Stats.read

    def read(self):
        reads.append(self)
        reading.append(True)
        try:
            return original_read(self)
        finally:
            reading.pop()

    monkeypatch.setattr(tracing._Stats, "read", read)
    # on the CPU, a norm small enough to have underflowed is read at once and taken again: not on a GPU
    monkeypatch.setattr(tracing._Stats, "_reads_at_once", lambda self, tensor: False)
    torch.manual_seed(0)
    small = [nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(20)]
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 16), *small).to(dtype)
    x = torch.randn(128, 256, dtype=dtype)
    assert model[0].weight.numel() > tracing.SMALL_NUMEL >= 128 * 16  # large gradients and small ones
    with HostReads():
        result = trace(model, x, loss_fn=lambda out: out.pow(2).mean(), forward_stats=forward_stats)
    assert early == []
    assert len(reads) == 1
    assert all(n.order is not None for n in result.nodes)
    expected = plain_grads(model, (x,), loss_fn=lambda out: out.pow(2).mean())
    for name in ("0.weight", "3.0.weight", "22.0.weight"):
        assert result.leaf(name).grad_outputs[0].norm == pytest.approx(float(expected[name].double().norm()), rel=1e-4)
    if forward_stats:
        _check_forward_values(model, x, result)


# ops that read a tensor's values to the host (a sync on CUDA): item(), bool(), data-dependent shapes
READING_OPS = {"_local_scalar_dense", "is_nonzero", "nonzero", "masked_select", "equal", "allclose", "unique"}


def _names_a_device(args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.to`` call names a device (a copy to the host on CUDA), not only a dtype."""
    values = [*args, kwargs.get("device")]
    return any(isinstance(v, (str, torch.device, torch.Tensor)) for v in values)


def _sin_sum(x):
    return x.sin().sum()


def test_sources_are_relative_to_the_working_folder_of_each_trace(monkeypatch, tmp_path):
    """A site's path is shown relative to the working folder when the trace ran in it (absolute outside it,
    or when the working folder was deleted), also after a trace in another folder."""
    from pathlib import Path

    here = Path(__file__).resolve()
    expected_line = _sin_sum.__code__.co_firstlineno + 1
    for folder, shown in (
        (here.parents[1], f"tests/{here.name}"),
        (here.parents[1] / "sample_models", str(here)),
        (here.parent, here.name),
    ):
        monkeypatch.chdir(folder)
        (node,) = trace(_sin_sum, torch.ones(3)).find("SinBackward0")
        assert node.source == f"{shown}:{expected_line}", folder
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    (node,) = trace(_sin_sum, torch.ones(3)).find("SinBackward0")
    assert node.source == f"{here}:{expected_line}"


def test_torch_compile_region_is_one_node_and_stays_whole():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    compiled = torch.compile(model, backend="aot_eager")  # AOTAutograd without inductor: quick on CPU
    x = torch.randn(3, 4)
    result = trace(compiled, x)
    regions = result.find("CompiledFunctionBackward")
    assert len(regions) == 1  # no hook inside the compiled module split its graph
    assert regions[0].module == ""
    model(x.clone().requires_grad_()).sum().backward()
    for name, param in model.named_parameters():
        leaf = result.leaf(f"_orig_mod.{name}")
        assert leaf.grad_outputs[0].norm == pytest.approx(float(param.grad.norm()), rel=1e-5)
    torch._dynamo.reset()


class _CompiledBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 8)

    def forward(self, x):  # (code of the user's: dynamo compiles it on every torch; torch's own modules it may skip)
        return self.b(torch.relu(self.a(x)))


class _WithCompiledBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.act, self.head = _CompiledBlock(), nn.Tanh(), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.act(self.block(x)))


@pytest.mark.parametrize("where", ["root", "block"])
def test_a_module_compiled_in_place_is_one_region_and_stays_compiled(where):
    """``module.compile()`` (in place: no wrapper) traced before its first step: the trace shows its region, and
    no hook of gradtrace's is compiled into it, so the user's later steps run it compiled, without graph breaks
    nor more than the one recompile any compiled module makes after a first trace (the README says so); gradtrace's
    hooks inside it broke its graph, and used up its recompile limit: it ran uncompiled from then on."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = _WithCompiledBlock()
    compiled = model if where == "root" else model.block
    compiled.compile(backend="aot_eager")
    own = compiled.__dict__["_compiled_call_impl"]
    x = torch.randn(3, 4)
    result = trace(model, x)
    (region,) = result.find("CompiledFunctionBackward")
    assert region.module == ("" if where == "root" else "block")
    if where == "block":
        assert [n.module for n in result.find("TanhBackward0")] == ["act"]
    assert not counters["graph_break"]
    graphs = []
    for _ in range(3):  # the user's own steps: compiled, one region each
        loss = model(x).sum()
        assert "CompiledFunctionBackward" in {node.name() for node in _graph(loss)}
        loss.backward()
        graphs.append(counters["stats"]["unique_graphs"])
    # compiled once more at most for the user's first step (the trace's ran under gradtrace's mode; torch 2.1 guards
    # on no mode, and compiles once in all), and then no more
    assert not counters["graph_break"] and graphs[0] <= 2 and graphs == [graphs[0]] * 3
    assert compiled.__dict__["_compiled_call_impl"] is own
    torch._dynamo.reset()


def _graph(loss):
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
    return seen


def test_a_compiled_region_is_neither_replayed_nor_gradchecked():
    """Its backward frees what it saved as it runs: running it again fails, which says nothing of the model."""
    torch.manual_seed(0)
    compiled = torch.compile(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)), backend="aot_eager")
    result = trace(compiled, torch.randn(3, 4), replay=True, gradcheck=True)
    (region,) = result.find("CompiledFunctionBackward")
    assert region.replay.reproducible is None and "not replayed" in region.replay.note
    assert region.gradcheck is None
    assert all(n.replay.reproducible is not False for n in result.nodes if n.replay is not None)
    torch._dynamo.reset()


def test_with_torch_compile_disabled_a_compiled_modules_ops_belong_to_its_submodules(monkeypatch):
    """TORCH_COMPILE_DISABLE=1 (what the README says to run to see a compiled region's ops): the original
    module runs eagerly, and its ops are attributed to its own submodules, not all to the wrapper."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    compiled = torch.compile(model, backend="aot_eager")
    monkeypatch.setattr(torch._dynamo.config, "disable", True)
    result = trace(compiled, torch.randn(3, 4))
    assert not result.find("CompiledFunctionBackward")
    assert {n.module for n in result.find("AddmmBackward0")} == {"_orig_mod.0", "_orig_mod.2"}
    assert [n.module for n in result.find("ReluBackward0")] == ["_orig_mod.1"]
    torch._dynamo.reset()


def test_forward_stats_are_the_norms_of_each_op_output():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    result = trace(model, x, forward_stats=True, input_grad=True)
    with torch.no_grad():  # the independent forward
        hidden = model[0](x)
        activated = model[1](hidden)
        out = model[2](activated)
    expected = {
        ("AddmmBackward0", "0"): hidden.norm(),
        ("ReluBackward0", "1"): activated.norm(),
        ("AddmmBackward0", "2"): out.norm(),
        ("SumBackward0", None): out.sum().abs(),
    }
    for (name, module), value in expected.items():
        (node,) = result.find(name, module=module) if module is not None else result.find(name)
        assert node.forward.norm == pytest.approx(float(value), rel=1e-6)
    for name, param in model.named_parameters():
        assert result.leaf(name).forward.norm == pytest.approx(float(param.detach().norm()), rel=1e-6)
    assert result.leaf("input:0").forward.norm == pytest.approx(float(x.norm()), rel=1e-6)
    # nodes made inside an op (F.linear's TBackward0) have no forward value of their own
    assert all(n.forward is None for n in result.find("TBackward0"))
    # off by default
    assert all(n.forward is None for n in trace(model, x, input_grad=True).nodes)


def test_param_grads_are_the_grads_after_backward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    result = trace(model, x)
    model(x).sum().backward()
    recorded = dict(result.param_grads)
    assert set(recorded) == {name for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        assert recorded[name].norm == pytest.approx(float(param.grad.norm()), rel=1e-6)


def test_param_grads_changed_after_accumulation_are_read_again():
    """Where .grad can differ from what AccumulateGrad received (a parameter accumulated twice through a
    reentrant checkpoint), it is read again, not reused. A post-accumulate-grad hook is held back: .grad is
    what arrived."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    scaled, shared = nn.Linear(16, 16), nn.Linear(16, 16)

    def times_ten(param):
        param.grad.mul_(10.0)

    scaled.weight.register_post_accumulate_grad_hook(times_ten)

    def model(x):
        h = scaled(x)
        h = checkpoint(lambda t: shared(t).tanh(), h, use_reentrant=True)
        return shared(h).sum()  # `shared` again, outside the checkpoint

    x = torch.randn(4, 16)
    result = trace(model, x)
    assert len(result.leaf("shared.weight").calls) == 2
    for p in (*scaled.parameters(), *shared.parameters()):
        p.grad = None
    model(x.clone().requires_grad_()).backward()
    recorded = dict(result.param_grads)
    for name, param in (("shared.weight", shared.weight), ("shared.bias", shared.bias)):
        assert recorded[name].norm == pytest.approx(float(param.grad.norm()), rel=1e-6), name
    received = result.leaf("scaled.weight").grad_outputs[0].norm
    assert recorded["scaled.weight"].norm == pytest.approx(received, rel=1e-6)
    assert float(scaled.weight.grad.norm()) == pytest.approx(10.0 * received, rel=1e-6)  # the user's backward ran it


@pytest.mark.parametrize("width", [4, 160], ids=["small", "large"])
def test_each_call_of_a_leaf_records_what_arrived_then(width):
    """A parameter whose AccumulateGrad runs twice (inside a reentrant checkpoint and outside): each call
    records the gradient that arrived then, not .grad summed in place by the second call, whether its norm
    waits for a batch (a small gradient, held meanwhile) or is taken at once (a large one). Against a tensor
    hook of a plain backward, which sees each arriving gradient."""
    from torch.utils.checkpoint import checkpoint

    from tracer_cli import tracing

    torch.manual_seed(0)
    first, shared = nn.Linear(width, width), nn.Linear(width, width)
    assert (shared.weight.numel() > tracing.SMALL_NUMEL) == (width == 160)

    def model(x):
        h = checkpoint(lambda t: shared(t).tanh(), first(x), use_reentrant=True)
        return shared(h).pow(2).sum()

    x = torch.randn(3, width)
    result = trace(model, x, input_grad=False)
    arrived = []
    handle = shared.weight.register_hook(lambda grad: arrived.append(float(grad.double().norm())))
    model(x).backward()
    handle.remove()
    calls = result.leaf("shared.weight").calls
    assert len(calls) == 2 == len(arrived) and arrived[0] != pytest.approx(arrived[1], rel=1e-3)
    assert [call.grad_outputs[0].norm for call in calls] == pytest.approx(arrived, rel=1e-5)
    assert dict(result.param_grads)["shared.weight"].norm == pytest.approx(float(shared.weight.grad.double().norm()), rel=1e-5)


def test_sources_are_the_user_lines_that_created_each_node():
    from .reference import SAMPLES_DIR, load_sample

    module = load_sample("nan_where")
    torch.manual_seed(0)
    result = trace(module.build_model(), module.example_inputs())
    lines = (SAMPLES_DIR / "nan_where.py").read_text().splitlines()

    def line_of(fragment: str) -> int:
        return max(i + 1 for i, text in enumerate(lines) if fragment in text)  # the code, not the docstring

    def source(name, module_path=None):
        (node,) = result.find(name, module=module_path) if module_path is not None else result.find(name)
        path, _, line = node.source.rpartition(":")
        assert path.endswith("nan_where.py")
        return int(line)

    assert source("SqrtBackward0") == line_of("torch.sqrt(h)")
    assert source("WhereBackward0") == line_of("torch.where(")
    assert source("AddmmBackward0", "proj") == line_of("self.proj(x)")
    # nodes made inside F.linear share the line of the module call
    (t_proj,) = [n for n in result.find("TBackward0") if n.module == "proj"]
    assert t_proj.source == result.find("AddmmBackward0", module="proj")[0].source
    assert all(n.source is None for n in result.nodes if n.is_leaf)
    assert all(n.source is None for n in trace(module.build_model(), module.example_inputs(), sources=False).nodes)


def test_a_100k_node_chain_is_traced_completely_and_freed_safely():
    """Every node of a long chain is traced; releasing the graph must not recurse node by node (it crashed)."""

    def chain(x):
        for _ in range(100_000 - 2):
            x = x * 1.000001
        return x.sum()

    result = trace(chain, torch.ones(4), sources=False)
    assert len(result.nodes) == 100_000
    assert all(n.order is not None for n in result.nodes)
    assert sorted(n.order for n in result.nodes) == list(range(100_000))
    x = torch.ones(4, requires_grad=True)
    chain(x).backward()  # the plain run
    assert result.leaf("input:0").grad_outputs[0].norm == pytest.approx(float(x.grad.norm()), rel=1e-6)


class _Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x * 2.0  # no node: forward runs without grad
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad * 2.0


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x).relu() * 0.5 + _helper(x)
        return _Scaled.apply(h) * 3.0 + h.sin()


def _helper(x):
    y = x.tanh()
    return (y *
            2.0).exp()  # an op on a continuation line


def _many_lines(model, x):
    out = x
    for _ in range(3):
        out = model(out)
        out = out * 1.5
    values = [t.cos() for t in out.unbind(0)]  # a comprehension frame
    return torch.stack(values).sum() + _helper(out).mean()


def test_sources_from_line_events_match_those_from_a_mode():
    """Two independent ways of recording creation sites agree on every node: line events (the default)
    and a TorchFunctionMode per op (used while another trace function is set, e.g. a debugger's)."""
    import sys

    torch.manual_seed(0)
    model = _Block()
    x = torch.randn(2, 4)
    by_lines = trace(lambda x: _many_lines(model, x), x)
    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: None)  # traces nothing, but is there
    try:
        by_mode = trace(lambda x: _many_lines(model, x), x)
    finally:
        sys.settrace(previous)
    assert [n.name for n in by_lines.nodes] == [n.name for n in by_mode.nodes]
    assert [n.source for n in by_lines.nodes] == [n.source for n in by_mode.nodes]
    sources = {n.source for n in by_lines.nodes if n.source}
    assert len(sources) >= 8 and all("test_tracing.py:" in s for s in sources)
    (exp,) = {n.source for n in by_lines.nodes if n.name == "ExpBackward0"}
    assert exp.endswith(f":{_helper.__code__.co_firstlineno + 3}")  # where .exp() is, not where the statement starts


def test_line_events_leave_no_trace_function_behind():
    import sys

    from tracer_cli.errors import UserCodeError

    def failing(x):
        (x * 2.0).sum()  # a node, then the error
        raise ValueError("bad model")

    assert sys.gettrace() is None
    trace(lambda x: (x * 2.0).sum(), torch.ones(2))
    assert sys.gettrace() is None
    with pytest.raises(UserCodeError):
        trace(failing, torch.ones(2))
    assert sys.gettrace() is None

    def debugger(frame, event, arg):
        return None

    sys.settrace(debugger)  # someone else's: kept, and gradtrace falls back to a mode
    try:
        result = trace(lambda x: (x * 2.0).sum(), torch.ones(2))
        assert sys.gettrace() is debugger
    finally:
        sys.settrace(None)
    assert all(n.source for n in result.nodes if not n.is_leaf)


class _TwoLineLinear(nn.Linear):
    """A subclass of the user's: its lines are the user's, although nn.Linear's forward is torch's."""

    def forward(self, x):
        y = super().forward(x)
        return y * 2.0  # MulBackward0: this line


class _Opaque(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.norm = nn.LayerNorm(3)
        self.mine = _TwoLineLinear(3, 3)

    def forward(self, x):
        h = self.norm(self.linear(x))
        return self.mine(h).sum()


def test_line_events_are_off_while_a_torch_module_runs_and_sites_stay_the_same():
    """While one of torch's own leaf modules runs (no user code in it), line events are off (Python 3.11):
    the frames of its call run off Python's slower tracing path. Its nodes keep the user's line that called it, and a
    user's subclass of a torch module is traced as the user's code. Sites agree with those from a mode."""
    import sys

    from torch.nn.modules.module import register_module_forward_hook

    torch.manual_seed(0)
    model, x = _Opaque(), torch.randn(2, 3)
    tracing_in: dict[str, bool] = {}

    def seen(module, args, output):  # registered before gradtrace's hooks: runs before its own
        tracing_in[type(module).__name__] = sys.gettrace() is not None

    handle = register_module_forward_hook(seen)
    try:
        by_lines = trace(model, x)
    finally:
        handle.remove()
    off = sys.version_info < (3, 12)  # on later versions, turning sys.settrace off and on costs more than it saves
    assert tracing_in == {"Linear": not off, "LayerNorm": not off, "_TwoLineLinear": True, "_Opaque": True}
    assert sys.gettrace() is None
    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: None)  # sites from a mode, per op
    try:
        by_mode = trace(model, x)
    finally:
        sys.settrace(previous)
    assert [(n.name, n.source) for n in by_lines.nodes] == [(n.name, n.source) for n in by_mode.nodes]
    first = _Opaque.forward.__code__.co_firstlineno
    (addmm,) = by_lines.find("AddmmBackward0", module="linear")
    assert addmm.source.endswith(f"test_tracing.py:{first + 1}")
    (mul,) = by_lines.find("MulBackward0")
    assert mul.source.endswith(f"test_tracing.py:{_TwoLineLinear.forward.__code__.co_firstlineno + 2}")
    from tracer_cli.errors import UserCodeError

    with pytest.raises(UserCodeError, match="'linear'"):  # raised inside nn.Linear, while line events are off
        trace(model, torch.randn(2, 4))
    assert sys.gettrace() is None


class Keeper(nn.Module):
    """Keeps its output, so the graph outlives trace(); a user hook is put on a node while forward runs."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.kept = None
        self.calls: list[str] = []
        self.handle = None

    def forward(self, x):
        y = self.w + x  # no tensor saved for backward: the kept graph can run again
        if self.handle is None:
            self.handle = y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: self.calls.append("user"))
        self.kept = y
        return y.sum()


def test_the_session_is_freed_when_trace_returns_without_a_garbage_collection():
    from tracer_cli import tracing

    def chain(x):
        for _ in range(50):
            x = (x * 1.5).sin()
        return x.sum()

    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for replay in (False, True):
            trace(chain, torch.randn(4), replay=replay)
            # an object in a reference cycle stays listed until a collection frees it
            assert not [o for o in gc.get_objects() if type(o) is tracing._TraceSession]
    finally:
        if was_enabled:
            gc.enable()


def test_graph_nodes_the_model_keeps_are_left_without_gradtrace_hooks():
    from torch.autograd.function import _HookMixin

    from tracer_cli import tracing

    torch_register = _HookMixin.__dict__["_register_hook"]
    model = Keeper()
    trace(model, torch.ones(3), input_grad=False)
    assert model.calls == ["user"]  # the user's hook on the same node ran, once
    assert _HookMixin.__dict__["_register_hook"] is torch_register
    gc.collect()
    # a hook left behind would hold the session (its hooks are bound to it)
    assert not [o for o in gc.get_objects() if type(o) is tracing._TraceSession]

    # the kept graph runs again with only the user's hooks, and takes new ones with torch's handles, also on
    # a node that had only gradtrace's hook (torch's handle holds a weak reference to the node's hook dict)
    (accumulate, _), *_ = model.kept.grad_fn.next_functions
    later = []
    handle = accumulate.register_hook(lambda grad_inputs, grad_outputs: later.append("later"))
    model.kept.sum().backward()
    assert model.calls == ["user", "user"] and later == ["later"]
    assert torch.equal(model.w.grad, torch.ones(3))
    handle.remove()
    model.handle.remove()
    model.kept.sum().backward()
    assert model.calls == ["user", "user"] and later == ["later"]


def test_a_hook_added_later_to_a_node_that_shares_gradtraces_hook_dict_is_refused():
    """Nodes hooked by gradtrace alone share one hook dict: a hook put there would run on all of them. A node of a
    graph kept past the trace refuses a new hook with a clear error; the kept graph still runs without it."""
    keeper = Keeper()
    trace(keeper, torch.ones(3), input_grad=False)
    sin = keeper.kept.sin()  # a node made after the trace takes hooks as usual
    sin.grad_fn.register_hook(lambda grad_inputs, grad_outputs: None)
    shared = keeper.kept.grad_fn  # AddBackward0 had the user's hook: its own dict, which takes more
    shared.register_hook(lambda grad_inputs, grad_outputs: None)

    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))
            self.kept = None

        def forward(self, x):
            self.kept = (x + self.w).neg()  # nothing saved for backward: the kept graph can run again
            return self.kept.sum()

    model = Chain()
    trace(model, torch.ones(3))
    with pytest.raises(RuntimeError, match="gradtrace"):
        model.kept.grad_fn.register_hook(lambda grad_inputs, grad_outputs: None)
    model.kept.sum().backward()
    assert torch.equal(model.w.grad, -torch.ones(3))


def test_a_shared_hook_call_for_no_node_of_the_graph_fails_the_trace_and_leaves_the_model_as_it_was(monkeypatch):
    """The shared hook asks the engine which node runs; where the answer is no node of the traced graph, the
    trace fails with gradtrace's own error rather than logging the gradient under a wrong node, and the model
    then runs a plain backward with no hook of gradtrace's left."""
    from tracer_cli.errors import InternalError

    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    x = torch.randn(5, 4)
    expected = plain_grads(model, (x,))
    monkeypatch.setattr(torch._C, "_current_autograd_node", lambda: None)
    with pytest.raises(InternalError, match="names no node"):
        trace(model, x)
    monkeypatch.undo()
    assert model.training and all(p.grad is None for p in model.parameters())
    after = plain_grads(model, (x,))
    assert after.keys() == expected.keys() and all(torch.equal(after[k], expected[k]) for k in expected)


def test_a_failure_recording_forward_values_is_reported_as_such(monkeypatch):
    """A hook error is reported with where it happened: recording forward values, not during backward."""
    from tracer_cli import tracing
    from tracer_cli.errors import InternalError

    batch = tracing._Stats.batch
    calls = []

    def failing_first(*args, **kwargs):  # the first batch is forward's (backward's flush raises in no hook)
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("norms unavailable")
        return batch(*args, **kwargs)

    monkeypatch.setattr(tracing._Stats, "batch", failing_first)
    with pytest.raises(InternalError, match="failed while recording forward values") as raised:
        trace(nn.Linear(4, 3), torch.randn(5, 4), forward_stats=True)
    assert "norms unavailable" in str(raised.value)


def test_two_threads_recording_custom_functions_at_once_each_record_their_own_and_leave_apply_as_it_was():
    """Each trace records its thread's custom Function calls (for --gradcheck) through Function.apply, one
    attribute for the process. Two traces in two threads, the first to start also the first to end: each
    checks its own Function, and afterwards Function.apply is torch's again (it was left pointing at a
    finished trace, which then hooked the graph of every custom Function applied later); so is the engine's
    entry, replaced the same way while forward runs."""
    import threading

    original, engine_entry = torch.autograd.Function.__dict__["apply"], _engine_entry()
    both_inside, first_done = threading.Barrier(2, timeout=30), threading.Event()

    def function(name, scale, wait):
        calls = []

        def forward(ctx, x):
            calls.append(x)
            if len(calls) == 1:  # the trace's forward (the gradcheck runs it again)
                both_inside.wait()  # both traces are recording now
                if wait:
                    first_done.wait(timeout=30)  # the other trace ends first
            return x * scale

        def backward(ctx, grad):
            return grad * scale

        return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})

    results: dict[str, object] = {}

    def run(name, scale, wait):
        fn = function(name, scale, wait)
        try:
            results[name] = trace(lambda x: fn.apply(x.sin()).sum(), torch.ones(3), gradcheck=True)
        except Exception as exc:  # noqa: BLE001 (reported by the assertion below)
            results[name] = exc
        if not wait:
            first_done.set()

    threads = [threading.Thread(target=run, args=args) for args in (("First", 2.0, False), ("Second", 3.0, True))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert torch.autograd.Function.__dict__["apply"] is original and _engine_entry() is engine_entry
    for name in ("First", "Second"):
        (node,) = results[name].find(f"{name}Backward")
        assert node.gradcheck is not None and node.gradcheck.passed, name


    class Later(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1.0

        @staticmethod
        def backward(ctx, grad):
            return grad

    # a custom Function applied later: its input's node takes hooks as usual (no finished trace hooked it)
    y = Later.apply(torch.ones(3, requires_grad=True).sin())
    y.grad_fn.next_functions[0][0].register_hook(lambda grad_inputs, grad_outputs: None)


def test_two_threads_tracing_at_once_see_each_nodes_own_gradients():
    """Every ordinary node shares one hook, which asks the engine which node runs: two traces in two threads
    at once still give each node the gradient it received, as retain_grad() shows it."""
    import threading

    def chain(length, scale):
        def model(x):
            for _ in range(length):
                x = (x * scale).sin()
            return x.sum()

        return model

    def expected(length, scale):
        x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
        kept = []
        y = x
        for _ in range(length):
            y = (y * scale).sin()
            y.retain_grad()
            kept.append(y)
        y.sum().backward()
        return [float(t.grad.norm()) for t in reversed(kept)]  # SinBackward0 nodes, last made first

    wrong: list[str] = []

    def run(length, scale):
        want = expected(length, scale)
        for _ in range(10):
            result = trace(chain(length, scale), torch.linspace(-1.0, 1.0, 8))
            sins = sorted((n for n in result.nodes if n.name == "SinBackward0"), key=lambda n: n.order)
            got = [n.grad_outputs[0].norm for n in sins]
            if got != pytest.approx(want, rel=1e-5):
                wrong.append(f"chain of {length}: {got[:3]} against {want[:3]}")

    threads = [threading.Thread(target=run, args=args) for args in ((300, 1.1), (500, 0.7))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


class _Waiting(nn.Module):
    """A model whose forward, while ``waiting`` holds an event, says it is inside and waits for the event."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.inside = None
        self.waiting = None

    def forward(self, x):
        if self.waiting is not None:
            self.inside.set()
            assert self.waiting.wait(timeout=30)
        return self.fc(x).pow(2).sum()


def test_a_model_another_thread_is_tracing_is_refused_and_that_trace_is_left_whole():
    """Two traces of one model at once would share its parameters' .grad (each setting, reading and restoring
    it): the second is refused, as a usage error, before it changes anything; the first is as if alone."""
    import threading

    from tracer_cli.errors import UsageError

    torch.manual_seed(0)
    model, x = _Waiting(), torch.randn(2, 4)
    want = {name: grad for name, grad in plain_grads(model, (x,)).items() if not name.startswith("input:")}
    model.inside, model.waiting = threading.Event(), threading.Event()
    results: list = []
    first = threading.Thread(target=lambda: results.append(trace(model, (x,))))
    first.start()
    try:
        assert model.inside.wait(timeout=30)
        with pytest.raises(UsageError, match="another thread is tracing this model") as refused:
            trace(model, (x,))
        assert "copy" in refused.value.hint
    finally:
        model.waiting.set()
        first.join()
    (result,) = results
    for name, grad in want.items():
        assert result.leaf(name).grad_norm == pytest.approx(float(grad.norm()), rel=1e-6)
    assert all(p.grad is None for p in model.parameters())
    model.waiting = None  # and once the first trace is over, or has failed, another thread may trace it
    other: list = []
    thread = threading.Thread(target=lambda: other.append(trace(model, (x,))))
    thread.start()
    thread.join()
    assert other and other[0].leaf("fc.weight").grad_norm == pytest.approx(float(want["fc.weight"].norm()), rel=1e-6)


def test_a_model_may_be_traced_by_another_thread_after_a_trace_that_raised():
    import threading

    model = nn.Linear(4, 3)
    with pytest.raises(ModelError):
        trace(model, torch.randn(2, 4), loss_fn=lambda out: out.detach().sum())  # no grad: raises
    done: list = []
    thread = threading.Thread(target=lambda: done.append(trace(model, torch.randn(2, 4))))
    thread.start()
    thread.join()
    assert done and done[0].leaf("weight").grad_norm > 0


def test_a_model_on_the_meta_device_is_refused():
    """torch runs a meta model's forward and backward on shapes alone: no norm to show, so no trace."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with pytest.raises(ModelError, match="meta device") as refused:
        trace(model, torch.randn(4, 8, device="meta"))
    assert "to_empty" in refused.value.hint
    with pytest.raises(ModelError, match="meta device"):  # inputs alone on it
        trace(lambda x: x.sin().sum(), torch.randn(4, device="meta"), input_grad=True)


def test_something_that_is_not_callable_is_a_usage_error():
    from tracer_cli.errors import UsageError

    with pytest.raises(UsageError, match="not callable: str"):
        trace("model", torch.randn(2))


def test_hooks_registered_by_another_thread_meanwhile_get_torch_handles():
    import threading

    from torch.utils.hooks import RemovableHandle

    from tracer_cli.tracing import _node_hooks

    y = torch.ones(2, requires_grad=True) * 2.0
    handles = []
    with _node_hooks(object()):
        other = threading.Thread(target=lambda: handles.append(y.grad_fn.register_hook(lambda gi, go: None)))
        other.start()
        other.join()
    assert isinstance(handles[0], RemovableHandle)
    handles[0].remove()


def test_a_thread_registering_hooks_while_traces_hook_their_graphs_gets_torch_handles_that_run():
    """While a trace hooks its graph (torch's registration callback replaced for one run of C calls), another
    thread that registers hooks of its own gets torch's handles, and its hooks run: the thread switch
    interval is made tiny, so a replacement that let other threads run meanwhile would show here."""
    import threading

    from torch.utils.hooks import RemovableHandle

    def model(x):
        for _ in range(2000):
            x = x.sin()
        return x.sum()

    stop, wrong, registered = threading.Event(), [], [0]

    def register_meanwhile():
        while not stop.is_set():
            y = torch.ones(2, requires_grad=True) * 2.0
            calls = []
            handle = y.grad_fn.register_hook(lambda grad_inputs, grad_outputs, calls=calls: calls.append(1))
            if not isinstance(handle, RemovableHandle):
                wrong.append(f"handle {type(handle).__name__}")
            y.sum().backward()
            if calls != [1]:
                wrong.append(f"the hook ran {len(calls)} times")
            handle.remove()
            registered[0] += 1

    interval = sys.getswitchinterval()
    other = threading.Thread(target=register_meanwhile)
    sys.setswitchinterval(1e-6)
    other.start()
    try:
        for _ in range(10):
            result = trace(model, torch.linspace(-1.0, 1.0, 8))
            assert sum(n.name == "SinBackward0" and n.order is not None for n in result.nodes) == 2000
    finally:
        stop.set()
        other.join()
        sys.setswitchinterval(interval)
    assert registered[0] > 0 and wrong == []


@pytest.mark.parametrize("gil", [True, False])
def test_shared_hook_registration_hooks_every_node_and_keeps_the_users_own_dicts(monkeypatch, gil):
    """Nodes without hooks get the shared dict; a node with a hook dict of the user's (which ends the fast
    run of C calls) gets the hook in its own dict, and so does every node after it. Torch's callback is
    as it was afterwards. Without the GIL (free-threaded Python) every node goes through _register_hook."""
    from torch.autograd.function import _HookMixin

    from tracer_cli import tracing
    from tracer_cli.tracing import _node_hooks, _register_shared, _SharedHooks

    class Counting(dict):  # counts the calls of _register_hook, the per-node Python callback
        lookups = 0

        def get(self, *args):
            Counting.lookups += 1
            return super().get(*args)

    monkeypatch.setattr(tracing, "_fast_hook_keys", Counting())
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: gil, raising=False)
    x = torch.ones(3, requires_grad=True)
    nodes, y = [], x
    for _ in range(40):
        y = y.sin()
        nodes.append(y.grad_fn)
    user_calls = []
    for position in (10, 30):
        nodes[position].register_hook(lambda grad_inputs, grad_outputs, p=position: user_calls.append(p))
    ran = []
    shared = lambda grad_inputs, grad_outputs: ran.append(torch._C._current_autograd_node())
    shared_hooks, key = _SharedHooks(), object()
    dict.__setitem__(shared_hooks, key, shared)  # as the session puts it there
    before = _HookMixin.__dict__["_register_hook"]
    with _node_hooks(key, shared, shared_hooks):
        inside = _HookMixin.__dict__["_register_hook"]
        handles = _register_shared(nodes, shared, shared_hooks)
        assert _HookMixin.__dict__["_register_hook"] is inside
    assert _HookMixin.__dict__["_register_hook"] is before
    own = [position for position, handle in enumerate(handles) if handle is not shared_hooks]
    assert own == [10, 30]
    # with the GIL, the nodes before the first with a dict of its own are hooked without a Python call
    assert Counting.lookups == (30 if gil else 40)
    assert all(key in handles[position] and len(handles[position]) == 2 for position in own)
    y.sum().backward()
    assert sorted(map(id, ran)) == sorted(map(id, nodes))  # each node's hook ran once
    assert sorted(user_calls) == [10, 30]


@given(
    st.lists(st.integers(0, 60), max_size=30).map(sorted),
    st.lists(st.integers(-5, 80) | st.just(2**64 - 1), max_size=40),
)
@settings(max_examples=300, deadline=None)
def test_interval_lookup_agrees_with_a_binary_search(starts, seqs):
    """Modules and creation sites are looked up by sequence number: the value of the last interval that
    starts at or before it, None before the first. Lists of both sizes occur, so both the binary search
    alone (few intervals) and the dict with a binary search for misses (many) are checked."""
    import bisect

    from tracer_cli.tracing import _intervals_at

    values = [f"site {i}" for i in range(len(starts))]
    expected = [None if bisect.bisect_right(starts, s) == 0 else values[bisect.bisect_right(starts, s) - 1] for s in seqs]
    assert _intervals_at(starts, values, seqs) == expected



@given(st.lists(st.integers(0, 5), max_size=40))
@settings(max_examples=300, deadline=None)
def test_cutting_statistics_into_calls_agrees_with_slicing(counts):
    """Each call's sent and received statistics are cut from one flat sequence by their counts (0 for a
    node that sends nothing): the same tuples as slicing it; too few or too many items is an error."""
    import itertools

    from tracer_cli.errors import InternalError
    from tracer_cli.tracing import _cut

    items = [f"stat {i}" for i in range(sum(counts))]
    ends = list(itertools.accumulate(counts))
    assert _cut(items, counts) == [tuple(items[start:end]) for start, end in zip([0, *ends], ends)]
    if items:
        with pytest.raises(InternalError):
            _cut(items[:-1], counts)
    with pytest.raises(InternalError):
        _cut([*items, "extra"], counts)

def test_hooks_of_both_kinds_are_removed():
    """Hooks registered under _node_hooks (the handle is the node's hook dict) and torch's RemovableHandles."""
    from tracer_cli.tracing import _node_hooks, _remove_hooks

    x = torch.ones(2, requires_grad=True)
    y = x + 1.0
    calls = []
    key = object()
    torch_handle = y.grad_fn.register_hook(lambda gi, go: calls.append("torch's"))
    with _node_hooks(key):
        dict_handle = y.grad_fn.register_hook(lambda gi, go: calls.append("fast"))
        other_node = y.grad_fn.next_functions[0][0].register_hook(lambda gi, go: calls.append("fast, own dict"))
    assert isinstance(dict_handle, dict) and isinstance(other_node, dict)
    _remove_hooks([dict_handle, torch_handle, other_node], key)
    y.sum().backward()
    assert calls == []


class _Named:
    """A stand-in for nodes of the type torch gives C++ classes it has no type for: names differ."""

    def __init__(self, name):
        self._name = name

    def name(self):
        return self._name


def test_node_names_are_each_nodes_own_name():
    """Names are asked once per node type where the type fixes them; a type that does not gets asked per node."""
    from torch.utils import checkpoint

    from tracer_cli.tracing import _node_names

    x = torch.randn(4, 4, requires_grad=True)
    y = x.clone()
    y[0] = 1.0  # CopySlices, named torch::autograd::CopySlices
    z = _Scaled.apply(y).sum() + checkpoint.checkpoint(torch.sin, x, use_reentrant=True).sum()
    z = z + torch.nn.functional.linear(x, x).sum() + x.double().sum()
    nodes = [z.grad_fn]
    for node in nodes:
        nodes += [child for child, _ in node.next_functions if child is not None and child not in nodes]
    expected = [node.name() for node in nodes]
    assert {"torch::autograd::AccumulateGrad", "torch::autograd::CopySlices", "_ScaledBackward"} <= set(expected)
    assert _node_names(nodes) == expected
    fakes = [_Named("A"), _Named("B"), *nodes, _Named("C")]
    assert _node_names(fakes) == ["A", "B", *expected, "C"]


@pytest.mark.parametrize(
    "tensors",
    [
        [torch.randn(8) for _ in range(5)],  # one shape, one dtype, contiguous: a single stack
        [torch.randn(8) for _ in range(3)] + [torch.randn(8, dtype=torch.float64)],  # two dtypes
        [torch.randn(8) for _ in range(3)] + [torch.randn(2, 4)],  # two shapes
        [torch.randn(8) for _ in range(3)] + [torch.randn(1).expand(8)],  # one strided
        [torch.randn(2, 3).t(), torch.randn(2, 3).t(), torch.randn(3, 2)],  # transposed and not
        [torch.randn(0, 3), torch.randn(0, 3), torch.randn(8)],  # empty
    ],
)
def test_batched_norms_are_each_tensors_own(tensors):
    """However a batch is stacked (one stack, or one per shape, dtype and contiguity), each tensor gets
    its own slot, shape, dtype and norm."""
    from tracer_cli.tracing import _Stats

    stats = _Stats()
    batch = [*tensors, None, tensors[0]]  # no gradient, and a tensor twice: one slot
    slots = stats.batch(batch)
    assert len(stats.positions) == len(tensors) and slots[id(None)] == -1
    values = stats.read()
    for tensor in tensors:
        slot = slots[id(tensor)]
        assert tuple(stats.shapes[slot]) == tuple(tensor.shape) and stats.dtypes[slot] == tensor.dtype
        expected = torch.linalg.vector_norm(tensor.double()).item()
        assert values[stats.positions[slot]] == pytest.approx(expected, rel=1e-6, abs=1e-12)


def test_site_table_is_put_in_order_keeping_ties():
    """A Function applied inside an op is marked before the op's own interval: the table is sorted by start,
    marks with the same start keep their order (the later one wins a lookup)."""
    from tracer_cli.tracing import _intervals_at, _SiteRecorder

    recorder = _SiteRecorder()
    recorder.starts += [10, 14, 15, 12, 16, 14]
    recorder.sites += ["a", "function", "after function", "op", "after op", "later mark at 14"]
    starts, sites = recorder.table()
    assert starts == [10, 12, 14, 14, 15, 16]
    assert sites == ["a", "op", "function", "later mark at 14", "after function", "after op"]
    assert _intervals_at(starts, sites, [9, 11, 13, 14, 15, 99]) == [None, "a", "op", "later mark at 14", "after function", "after op"]
    ordered = _SiteRecorder()
    ordered.starts += [1, 2, 2, 5]
    ordered.sites += ["w", "x", "y", "z"]
    assert ordered.table() == ([1, 2, 2, 5], ["w", "x", "y", "z"])


def _check_rows(x, scale=None):
    rows = x.shape[0]  # no node
    if scale is None:
        return x
    return x * (scale + rows)  # a node: only in the third call


def _calls_a_quiet_helper(x):
    x = _check_rows(_check_rows(x))
    y = _check_rows(x, scale=2.0)  # line 2 of this function
    return (y.sin() + x).sum()


def test_a_function_that_made_no_node_in_its_first_calls_is_not_traced_line_by_line():
    """Its later nodes get the line that called it; every other node keeps its own line."""
    result = trace(_calls_a_quiet_helper, torch.randn(3))
    first = _calls_a_quiet_helper.__code__.co_firstlineno
    (mul,) = result.find("MulBackward0")
    assert mul.source.endswith(f"test_tracing.py:{first + 2}")  # the call, not the line inside _check_rows
    (sin,) = result.find("SinBackward0")
    assert sin.source.endswith(f"test_tracing.py:{first + 3}")
    # traced from its first call, a function that makes a node keeps the node's own line
    result = trace(lambda x: _check_rows(x, scale=1.0).sum(), torch.randn(3))
    (mul,) = result.find("MulBackward0")
    assert mul.source.endswith(f"test_tracing.py:{_check_rows.__code__.co_firstlineno + 4}")


def test_nodes_gradtrace_itself_makes_have_no_creation_site():
    """The loss rule's sum is gradtrace's op: it gets no site, not the line of whoever called trace() (under
    the CLI, a line of Typer's). Line events, the per-op mode (another trace function is set) and --stack agree."""
    import sys

    def model(x):
        return x * 2.0

    def roots():
        yield trace(model, torch.randn(3))
        yield trace(model, torch.randn(3), stacks=True)
        previous = sys.gettrace()
        sys.settrace(lambda frame, event, arg: None)
        try:
            yield trace(model, torch.randn(3))
        finally:
            sys.settrace(previous)

    for result in roots():
        root, mul = result.nodes[0], result.find("MulBackward0")[0]
        assert root.name == "SumBackward0" and root.source is None and root.stack is None
        assert mul.source.endswith(f"test_tracing.py:{model.__code__.co_firstlineno + 1}")


# A plain function's modules and leaf tensors are those its code reaches, not every global of its file.
_encoder = nn.Linear(4, 4)
_scale = nn.Parameter(torch.ones(4))
_unrelated = nn.Linear(16, 2)  # another model in the same file (a notebook's, a test file's)
_scratch = torch.randn(3, requires_grad=True)


def _scaled_encoder(x):
    return _encoder(x) * _scale


def _through_helper(x):
    return _scaled_encoder(x).pow(2).sum()


def test_a_plain_function_takes_only_the_modules_and_tensors_its_code_reaches():
    x = torch.randn(2, 4)
    result = trace(_through_helper, x)
    assert result.meta.module_types == {"_encoder": "Linear"}
    assert result.params_without_grad == ()
    for param in (_encoder.weight, _encoder.bias, _scale):
        param.grad = None
    _through_helper(x).backward()
    expected = {"_encoder.weight": _encoder.weight, "_encoder.bias": _encoder.bias, "_scale": _scale}
    assert set(result.parameter_grad_norms()) == set(expected)
    for name, param in expected.items():
        assert result.parameter_grad_norms()[name] == pytest.approx(float(param.grad.norm()), rel=1e-6)
        param.grad = None


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.unused = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x, scale=1.0):
        return self.fc(x) * scale


class _Task:  # a plain (not nn.Module) object holding the model, Lightning-style
    def __init__(self, model):
        self.model = model

    def step(self, x):
        return self.model(x).sum()


def test_a_partial_and_a_bound_method_of_a_plain_object_name_the_model_inside():
    import functools

    model = _TwoLayers()
    partial = trace(functools.partial(model, scale=2.0), torch.randn(3, 4), input_grad=True)
    assert partial.meta.module_types == {"": "_TwoLayers", "fc": "Linear", "unused": "Linear"}
    assert partial.params_without_grad == ("unused.weight", "unused.bias")
    assert {n.param for n in partial if n.is_leaf} == {"fc.weight", "fc.bias", "input:0"}
    method = trace(_Task(model).step, torch.randn(3, 4), input_grad=True)
    assert method.params_without_grad == ("model.unused.weight", "model.unused.bias")
    assert {n.param for n in method if n.is_leaf} == {"model.fc.weight", "model.fc.bias", "input:0"}


_thread_a = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
_thread_b = nn.Linear(8, 1)


def _model_a(x):
    return _thread_a(x).sum()


def _model_b(x):
    return _thread_b(x).pow(2).sum()


def test_two_threads_tracing_two_plain_functions_do_not_touch_each_others_parameters():
    """Each trace sets the .grad of its model's parameters aside while it runs: a function's model is only
    what its code reaches, so two functions of one file traced at once leave each other alone."""
    import threading

    inputs = torch.randn(16, 8)
    expected = {}
    for fn, owner, prefix in ((_model_a, _thread_a, "_thread_a"), (_model_b, _thread_b, "_thread_b")):
        fn(inputs).backward()
        expected[fn] = {f"{prefix}.{param}": float(p.grad.norm()) for param, p in owner.named_parameters()}
        owner.zero_grad(set_to_none=True)
    wrong: list[str] = []

    def run(fn):
        for _ in range(20):
            grads = trace(fn, inputs).parameter_grad_norms()
            wrong.extend(f"{fn.__name__} {param}" for param, norm in expected[fn].items() if grads.get(param) != pytest.approx(norm, rel=1e-5))

    threads = [threading.Thread(target=run, args=(fn,)) for fn in (_model_a, _model_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def test_a_trace_between_the_callers_forward_and_backward_leaves_that_backward_as_it_would_be():
    """BatchNorm saved its running statistics for the caller's backward: putting them back after the trace's
    forward must not look like an in-place change to autograd."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    twin = copy.deepcopy(model)
    x = torch.randn(16, 4)
    loss = model(x).pow(2).mean()
    trace(model, x)
    loss.backward()
    twin(x).pow(2).mean().backward()
    for (name, param), twin_param in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(param.grad, twin_param.grad), name
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, twin.get_buffer(name)), name


def test_an_input_made_by_the_callers_graph_is_detached_so_the_trace_stops_there():
    torch.manual_seed(0)
    encoder, head = nn.Linear(4, 4), nn.Linear(4, 2)
    x = torch.randn(3, 4)
    hidden = encoder(x)
    result = trace(head, hidden, input_grad=True)
    assert {n.param for n in result if n.is_leaf} == {"weight", "bias", "input:0"}
    expected = head.weight.detach().sum(0).expand(3, 4)  # d(sum(head(h)))/dh: each row is the column sums of head.weight
    assert result.leaf("input:0").grad_outputs[0].norm == pytest.approx(float(expected.norm()), rel=1e-6)
    assert encoder.weight.grad is None
    head(hidden).sum().backward()  # the caller's graph is still there
    assert encoder.weight.grad is not None


def test_a_trace_shows_itself_in_one_line_in_a_repl():
    """A notebook shows repr(trace): a line that says what matters, not every node of a large model."""
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(40)])
    result = trace(model, torch.randn(2, 8))
    text = repr(result)
    assert "\n" not in text and len(text) < 200 and f"nodes={len(result.nodes)}" in text
    broken = trace(lambda x: x.log().sum(), torch.tensor([0.0, 1.0]))
    assert "nonfinite=2 (first: #1 LogBackward0)" in repr(broken)


def test_a_parameter_whose_grad_backward_filled_is_not_without_gradient():
    """DDP with find_unused_parameters fills the .grad of a parameter this rank did not use (its all-reduce
    brings the other ranks' gradients): not a parameter that received no gradient. Here a callback queued from a
    tensor hook does the same, at the end of backward, as DDP's reducer does."""

    class Partly(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            out = self.used(x)
            out.register_hook(queue_fill)
            return out

    model = Partly()

    def fill():
        model.unused.weight.grad = torch.ones_like(model.unused.weight)

    def queue_fill(grad):
        torch.autograd.Variable._execution_engine.queue_callback(fill)

    result = trace(model, torch.randn(3, 2))
    assert result.params_without_grad == ("unused.bias",)
    assert dict(result.param_grads)["unused.weight"].norm == pytest.approx(2.0)


# Code a plain function reaches through a class of its file, a decorator, and a decorated top-level function.
_reached = nn.Linear(4, 4)


class _Pipeline:
    def run(self, x):
        return _reached(x).sum()


def _decorated(function):
    import functools

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs)

    return wrapper


@_decorated
def _decorated_helper(x):
    return _reached(x)


def _through_a_class(x):
    return _Pipeline().run(x)


def _through_a_decorated_helper(x):
    return _decorated_helper(x).sum()


@_decorated
def _decorated_model(x):
    return _reached(x).sum()


@pytest.mark.parametrize("model", [_through_a_class, _through_a_decorated_helper, _decorated_model])
def test_a_plain_function_reaches_modules_through_classes_and_decorators(model):
    result = trace(model, torch.randn(2, 4), input_grad=True)
    assert result.meta.module_types == {"_reached": "Linear"}
    assert {n.param for n in result if n.is_leaf} == {"_reached.weight", "_reached.bias", "input:0"}
