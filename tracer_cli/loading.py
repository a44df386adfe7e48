"""Target resolution: from ``model.py[:NAME]`` or ``package.module:NAME`` to a model, inputs and loss.

The model-file contract (README "Model files"): the file is imported as a module
(not as ``__main__``, with ``sys.argv`` ``[path]``) with its own folder importable, and defines ``model``
or ``build_model()``, optionally ``example_inputs()`` and ``loss_fn(output)``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import itertools
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterator

from .errors import USER_CODE_ERRORS, ModelError, UsageError, UserCodeError, message_of
from .records import a_or_an

DEFAULT_NAMES = ("model", "build_model")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass
class LoadedTarget:
    """What a target provides.

    Attributes:
        target: the target as the user wrote it.
        model: the model (an ``nn.Module`` or a callable).
        source: the imported Python module the model came from.
        example_inputs: the file's ``example_inputs`` (callable or value), if any.
        loss_fn: the file's ``loss_fn``, if any.
    """

    target: str
    model: Any
    source: ModuleType
    example_inputs: Any = None
    loss_fn: Callable[[Any], Any] | None = None

    def inputs(self) -> tuple[tuple, dict] | None:
        """Call ``example_inputs()`` and split it into ``(args, kwargs)``; None if absent."""
        if self.example_inputs is None:
            return None
        value = self.example_inputs
        if callable(value):
            try:
                value = value()
            except USER_CODE_ERRORS as exc:
                raise UserCodeError("example_inputs()", exc) from exc
        return split_inputs(value, "example_inputs()")


def split_inputs(value: Any, source: str) -> tuple[tuple, dict]:
    """A Tensor is one argument, a tuple/list is positional arguments, a dict is keyword arguments. A
    namedtuple (a PackedSequence) is one argument, not its fields."""
    import torch

    if isinstance(value, torch.Tensor) or (isinstance(value, tuple) and hasattr(value, "_fields")):
        return (value,), {}
    if isinstance(value, (tuple, list)):
        return tuple(value), {}
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):  # a dict, a tokenizer's BatchEncoding
        return (), dict(value)
    raise ModelError(
        f"{source} returned {a_or_an(type(value).__name__)}",
        hint="return a Tensor, a tuple of positional arguments, or a dict (any mapping) of keyword arguments",
    )


def split_target(target: str) -> tuple[str, str, str | None]:
    """Split a target into ``(kind, location, name)``; kind is "file" or "module".

    Raises:
        UsageError: the target is neither ``FILE.py[:NAME]`` nor ``package.module[:NAME]``.
    """
    location, name = target, None
    head, sep, tail = target.rpartition(":")
    if sep and _IDENTIFIER.match(tail) and head:
        location, name = head, tail
    elif sep and head and not tail:
        raise UsageError(f"no NAME after ':' in target {target!r}", hint=f"name an attribute ({head}:build_model) or drop the ':'")
    # an existing file is one, whatever its name (notes.txt is not the module txt of a package notes)
    if location.endswith(".py") or os.sep in location or "/" in location or os.path.isfile(location):
        return "file", location, name
    if os.path.isdir(location) and not os.path.exists(os.path.join(location, "__init__.py")):  # not a package
        raise UsageError(f"{location} is a folder, not a Python file", hint="name the model file, e.g. model.py")
    if _DOTTED.match(location):
        return "module", location, name
    raise UsageError(
        f"cannot read target {target!r}",
        hint="expected FILE.py, FILE.py:NAME or package.module:NAME",
    )


def check_file(path: str) -> None:
    """Raise the UsageError for a model file that is not there, or is a folder."""
    if not os.path.exists(path):
        hint = "check the path (relative to the current folder; targets in [tool.gradtrace] are relative to its pyproject.toml)"
        raise UsageError(f"model file not found: {path}", hint=hint)
    if os.path.isdir(path):
        raise UsageError(f"{path} is a folder, not a Python file", hint="name the model file, e.g. model.py")


def _import_file(path: str) -> ModuleType:
    check_file(path)
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    _forget_neighbours_of_other_targets(folder)
    stem = os.path.splitext(os.path.basename(path))[0]
    module_name = stem if _IDENTIFIER.match(stem) and stem not in sys.modules else f"gradtrace_target_{abs(hash(path))}"
    if folder in sys.path:  # first, as for `python model.py`: its neighbours before another target's
        sys.path.remove(folder)
    sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"cannot import {path}", hint="the model file must be a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up here
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        sys.modules.pop(module_name, None)
        where = f"{exc.filename}:{exc.lineno}" if exc.lineno else exc.filename
        raise ModelError(f"syntax error in {where}: {exc.msg}", hint=(exc.text or "").rstrip() or None) from exc
    except USER_CODE_ERRORS as exc:
        sys.modules.pop(module_name, None)
        hint = None
        if isinstance(exc, ImportError) and "no known parent package" in message_of(exc):
            dotted, root = _dotted_name(path)
            if "." in dotted:  # a module of a package, imported by path: by its import path, its relative imports work
                where = "" if os.path.samefile(root, os.getcwd()) else f" from {os.path.relpath(root)}"
                hint = f"it is part of a package, so run it by its import path{where}: gradtrace run {dotted}"
        raise UserCodeError(f"importing {os.path.relpath(path)}", exc, hint=hint) from exc
    return module


def _dotted_name(path: str) -> tuple[str, str]:
    """``(package.module, folder to run from)`` of a file inside packages (folders with ``__init__.py``)."""
    folder, stem = os.path.split(os.path.abspath(path))
    parts = [os.path.splitext(stem)[0]]
    while os.path.isfile(os.path.join(folder, "__init__.py")):
        folder, package = os.path.split(folder)
        parts.insert(0, package)
    return ".".join(parts), folder


_target_folders: list[str] = []  # the folders of the model files imported so far, in this process
_loaded_before: set[str] = set()  # the modules loaded before the first model file: never forgotten


def _forget_neighbours_of_other_targets(folder: str) -> None:
    """Drop from ``sys.modules`` what an earlier target imported from its own folder where this target's
    folder has a module of the same name.

    ``check a/model.py b/model.py``, where each imports ``layers`` from its folder: without this, b
    would get a's ``layers`` (already imported) and be traced as a's model. A module counts as an
    earlier folder's when that folder holds its top-level package or file (``layers.py``,
    ``layers/``), and is dropped only where ``folder`` holds one of that name too: a package both
    targets import from one place stays imported once (importing it twice could register its ops
    twice). Nothing loaded before the first model file is dropped (gradtrace itself, torch).
    """
    if not _target_folders:
        _loaded_before.update(sys.modules)
    others = [other for other in _target_folders if other != folder]
    if folder not in _target_folders:
        _target_folders.append(folder)
    if not others:
        return
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not file or name in _loaded_before:
            continue
        top = name.partition(".")[0]
        if not (os.path.isfile(os.path.join(folder, f"{top}.py")) or os.path.isdir(os.path.join(folder, top))):
            continue  # this target has no module of that name: it would import the same one
        for other in others:
            try:
                relative = os.path.relpath(file, other)
            except ValueError:  # another drive (Windows)
                continue
            first = relative.split(os.sep, 1)[0]
            if not relative.startswith(os.pardir) and first in (top, f"{top}.py"):
                del sys.modules[name]
                break


def _import_module(dotted: str) -> ModuleType:
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError as exc:
        if exc.name and dotted.startswith(exc.name):
            raise ModelError(
                f"no module named {exc.name!r}",
                hint="install the package, run from its folder, or name a file: model.py[:NAME]",
            ) from exc
        raise UserCodeError(f"importing {dotted}", exc) from exc
    except USER_CODE_ERRORS as exc:
        raise UserCodeError(f"importing {dotted}", exc) from exc


def _is_factory(value: Any) -> bool:
    """A class, or a function whose parameters all have defaults."""
    if inspect.isclass(value):
        return True
    if not (inspect.isfunction(value) or inspect.ismethod(value)):
        return False
    return _required_parameters(value) == []


def _required_parameters(callable_: Any) -> list[str] | None:
    """The names of the parameters a call of ``callable_`` requires; None where they cannot be read."""
    try:
        parameters = inspect.signature(callable_).parameters.values()
    except (TypeError, ValueError):
        return None
    return [
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def resolve_model(value: Any, label: str) -> Any:
    """Turn a target attribute into a model, calling it when it is a factory."""
    import torch.nn as nn

    if isinstance(value, nn.Module):
        return value
    if not callable(value):
        raise ModelError(
            f"{label} is {a_or_an(type(value).__name__)}, not a model",
            hint="point the target at an nn.Module, a callable, or a factory that returns one",
        )
    if not _is_factory(value):
        if label.endswith(":build_model"):  # the contract's factory, with parameters it cannot be given
            required = _required_parameters(value) or []
            raise ModelError(
                f"{label} takes arguments ({', '.join(required)}); build_model() is called without any",
                hint="give its parameters defaults, or name a model function that takes the inputs with TARGET:NAME",
            )
        return value  # a callable model such as def model(x, y)
    try:
        built = value()
    except USER_CODE_ERRORS as exc:
        required = _required_parameters(value) if inspect.isclass(value) and isinstance(exc, TypeError) else None
        hint = (
            f"{value.__name__} takes arguments ({', '.join(required)}): define build_model() returning "
            f"{value.__name__}(...) in the file, and run that"
            if required
            else None
        )
        raise UserCodeError(f"{label}()", exc, hint=hint) from exc
    if not callable(built):
        hint = "a factory must return an nn.Module or a callable"
        if inspect.isfunction(value):  # perhaps the forward itself, taken for a factory
            hint += (
                f"; {value.__name__} was called as a factory because all its parameters have defaults: "
                "a function that computes the output from the inputs needs a required parameter"
            )
        raise ModelError(f"{label}() returned {a_or_an(type(built).__name__)}, not a model", hint=hint)
    return built


def _model_candidates(module: ModuleType) -> list[str]:
    """Names in ``module`` that look like models: module instances, and classes and factories (functions
    without required parameters, other than the contract's ``example_inputs``) defined there."""
    import torch.nn as nn

    found = []
    for key, value in vars(module).items():
        if key.startswith("_") or key in ("example_inputs", "loss_fn"):
            continue
        defined_here = getattr(value, "__module__", None) == module.__name__
        model_class = inspect.isclass(value) and issubclass(value, nn.Module)
        factory = inspect.isfunction(value) and _is_factory(value)
        if isinstance(value, nn.Module) or (defined_here and (model_class or factory)):
            found.append(key)
    return found


def load_target(target: str) -> LoadedTarget:
    """Import a target and build its model.

    Raises:
        UsageError: the target cannot be parsed or the file does not exist.
        ModelError: the module cannot be imported or does not define a model.
        UserCodeError: the user's code raised while importing or building.
    """
    kind, location, name = split_target(target)
    with _script_argv(location):
        return _load(target, kind, location, name)


@contextlib.contextmanager
def _script_argv(location: str) -> Iterator[None]:
    """``sys.argv`` is ``[location]`` while the target is imported and its model built, as under ``python
    model.py``: gradtrace's own arguments are not the model file's (argparse at import would refuse them)."""
    saved = sys.argv
    sys.argv = [location]
    try:
        yield
    finally:
        sys.argv = saved


def _load(target: str, kind: str, location: str, name: str | None) -> LoadedTarget:
    if kind == "file":
        source = _import_file(location)
        where = os.path.basename(location)
    else:
        source = _import_module(location)
        where = location
    if name is not None:
        if not hasattr(source, name):
            candidates = _model_candidates(source)
            raise ModelError(
                f"{where} has no attribute {name!r}",
                hint=f"models found there: {', '.join(candidates)}" if candidates else None,
            )
        chosen = name
    else:
        chosen = next((n for n in DEFAULT_NAMES if hasattr(source, n)), None)
        if chosen is None:
            candidates = _model_candidates(source)
            hint = "define `model` (an nn.Module, or a function of the inputs) or `def build_model(): ...`, or pick one with TARGET:NAME"
            if candidates:
                hint += f" (found: {', '.join(candidates)})"
            raise ModelError(f"{where} defines neither `model` nor `build_model`", hint=hint)
    model = resolve_model(getattr(source, chosen), f"{where}:{chosen}")
    loss_fn = getattr(source, "loss_fn", None)
    if loss_fn is not None and not callable(loss_fn):
        raise ModelError(f"{where}: loss_fn is {a_or_an(type(loss_fn).__name__)}, not a function")
    return LoadedTarget(
        target=target,
        model=model,
        source=source,
        example_inputs=getattr(source, "example_inputs", None),
        loss_fn=loss_fn,
    )


@dataclass
class PreparedRun:
    """A loaded model with its inputs, ready for ``trace()``."""

    loaded: LoadedTarget
    args: tuple
    kwargs: dict


def parse_device(device: str) -> Any:
    """Validate ``--device``: CUDA must be available when asked for, and any other device usable here."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise UsageError(f"invalid device {device!r}", hint="e.g. cpu, cuda, cuda:1") from exc
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {device!r} was asked for, but CUDA is not available here", hint="use --device cpu")
    if parsed.type == "meta":
        raise UsageError("device 'meta' holds no values, so there are no gradients to measure", hint="use --device cpu")
    if parsed.type != "cpu":
        try:  # a type this torch was not built for (mps elsewhere than on a Mac), a GPU index past the last one
            torch.empty(0, device=parsed)
        except Exception as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0]  # torch's first sentence
            reason = reason if len(reason) <= 160 else reason[:157] + "..."
            raise UsageError(
                f"device {device!r} cannot be used here (this torch is not built for it, or there is no such device): "
                f"{reason}",
                hint="use --device cpu",
            ) from exc
    return parsed


def move_model(model: Any, device: Any) -> None:
    """Move a model (or a plain callable's top-level modules) to ``device``. Tensors on the meta device stay there
    where others are not (a template module that ``functional_call`` runs with real parameters: torch's model
    ensembling); a model on the meta device alone is refused (:func:`_no_data_is_a_model_error`)."""
    from .tracing import named_modules_of

    top = [module for name, module in named_modules_of(model) if "." not in name]
    meta = {tensor.is_meta for module in top for tensor in itertools.chain(module.parameters(), module.buffers())}
    for module in top:
        if meta == {True, False}:  # (what Module.to does, tensor by tensor)
            module._apply(lambda tensor: tensor if tensor.is_meta else tensor.to(device))
        else:
            module.to(device)


def prepare_run(
    target: str,
    *,
    input_specs: list[str] | None = None,
    inputs_file: str | None = None,
    seed: int = 0,
    input_seed: int | None = None,
    device: str = "cpu",
) -> PreparedRun:
    """Seed, load the target, move it to the device and build its inputs.

    Inputs come from ``--input`` specs, else ``--inputs FILE``, else the file's
    ``example_inputs()``. The seed is set before the model is built and again
    before the inputs are, so inputs do not depend on how the model was built;
    ``input_seed`` (``--rank-seed``: the seed plus the rank), if given, is the second.

    Raises:
        UsageError: bad device, spec or inputs file; no inputs anywhere.
        ModelError: the target cannot be loaded.
    """
    import torch

    from .inputs import build_inputs, load_inputs_file, parse_spec

    torch_device = parse_device(device)
    if input_specs and inputs_file:
        raise UsageError("use either --input specs or --inputs FILE, not both")
    for spec in input_specs or ():  # a typo is reported before the model file is imported and built
        parse_spec(spec)
    if inputs_file:  # found where it was given, should the model file change the working folder
        inputs_file = os.path.abspath(inputs_file)
    torch.manual_seed(seed)
    loaded = load_target(target)
    with _no_data_is_a_model_error("the model"):
        move_model(loaded.model, torch_device)
    torch.manual_seed(seed if input_seed is None else input_seed)
    if input_specs:
        args, kwargs = build_inputs(input_specs, device=torch_device)
    elif inputs_file:
        args, kwargs = load_inputs_file(inputs_file, device=torch_device)
    else:
        found = loaded.inputs()
        if found is None and _takes_no_arguments(loaded.model):  # forward(self): it makes its own inputs
            found = ((), {})
        if found is None:
            raise UsageError(
                f"no inputs for {target}",
                hint="pass input specs, e.g. -i 'float32[8,16]', or define example_inputs() in the model file",
            )
        with _no_data_is_a_model_error("example_inputs()"):
            args, kwargs = _to_device(found, torch_device)
    return PreparedRun(loaded, args, kwargs)


def _takes_no_arguments(model: Any) -> bool:
    """Whether the model's forward has no parameters at all (one with defaults only, a Hugging Face model's
    ``forward(input_ids=None, ...)``, still needs inputs)."""
    import torch

    function = model.forward if isinstance(model, torch.nn.Module) else model
    try:
        return not inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin, a C function: unknown
        return False


@contextlib.contextmanager
def _no_data_is_a_model_error(what: str) -> Iterator[None]:
    """Tensors on the meta device have no data to move (or to trace): say so, rather than torch's message."""
    try:
        yield
    except NotImplementedError as exc:
        if "meta tensor" not in message_of(exc):
            raise
        raise ModelError(
            f"{what} holds tensors on the meta device, which have no data to trace",
            hint="build it with real tensors (e.g. model.to_empty(device='cpu') and initialise the weights)",
        ) from exc


def _to_device(inputs: tuple[tuple, dict], device: Any) -> tuple[tuple, dict]:
    import torch

    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
            return type(value)(move(v) for v in value)
        if isinstance(value, dict):
            return {k: move(v) for k, v in value.items()}
        return value

    args, kwargs = inputs
    return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}
