"""Independent reference computations for the tracer's tests.

Nothing here imports ``tracer_cli``: these helpers walk the autograd graph and
run a plain ``loss.backward()`` with PyTorch alone, so the tests compare the
tracer against autograd itself rather than against its own code.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import itertools
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest
import torch
from torch import nn

SAMPLES_DIR = Path(__file__).resolve().parent.parent / "sample_models"
SAMPLE_NAMES = tuple(sorted(p.stem for p in SAMPLES_DIR.glob("*.py") if not p.stem.startswith("_")))

_import_counter = itertools.count()


def graph_nodes(root_grad_fn: Any) -> list[Any]:
    """Every node reachable from ``root_grad_fn`` through ``next_functions``.

    Iterative depth-first walk; nodes are deduplicated by ``id()`` while the
    returned list keeps them alive, so ids cannot be reused mid-walk.
    """
    if root_grad_fn is None:
        return []
    seen: set[int] = {id(root_grad_fn)}
    nodes = [root_grad_fn]
    stack = [root_grad_fn]
    while stack:
        node = stack.pop()
        for next_fn, _ in node.next_functions:
            if next_fn is not None and id(next_fn) not in seen:
                seen.add(id(next_fn))
                nodes.append(next_fn)
                stack.append(next_fn)
    return nodes


def graph_signature(loss: torch.Tensor) -> collections.Counter:
    """The multiset of ``node.name()`` over the graph behind ``loss``."""
    return collections.Counter(node.name() for node in graph_nodes(loss.grad_fn))


def reference_loss(output: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None, reduction: str = "sum") -> torch.Tensor:
    """The loss by the product's rule, written out independently of the tracer.

    ``loss_fn(output)`` if given; else a 0-dim tensor output as is; else the
    output's ``.loss`` / ``["loss"]``; else every floating-point tensor in the
    output reduced with ``.sum()`` (or ``.mean()``) and the results added; float16 and bfloat16
    tensors reduced in float32.
    """
    if loss_fn is not None:
        return loss_fn(output)
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    if not isinstance(output, torch.Tensor):
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if loss is not None:
            return loss
    reduce = torch.Tensor.sum if reduction == "sum" else torch.Tensor.mean

    def reduced(t: torch.Tensor) -> torch.Tensor:
        return reduce(t, dtype=torch.float32) if t.dtype in (torch.float16, torch.bfloat16) else reduce(t)

    terms = [reduced(t) for t in _tensors(output) if t.is_floating_point() or t.is_complex()]
    if not terms:
        raise ValueError("output holds no floating-point tensor")
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        values = output.values()
    elif isinstance(output, (list, tuple)):
        values = output
    elif dataclasses.is_dataclass(output):
        values = [getattr(output, f.name) for f in dataclasses.fields(output)]
    else:
        return []
    return [t for value in values for t in _tensors(value)]


def with_input_grads(args: tuple, kwargs: dict) -> tuple[tuple, dict, dict[str, torch.Tensor]]:
    """Copies of the inputs where each floating-point tensor requires grad.

    Returns the new args, the new kwargs and ``{"input:0": tensor, "input:NAME": tensor}``.
    """
    leaves: dict[str, torch.Tensor] = {}

    def alias(key: str, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.detach().requires_grad_()
            leaves[f"input:{key}"] = value
        return value

    new_args = tuple(alias(str(i), a) for i, a in enumerate(args))
    new_kwargs = {name: alias(name, v) for name, v in kwargs.items()}
    return new_args, new_kwargs, leaves


def plain_grads(
    model: Callable[..., Any],
    args: tuple = (),
    kwargs: dict | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    reduction: str = "sum",
) -> dict[str, torch.Tensor]:
    """Gradients from a plain ``loss.backward()``, with no hooks anywhere.

    Returns ``{name: grad}`` for every named parameter that received one, plus
    ``"input:0"`` / ``"input:NAME"`` for floating-point inputs (made to require
    grad on detached copies; the caller's tensors are untouched). The model's
    ``.grad`` fields are restored afterwards.
    """
    args, kwargs, leaves = with_input_grads(tuple(args), dict(kwargs or {}))
    params = dict(model.named_parameters()) if isinstance(model, nn.Module) else {}
    saved = {name: p.grad for name, p in params.items()}
    try:
        for p in params.values():
            p.grad = None
        loss = reference_loss(model(*args, **kwargs), loss_fn, reduction)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in params.items() if p.grad is not None}
    finally:
        for name, p in params.items():
            p.grad = saved[name]
    for key, leaf in leaves.items():
        if leaf.grad is not None:
            grads[key] = leaf.grad.clone()
    return grads


def load_sample(name: str):
    """Import ``sample_models/NAME.py`` by path, as a fresh module (not ``__main__``).

    The sample's folder is put on ``sys.path`` so a sample may import its neighbours.
    """
    path = SAMPLES_DIR / f"{name}.py"
    module_name = f"_gradtrace_sample_{name}_{next(_import_counter)}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    folder = str(SAMPLES_DIR)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def sample_model(module: Any, **build_kwargs: Any) -> Callable[..., Any]:
    """The sample's model: ``build_model(**build_kwargs)`` if defined, else ``model``."""
    if hasattr(module, "build_model"):
        return module.build_model(**build_kwargs)
    return module.model


def as_call_args(inputs: Any) -> tuple[tuple, dict]:
    """``example_inputs()``'s result as ``(args, kwargs)``."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, tuple):
        return inputs, {}
    return (inputs,), {}


def grad_norm(grad: torch.Tensor) -> float:
    """The L2 norm of a gradient, in float32 or wider; sparse gradients are coalesced first."""
    if grad.layout == torch.sparse_coo:
        grad = grad.coalesce().values()
    dtype = torch.float64 if grad.dtype in (torch.float64, torch.complex128) else torch.float32
    if grad.is_complex():
        return float(torch.linalg.vector_norm(grad).to(dtype))
    return float(torch.linalg.vector_norm(grad, dtype=dtype))


StatTuple = tuple  # (shape, dtype name, norm) of one gradient, or None


def grad_stat(grad: torch.Tensor | None) -> StatTuple | None:
    """``(shape, dtype, norm)`` of a gradient, as the product documents them."""
    if grad is None:
        return None
    return tuple(grad.shape), str(grad.dtype).removeprefix("torch."), grad_norm(grad)


@dataclasses.dataclass
class ReferenceBackward:
    """What an independent, hooked ``loss.backward()`` saw.

    Attributes:
        before: the graph's nodes before backward, root first (kept alive).
        created: nodes that exist only in graphs built during backward (reentrant
            checkpoint recomputation), kept alive.
        calls: ``id(node) -> [(grad_inputs, grad_outputs), ...]`` for each run of a
            node in ``before``, each side a tuple of :func:`grad_stat` values.
    """

    before: list[Any]
    created: list[Any]
    calls: dict[int, list[tuple[tuple, tuple]]]


def reference_backward(loss: torch.Tensor) -> ReferenceBackward:
    """Run ``loss.backward()`` with a plain pre-hook and post-hook on every pre-existing node: what arrived at
    it (before its backward ran, which may change it in place) and what it sent on.

    Graphs built during backward are found by wrapping ``torch.autograd.backward``,
    which reentrant checkpointing calls on its recomputed outputs.
    """
    before = graph_nodes(loss.grad_fn)
    known = {id(n) for n in before}
    created: list[Any] = []
    calls: dict[int, list[tuple[tuple, tuple]]] = {id(n): [] for n in before}
    arrived: dict[int, tuple] = {}

    def arrive(node_key: int):
        def hook(grad_outputs):
            arrived[node_key] = tuple(grad_stat(g) for g in grad_outputs)

        return hook

    def record(node_key: int):
        def hook(grad_inputs, grad_outputs):
            received = arrived.pop(node_key, None) or tuple(grad_stat(g) for g in grad_outputs)
            calls[node_key].append((tuple(grad_stat(g) for g in grad_inputs), received))

        return hook

    handles = [node.register_prehook(arrive(id(node))) for node in before]
    handles += [node.register_hook(record(id(node))) for node in before]
    original_backward = torch.autograd.backward
    nested_depth = [0]

    def recording_backward(tensors, *args, **kwargs):
        if nested_depth[0] > 0:
            roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
            for root in roots:
                for node in graph_nodes(root.grad_fn):
                    if id(node) not in known:
                        known.add(id(node))
                        created.append(node)
        nested_depth[0] += 1
        try:
            return original_backward(tensors, *args, **kwargs)
        finally:
            nested_depth[0] -= 1

    torch.autograd.backward = recording_backward
    try:
        loss.backward()
    finally:
        torch.autograd.backward = original_backward
        for handle in handles:
            handle.remove()
    return ReferenceBackward(before, created, calls)


def backward_graph(loss: torch.Tensor) -> tuple[list[Any], list[Any]]:
    """``(nodes before backward, nodes created during backward)`` of ``loss.backward()``."""
    result = reference_backward(loss)
    return result.before, result.created


def canonical_order(root: Any, next_of: Callable[[Any], Iterable[Any]], key: Callable[[Any], Any] = id) -> list[Any]:
    """Nodes in breadth-first order from ``root``, visiting successors in edge order.

    Two isomorphic graphs whose edges are listed in the same order give the same
    sequence, which pairs their nodes one to one.
    """
    seen = {key(root)}
    order = [root]
    queue = collections.deque([root])
    while queue:
        node = queue.popleft()
        for successor in next_of(node):
            if successor is not None and key(successor) not in seen:
                seen.add(key(successor))
                order.append(successor)
                queue.append(successor)
    return order


def compare_with_hooks(result: Any, loss: torch.Tensor) -> ReferenceBackward:
    """Every node's stats in ``result`` (a Trace) equal an independent hooked backward of ``loss``
    (nodes paired by position in a canonical walk of both graphs)."""
    ref = reference_backward(loss)
    traced_order = canonical_order(
        result.nodes[0], lambda n: [None if j is None else result.nodes[j] for j in n.next], key=lambda n: n.id
    )
    reference_order = canonical_order(ref.before[0], lambda n: [f for f, _ in n.next_functions])
    assert [n.name for n in traced_order] == [n.name() for n in reference_order]
    for node, ref_node in zip(traced_order, reference_order):
        (ref_in, ref_out), = ref.calls[id(ref_node)]
        for stats, expected in ((node.grad_inputs, ref_in), (node.grad_outputs, ref_out)):
            assert len(stats) == len(expected), node.label()
            for stat, exp in zip(stats, expected):
                assert (stat is None) == (exp is None), node.label()
                if stat is not None:
                    assert (stat.shape, stat.dtype) == exp[:2], node.label()
                    assert stat.norm == pytest.approx(exp[2], rel=1e-4, abs=1e-6), node.label()
    return ref
