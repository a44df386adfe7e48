"""``--gradcheck``: custom ``autograd.Function`` backwards checked numerically, in float64.

While the forward runs, each custom Function call is recorded (its class and the
arguments it was called with). After backward, each is checked on float64 copies of
those arguments in two ways, both along random directions (so they scale to large
tensors), and fails if either fails:

* PyTorch's fast-mode ``gradcheck``. Its absolute tolerance grows with the number of
  elements (``atol`` times the sums of its two non-negative unit vectors), so on a tensor
  of a few thousand elements it passes a backward that is off by several percent.
* The analytical and the numerical directional derivative of ``<w, f(x)>`` along a
  random ``u`` (signed ``w`` and ``u``), which must agree to ``RTOL`` beyond what
  float64 rounding in the central difference explains. Their relative difference is
  the ``mismatch`` reported.

A Function that casts its inputs down and computes in float32 is checked by the second
alone, at float32's precision (:func:`_inner_dtype`); in bfloat16 or float16, not at all.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

from .errors import first_line
from .records import Gradcheck
from .tracing import _own_ops, _PerThread, _tensors_in

# Functions of PyTorch's own machinery: their "backward" is autograd itself (a checkpoint), code torch.compile
# generated from autograd's (a compiled region, whose backward also runs only once), or an identity that calls a
# module's full backward hooks (BackwardHookFunction): nothing of the user's to check.
SKIPPED = frozenset({"CheckpointFunction", "CompiledFunction", "BackwardHookFunction"})
_STEP = 1e-8  # the central difference's step, times a standard normal direction
RTOL = 1e-3  # PyTorch gradcheck's own relative tolerance
_ROUNDING = 10 * 2.0**-52  # float64 rounding of each output value, with a margin
# A Function that computes in float32 inside (it casts its float64 inputs down) gives outputs that a step of
# _STEP does not move beyond float32's rounding: its central difference is taken with steps of this share of
# each input (relative: inputs of 0.01, a weight's, would bend the difference by the function's curvature),
# and it is checked by the directional derivative alone (PyTorch's check takes absolute steps of 1e-6). Its
# rounding is float32's, a few units in the last place per output value, summed as the random signs of the
# weights sum them (the square root of the sum of squares, six times over) rather than all in one direction:
# that would hide errors of a few percent on a few thousand outputs.
_STEP_FLOAT32 = 1e-3
_ROUNDING_FLOAT32 = 2 * 2.0**-24
_ROUNDING_SPREAD = 6.0
_NOISE_FLOAT32 = 0.02  # no verdict where that rounding is more than this share of the directional derivative


# Function.apply is one attribute for the whole process: while any thread records, it is _apply, which hands
# each call to the innermost recorder of the calling thread (each recorder calls the one it was opened inside,
# the outermost torch's apply); other threads' calls go straight to torch's apply.
def _install_apply() -> Any:
    import torch

    function = torch.autograd.Function
    original = function.__dict__["apply"]  # a classmethod; from torch 2.14 a C classmethod_descriptor
    function.apply = classmethod(_apply)
    return original


def _restore_apply(original: Any) -> None:
    import torch

    torch.autograd.Function.apply = original


_APPLY = _PerThread(_install_apply, _restore_apply)


def _torch_call(cls: type, *args: Any, **kwargs: Any) -> Any:
    return _APPLY.original.__get__(None, cls)(*args, **kwargs)  # bound to cls: either kind of classmethod


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    return (_APPLY.handler() or _torch_call)(cls, *args, **kwargs)


@contextlib.contextmanager
def recording_calls(
    calls: dict[int, tuple] | None, keep_args: bool, sites: Any = None, on_output: Callable[[Any], None] | None = None
) -> Iterator[None]:
    """Record each custom Function call of this thread under ``id(node)`` (and, with ``sites``, where it was
    made; with ``on_output``, its output: no TorchFunctionMode sees it).

    The record is ``(node, Function class, args, kwargs, tensor_mask, outputs)``: ``tensor_mask``
    says which positional arguments were tensors (the backward returns one gradient per
    argument, the engine keeps those of tensors); ``outputs`` is ``(shape, dtype, device)`` of
    each tensor output, in order (what the backward receives a gradient for). ``args`` and
    ``kwargs`` are kept only with ``keep_args`` (they hold the inputs alive until the check).
    """
    import torch

    next_sequence_nr = torch._C._autograd._get_sequence_nr

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        first = next_sequence_nr()
        output = inner(cls, *args, **kwargs)
        if sites is not None:  # the Function's node was numbered before its forward ran; after it, the
            site = sites.user_site()  # caller's line goes on
            sites.starts += (first, first + 1)
            sites.sites += (site, site)
        if on_output is not None:
            on_output(output)
        if calls is None:
            return output
        with _own_ops(torch):  # (reads of the output's attributes, out of sight of the user's modes)
            tensors = _tensors_in(output, torch.Tensor)
            for tensor in tensors:
                if tensor.grad_fn is not None:
                    mask = tuple(isinstance(a, torch.Tensor) for a in args)
                    kept = (args, kwargs) if keep_args else (None, None)
                    outputs = tuple((t.shape, t.dtype, t.device) for t in tensors)
                    calls[id(tensor.grad_fn)] = (tensor.grad_fn, cls, *kept, mask, outputs)
                    break
        return output

    with _APPLY.handling(apply) as outer:
        inner = outer or _torch_call
        yield


def check(cls: type, args: tuple, kwargs: dict) -> Gradcheck | None:
    """Check one custom Function's backward on float64 copies of the arguments it was called with (None for
    PyTorch's own Functions, :data:`SKIPPED`)."""
    import torch

    if cls.__name__ in SKIPPED:
        return None
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
        """The Function's floating-point and complex outputs (an integer or bool one, a mask it marks
        non-differentiable, has no derivative to check: PyTorch's gradcheck fails on its differences)."""
        rebuilt = list(args)
        for position, tensor in zip(positions, tensors):
            rebuilt[position] = tensor.clone()  # a Function that changes its input in place (mark_dirty) may
        output = cls.apply(*rebuilt, **kwargs)  # not change a leaf, nor what the next evaluation starts from
        return tuple(t for t in _tensors_in(output, torch.Tensor) if t.is_floating_point() or t.is_complex())

    try:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.manual_seed(0)
            inside = _inner_dtype(function, inputs)
            torch.manual_seed(0)  # the checks' directions, whatever the look above drew
            if inside in (torch.float16, torch.bfloat16):
                name = str(inside).removeprefix("torch.")
                return Gradcheck(None, None, f"computes in {name} inside, too coarse for a numerical derivative")
            if inside is torch.float32:

                def at(step: float, moved: list[Any] = inputs) -> tuple[float, bool | None, float]:
                    torch.manual_seed(0)  # the same directions and weights at every step
                    return _directional_mismatch(function, moved, step, _ROUNDING_FLOAT32, narrow=True)

                passed, step = True, _STEP_FLOAT32
                mismatch, agree, noise = at(step)
                while agree is False and step > _STEP_FLOAT32 / 64:
                    # a curvature's share of the difference shrinks with the step squared, a wrong backward's
                    # not at all: a smaller step before failing (a sine of 10x at inputs of 3 needs one)
                    step /= 4
                    smaller = at(step)
                    if smaller[2] > _NOISE_FLOAT32 or smaller[0] > mismatch / 2:  # rounding takes over, or it stands
                        break
                    mismatch, agree, noise = smaller
                if noise > _NOISE_FLOAT32 and agree is not None:
                    return Gradcheck(None, mismatch, "computes in float32 inside, whose rounding hides the derivative at these inputs")

                def alone(moved: list[Any]) -> bool | None:
                    return at(step, moved)[1]
            else:
                passed = torch.autograd.gradcheck(
                    function, tuple(inputs), fast_mode=True, raise_exception=False, check_undefined_grad=False
                )
                mismatch, agree, _ = _directional_mismatch(function, inputs)

                def alone(moved: list[Any]) -> bool | None:
                    torch.manual_seed(0)
                    return _directional_mismatch(function, moved)[1]

            if agree is None:  # PyTorch's check is misled by the same kink
                why = "not differentiable at the inputs it was called with (a kink, like ReLU's at 0)"
                return Gradcheck(None, mismatch, why)
            if bool(passed) and agree:
                return Gradcheck(True, mismatch, None)
            # which arguments' gradients are wrong: each checked alone, the others held still
            differentiable = [index for index, x in enumerate(inputs) if x.requires_grad]
            wrong = [
                index for index in differentiable
                if len(differentiable) > 1 and alone([x if i == index else x.detach() for i, x in enumerate(inputs)]) is False
            ]
            return Gradcheck(False, mismatch, None, tuple(_argument_name(cls, positions[index]) for index in wrong))
    except Exception as exc:  # the Function does not run in float64, or raised: report it
        return Gradcheck(None, None, first_line(exc, 300))


def _argument_name(cls: type, position: int) -> str:
    """The name of the Function's ``position``-th argument in its forward's signature (after the context, which
    forward takes, whatever it is called, unless the Function has a ``setup_context``), ``ts[1]`` for one in
    ``*ts``, else ``argument N``."""
    import inspect

    import torch

    try:
        parameters = list(inspect.signature(cls.forward).parameters.values())
    except (TypeError, ValueError):
        return f"argument {position}"
    base = getattr(torch.autograd.function, "_SingleLevelFunction", torch.autograd.Function)
    if parameters and getattr(cls, "setup_context", None) is getattr(base, "setup_context", None):
        parameters = parameters[1:]  # forward(ctx, ...): the context is not an argument of apply()
    positional = [p for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if position < len(positional):
        return positional[position].name
    rest = next((p for p in parameters if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
    if rest is not None:
        return f"{rest.name}[{position - len(positional)}]"
    return f"argument {position}"


def _inner_dtype(function: Any, inputs: list[Any]) -> Any:
    """The dtype the Function computes in: float64, or a narrower one it casts its inputs down to, known by
    outputs that are all exactly that dtype's values at inputs nudged off float32's (a float64 computation
    of them almost never is) but that move with a larger nudge. float64 where no output tells: none that
    is real and float64, none but zeros and non-finite values, values on a coarse grid only (a rounding or
    quantizing Function's), or outputs that a nudge of 1% does not move (a constant's)."""
    import torch

    def outputs(relative: float) -> list[Any]:
        with torch.no_grad():
            nudged = [
                x + (x.abs() + 1) * relative * torch.randn_like(x) if x.requires_grad and x.dtype is torch.float64 else x
                for x in inputs
            ]
            return [o for o in _tensors_in(function(*nudged), torch.Tensor) if o.dtype is torch.float64]

    near = outputs(1e-9)
    values = [v for v in (o[o.isfinite() & (o != 0)] for o in near) if v.numel()]
    if not values:
        return torch.float64
    # values on a coarse grid, multiples of a power of two within a quarter of the smallest (whole numbers, a
    # fake quantizer's round(x * 16) / 16): what the Function computes, not a narrow dtype's rounding
    smallest = min(float(v.abs().min()) for v in values)
    grid = 2.0 ** (math.floor(math.log2(smallest)) - 2)
    if all(torch.equal((v / grid).round(), v / grid) for v in values):
        return torch.float64
    narrow = next(
        (d for d in (torch.bfloat16, torch.float16, torch.float32) if all(torch.equal(v.to(d).to(torch.float64), v) for v in values)),
        torch.float64,
    )
    if narrow is not torch.float64 and all(torch.equal(a, b) for a, b in zip(near, outputs(1e-2))):
        return torch.float64
    return narrow


# Random directions per check. Along one, a backward off by a few percent, in elements of both signs, agrees with the
# numerical derivative by chance where its errors cancel in the sum (3% off: about one direction in 30 within 1e-3);
# along three, all of them about one time in 30,000.
DIRECTIONS = 3


def _directional_mismatch(
    function: Any, inputs: list[Any], step: float = _STEP, rounding_unit: float = _ROUNDING, narrow: bool = False
) -> tuple[float, bool | None, float]:
    """:func:`_one_direction` along DIRECTIONS random directions, each with weights of its own: the largest
    mismatch and noise, and a verdict: None where one direction finds a kink, else True where all agree."""
    results = [_one_direction(function, inputs, step, rounding_unit, narrow) for _ in range(DIRECTIONS)]
    verdicts = [agree for _, agree, _ in results]
    verdict = None if None in verdicts else all(verdicts)
    return max(mismatch for mismatch, _, _ in results), verdict, max(noise for _, _, noise in results)


def _one_direction(
    function: Any, inputs: list[Any], step: float = _STEP, rounding_unit: float = _ROUNDING, narrow: bool = False
) -> tuple[float, bool | None, float]:
    """Compare the analytical and the numerical derivative of ``<w, f(x)>`` along a random direction.

    Returns their relative difference, a verdict, and the share of the derivative that rounding of the
    outputs may account for. The verdict: True where they agree to ``RTOL`` beyond what
    float64 rounding of the outputs explains (it matters where the derivative is tiny beside the
    values, a saturated activation), False where they do not, None where ``f`` is not differentiable
    at ``x`` along the direction (a kink on the way, ReLU's at an input that is exactly 0).

    A kink shows as a forward and a backward difference that disagree with the analytical derivative
    differently, by an amount that grows with the step. A smooth function's differences disagree too,
    by its curvature, where its derivative vanishes (``x * x`` at 0): that amount grows with the
    step's square. So where they disagree, the step is doubled: the disagreement doubling is a kink.

    The step is small (``_STEP``) so that few elements straddle a kink; the analytical derivative is
    taken along the displacement actually made (``x + h`` is rounded). A Function that computes in float32
    inside is checked (``narrow``) with a larger ``step``, relative to each input, and float32's ``rounding_unit``,
    its rounding summed as random errors (``_ROUNDING_SPREAD`` times the root of the sum of their squares).
    """
    import torch

    differentiable = [x for x in inputs if x.requires_grad]
    produced = _tensors_in(function(*inputs), torch.Tensor)
    keep = [o.requires_grad for o in produced]
    outputs = [o for o, kept in zip(produced, keep) if kept]
    weights = [torch.randn_like(o) for o in outputs]
    grads = torch.autograd.grad(outputs, differentiable, weights, allow_unused=True)
    here = [o.detach() for o in outputs]
    direction = [torch.randn_like(x) for x in differentiable]
    if narrow:  # relative to each element and to the typical one (an element at 0 moves too)
        direction = [d * (x.detach().abs() + float(x.detach().abs().mean()) + 1e-30) for d, x in zip(direction, differentiable)]

    def dot(pairs: Any) -> float:
        """The real inner product: of complex tensors, that of their real and imaginary parts (PyTorch's
        gradient of a real function of ``z`` is ``dL/dRe z + i dL/dIm z``)."""
        return sum(float((a.conj() * b).real.sum()) for a, b in pairs if a is not None)

    def differences(step: float) -> tuple[float, float, float, float]:
        """``(analytical, numerical, excess, rounding)`` of a central difference at ``step``: the sums of
        the forward and the backward difference, how much more the forward one differs from the analytical
        derivative than the backward one, and what float64 rounding of the outputs explains."""
        with torch.no_grad():
            steps = iter([step * d for d in direction])
            moved = [(x.detach(), next(steps)) if x.requires_grad else None for x in inputs]
            ahead = [x if m is None else m[0] + m[1] for x, m in zip(inputs, moved)]
            behind = [x if m is None else m[0] - m[1] for x, m in zip(inputs, moved)]
            plus = [p for p, kept in zip(_tensors_in(function(*ahead), torch.Tensor), keep) if kept]
            minus = [m for m, kept in zip(_tensors_in(function(*behind), torch.Tensor), keep) if kept]
            moved_by = [(a - x.detach(), x.detach() - b) for a, b, x in zip(ahead, behind, inputs) if x.requires_grad]
            analytical_ahead = dot(zip(grads, (d for d, _ in moved_by)))
            analytical_behind = dot(zip(grads, (d for _, d in moved_by)))
            numerical_ahead = dot((w, p - o) for w, p, o in zip(weights, plus, here))
            numerical_behind = dot((w, o - m) for w, o, m in zip(weights, here, minus))
            magnitudes = (w.abs() * (p.abs() + 2 * o.abs() + m.abs()) for w, p, o, m in zip(weights, plus, here, minus))
            if narrow:
                rounding = rounding_unit * _ROUNDING_SPREAD * math.sqrt(sum(float(t.square().sum()) for t in magnitudes))
            else:
                rounding = rounding_unit * sum(float(t.sum()) for t in magnitudes)
        excess = (numerical_ahead - analytical_ahead) - (numerical_behind - analytical_behind)
        return analytical_ahead + analytical_behind, numerical_ahead + numerical_behind, excess, rounding

    analytical, numerical, excess, rounding = differences(step)
    scale = max(abs(analytical), abs(numerical), 1e-300)
    tolerance = RTOL * scale + rounding
    mismatch = abs(analytical - numerical) / scale
    noise = rounding / scale
    if abs(excess) > tolerance:
        doubled = differences(2 * step)[2]
        if abs(doubled - 2 * excess) <= abs(doubled - 4 * excess):  # grows with the step: a kink
            return mismatch, None, noise
    return mismatch, abs(analytical - numerical) <= tolerance, noise
