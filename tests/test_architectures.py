"""The tracer on real architectures, checked against autograd and an independent attribution oracle.

Each architecture is built by hand from plain torch (no transformers/torchvision), small enough to
run in seconds. For each one an independent forward and plain ``loss.backward()`` of an identical
copy (same weights, same inputs, same seed) is compared with ``trace()``:

(a) completeness: the multiset of node names reachable from the independent loss through
    ``next_functions`` (plus, for reentrant checkpointing, the nodes its recompute builds during
    backward) equals the trace's nodes; the forward part (``created_in is None``) equals the graph
    that existed before backward, with the same edges.
(b) gradients: every parameter's and float input's AccumulateGrad norm equals ``grad.norm()`` of the
    plain backward within 1e-4 relative; parameters without a gradient are reported as such.
(c) attribution: forward hooks on every module record, for each call, the nodes created during it
    (reachable from its outputs but not from its inputs); the innermost call that created a node is
    its expected module. Forward nodes are paired with the trace's by breadth-first position from the
    loss; nodes made during backward are compared as a multiset of (name, module).
(d) the model is left as found: no hooks, training flags, ``.grad`` fields, caller's inputs.

``check_model`` returns a :class:`Report` instead of asserting, so ``scripts/validate_hf.py`` can run
the same checks on Hugging Face models and print a table.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import grad as autograd_grad
from torch.utils.checkpoint import checkpoint

from tracer_cli import trace

from .reference import plain_grads

REL = 1e-4
ACCUMULATE = "torch::autograd::AccumulateGrad"


# --- independent helpers (no tracer_cli code) -------------------------------------------------


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nested output: tensors, tuples/lists, mappings, dataclasses."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for item in value.values() for t in tensors_in(item)]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensors_in(item)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in tensors_in(getattr(value, f.name, None))]
    return []


def walk(roots: list[Any], stop: set[int] | None = None) -> list[Any]:
    """Nodes reachable from ``roots`` through ``next_functions``, not entering ids in ``stop``."""
    stop = stop or set()
    seen: set[int] = set()
    found: list[Any] = []
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen or id(node) in stop:
            continue
        seen.add(id(node))
        found.append(node)
        stack.extend(f for f, _ in node.next_functions if f is not None)
    return found


def breadth_first(root: Any, successors: Callable[[Any], list[Any]], key: Callable[[Any], Any] = id) -> list[Any]:
    """Nodes in breadth-first order from ``root``, successors in edge order (pairs isomorphic graphs)."""
    seen = {key(root)}
    order = [root]
    queue = collections.deque([root])
    while queue:
        for successor in successors(queue.popleft()):
            if successor is not None and key(successor) not in seen:
                seen.add(key(successor))
                order.append(successor)
                queue.append(successor)
    return order


def grad_norm(grad: torch.Tensor) -> float:
    if grad.layout == torch.sparse_coo:
        grad = grad.coalesce().values()
    return float(torch.linalg.vector_norm(grad.detach().double()))


def is_accumulate(node: Any) -> bool:
    return hasattr(node, "variable")


def fallback_loss(output: Any) -> torch.Tensor:
    """The product's loss rule, written out independently."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss if loss.dim() == 0 else loss.sum()
    floats = [t for t in tensors_in(output) if t.is_floating_point()]
    with_grad = [t for t in floats if t.requires_grad] or floats
    total = with_grad[0].sum()
    for t in with_grad[1:]:
        total = total + t.sum()
    return total


class CreationOracle:
    """Forward hooks on every module: which module call created each autograd node.

    A call creates the nodes reachable from its outputs but not from its inputs (the inputs'
    ``grad_fn`` are taken in the pre-hook, before an in-place op can move them). The innermost
    call is the one entered last among those that created the node. Parameters' AccumulateGrad
    nodes belong to the module that owns the parameter (first in ``named_modules`` order). A module's
    full backward hooks wrap its output in a node after every forward hook (these hooks see it made in
    the parent's call): it belongs to the module whose output it wraps.
    """

    def __init__(self, model: nn.Module):
        self.paths = {id(m): name for name, m in model.named_modules()}
        self.modules = dict(model.named_modules())
        self.leaf_paths = {name for name, m in model.named_modules() if not any(True for _ in m.children())}
        self.param_owner: dict[int, str] = {}
        for name, module in model.named_modules():
            for p in module.parameters(recurse=False):
                self.param_owner.setdefault(id(p), name)
        self.entries = 0
        self.pending: dict[int, list[tuple[int, list[Any]]]] = {}
        self.owner: dict[int, tuple[int, str, Any]] = {}  # id(node) -> (entry, path, node kept alive)
        self.leaf_outputs: list[tuple[str, Any]] = []
        self.handles = []
        for _, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post, with_kwargs=True))

    def _pre(self, module, args, kwargs):
        self.entries += 1
        roots = [t.grad_fn for t in tensors_in((args, kwargs)) if t.grad_fn is not None]
        self.pending.setdefault(id(module), []).append((self.entries, roots))

    def _post(self, module, args, kwargs, output):
        stack = self.pending.get(id(module))
        if not stack:
            return
        entry, roots = stack.pop()
        before = walk(roots)
        outputs = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
        created = [n for n in walk(outputs, {id(n) for n in before}) if not is_accumulate(n)]
        path = self.paths[id(module)]
        for node in created:
            known = self.owner.get(id(node))
            if known is None or known[0] < entry:
                self.owner[id(node)] = (entry, path, node)
        if path in self.leaf_paths:
            created_ids = {id(n) for n in created}
            self.leaf_outputs.extend((path, g) for g in outputs if id(g) in created_ids)

    def expected(self, node: Any, default: str | None = None) -> str | None:
        if is_accumulate(node):
            return self.param_owner.get(id(node.variable))
        known = self.owner.get(id(node))
        if known and node.name() == "BackwardHookFunctionBackward":
            wrapped = {self.owner[id(f)][1] for f, _ in node.next_functions if f is not None and id(f) in self.owner}
            if len(wrapped) == 1:
                (path,) = wrapped
                module = self.modules[path]
                hooked = module._backward_pre_hooks or getattr(module, "_is_full_backward_hook", None)
                inside = path.startswith(f"{known[1]}.") if known[1] else path != ""
                if hooked and inside:  # the output side: made after the module's call, in its parent's
                    return path
        return known[1] if known else default

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@dataclasses.dataclass
class Independent:
    """What an independent forward and plain backward saw."""

    loss: float
    before: list[Any]  # graph before backward, root first
    created: list[Any]  # graphs built during backward (reentrant checkpoint recompute)
    created_expected: dict[int, str | None]  # id(node) -> expected module, for created nodes
    oracle: CreationOracle
    grads: dict[str, torch.Tensor]  # "fc.weight" / "input:0" -> gradient
    params_without_grad: set[str]
    seconds: float


def with_input_grads(args: tuple, kwargs: dict) -> tuple[tuple, dict, dict[str, torch.Tensor]]:
    leaves: dict[str, torch.Tensor] = {}

    def alias(key: str, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and not value.requires_grad:
            value = value.detach().requires_grad_()
            leaves[f"input:{key}"] = value
        return value

    return (
        tuple(alias(str(i), a) for i, a in enumerate(args)),
        {k: alias(k, v) for k, v in kwargs.items()},
        leaves,
    )


def independent_run(model: nn.Module, args: tuple, kwargs: dict, loss_fn, seed: int) -> Independent:
    """Forward with the oracle, a plain backward; nodes built during backward are collected too."""
    args, kwargs, input_leaves = with_input_grads(args, kwargs)
    params = dict(model.named_parameters())
    for p in params.values():
        p.grad = None
    oracle = CreationOracle(model)
    created: list[Any] = []
    created_expected: dict[int, str | None] = {}
    original_backward = torch.autograd.backward
    handles = []
    try:
        torch.manual_seed(seed)
        started = time.perf_counter()
        output = model(*args, **kwargs)
        loss = loss_fn(output) if loss_fn is not None else fallback_loss(output)
        before = breadth_first(loss.grad_fn, lambda n: [f for f, _ in n.next_functions])
        known = {id(n) for n in before}
        # reentrant checkpoint: which checkpoint node is running, and where it was created
        running: list[str | None] = []

        def enter_checkpoint(module: str | None):
            def prehook(grad_outputs):
                running.append(module)

            return prehook

        def leave_checkpoint(grad_inputs, grad_outputs):
            running.pop()

        for node in before:
            if node.name() == "CheckpointFunctionBackward":
                handles.append(node.register_prehook(enter_checkpoint(oracle.expected(node))))
                handles.append(node.register_hook(leave_checkpoint))
        depth = [0]

        def recording_backward(tensors, *a, **kw):
            if depth[0] > 0:
                roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
                for node in walk([t.grad_fn for t in roots]):
                    if id(node) not in known:
                        known.add(id(node))
                        created.append(node)
                        created_expected[id(node)] = oracle.expected(node, running[-1] if running else None)
            depth[0] += 1
            try:
                return original_backward(tensors, *a, **kw)
            finally:
                depth[0] -= 1

        torch.autograd.backward = recording_backward
        loss.backward()
        # a leaf made in backward that is no parameter (a reentrant checkpoint's copy of its inputs) belongs to the
        # module of the first node made in backward that uses it (by sequence number: the first op of the block)
        for leaf in created:
            if is_accumulate(leaf) and created_expected[id(leaf)] is None:
                users = [n for n in created if any(f is leaf for f, _ in n.next_functions)]
                if users:
                    created_expected[id(leaf)] = created_expected[id(min(users, key=lambda n: n._sequence_nr()))]
        seconds = time.perf_counter() - started
    finally:
        torch.autograd.backward = original_backward
        oracle.remove()
    for h in handles:
        h.remove()
    grads = {name: p.grad.clone() for name, p in params.items() if p.grad is not None}
    grads.update({k: t.grad.clone() for k, t in input_leaves.items() if t.grad is not None})
    without = {name for name, p in params.items() if p.requires_grad and p.grad is None}
    for p in params.values():
        p.grad = None
    return Independent(float(loss.detach().float()), before, created, created_expected, oracle, grads, without, seconds)


def plain_seconds(model: nn.Module, args: tuple, kwargs: dict, loss_fn, seed: int) -> float:
    """One plain forward+backward with no hooks at all."""
    args, kwargs, _ = with_input_grads(args, kwargs)
    torch.manual_seed(seed)
    started = time.perf_counter()
    output = model(*args, **kwargs)
    (loss_fn(output) if loss_fn is not None else fallback_loss(output)).backward()
    seconds = time.perf_counter() - started
    for p in model.parameters():
        p.grad = None
    return seconds


# --- the check ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Report:
    name: str
    nodes_traced: int = 0
    nodes_executed: int = 0
    nodes_reference: int = 0
    max_rel_err: float = 0.0
    attribution_failures: list[str] = dataclasses.field(default_factory=list)
    failures: list[str] = dataclasses.field(default_factory=list)
    trace_s: float = 0.0
    plain_s: float = 0.0
    loss_rule: str = ""

    @property
    def ok(self) -> bool:
        return not self.failures and not self.attribution_failures

    def all_failures(self) -> list[str]:
        return self.failures + [f"attribution: {a}" for a in self.attribution_failures]


def _counter_diff(expected: collections.Counter, actual: collections.Counter) -> str:
    missing = expected - actual
    extra = actual - expected
    return f"missing from trace {dict(missing)}; extra in trace {dict(extra)}"


_HOOK_ATTRS = (
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
    "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)
_GLOBAL_HOOK_ATTRS = (
    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
    "_global_backward_pre_hooks", "_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs",
)


def hook_snapshot(model: nn.Module) -> dict[str, tuple]:
    """Every module's (and the global) hook dictionaries' keys, to compare before and after."""
    import torch.nn.modules.module as module_globals

    snapshot = {}
    for name, module in model.named_modules():
        for attr in _HOOK_ATTRS:
            snapshot[f"{name or '<root>'}.{attr}"] = tuple(getattr(module, attr, None) or ())
    for attr in _GLOBAL_HOOK_ATTRS:
        snapshot[attr] = tuple(getattr(module_globals, attr, None) or ())
    snapshot["torch function mode active"] = (torch._C._is_torch_function_mode_enabled(),)
    return snapshot


def check_model(
    name: str,
    build: Callable[[], nn.Module],
    make_inputs: Callable[[], tuple[tuple, dict]],
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    trace_train: bool | None = None,
    seed: int = 0,
    timing_repeats: int = 0,
) -> Report:
    """Trace ``build()`` on ``make_inputs()`` and compare with an independent run of a deep copy.

    ``trace_train`` is passed to ``trace(train=...)``; the independent copy is put in that mode.
    """
    report = Report(name)
    torch.manual_seed(seed)
    model = build()
    args, kwargs = make_inputs()
    try:
        reference_model = copy.deepcopy(model)
    except RuntimeError:  # old-style weight_norm keeps a computed weight, which deepcopy refuses: built again alike
        torch.manual_seed(seed)
        reference_model = build()
    if trace_train is not None:
        reference_model.train(trace_train)

    ref = independent_run(reference_model, args, kwargs, loss_fn, seed)
    report.nodes_reference = len(ref.before) + len(ref.created)

    # the model as the user left it: some .grad set, some None; flags recorded
    params = dict(model.named_parameters())
    sentinels: dict[str, torch.Tensor | None] = {}
    for i, (pname, p) in enumerate(params.items()):
        sentinels[pname] = torch.full_like(p, 0.25) if i % 2 == 0 else None
        p.grad = sentinels[pname]
    sentinel_copies = {k: None if v is None else v.clone() for k, v in sentinels.items()}
    flags = {mname: m.training for mname, m in model.named_modules()}
    input_flags = [(t, t.requires_grad) for t in tensors_in((args, kwargs))]
    hooks_before = hook_snapshot(model)
    buffers_before = {bname: (b, b.clone()) for bname, b in model.named_buffers()}

    torch.manual_seed(seed)
    started = time.perf_counter()
    t = trace(model, args, kwargs, loss_fn=loss_fn, train=trace_train, input_grad=True)
    report.trace_s = time.perf_counter() - started
    report.plain_s = ref.seconds
    report.nodes_traced = len(t.nodes)
    report.nodes_executed = sum(1 for n in t.nodes if n.order is not None)
    report.loss_rule = t.meta.loss_rule
    fail = report.failures.append

    # (d) left as found
    hooks_after = hook_snapshot(model)
    for key, value in hooks_after.items():
        if value != hooks_before.get(key):
            fail(f"hooks changed by trace(): {key} {hooks_before.get(key)} -> {value}")
    for mname, m in model.named_modules():
        if m.training != flags[mname]:
            fail(f"training flag of {mname or '<root>'} changed: {flags[mname]} -> {m.training}")
    for pname, p in params.items():
        before = sentinels[pname]
        if p.grad is not before or (before is not None and not torch.equal(p.grad, sentinel_copies[pname])):
            fail(f".grad of {pname} changed by trace()")
            break
    for tensor, flag in input_flags:
        if tensor.requires_grad != flag or tensor.grad is not None:
            fail("a caller's input tensor was changed by trace()")
    for bname, (buffer, value) in buffers_before.items():  # BatchNorm's running statistics, in train mode
        if model.get_buffer(bname) is not buffer or not torch.equal(buffer, value):
            fail(f"buffer {bname} changed by trace()")
            break
    for p in params.values():
        p.grad = None

    # loss
    if not math.isclose(t.meta.loss, ref.loss, rel_tol=REL, abs_tol=1e-6):
        fail(f"meta.loss {t.meta.loss} != independent loss {ref.loss} (rule {t.meta.loss_rule!r})")

    # (a) completeness
    traced_names = collections.Counter(n.name for n in t.nodes)
    expected_names = collections.Counter(n.name() for n in ref.before + ref.created)
    if traced_names != expected_names:
        fail("node multiset differs from the independent graph: " + _counter_diff(expected_names, traced_names))
    forward_names = collections.Counter(n.name for n in t.nodes if n.created_in is None)
    before_names = collections.Counter(n.name() for n in ref.before)
    if forward_names != before_names:
        fail("nodes with created_in None differ from the graph before backward: "
             + _counter_diff(before_names, forward_names))
    if ref.created and not any(n.created_in is not None for n in t.nodes):
        fail("nodes were created during backward but none has created_in")
    never_ran = [n.name for n in t.nodes if n.order is None]
    if never_ran:
        fail(f"{len(never_ran)} traced nodes never ran: {collections.Counter(never_ran)}")

    # forward graph: pair by breadth-first position from the loss, compare names, edges, modules
    traced_order = breadth_first(
        t.nodes[0], lambda n: [None if j is None else t.nodes[j] for j in n.next], key=lambda n: n.id
    )
    paired: set[int] = set()
    if len(traced_order) != len(ref.before):
        fail(f"{len(traced_order)} nodes reachable from trace node 0, {len(ref.before)} in the independent graph")
    else:
        for node, ref_node in zip(traced_order, ref.before):
            ref_next = [None if f is None else f.name() for f, _ in ref_node.next_functions]
            traced_next = [None if j is None else t.nodes[j].name for j in node.next]
            if node.name != ref_node.name() or traced_next != ref_next:
                fail(f"graph differs at {node.name} (id {node.id}) vs {ref_node.name()}: next {traced_next} vs {ref_next}")
                break
            paired.add(node.id)
            expected_module = ref.oracle.expected(ref_node)
            if node.module != expected_module:
                report.attribution_failures.append(
                    f"{node.name} (id {node.id}{', ' + node.param if node.param else ''}): "
                    f"module {node.module!r}, expected {expected_module!r}"
                )

    # nodes made during backward: multiset of (name, module)
    if ref.created:
        traced_created = collections.Counter((n.name, n.module) for n in t.nodes if n.id not in paired)
        expected_created = collections.Counter((n.name(), ref.created_expected[id(n)]) for n in ref.created)
        if traced_created != expected_created:
            report.attribution_failures.append(
                "backward-created nodes (name, module): " + _counter_diff(expected_created, traced_created)
            )

    # every module is a real path; each leaf module's output node is attributed to it
    valid = set(ref.oracle.paths.values())
    bad = {n.module for n in t.nodes if n.module is not None and n.module not in valid}
    if bad:
        report.attribution_failures.append(f"modules that are not paths of the model: {sorted(bad)}")
    attributed = collections.Counter((n.name, n.module) for n in t.nodes)
    in_graph = {id(n) for n in ref.before + ref.created}
    for path, node in ref.oracle.leaf_outputs:
        if id(node) in in_graph and attributed[(node.name(), path)] == 0:
            report.attribution_failures.append(f"no {node.name()} attributed to leaf module {path!r}")

    # (b) leaf gradients
    leaf_params = [n.param for n in t.nodes if n.param is not None]
    duplicates = [p for p, k in collections.Counter(leaf_params).items() if k > 1]
    if duplicates:
        fail(f"several AccumulateGrad nodes named {duplicates}")
    for key, grad in ref.grads.items():
        try:
            leaf = t.leaf(key)
        except KeyError:
            fail(f"no AccumulateGrad node for {key}")
            continue
        stat = leaf.grad_outputs[0] if leaf.grad_outputs else None
        if stat is None or stat.norm is None:
            fail(f"{key}: no gradient statistic")
            continue
        expected = grad_norm(grad)
        if tuple(stat.shape) != tuple(grad.shape):
            fail(f"{key}: shape {stat.shape} != {tuple(grad.shape)}")
        error = abs(stat.norm - expected) / max(abs(expected), 1e-30) if expected else abs(stat.norm)
        report.max_rel_err = max(report.max_rel_err, error)
        if error > REL and not (expected == 0 and stat.norm <= 1e-12):
            fail(f"{key}: traced norm {stat.norm!r} != plain backward {expected!r} (rel err {error:.2e})")
    if set(t.params_without_grad) != ref.params_without_grad:
        fail(f"params_without_grad {sorted(t.params_without_grad)} != {sorted(ref.params_without_grad)}")

    if timing_repeats:
        plain, traced = [], []
        for _ in range(timing_repeats):
            plain.append(plain_seconds(reference_model, args, kwargs, loss_fn, seed))
            torch.manual_seed(seed)
            started = time.perf_counter()
            trace(model, args, kwargs, loss_fn=loss_fn, train=trace_train, input_grad=True)
            traced.append(time.perf_counter() - started)
        report.plain_s = sorted(plain)[len(plain) // 2]
        report.trace_s = sorted(traced)[len(traced) // 2]
    return report


# --- architectures ---------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: in-place ReLU used twice, ``out += identity``, optional downsample."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, classes: int = 5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(2)
        self.layer1 = nn.Sequential(BasicBlock(8, 8))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, stride=2), BasicBlock(16, 16))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


RESNET_TARGET = torch.tensor([0, 3, 1])


def resnet_loss(output):
    return F.cross_entropy(output, RESNET_TARGET.to(output.device))


class BiLSTMClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 6, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return self.head(out.mean(1)) + h.sum(0).mean(-1, keepdim=True)


class CausalSelfAttention(nn.Module):
    """Hand-written attention through F.scaled_dot_product_attention (a fused node)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, s, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class TorchAttention(nn.Module):
    """nn.MultiheadAttention with a causal mask."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.mha = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x):
        s = x.shape[1]
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=x.device), 1)
        return self.mha(x, x, x, attn_mask=mask, need_weights=False)[0]


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, torch_attention: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = TorchAttention(dim, heads) if torch_attention else CausalSelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """Token + position embeddings, two blocks, LM head tied to the token embedding, dict output."""

    def __init__(self, vocab: int = 50, dim: int = 16, heads: int = 2, context: int = 16):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(context, dim)
        self.h = nn.ModuleList([GPTBlock(dim, heads, False), GPTBlock(dim, heads, True)])
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, input_ids, labels=None):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return out


class EncoderClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, x, padding_mask):
        return self.head(self.encoder(x, src_key_padding_mask=padding_mask)[:, 0])


class SparseBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(30, 8, sparse=True)
        self.bag = nn.EmbeddingBag(30, 8, mode="sum", sparse=True)
        self.dense_bag = nn.EmbeddingBag(30, 8, mode="mean")
        self.unused = nn.Linear(8, 8)  # never called: no gradient
        self.head = nn.Linear(24, 2)

    def forward(self, ids, bag_ids, offsets, weights):
        a = self.tokens(ids).mean(1)
        b = self.bag(bag_ids, offsets, per_sample_weights=weights)
        c = self.dense_bag(bag_ids, offsets)
        return self.head(torch.cat([a, b, c], -1))


class AutocastNet(nn.Module):
    """Conv + MLP under bf16 autocast on CPU; a Linear called twice shares the cached cast."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.LayerNorm(4 * 6 * 6)
        self.fc = nn.Linear(4 * 6 * 6, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.relu(self.conv(x)).flatten(1)
            h = self.fc(self.norm(h))
            h = self.out(torch.tanh(h))
            h = self.out(h)  # second call: the bf16 weight cast is reused
        return h.float()


class CheckBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Stage(nn.Module):
    """Calls checkpoint on a function that mixes module calls and bare ops, and uses ``shared`` inside."""

    def __init__(self, dim: int, shared: nn.Linear, use_reentrant: bool):
        super().__init__()
        self.block = CheckBlock(dim)
        self.shared = shared
        self.use_reentrant = use_reentrant

    def _inner(self, h):
        return torch.tanh(self.shared(self.block(h))) * 2

    def forward(self, h):
        return checkpoint(self._inner, h, use_reentrant=self.use_reentrant)


class CheckpointNet(nn.Module):
    def __init__(self, use_reentrant: bool, dim: int = 8):
        super().__init__()
        self.shared = nn.Linear(dim, dim)
        self.stage1 = Stage(dim, self.shared, use_reentrant)
        self.stage2 = Stage(dim, self.shared, use_reentrant)
        self.head = nn.Linear(dim, 2)

    def forward(self, x):
        h = torch.sigmoid(self.shared(x))  # shared outside the checkpoints too
        return self.head(self.stage2(self.stage1(h)))


class ScaledTanh(torch.autograd.Function):
    """tanh(x) * scale, with a float argument that gets no gradient."""

    @staticmethod
    def forward(ctx, x, scale: float):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y * scale

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * ctx.scale * (1 - y * y), None


class MulAdd(torch.autograd.Function):
    """Two outputs, (x * w, x + w); the caller uses only the first one in one place."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w, x + w

    @staticmethod
    def backward(ctx, grad_mul, grad_add):
        x, w = ctx.saved_tensors
        grad_x = grad_w = None
        if grad_mul is not None:
            grad_x, grad_w = grad_mul * w, (grad_mul * x).sum(0)
        if grad_add is not None:
            grad_x = grad_add if grad_x is None else grad_x + grad_add
            grad_w = grad_add.sum(0) if grad_w is None else grad_w + grad_add.sum(0)
        return grad_x, grad_w


class Act(nn.Module):
    def forward(self, x):
        return ScaledTanh.apply(x, 1.5)


class Mix(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim))

    def forward(self, x, both: bool):
        mul, add = MulAdd.apply(x, self.w)
        return mul + add if both else mul


class CustomNet(nn.Module):
    def __init__(self, dim: int = 6):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.act = Act()
        self.mix = Mix(dim)

    def forward(self, x):
        h = self.act(self.fc(x))
        h = self.mix(h, True) + self.mix(h, False)
        return ScaledTanh.apply(h, 0.5)  # a custom Function called by the root itself


class Parametrized(nn.Module):
    """weight_norm and spectral_norm parametrizations, a full backward hook, a user forward hook
    that replaces the output, and a nested reentrant checkpoint."""

    def __init__(self):
        super().__init__()
        from torch.nn.utils.parametrizations import spectral_norm, weight_norm

        self.wn = weight_norm(nn.Linear(4, 4))
        self.sn = spectral_norm(nn.Linear(4, 4))
        self.hooked = nn.Linear(4, 4)
        self.hooked.register_full_backward_hook(lambda module, grad_inputs, grad_outputs: None)
        self.scaled = nn.Linear(4, 4)
        self.scaled.register_forward_hook(lambda module, args, output: output * 3)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def _outer(self, h):
        return torch.relu(checkpoint(self.b, self.a(h), use_reentrant=True))

    def forward(self, x):
        h = self.scaled(self.hooked(torch.tanh(self.sn(self.wn(x)))))
        return checkpoint(self._outer, h, use_reentrant=True)


def old_style_norms() -> nn.Module:
    """torch.nn.utils.weight_norm / spectral_norm: the weight is computed in a forward pre-hook of the
    Linear, so its nodes belong to that Linear's call."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*weight_norm`? is deprecated")  # for parametrizations (torch 2.1: a UserWarning)
        wn = nn.utils.weight_norm(nn.Linear(6, 6))
    return nn.Sequential(wn, nn.Tanh(), nn.utils.spectral_norm(nn.Linear(6, 2)))


class PackedBiLSTM(nn.Module):
    """A bidirectional LSTM over a PackedSequence of unsorted lengths."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 5, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(10, 2)

    def forward(self, x, lengths):
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)  # (torch wants them there)
        out, _ = pad_packed_sequence(self.lstm(packed)[0], batch_first=True)
        return self.head(out.sum(1))


class GradientPenalty(nn.Module):
    """WGAN-GP: ``torch.autograd.grad(..., create_graph=True)`` inside forward builds double-backward nodes."""

    class Penalty(nn.Module):
        def forward(self, score, x):
            (grad,) = torch.autograd.grad(score.sum(), x, create_graph=True)
            return ((grad.norm(dim=1) - 1) ** 2).mean()

    def __init__(self):
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.penalty = self.Penalty()

    def forward(self, x):
        score = self.critic(x)
        return score.mean() + 10 * self.penalty(score, x)


class _TanhBackwardInAThread(torch.autograd.Function):
    """tanh whose backward computes in a thread of its own: the nodes a double backward makes there are
    numbered by that thread's counter, as those that a GPU's part of a backward makes are by the engine's
    thread for the device."""

    @staticmethod
    def forward(ctx, x):
        y = x.tanh()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        result = []
        worker = threading.Thread(target=lambda: result.append(grad * (1 - y * y)))
        worker.start()
        worker.join()
        return result[0]


class _ThreadedTanh(nn.Module):
    def forward(self, x):
        return _TanhBackwardInAThread.apply(x)


class GradientPenaltyInAThread(GradientPenalty):
    """The gradient penalty, its double-backward nodes made in another thread (as on a GPU), through a
    ``grad`` imported by name before the trace."""

    class Penalty(nn.Module):
        def forward(self, score, x):
            (grad,) = autograd_grad(score.sum(), x, create_graph=True)
            return ((grad.norm(dim=1) - 1) ** 2).mean()

    def __init__(self):
        super().__init__()
        self.critic[1] = _ThreadedTanh()
        self.penalty = self.Penalty()


class InnerStep(nn.Module):
    """A backward(create_graph=True) into a weight's ``.grad`` inside forward (one inner step of a learned
    optimiser), its double-backward nodes made in another thread (as on a GPU)."""

    class Step(nn.Module):
        def forward(self, body, x):
            weight = body[0].weight
            weight.grad = None
            body(x).pow(2).sum().backward(create_graph=True, inputs=[weight])
            grad, weight.grad = weight.grad, None
            return grad.pow(2).sum()

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), _ThreadedTanh(), nn.Linear(8, 1))
        self.step = self.Step()

    def forward(self, x):
        return self.body(x).sum() + self.step(self.body, x)


class MixtureOfExperts(nn.Module):
    """Top-2 routing with index_add and an in-place write into a view (CopySlices) in a submodule."""

    class Writer(nn.Module):
        def forward(self, h, values):
            h[:, :2] = values * 3
            return h

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(4, 3)
        self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.writer = self.Writer()

    def forward(self, x):
        weights, chosen = F.softmax(self.gate(x), -1).topk(2, -1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (chosen == e).any(-1).nonzero().squeeze(-1)
            if len(rows):
                weight = (weights * (chosen == e)).sum(-1)[rows].unsqueeze(-1)
                out = out.index_add(0, rows, weight * expert(x[rows]))
        return self.writer(out * 2, x[:, :2])


def _ids(shape, high):
    return torch.randint(0, high, shape)


ARCHITECTURES = {
    "resnet": dict(build=ResNet, make_inputs=lambda: ((torch.randn(3, 3, 12, 12),), {}), loss_fn=resnet_loss),
    "bilstm": dict(build=BiLSTMClassifier, make_inputs=lambda: ((torch.randn(2, 5, 4),), {})),
    "gpt_dict_loss": dict(
        build=TinyGPT, make_inputs=lambda: ((), {"input_ids": _ids((2, 8), 50), "labels": _ids((2, 8), 50)})
    ),
    "gpt_fallback": dict(build=TinyGPT, make_inputs=lambda: ((_ids((2, 8), 50),), {})),
    "transformer_encoder": dict(
        build=lambda: EncoderClassifier().eval(),  # traced with train=True: dropout active, mode restored
        make_inputs=lambda: ((torch.randn(2, 6, 16), torch.tensor([[False] * 6, [False] * 4 + [True] * 2])), {}),
        trace_train=True,
    ),
    "sparse_embeddings": dict(
        build=SparseBag,
        make_inputs=lambda: (
            (_ids((2, 5), 30), _ids((7,), 30), torch.tensor([0, 3]), torch.rand(7)),
            {},
        ),
    ),
    "bf16_autocast": dict(build=AutocastNet, make_inputs=lambda: ((torch.randn(2, 2, 6, 6),), {})),
    "checkpoint_reentrant": dict(
        build=lambda: CheckpointNet(True), make_inputs=lambda: ((torch.randn(3, 8),), {})
    ),
    "checkpoint_nonreentrant": dict(
        build=lambda: CheckpointNet(False), make_inputs=lambda: ((torch.randn(3, 8),), {})
    ),
    "custom_functions": dict(build=CustomNet, make_inputs=lambda: ((torch.randn(4, 6),), {})),
    "packed_bilstm": dict(
        build=PackedBiLSTM, make_inputs=lambda: ((torch.randn(3, 5, 4), torch.tensor([5, 2, 3])), {})
    ),
    "gradient_penalty": dict(build=GradientPenalty, make_inputs=lambda: ((torch.randn(3, 4),), {})),
    "gradient_penalty_backward_in_a_thread": dict(build=GradientPenaltyInAThread, make_inputs=lambda: ((torch.randn(3, 4),), {})),
    "inner_backward_in_a_thread": dict(build=InnerStep, make_inputs=lambda: ((torch.randn(3, 4),), {})),
    "mixture_of_experts": dict(build=MixtureOfExperts, make_inputs=lambda: ((torch.randn(6, 4),), {})),
    "parametrized_hooked_nested_checkpoint": dict(
        build=Parametrized, make_inputs=lambda: ((torch.randn(3, 4),), {})
    ),
    "old_style_weight_and_spectral_norm": dict(build=old_style_norms, make_inputs=lambda: ((torch.randn(3, 6),), {})),
}


_REPORTS: dict[str, Report] = {}


def report_for(name: str) -> Report:
    if name not in _REPORTS:
        _REPORTS[name] = check_model(name, **ARCHITECTURES[name])
    return _REPORTS[name]


# the nested checkpoint's inner call runs under the outer one's no_grad forward: torch warns, as expected; and
# so does a backward(create_graph=True) (InnerStep's), of the cycle between a parameter and its .grad
_NESTED_WARNING = "ignore:None of the inputs have requires_grad=True"
_CREATE_GRAPH_WARNING = r"ignore:Using backward\(\) with create_graph=True"


@pytest.mark.filterwarnings(_NESTED_WARNING, _CREATE_GRAPH_WARNING)
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_graph_gradients_and_cleanup(name):
    report = report_for(name)
    assert report.nodes_traced > 0
    assert not report.failures, "\n".join(report.failures)


@pytest.mark.filterwarnings(_NESTED_WARNING, _CREATE_GRAPH_WARNING)
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_attribution_matches_oracle(name):
    report = report_for(name)
    assert not report.attribution_failures, "\n".join(report.attribution_failures)


def to_device(value: Any, device: str) -> Any:
    """Tensors in nested tuples, lists and dicts, moved to ``device`` (also for ``scripts/validate_hf.py``)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(item, device) for item in value)
    if isinstance(value, dict):
        return {key: to_device(item, device) for key, item in value.items()}
    return value


@pytest.mark.filterwarnings(_NESTED_WARNING, _CREATE_GRAPH_WARNING)
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_graph_gradients_attribution_and_cleanup_as_on_a_device(name, monkeypatch):
    """The same checks with every CPU tensor taken for a device's, as on a GPU: nothing read back before the end,
    large gradients waiting for batches, norms in float64; where CI runs (the same over the statistics tests
    found an empty float64 gradient that crashed a device's trace)."""
    from tracer_cli import tracing

    monkeypatch.setattr(tracing._Stats, "_reads_at_once", lambda self, tensor: False)
    monkeypatch.setattr(tracing, "SMALL_NUMEL", 16)  # these models' gradients taken for large ones, which wait in batches
    spec = ARCHITECTURES[name]
    report = check_model(name, spec["build"], spec["make_inputs"], spec.get("loss_fn"), trace_train=spec.get("trace_train"))
    assert report.nodes_traced > 0
    assert not report.all_failures(), "\n".join(report.all_failures())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings(_NESTED_WARNING, _CREATE_GRAPH_WARNING)
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_graph_gradients_attribution_and_cleanup_on_cuda(name):  # pragma: no cover - GPU only
    """The same checks with the model and its inputs on a GPU (statistics stay there until one read-back)."""
    spec = ARCHITECTURES[name]
    build, make_inputs = spec["build"], spec["make_inputs"]
    report = check_model(
        name, lambda: build().cuda(), lambda: to_device(make_inputs(), "cuda"), spec.get("loss_fn"), trace_train=spec.get("trace_train")
    )
    assert report.nodes_traced > 0
    assert not report.all_failures(), "\n".join(report.all_failures())


# --- targeted expectations that the generic check does not spell out ---------------------------


def _trace(name: str):
    spec = ARCHITECTURES[name]
    torch.manual_seed(0)
    model = spec["build"]()
    args, kwargs = spec["make_inputs"]()
    return model, trace(model, args, kwargs, loss_fn=spec.get("loss_fn"), train=spec.get("trace_train"), input_grad=True)


def test_linear_inner_nodes_belong_to_the_linear():
    _, t = _trace("resnet")
    assert {n.module for n in t.find("TBackward0")} == {"fc"}
    assert {n.module for n in t.find("AddmmBackward0")} == {"fc"}
    assert {n.module for n in t.find("NllLossBackward0")} == {None}  # loss_fn runs outside the model
    # the in-place residual add belongs to the block, not to bn2 or to the Sequential
    adds = sorted(n.module for n in t.find("AddBackward0"))
    assert adds == ["layer1.0", "layer2.0", "layer2.1"]


def test_tied_embedding_has_one_leaf_and_dict_loss_is_used():
    model, t = _trace("gpt_dict_loss")
    assert t.meta.loss_rule == 'output["loss"]'
    tied = [n for n in t.nodes if n.param in ("wte.weight", "lm_head.weight")]
    assert [n.param for n in tied] == ["wte.weight"]
    assert tied[0].module == "wte"
    assert {n.module for n in t.find("EmbeddingBackward0")} == {"wte", "wpe"}
    assert {n.module for n in t.find("NllLossBackward0")} == {""}


def test_sparse_gradient_statistics():
    _, t = _trace("sparse_embeddings")
    for param in ("tokens.weight", "bag.weight"):
        stat = t.leaf(param).grad_outputs[0]
        assert stat.layout == "sparse_coo" and stat.shape == (30, 8)
    assert t.leaf("dense_bag.weight").grad_outputs[0].layout is None
    assert set(t.params_without_grad) == {"unused.weight", "unused.bias"}
    assert t.leaf("input:3").grad_outputs[0].shape == (7,)


def test_bf16_gradients_are_recorded_as_bf16():
    _, t = _trace("bf16_autocast")
    casts = t.find("ToCopyBackward0")
    assert casts
    assert any(s is not None and s.dtype == "bfloat16" for n in casts for s in n.grad_outputs)
    assert {n.module for n in casts} <= {"conv", "fc", "out", ""}
    assert t.leaf("fc.weight").grad_outputs[0].dtype == "float32"


def test_reentrant_checkpoint_runs_shared_leaf_three_times():
    _, t = _trace("checkpoint_reentrant")
    checkpoints = t.find("CheckpointFunctionBackward")
    assert sorted(n.module for n in checkpoints) == ["stage1", "stage2"]
    leaf = t.leaf("shared.weight")
    assert leaf.runs == 3 and leaf.created_in is None
    inner = [n for n in t.nodes if n.created_in is not None]
    assert {n.created_in for n in inner} == {n.id for n in checkpoints}
    # bare ops of the checkpointed function belong to the module that called checkpoint
    assert sorted(n.module for n in t.find("TanhBackward0")) == ["stage1", "stage2"]
    assert sorted(n.module for n in t.find("NativeLayerNormBackward0")) == ["stage1.block.norm", "stage2.block.norm"]
    for param in ("stage1.block.fc1.weight", "stage2.block.norm.bias"):
        assert t.leaf(param).created_in is not None, param


def test_nonreentrant_checkpoint_graph_is_complete_before_backward():
    _, t = _trace("checkpoint_nonreentrant")
    assert all(n.created_in is None for n in t.nodes)
    assert t.leaf("shared.weight").runs == 1
    assert sorted(n.module for n in t.find("TanhBackward0")) == ["stage1", "stage2"]


def test_custom_function_nodes():
    _, t = _trace("custom_functions")
    scaled = t.find("ScaledTanhBackward")
    assert sorted(n.module for n in scaled) == ["", "act"]
    for node in scaled:
        assert len(node.grad_inputs) == 1  # one per tensor input: the float scale has no slot
    muladd = t.find("MulAddBackward")
    assert [n.module for n in muladd] == ["mix", "mix"]
    # the call that used only the product got None for the unused sum
    assert sorted(sum(s is None for s in n.grad_outputs) for n in muladd) == [0, 1]


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a broken custom backward")


class _ExitInBackward(_Boom):
    @staticmethod
    def backward(ctx, grad):
        sys.exit(4)


class _Failing(nn.Module):
    def __init__(self, where: str):
        super().__init__()
        self.where = where
        self.fc = nn.Linear(3, 3)
        self.block = CheckBlock(3)

    def forward(self, x):
        h = self.block(self.fc(x))
        if self.where == "forward":
            raise ValueError("a broken forward")
        if self.where == "forward-exit":
            sys.exit(4)
        return (_ExitInBackward if self.where == "backward-exit" else _Boom).apply(h)


@pytest.mark.parametrize("where", ["forward", "backward", "forward-exit", "backward-exit"])
def test_model_left_as_found_when_user_code_raises(where):
    """Also when it calls sys.exit(): reported as the model's error, not an exit of gradtrace."""
    from tracer_cli.errors import UserCodeError

    model = _Failing(where).eval()
    hooks = hook_snapshot(model)
    model.fc.weight.grad = torch.ones(3, 3)
    with pytest.raises(UserCodeError):
        trace(model, (torch.randn(2, 3),), train=True)
    assert hook_snapshot(model) == hooks
    assert not any(m.training for m in model.modules())
    assert torch.equal(model.fc.weight.grad, torch.ones(3, 3)) and model.fc.bias.grad is None


class _ScriptedBody(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return torch.relu(self.fc(x)) * 2


class _WithScriptedBody(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 8)
        self.body = torch.jit.script(_ScriptedBody())

    def forward(self, x):
        return self.body(torch.tanh(self.pre(x)))


@pytest.mark.filterwarnings("ignore:.*torch.jit.script.* is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:.*torch.jit.script.* is deprecated:FutureWarning")  # torch 2.14 on
@pytest.mark.parametrize("scripted_root", [False, True])
def test_torchscript_modules_are_traced_without_hooks(scripted_root):
    """TorchScript modules take no hooks: their nodes belong to the nearest eager module above (the root's
    own boundaries where the root is scripted); every gradient is still recorded, and the model is left as
    found."""
    torch.manual_seed(0)
    model = torch.jit.script(_ScriptedBody()) if scripted_root else _WithScriptedBody()
    x = torch.randn(5, 8 if scripted_root else 4)
    hooks = hook_snapshot(model)
    result = trace(model, (x,), input_grad=True)
    assert hook_snapshot(model) == hooks
    prefix = "" if scripted_root else "body."
    assert result.meta.module_types[prefix.rstrip(".")] == "_ScriptedBody"
    # the scripted body's ops (their nodes depend on the TorchScript executor: one op each, or a single
    # DifferentiableGraphBackward) belong to the root; pre's to pre; the loss rule's sum to no module
    (loss_sum,) = result.find("SumBackward0")
    assert loss_sum.module is None
    ops = [n for n in result.nodes if not n.is_leaf and n is not loss_sum]
    if not scripted_root:
        assert sorted(n.name for n in ops if n.module == "pre") == ["AddmmBackward0", "TBackward0"]
        assert result.leaf("pre.weight").module == "pre"
    assert {n.module for n in ops if n.module != "pre"} == {""}, [(n.name, n.module) for n in ops]
    assert result.leaf(f"{prefix}fc.weight").module == f"{prefix}fc"  # leaves by their parameter's name
    expected = plain_grads(model, (x,))
    assert set(expected) == {n.param for n in result.nodes if n.is_leaf}
    for name, grad in expected.items():
        assert result.leaf(name).grad_outputs[0].norm == pytest.approx(float(grad.norm()), rel=1e-5), name
