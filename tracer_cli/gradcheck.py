"""``--gradcheck``: custom ``autograd.Function`` backwards checked numerically, in float64.

While the forward runs, each custom Function call is recorded (its class and the
arguments it was called with). After backward, each is checked with PyTorch's
fast-mode ``gradcheck`` (one random direction, so it scales to large tensors) on
float64 copies of those arguments. Beside the verdict, the analytical and the
numerical directional derivatives along a random direction are compared, which
gives the size of the mismatch.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from .records import Gradcheck
from .tracing import _tensors_in

# Functions of PyTorch's own machinery: their "backward" is autograd itself, nothing to check.
SKIPPED = frozenset({"CheckpointFunction"})
_EPS = 1e-6


@contextlib.contextmanager
def recording_calls(calls: dict[int, tuple] | None, keep_args: bool, sites: Any = None) -> Iterator[None]:
    """Record each custom Function call under ``id(node)`` (and, with ``sites``, where it was made).

    The record is ``(node, Function class, args, kwargs, tensor_mask)``: ``tensor_mask``
    says which positional arguments were tensors (the backward returns one gradient per
    argument, the engine keeps those of tensors). ``args`` and ``kwargs`` are kept only
    with ``keep_args`` (they hold the inputs alive until the check).
    """
    import torch

    function = torch.autograd.Function
    original = function.__dict__["apply"]  # a classmethod; from torch 2.14 a C classmethod_descriptor
    next_sequence_nr = torch._C._autograd._get_sequence_nr

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        first = next_sequence_nr()
        output = original.__get__(None, cls)(*args, **kwargs)  # bound to cls: either kind of classmethod
        if sites is not None:  # the Function's node was numbered before its forward ran; after it, the
            site = sites.user_site()  # caller's line goes on
            sites.starts += (first, first + 1)
            sites.sites += (site, site)
        if calls is None:
            return output
        for tensor in _tensors_in(output, torch.Tensor):
            if tensor.grad_fn is not None:
                mask = tuple(isinstance(a, torch.Tensor) for a in args)
                kept = (args, kwargs) if keep_args else (None, None)
                calls[id(tensor.grad_fn)] = (tensor.grad_fn, cls, *kept, mask)
                break
        return output

    function.apply = classmethod(apply)
    try:
        yield
    finally:
        function.apply = original


def check(cls: type, args: tuple, kwargs: dict) -> Gradcheck:
    """Check one custom Function's backward on float64 copies of the arguments it was called with."""
    import torch

    if cls.__name__ in SKIPPED:
        return Gradcheck(None, None, f"{cls.__name__} belongs to PyTorch: not checked")
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    if not any(args[i].requires_grad and (args[i].is_floating_point() or args[i].is_complex()) for i in positions):
        return Gradcheck(None, None, "no input requires grad")

    def widen(tensor: Any) -> Any:
        wide = tensor.detach()
        if wide.is_floating_point():
            wide = wide.to(torch.float64)
        elif wide.is_complex():
            wide = wide.to(torch.complex128)
        return wide.requires_grad_(tensor.requires_grad and (wide.is_floating_point() or wide.is_complex()))

    inputs = [widen(args[i]) for i in positions]

    def function(*tensors: Any) -> Any:
        rebuilt = list(args)
        for position, tensor in zip(positions, tensors):
            rebuilt[position] = tensor
        return cls.apply(*rebuilt, **kwargs)

    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.manual_seed(0)
            passed = torch.autograd.gradcheck(
                function, tuple(inputs), fast_mode=True, raise_exception=False, check_undefined_grad=False
            )
            mismatch = _directional_mismatch(function, inputs)
    except Exception as exc:  # the Function does not run in float64, or raised: report it
        return Gradcheck(None, None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
    return Gradcheck(bool(passed), mismatch, None)


def _directional_mismatch(function: Any, inputs: list[Any]) -> float:
    """Relative difference of the analytical and numerical derivative of ``<v, f(x)>`` along a random ``u``."""
    import torch

    differentiable = [x for x in inputs if x.requires_grad]
    directions = [torch.randn_like(x) for x in differentiable]
    produced = _tensors_in(function(*inputs), torch.Tensor)
    keep = [o.requires_grad for o in produced]
    outputs = [o for o, kept in zip(produced, keep) if kept]
    weights = [torch.randn_like(o) for o in outputs]
    grads = torch.autograd.grad(outputs, differentiable, weights, allow_unused=True)
    analytical = sum(float((g * u).sum()) for g, u in zip(grads, directions) if g is not None)

    def shifted(sign: float) -> list[Any]:
        moved, step = [], iter(directions)
        for x in inputs:
            moved.append(x.detach() + sign * _EPS * next(step) if x.requires_grad else x)
        return moved

    with torch.no_grad():
        plus = [p for p, kept in zip(_tensors_in(function(*shifted(1.0)), torch.Tensor), keep) if kept]
        minus = [m for m, kept in zip(_tensors_in(function(*shifted(-1.0)), torch.Tensor), keep) if kept]
    numerical = sum(float((w * (p - m)).sum()) for w, p, m in zip(weights, plus, minus)) / (2 * _EPS)
    scale = max(abs(analytical), abs(numerical), 1e-12)
    return abs(analytical - numerical) / scale
