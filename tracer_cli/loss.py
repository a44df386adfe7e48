"""The loss rule: how a model's output becomes the scalar that backward starts from."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

from .errors import USER_CODE_ERRORS, ModelError, UsageError, UserCodeError, first_line
from .records import a_or_an

REDUCTIONS = ("sum", "mean")
COMPLEX_LEFT_OUT = "left out: complex"  # in the rule, before the complex outputs that the loss leaves out


def floating_outputs(output: Any, path: str = "output", complex_: bool = False) -> list[tuple[str, Any]]:
    """Every real floating-point tensor in a (nested) model output, with its path (with ``complex_``,
    every complex one).

    Walks tensors, tuples/lists (a namedtuple's items named by field), mappings (dicts, Hugging Face
    ``ModelOutput``) and dataclasses.
    """
    import torch

    if isinstance(output, torch.Tensor):
        return [(path, output)] if (output.is_complex() if complex_ else output.is_floating_point()) else []
    if isinstance(output, Mapping):
        items = [(f"{path}[{key!r}]", value) for key, value in output.items()]
    elif isinstance(output, tuple) and hasattr(type(output), "_fields"):  # a namedtuple: by field name
        items = [(f"{path}.{name}", value) for name, value in zip(type(output)._fields, output)]
    elif isinstance(output, (tuple, list)):
        items = [(f"{path}[{index}]", value) for index, value in enumerate(output)]
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        items = [(f"{path}.{f.name}", getattr(output, f.name)) for f in dataclasses.fields(output)]
    else:
        return []
    found: list[tuple[str, Any]] = []
    for item_path, value in items:
        found.extend(floating_outputs(value, item_path, complex_))
    return found


def _as_scalar(loss: Any, source: str) -> Any:
    import torch

    if not isinstance(loss, torch.Tensor):
        raise ModelError(
            f"{source} is {a_or_an(type(loss).__name__)}, not a tensor",
            hint="return a scalar tensor from loss_fn, or let gradtrace reduce the output",
        )
    from .tracing import _own_ops

    with _own_ops(torch):  # (gradtrace's look at the loss: out of sight of the user's modes)
        size, dims = loss.numel(), loss.dim()
    if size != 1:
        raise ModelError(
            f"{source} has shape {tuple(loss.shape)}; a loss must be a single value",
            hint="reduce it in loss_fn (e.g. with .mean())" if source == "loss_fn(output)"
            else "return a single value, or define loss_fn(output) in the model file that reduces it (e.g. with .mean())",
        )
    return loss if dims == 0 else loss.sum()


def compute_loss(
    output: Any, loss_fn: Callable[[Any], Any] | None = None, reduction: str = "sum"
) -> tuple[Any, str]:
    """Apply the documented loss rule to a model output.

    Args:
        output: what the model returned.
        loss_fn: the user's ``loss_fn(output)``, if any.
        reduction: "sum" or "mean", for the fallback over floating-point outputs.

    Returns:
        ``(loss, rule)``: the 0-dim loss tensor and a sentence naming the rule used.

    Raises:
        ModelError: no loss can be made from the output.
        UserCodeError: ``loss_fn`` raised.
    """
    import torch

    if reduction not in REDUCTIONS:
        raise UsageError(f"unknown loss reduction {reduction!r}", hint="use 'sum' or 'mean'")
    if loss_fn is not None:
        try:
            loss = loss_fn(output)
        except USER_CODE_ERRORS as exc:
            raise UserCodeError("loss_fn(output)", exc) from exc
        return _as_scalar(loss, "loss_fn(output)"), "loss_fn(output)"
    if isinstance(output, torch.Tensor) and output.dim() == 0 and output.is_floating_point():
        return output, "output (a scalar)"
    attribute_loss = getattr(output, "loss", None)
    if isinstance(attribute_loss, torch.Tensor):
        return _as_scalar(attribute_loss, "output.loss"), "output.loss"
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return _as_scalar(output["loss"], 'output["loss"]'), 'output["loss"]'

    outputs = floating_outputs(output)
    with_grad = [(path, t) for path, t in outputs if t.requires_grad]
    chosen = with_grad or outputs
    if not chosen:
        if floating_outputs(output, complex_=True):
            raise ModelError(
                f"the model's output ({type(output).__name__}) holds complex tensors and no real floating-point "
                "one: a complex loss has no gradient to follow",
                hint="define loss_fn(output) returning a real scalar, e.g. output.abs().pow(2).sum() or output.real.sum()",
            )
        import torch

        what = a_or_an(f"{str(output.dtype).removeprefix('torch.')} tensor") if isinstance(output, torch.Tensor) else type(output).__name__
        raise ModelError(
            f"the model returned {what}, which holds no floating-point tensor to differentiate",
            hint="define loss_fn(output) in the model file, or return a tensor",
        )
    paths = ", ".join(path for path, _ in chosen)
    # float16 and bfloat16 outputs reduced in float32: the sum of a healthy float16 output overflows at 65504
    half = {torch.float16, torch.bfloat16}
    widened = any(t.dtype in half for _, t in chosen)
    try:
        terms = [
            getattr(t, reduction)(dtype=torch.float32) if t.dtype in half else getattr(t, reduction)() for _, t in chosen
        ]
        loss = terms[0]
        for term in terms[1:]:
            loss = loss + term
        loss = _as_scalar(loss, f"the .{reduction}() of {paths}")
    except ModelError:
        raise
    except Exception as exc:  # a tensor type without a plain .sum() (a nested tensor), or terms on several devices
        raise ModelError(
            f"the output could not be reduced to a loss ({paths}.{reduction}() raised {first_line(exc, 160)})",
            hint="define loss_fn(output) in the model file (trace(..., loss_fn=...)) returning a scalar tensor",
        ) from exc
    rule = f"{paths}.{reduction}()" if len(chosen) == 1 else f"sum of .{reduction}() over {paths}"
    rule += " (half precision in float32)" if widened else ""
    # a complex output has no real sum to add: said in the rule, or what only it uses looks unused (no gradient)
    left_out = [path for path, t in floating_outputs(output, complex_=True) if t.requires_grad]
    if left_out:
        rule += f"; {COMPLEX_LEFT_OUT} {', '.join(left_out)} (a loss_fn can include {'it' if len(left_out) == 1 else 'them'})"
    return loss, rule
