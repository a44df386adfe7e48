"""trace(): one forward and backward with a hook on every autograd graph node.

How it works (see AUTOGRAD_FACTS.md for the measurements behind each choice):

* Attribution. Module forward pre/post hooks record, at every module boundary,
  the autograd sequence number about to be assigned. A node created in forward
  belongs to the innermost module active when its ``_sequence_nr()`` was taken,
  which a lookup over those boundaries finds. This also places nodes made
  inside an op (``TBackward0`` of ``F.linear``) and custom Function nodes. Nodes
  that a backward run in forward made in another thread (a GPU's engine thread)
  are numbered as made where it was called (_renumbering_inner_backwards).
  Modules of the model that run in another thread (a thread pool's experts) number
  their nodes by that thread's counter: each such call claims the nodes it made
  by a walk back from its output (_ModuleTracker._left_elsewhere).
* Creation sites, the same way: line events of the user's frames (``sys.settrace``)
  mark the sequence number each line's ops take.
* Hooks. After forward, the graph is walked from the loss and a post-hook is put
  on every node: one hook shared by every ordinary node, which asks the engine
  which node runs (torch's registration callback, which makes a RemovableHandle per
  hook, is replaced meanwhile: see _node_hooks). A hook only logs what the node
  received and sent. A large gradient's norm is queued at once (a BLAS dot
  product on the CPU, read at once and taken again scaled where its squares left
  the dtype's range; on a device, a norm in float64, which needs no read), and
  the gradient is not kept; small gradients wait, and their norms are taken in
  batches, one stack and one norm per shape and dtype, before a custom
  Function's backward runs (Python that might change them in place) and at the
  end. All values are read back in one
  transfer per device at the end, so there is no host sync per node (a CPU
  tensor's norm taken alone is read at once: no device to wait for).
* Nodes created during backward. Only Python code can create nodes while backward
  runs: a custom Function's backward (reentrant checkpointing recomputes its
  forward there). While such a node runs, a TorchFunctionMode hooks the nodes its
  ops create; they carry ``created_in``.
* Cleanup. Every hook and the trace function are removed (torch's registration
  callback is put back as soon as the hooks are on), each parameter's ``.grad``
  and every module's training flag are restored in ``finally``, also when the user's
  code raises.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import dataclasses
import functools
import gc
import inspect
import itertools
import math
import operator
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, NamedTuple

from .errors import (
    USER_CODE_ERRORS,
    InternalError,
    ModelError,
    UsageError,
    UserCodeError,
    first_line,
    message_of,
)
from .inputs import tensors_in
from .loss import compute_loss
from .records import Gradcheck, GradStat, InputInfo, Meta, Node, NodeCall, Replay, Trace

_MISSING = object()
REPLAY_RTOL = 1e-6  # a replayed backward within this relative difference counts as reproducible

def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _reachable(model: Any) -> list[tuple[str, Any]]:
    """Named values a plain callable's code can reach, where its modules and leaf tensors are looked for:
    a ``functools.partial``'s arguments and function, a bound method's ``self`` (its attributes), a
    callable object's attributes, closure cells, and the module-level globals its code names. The code
    followed: the function's own (through decorators, ``__wrapped__``), the functions, nested functions
    and lambdas it defines, and the functions and classes' methods of the same file it names or holds in
    closures, transitively. Not every global of its file: a notebook's or a test file's other models are
    not part of it."""
    import types

    found: list[tuple[str, Any]] = []
    while isinstance(model, functools.partial):
        found += [(f"arg{i}", value) for i, value in enumerate(model.args)] + list(model.keywords.items())
        model = model.func
    owner = getattr(model, "__self__", None)
    if owner is not None and not isinstance(owner, types.ModuleType) and hasattr(owner, "__dict__"):
        found += list(vars(owner).items())
    function = getattr(model, "__func__", model)
    if not hasattr(function, "__code__") and hasattr(function, "__dict__"):  # a callable object
        found += list(vars(function).items())
        function = getattr(type(function).__call__, "__func__", type(function).__call__)
    found += _closure(function)
    function = _unwrapped(function)
    module_globals = getattr(function, "__globals__", None)
    if getattr(function, "__code__", None) is None or not isinstance(module_globals, dict):
        return found
    file_name = module_globals.get("__name__")
    codes: list[Any] = []
    seen: set[Any] = set()
    names: dict[str, Any] = {}

    def follow(value: Any) -> None:
        """Queue the code a value runs, where it is the same file's: a function's, a class's methods'."""
        value = _unwrapped(value.__func__ if isinstance(value, (staticmethod, classmethod)) else value)
        if isinstance(value, type):
            if getattr(value, "__module__", None) == file_name and value not in seen:
                seen.add(value)
                for member in list(vars(value).values()):
                    follow(member)
            return
        code = getattr(value, "__code__", None)
        if code is None or code in seen or getattr(value, "__globals__", None) is not module_globals:
            return
        seen.add(code)
        codes.append(code)
        for name, content in _closure(value):
            if name not in names:
                names[name] = content
            follow(content)

    follow(function)
    while codes:  # the names each code object loads; its nested code objects
        current = codes.pop()
        for const in current.co_consts:
            if isinstance(const, types.CodeType) and const not in seen:
                seen.add(const)
                codes.append(const)
        for name in _global_names(current):
            if name not in names and name in module_globals:
                names[name] = module_globals[name]
                follow(names[name])
    follow = None  # type: ignore[assignment]  # it refers to itself: no cycle left for the garbage collector
    taken = {name for name, _ in found}
    return found + [(name, value) for name, value in names.items() if name not in taken]


def _closure(function: Any) -> list[tuple[str, Any]]:
    """A function's closure cells, by the name of the variable each holds (empty ones left out)."""
    code = getattr(function, "__code__", None)
    cells = []
    for name, cell in zip(getattr(code, "co_freevars", ()), getattr(function, "__closure__", None) or ()):
        try:
            cells.append((name, cell.cell_contents))
        except ValueError:  # an empty cell
            pass
    return cells


def _unwrapped(function: Any) -> Any:
    """The function a decorator wrapped (``functools.wraps`` sets ``__wrapped__``), or the function itself."""
    try:
        return inspect.unwrap(function) if callable(function) else function
    except ValueError:  # a cycle of __wrapped__
        return function


@functools.lru_cache(maxsize=4096)
def _global_names(code: Any) -> tuple[str, ...]:
    """The global names a code object loads (``co_names`` also holds attribute names: ``self.model``)."""
    import dis

    return tuple(dict.fromkeys(op.argval for op in dis.get_instructions(code) if op.opname in ("LOAD_GLOBAL", "LOAD_NAME")))


def named_modules_of(model: Any) -> list[tuple[str, Any]]:
    """The modules a model is made of, with their dotted names.

    An ``nn.Module`` is the root ``""`` (also behind a ``functools.partial``, or as a bound method's
    ``self``). A plain callable's modules are found where its code can reach them (see
    :func:`_reachable`), each named by its variable or attribute.
    """
    import torch.nn as nn

    root = model
    while isinstance(root, functools.partial) and not root.args and not root.keywords:
        root = root.func
    if isinstance(root, functools.partial) and isinstance(root.func, nn.Module):
        root = root.func  # partial(model, scale=2.0): the arguments are not part of it
    if isinstance(root, nn.Module):
        return list(root.named_modules())
    owner = getattr(root, "__self__", None)
    if isinstance(owner, nn.Module):
        return list(owner.named_modules())
    seen: set[int] = set()
    found: list[tuple[str, Any]] = []
    for root_name, value in _reachable(model):
        if not isinstance(value, nn.Module) or root_name.startswith("__"):
            continue
        for sub_name, module in value.named_modules():
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

    A plain callable's leaf tensors that require grad, where its code can reach them (module-level
    globals it names, closure cells), count too, named by variable and owned by no module.
    """
    import torch

    leaves: dict[int, _Leaf] = {}
    for module_name, module in modules:
        for param_name, param in module._parameters.items():  # named_parameters(recurse=False), without its generators
            if param is not None and id(param) not in leaves:
                name = f"{module_name}.{param_name}" if module_name else param_name
                leaves[id(param)] = _Leaf(name, param, module_name)
    if not isinstance(model, torch.nn.Module):
        for name, value in _reachable(model):
            if isinstance(value, torch.Tensor) and value.requires_grad and value.is_leaf and id(value) not in leaves:
                leaves[id(value)] = _Leaf(name, value, None)
    return leaves


def _saved_buffers(modules: list[tuple[str, Any]]) -> list[tuple[Any, str, Any, Any]]:
    """``(module, name, buffer, copy)`` for every buffer of the model, copied before forward runs
    (BatchNorm's running statistics are updated by a forward in train mode), for
    :func:`_restore_buffers`. Copied before forward, not as each module runs: small tensors allocated
    between the activations and kept to the end make backward's allocations slower."""
    from torch.nn.parameter import is_lazy

    saved = []
    copies: dict[int, Any] = {}  # one copy of a buffer that several modules hold, each put back
    for _, module in modules:
        for name, buffer in module._buffers.items():
            # a lazy module's buffer has no value until its first call sets its shape (and keeps it)
            if buffer is not None and not is_lazy(buffer):
                copy = copies.get(id(buffer))
                if copy is None:
                    copy = copies[id(buffer)] = buffer.detach().clone()
                saved.append((module, name, buffer, copy))
    return saved


def _restore_buffers(saved: list[tuple[Any, str, Any, Any]]) -> None:
    """Put back every buffer that a module changed, or replaced, while the trace ran."""
    import torch

    with torch.no_grad():
        for module, name, buffer, copy in saved:
            try:
                buffers = module._buffers  # (a TorchScript module's is a mapping without get())
                if (buffers[name] if name in buffers else None) is not buffer:
                    buffers[name] = buffer
                # every buffer copied back, not only those that differ: the version counter cannot tell
                # (batch_norm updates its running statistics in place without bumping it), and a comparison
                # reads a GPU's answer back, a synchronisation per buffer. On the CPU, after a forward in train
                # mode (every BatchNorm buffer differs), copying alone is faster: ResNet-18's 60 buffers 0.30
                # against 0.42 ms; in eval mode (none differs) it costs a little more, 0.20 against 0.13.
                # Copied through .data, which leaves the version counter as it is: a backward of the caller's
                # still pending (trace() called between their forward and backward) saved these very buffers
                if buffer.layout is not torch.strided:
                    buffer.copy_(copy)  # (a sparse tensor's .data is not the same tensor)
                else:
                    buffer.data.copy_(copy)
            except Exception:  # e.g. an inference tensor, which cannot be written outside inference mode
                pass


def _prepare_inputs(args: tuple, kwargs: dict, input_grad: bool) -> tuple[tuple, dict, dict[int, str], list[InputInfo]]:
    """Give floating-point input tensors ``requires_grad`` (as new aliases) and name them."""
    import torch

    names: dict[int, str] = {}
    infos: list[InputInfo] = []

    def prepare(value: Any, name: str) -> Any:
        if isinstance(value, torch.Tensor):
            if value.is_inference():  # made under inference_mode(): autograd refuses it, a copy is a tensor like any
                value = value.clone()
            elif value.grad_fn is not None:  # part of the caller's graph: the backward stops at the model's input
                value = value.detach()
            if input_grad and value.is_leaf and not value.requires_grad and (value.is_floating_point() or value.is_complex()):
                value = value.detach().requires_grad_()
            names.setdefault(id(value), name)  # one tensor passed twice is one leaf: named where it comes first
            infos.append(InputInfo(name, tuple(value.shape), _dtype_name(value.dtype)))
            return value
        if isinstance(value, tuple) and hasattr(value, "_fields") and hasattr(value, "_make"):  # a PackedSequence
            return value._make(prepare(item, f"{name}.{field}") for field, item in zip(value._fields, value))
        if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
            return type(value)(prepare(item, f"{name}.{i}") for i, item in enumerate(value))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a batch object (before dict: ModelOutput is both)
            # a shallow copy with the fields set in place: no __init__ or __post_init__ of the user's runs again
            # (dataclasses.replace would reset init=False fields), and a frozen one takes it too
            try:
                copied = copy.copy(value)
            except Exception:  # an object that refuses to be copied: passed as it is
                return value
            for field in dataclasses.fields(value):
                if hasattr(value, field.name):
                    object.__setattr__(copied, field.name, prepare(getattr(value, field.name), f"{name}.{field.name}"))
            return copied
        if isinstance(value, dict):
            prepared = {key: prepare(item, f"{name}.{key}") for key, item in value.items()}
            if type(value) is dict:
                return prepared
            copied = copy.copy(value)  # an OrderedDict, a defaultdict: the same type
            copied.update(prepared)
            return copied
        return value

    new_args = tuple(prepare(value, f"input:{i}") for i, value in enumerate(args))
    new_kwargs = {key: prepare(value, f"input:{key}") for key, value in kwargs.items()}
    prepare = None  # type: ignore[assignment]  # it refers to itself: no cycle left for the garbage collector
    return new_args, new_kwargs, names, infos


class _ModuleTracker:
    """Module forward hooks: the active-module stack and the sequence-number boundaries."""

    def __init__(self, modules: list[tuple[str, Any]], leaves: dict[int, _Leaf]):
        import torch

        self._next_sequence_nr = torch._C._autograd._get_sequence_nr  # per thread, like _sequence_nr()
        # backward hooks for every module (torch changes these dicts in place): see _output_hook_node
        self._global_backward_hooks = vars(torch.nn.modules.module).get("_global_backward_hooks", {})
        self._global_backward_pre_hooks = vars(torch.nn.modules.module).get("_global_backward_pre_hooks", {})
        self._modules = modules
        self._leaves = leaves
        # id(parameter) -> _Leaf: parameters a module held while it ran that are not the model's own, e.g.
        # FSDP2's unsharded parameters (swapped in before a module runs, the sharded ones put back after)
        self.held: dict[int, _Leaf] = {}
        self._local = threading.local()
        self._handles: list[Any] = []
        self._direct: list[tuple[Any, bool]] = []  # (module, whether it held _compiled_call_impl = None) (see _call_directly)
        self._wrapped_compiled: list[tuple[Any, Any]] = []  # (module, its own _compiled_call_impl) (see _wrap_compiled)
        self._record_thread: int | None = None
        self.compiled = False  # whether the model holds a torch.compile'd module
        self.scripted_root = False  # whether the model itself is a TorchScript module (no hooks: see root_call)
        self.bound_seqs: list[int] = []
        self.bound_modules: list[str | None] = []
        self._with_kwargs_ids: list[int] = []  # the global forward hook's, registered with_kwargs (see remove)
        # modules of the model run in another thread while recording (see _left_elsewhere): node -> its module, the
        # numbers each thread's claimed nodes took, and the numbers each thread's outermost module calls spanned
        self.claimed: dict[Any, str] = {}
        self.claimed_seqs: dict[int, set[int]] = {}
        self.spans_elsewhere: dict[int, list[tuple[int, int]]] = {}
        # creation sites' trace function while line events are recorded in this thread (see _opaque_modules)
        self.line_tracer: Callable | None = None

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
        # TorchScript modules take no hooks at all: their nodes belong to the nearest eager module above.
        import torch
        import torch.nn as nn

        # a compiled wrapper holds its original as the submodule _orig_mod: looked up there, not by a getattr() that
        # raises inside nn.Module.__getattr__ for every other module (a ScriptModule's _modules is no dict, nor a wrapper)
        compiled = [
            name for name, module in self._modules
            if isinstance(module._modules, dict) and isinstance(module._modules.get("_orig_mod"), nn.Module)
        ]
        # compiled in place (module.compile()): its _call_impl, hooks and global hooks included, is what dynamo
        # compiles, so no hook goes on it or inside it; its call is wrapped from outside instead (_wrap_compiled)
        in_place = [(name, module) for name, module in self._modules if _compiled_in_place(module)]
        holds_compiled = bool(compiled or in_place)  # torch warns of global module hooks around a compiled module
        if holds_compiled and _compile_disabled():  # the compiled modules run their originals, eagerly: hooked as any
            compiled, in_place = [], []
        compiled += [name for name, _ in in_place]
        self.compiled = bool(compiled)
        for name, module in in_place:
            self._wrap_compiled(name, module)
        wrapped = {id(module) for _, module in in_place}
        hooked = []
        for name, module in self._modules:
            if compiled and (id(module) in wrapped or any(_is_descendant(name, prefix) for prefix in compiled)):
                continue
            if isinstance(module, torch.jit.ScriptModule):
                self.scripted_root = self.scripted_root or name == ""
                continue
            hooked.append((name, module))
        if not hooked:
            return
        if holds_compiled or any(module._forward_pre_hooks or module._forward_hooks for _, module in hooked):
            # hooks of the model's own (FSDP2's, which swap parameters in; a user's whose ops belong to the
            # module call): ours run after them, as hooks registered on the module run in order
            for name, module in hooked:
                # the boundary before the module's own pre-hooks (weight_norm's ops belong to the module), the
                # parameters it holds after them (FSDP2's unsharded ones, swapped in by its pre-hook)
                enter = functools.partial(self._enter, name, hold=False)
                self._handles.append(module.register_forward_pre_hook(enter, prepend=True))
                self._handles.append(module.register_forward_pre_hook(functools.partial(self._hold, name)))
                self._handles.append(
                    module.register_forward_hook(
                        functools.partial(self._exit_with_kwargs, name), with_kwargs=True, always_call=True
                    )
                )
            return
        # Otherwise two global hooks that look each module up: two registrations instead of two per module
        # (measured on a ResNet-style CNN: 2 to 3 ms less per traced step, of 60 to 75)
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        names = {id(module): name for name, module in hooked}
        enter, exit_, find = self._enter, self._exit, names.get
        opaque = _opaque_modules(hooked) if sys.version_info < (3, 12) else set()
        settrace, gettrace, get_ident = sys.settrace, sys.gettrace, threading.get_ident
        quieted: list[int] = []  # the opaque module whose call turned line tracing off, until it returns

        def pre(module: Any, args: Any) -> None:
            key = id(module)
            name = find(key)
            if name is not None:
                # (where line tracing is still ours: a debugger started in forward has put its own in its place)
                if key in opaque and self.line_tracer is not None and get_ident() == self._record_thread and gettrace() is self.line_tracer:
                    settrace(None)  # first: the calls below are not traced either
                    quieted.append(key)
                enter(name, module, args)

        def post(module: Any, args: Any, *kwargs_output: Any) -> None:
            """(module, args, output), or (module, args, kwargs, output) where torch gives global hooks the
            keyword arguments (a module run in another thread with them: see _left_elsewhere)."""
            key = id(module)
            name = find(key)
            if name is not None:
                kwargs = kwargs_output[0] if len(kwargs_output) == 2 else None
                exit_(name, module, (*args, kwargs) if kwargs else args, kwargs_output[-1])
                if quieted and quieted[-1] == key and get_ident() == self._record_thread:
                    quieted.pop()
                    if self.line_tracer is not None and gettrace() is None:
                        settrace(self.line_tracer)  # last, for the same reason

        self._handles.append(register_module_forward_pre_hook(pre))
        with_kwargs = {"with_kwargs": True} if "with_kwargs" in inspect.signature(register_module_forward_hook).parameters else {}
        handle = register_module_forward_hook(post, always_call=True, **with_kwargs)
        self._handles.append(handle)
        if with_kwargs:  # its handle leaves its id in this dict (torch 2.14): taken out in remove()
            self._with_kwargs_ids.append(handle.id)
        self._call_directly(hooked, opaque)

    def _wrap_compiled(self, name: str, module: Any) -> None:
        """A module compiled in place: its boundaries marked around the call of its compiled ``_call_impl``, which
        torch's ``_wrapped_call_impl`` makes through ``_compiled_call_impl`` (put back in :meth:`remove`)."""
        compiled_call = module.__dict__["_compiled_call_impl"]
        enter, exit_ = self._enter, self._exit

        def call(*args: Any, **kwargs: Any) -> Any:
            enter(name, module, args)
            output = None
            try:
                output = compiled_call(*args, **kwargs)
                return output
            finally:
                exit_(name, module, (*args, kwargs) if kwargs else args, output)

        module.__dict__["_compiled_call_impl"] = _OurCall(call)
        self._wrapped_compiled.append((module, compiled_call))

    def _call_directly(self, hooked: list[tuple[str, Any]], opaque: set[int]) -> None:
        """Where the global hooks above are the only module hooks in the process, each module is called
        through a function of its own that marks its boundaries and calls its ``forward``: what torch's
        ``_call_impl`` does for a module without hooks, less its hook dispatch (a closure, a set and the
        loops over hooks, per module call; measured on a ResNet-style CNN at batch 2, its forward with module
        hooks: 21.6M -> 20.5M instructions; with creation sites too, whose line events then see half the
        Python calls: 25.9M -> 22.9M). torch's ``_wrapped_call_impl`` calls ``_compiled_call_impl`` where a
        module has one (``Module.compile()`` sets it; pickling drops it): the function is put there, and
        taken away in :meth:`remove`.

        A call falls back on ``_call_impl`` (and the global hooks) where the module has hooks by then, other
        global hooks came meanwhile (another thread's trace), or JIT tracing runs; a module already compiled,
        or whose class calls otherwise, keeps torch's way. Not under ``nn.DataParallel``, whose replicas are
        copies of each module's ``__dict__``: they would call the original's function."""
        import torch
        from torch.nn.modules import module as torch_module

        Module = torch.nn.Module
        wrapped = getattr(Module, "_wrapped_call_impl", None)
        if (
            wrapped is None
            or getattr(Module, "_compiled_call_impl", _MISSING) is not None
            or len(torch_module._global_forward_pre_hooks) != 1  # ours alone
            or len(torch_module._global_forward_hooks) != 1
            or getattr(torch_module, "_global_backward_hooks", None)
            or getattr(torch_module, "_global_backward_pre_hooks", None)
            or any(isinstance(module, torch.nn.DataParallel) for _, module in hooked)
        ):
            return
        global_pre_hooks = torch_module._global_forward_pre_hooks
        tracing_state = torch._C._get_tracing_state
        settrace, gettrace, get_ident = sys.settrace, sys.gettrace, threading.get_ident
        enter, exit_ = self._enter, self._exit

        def direct(name: str, module: Any, off: bool) -> Callable:
            call_impl = module._call_impl

            def call(*args: Any, **kwargs: Any) -> Any:
                if (
                    module._forward_pre_hooks or module._forward_hooks or module._backward_hooks
                    or module._backward_pre_hooks or len(global_pre_hooks) != 1 or tracing_state()
                ):  # fmt: skip
                    return call_impl(*args, **kwargs)
                # (where line tracing is still ours: a debugger started in forward has put its own in its place)
                quiet = off and self.line_tracer is not None and get_ident() == self._record_thread and gettrace() is self.line_tracer
                if quiet:
                    settrace(None)  # first: the calls below are not traced either
                enter(name, module, args)
                output = None
                try:
                    output = module.forward(*args, **kwargs)
                    return output
                finally:
                    exit_(name, module, (*args, kwargs) if kwargs else args, output)
                    if quiet and self.line_tracer is not None and gettrace() is None:
                        settrace(self.line_tracer)  # last, for the same reason

            return call

        for name, module in hooked:
            state = module.__dict__
            if type(module).__call__ is not wrapped or state.get("_compiled_call_impl") is not None:
                continue
            self._direct.append((module, "_compiled_call_impl" in state))  # (and then None)
            state["_compiled_call_impl"] = _OurCall(direct(name, module, id(module) in opaque))

    # _enter and _exit run on every module call: _mark() inlined, and _stack() in _enter (a Python call
    # each costs, more so while creation sites are traced)
    def _enter(self, name: str, module: Any, args: Any, hold: bool = True) -> None:
        local = self._local
        stack = getattr(local, "stack", None)
        if stack is None:
            stack = local.stack = []
        stack.append(name)
        if threading.get_ident() == self._record_thread:
            self.bound_seqs.append(self._next_sequence_nr())
            self.bound_modules.append(name)
            if hold:
                self._hold(name, module, args)
        else:
            entered = getattr(local, "entered", None)
            if entered is None:
                entered = local.entered = []
            entered.append((name, self._next_sequence_nr()))  # this thread's number, for _left_elsewhere

    def _hold(self, name: str, module: Any, args: Any) -> None:
        """Name the parameters the module holds that are not the model's own (FSDP2's unsharded ones)."""
        params = module._parameters if module is not None else None
        if params and threading.get_ident() == self._record_thread:
            leaves = self._leaves
            for param_name, param in params.items():
                if param is not None and id(param) not in leaves and id(param) not in self.held:
                    self.held[id(param)] = _Leaf(f"{name}.{param_name}" if name else param_name, param, name)

    def _exit_with_kwargs(self, name: str, module: Any, args: Any, kwargs: dict, output: Any) -> None:
        self._exit(name, module, (*args, kwargs) if kwargs else args, output)

    def _exit(self, name: str, module: Any, args: Any, output: Any) -> None:
        """A module call ends. ``args``: its positional arguments, and its keyword arguments' dict after them where
        it had any (what a call in another thread claims its nodes back to: _left_elsewhere)."""
        stack = self._stack()
        # Pairs are guaranteed by always_call; search anyway so one odd exit cannot shift the rest.
        for position in range(len(stack) - 1, -1, -1):
            if stack[position] == name:
                del stack[position:]
                break
        if threading.get_ident() == self._record_thread:
            seq = self._next_sequence_nr()
            if module is not None and (
                module._backward_hooks or module._backward_pre_hooks or self._global_backward_hooks or self._global_backward_pre_hooks
            ):
                seq += self._output_hook_node(module, output)
            self.bound_seqs.append(seq)
            self.bound_modules.append(stack[-1] if stack else None)
        else:
            self._left_elsewhere(name, args, output)

    def _left_elsewhere(self, name: str, args: Any, output: Any) -> None:
        """A module call in a thread other than the recording one ends: it claims the nodes it made.

        That thread numbers its nodes by its own counter, which the recording thread's boundaries cannot place.
        The nodes the call made are those reachable from its output, back to its inputs, that took this
        thread's numbers meanwhile (a node made earlier feeds no node made later: the walk stops at the first
        one outside them). Inner modules end first, and claim first. Nodes the call made that its output does
        not reach (a side output kept in an attribute) cannot be told from the recording thread's nodes under
        the same numbers: the numbers each thread's outermost calls spanned are kept, for :meth:`placed_elsewhere`.
        """
        import torch

        entered = getattr(self._local, "entered", None)
        if not entered:
            return
        for position in range(len(entered) - 1, -1, -1):
            if entered[position][0] == name:
                first = entered[position][1]
                del entered[position:]
                break
        else:
            return
        if self._record_thread is None:  # not while forward runs: backward's threads (a reentrant checkpoint)
            return
        thread, made = threading.get_ident(), range(first, self._next_sequence_nr())
        if not made:
            return
        if not entered:
            self.spans_elsewhere.setdefault(thread, []).append((made.start, made.stop))
        claimed, claimed_seqs = self.claimed, self.claimed_seqs.setdefault(thread, set())
        if isinstance(output, dict):  # a ModelOutput, a dict of tensors
            output = list(output.values())
        # made before the call, maybe in another thread (keyword arguments too: a dict after the positional ones)
        known = {t.grad_fn for t in tensors_in(args, torch.Tensor)}
        stack = [t.grad_fn for t in _tensors_in(output, torch.Tensor)]
        seen: set[Any] = set()
        while stack:
            node = stack.pop()
            if node is None or node in seen or node in known:
                continue
            seen.add(node)
            seq = node._sequence_nr()
            if seq not in made:
                continue
            if node not in claimed:
                claimed[node] = name
                claimed_seqs.add(seq)
            stack.extend(child for child, _ in node.next_functions)

    def placed_elsewhere(self, nodes: list[Any], seqs: list[int]) -> dict[int, str | None]:
        """Position -> module of each node made in another thread while recording: the module call that claimed
        it, or None where its number lies in another thread's module calls and no claimed node of that thread
        took it (it may be that thread's, made out of its output's reach): no module rather than a wrong one."""
        spans = {}
        for thread, calls in self.spans_elsewhere.items():
            calls.sort()
            spans[thread] = ([start for start, _ in calls], [stop for _, stop in calls], self.claimed_seqs.get(thread, ()))
        placed: dict[int, str | None] = {}
        for position, (node, seq) in enumerate(zip(nodes, seqs)):
            module = self.claimed.get(node, _MISSING)
            if module is not _MISSING:
                placed[position] = module
                continue
            for starts, stops, taken in spans.values():
                call = bisect.bisect_right(starts, seq) - 1
                if call >= 0 and seq < stops[call] and seq not in taken:
                    placed[position] = None
                    break
        return placed

    def _output_hook_node(self, module: Any, output: Any) -> int:
        """1 where the module's full backward hooks will wrap its output in a node after this hook has run
        (``BackwardHookFunctionBackward``, made after every forward hook): the module's own, as is the one
        on its inputs; else 0."""
        import torch
        from torch.nn.modules import module as torch_module

        # as torch's _call_impl decides: full backward hooks, the module's own or every module's, or pre-hooks
        if not (
            module._backward_pre_hooks
            or getattr(torch_module, "_global_backward_pre_hooks", None)
            or (getattr(module, "_is_full_backward_hook", None) and module._backward_hooks)
            or (getattr(torch_module, "_global_is_full_backward_hook", None) and getattr(torch_module, "_global_backward_hooks", None))
        ):
            return 0
        tensors = output if isinstance(output, tuple) else (output,)
        with _own_ops(torch):  # (attribute reads: out of sight of the user's modes)
            requires_grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
        return int(requires_grad and torch.is_grad_enabled())

    @contextlib.contextmanager
    def root_call(self) -> Iterator[None]:
        """Around the model's call: the root module's boundaries where it has no hooks (TorchScript)."""
        if not self.scripted_root:
            yield
            return
        self._enter("", None, ())
        try:
            yield
        finally:
            self._exit("", None, (), None)

    def start_recording(self) -> None:
        self._record_thread = threading.get_ident()
        self._mark()

    def stop_recording(self) -> None:
        self._mark()
        self._record_thread = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._with_kwargs_ids:
            from torch.nn.modules import module as torch_module

            for handle_id in self._with_kwargs_ids:
                getattr(torch_module, "_global_forward_hooks_with_kwargs", {}).pop(handle_id, None)
            self._with_kwargs_ids.clear()
        for module, held_none in self._direct:
            if held_none:
                module.__dict__["_compiled_call_impl"] = None
            else:
                module.__dict__.pop("_compiled_call_impl", None)
        self._direct.clear()
        for module, compiled_call in self._wrapped_compiled:
            module.__dict__["_compiled_call_impl"] = compiled_call
        self._wrapped_compiled.clear()


class _OurCall(functools.partial):
    """A module's call function put in its ``_compiled_call_impl`` by a trace (this one's, or another thread's):
    told from one that ``module.compile()`` put there."""

    __slots__ = ()


def _compiled_in_place(module: Any) -> bool:
    """Whether ``module.compile()`` put a compiled call in the module (not a trace's call function, nor None)."""
    call = getattr(module, "__dict__", {}).get("_compiled_call_impl")
    return call is not None and not isinstance(call, _OurCall)


def _opaque_modules(modules: list[tuple[str, Any]]) -> set[int]:
    """Modules no user code runs in: torch's own classes (not a subclass of the user's), without submodules or
    a ``forward`` of the instance's own. While one runs, creation sites' line events are turned off: Python
    then runs its frames (torch's module call, BatchNorm's checks) off its slower tracing path, and their
    nodes get the user's line that called the module either way (Python 3.11: a traced step's forward on a
    ResNet-style CNN 21.6 -> 20.7 ms, GPT-2-style 26.9 -> 25.9). Not on 3.12 and later, where ``sys.settrace``
    runs on ``sys.monitoring`` and turning it off and on has code objects instrumented again (measured
    slower: 22.2 -> 25.2 ms on that CNN)."""
    skip = _library_prefixes()
    library: dict[type, bool] = {}
    opaque = set()
    for _, module in modules:
        cls = type(module)
        if cls not in library:
            path = getattr(sys.modules.get(cls.__module__), "__file__", None) or ""
            forward = getattr(getattr(cls, "forward", None), "__code__", None)  # not one the user patched in
            library[cls] = path.startswith(skip) and forward is not None and forward.co_filename.startswith(skip)
        if library[cls] and not module._modules and "forward" not in module.__dict__:
            opaque.add(id(module))
    return opaque


def _compile_disabled() -> bool:
    """Whether torch.compile is off (``TORCH_COMPILE_DISABLE=1``): a compiled module then runs its original."""
    config = getattr(sys.modules.get("torch._dynamo"), "config", None)
    return bool(getattr(config, "disable", False))


def _is_descendant(path: str, ancestor: str) -> bool:
    """Whether module ``path`` lies strictly inside module ``ancestor``."""
    if ancestor == "":
        return path != ""
    return path.startswith(ancestor + ".")


@functools.cache  # a class made once, not per trace
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


QUIET_AFTER = 2  # calls of a function that made no node, after which its lines are not traced
LINE_BITS = 32  # a site recorded as an int: its file's number above these bits, its line in them
LINE_MASK = (1 << LINE_BITS) - 1


def _user_frame(frame: Any, skip: tuple[str, ...]) -> Any:
    """The innermost frame of the user's code from ``frame`` up, below the call of :func:`trace`; None for
    an op gradtrace itself runs (the loss rule's sum): the frames above trace() are its caller's (the
    CLI's, or the code that called it), not the model's."""
    while frame is not None:
        code = frame.f_code
        if code is _TRACE_CODE:
            return None
        if not code.co_filename.startswith(skip):
            return frame
        frame = frame.f_back
    return None


class _SiteRecorder:
    """Creation sites: the user's source line behind each node, recorded at sequence-number boundaries.

    A table of marks "nodes numbered from here on were made at this site" is filled in forward, by
    line events (:meth:`tracing_lines`) or by a TorchFunctionMode per op (the innermost frame outside
    torch and gradtrace; an op that makes nodes gets an interval ``[first, next)``); a node's site is
    the last mark at or before its ``_sequence_nr()``. Nodes made inside an op (``TBackward0`` of
    ``F.linear``) share the op's site. A line event's mark replaces the last one where no node was made
    since (the same sequence number).

    A site is ``(path, line)``, or, from a line event, that pair as one int (:meth:`site`): the file's
    number shifted left by LINE_BITS, plus the line (a tuple per line event was about a quarter of its cost).
    """

    def __init__(self, stacks: bool = False) -> None:
        import torch

        self.next_sequence_nr = torch._C._autograd._get_sequence_nr
        self.skip = _library_prefixes()
        self.stacks = stacks
        self._sorted = False
        self.starts: list[int] = []
        self.sites: list[Any] = []
        self.files: list[str] = []  # the paths of sites recorded as ints, by number

    def site(self, recorded: Any) -> Any:
        """A recorded site as ``(path, line)`` (or as it is: None, a stack)."""
        if type(recorded) is int:
            return (self.files[recorded >> LINE_BITS], recorded & LINE_MASK)
        return recorded

    def user_site(self, depth: int = 2) -> Any:
        """The innermost user frame as ``(path, line)``; with ``stacks``, every user frame (innermost first)
        as ``((path, line, function), ...)``, up to the call of ``trace()``."""
        skip = self.skip
        frame = _user_frame(sys._getframe(depth), skip)
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

    @contextlib.contextmanager
    def tracing_lines(self, tracker: _ModuleTracker | None = None) -> Iterator[None]:
        """Record sites from Python's line events in user frames (``sys.settrace``, this thread only).

        A line marks the sequence number its ops will take; a user frame returning marks the line its
        caller goes on with. torch's and gradtrace's frames are not traced. On a graph of tiny ops this
        costs a fifth of a TorchFunctionMode call per op; on module-heavy models about the same.

        A function whose first QUIET_AFTER calls made no node (a config's ``__getattribute__``, a helper
        that checks shapes) is not traced line by line again: skipping such a call leaves the same table.
        Should a later call of it make nodes, they get the line that called it.

        ``tracker`` turns line events off while a module runs that holds no user code (see _opaque_modules).
        """
        skip, next_sequence_nr = self.skip, self.next_sequence_nr
        starts, sites, files = self.starts, self.sites, self.files  # extended in place while forward runs
        # Code objects are looked up by id(): a code object's hash is not cached, and hashes its constants
        # and names each time (by id: 0.7M fewer of the 5.0M instructions line events added to a ResNet-style
        # CNN's forward). Every code seen is held in `codes` until tracing ends, so no id is reused meanwhile.
        codes: list[Any] = []
        user_code: dict[int, bool] = {}  # id(code) -> whether the user's
        idle_calls: dict[int, int] = {}  # id(user code) -> its calls so far, all without a node; -1: one made nodes
        entered: dict[Any, int] = {}  # a traced frame -> the sequence number when it was entered
        tracers: dict[int, Callable] = {}  # id(user code) -> the trace function of its frames (one per file)
        bases: dict[int, int] = {}  # and its file's number, shifted: a site is base + line
        by_file: dict[str, tuple[Callable, int]] = {}

        def is_user(code: Any) -> bool:
            codes.append(code)
            user = user_code[id(code)] = not code.co_filename.startswith(skip)
            return user

        def tracer(code: Any) -> Callable:
            """The trace function of a user code object's frames: that of its file, made at the file's first call."""
            path = code.co_filename
            if path not in by_file:
                files.append(path)
                base = (len(files) - 1) << LINE_BITS
                by_file[path] = (tracer_of_file(base), base)
            key = id(code)
            tracers[key], bases[key] = by_file[path]
            return tracers[key]

        def tracer_of_file(base: int) -> Callable:
            # it returns None: the frame keeps it as its trace function (and it holds no reference to itself)
            def local(frame: Any, event: str, arg: Any) -> None:
                if event == "line":  # a mark: once per line the user's code runs
                    seq, site = next_sequence_nr(), base + frame.f_lineno
                    if starts and starts[-1] == seq:
                        sites[-1] = site
                    else:
                        starts.append(seq)
                        sites.append(site)
                elif event == "return":
                    seq = next_sequence_nr()
                    first = entered.pop(frame, None)
                    if first is not None:  # a call of a function not yet seen to make a node is counted
                        key = id(frame.f_code)
                        if first != seq:
                            idle_calls[key] = -1
                        else:
                            calls = idle_calls.get(key, 0)
                            if calls >= 0:
                                idle_calls[key] = calls + 1
                    site = None  # the line the innermost user frame above goes on with (torch's module call frames
                    caller = frame.f_back  # between are skipped; none above trace())
                    while caller is not None:
                        code = caller.f_code
                        key = id(code)
                        caller_base = bases.get(key)
                        if caller_base is not None:  # a traced frame (the usual case)
                            site = caller_base + caller.f_lineno
                            break
                        user = user_code.get(key)
                        if user or (user is None and is_user(code)):
                            site = (code.co_filename, caller.f_lineno)
                            break
                        caller = None if code is _TRACE_CODE else caller.f_back
                    if starts and starts[-1] == seq:  # a mark, as for a line
                        sites[-1] = site
                    else:
                        starts.append(seq)
                        sites.append(site)

            return local

        def on_call(frame: Any, event: str, arg: Any) -> Any:  # every call in this thread: is_user() inlined
            code = frame.f_code
            key = id(code)
            user = user_code.get(key)
            if user is None:
                user = is_user(code)
            if not user:
                return None
            calls = idle_calls.get(key, 0)
            if calls >= QUIET_AFTER:
                return None
            if calls >= 0:  # not yet seen to make nodes: counted
                entered[frame] = next_sequence_nr()
            return tracers.get(key) or tracer(code)

        sys.settrace(on_call)
        if tracker is not None:
            tracker.line_tracer = on_call
        try:
            yield
        finally:
            if tracker is not None:
                tracker.line_tracer = None
            if sys.gettrace() is on_call:  # (a debugger started in forward keeps its own)
                sys.settrace(None)
            entered.clear()  # frames still running now (the caller's)
            tracers.clear()
            bases.clear()
            user_code.clear()
            codes.clear()
            by_file.clear()

    def table(self) -> tuple[list[int], list[Any]]:
        """The interval starts, sorted, and the site of each (a Function applied inside an op is recorded
        before that op, so the order needs restoring; ties keep their order)."""
        starts = self.starts
        if not self._sorted:
            if not all(map(operator.le, starts, itertools.islice(starts, 1, None))):  # usually they are in order
                order = sorted(range(len(starts)), key=starts.__getitem__)
                self.starts = [starts[i] for i in order]
                self.sites = [self.sites[i] for i in order]
            self._sorted = True
        return self.starts, self.sites


# _writes(): an in-place op (it changes its first argument); another op that may write; from _INPLACE_AT up, a
# function whose `inplace` parameter, at position (value - _INPLACE_AT), says whether it writes
_WRITES_FIRST, _MAY_WRITE, _INPLACE_AT = 1, 2, 3


def _writes(func: Any) -> int:
    """Whether an op may change a tensor in place: _WRITES_FIRST for an in-place op, which changes its first
    argument (``add_``, ``x += y`` through ``__iadd__``, ``x |= m``, ``h[0, 3] = v``, ``torch.ops.aten.add_.Tensor``;
    not ``__getitem__`` or ``__rsub__``); _MAY_WRITE for an operator whose schema writes (an ``out=`` variant);
    _INPLACE_AT plus its position for a function with an ``inplace`` parameter (``F.relu(x, True)`` passes it by
    position, ``nn.ReLU`` by name); 0 for others."""
    import torch

    name = getattr(func, "__name__", "")
    base = name.partition(".")[0]  # an operator's overload: add_.Tensor
    if name == "__setitem__" or (base.endswith("_") and not base.startswith("__")):
        return _WRITES_FIRST
    if name.startswith("__i") and hasattr(torch.Tensor, f"__{name[3:]}"):
        return _WRITES_FIRST
    schema = getattr(func, "_schema", None)
    if schema is not None:
        return _MAY_WRITE if getattr(schema, "is_mutable", False) else 0
    try:
        parameters = list(inspect.signature(func).parameters)
    except Exception:  # no signature (a builtin, as a Tensor method is): its name said it all
        return 0
    return _INPLACE_AT + parameters.index("inplace") if "inplace" in parameters else 0


def _may_write(writes: int, args: tuple, kwargs: dict) -> bool:
    """Whether this call of an op that :func:`_writes` classified may change a tensor in place."""
    if writes >= _INPLACE_AT:
        at = writes - _INPLACE_AT
        inplace = args[at] if len(args) > at else kwargs.get("inplace")
        return isinstance(inplace, int) and bool(inplace)  # a bool, or 1 (not a tensor, whose truth may raise)
    return bool(writes) or "out" in kwargs


@functools.cache  # a class made once, not per trace
def _forward_mode_class() -> type:
    import torch
    from torch.overrides import TorchFunctionMode

    try:
        from torch.compiler import is_compiling
    except ImportError:  # torch < 2.3: dynamo's own (it is special-cased there)
        from torch._dynamo.external_utils import is_compiling

    function_modes, dispatch_modes = torch._C._len_torch_function_stack, torch._C._len_torch_dispatch_stack

    class _ForwardMode(TorchFunctionMode):
        """Per op in forward: the creation site of the nodes it makes, and (optionally) its output's norm."""

        def __init__(self, session: _TraceSession, sites: _SiteRecorder | None):
            super().__init__()
            self.session = session
            self.sites = sites
            self.writes: dict[Any, int] = {}  # func -> how it may write in place (_writes()), asked once per func

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if kwargs is None:
                kwargs = {}
            if is_compiling():  # torch.compile traces modes: stay out of its way (its region is one node)
                return func(*args, **kwargs)
            session = self.session
            if session.forward_stats:
                try:
                    writes = self.writes.get(func)
                    if writes is None:
                        writes = self.writes[func] = _writes(func)
                except TypeError:  # an unhashable callable
                    writes = _writes(func)
                if session.forward_pending and (writes or kwargs) and _may_write(writes, args, kwargs):
                    session.flush_forward()  # values waiting for a batched norm are taken before the op may change them
            sites = self.sites
            if sites is None:
                output = func(*args, **kwargs)
            else:
                first = sites.next_sequence_nr()
                output = func(*args, **kwargs)
                after = sites.next_sequence_nr()
                if after != first:  # the op made nodes: they were made here (inlined user_site(), per op)
                    if sites.stacks:
                        site = sites.user_site()
                    else:
                        frame = _user_frame(sys._getframe(1), sites.skip)
                        site = None if frame is None else (frame.f_code.co_filename, frame.f_lineno)
                    sites.starts += (first, after)
                    sites.sites += (site, None)
            if session.forward_stats:
                if function_modes() or dispatch_modes():  # the user's, below this one: set aside (_modes_set_aside)
                    with _modes_set_aside(torch):
                        session.record_forward(output)
                else:
                    session.record_forward(output)
                if writes == _WRITES_FIRST and args and isinstance(args[0], torch.Tensor):
                    # an in-place op (h[0, 3] = x returns None): the tensor it changed, and the tensor a changed
                    # view belongs to, whose node (CopySlices) the ops after it use
                    changed = args[0]
                    try:
                        base = changed._base
                    except Exception:  # noqa: BLE001 - a tensor subclass without one: never break the user's forward
                        base = None
                    session.record_output(changed if base is None else (changed, base))
            return output

    return _ForwardMode


# Gradients up to SMALL_NUMEL elements wait in their hook's record and get their norms in batches
# (one stack and one norm per shape and dtype): a norm per tensor costs a dispatch (about 2.5 µs),
# however small the tensor. At most PENDING_NUMEL elements or PENDING_CALLS hook calls wait: a few
# hundred calls' gradients stay in the CPU's caches, and their memory is soon free for backward to reuse
# (measured on chains of tiny ops: 256 calls, 1.4 µs per waiting gradient; 4,096 calls, 1.7 to 3.2 µs).
SMALL_NUMEL = 1 << 14
PENDING_NUMEL = 1 << 22
PENDING_CALLS = 1 << 8
# a tensor that is not contiguous, whose innermost run of elements (_element_runs) is at least this long, is
# normed row by row, then the rows' norms together (a slice of 4x127 rows of 5,000: 0.3 ms against 1.4 for a norm
# over every dimension at once; rows of 8 as fast as that, shorter ones slower)
ROW_NUMEL = 8
OUT_CHUNK = 1024  # norms taken one at a time are written into buffers of this many values
# A stack of float32, bf16 or fp16 gradients up to this many elements is normed in float64, whose sums of their
# squares neither underflow nor overflow: no range check to follow (on the CPU, 256 rows of 8: 3.6 us against
# 12.7 for a float32 norm and its check; float64 is the slower from about 256 rows of 128, and far slower for
# large rows: 256 of 16k, 7.6 ms against 0.3)
DIRECT_WIDE_NUMEL = 1 << 15
# On a device, a float32, bf16 or fp16 tensor normed alone that fills one block of memory (_flat_block) and has at
# least this many elements is normed by a multi-tensor kernel that squares each element in float64 as it reads it
# (torch's _foreach_norm with a dtype), not by a norm in float64, which makes a float64 copy first: twice the
# tensor's memory meanwhile (1.6 GB for a GPT-2 step's logits) and three times its memory traffic. Below it the copy
# costs the GPU less than the multi-tensor kernel's extra launches cost the CPU (on an H200, about 4 us either way at
# 1M elements). (Gradients that wait for a batch on a device are normed so whatever their size: _device_batch)
WIDE_ON_DEVICE_NUMEL = 1 << 22
# Rows whose float32 norm overflowed are looked at for an infinity (a norm of rows that hold one is infinite, with
# no float64 norm to take) above this many elements; below it the six ops of that look cost more than the norm
# (on the CPU, 8 elements: 32 against 7 us; 64k: 40 against 58)
INF_CHECK_NUMEL = 1 << 16
# A float32 dot product accumulates in float32: past this many elements its sum of squares is taken by chunks of
# DOT_CHUNK elements, added in float64 (on 8M elements with a few large rows: 1e-4 relative error against 5e-6)
CHUNKED_DOT_NUMEL = 1 << 21
DOT_CHUNK = 1 << 19
NO_VALUE = -1  # the position of a norm that could not be taken
# where a hook of gradtrace's failed (the error is reported after the step)
RECORDING_FORWARD = "while recording forward values"
DURING_BACKWARD = "during backward"
CHANGED_IN_PLACE = "its backward changed the gradients it received in place: not replayed"
# Where at least one call in this many is an AccumulateGrad's, a parameter's .grad finds what its AccumulateGrad
# received in a pass over every call (0.1 us a call), rather than having a small one normed again (about 2 us; a
# chain of 6,000 tiny ops with one parameter is better without the pass, 1,000 Linear layers with it)
LEAF_SHARE = 16
# A float32 sum of squares below TINY_SQUARE (a norm below TINY_NORM) may have lost elements whose squares
# underflow (below about 1e-19 each); above it, what is lost is within float32 rounding. The same for
# float64 (elements below about 1e-154) below TINY_SQUARE_64 and TINY_NORM_64. An infinite norm of finite
# elements is the other way out of range: squares that overflow (a float32 norm above about 1.8e19).
TINY_SQUARE = 2.0**-100
TINY_NORM = 2.0**-50
TINY_SQUARE_64 = 2.0**-960
TINY_NORM_64 = 2.0**-480


_NO_CONTEXT = contextlib.nullcontext()  # reusable: entered once per hook call that queues norms at once


# gradtrace's own tensor work (statistics, copies, replays, checks, even a tensor's numel()) is kept out of
# sight of the modes of the user's (TorchFunctionMode, TorchDispatchMode) active around trace() or in forward:
# a FLOP counter or an op log would count it, and a guard that refuses host reads (code meant for CUDA graphs
# checks itself so) would refuse the norms read on the CPU. The step's own forward and backward stay in them.
@contextlib.contextmanager
def _modes_set_aside(torch: Any) -> Iterator[None]:
    """Every TorchFunctionMode and TorchDispatchMode off this thread's stacks while the block runs, then back."""
    from torch.utils._python_dispatch import _disable_current_modes

    functions = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    try:
        with _disable_current_modes():
            yield
    finally:
        for mode in reversed(functions):
            torch._C._push_on_torch_function_stack(mode)


def _own_ops(torch: Any) -> contextlib.AbstractContextManager:
    """:func:`_modes_set_aside` where a mode is active; nothing to do where none is (the usual case)."""
    if torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
        return _modes_set_aside(torch)
    return _NO_CONTEXT


class _ModesAside:
    """The user's modes set aside while trace() runs (:func:`_modes_set_aside`), but for the user's own code
    (forward, the loss, backward: :func:`_user_modes`), which runs in them as in a plain step."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch
        self._aside: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> _ModesAside:
        self._aside = _modes_set_aside(self._torch)
        self._aside.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        aside, self._aside = self._aside, None
        if aside is not None:
            aside.__exit__(None, None, None)

    @contextlib.contextmanager
    def user_code(self) -> Iterator[None]:
        self.__exit__()
        try:
            yield
        finally:
            self.__enter__()


_asides = threading.local()  # .stack: this thread's _ModesAside of each trace() running (nested: a loss_fn's own)


def _user_modes_aside(function: Callable) -> Callable:
    """``trace()`` with the user's modes set aside where modes are active (:class:`_ModesAside`)."""

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        import torch

        if not (torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack()):
            return function(*args, **kwargs)
        stack = _asides.__dict__.setdefault("stack", [])
        with _ModesAside(torch) as aside:
            stack.append(aside)
            try:
                return function(*args, **kwargs)
            finally:
                stack.pop()

    return run


def _user_modes() -> contextlib.AbstractContextManager:
    """Where trace() runs the user's code: the user's modes back, if :func:`_user_modes_aside` set them aside."""
    stack = getattr(_asides, "stack", None)
    return stack[-1].user_code() if stack else _NO_CONTEXT


@contextlib.contextmanager
def _entered(mode: Any, torch: Any) -> Iterator[None]:
    """gradtrace's TorchFunctionMode for forward, entered, and left however forward leaves the stack: a mode the
    user's forward entered and left active stays, above what was below this one (leaving it by ``__exit__`` alone
    would pop the user's, and leave gradtrace's on the stack)."""
    mode.__enter__()
    depth = torch._C._len_torch_function_stack()
    try:
        yield
    finally:
        above = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack() - depth)]
        mode.__exit__(None, None, None)
        for left in reversed(above):
            torch._C._push_on_torch_function_stack(left)


def _out_of_user_modes(method: Callable) -> Callable:
    """A session method that runs gradtrace's own tensor work: with the user's modes set aside (:func:`_own_ops`)."""

    @functools.wraps(method)
    def run(self: Any, *args: Any) -> Any:
        with _own_ops(self._torch):
            return method(self, *args)

    return run
_SHAPE, _DTYPE, _LAYOUT = operator.attrgetter("shape"), operator.attrgetter("dtype"), operator.attrgetter("layout")


class _Stats:
    """Statistics of tensors as numbered slots: shape, dtype and a norm computed on the tensor's device.

    Norms (and any other value queued with :meth:`value`) stay on their devices until :meth:`read`,
    which reads them back in one transfer per device; a plain CPU tensor's norm taken alone is read at
    once (no device to wait for). :meth:`now` takes one tensor's norm at once;
    :meth:`batch` takes the norms of many small tensors with one op per shape and dtype.
    """

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._plain = torch.Tensor
        self._strided = torch.strided
        self._float32 = torch.float32
        self._vector_norm = torch.linalg.vector_norm
        self._wide = {torch.float64, torch.complex64, torch.complex128}  # normed in their own dtype
        self._dot, self._dot_dtypes = torch.dot, {torch.float32, torch.float64}
        self._foreach_norm = torch._foreach_norm if _foreach_norm_takes_dtype() else None  # (torch 2.4 and later)
        self._float64, self._double = torch.float64, {torch.float64, torch.complex128}  # norms in float64
        self._narrow = {torch.float32, torch.bfloat16, torch.float16}  # squares in range in float64
        # result dtype -> (least square, least norm) read as exact
        self._tiny = {torch.float32: (TINY_SQUARE, TINY_NORM), torch.float64: (TINY_SQUARE_64, TINY_NORM_64)}
        self._buffers: dict[tuple, list[Any]] = {}  # (device, dtype) -> [values, first position, used]
        self._exact: dict[Any, Any] = {}  # device -> the dtype its narrow tensors are normed in (:meth:`_exact_dtype`)
        self._squared: list[int] = []  # positions that hold a squared norm
        self._joints: list[tuple[int, list[int]]] = []  # (position, positions of the norms it is the joint norm of)
        self.shapes: list[Any] = []
        self.dtypes: list[Any] = []
        self.positions: list[int] = []  # where each slot's norm lies in the read-back values; NO_VALUE: none
        self.layouts: dict[int, str] = {}  # slot -> layout, for the few that are not strided
        self._chunks: list[tuple[Any, int]] = []  # (0-d or 1-d tensor of values, position of its first)
        self._read: list[tuple[int, float]] = []  # (position, value) of values read already (on the CPU)
        self._size = 0

    def value(self, tensor: Any) -> int:
        """Queue a 0-d or 1-d tensor's values for reading back; the position of the first."""
        position = self._size
        self._chunks.append((tensor, position))
        self._size += 1 if tensor.dim() == 0 else tensor.shape[0]
        return position

    def _norm_tensor(self, tensor: Any, out: Any = None) -> tuple[Any, bool]:
        """``(value, squared)``: the norm of ``tensor`` as a 0-d tensor on its device, or its square (a BLAS
        dot product, faster than a norm and more accurate on CPU); ``(None, False)`` for an exotic tensor.

        With ``out`` (a 0-d tensor of :meth:`_result_dtype`, or float64: :meth:`_norm` on a device), the value is
        written there, accumulated in ``out``'s dtype.
        """
        try:
            if tensor.layout is self._strided and tensor.dtype in self._dot_dtypes and (out is None or out.dtype is tensor.dtype):
                try:
                    if tensor.is_contiguous():
                        flat = tensor.view(-1)
                        return self._dot(flat, flat, out=out), True
                    if tensor.dim() == 2 and tensor.t().is_contiguous():  # a weight's gradient, transposed back
                        flat = tensor.t().view(-1)
                        return self._dot(flat, flat, out=out), True
                except (RuntimeError, NotImplementedError, TypeError):  # a subclass that cannot be flattened (an
                    pass  # unevenly sharded DTensor): a norm below
            if type(tensor) is self._plain and tensor.layout is self._strided and not tensor.is_contiguous():
                try:
                    return self._norm_of_runs(tensor, *_element_runs(tensor), out)
                except (RuntimeError, NotImplementedError, TypeError):  # a backend without an op for a strided
                    pass  # view (a dot of every other element): the norm below
            values = self._elements(tensor)
            wide = self._accumulate(tensor.dtype, out)
            if out is not None and type(tensor) is not self._plain:
                # a subclass's norm into a plain tensor: torch crashes on that mixture (an unevenly sharded
                # DTensor); its norm, made whole (a DTensor's is partial on each rank), is copied in
                norm = self._vector_norm(values, **wide)
                whole = getattr(norm, "full_tensor", None)
                out.copy_(whole() if whole is not None else norm)
                return out, False
            return self._vector_norm(values, out=out, **wide), False
        except Exception:
            return None, False

    def _norm_of_runs(self, tensor: Any, runs: tuple[tuple[int, int], ...], repeat: int, out: Any) -> tuple[Any, bool]:
        """:meth:`_norm_tensor` of a plain strided tensor that is not contiguous, from its runs
        (:func:`_element_runs`): its elements, each once (an expanded tensor's norm is theirs times the square
        root of how often it reads each); one run of them read flat (a BLAS dot product: attention heads
        moved, every other element), or the rows of the innermost run normed row by row, then together (a
        slice of rows, a chunk of a projection: a quarter of the time of a norm over every dimension at once,
        and a float32 sum of far fewer terms), or, where rows are short, a norm of them all."""
        values = tensor.as_strided(tuple(size for _, size in reversed(runs)), tuple(stride for stride, _ in reversed(runs)))
        dtype = tensor.dtype
        wide = self._accumulate(dtype, out)
        if dtype in self._dot_dtypes and len(runs) <= 1 and (out is None or out.dtype is dtype):
            flat = values.reshape(-1)  # (one element: no runs, a 0-d tensor)
            norm, squared = self._dot(flat, flat), True
        elif len(runs) > 1 and runs[0][1] >= ROW_NUMEL:
            rows = self._vector_norm(values, dim=-1, **wide).reshape(-1)
            norm, squared = self._dot(rows, rows), True
        else:
            norm, squared = self._vector_norm(values, **wide), False
        if repeat > 1:
            norm = norm * (repeat if squared else math.sqrt(repeat))
        if out is None:
            return norm, squared
        out.copy_(norm)
        return out, squared

    def _accumulate(self, dtype: Any, out: Any) -> dict[str, Any]:
        """The ``dtype`` keyword of a norm of ``dtype`` elements: float64 where it goes into a float64 ``out`` (a
        device's norm: :meth:`_norm`), else float32, so bf16/fp16 gradients do not overflow it; none for float64
        and complex elements (their own dtype)."""
        if dtype in self._wide:
            return {}
        return {"dtype": self._float64 if out is not None and out.dtype is self._float64 else self._float32}

    def _elements(self, tensor: Any) -> Any:
        """The tensor, or a sparse tensor's stored values (an uncoalesced one's repeat indices: coalesced)."""
        if tensor.layout is self._strided:
            return tensor
        return tensor.coalesce().values() if tensor.is_sparse else tensor.values()

    def _out_of_range(self, tensor: Any, norm: Any, squared: bool) -> bool:
        """Whether a norm (or its square; or any of a 1-d tensor of norms) may be wrong although the tensor's
        elements are finite: small enough that their squares may have underflowed (float32 elements all
        below about 1e-19 read as 0), or infinite, as squares that overflow make it. Known only where the
        norm can be read at once (:meth:`_readable_now`); elsewhere such a norm stays as it is."""
        tiny = self._tiny.get(norm.dtype)
        if tiny is None or tensor.numel() == 0 or not self._readable_now(tensor, norm):
            return False  # (an empty tensor's norm is 0, and it has no largest element)
        limit = tiny[0] if squared else tiny[1]
        if norm.dim() == 0:
            value = norm.item()
            return value < limit or value == math.inf
        values = norm.tolist()  # read in Python: a few tensor ops cost more, after backward's ops left the caches
        return any(map(limit.__gt__, values)) or math.inf in values

    def _readable_now(self, tensor: Any, norm: Any) -> bool:
        """Plain tensors (a tensor subclass's read may be a collective) on a device read at once."""
        return type(norm) is self._plain and type(tensor) is self._plain and self._reads_at_once(tensor)

    def _reads_at_once(self, tensor: Any) -> bool:
        """A plain tensor on the CPU: reading a value there costs no synchronisation with a device.
        (``is_cpu``, not ``device.type``, which makes a string: this runs for every large gradient.)"""
        return tensor.is_cpu

    def _scaled_norm(self, tensor: Any, infinite: bool = True) -> Any:
        """:meth:`_scaled_norms` of one tensor's elements: a 0-d float64 norm."""
        return self._scaled_norms(self._elements(tensor).reshape(1, -1), infinite)[0]

    def _scaled_norms(self, rows: Any, infinite: bool = True) -> Any:
        """The norm of each row in float64, exact where a sum of squares in the rows' dtype underflows or
        overflows: float32, bf16 and fp16 rows are normed in float64, which holds their squares; float64
        and complex rows are scaled by each row's largest element first. A row with an infinity or a NaN
        keeps it. ``infinite`` False: no row holds an infinity (their sums of squares underflowed)."""
        torch = self._torch
        if rows.dtype in self._narrow:  # float64 holds their squares: one pass, no scaled copy
            if infinite and rows.numel() > INF_CHECK_NUMEL and self._reads_at_once(rows):
                # rows that hold an infinity (attention scores masked with -inf) have infinite norms: known from
                # their largest and least elements in a quarter of the time of a norm in float64 on a 1 MB row
                # (aminmax(dim=-1) is slower than the two on a long row)
                if bool(((rows.amax(dim=-1) == math.inf) | (rows.amin(dim=-1) == -math.inf)).all()):
                    return torch.full(rows.shape[:-1], math.inf, dtype=self._float64, device=rows.device)
            return self._vector_norm(rows, dim=-1, dtype=self._float64)
        if rows.shape[-1] == 0:  # empty rows (no largest element to scale by): their norms are 0
            return torch.zeros(rows.shape[:-1], dtype=self._float64, device=rows.device)
        largest = self._vector_norm(rows, ord=math.inf, dim=-1, keepdim=True)  # exact in any dtype
        if self._reads_at_once(rows) and not largest.any():  # all zeros (a dead branch): no scaled copy to make
            return largest.to(self._float64).reshape(rows.shape[:-1])
        if rows.dtype not in self._wide:  # bf16 and fp16 scaled in float32, not rounded again
            rows, largest = rows.to(self._float32), largest.to(self._float32)
        usable = (largest > 0) & largest.isfinite()
        scaled = rows / torch.where(usable, largest, torch.ones_like(largest))
        norms = largest.to(self._float64) * self._vector_norm(scaled, dim=-1, keepdim=True).to(self._float64)
        norms = torch.where(largest.isfinite(), norms, largest.to(self._float64))
        return norms.reshape(rows.shape[:-1])

    def _result_dtype(self, dtype: Any) -> Any:
        return self._float64 if dtype in self._double else self._float32

    def _norm(self, tensor: Any) -> int:
        """Queue the norm of one tensor; its position.

        A plain tensor on the CPU has its norm read at once (a float; the 0-d result is freed at once, and
        is read anyway to check its range: :meth:`_out_of_range`, inlined, as this runs for every large
        gradient). Elsewhere the norm is written into a preallocated buffer, read at the end: a small
        tensor allocated per norm and kept to the end would sit between the large blocks backward frees
        and allocates again (measured: twice the page faults of a plain backward on a CNN, and 20% of its
        time)."""
        if type(tensor) is self._plain and self._reads_at_once(tensor):
            dtype = tensor.dtype
            if dtype in self._dot_dtypes and tensor.layout is self._strided and tensor.is_contiguous():
                # _norm_tensor()'s usual case, inlined (a fresh result: faster than out=, a view and a write); its
                # fallbacks are for tensor subclasses, and a plain contiguous tensor always flattens
                flat = tensor if tensor.dim() == 1 else tensor.view(-1)
                value, squared = self._sum_of_squares(flat), True
                least, smallest = self._tiny[dtype]
                if value < least and flat.numel():
                    # squares that underflow (vanishing gradients): every element is below the least norm, so
                    # the elements divided by it square without underflow (unless far smaller), nor overflow. A
                    # second dot product: a quarter to a seventh of the time of a norm in float64 on 256k to 4M
                    # elements. The float64 norm below only where these squares underflow too
                    scaled = flat * (1.0 / smallest)
                    rescaled = self._sum_of_squares(scaled)
                    if least <= rescaled < math.inf:
                        return self._read_now(math.sqrt(rescaled) * smallest)
            else:
                norm, squared = self._norm_tensor(tensor)
                if norm is None:
                    return NO_VALUE
                value = norm.item()
            tiny = self._tiny[self._result_dtype(dtype)]
            if (value < tiny[0 if squared else 1] or value == math.inf) and tensor.numel():
                return self.value(self._scaled_norm(tensor, value == math.inf))
            return self._read_now(math.sqrt(value) if squared else value)
        # on a device, where reading a norm to check its range would synchronise: bf16, fp16 and float32 elements
        # are normed in float64, which holds their squares; float64 and complex ones scaled by their largest
        dtype, device = tensor.dtype, tensor.device
        exact = self._exact_dtype(device)
        if dtype in self._wide and type(tensor) is self._plain and exact is self._float64:
            return self.value(self._scaled_norm(tensor, False))
        key = (device, exact if dtype in self._narrow else self._result_dtype(dtype))
        buffer = self._buffers.get(key)
        if buffer is None or buffer[2] == OUT_CHUNK:
            values = self._torch.empty(OUT_CHUNK, dtype=key[1], device=key[0])
            buffer = self._buffers[key] = [values, self.value(values), 0]
        values, first, used = buffer
        if key[1] is self._float64 and dtype in self._narrow and tensor.numel() >= WIDE_ON_DEVICE_NUMEL and self._wide_in_place(tensor, values[used]):
            norm, squared = values, False
        else:
            norm, squared = self._norm_tensor(tensor, out=values[used])
        if norm is None:
            return NO_VALUE
        buffer[2] = used + 1
        if squared:
            self._squared.append(first + used)
        return first + used

    def _sum_of_squares(self, flat: Any) -> float:
        """A 1-d CPU tensor's sum of squares by BLAS dot products: one, or one per DOT_CHUNK elements added in
        float64 past CHUNKED_DOT_NUMEL (a single float32 dot over 38M elements of an embedding's gradient
        was 7e-4 off, by chunks 2e-6, for an eighth more time)."""
        if flat.numel() <= CHUNKED_DOT_NUMEL or flat.dtype is self._float64:  # (float64 holds the sum)
            return self._dot(flat, flat).item()
        dot = self._dot
        return self._torch.stack([dot(part, part) for part in flat.split(DOT_CHUNK)]).sum(dtype=self._float64).item()

    def _wide_in_place(self, tensor: Any, out: Any) -> bool:
        """Write a large float32/bf16/fp16 tensor's norm into the float64 ``out`` with its squares summed in float64,
        without a float64 copy of it (see WIDE_ON_DEVICE_NUMEL); False, with nothing written, for a tensor that is
        not plain or fills no block of memory (:func:`_flat_block`), where this torch's ``_foreach_norm`` takes no
        dtype, or where the device has no kernel for it."""
        block = _flat_block(tensor) if self._foreach_norm is not None and type(tensor) is self._plain and tensor.layout is self._strided else None
        if block is None:
            return False
        try:
            norm = self._foreach_norm([block], 2, dtype=out.dtype)[0]
        except (RuntimeError, NotImplementedError):  # no such kernel here
            return False
        out.copy_(norm)
        return True

    def _exact_dtype(self, device: Any) -> Any:
        """The dtype a device's bf16, fp16 and float32 tensors are normed in: float64, which holds their squares,
        where the device has it; float32 where it has not (Apple's MPS), their range then unchecked."""
        exact = self._exact.get(device)
        if exact is None:
            try:
                self._torch.empty(1, dtype=self._float64, device=device)  # (MPS refuses float64 here; no kernel runs)
                exact = self._float64
            except Exception:
                exact = self._float32
            self._exact[device] = exact
        return exact

    def _read_now(self, norm: float) -> int:
        """Queue a norm read already; its position."""
        position = self._size
        self._size += 1
        self._read.append((position, norm))
        return position

    def _new_slot(self, tensor: Any) -> int:
        slot = len(self.shapes)
        self.shapes.append(tensor.shape)
        self.dtypes.append(tensor.dtype)
        self._note_layout(slot, tensor.layout)
        return slot

    def _note_layout(self, slot: int, layout: Any) -> None:
        """A slot's layout, where it is not strided (``"sparse_coo"``, ``"sparse_csr"``, ...)."""
        if layout is not self._strided:
            self.layouts[slot] = str(layout).removeprefix("torch.")

    def now(self, tensor: Any) -> int:
        """A new slot for ``tensor``, its norm queued at once."""
        slot = len(self.shapes)  # _new_slot(), inlined: this runs for every large gradient
        self.shapes.append(tensor.shape)
        self.dtypes.append(tensor.dtype)
        layout = tensor.layout
        if layout is not self._strided:
            self._note_layout(slot, layout)
        self.positions.append(self._norm(tensor))
        return slot

    def unknown(self, tensor: Any) -> int:
        """A new slot for ``tensor`` whose norm is not known (its elements have changed since)."""
        slot = self._new_slot(tensor)
        self.positions.append(NO_VALUE)
        return slot

    def alias(self, tensor: Any, slot: int) -> int:
        """A new slot for ``tensor``, whose norm is that of ``slot`` (the same elements)."""
        new = self._new_slot(tensor)
        self.positions.append(self.positions[slot])
        return new

    def batch(self, tensors: list[Any], ids: list[int] | None = None, wide: bool = False) -> dict[int, int]:
        """A slot for each distinct tensor (by object; ``ids``, if given, are their ids), norms taken one op
        per shape and dtype; ``wide``: some are large, on a device, where they are normed by one op per dtype
        whatever their shapes (:meth:`_device_batch`), which costs more Python per tensor than the stacks of
        small ones.

        Returns ``id(tensor) -> slot``, with ``id(None) -> -1``. The tensors must stay alive meanwhile, so
        ids are unique. Per tensor, only C-level iteration runs (maps, a sort); Python runs per group.
        """
        by_id = dict(zip(map(id, tensors) if ids is None else ids, tensors))
        by_id.pop(id(None), None)
        distinct = list(by_id.values())
        count = len(distinct)
        base = len(self.shapes)
        slots = dict(zip(by_id, range(base, base + count)))
        slots[id(None)] = -1
        dtypes = list(map(_DTYPE, distinct))
        self.dtypes += dtypes
        if wide and count and self._foreach_norm is not None and not self._reads_at_once(distinct[0]):
            self.positions += self._device_batch(distinct, base)
            self.shapes += map(_SHAPE, distinct)
            return slots
        if count > 1 and self._one_stack(distinct, dtypes):
            return slots
        shapes = list(map(_SHAPE, distinct))
        self.shapes += shapes
        try:
            # contiguous tensors apart: one strided member (an expanded gradient) makes a whole stack slow
            keys = list(zip(shapes, dtypes, map(self._torch.Tensor.is_contiguous, distinct), map(_LAYOUT, distinct)))
        except Exception:  # no strides (a sparse CSR tensor) or no layout (a tensor subclass): one by one
            for index, tensor in enumerate(distinct):
                self._note_layout(base + index, getattr(tensor, "layout", self._strided))
            self.positions += map(self._norm, distinct)
            return slots
        first_with_key: dict[tuple, int] = {}
        groups = list(map(first_with_key.setdefault, keys, range(count)))  # a group: its first member's index
        # each group's members together, in order (a stable sort)
        order = range(count) if len(first_with_key) == 1 else sorted(range(count), key=groups.__getitem__)
        in_order: list[int] = []  # the position of each tensor, in `order`
        for group, members in itertools.groupby(order, key=groups.__getitem__):
            members = list(members)
            _, dtype, _, layout = keys[group]
            if layout is not self._strided:
                for index in members:
                    self._note_layout(base + index, layout)
            if layout is not self._strided or len(members) == 1:
                in_order += map(self._norm, map(distinct.__getitem__, members))
                continue
            try:
                in_order += self._stacked_norms(self._torch.stack(list(map(distinct.__getitem__, members))), dtype)
            except Exception:  # tensors on several devices, or subclasses that refuse to stack: one by one
                in_order += map(self._norm, map(distinct.__getitem__, members))
        if len(first_with_key) == 1:
            self.positions += in_order
        else:
            positions = [NO_VALUE] * count
            deque(map(positions.__setitem__, order, in_order), maxlen=0)  # back in slot order
            self.positions += positions
        return slots

    def _device_batch(self, tensors: list[Any], base: int) -> list[int]:
        """The positions of the norms of a batch on a device (``base``: the first tensor's slot): float32, bf16 and
        fp16 tensors that fill one block of memory (contiguous, or a permutation of a contiguous one) with one
        multi-tensor norm per device and dtype, each element squared in float64 as it is read (no stack, no
        float64 copy: WIDE_ON_DEVICE_NUMEL), whatever their shapes; the others one by one (:meth:`_norm`). Only
        where this torch's ``_foreach_norm`` takes a dtype (2.4 and later)."""
        plain, strided, narrow, float64 = self._plain, self._strided, self._narrow, self._float64
        groups: dict[tuple, list[int]] = {}
        blocks: list[Any] = []  # each tensor's block of memory, read flat (_flat_block); None for the others
        for tensor in tensors:
            block = None
            if type(tensor) is plain and tensor.layout is strided and tensor.dtype in narrow and not self._reads_at_once(tensor):
                block = _flat_block(tensor)
                if block is not None and self._exact_dtype(tensor.device) is float64:
                    groups.setdefault((tensor.device, tensor.dtype), []).append(len(blocks))
                else:
                    block = None
            blocks.append(block)
        positions = [NO_VALUE] * len(tensors)
        for members in groups.values():
            try:
                norms = self._foreach_norm([blocks[index] for index in members], 2, dtype=float64)
            except (RuntimeError, NotImplementedError):  # no such kernel here: one by one
                continue
            first = self.value(self._torch.stack(norms))
            for offset, index in enumerate(members):
                positions[index] = first + offset
                blocks[index] = _MISSING  # normed
        for index, (tensor, block) in enumerate(zip(tensors, blocks)):
            if block is not _MISSING:
                if tensor.layout is not strided:
                    self._note_layout(base + index, tensor.layout)
                positions[index] = self._norm(tensor)
        return positions

    def _one_stack(self, tensors: list[Any], dtypes: list[Any]) -> bool:
        """The norms of tensors of one shape and one dtype, all contiguous, with one stack (the usual batch on
        a graph of tiny ops): what :meth:`batch` would do with them as one group, without grouping. False,
        with nothing queued, for any other batch."""
        torch = self._torch
        dtype = dtypes[0]
        try:
            # (a sparse tensor is not contiguous, or has no is_contiguous; an MKL-DNN one does not stack)
            if dtypes.count(dtype) != len(dtypes) or not all(map(torch.Tensor.is_contiguous, tensors)):
                return False
            stacked = torch.stack(tensors)  # raises unless every shape is the same
        except Exception:
            return False
        if stacked.layout is not self._strided:  # any other layout that stacks: the groups' way, one by one
            return False
        self.positions += self._stacked_norms(stacked, dtype)
        self.shapes += itertools.repeat(tensors[0].shape, len(tensors))
        return True

    def _stacked_norms(self, stacked: Any, dtype: Any) -> range:
        """Queue the norm of each of the stacked tensors (one op); their positions."""
        rows = stacked.reshape(len(stacked), math.prod(stacked.shape[1:]))  # (-1 fails on empty tensors)
        readable = self._readable_now(stacked, stacked)
        if dtype in self._narrow and (rows.numel() <= DIRECT_WIDE_NUMEL or not readable):
            # float64 holds their squares: no range to check (as on a device, where it cannot be read to check)
            norms = self._vector_norm(rows, dim=1, dtype=self._float64 if readable else self._exact_dtype(rows.device))
        elif dtype in self._wide and not readable and self._exact_dtype(rows.device) is self._float64:
            norms = self._scaled_norms(rows, False)  # on a device: scaled, its range unchecked
        else:
            norms = self._vector_norm(rows, dim=1) if dtype in self._wide else self._vector_norm(rows, dim=1, dtype=self._float32)
            if self._out_of_range(stacked, norms, False):  # only those rows are taken again
                suspect = (norms < self._tiny[norms.dtype][1]) | norms.isinf()
                norms = self._torch.where(suspect, self._scaled_norms(rows), norms.to(self._float64))
        first = self.value(norms)
        return range(first, first + len(norms))

    def joint(self, slots: list[int], numel: int) -> int:
        """One slot for several tensors slotted already (the outputs of one multi-output op, which views of
        each may share: :meth:`_TraceSession._slot_now`): their joint norm, the root of the sum of their
        squares, taken from their norms as they are read (:meth:`read`)."""
        slot = len(self.shapes)
        self.shapes.append((numel,))
        self.dtypes.append(self.dtypes[slots[0]])
        if slots[0] in self.layouts:  # (not strided: as its first part)
            self.layouts[slot] = self.layouts[slots[0]]
        positions = [self.positions[part] for part in slots]
        if NO_VALUE in positions:
            self.positions.append(NO_VALUE)
        else:
            self.positions.append(self._size)
            self._joints.append((self._size, positions))
            self._size += 1
        return slot

    def read(self) -> list[float | None]:
        """Every queued value as a float, in one transfer per device."""
        torch = self._torch
        values: list[float | None] = [None] * self._size
        by_device: dict[Any, dict[tuple, list[tuple[Any, int]]]] = {}
        for chunk in self._chunks:  # per device, 0-d values are stacked and 1-d ones joined, per dtype
            tensor = chunk[0]
            groups = by_device.setdefault(tensor.device, {})
            groups.setdefault((tensor.dim() == 0, tensor.dtype), []).append(chunk)
        for device, groups in by_device.items():
            exact = self._exact_dtype(device)  # float64, but where the device has none (MPS)
            try:
                flat = torch.cat(
                    [(torch.stack if zero_d else torch.cat)([t for t, _ in group]).to(exact) for (zero_d, _), group in groups.items()]
                ).tolist()
            except Exception:  # tensor subclasses that refuse to stack: one by one
                for group in groups.values():
                    for tensor, start in group:
                        try:
                            chunk_values = tensor.reshape(-1).tolist()
                        except Exception:
                            continue
                        values[start : start + len(chunk_values)] = chunk_values
                continue
            offset = 0
            for (zero_d, _), group in groups.items():
                for tensor, start in group:
                    count = 1 if zero_d else tensor.shape[0]
                    values[start : start + count] = flat[offset : offset + count]
                    offset += count
        for position in self._squared:
            if values[position] is not None:
                values[position] = math.sqrt(values[position])
        for position, value in self._read:
            values[position] = value
        for position, parts in self._joints:  # after every value they are made of
            norms = [values[part] for part in parts]
            values[position] = None if None in norms else math.hypot(*norms)  # (no square leaves a float)
        return values

    def records(self, values: list[float | None]) -> list[GradStat | None]:
        """A GradStat per slot, plus ``None`` at the end (so slot -1 reads as "no gradient")."""
        names = {dtype: _dtype_name(dtype) for dtype in set(self.dtypes)}
        shapes = {shape: tuple(shape) for shape in set(self.shapes)}  # one tuple per distinct shape
        norms = map([*values, None].__getitem__, self.positions)  # NO_VALUE (-1) reads the None
        layouts = map(self.layouts.get, range(len(self.shapes))) if self.layouts else itertools.repeat(None)
        fields = zip(map(shapes.__getitem__, self.shapes), map(names.__getitem__, self.dtypes), norms, layouts)
        records: list[GradStat | None] = list(_named_tuples(GradStat, fields))
        records.append(None)
        return records


class _TraceSession:
    """The mutable state of one trace; turned into a frozen Trace by :meth:`finish`.

    Nodes are numbered as discovery finds them (0 is the loss's ``grad_fn``); what is known of
    each lies in lists indexed by that number. Hooks only log what they see: three items per call, ``node
    id, grad_inputs, grad_outputs``, in execution order, in one flat list (no tuple per call). Statistics
    are slots whose norms are queued at once for large tensors and leaves (such a call's gradients are
    lists of slots) and in batches for small ones (tuples of tensors until :meth:`flush`, which leaves
    the node id alone in the call's place).
    """

    def __init__(self, leaves: dict[int, _Leaf], input_names: dict[int, str], tracker: _ModuleTracker):
        import torch

        self._torch = torch
        self._plain, self._strided = torch.Tensor, torch.strided
        self._leaf_type = torch._C._functions.AccumulateGrad
        self._custom_type = torch.autograd.function.BackwardCFunction
        self._current_node = getattr(torch._C, "_current_autograd_node", None)  # the node running in this thread
        # a tensor inside a torch.func transform (vmap's batched one, grad's or functionalize's wrapper): its node,
        # if any, is of the transform's own graph, never the traced one, and its elements cannot be read outside
        self._in_transform = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", _never)
        self.stats = _Stats()
        self.leaves = leaves
        self.input_names = input_names
        self.tracker = tracker
        self.nodes: list[Any] = []
        self.leaf_ids: list[int] = []  # the AccumulateGrad nodes
        self.next: list[tuple[int | None, ...]] = []
        # node -> node id (nodes compare and hash by identity)
        self.index: dict[Any, int | None] = {None: None}
        self.handles: list[Any] = []  # what register_hook returned: our hooks' dicts (see _node_hooks), or handles
        # hook dicts of the user's held back while the trace runs, and what they held: a leaf's post-accumulate-grad
        # hooks, and its AccumulateGrad node's post hooks (_hold_post_hooks); trace() puts them back
        self.held_hooks: list[tuple[dict, dict]] = []
        self.modes_in_backward = False  # whether the user's modes are active as backward starts (see on_run)
        self._hook_key = object()  # our hooks' key in those dicts
        # the hook dict of every ordinary node without hooks of the user's: the shared hook, under our key
        self._shared_hooks = _SharedHooks()
        self.handles.append(self._shared_hooks)
        self.log: list[Any] = []
        self.flushed = 0  # items before this one are node ids (a call each), their slots in self.slotted
        # per flush, in call order: how many gradients each call sent, and received; the slots of all it sent, and
        # of all it received
        self.slotted: list[tuple[list[int], list[int], list[int], list[int]]] = []
        self._logged_now = False  # whether _log_now logged a call since the last flush
        # large gradients waiting on a device: id -> (tensor, its version when first logged), so that one a hook of the
        # user's changed in place before the flush is not read as what was sent (see flush)
        self._held_large: dict[int, tuple[Any, int]] = {}
        # norms queued one at a time, and flushes: hooks may run in two devices' threads (reentrant, so a hook
        # can never wait on a flush of its own thread)
        self._lock = threading.RLock()
        self._run_hook: Callable | None = None
        # id(tensor) -> (weak reference, version, slot): a large gradient a node sends on is usually the
        # very object the next node receives, so its norm is taken once
        self._seen: dict[int, tuple[Any, int, int]] = {}
        self._blocks: dict[tuple, tuple[Any, int, int]] = {}  # the same, per set of elements in memory (_elements_key)
        self.received: dict[int, list[list[int]]] = {}  # AccumulateGrad node -> grad_outputs slots, per call logged at once
        self.errors: list[tuple[str, str]] = []  # (where a hook failed, its traceback): reported after the step
        self.running_custom: list[int] = []
        # custom Function node -> what it received, before its backward ran, per call running (a backward may run its
        # own node again inside): per gradient, None or (the tensor, its version, a copy of a small one or the slot
        # of a large one)
        self._received_at_start: dict[int, list[list[tuple[Any, int, Any] | None]]] = {}
        self.modes: list[Any] = []
        self._mode_class = _discovery_mode_class()
        self.created_in: dict[int, int | None] = {}  # nodes made during backward -> the node running then
        self.backward_modules: dict[int, str | None] = {}  # and the module active when they were made
        self.backward_sites: dict[int, Any] = {}  # and the user's line (or stack) that made them
        # and their sequence numbers and names, read as they are made: a reentrant checkpoint's recompute graph
        # is freed before the trace ends, and a custom Function's node then has neither (torch 2.1 crashes)
        self.backward_ids: dict[int, tuple[int, str]] = {}
        self.renumbered: dict[Any, int] = {}  # node made in forward in another thread -> its number in this one
        self.forward_stats = False
        self.forward_slots: dict[int, int] = {}  # node id -> slot of the forward value its op produced
        self.sites: _SiteRecorder | None = None
        self.replay = False
        self._replaying = False
        self.hook_dicts: dict[int, Any] = {}  # --replay: node id -> its post hooks (ours and any of the user's)
        self.replays: dict[int, tuple] = {}
        self.gradchecks: dict[int, Gradcheck] = {}
        # id(custom Function node) -> (node, class, args, kwargs, tensor mask), recorded in forward for
        # --gradcheck (the arguments) and --replay (which arguments were tensors)
        self.custom_calls: dict[int, tuple] = {}
        # id(grad_fn) -> (grad_fn, slot of the forward value it produced); the node is kept so its id stays its own
        self.forward_values: dict[int, tuple[Any, int]] = {}
        # forward values waiting for a batched norm: (their forward_values entry, the tensor, its version then)
        self.forward_pending: list[tuple[tuple[Any, int], Any, int]] = []
        self.param_grads: list[tuple[str, int]] = []

    # --- discovery -------------------------------------------------------------
    def discover(self, roots: Iterable[Any], in_backward: bool = False) -> None:
        """Number and hook every node reachable from ``roots`` that is not hooked yet."""
        nodes, index, nexts, handles = self.nodes, self.index, self.next, self.handles
        leaf_type, custom_type, partial, missing = self._leaf_type, self._custom_type, functools.partial, _MISSING
        repeat = itertools.repeat
        find, add_node, add_next, add_handle = index.get, nodes.append, nexts.append, handles.append
        shared_hooks = self._shared_hooks
        if self._run_hook is None:
            self._run_hook = self._make_run_hook()
            if not self.replay and self._current_node is not None:
                # with the node running asked of the engine, one hook for every ordinary node (see _node_hooks)
                dict.__setitem__(shared_hooks, self._hook_key, partial(self._run_hook, None))
        shared = shared_hooks.get(self._hook_key)
        on_run = self._on_run_now if self.replay else self._run_hook
        start, first_handle = len(nodes), len(handles)
        for root in roots:
            if root is not None and root not in index:
                index[root] = len(nodes)
                nodes.append(root)
        # breadth first: the new nodes are the queue (a list iterator sees what is appended meanwhile)
        for node in itertools.islice(nodes, start, None):
            children = []
            for child, _ in node.next_functions:
                child_id = find(child, missing)  # index maps None to None
                if child_id is missing:
                    child_id = index[child] = len(nodes)
                    add_node(child)
                children.append(child_id)
            add_next(tuple(children))
        new_ids = range(start, len(nodes))
        with _node_hooks(self._hook_key, shared, shared_hooks) as fast:
            if fast and shared is not None:
                # every ordinary node at once (one hook, one dict: see _node_hooks); the rest one by one below
                new_nodes = nodes[start:]
                # by type, each type asked once (6,000 nodes: 0.22 ms, against 0.33 by isinstance() per node)
                types = list(map(type, new_nodes))
                ordinary_types = {kind for kind in set(types) if not issubclass(kind, (leaf_type, custom_type))}
                ordinary = list(map(ordinary_types.__contains__, types))
                hooked = _register_shared(list(itertools.compress(new_nodes, ordinary)), shared, shared_hooks)
                # a node's own dict where it had hooks of the user's
                handles += itertools.compress(hooked, map(operator.is_not, hooked, repeat(shared_hooks)))
                new_ids = itertools.compress(new_ids, map(operator.not_, ordinary))
            for node_id in new_ids:
                node = nodes[node_id]
                if type(node) is leaf_type:
                    # before it runs: what arrived, before it lands in .grad, where a post-accumulate-grad hook
                    # (an optimizer step in backward) may change this very tensor in place. A small one waits for
                    # a batched norm, as an ordinary node's do: held, it is not the tensor that becomes .grad
                    # (AccumulateGrad takes a gradient as .grad only where nothing else holds it, and copies it
                    # otherwise), so nothing that changes .grad later (a second call's sum, an optimizer step)
                    # changes it; a large one is normed then (_log_now), as held it would cost a copy. A pre-hook
                    # gets grad_outputs alone; AccumulateGrad sends nothing on, its grad_inputs are ()
                    add_handle(node.register_prehook(partial(on_run, node_id, ())))
                    self.leaf_ids.append(node_id)
                    if fast:
                        self._hold_post_hooks(node)
                elif isinstance(node, custom_type):
                    add_handle(node.register_prehook(partial(self._on_custom_start, node_id)))
                    add_handle(node.register_hook(partial(self._on_custom_run, node_id)))
                else:
                    add_handle(node.register_hook(partial(on_run, node_id)))
        if self.replay:  # each node's post-hook dict: hooks of the user's there make a replay differ
            handle_iter = iter(handles[first_handle:])
            for node_id in range(start, len(nodes)):
                node = nodes[node_id]
                if type(node) is not leaf_type and isinstance(node, custom_type):
                    next(handle_iter)  # its pre-hook's
                handle = next(handle_iter)
                self.hook_dicts[node_id] = handle if isinstance(handle, dict) else handle.hooks_dict_ref()
        if in_backward and len(nodes) > start:
            # the line of the user's code whose op made them: a reentrant checkpoint's recompute runs the
            # checkpointed function again, so it is the line of the forward op that these nodes repeat
            site = self.sites.user_site(1) if self.sites is not None else None
            for node_id in range(start, len(nodes)):
                self.created_in[node_id] = self.running_custom[-1] if self.running_custom else None
                self.backward_modules[node_id] = self.tracker.current()
                self.backward_sites[node_id] = site
                self.backward_ids[node_id] = (nodes[node_id]._sequence_nr(), nodes[node_id].name())
        if self.forward_stats:
            self.flush_forward()
            with self._torch.no_grad():  # (the user's modes are set aside here already: trace(), discover_in_backward)
                for node_id in range(start, len(nodes)):
                    node = nodes[node_id]
                    if type(node) is leaf_type:  # a leaf's forward value is the tensor itself
                        if not _storage_freed(node.variable):
                            self.forward_slots[node_id] = self.stats.now(node.variable.detach())
                    else:
                        recorded = self.forward_values.get(id(node))
                        if recorded is not None:
                            self.forward_slots[node_id] = recorded[1]

    def record_forward(self, output: Any) -> None:
        """Queue the norm of an op's output tensors under the node that produced them.

        A plain tensor of up to SMALL_NUMEL elements waits for a batched norm (:meth:`flush_forward`), held
        with its version: the mode takes waiting values before an op that may change one in place, and a value
        changed by other means meanwhile is left unknown rather than read as changed (a write torch does not
        count, through NumPy's view of a tensor, is not seen: autograd does not see it either). A larger one is
        normed at once, as a gradient is (:meth:`_slot_now`)."""
        try:
            if type(output) is self._plain:  # most ops: one plain tensor (normed under no_grad: no graph)
                grad_fn = output.grad_fn
                if grad_fn is not None and not self._in_transform(output):
                    if output.numel() > SMALL_NUMEL:  # normed at once, once per set of elements in memory: a view that
                        with self._torch.no_grad():  # transposes or reshapes an output has its norm
                            self.forward_values[id(grad_fn)] = (grad_fn, self._slot_now(output))
                        return
                    entry = (grad_fn, NO_VALUE)  # until the flush, unless a later record of this node replaces it
                    self.forward_values[id(grad_fn)] = entry
                    self.forward_pending.append((entry, output, output._version))
                    if len(self.forward_pending) >= PENDING_CALLS:
                        self.flush_forward()
                return
            grouped: dict[int, list[Any]] = {}
            for tensor in _tensors_in(output, self._torch.Tensor):
                grad_fn = tensor.grad_fn
                if grad_fn is not None and not self._in_transform(tensor):
                    grouped.setdefault(id(grad_fn), [grad_fn]).append(tensor)
            with self._torch.no_grad():
                for key, (grad_fn, *tensors) in grouped.items():
                    slots = list(map(self._slot_now, tensors))  # views of a chunk share its norm
                    slot = slots[0] if len(slots) == 1 else self.stats.joint(slots, sum(t.numel() for t in tensors))
                    self.forward_values[key] = (grad_fn, slot)
        except Exception:  # never break the user's forward; report after it
            self.errors.append((RECORDING_FORWARD, traceback.format_exc()))

    # the same, with the user's modes set aside, for a custom Function's output (_ForwardMode asks for itself, per op)
    record_output = _out_of_user_modes(record_forward)

    @_out_of_user_modes
    def flush_forward(self) -> None:
        """Take the norms of the forward values that wait (:meth:`record_forward`), in batches."""
        pending, self.forward_pending = self.forward_pending, []
        if not pending:
            return
        try:
            with self._torch.no_grad():
                slots = self.stats.batch([tensor for _, tensor, _ in pending])
            values = self.forward_values
            # a loop: faster here than map() passes, which make a list each (256 values: 126 against 181 µs)
            for entry, tensor, version in pending:
                grad_fn = entry[0]
                if values.get(id(grad_fn)) is entry:  # not recorded again since (the node's last record stands)
                    # a value whose tensor changed since, out of the mode's sight, has none
                    values[id(grad_fn)] = (grad_fn, slots[id(tensor)] if tensor._version == version else NO_VALUE)
        except Exception:  # never break the user's forward; report after it
            self.errors.append((RECORDING_FORWARD, traceback.format_exc()))

    def _hold_post_hooks(self, node: Any) -> None:
        """Hold back the user's post hooks on an AccumulateGrad node while the trace runs, as post-accumulate-grad
        hooks are: the older form of the same thing (Megatron's and DeepSpeed's ``main_grad`` buffers, FSDP1's
        reduction), which adds ``.grad`` into state of the user's. Run during a trace, a step mid-training would
        count one micro-batch twice. (The engine ignores what such a hook returns: it cannot change a gradient.)
        Inside :func:`_node_hooks` only, whose probe reads the node's hook dict without adding one."""
        try:
            hooks = node.register_hook(_PROBE)
        except _NoHookDict:
            return
        if hooks:
            self.held_hooks.append((hooks, dict(hooks)))
            hooks.clear()

    @_out_of_user_modes
    def discover_in_backward(self, output: Any) -> None:
        if self._replaying:  # nodes a replay makes (a custom backward's own autograd, run again) are not this backward's
            return
        try:
            roots = [t.grad_fn for t in _tensors_in(output, self._torch.Tensor) if t.grad_fn is not None]
            if roots:
                self.discover(roots, in_backward=True)
        except Exception:  # never break the user's backward; report after it
            self.errors.append((DURING_BACKWARD, traceback.format_exc()))

    # --- hooks -------------------------------------------------------------------
    def _make_run_hook(self) -> Callable[[int, tuple, tuple], None]:
        """The hook of an ordinary node (bound to its id by a partial; the shared hook, by None) and the pre-hook
        of an AccumulateGrad (bound to its id and ``()``): a closure, as it runs once per node."""
        session, log = self, self.log.extend
        # what waits is weighed in elements, a call as much as PENDING_CALLS calls fill PENDING_NUMEL
        small, most, per_call = SMALL_NUMEL, PENDING_NUMEL, PENDING_NUMEL // PENDING_CALLS

        waiting = 0  # elements, since this hook last flushed
        node_of, current, stats, held = self.index.get, self._current_node, self.stats, self._held_large.setdefault
        function_modes, dispatch_modes, torch = self._torch._C._len_torch_function_stack, self._torch._C._len_torch_dispatch_stack, self._torch

        def on_run(node_id: int | None, grad_inputs: tuple, grad_outputs: tuple, aside: bool = False) -> None:
            """Log the call. Small gradients wait (held) for a batched norm; a large one is not kept: the
            norms of a call's gradients are queued at once if one has more than SMALL_NUMEL elements.
            ``node_id`` None: the shared hook's call, for the node the engine runs in this thread.
            Not used with --replay, so no replayed call comes here."""
            nonlocal waiting
            # the user's modes: set aside, this hook called again (asked only where some were active as backward
            # started: two C calls per node otherwise, 2% of a graph of tiny ops)
            if not aside and session.modes_in_backward and (function_modes() or dispatch_modes()):
                with _modes_set_aside(torch):
                    return session._run_hook(node_id, grad_inputs, grad_outputs, True)  # (by name: no cycle)
            try:
                if node_id is None:
                    node_id = node_of(current())
                    if node_id is None:
                        raise RuntimeError("the autograd engine names no node of this graph as running")
                size = per_call
                for grad in grad_inputs + grad_outputs:  # a loop: faster than map() and filter() on a few items
                    if grad is not None:
                        numel = grad.numel()
                        # normed at once: a large gradient on the CPU, or one that alone fills what may wait; on a
                        # device, where a norm costs a kernel launch however small it is, one waits for a batch
                        if numel > small:
                            if numel > most or stats._foreach_norm is None or stats._reads_at_once(grad):
                                session._log_now(node_id, grad_inputs, grad_outputs)
                                return None
                            held(id(grad), (grad, grad._version))  # its version when first logged (see flush)
                        size += numel
                log((node_id, grad_inputs, grad_outputs))  # one C call: a flush never sees part of it
                waiting += size
                if waiting > most:
                    waiting = 0
                    session.flush()
            except Exception:  # never break the user's backward; report after it
                session.errors.append((DURING_BACKWARD, traceback.format_exc()))
            return None

        return on_run

    def _on_custom_start(self, node_id: int, grad_outputs: Any) -> None:
        """A custom Function's backward is about to run: Python that may change gradients in place, or
        make nodes. Norms still pending are taken first, and a mode hooks the nodes its ops make (on top of
        the user's modes, which are set aside meanwhile: see _modes_set_aside)."""
        self._before_custom(node_id, grad_outputs)
        try:
            mode = self._mode_class(self)
            mode.__enter__()
            self.modes.append(mode)
            self.running_custom.append(node_id)
        except Exception:  # never break the user's backward; report after it
            self.errors.append((DURING_BACKWARD, traceback.format_exc()))

    @_out_of_user_modes
    def _before_custom(self, node_id: int, grad_outputs: Any) -> None:
        try:
            self.flush()
            if not self._replaying:
                # what it receives, before it runs: a backward that changes it in place (g.mul_(2)) would show what
                # it made of it, and a replay would run on that (and change it again, for the nodes after it). A
                # small gradient is copied (its norm is taken in a batch, of the copy where the backward changed
                # it), a large one normed now (as it would be when logged: the same slot then, if unchanged)
                arrived = []
                for grad in grad_outputs:
                    if grad is None:
                        arrived.append(None)
                    elif grad.numel() <= SMALL_NUMEL:
                        arrived.append((grad, grad._version, grad.detach().clone()))
                    else:
                        with self._outside_graph(), self._lock:
                            arrived.append((grad, grad._version, self._slot_now(grad)))
                self._received_at_start.setdefault(node_id, []).append(arrived)  # (a backward may run it again inside)
        except Exception:  # never break the user's backward; report after it
            self.errors.append((DURING_BACKWARD, traceback.format_exc()))

    def _on_custom_run(self, node_id: int, grad_inputs: tuple, grad_outputs: tuple) -> None:
        try:
            if self.running_custom and self.running_custom[-1] == node_id:
                self.running_custom.pop()
                self.modes.pop().__exit__(None, None, None)  # (the top mode: before the user's are set aside)
        except Exception:
            self.errors.append((DURING_BACKWARD, traceback.format_exc()))
        return self._after_custom(node_id, grad_inputs, grad_outputs)

    @_out_of_user_modes
    def _after_custom(self, node_id: int, grad_inputs: tuple, grad_outputs: tuple) -> None:
        try:
            calls = self._received_at_start.get(node_id)
            arrived = calls.pop() if calls else None
            changed = arrived is not None and any(a is not None and _changed_since(*a) for a in arrived)
        except Exception:
            self.errors.append((DURING_BACKWARD, traceback.format_exc()))
            changed = False
        if not changed or self._replaying:
            return (self._on_run_now if self.replay else self._run_hook)(node_id, grad_inputs, grad_outputs)
        try:  # its backward changed what it received: that is logged as it arrived, and not replayed
            with self._outside_graph(), self._lock:
                received = [-1 if a is None else a[2] if isinstance(a[2], int) else self._slot_now(a[2]) for a in arrived]
                for entry in arrived:  # a norm taken of them before is not theirs now (a change through .data keeps
                    if entry is not None:  # the version the tables go by)
                        self._seen.pop(id(entry[0]), None)
                        self._blocks.pop(self._elements_key(entry[0]), None)
            self._log_now(node_id, grad_inputs, grad_outputs, received=received)
            if self.replay and node_id not in self.replays:
                self.replays[node_id] = (None, None, CHANGED_IN_PLACE)
        except Exception:
            self.errors.append((DURING_BACKWARD, traceback.format_exc()))
        return None

    @_out_of_user_modes
    def _on_run_now(self, node_id: int, grad_inputs: tuple, grad_outputs: tuple) -> None:
        """Any node with ``--replay``: statistics now, then the node is run again from what it received."""
        if self._replaying:
            return None
        try:
            self._log_now(node_id, grad_inputs, grad_outputs)
            if self.replay and node_id not in self.replays:
                self.replays[node_id] = self._replay(node_id, grad_inputs, grad_outputs)
        except Exception:
            self.errors.append((DURING_BACKWARD, traceback.format_exc()))
        return None

    def _log_now(self, node_id: int, grad_inputs: tuple, grad_outputs: tuple, received: list[int] | None = None) -> None:
        """Log a call with slots whose norms are queued now (lists: a flush tells them from tuples of tensors).
        An AccumulateGrad's are kept per call too (:attr:`received`): its ``.grad`` may be this very tensor,
        whose norm :meth:`record_param_grads` then reuses. ``received``: the slots of ``grad_outputs`` taken
        already (a custom Function's, before its backward ran)."""
        if self._torch.is_grad_enabled():  # backward(create_graph=True): statistics stay out of the graph
            with self._torch.no_grad():
                self._log_now(node_id, grad_inputs, grad_outputs, received)
            return
        slot_now = self._slot_now
        with self._lock:
            if received is None:
                received = list(map(slot_now, grad_outputs))
            self.log.extend((node_id, list(map(slot_now, grad_inputs)), received))
            self._logged_now = True
            if not grad_inputs and type(self.nodes[node_id]) is self._leaf_type:
                self.received.setdefault(node_id, []).append(received)

    def _outside_graph(self) -> contextlib.AbstractContextManager:
        """``no_grad()`` where grad mode is on (backward(create_graph=True) runs hooks in it, and flush() runs
        after backward too), so statistics stay out of the graph; nothing to do in a plain backward."""
        return self._torch.no_grad() if self._torch.is_grad_enabled() else _NO_CONTEXT

    def _slot_now(self, grad: Any) -> int:
        """The slot of a gradient, its norm queued once per tensor object and version, and once per set of
        elements in memory (:meth:`_elements_key`): a transposed view (``TBackward0`` sends on its input's
        transpose) has the same norm."""
        if grad is None:
            return -1
        key, version = id(grad), grad._version
        seen = self._seen.get(key)
        # the same object with the same version: the engine accumulates gradients in place
        if seen is not None and seen[1] == version and seen[0]() is grad:
            return seen[2]
        block = self._elements_key(grad)
        same = self._blocks.get(block) if block is not None else None
        # the same elements while the first tensor lives (its memory cannot be reused), unchanged since
        if same is not None and same[1] == version and same[0]() is not None:
            slot = self.stats.alias(grad, same[2])
            self._seen[key] = (weakref.ref(grad), version, slot)
            return slot
        slot = self.stats.now(grad)
        entry = (weakref.ref(grad), version, slot)  # one weak reference for both tables
        if block is not None:
            self._blocks[block] = entry
        self._seen[key] = entry
        return slot

    def _elements_key(self, grad: Any) -> tuple | None:
        """What a plain strided tensor reads of memory, as a key that two tensors share only if they read the
        same elements as often (then they have the same norm): ``(address, numel, dtype, device)`` where they
        fill one block exactly (contiguous, or a permutation of a contiguous tensor: :func:`_fills_block`),
        ``(address, runs, repeat, dtype, device)`` for others (:func:`_element_runs`: a view that reshapes or
        transposes a slice of attention heads shares the slice's norm); None for other tensors.

        A tensor subclass's ``data_ptr()`` need not be an address (a DTensor's is its offset in a
        storage it does not hold): only plain tensors qualify."""
        try:
            if type(grad) is not self._plain or grad.layout is not self._strided:
                return None
            if grad.is_contiguous():
                return (grad.data_ptr(), grad.numel(), grad.dtype, grad.device)
            runs, repeat = _element_runs(grad)
            if _fills_block(runs, repeat):
                return (grad.data_ptr(), grad.numel(), grad.dtype, grad.device)
            return (grad.data_ptr(), runs, repeat, grad.dtype, grad.device)  # the same elements, as often
        except Exception:  # a tensor subclass without storage
            pass
        return None

    def flush(self) -> None:
        """Take the norms of the gradients that wait in the log, in batches. Each call logged since the last
        flush becomes its node id, its statistics a block of :attr:`slotted`."""
        with self._lock:
            # calls up to `end`: a hook on another device's thread may log meanwhile, for the next flush
            start, end = self.flushed, len(self.log)
            if start == end:
                return
            logged = self.log[start:end]
            held = self._held_large.copy()  # (the dict itself stays: the hook holds its setdefault)
            self._held_large.clear()
            chain = itertools.chain.from_iterable
            sent, received = logged[1::3], logged[2::3]
            grads = list(chain(sent))
            count_sent = len(grads)
            grads += chain(received)
            ids = list(map(id, grads))
            with self._outside_graph():
                if self._logged_now:  # some calls' slots are in place already (lists, from _log_now): only tuples wait
                    groups = sent + received
                    waiting = itertools.compress(groups, map(operator.is_, map(type, groups), itertools.repeat(tuple)))
                    slots = self.stats.batch(list(chain(waiting)), wide=bool(held))
                else:
                    slots = self.stats.batch(grads, ids, wide=bool(held))
            self._logged_now = False
            # a slot already in place stays: it is alive, as are the tensors, so its id is none of theirs
            in_place = list(map(slots.get, ids, grads))
            if held:
                # a large gradient changed in place since it was first logged (a tensor hook of the user's that changes
                # the gradient the next node receives): normed now, it is what that node received, not what was sent,
                # which is left unknown (small gradients: the README says so)
                changed = {key for key, (tensor, version) in held.items() if tensor._version != version}
                for index in itertools.compress(range(count_sent), map(changed.__contains__, ids)) if changed else ():
                    in_place[index] = self.stats.unknown(grads[index])
            self.slotted.append((list(map(len, sent)), list(map(len, received)), in_place[:count_sent], in_place[count_sent:]))
            self.log[start:end] = logged[0::3]
            self.flushed = start + len(sent)

    def _replay(self, node_id: int, grad_inputs: tuple, grad_outputs: tuple) -> tuple:
        """Run the node's backward again from the gradients it received; queue the largest difference.

        Returns ``(difference position, scale position, note)``; positions index the read-back values.
        """
        torch = self._torch
        node = self.nodes[node_id]
        if type(node) is self._leaf_type:
            return (None, None, "AccumulateGrad writes .grad: not replayed")
        name = node.name()
        if name == "CheckpointFunctionBackward":
            return (None, None, "recomputes its forward and runs a backward of its own: not replayed")
        if name == "CompiledFunctionBackward":
            return (None, None, "a torch.compile region's backward, which frees what it saved as it runs: not replayed")
        self._replaying = True
        try:
            with torch.no_grad():
                if isinstance(node, self._custom_type):
                    call = self.custom_calls.get(id(node))
                    outputs = call[5] if call is not None and call[0] is node else None
                    # on copies: Python of the user's may change what it gets in place, and these are the engine's
                    copies = tuple(None if grad is None else grad.clone() for grad in grad_outputs)
                    again = node.apply(*_materialized(node, copies, outputs))
                    again = again if isinstance(again, tuple) else (again,)
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
                    if original.numel() == 0:  # nothing to differ (HF's cache concatenates empty tensors)
                        continue
                    # the same NaN, or the same infinity, again is no difference; the scale is of finite elements
                    same = (replayed == original) | (replayed.isnan() & original.isnan())
                    diffs.append(torch.where(same, 0, (replayed - original).abs()).max().to(torch.float64))
                    scales.append(torch.where(original.isfinite(), original.abs(), 0).max().to(torch.float64))
                if not diffs:
                    return (None, None, "no gradient to compare")
                hooks = self.hook_dicts.get(node_id)
                note = USER_HOOKS if hooks is not None and len(hooks) > 1 else None
                return (self.stats.value(torch.stack(diffs).max()), self.stats.value(torch.stack(scales).max()), note)
        except Exception as exc:  # the node refused to run again: that is the finding
            if "backward through the graph a second time" in message_of(exc):  # it frees what it saved: no verdict
                return (None, None, f"could not run again, its saved tensors were freed as it ran: not replayed ({first_line(exc, 120)})")
            if type(exc).__name__ == "CheckpointError" or "already unpacked once" in message_of(exc):
                # a non-reentrant checkpoint recomputes what its nodes saved once per backward: no verdict either
                return (None, None, "could not run again, its saved tensors are a checkpoint's, recomputed once per backward: not replayed")
            if not isinstance(node, self._custom_type) and _raised_in_users_code(exc):
                # a built-in node runs no Python of the user's but saved-tensor hooks (unpacking): one that releases
                # what it stashed once unpacked (activation offloading) refuses a second run, which says nothing of it
                return (None, None, f"could not run again, a saved-tensor hook of yours refused ({first_line(exc, 120)}): not replayed")
            return (None, None, f"could not run again: {first_line(exc, 200)}")
        finally:
            self._replaying = False

    # --- result ------------------------------------------------------------------
    def run_gradchecks(self) -> None:
        """Check each custom Function node recorded in forward, and each one made in backward that ran (after
        backward: no hook is left)."""
        from .gradcheck import SKIPPED, check

        self.flush()
        ran = set(self.log)  # node ids, once flushed
        for node_id, node in enumerate(self.nodes):
            call = self.custom_calls.get(id(node))
            if call is not None and call[0] is node and (node_id not in self.created_in or node_id in ran):
                _, function_class, args, kwargs, _, _ = call
                result = check(function_class, args, kwargs)
                if result is not None:
                    self.gradchecks[node_id] = result
            elif isinstance(node, self._custom_type) and node_id not in self.created_in:
                function_class = getattr(node, "_forward_cls", None)
                if function_class is not None and function_class.__name__ not in SKIPPED:  # not applied through
                    self.gradchecks[node_id] = Gradcheck(None, None, UNRECORDED_CALL)  # Function.apply: unseen
        self.custom_calls.clear()

    def record_param_grads(self) -> None:
        """Queue each parameter's ``.grad`` as backward left it (under DDP: averaged across ranks).

        Where nothing can have changed it since, ``.grad`` holds what the parameter's AccumulateGrad
        received (that very tensor, or a copy: of a transposed view, or of a small gradient that waited
        for its norm): its statistics are reused rather than read again. Something can have changed it
        when ranks average gradients, when AccumulateGrad ran more than once, or when the parameter has
        post-accumulate-grad hooks (those it had before the trace are held while it runs; one registered
        in forward is not).
        """
        dist = self._torch.distributed
        averaged = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        once: dict[int, int] = {}  # id(parameter) -> slot of the gradient its AccumulateGrad received
        if not averaged:
            # what each leaf received: from the calls logged at once, or, where leaves are many among the calls
            # (a pass over every call costs less than norming their gradients again), from every call
            many = len(self.leaf_ids) * LEAF_SHARE >= len(self.log)
            for node_id, calls in (self._received_by_leaves() if many else self.received).items():
                variable = self.nodes[node_id].variable
                if len(calls) == 1 and len(calls[0]) == 1 and not getattr(variable, "_post_accumulate_grad_hooks", None):
                    once[id(variable)] = calls[0][0]
        small: list[tuple[int, Any]] = []  # (position in param_grads, gradient) of small ones: normed in one batch
        waited = not self.replay  # a small gradient waits for its norm in the hook, unless --replay takes every norm at once
        with self._torch.no_grad():
            for leaf in self.leaves.values():
                grad = leaf.tensor.grad
                if grad is None:
                    continue
                slot = once.get(id(leaf.tensor), -1)
                is_small = type(grad) is self._plain and grad.numel() <= SMALL_NUMEL
                # what AccumulateGrad received, unchanged since: the tensor itself (its version then, 0 here), or a
                # copy that nothing changed in place (a hook of the user's on the AccumulateGrad node may have: then
                # it is read again). A gradient that waited for its norm (a small one; on a device, any that did not
                # fill PENDING_NUMEL alone) was held meanwhile, so AccumulateGrad copied it: into a tensor of the
                # parameter's strides (version 1 after the copy; a contiguous parameter's are certain to qualify),
                # or by clone() (version 0)
                held = waited and (
                    is_small or grad.numel() <= PENDING_NUMEL and self.stats._foreach_norm is not None and not self.stats._reads_at_once(grad)
                )
                if (
                    slot >= 0
                    and (grad._version == 0 or grad._version == 1 and held and leaf.tensor.is_contiguous())
                    and self.stats.shapes[slot] == grad.shape
                    and self.stats.dtypes[slot] == grad.dtype
                ):
                    self.param_grads.append((leaf.name, slot))  # its statistics: those of the same elements
                elif is_small:  # a copy of what waited (see discover)
                    small.append((len(self.param_grads), grad))
                    self.param_grads.append((leaf.name, NO_VALUE))
                else:  # often the very tensor AccumulateGrad received
                    self.param_grads.append((leaf.name, self._slot_now(grad)))
            if small:
                slots = self.stats.batch([grad for _, grad in small])
                for position, grad in small:
                    self.param_grads[position] = (self.param_grads[position][0], slots[id(grad)])
            # tensors a module held in forward in place of its own parameters (torch.func.functional_call's),
            # named after those: theirs is the gradient the name got, where the module's own got none
            named = {name for name, _ in self.param_grads}
            for leaf in self.tracker.held.values():
                tensor = leaf.tensor
                # a stand-in made by an op (v * scale) has no .grad unless it retains one, and reading it makes
                # torch warn: read only where backward may have filled it
                grad = tensor.grad if tensor.is_leaf or tensor.retains_grad else None
                if grad is not None and leaf.name not in named:
                    self.param_grads.append((leaf.name, self._slot_now(grad)))

    def _received_by_leaves(self) -> dict[int, list[list[int]]]:
        """Each AccumulateGrad node that ran -> the slots of the gradients it received, per call. Every call is
        flushed first; only C-level passes run per call, Python per leaf call."""
        self.flush()
        chain = itertools.chain.from_iterable
        counts = list(chain(block[1] for block in self.slotted))
        slots = list(chain(block[3] for block in self.slotted))
        starts = list(itertools.accumulate(counts, initial=0))
        run_by = self.log  # node ids, once flushed
        received: dict[int, list[list[int]]] = {}
        for order in itertools.compress(range(len(run_by)), map(set(self.leaf_ids).__contains__, run_by)):
            received.setdefault(run_by[order], []).append(slots[starts[order] : starts[order + 1]])
        return received

    def hook_failure(self) -> InternalError:
        """The first error a hook of gradtrace's caught, as gradtrace's own, saying where it happened."""
        where, details = self.errors[0]
        return InternalError(f"a gradtrace hook failed {where}:\n{details}")

    def finish(self, meta: Meta, loss: Any) -> Trace:
        """Read the statistics (and the loss value) back in one transfer and build the frozen Trace.

        Built column by column (a list per Node field), so that a 100k-node trace costs little
        Python per node.
        """
        if self.errors:
            raise self.hook_failure()
        self.flush()
        nodes = self.nodes
        run_by = self.log  # each call's node id, in the order of the calls
        first_call = dict(zip(reversed(run_by), range(len(run_by) - 1, -1, -1)))  # node id -> order of its first call
        calls: dict[int, list[int]] = {}  # nodes that ran more than once: the order of every call
        if len(first_call) < len(run_by):
            for order, node_id in enumerate(run_by):
                calls.setdefault(node_id, []).append(order)
            calls = {node_id: orders for node_id, orders in calls.items() if len(orders) > 1}
        totals = {}  # a leaf that ran more than once: its .grad holds the sum
        with self._torch.no_grad():
            for node_id in calls:
                variable = getattr(nodes[node_id], "variable", None)
                if variable is not None and variable.grad is not None:
                    totals[node_id] = self.stats.now(variable.grad)
        loss_position = self.stats.value(loss.detach().reshape(()))
        values = self.stats.read()
        meta = replace(meta, loss=values[loss_position])
        stat = self.stats.records(values).__getitem__  # slot -1 is None
        repeat, chain = itertools.repeat, itertools.chain.from_iterable
        # per call, the statistics it sent and received; the last item (order -1) for nodes that did not run
        sent = _cut(map(stat, chain(block[2] for block in self.slotted)), list(chain(block[0] for block in self.slotted)))
        received = _cut(map(stat, chain(block[3] for block in self.slotted)), list(chain(block[1] for block in self.slotted)))
        sent.append(None)
        received.append(None)

        keep = self._kept_ids(first_call)
        every = len(keep) == len(nodes)
        kept = nodes if every else [nodes[old] for old in keep]
        # old node id -> new (a range: the same number, and `in` tells which are kept)
        position_of = range(len(nodes)) if every else {old: new for new, old in enumerate(keep)}
        at = position_of.__getitem__

        def column(values: dict[int, Any]) -> Any:  # a field that is None for most nodes
            return _column(len(kept), {at(old): v for old, v in values.items() if old in position_of})

        leaves = {at(old) for old in self.leaf_ids if old in position_of}
        backward = {at(old): creator for old, creator in self.created_in.items() if old in position_of}
        # per field, the value for each kept node
        seqs = [node._sequence_nr() for node in kept] if not backward else self._sequence_nrs(kept, keep)  # a leaf's is 2**64-1
        if self.renumbered:  # made in forward by a backward of the model's own, in a device's thread
            seqs = list(map(self.renumbered.get, kept, seqs))
        modules = _intervals_at(self.tracker.bound_seqs, self.tracker.bound_modules, seqs)
        sources: list[str | None] = [None] * len(kept)
        stacks: list[tuple[str, ...] | None] = [None] * len(kept)
        if self.sites is not None:
            sites = _intervals_at(*self.sites.table(), seqs)
            if self.sites.stacks:
                stacks = [None if s is None else tuple(f"{_format_site(f[:2])} in {f[2]}" for f in s) for s in sites]
                sites = [None if s is None else s[0][:2] for s in sites]
            as_pair = self.sites.site
            formatted = {site: _format_site(as_pair(site)) for site in set(sites)}
            sources = list(map(formatted.__getitem__, sites))
        if self.tracker.spans_elsewhere:  # modules run in other threads, whose numbers the lookups above cannot place
            for position, module in self.tracker.placed_elsewhere(kept, seqs).items():
                # no site: lines are recorded in the recording thread only
                modules[position], sources[position], stacks[position] = module, None, None
        params: list[str | None] = [None] * len(kept)
        own, held, inputs = self.leaves.get, self.tracker.held.get, self.input_names.get
        for position in leaves:
            key = id(kept[position].variable)
            leaf = own(key) or held(key)
            params[position], modules[position] = (leaf.name, leaf.module) if leaf else (inputs(key), None)
            sources[position] = stacks[position] = None
        for position in sorted(backward):  # creators come before what they create
            if position in leaves:
                continue
            creator = backward[position]
            module = self.backward_modules.get(keep[position])
            if module is None and creator is not None:
                # e.g. a checkpointed function's own ops: they belong where the checkpoint was called
                module = modules[at(creator)]
            site = self.backward_sites.get(keep[position])
            if site and self.sites is not None and self.sites.stacks:  # innermost first, as in forward
                sources[position] = _format_site(site[0][:2])
                stacks[position] = tuple(f"{_format_site(frame[:2])} in {frame[2]}" for frame in site)
            else:
                sources[position], stacks[position] = _format_site(site) if site else None, None
            modules[position] = module
        created: list[int | None] = [None] * len(kept)
        made = list(itertools.filterfalse(leaves.__contains__, range(len(kept))))
        if backward:
            creation = sorted(itertools.filterfalse(backward.__contains__, made), key=seqs.__getitem__)
            creation += sorted(filter(backward.__contains__, made), key=seqs.__getitem__)  # threads number apart
        else:
            creation = sorted(made, key=seqs.__getitem__)
        deque(map(created.__setitem__, creation, range(len(creation))), maxlen=0)  # each node's rank
        orders = list(map(first_call.get, keep))
        grad_inputs = list(map(sent.__getitem__, map(first_call.get, keep, repeat(-1))))
        grad_outputs = list(map(received.__getitem__, map(first_call.get, keep, repeat(-1))))
        every_call: list[tuple] = [()] * len(kept)
        for old, node_calls in calls.items():
            if old in position_of:
                every_call[at(old)] = tuple(NodeCall(order, sent[order], received[order]) for order in node_calls)
                if old in totals:
                    grad_outputs[at(old)] = (stat(totals[old]),)
        created_in = column({old: None if creator is None else at(creator) for old, creator in self.created_in.items()})
        nexts = self.next if every else [tuple(None if n is None else at(n) for n in self.next[old]) for old in keep]
        # a tensor made with requires_grad inside a module in forward (T5's position bias), or a reentrant checkpoint's
        # copy of its inputs, made in backward (which says where it comes from too: created_in): the module of its first
        # user (the checkpointed block's first op)
        unnamed = {position for position in leaves if params[position] is None}
        if unnamed:
            users: dict[int, int] = {}
            for position, children in enumerate(nexts):
                for child in children:
                    if child in unnamed and (child not in users or seqs[position] < seqs[users[child]]):
                        users[child] = position
            for position, user in users.items():
                modules[position] = modules[user]
        forwards = column({old: stat(slot) for old, slot in self.forward_slots.items()})
        replays = column({old: _replay_record(record, values) for old, record in self.replays.items()})
        gradchecks = column(self.gradchecks)
        built = tuple(
            _named_tuples(
                Node,
                zip(
                    range(len(kept)),
                    _node_names(kept, {position: self.backward_ids[keep[position]][1] for position in backward}),
                    modules,
                    params,
                    orders,
                    nexts,
                    grad_inputs,
                    grad_outputs,
                    created,
                    created_in,
                    every_call,
                    forwards,
                    sources,
                    stacks,
                    replays,
                    gradchecks,
                ),
            )
        )
        # a leaf that ran received a gradient, unless every one it got was None (a custom backward's None for it)
        with_grad = {params[p] for p in leaves if _holds_stat(grad_outputs[p])}
        with_grad.update(params[at(old)] for old in calls if old in position_of and at(old) in leaves and any(
            _holds_stat(call.grad_outputs) for call in every_call[at(old)]))
        # nor a .grad after backward: DDP (find_unused_parameters) fills that of a parameter this rank did not use
        with_grad |= {name for name, _ in self.param_grads}
        # a parameter on the meta device has no values to train (a template functional_call runs with others)
        missing = tuple(
            leaf.name
            for leaf in self.leaves.values()
            if leaf.tensor.requires_grad and not leaf.tensor.is_meta and leaf.name not in with_grad
        )
        param_grads = tuple(sorted((name, stat(slot)) for name, slot in self.param_grads))
        return Trace(meta=meta, nodes=built, params_without_grad=missing, param_grads=param_grads)

    def _kept_ids(self, first_call: dict[int, int]) -> list[int]:
        """Forward nodes, plus backward-created nodes that ran or are reachable from one that ran.

        A non-reentrant checkpoint's recompute builds a throwaway graph that never
        runs; it is left out.
        """
        if not self.created_in:
            return list(range(len(self.nodes)))
        keep = {i for i in range(len(self.nodes)) if i not in self.created_in}
        queue = deque(i for i in self.created_in if i in first_call)
        while queue:
            node_id = queue.popleft()
            if node_id in keep:
                continue
            keep.add(node_id)
            queue.extend(n for n in self.next[node_id] if n is not None)
        return sorted(keep)

    def close(self) -> None:
        """Remove every hook and leave no mode behind."""
        _remove_hooks(self.handles, self._hook_key)
        self.handles.clear()
        while self.modes:
            mode = self.modes.pop()
            try:
                mode.__exit__(None, None, None)
            except Exception:  # the mode was pushed on another thread; it ends with that thread's task
                pass
        self.running_custom.clear()

    def _sequence_nrs(self, kept: list[Any], keep: list[int]) -> list[int]:
        """Each kept node's sequence number: of a node made during backward, as read when it was made."""
        made = self.backward_ids
        return [made[old][0] if old in made else node._sequence_nr() for old, node in zip(keep, kept)]

    def release(self) -> None:
        """Drop every reference to the graph and the gradients, the loss's node first.

        Freed root first, each node's inputs are still held here, so every free is shallow; freed
        from the leaves up, a 100k-node chain would be destroyed by one deep recursion (a crash).
        """
        self.forward_values.clear()  # these hold nodes in forward order: leaves first
        self.renumbered.clear()
        self.tracker.claimed.clear()
        self.custom_calls.clear()
        self.log.clear()
        self.index.clear()  # the nodes are still in self.nodes
        self.index[None] = None
        self.nodes.reverse()  # clear() drops the last item first: now that is the root
        self.nodes.clear()
        self._seen.clear()
        self._blocks.clear()
        self._run_hook = None  # it holds the session: freed now, not by a later garbage collection


_CALL = operator.methodcaller("__call__")  # operator.call, also on Python 3.10

# Hook registration on graph nodes. node.register_hook() calls back into Python, torch's
# Function._register_hook (on _HookMixin), which makes a RemovableHandle per hook: about 0.8 µs a node to
# make and remove, a quarter of the cost of hooking a graph of tiny ops. While _node_hooks() runs, that
# callback, for this thread only, stores the hook under the session's key in the node's hook dict and
# returns the dict itself as the handle (removed with ``handle.pop(key, None)``). The session's shared hook
# (one callable for every ordinary node, which asks the engine which node runs) goes into one dict that
# every node without hooks of its own shares: registered with no Python object per node, and called faster
# than a hook per node (measured on 6,000 tiny ops: 1.2 ms against 3.2 to hook them, 24 against 26 ms of
# backward). Other threads, and torch versions without that callback, get torch's own handles. Nodes with
# no hook dict yet are hooked with no Python call at all (_register_shared).
class _Hooks(dict):
    """A node's hook dict: a RemovableHandle made later (the user's) holds a weak reference to it."""

    __slots__ = ("__weakref__",)


class _SharedHooks(_Hooks):
    """The hook dict that nodes hooked only by gradtrace share. A hook added there would run for every one of
    them: torch's registration (``node.register_hook()`` on such a node, after the trace) is refused."""

    __slots__ = ()

    def __setitem__(self, key: Any, value: Any) -> None:
        raise RuntimeError(
            "gradtrace: this autograd node belongs to a graph made inside gradtrace.trace(), whose nodes share "
            "one hook dict; a hook cannot be added to it. Run forward again and hook a node of the new graph."
        )


_fast_hook_keys: dict[int, tuple[object, Any, Any]] = {}  # thread -> (key, shared hook, its dict), while _node_hooks() runs
_fast_hooks_lock = threading.Lock()
_torch_register_hook: Any = None  # torch's own _HookMixin._register_hook while ours is in its place


class _NoHookDict(Exception):
    """The node has no hook dict (:data:`_PROBE`)."""


_PROBE = object()  # registered as a hook inside _node_hooks(): the node's hook dict is returned, and nothing added


def _register_hook(hooks: Any, hook: Callable) -> tuple[Any, Any]:
    fast = _fast_hook_keys.get(threading.get_ident())
    if fast is None:
        return _torch_register_hook.__func__(hooks, hook)
    key, shared, shared_hooks = fast
    if hook is _PROBE:
        if hooks is None:
            raise _NoHookDict  # before torch adds a dict to the node
        return hooks, hooks
    if hooks is None:
        if hook is shared:
            return shared_hooks, shared_hooks
        hooks = _Hooks()
    dict.__setitem__(hooks, key, hook)
    return hooks, hooks


@contextlib.contextmanager
def _node_hooks(key: object, shared: Callable | None = None, shared_hooks: dict | None = None) -> Iterator[bool]:
    """Fast registration in this thread (see above): ``shared`` goes into ``shared_hooks`` on nodes with no
    hook dict yet. Yields whether registration is fast (False with another torch: its own handles)."""
    global _torch_register_hook
    from torch.autograd.function import _HookMixin

    if not isinstance(_HookMixin.__dict__.get("_register_hook"), staticmethod):
        yield False  # another torch: its own handles
        return
    thread = threading.get_ident()
    with _fast_hooks_lock:
        if not _fast_hook_keys:
            _torch_register_hook = _HookMixin.__dict__["_register_hook"]
            _HookMixin._register_hook = staticmethod(_register_hook)
        _fast_hook_keys[thread] = (key, shared, shared_hooks)
    try:
        yield True
    finally:
        with _fast_hooks_lock:
            del _fast_hook_keys[thread]
            if not _fast_hook_keys:
                _HookMixin._register_hook = _torch_register_hook


def _register_shared(nodes: list[Any], shared: Callable, shared_hooks: dict) -> list[Any]:
    """``node.register_hook(shared)`` on each node, inside :func:`_node_hooks`; what each returned.

    Where the GIL holds, torch's callback is first replaced by a C function that returns the shared dict
    (``dict.get`` on ``{None: ...}``), put back as the last step of the same run of C calls: no bytecode runs
    in between, so no other thread can run meanwhile to register a hook of its own through it. This
    registers 6,000 nodes in about 60% of the time :func:`_register_hook` takes (a Python call per node).
    A node that has a hook dict already (unhashable: ``dict.get`` refuses it) ends the run; it and the
    rest go through :func:`_register_hook`.
    """
    from torch.autograd.function import _HookMixin

    register = operator.methodcaller("register_hook", shared)
    hooked: list[Any] = []
    if getattr(sys, "_is_gil_enabled", lambda: True)():
        current = _HookMixin.__dict__["_register_hook"]
        fast = staticmethod({None: (shared_hooks, shared_hooks)}.get)
        steps = (
            functools.partial(setattr, _HookMixin, "_register_hook", fast),
            functools.partial(hooked.extend, map(register, nodes)),  # the nodes hooked stay, should one refuse
            functools.partial(setattr, _HookMixin, "_register_hook", current),
        )
        try:
            deque(map(_CALL, steps), maxlen=0)
        except BaseException as exc:
            _HookMixin._register_hook = current  # the first statement: no other thread has run since
            if not isinstance(exc, TypeError):  # TypeError: a node with a hook dict of its own
                raise
    hooked += map(register, itertools.islice(nodes, len(hooked), None))
    return hooked


def _remove_hooks(handles: list[Any], key: object) -> None:
    """Remove hooks registered under :func:`_node_hooks` (dicts) or not (RemovableHandles)."""
    repeat = itertools.repeat
    try:
        deque(map(dict.pop, handles, repeat(key), repeat(None)), maxlen=0)
    except TypeError:  # some are RemovableHandles: torch's own registration, or another torch
        kinds = list(map(isinstance, handles, repeat(dict)))
        deque(map(dict.pop, itertools.compress(handles, kinds), repeat(key), repeat(None)), maxlen=0)
        for handle in itertools.compress(handles, map(operator.not_, kinds)):
            handle.remove()


def _element_runs(tensor: Any) -> tuple[tuple[tuple[int, int], ...], int]:
    """Which elements of memory a strided tensor reads, from its ``data_ptr()``: its dimensions as runs
    ``(stride, size)``, innermost first, those that step on evenly merged (a contiguous tensor, or any
    permutation of one, is one run of stride 1; a slice of rows keeps a run per level), and how many times
    it reads each (the sizes of expanded dimensions, stride 0, multiplied). Sorting and merging keep the
    multiset of addresses read, so two tensors with the same data_ptr(), dtype, runs and repeat read the same
    elements as often: they have the same norm (a view that transposes or reshapes a slice of heads)."""
    repeat = 1
    runs: list[tuple[int, int]] = []
    for stride, size in sorted(zip(tensor.stride(), tensor.shape)):
        if size == 1:  # a dimension of one element may have any stride
            continue
        if stride == 0:
            repeat *= size
        elif runs and runs[-1][0] * runs[-1][1] == stride:
            runs[-1] = (runs[-1][0], runs[-1][1] * size)
        else:
            runs.append((stride, size))
    return tuple(runs), repeat


def _fills_block(runs: tuple[tuple[int, int], ...], repeat: int) -> bool:
    """Whether :func:`_element_runs` say a tensor's elements fill one block of memory exactly, each read once,
    in some order of its dimensions: a permutation of a contiguous tensor (a transposed weight gradient, a
    gradient with attention heads moved). Such a tensor has the norm of that block read flat, and shares it
    with every other tensor over the block (the contiguous gradient it is a view of)."""
    return repeat == 1 and (not runs or (len(runs) == 1 and runs[0][0] == 1))


@functools.cache
def _foreach_norm_takes_dtype() -> bool:
    """Whether this torch's ``_foreach_norm`` takes a ``dtype`` (2.4 and later): asked once, of a one-element CPU tensor."""
    import torch

    try:
        torch._foreach_norm([torch.zeros(1)], 2, dtype=torch.float64)
    except (AttributeError, TypeError, RuntimeError):
        return False
    return True


def _flat_block(tensor: Any) -> Any:
    """A plain strided tensor's elements as a 1-d contiguous view of the block of memory they fill (contiguous, or a
    permutation of a contiguous tensor: :func:`_fills_block`), with the same norm; None where they fill none."""
    if tensor.is_contiguous():
        return tensor.view(-1)
    if _fills_block(*_element_runs(tensor)):
        return tensor.as_strided((tensor.numel(),), (1,))  # from its data_ptr(), the block's first element
    return None


def _storage_freed(tensor: Any) -> bool:
    """Whether a tensor's storage was resized to nothing (FSDP2 frees an unsharded parameter after its module's
    forward): its elements are not there to read (reading them crashed the process)."""
    try:
        return tensor.numel() > 0 and tensor.untyped_storage().nbytes() == 0
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):  # a subclass without storage: not this case
        return False


def _holds_stat(stats: tuple | None) -> bool:
    """Whether a call's statistics (None: it did not run) hold one that is not None."""
    return bool(stats) and stats.count(None) < len(stats)


class _PerThread:
    """A replacement of one process-wide attribute of torch's (``Function.apply``, the engine object) that hands
    each call to the innermost handler of the calling thread; other threads' calls go to what it replaced. Put
    in place when any thread opens the first handler, put back when the last closes: patched and put back per
    handler instead, two threads tracing at once put each other's patch back, and one stayed in place after
    both had ended."""

    def __init__(self, install: Callable[[], Any], restore: Callable[[Any], None]) -> None:
        self._install, self._restore = install, restore  # install() puts the replacement in, returns what it replaced
        self._handlers: dict[int, list[Callable[..., Any]]] = {}  # thread -> its handlers, innermost last
        self._lock = threading.Lock()
        self.original: Any = None  # what the replacement replaced (torch's)

    def handler(self) -> Callable[..., Any] | None:
        """The calling thread's innermost handler; None where it has none."""
        handlers = self._handlers.get(threading.get_ident())
        return handlers[-1] if handlers else None

    @contextlib.contextmanager
    def handling(self, handler: Callable[..., Any]) -> Iterator[Callable[..., Any] | None]:
        """``handler`` is the calling thread's innermost while the block runs; yields the one it was opened
        inside, which it calls on to (None: the outermost, which calls :attr:`original`)."""
        thread = threading.get_ident()
        with self._lock:
            if not self._handlers:
                self.original = self._install()
            handlers = self._handlers.setdefault(thread, [])
            outer = handlers[-1] if handlers else None
            handlers.append(handler)
        try:
            yield outer
        finally:
            with self._lock:
                handlers.remove(handler)
                if not handlers:
                    del self._handlers[thread]
                if not self._handlers:
                    self._restore(self.original)


# A backward that forward runs itself (torch.autograd.grad(..., create_graph=True): a gradient penalty, a
# physics-informed loss) runs a device's part in the engine's thread for that device, and the nodes it makes
# there are numbered by that thread's counter, not by the calling thread's: their numbers would place them in
# no module, or in another one. While forward runs, the engine object through which torch.autograd.grad and
# backward reach the engine, however they were imported (Variable._execution_engine), is an _EngineProxy,
# whose run_backward goes through the calling thread's renumbering (_ENGINE), its other attributes torch's.
class _EngineProxy:
    """torch's engine object, but for ``run_backward``, which goes through the calling thread's renumbering."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        return (_ENGINE.handler() or self._engine.run_backward)(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # queue_callback (DDP, FSDP), is_checkpoint_valid
        return getattr(self._engine, name)


def _install_engine_proxy() -> Any:
    from torch.autograd.variable import Variable

    engine = Variable._execution_engine
    Variable._execution_engine = _EngineProxy(engine)
    return engine


def _restore_engine(engine: Any) -> None:
    from torch.autograd.variable import Variable

    Variable._execution_engine = engine


_ENGINE = _PerThread(_install_engine_proxy, _restore_engine)


@contextlib.contextmanager
def _renumbering_inner_backwards(renumbered: dict[Any, int]) -> Iterator[None]:
    """While forward runs: each node that a backward run by this thread had made in another thread (a device's)
    goes in ``renumbered``, under the number this thread's counter had when the backward began, so that it
    belongs to the module and the line that ran it, as the nodes made in this thread do."""
    import torch

    Tensor = torch.Tensor
    given = (Tensor, getattr(torch.autograd.graph, "GradientEdge", ()))  # what a backward is given (no edges in 2.1)
    next_sequence_nr = torch._C._autograd._get_sequence_nr

    def run_backward(*args: Any, **kwargs: Any) -> Any:
        first = next_sequence_nr()
        result = inner(*args, **kwargs)
        try:
            made_here = range(first, next_sequence_nr())
            made_from = [t.grad_fn for t in _tensors_in(result, Tensor) if t.grad_fn is not None]  # (create_graph=True)
            accumulated = kwargs.get("accumulate_grad")  # a backward(): into the leaves' .grad
            if made_from or accumulated:
                # the graph the backward ran through, from the tensors (or gradient edges) it was given: what was
                # there before it
                known = _graph_from(t.grad_fn if isinstance(t, Tensor) else t.node for t in _tensors_in(args, given))
                if accumulated:
                    grads = [getattr(getattr(node, "variable", None), "grad", None) for node in known]
                    made_from += [grad.grad_fn for grad in grads if grad is not None]
                for node in _graph_from(made_from, known):
                    if node._sequence_nr() not in made_here:
                        renumbered[node] = first
        except Exception:  # attribution only: never the model's failure
            pass
        return result

    with _ENGINE.handling(run_backward) as outer:
        inner = outer or _ENGINE.original.run_backward
        yield


def _graph_from(roots: Iterable[Any], stop: set[Any] | frozenset[Any] = frozenset()) -> set[Any]:
    """The nodes reachable from ``roots`` (None ones skipped) through ``next_functions``, not through ``stop``."""
    seen: set[Any] = set()
    stack = [node for node in roots if node is not None]
    while stack:
        node = stack.pop()
        if node in seen or node in stop:
            continue
        seen.add(node)
        stack.extend(child for child, _ in node.next_functions if child is not None)
    return seen


def _intervals_at(starts: list[int], values: list[Any], seqs: list[int]) -> list[Any]:
    """For each sequence number, the value of the last interval starting at or before it (None before
    the first). ``starts`` must be sorted. Where intervals are few (module boundaries), a binary search
    each, in C (faster than a table per sequence number). Where there are about as many intervals as
    numbers (a site per op), most numbers start one: a dict finds those, a binary search the rest."""
    shifted = [None, *values]
    position = functools.partial(bisect.bisect_right, starts)
    if len(starts) < len(seqs) // 2:
        return list(map(shifted.__getitem__, map(position, seqs)))
    repeat = itertools.repeat
    found = list(map(dict(zip(starts, values)).get, seqs, repeat(_MISSING)))  # ties: the last value, as bisect
    misses = list(itertools.compress(range(len(seqs)), map(operator.is_, found, repeat(_MISSING))))
    deque(map(found.__setitem__, misses, map(shifted.__getitem__, map(position, map(seqs.__getitem__, misses)))), maxlen=0)
    return found


def _node_names(nodes: list[Any], known: dict[int, str] | None = None) -> list[str]:
    """``node.name()`` of each node, asked once per node type where the type fixes the name; ``known``:
    position -> name of nodes that may be freed by now (not asked).

    It does for a generated node type (named as its nodes are), a custom Function's node type (its
    nodes are named by it) and every other type torch registers for one C++ class
    (``torch._C._functions``); not for the type torch gives C++ classes it has no type for.
    """
    import torch

    if known:
        asked = iter(_node_names([node for position, node in enumerate(nodes) if position not in known]))
        return [known[position] if position in known else next(asked) for position in range(len(nodes))]
    types = list(map(type, nodes))
    names: dict[type, str | None] = {}
    for node_type, node in dict(zip(types, nodes)).items():  # a node of each type
        name = node.name()
        fixed = name == node_type.__name__ or getattr(torch._C._functions, node_type.__name__, None) is node_type
        names[node_type] = name if fixed else None
    if None not in names.values():
        return list(map(names.__getitem__, types))
    return [names[node_type] or node.name() for node_type, node in zip(types, nodes)]


def _named_tuples(cls: type, rows: Iterable[tuple]) -> Iterator[Any]:
    """``cls(*row)`` of a named tuple class for each row, with no Python call per row: ``tuple.__new__`` through
    ``starmap``, which passes each (class, row) pair on as the call's argument tuple (6,000 rows: 0.96 ms; by
    ``map`` over the class repeated, which makes that tuple per call, 1.13; through a ``partial``, 1.46)."""
    return itertools.starmap(tuple.__new__, zip(itertools.repeat(cls), rows))  # noqa: RUF058 (see above)


def _cut(items: Iterable[Any], counts: list[int]) -> list[tuple]:
    """``items`` cut into consecutive tuples of ``counts[i]`` items each, in one C-level pass: each count's
    tuples come from a ``zip`` of the one iterator repeated that many times (6,000 tuples of one: 0.6 ms,
    against 1.2 by a slice each)."""
    items = iter(items)
    cutters = {count: zip(*[items] * count) if count else itertools.repeat(()) for count in set(counts)}
    cut = list(map(next, map(cutters.__getitem__, counts)))
    if len(cut) < len(counts) or next(items, _MISSING) is not _MISSING:
        raise InternalError(f"{len(counts)} calls' gradients did not match their statistics")
    return cut


def _column(length: int, values: dict[int, Any]) -> Any:
    """A field's values for every node: ``None`` but where ``values`` says otherwise."""
    if not values:
        return itertools.repeat(None, length)
    column = [None] * length
    for position, value in values.items():
        column[position] = value
    return column


def _materialized(node: Any, grad_outputs: tuple, outputs: tuple | None) -> tuple:
    """A custom Function's gradients as the engine hands them to its backward: zeros for an unused output
    (``ctx.set_materialize_grads`` is on by default; a backward written for None handles zeros alike).
    ``outputs``: ``(shape, dtype, device)`` of each output, as recorded in forward (the node's own
    ``_input_metadata`` where torch has it)."""
    if all(grad is not None for grad in grad_outputs):
        return grad_outputs
    import torch

    metadata = getattr(node, "_input_metadata", None)
    if metadata is not None:
        outputs = tuple((meta.shape, meta.dtype, meta.device) for meta in metadata)
    if outputs is None or len(outputs) != len(grad_outputs):
        return grad_outputs
    return tuple(
        torch.zeros(shape, dtype=dtype, device=device) if grad is None and shape is not None else grad
        for grad, (shape, dtype, device) in zip(grad_outputs, outputs)
    )


def _raised_in_users_code(exc: BaseException) -> bool:
    """Whether Python code of the user's (not torch's nor gradtrace's) ran below the frame that caught ``exc``."""
    skip = _library_prefixes()
    below = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    while below is not None:
        if not below.tb_frame.f_code.co_filename.startswith(skip):
            return True
        below = below.tb_next
    return False


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
    if not reproducible and note == USER_HOOKS:  # the user's hook may be what changed them: no verdict
        return Replay(diff, relative, None, note)
    return Replay(diff, relative, reproducible, None)


UNRECORDED_CALL = (
    "its call was not seen (an alias of .apply taken before the trace, as `f = MyFunction.apply` at import): "
    "call MyFunction.apply(...) in forward to check it"
)

# A replay runs the node alone; what the engine sent on went through the node's post hooks too.
USER_HOOKS = "hooks of your own on this node (register_hook, a module's backward hook) may change what it sends: not judged"


def _format_site(site: tuple[str, int] | None) -> str | None:
    """``path:line``, the path relative to the working folder when it lies inside it."""
    if site is None:
        return None
    path, line = site
    return f"{_display_path(path)}:{line}"


def _display_path(path: str) -> str:
    import os

    try:
        folder = os.getcwd()  # it may change between traces
    except OSError:  # the working folder was deleted
        return path
    return _relative_to(path, folder)


@functools.lru_cache(maxsize=1024)
def _relative_to(path: str, folder: str) -> str:
    import os

    try:
        relative = os.path.relpath(path, folder)
    except ValueError:  # another drive (Windows)
        return path
    return path if relative.startswith("..") else relative


def _changed_since(tensor: Any, version: int, copy: Any) -> bool:
    """Whether a gradient a custom backward received changed while it ran: its version counter moved, or (a change
    through ``.data``, which the counter does not see) a small one's values differ from the copy taken before (a
    NaN where the copy has one is no change)."""
    if tensor._version != version:
        return True
    if isinstance(copy, int):  # (a large one: no copy, its version alone)
        return False
    try:
        return not (copy.equal(tensor) or bool(((copy == tensor) | (copy.isnan() & tensor.isnan())).all()))
    except RuntimeError:  # a layout or subclass without these ops: its version alone
        return False


def _never(tensor: Any) -> bool:
    """In place of a check this torch lacks: no tensor is said to be in a torch.func transform."""
    return False


def _tensors_in(value: Any, tensor_type: type) -> list[Any]:
    if isinstance(value, tensor_type):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors_in(item, tensor_type)]
    return []


def _describe_model(model: Any) -> str:
    return getattr(model, "__qualname__", None) or type(model).__name__


def _with_grad(function: Callable[..., Trace]) -> Callable[..., Trace]:
    """Run ``function`` with grad mode on and inference mode off, as a training step runs, also where the
    caller is inside ``no_grad()`` or ``inference_mode()`` (an evaluation loop, say); and with garbage
    collection paused until it returns."""

    @functools.wraps(function)
    def in_grad_mode(*args: Any, **kwargs: Any) -> Trace:
        import torch

        # A trace allocates many small objects while the graph holds many more: generational collections
        # would walk them all, again and again (measured: half the trace time). Collection is back on as the
        # last thing before the Trace is returned: the first collection after it then comes with the
        # caller's next allocation, not with the context managers' exits here, and walks the Trace only if
        # the caller keeps it (1 ms a trace of 6,000 nodes, and the Trace's objects kept from the older
        # generations, whose full collections took 60 to 90 ms every ten to fifteen traces).
        with collection_paused(), torch.inference_mode(False), torch.enable_grad():
            return function(*args, **kwargs)

    return in_grad_mode


class collection_paused:  # a context manager, named as contextlib's are
    """Garbage collection off meanwhile (as it was, after): for work that makes many objects and no reference
    cycles while many others are alive (a trace; the JSON and tree of a large Trace), where each collection
    would walk them all. A class, not a generator: switching collection back on is the last thing its exit
    does, so no collection starts before the ``with`` block is left."""

    def __enter__(self) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc_info: object) -> None:
        if self._was_enabled:
            gc.enable()


@_user_modes_aside
@_with_grad
def trace(
    model: Callable[..., Any],
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    loss_fn: Callable[[Any], Any] | None = None,
    loss_reduction: str = "sum",
    input_grad: bool | None = None,
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
        input_grad: ``True`` gives floating-point input tensors ``requires_grad``
            (through new aliases; the caller's tensors are not changed) so their
            gradients appear as ``input:N`` leaves; ``False`` takes the inputs as
            they are. ``None`` (the default): as they are where a parameter of the
            model requires grad, so the trace computes what the caller's own step
            computes (an input that requires grad still shows as a leaf); as with
            ``True`` where none does (a function of its inputs alone, or a frozen
            model), which would otherwise have no backward. ``gradtrace run``
            passes ``True`` unless ``--no-input-grad``. An input that is part of
            the caller's graph (made by ops on tensors that require grad) is
            detached first: the backward stops at the model's inputs, and the
            caller's graph is left for the caller's own backward.
        train: ``True``/``False`` to run in train/eval mode; ``None`` keeps the mode
            the model is in. The mode is restored afterwards.
        target: how to name the model in ``meta.target``.
        seed: recorded in ``meta.seed`` (seeding is the caller's job).
        forward_stats: also record, per node, the norm of the forward value its op
            produced (``Node.forward``), for comparing runs or ranks. Costs a
            Python call per op in forward, so it is off by default.
        rank, world_size: recorded in ``meta`` (set under torchrun).
        sources: record each node's creation site, the user's source line whose op
            made it (``Node.source``), from Python line events while forward runs
            (``sys.settrace``; a TorchFunctionMode when another trace function is set).
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

    The model is left as it was found: each parameter's ``.grad`` (gradients of this
    backward are recorded, then discarded), each module's training flag, and each
    module's buffers (BatchNorm's running statistics, which a forward in train mode
    updates) as they were before forward. Post-accumulate-grad hooks (an optimizer
    step in backward), and post hooks on a parameter's AccumulateGrad node (the older
    form: Megatron's ``main_grad``), are held back while the trace's backward runs, so
    they take no step and add to no buffer; ``param_grads`` is each ``.grad`` as
    accumulated, before any such hook.
    """
    import torch

    started = time.perf_counter()
    if not callable(model):
        raise UsageError(f"the model is not callable: {type(model).__name__}", hint="pass an nn.Module or a function")
    if isinstance(args, torch.Tensor) or not isinstance(args, (tuple, list)):
        args = (args,)
    modules = named_modules_of(model)
    leaves = _named_leaves(model, modules)
    if input_grad is None:  # the inputs as given, unless nothing else would give the step a backward
        input_grad = not any(leaf.tensor.requires_grad for leaf in leaves.values())
    args, kwargs, input_names, input_infos = _prepare_inputs(tuple(args), dict(kwargs or {}), input_grad)
    tracker = _ModuleTracker(modules, leaves)
    session = _TraceSession(leaves, input_names, tracker)
    training = [(module, module.training) for _, module in modules]
    saved_buffers = _saved_buffers(modules)
    held_hooks = session.held_hooks  # the user's hooks held back while the trace runs (see _hold_post_hooks)
    # each parameter's .grad as the caller left it, before forward: a loss_fn may run a backward of its own
    saved_grads: dict[int, tuple[Any, Any]] = {id(leaf.tensor): (leaf.tensor, leaf.tensor.grad) for leaf in leaves.values()}
    claim = _claim_leaves(leaves)
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
        # creation sites from line events, unless something else traces this thread (a debugger, coverage),
        # the model holds a torch.compile'd module, or --stack wants whole stacks: then from a mode, per op. With
        # forward values, a mode runs per op anyway (line tracing would slow its every frame): it records them
        by_lines = session.sites is not None and not (stacks or forward_stats or tracker.compiled) and sys.gettrace() is None
        with contextlib.ExitStack() as forward_context:
            forward_context.enter_context(_user_modes())  # (first: gradtrace's own modes go on top of them)
            forward_context.enter_context(_renumbering_inner_backwards(session.renumbered))
            if forward_stats or (session.sites is not None and not by_lines):
                forward_context.enter_context(_entered(_forward_mode_class()(session, None if by_lines else session.sites), torch))
            if by_lines:
                forward_context.enter_context(session.sites.tracing_lines(tracker))
            if gradcheck or replay or session.sites is not None or forward_stats:
                from .gradcheck import recording_calls

                calls = session.custom_calls if gradcheck or replay else None
                on_output = session.record_output if forward_stats else None  # a custom Function's output
                forward_context.enter_context(recording_calls(calls, keep_args=gradcheck, sites=session.sites, on_output=on_output))
            try:
                with tracker.root_call():
                    output = model(*args, **kwargs)
            except USER_CODE_ERRORS as exc:
                phase = "the model's forward" + _failing_module(exc, modules)
                hint = None if isinstance(exc, SystemExit) else _inference_hint(leaves, exc) or _input_hint(input_infos, exc, input_grad)
                raise UserCodeError(phase, exc, hint=hint) from exc
            loss, loss_rule = compute_loss(output, loss_fn, loss_reduction)
        tracker.stop_recording()
        if loss.is_meta:  # (torch runs a meta model's forward and backward, on shapes alone)
            raise ModelError(
                "the model or its inputs hold tensors on the meta device, which have no data to trace",
                hint="build it with real tensors (e.g. model.to_empty(device='cpu') and initialise the weights)",
            )
        forward_done = time.perf_counter()
        if loss.grad_fn is None and loss.requires_grad:
            raise ModelError(
                f"the loss ({loss_rule}) is a leaf tensor, a parameter or an input as it is: no op made it, so its "
                "backward has no graph to trace",
                hint="return what forward computes from it (or pass a loss_fn that computes the loss)",
            )
        if loss.grad_fn is None:
            inputs_too = "" if input_grad else " (without --no-input-grad, or with trace(..., input_grad=True), floating inputs do)"
            trainable = sum(leaf.tensor.requires_grad for leaf in leaves.values())
            hint = f"check that parameters or inputs require grad{inputs_too} and that forward does not run under torch.no_grad() or .detach() the output"
            if trainable:  # they do, and none reached the loss
                hint = (
                    f"{trainable} parameter{'s' if trainable != 1 else ''} require grad but none reached the loss: forward "
                    "runs under torch.no_grad() or detaches, or a reentrant checkpoint (use_reentrant=True) got inputs "
                    "that need no grad (Hugging Face: model.enable_input_require_grads(), or use_reentrant=False), or "
                    "the trainable ones are not on the way (an adapter merged into its base)"
                )
            raise ModelError(f"the loss ({loss_rule}) does not require grad: nothing to trace", hint=hint)
        del output
        session.discover([loss.grad_fn])
        for node_id in session.leaf_ids:
            variable = session.nodes[node_id].variable
            if id(variable) not in saved_grads:
                saved_grads[id(variable)] = (variable, variable.grad)
        for tensor, _ in saved_grads.values():
            tensor.grad = None
        # an optimizer step in backward: the trace must not take it (also for the parameters of a reentrant
        # checkpoint's segment, whose graph is made again during backward)
        for tensor, _ in saved_grads.values():
            hooks = getattr(tensor, "_post_accumulate_grad_hooks", None)
            if hooks:
                held_hooks.append((hooks, dict(hooks)))
                hooks.clear()
        backward_start = time.perf_counter()
        try:
            # a custom Function applied during backward (in a reentrant checkpoint's recompute) makes a node no
            # op mode sees: it is hooked (and, for --gradcheck and --replay, recorded) as it is made
            from .gradcheck import recording_calls

            calls = session.custom_calls if gradcheck or replay else None
            with _user_modes(), recording_calls(calls, keep_args=gradcheck, on_output=session.discover_in_backward):
                session.modes_in_backward = bool(torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack())
                loss.backward()
        except USER_CODE_ERRORS as exc:
            if session.errors:
                raise session.hook_failure() from exc
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
            module_types={name: _module_type(module) for name, module in modules},
        )
        result = session.finish(meta, loss)
        timings = {
            "forward": forward_done - started,
            "backward": backward_done - backward_start,
            "total": time.perf_counter() - started,
        }
        return result.with_meta(timings_s=timings)
    finally:
        try:
            tracker.stop_recording()
            session.close()
            tracker.remove()
            for hooks, held in held_hooks:
                added = dict(hooks)  # none, unless a hook of the user's registered one meanwhile
                hooks.clear()
                hooks.update(held)
                hooks.update(added)
            _restore_buffers(saved_buffers)
            for tensor, grad in saved_grads.values():
                tensor.grad = grad
            for module, flag in training:
                if module.training is not flag:  # nn.Module's __setattr__ costs microseconds: only where it changed
                    module.training = flag
            loss = None  # so that the session holds the last reference to the graph's root
            session.release()
        finally:
            _release_leaves(claim)  # whatever failed above


# (thread, leaves) of every trace running, in any thread: a model's parameters are traced by one thread at a time
_traced_leaves: list[tuple[int, dict[int, _Leaf]]] = []
_traced_leaves_lock = threading.Lock()


def _claim_leaves(leaves: dict[int, _Leaf]) -> tuple[int, dict[int, _Leaf]]:
    """Note that this thread traces these parameters; a UsageError where another thread's trace holds one of them
    (both would set, read and restore the same ``.grad``, and each would record the other's gradients)."""
    me = threading.get_ident()
    claim = (me, leaves)
    with _traced_leaves_lock:
        for thread, others in _traced_leaves:
            if thread != me and not leaves.keys().isdisjoint(others):
                shared = next(key for key in leaves if key in others)
                raise UsageError(
                    f"another thread is tracing this model (its parameter {leaves[shared].name}) at the same time",
                    hint="trace a model from one thread at a time, or give each thread its own copy (copy.deepcopy)",
                )
        _traced_leaves.append(claim)
    return claim


def _release_leaves(claim: tuple[int, dict[int, _Leaf]]) -> None:
    with _traced_leaves_lock:
        for index, entry in enumerate(_traced_leaves):
            if entry is claim:
                del _traced_leaves[index]
                break


def _module_type(module: Any) -> str:
    """The module's class name; a TorchScript module's is that of the class it was scripted from."""
    import torch

    if isinstance(module, torch.jit.ScriptModule):
        return getattr(module, "original_name", None) or type(module).__name__
    return type(module).__name__


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


# what torch says when code changes an input that gradtrace made require grad
_INPUT_GRAD_ERRORS = (
    "you can only change requires_grad flags of leaf variables",
    "a leaf Variable that requires grad is being used in an in-place operation",
    "a view of a leaf Variable that requires grad is being used in an in-place operation",
)


def _inference_hint(leaves: dict[int, _Leaf], exc: BaseException) -> str | None:
    """Where forward refused inference tensors and some parameters are such (made under inference_mode())."""
    if "Inference tensors" not in message_of(exc):
        return None
    made = [leaf.name for leaf in leaves.values() if leaf.tensor.is_inference()]
    if not made:
        return None
    names = ", ".join(made[:3]) + (f" and {len(made) - 3} more" if len(made) > 3 else "")
    which = f"the parameter {names} was" if len(made) == 1 else f"the parameters {names} were"
    return f"{which} made under torch.inference_mode(), so autograd cannot use them: build the model outside it"


def _input_hint(infos: list[InputInfo], exc: BaseException, input_grad: bool) -> str | None:
    if input_grad and infos and any(message in message_of(exc) for message in _INPUT_GRAD_ERRORS):
        return (
            "gradtrace makes floating-point inputs require grad to show their gradients, and the model "
            "changes an input in place, or sets requires_grad on a tensor made from one: run with "
            "--no-input-grad (trace(..., input_grad=False))"
        )
    if not infos or not isinstance(exc, _INPUT_ERROR_TYPES):  # a NameError is no question of inputs
        return None
    shapes = ", ".join(f"{i.name} {i.dtype}[{','.join(map(str, i.shape))}]" for i in infos)  # the -i grammar
    return f"the model was called with {shapes}; check the inputs (the -i specs, or example_inputs())"


# what a wrong shape, dtype or missing key raises (torch's RuntimeError, an index, an assertion on shapes)
_INPUT_ERROR_TYPES = (RuntimeError, ValueError, TypeError, IndexError, KeyError, AssertionError)


_TRACE_CODE = inspect.unwrap(trace).__code__
