"""trace(): one forward and backward with a hook on every autograd graph node.

How it works (see AUTOGRAD_FACTS.md for the measurements behind each choice):

* Attribution. Module forward pre/post hooks record, at every module boundary,
  the autograd sequence number about to be assigned. A node created in forward
  belongs to the innermost module active when its ``_sequence_nr()`` was taken,
  which a binary search over those boundaries finds. This also places nodes made
  inside an op (``TBackward0`` of ``F.linear``) and custom Function nodes.
* Hooks. After forward, the graph is walked from the loss and a post-hook is put
  on every node. Hooks record shapes and dtypes, and queue each gradient's norm
  as a tensor on the gradient's device; all norms are read back in one transfer
  at the end, so there is no host sync per node.
* Nodes created during backward. Only Python code can create nodes while backward
  runs: a custom Function's backward (reentrant checkpointing recomputes its
  forward there). While such a node runs, a TorchFunctionMode hooks the nodes its
  ops create; they carry ``created_in``.
* Cleanup. Every hook is removed, each parameter's ``.grad`` and every module's
  training flag are restored in ``finally``, also when the user's code raises.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import math
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import replace
from typing import Any, Callable, Iterable, NamedTuple

from .errors import InternalError, ModelError, UserCodeError
from .loss import compute_loss
from .records import Gradcheck, GradStat, InputInfo, Meta, Node, NodeCall, Replay, Trace

_MISSING = object()
REPLAY_RTOL = 1e-6  # a replayed backward within this relative difference counts as reproducible

# One queued statistic: [shape, dtype, layout, index into the norm queue or None, the GradStat once built].
# Shared by every node that saw the same gradient tensor, so the record is built once too.
_PendingStat = list


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def named_modules_of(model: Any) -> list[tuple[str, Any]]:
    """The modules a model is made of, with their dotted names.

    An ``nn.Module`` is the root ``""``. A plain callable's modules are found
    where its code can reach them: a bound method's ``self``, the attributes of a
    callable object, closure cells, and the module-level globals of the file that
    defines the function (each named by its variable).
    """
    import torch.nn as nn

    if isinstance(model, nn.Module):
        return list(model.named_modules())
    owner = getattr(model, "__self__", None)
    if isinstance(owner, nn.Module):
        return list(owner.named_modules())
    function = getattr(model, "__func__", model)
    candidates: list[tuple[str, Any]] = []
    if not hasattr(function, "__code__") and hasattr(model, "__dict__"):
        candidates += list(vars(model).items())  # a callable object
    code = getattr(function, "__code__", None)
    for name, cell in zip(getattr(code, "co_freevars", ()), getattr(function, "__closure__", None) or ()):
        try:
            candidates.append((name, cell.cell_contents))
        except ValueError:  # an empty cell
            pass
    candidates += list((getattr(function, "__globals__", None) or {}).items())
    seen: set[int] = set()
    found: list[tuple[str, Any]] = []
    for root_name, root in candidates:
        if not isinstance(root, nn.Module) or root_name.startswith("__"):
            continue
        for sub_name, module in root.named_modules():
            if id(module) not in seen:
                seen.add(id(module))
                found.append((f"{root_name}.{sub_name}" if sub_name else root_name, module))
    return found


class _Leaf(NamedTuple):
    name: str
    tensor: Any
    module: str | None


def _named_leaves(model: Any, modules: list[tuple[str, Any]]) -> dict[int, _Leaf]:
    """``id(tensor) -> _Leaf`` for every parameter of the model.

    A plain callable's module-level leaf tensors that require grad count too,
    named by variable and owned by no module.
    """
    import torch

    leaves: dict[int, _Leaf] = {}
    for module_name, module in modules:
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) not in leaves:
                name = f"{module_name}.{param_name}" if module_name else param_name
                leaves[id(param)] = _Leaf(name, param, module_name)
    function = getattr(model, "__func__", model)
    for name, value in (getattr(function, "__globals__", None) or {}).items():
        if isinstance(value, torch.Tensor) and value.requires_grad and value.is_leaf and id(value) not in leaves:
            leaves[id(value)] = _Leaf(name, value, None)
    return leaves


def _prepare_inputs(args: tuple, kwargs: dict, input_grad: bool) -> tuple[tuple, dict, dict[int, str], list[InputInfo]]:
    """Give floating-point input tensors ``requires_grad`` (as new aliases) and name them."""
    import torch

    names: dict[int, str] = {}
    infos: list[InputInfo] = []

    def prepare(value: Any, name: str) -> Any:
        if isinstance(value, torch.Tensor):
            if input_grad and value.is_leaf and not value.requires_grad and (value.is_floating_point() or value.is_complex()):
                value = value.detach().requires_grad_()
            names[id(value)] = name
            infos.append(InputInfo(name, tuple(value.shape), _dtype_name(value.dtype)))
            return value
        if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
            return type(value)(prepare(item, f"{name}.{i}") for i, item in enumerate(value))
        if isinstance(value, dict):
            return {key: prepare(item, f"{name}.{key}") for key, item in value.items()}
        return value

    new_args = tuple(prepare(value, f"input:{i}") for i, value in enumerate(args))
    new_kwargs = {key: prepare(value, f"input:{key}") for key, value in kwargs.items()}
    return new_args, new_kwargs, names, infos


class _ModuleTracker:
    """Module forward hooks: the active-module stack and the sequence-number boundaries."""

    def __init__(self, modules: list[tuple[str, Any]]):
        import torch

        self._next_sequence_nr = torch._C._autograd._get_sequence_nr  # per thread, like _sequence_nr()
        self._modules = modules
        self._local = threading.local()
        self._handles: list[Any] = []
        self._record_thread: int | None = None
        self.bound_seqs: list[int] = []
        self.bound_modules: list[str | None] = []

    def _stack(self) -> list[str]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def current(self) -> str | None:
        """The innermost module running in this thread, or None."""
        stack = self._stack()
        return stack[-1] if stack else None

    def _mark(self) -> None:
        if threading.get_ident() == self._record_thread:
            self.bound_seqs.append(self._next_sequence_nr())
            self.bound_modules.append(self.current())

    def install(self) -> None:
        # Hooks inside a torch.compile'd module would break its graph (and change what the user
        # compiled): hook the compiled wrapper only, which runs eagerly, and attribute its nodes to it.
        import torch.nn as nn

        compiled = [name for name, module in self._modules if isinstance(getattr(module, "_orig_mod", None), nn.Module)]
        for name, module in self._modules:
            if any(_is_descendant(name, prefix) for prefix in compiled):
                continue
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._enter, name)))
            self._handles.append(
                module.register_forward_hook(functools.partial(self._exit, name), always_call=True)
            )

    def _enter(self, name: str, module: Any, args: Any) -> None:
        self._stack().append(name)
        self._mark()

    def _exit(self, name: str, module: Any, args: Any, output: Any) -> None:
        stack = self._stack()
        # Pairs are guaranteed by always_call; search anyway so one odd exit cannot shift the rest.
        for position in range(len(stack) - 1, -1, -1):
            if stack[position] == name:
                del stack[position:]
                break
        self._mark()

    def start_recording(self) -> None:
        self._record_thread = threading.get_ident()
        self._mark()

    def stop_recording(self) -> None:
        self._mark()
        self._record_thread = None

    def module_at(self, seq: int) -> str | None:
        """The innermost module that was active when sequence number ``seq`` was assigned."""
        position = bisect.bisect_right(self.bound_seqs, seq) - 1
        return self.bound_modules[position] if position >= 0 else None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _is_descendant(path: str, ancestor: str) -> bool:
    """Whether module ``path`` lies strictly inside module ``ancestor``."""
    if ancestor == "":
        return path != ""
    return path.startswith(ancestor + ".")


class _NodeState:
    __slots__ = (
        "node", "name", "seq", "module", "param", "next", "calls", "in_backward", "created_in", "variable", "forward",
        "source", "stack", "replay", "gradcheck",
    )

    def __init__(self, node: Any, in_backward: bool, is_leaf: bool):
        self.node = node
        self.name = node.name()
        self.variable = node.variable if is_leaf else None
        # AccumulateGrad's sequence number is 2**64-1: leaves have no creation order.
        self.seq = None if is_leaf else node._sequence_nr()
        self.module: str | None = None
        self.param: str | None = None
        self.next: list[int | None] = []  # ids of next_functions
        self.calls: list[tuple[int, tuple, tuple]] = []
        self.in_backward = in_backward
        self.created_in: int | None = None
        self.forward: _PendingStat | None = None
        self.source: tuple[str, int] | None = None
        self.stack: tuple | None = None
        self.replay: tuple | None = None
        self.gradcheck: Gradcheck | None = None


def _discovery_mode_class() -> type:
    from torch.overrides import TorchFunctionMode

    class _DiscoveryMode(TorchFunctionMode):
        """Hooks the graph nodes that ops create while a custom Function's backward runs."""

        def __init__(self, session: _TraceSession):
            super().__init__()
            self.session = session

        def __torch_function__(self, func, types, args=(), kwargs=None):
            output = func(*args, **(kwargs or {}))
            self.session.discover_in_backward(output)
            return output

    return _DiscoveryMode


_LIBRARY_PREFIXES: tuple[str, ...] | None = None


def _library_prefixes() -> tuple[str, ...]:
    """Folders whose frames are not the user's: torch and gradtrace."""
    global _LIBRARY_PREFIXES
    if _LIBRARY_PREFIXES is None:
        import os

        import torch

        _LIBRARY_PREFIXES = tuple(
            os.path.dirname(os.path.abspath(path)) + os.sep for path in (torch.__file__, __file__)
        )
    return _LIBRARY_PREFIXES


class _SiteRecorder:
    """Creation sites: the user's source line behind each node, recorded per op at sequence-number boundaries.

    An op that creates nodes gets an interval ``[first, next)`` of sequence numbers and the
    innermost frame outside torch and gradtrace; a node's site is found by its ``_sequence_nr()``.
    Nodes made inside an op (``TBackward0`` of ``F.linear``) share the op's site.
    """

    def __init__(self, stacks: bool = False) -> None:
        import torch

        self._next_sequence_nr = torch._C._autograd._get_sequence_nr
        self._skip = _library_prefixes()
        self.stacks = stacks
        self._sorted = False
        self.starts: list[int] = []
        self.sites: list[Any] = []

    def user_site(self, depth: int = 2) -> Any:
        """The innermost user frame as ``(path, line)``; with ``stacks``, every user frame (innermost first)
        as ``((path, line, function), ...)``, up to the call of ``trace()``."""
        frame = sys._getframe(depth)
        skip = self._skip
        while frame is not None and frame.f_code.co_filename.startswith(skip):
            frame = frame.f_back
        if frame is None:
            return None
        if not self.stacks:
            return (frame.f_code.co_filename, frame.f_lineno)
        stack = []
        while frame is not None and frame.f_code is not _TRACE_CODE:  # up to the model call, not the CLI above it
            code = frame.f_code
            if not code.co_filename.startswith(skip):
                stack.append((code.co_filename, frame.f_lineno, code.co_name))
            frame = frame.f_back
        return tuple(stack)

    def site_at(self, seq: int) -> Any:
        if not self._sorted:  # a Function applied inside an op is recorded before that op
            order = sorted(range(len(self.starts)), key=self.starts.__getitem__)
            self.starts = [self.starts[i] for i in order]
            self.sites = [self.sites[i] for i in order]
            self._sorted = True
        position = bisect.bisect_right(self.starts, seq) - 1
        return self.sites[position] if position >= 0 else None


def _forward_mode_class() -> type:
    from torch.compiler import is_compiling
    from torch.overrides import TorchFunctionMode

    class _ForwardMode(TorchFunctionMode):
        """Per op in forward: the creation site of the nodes it makes, and (optionally) its output's norm."""

        def __init__(self, session: _TraceSession, sites: _SiteRecorder | None):
            super().__init__()
            self.session = session
            self.sites = sites

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if is_compiling():  # torch.compile traces modes: stay out of its way (its region is one node)
                return func(*args, **(kwargs or {}))
            sites = self.sites
            if sites is None:
                output = func(*args, **(kwargs or {}))
            else:
                first = sites._next_sequence_nr()
                output = func(*args, **(kwargs or {}))
                after = sites._next_sequence_nr()
                if after != first:  # the op made nodes: they were made here
                    sites.starts += (first, after)
                    sites.sites += (sites.user_site(), None)
            if self.session.forward_stats:
                self.session.record_forward(output)
            return output

    return _ForwardMode


class _TraceSession:
    """The mutable state of one trace; turned into a frozen Trace by :meth:`finish`."""

    def __init__(self, leaves: dict[int, _Leaf], input_names: dict[int, str], tracker: _ModuleTracker):
        import torch

        self._torch = torch
        self._leaf_type = torch._C._functions.AccumulateGrad
        self._custom_type = torch.autograd.function.BackwardCFunction
        self._grad_enabled = torch.is_grad_enabled
        self._vector_norm = torch.linalg.vector_norm
        self._strided, self._float32, self._float64 = torch.strided, torch.float32, torch.float64
        self._dtype_names: dict[Any, str] = {}
        # id(tensor) -> (weak reference, pending stat): the tensor a node sends on is usually the very
        # object the next node receives, so each gradient's statistics are computed once
        self._seen: dict[int, tuple[Any, int, _PendingStat]] = {}
        self.leaves = leaves
        self.input_names = input_names
        self.tracker = tracker
        self.states: list[_NodeState] = []
        # id(node) -> node id; the states hold every node alive, so ids are not reused meanwhile
        self.index: dict[int, int] = {}
        self.handles: list[Any] = []
        self.norms: list[Any] = []
        self.order = 0
        self.errors: list[str] = []
        self.running_custom: list[int] = []
        self.modes: list[Any] = []
        self._mode_class = _discovery_mode_class()
        self.forward_stats = False
        self.sites: _SiteRecorder | None = None
        self.replay = False
        self._replaying = False
        # id(custom Function node) -> (node, class, args, kwargs, tensor mask), recorded in forward for
        # --gradcheck (the arguments) and --replay (which arguments were tensors)
        self.custom_calls: dict[int, tuple] = {}
        # id(node) -> (node, pending stat of the forward value it produced); the node is kept so its id stays its own
        self.forward_values: dict[int, tuple[Any, _PendingStat]] = {}
        self.param_grads: list[tuple[str, _PendingStat]] = []

    # --- discovery -------------------------------------------------------------
    def discover(self, roots: Iterable[Any], in_backward: bool = False) -> None:
        """Hook every node reachable from ``roots`` that is not hooked yet."""
        queue = deque()
        for root in roots:
            if root is not None and id(root) not in self.index:
                self._add(root, in_backward)
                queue.append(root)
        while queue:
            node = queue.popleft()
            state = self.states[self.index[id(node)]]
            for next_node, _ in node.next_functions:
                if next_node is None:
                    state.next.append(None)
                    continue
                if id(next_node) not in self.index:
                    self._add(next_node, in_backward)
                    queue.append(next_node)
                state.next.append(self.index[id(next_node)])

    def _add(self, node: Any, in_backward: bool) -> None:
        node_id = len(self.states)
        state = _NodeState(node, in_backward, isinstance(node, self._leaf_type))
        self.index[id(node)] = node_id
        self.states.append(state)
        if in_backward:
            state.created_in = self.running_custom[-1] if self.running_custom else None
        if self.forward_stats:
            if state.variable is not None:  # a leaf's forward value is the tensor itself
                with self._torch.no_grad():
                    state.forward = self._queue_stat(state.variable.detach())
            else:
                recorded = self.forward_values.get(id(node))
                state.forward = None if recorded is None else recorded[1]
        if state.variable is not None:
            leaf = self.leaves.get(id(state.variable))
            if leaf is not None:
                state.param, state.module = leaf.name, leaf.module
            else:
                state.param = self.input_names.get(id(state.variable))
        elif in_backward:
            state.module = self.tracker.current()
        self.handles.append(node.register_hook(functools.partial(self._on_run, node_id)))
        if isinstance(node, self._custom_type):
            self.handles.append(node.register_prehook(functools.partial(self._on_custom_start, node_id)))

    def record_forward(self, output: Any) -> None:
        """Queue the norm of an op's output tensors under the node that produced them."""
        try:
            grouped: dict[int, list[Any]] = {}
            for tensor in _tensors_in(output, self._torch.Tensor):
                grad_fn = tensor.grad_fn
                if grad_fn is not None:
                    grouped.setdefault(id(grad_fn), [grad_fn]).append(tensor)
            with self._torch.no_grad():
                for key, (grad_fn, *tensors) in grouped.items():
                    self.forward_values[key] = (grad_fn, self._queue_values(tensors))
        except Exception:  # never break the user's forward; report after it
            self.errors.append(traceback.format_exc())

    def _queue_values(self, tensors: list[Any]) -> _PendingStat | None:
        """One statistic for the outputs of one node (a multi-output op has several)."""
        if len(tensors) == 1:
            return self._queue_stat(tensors[0].detach())
        stats = [self._queue_stat(t.detach()) for t in tensors]
        torch = self._torch
        norms = [self.norms[stat[3]] for stat in stats if stat is not None and stat[3] is not None]
        if len(norms) != len(stats):
            return None
        self.norms.append(torch.linalg.vector_norm(torch.stack([n.to(torch.float32) for n in norms])))
        first = stats[0]
        return [(sum(math.prod(st[0]) for st in stats),), first[1], first[2], len(self.norms) - 1, None]

    def discover_in_backward(self, output: Any) -> None:
        try:
            roots = [t.grad_fn for t in _tensors_in(output, self._torch.Tensor) if t.grad_fn is not None]
            if roots:
                self.discover(roots, in_backward=True)
        except Exception:  # never break the user's backward; report after it
            self.errors.append(traceback.format_exc())

    # --- hooks -------------------------------------------------------------------
    def _on_custom_start(self, node_id: int, grad_outputs: Any) -> None:
        try:
            mode = self._mode_class(self)
            mode.__enter__()
            self.modes.append(mode)
            self.running_custom.append(node_id)
        except Exception:  # never break the user's backward; report after it
            self.errors.append(traceback.format_exc())

    def _end_custom(self, node_id: int) -> None:
        if self.running_custom and self.running_custom[-1] == node_id:
            self.running_custom.pop()
            self.modes.pop().__exit__(None, None, None)

    def _on_run(self, node_id: int, grad_inputs: tuple, grad_outputs: tuple) -> None:
        if self._replaying:  # a replayed backward that runs graph nodes of its own: not part of the trace
            return None
        try:
            order = self.order
            self.order = order + 1
            if self.running_custom and self.running_custom[-1] == node_id:
                self._end_custom(node_id)
            stat = self._stat
            if self._grad_enabled():  # backward(create_graph=True): keep statistics out of the graph
                with self._torch.no_grad():
                    record = (order, [stat(g) for g in grad_inputs], [stat(g) for g in grad_outputs])
            else:
                record = (order, [stat(g) for g in grad_inputs], [stat(g) for g in grad_outputs])
            state = self.states[node_id]
            state.calls.append(record)
            if self.replay and state.replay is None:
                state.replay = self._replay(state, grad_inputs, grad_outputs)
        except Exception:  # never break the user's backward; report after it
            self.errors.append(traceback.format_exc())
        return None

    def _replay(self, state: _NodeState, grad_inputs: tuple, grad_outputs: tuple) -> tuple:
        """Run the node's backward again from the gradients it received; queue the largest difference.

        Returns ``(difference position, scale position, note)``; positions index the norm queue.
        """
        torch = self._torch
        node = state.node
        if state.variable is not None:
            return (None, None, "AccumulateGrad writes .grad: not replayed")
        if state.name == "CheckpointFunctionBackward":
            return (None, None, "recomputes its forward and runs a backward of its own: not replayed")
        self._replaying = True
        try:
            with torch.no_grad():
                if isinstance(node, self._custom_type):
                    again = node.apply(*grad_outputs)
                    again = again if isinstance(again, tuple) else (again,)
                    call = self.custom_calls.get(id(node))
                    if call is not None and call[0] is node:  # keep the gradients of tensor arguments
                        again = tuple(g for g, is_tensor in zip(again, call[4]) if is_tensor)
                else:
                    again = node(*grad_outputs)
                    again = again if isinstance(again, tuple) else (again,)
                if len(again) != len(grad_inputs):
                    return (None, None, f"replay gave {len(again)} gradients, the engine {len(grad_inputs)}")
                diffs, scales = [], []
                for replayed, original in zip(again, grad_inputs):
                    if original is None or replayed is None:
                        if (original is None) != (replayed is None):
                            return (None, None, "replay gave None where the engine gave a gradient, or the reverse")
                        continue
                    if original.is_sparse:
                        replayed, original = replayed.to_dense(), original.to_dense()
                    # what the engine does to a node's outputs before passing them on (validate_outputs):
                    # reduce a broadcast gradient to the input's shape, cast to its dtype
                    if replayed.shape != original.shape:
                        replayed = replayed.sum_to_size(original.shape)
                    if replayed.dtype != original.dtype:
                        replayed = replayed.to(original.dtype)
                    diffs.append((replayed - original).abs().max().to(torch.float64))
                    scales.append(original.abs().max().to(torch.float64))
                if not diffs:
                    return (None, None, "no gradient to compare")
                self.norms.append(torch.stack(diffs).max())
                self.norms.append(torch.stack(scales).max())
                return (len(self.norms) - 2, len(self.norms) - 1, None)
        except Exception as exc:  # the node refused to run again: that is the finding
            return (None, None, f"could not run again: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        finally:
            self._replaying = False

    def _stat(self, grad: Any) -> _PendingStat | None:
        """The pending statistics of a gradient, computed once per tensor object."""
        if grad is None:
            return None
        seen = self._seen.get(id(grad))
        # the same object with the same version: the engine accumulates gradients in place
        if seen is not None and seen[0]() is grad and seen[1] == grad._version:
            return seen[2]
        pending = self._queue_stat(grad)
        self._seen[id(grad)] = (weakref.ref(grad), grad._version, pending)
        return pending

    def _queue_stat(self, grad: Any) -> _PendingStat | None:
        """Record a tensor's shape and dtype; queue its norm as a device tensor (no host sync)."""
        if grad is None:
            return None
        dtype = grad.dtype
        dtype_name = self._dtype_names.get(dtype)
        if dtype_name is None:
            dtype_name = self._dtype_names[dtype] = _dtype_name(dtype)
        layout = None
        try:
            if grad.layout is self._strided:
                values = grad
            else:
                layout = str(grad.layout).removeprefix("torch.")
                # an uncoalesced sparse tensor's values() repeat indices: coalesce for the right norm
                values = grad.coalesce().values() if grad.is_sparse else grad.values()
            if dtype is self._float64 or values.is_complex():
                norm = self._vector_norm(values)
            else:  # float32 or wider, so bf16/fp16 gradients do not overflow the norm
                norm = self._vector_norm(values, dtype=self._float32)
            self.norms.append(norm)
            position = len(self.norms) - 1
        except Exception:  # an exotic tensor subclass: keep shape and dtype without a norm
            position = None
        return [grad.shape, dtype_name, layout, position, None]

    # --- result ------------------------------------------------------------------
    def _read_norms(self) -> list[float | None]:
        """All queued norms as floats, in one transfer per device."""
        torch = self._torch
        values: list[float | None] = [None] * len(self.norms)
        by_device: dict[Any, list[int]] = {}
        for position, norm in enumerate(self.norms):
            by_device.setdefault(norm.device, []).append(position)
        for positions in by_device.values():
            try:
                same_dtype = [self.norms[p].to(torch.float64) for p in positions] if _mixed_dtypes(
                    self.norms, positions
                ) else [self.norms[p] for p in positions]
                stacked = torch.stack(same_dtype).cpu().tolist()
            except Exception:  # tensor subclasses that refuse to stack: one by one
                stacked = []
                for p in positions:
                    try:
                        stacked.append(float(self.norms[p]))
                    except Exception:
                        stacked.append(None)
            for p, value in zip(positions, stacked):
                values[p] = value
        return values

    def run_gradchecks(self) -> None:
        """Check each custom Function node recorded in forward (after backward: no hook is left)."""
        from .gradcheck import check

        for state in self.states:
            call = self.custom_calls.get(id(state.node)) if state.node is not None else None
            if call is not None and call[0] is state.node:
                _, function_class, args, kwargs, _ = call
                state.gradcheck = check(function_class, args, kwargs)
        self.custom_calls.clear()

    def record_param_grads(self) -> None:
        """Queue each parameter's ``.grad`` as backward left it (under DDP: averaged across ranks)."""
        with self._torch.no_grad():
            for leaf in self.leaves.values():
                if leaf.tensor.grad is not None:
                    self.param_grads.append((leaf.name, self._queue_stat(leaf.tensor.grad)))

    def finish(self, meta: Meta, loss: Any) -> Trace:
        """Read the statistics (and the loss value) back in one transfer and build the frozen Trace."""
        if self.errors:
            raise InternalError("a gradtrace hook failed during backward:\n" + self.errors[0])
        module_at, site_at = self.tracker.module_at, None if self.sites is None else self.sites.site_at
        stacks = self.sites is not None and self.sites.stacks
        for state in self.states:  # creators come before what they create
            if state.seq is not None and not state.in_backward:
                state.module = module_at(state.seq)
                if site_at is not None:
                    site = site_at(state.seq)
                    if site is not None and stacks:
                        state.stack = site
                        site = site[0][:2]
                    state.source = site
            elif state.in_backward and state.seq is not None and state.module is None and state.created_in is not None:
                # e.g. a checkpointed function's own ops: they belong where the checkpoint was called
                state.module = self.states[state.created_in].module
        totals = {}
        for node_id, state in enumerate(self.states):
            if len(state.calls) > 1 and state.variable is not None and state.variable.grad is not None:
                with self._torch.no_grad():
                    totals[node_id] = self._queue_stat(state.variable.grad)

        keep = self._kept_ids()
        new_id = {old: new for new, old in enumerate(keep)}
        self.norms.append(loss.detach().reshape(()).to(self.norms[0].dtype if self.norms else loss.dtype))
        norms = self._read_norms()
        meta = replace(meta, loss=norms.pop())

        def stat(pending: _PendingStat | None) -> GradStat | None:
            if pending is None:
                return None
            record = pending[4]
            if record is None:
                shape, dtype, layout, position, _ = pending
                record = pending[4] = GradStat(tuple(shape), dtype, None if position is None else norms[position], layout)
            return record

        states = self.states
        renumber = new_id.get if len(keep) != len(states) else None  # None: every node kept, ids unchanged
        creation = sorted((old for old in keep if states[old].seq is not None), key=lambda old: (states[old].in_backward, states[old].seq))
        created = {old: rank for rank, old in enumerate(creation)}
        sites: dict[Any, str | None] = {None: None}
        nodes = []
        for old in keep:
            state = states[old]
            calls = state.calls
            if calls:
                order, gi, go = calls[0]
                grad_inputs, grad_outputs = tuple(map(stat, gi)), tuple(map(stat, go))
            else:
                order = grad_inputs = grad_outputs = None
            if old in totals:
                grad_outputs = (stat(totals[old]),)
            every_call = (
                tuple(NodeCall(o, tuple(map(stat, i)), tuple(map(stat, g))) for o, i, g in calls) if len(calls) > 1 else ()
            )
            source = sites.get(state.source, _MISSING)
            if source is _MISSING:
                source = sites[state.source] = _format_site(state.source)
            nodes.append(
                Node.build(
                    id=renumber(old) if renumber else old,
                    name=state.name,
                    module=state.module,
                    param=state.param,
                    order=order,
                    next=tuple(None if n is None else renumber(n) for n in state.next) if renumber else tuple(state.next),
                    grad_inputs=grad_inputs,
                    grad_outputs=grad_outputs,
                    created=created.get(old),
                    created_in=None if state.created_in is None else (renumber(state.created_in) if renumber else state.created_in),
                    calls=every_call,
                    forward=stat(state.forward),
                    source=source,
                    stack=None if state.stack is None else tuple(
                        f"{_format_site(frame[:2])} in {frame[2]}" for frame in state.stack
                    ),
                    replay=_replay_record(state.replay, norms),
                    gradcheck=state.gradcheck,
                )
            )
        with_grad = {
            self.states[old].param for old in keep if self.states[old].calls and self.states[old].param is not None
        }
        missing = tuple(
            leaf.name for leaf in self.leaves.values() if leaf.tensor.requires_grad and leaf.name not in with_grad
        )
        param_grads = tuple(sorted((name, stat(pending)) for name, pending in self.param_grads))
        return Trace(meta=meta, nodes=tuple(nodes), params_without_grad=missing, param_grads=param_grads)

    def _kept_ids(self) -> list[int]:
        """Forward nodes, plus backward-created nodes that ran or are reachable from one that ran.

        A non-reentrant checkpoint's recompute builds a throwaway graph that never
        runs; it is left out.
        """
        keep = {i for i, s in enumerate(self.states) if not s.in_backward}
        queue = deque(i for i, s in enumerate(self.states) if s.in_backward and s.calls)
        while queue:
            node_id = queue.popleft()
            if node_id in keep:
                continue
            keep.add(node_id)
            queue.extend(n for n in self.states[node_id].next if n is not None)
        return sorted(keep)

    def close(self) -> None:
        """Remove every hook and leave no mode behind; drop references to the graph."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        while self.modes:
            mode = self.modes.pop()
            try:
                mode.__exit__(None, None, None)
            except Exception:  # the mode was pushed on another thread; it ends with that thread's task
                pass
        self.running_custom.clear()

    def release(self) -> None:
        """Drop every reference to the graph, the loss's node first.

        Freed root first, each node's inputs are still held here, so every free is shallow; freed
        from the leaves up, a 100k-node chain would be destroyed by one deep recursion (a crash).
        """
        self.forward_values.clear()  # these hold nodes in forward order: leaves first
        self.custom_calls.clear()
        for state in self.states:
            state.node = None
            state.variable = None
            state.next = []
        self.index.clear()
        self.norms.clear()
        self._seen.clear()


def _replay_record(pending: tuple | None, norms: list[float | None]) -> Replay | None:
    if pending is None:
        return None
    diff_position, scale_position, note = pending
    if diff_position is None:
        return Replay(None, None, None if note and note.endswith("not replayed") else False, note)
    diff, scale = norms[diff_position], norms[scale_position]
    if diff is None or scale is None:
        return Replay(diff, None, None, "the difference could not be read")
    relative = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
    reproducible = math.isfinite(relative) and relative <= REPLAY_RTOL
    return Replay(diff, relative, reproducible, None)


def _format_site(site: tuple[str, int] | None) -> str | None:
    """``path:line``, the path relative to the working folder when it lies inside it."""
    if site is None:
        return None
    path, line = site
    return f"{_display_path(path)}:{line}"


@functools.lru_cache(maxsize=1024)
def _display_path(path: str) -> str:
    import os

    try:
        relative = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if relative.startswith("..") else relative


def _mixed_dtypes(tensors: list[Any], positions: list[int]) -> bool:
    first = tensors[positions[0]].dtype
    return any(tensors[p].dtype != first for p in positions)


def _tensors_in(value: Any, tensor_type: type) -> list[Any]:
    if isinstance(value, tensor_type):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors_in(item, tensor_type)]
    return []


def _describe_model(model: Any) -> str:
    return getattr(model, "__qualname__", None) or type(model).__name__


def trace(
    model: Callable[..., Any],
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    loss_fn: Callable[[Any], Any] | None = None,
    loss_reduction: str = "sum",
    input_grad: bool = True,
    train: bool | None = None,
    target: str | None = None,
    seed: int | None = None,
    forward_stats: bool = False,
    sources: bool = True,
    replay: bool = False,
    gradcheck: bool = False,
    stacks: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> Trace:
    """Run ``model(*args, **kwargs)`` and its backward with a hook on every graph node.

    Args:
        model: an ``nn.Module`` or any callable.
        args: positional inputs (a single tensor is taken as one argument).
        kwargs: keyword inputs.
        loss_fn: ``loss_fn(output)`` returning the scalar to differentiate; without
            it the output is reduced by the documented rule (scalar output as is,
            ``.loss`` / ``["loss"]``, else the sum of each floating output's sum).
        loss_reduction: "sum" or "mean" for that fallback rule.
        input_grad: give floating-point input tensors ``requires_grad`` (through
            new aliases; the caller's tensors are not changed) so their gradients
            appear as ``input:N`` leaves.
        train: ``True``/``False`` to run in train/eval mode; ``None`` keeps the mode
            the model is in. The mode is restored afterwards.
        target: how to name the model in ``meta.target``.
        seed: recorded in ``meta.seed`` (seeding is the caller's job).
        forward_stats: also record, per node, the norm of the forward value its op
            produced (``Node.forward``), for comparing runs or ranks. Costs a
            Python call per op in forward, so it is off by default.
        rank, world_size: recorded in ``meta`` (set under torchrun).
        sources: record each node's creation site, the user's source line whose op
            made it (``Node.source``): a frame walk per op in forward.
        replay: run each node's backward again inside its hook, from the gradients
            it received, and compare with what the engine produced (``Node.replay``).
        gradcheck: check every custom ``autograd.Function``'s backward numerically
            in float64 on the inputs it was called with (``Node.gradcheck``).
        stacks: with ``sources``, record every user frame behind each node
            (``Node.stack``), not only the innermost.

    Returns:
        A frozen :class:`~tracer_cli.records.Trace` of plain numbers and strings.

    Raises:
        UserCodeError: the model, the loss function or a custom backward raised.
        ModelError: the loss does not require grad, or cannot be formed.

    Each parameter's ``.grad`` is left as it was found: gradients of this backward
    are recorded, then discarded.
    """
    import torch

    started = time.perf_counter()
    if isinstance(args, torch.Tensor) or not isinstance(args, (tuple, list)):
        args = (args,)
    args, kwargs, input_names, input_infos = _prepare_inputs(tuple(args), dict(kwargs or {}), input_grad)
    modules = named_modules_of(model)
    leaves = _named_leaves(model, modules)
    tracker = _ModuleTracker(modules)
    session = _TraceSession(leaves, input_names, tracker)
    training = [(module, module.training) for _, module in modules]
    saved_grads: dict[int, tuple[Any, Any]] = {}
    # A trace allocates many small objects while the graph holds many more: generational
    # collections would walk them all, again and again (measured: half the trace time).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        if train is not None:
            for name, module in modules:
                if "." not in name:  # the roots; .train() recurses and honours overrides
                    module.train(train)
        tracker.install()
        tracker.start_recording()
        session.forward_stats = forward_stats
        session.sites = _SiteRecorder(stacks) if sources or stacks else None
        session.replay = replay
        wants_mode = forward_stats or session.sites is not None
        with contextlib.ExitStack() as forward_context:
            if wants_mode:
                forward_context.enter_context(_forward_mode_class()(session, session.sites))
            if gradcheck or replay or session.sites is not None:
                from .gradcheck import recording_calls

                calls = session.custom_calls if gradcheck or replay else None
                forward_context.enter_context(recording_calls(calls, keep_args=gradcheck, sites=session.sites))
            try:
                output = model(*args, **kwargs)
            except Exception as exc:
                phase = "the model's forward" + _failing_module(exc, modules)
                raise UserCodeError(phase, exc, hint=_input_hint(input_infos)) from exc
            loss, loss_rule = compute_loss(output, loss_fn, loss_reduction)
        tracker.stop_recording()
        forward_done = time.perf_counter()
        if loss.grad_fn is None:
            raise ModelError(
                f"the loss ({loss_rule}) does not require grad: nothing to trace",
                hint="check that parameters or inputs require grad and that forward does not run under "
                "torch.no_grad() or .detach() the output",
            )
        del output
        session.discover([loss.grad_fn])
        for leaf in leaves.values():
            saved_grads[id(leaf.tensor)] = (leaf.tensor, leaf.tensor.grad)
        for state in session.states:
            if state.variable is not None and id(state.variable) not in saved_grads:
                saved_grads[id(state.variable)] = (state.variable, state.variable.grad)
        for tensor, _ in saved_grads.values():
            tensor.grad = None
        backward_start = time.perf_counter()
        try:
            loss.backward()
        except Exception as exc:
            if session.errors:
                raise InternalError("a gradtrace hook failed during backward:\n" + session.errors[0]) from exc
            raise UserCodeError("backward", exc) from exc
        backward_done = time.perf_counter()
        session.close()
        session.record_param_grads()
        if gradcheck:
            session.run_gradchecks()
        meta = Meta(
            target=target or _describe_model(model),
            torch=torch.__version__,
            device=str(loss.device),
            loss=None,  # read back with the statistics
            loss_rule=loss_rule,
            inputs=tuple(input_infos),
            seed=seed,
            rank=rank,
            world_size=world_size,
            training=_training_flag(modules),
            module_types={name: type(module).__name__ for name, module in modules},
        )
        result = session.finish(meta, loss)
        timings = {
            "forward": forward_done - started,
            "backward": backward_done - backward_start,
            "total": time.perf_counter() - started,
        }
        return result.with_meta(timings_s=timings)
    finally:
        tracker.stop_recording()
        session.close()
        tracker.remove()
        for tensor, grad in saved_grads.values():
            tensor.grad = grad
        for module, flag in training:
            module.training = flag
        loss = None  # so that the session holds the last reference to the graph's root
        session.release()
        if gc_was_enabled:
            gc.enable()


def _training_flag(modules: list[tuple[str, Any]]) -> bool | None:
    return modules[0][1].training if modules else None


def _failing_module(exc: BaseException, modules: list[tuple[str, Any]]) -> str:
    """`` in module 'fc1' (Linear)``: the innermost module whose forward was running when ``exc`` was raised."""
    names = {id(module): name for name, module in modules}
    found = ""
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            name = names[id(owner)]
            found = f" in module {name!r} ({type(owner).__name__})" if name else f" ({type(owner).__name__})"
        tb = tb.tb_next
    return found


def _input_hint(infos: list[InputInfo]) -> str | None:
    if not infos:
        return None
    shapes = ", ".join(f"{i.name} {i.dtype}{list(i.shape)}" for i in infos)
    return f"the model was called with {shapes}; check the input specs (-i) or example_inputs()"


_TRACE_CODE = trace.__code__
