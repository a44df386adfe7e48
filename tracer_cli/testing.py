"""Gradient health from a test suite: ``assert_gradients_healthy(model, args)`` in one line.

    from tracer_cli.testing import assert_gradients_healthy

    def test_gradients():
        assert_gradients_healthy(build_model(), (torch.randn(8, 16),), max_grad_norm=100.0)

The same checks as ``gradtrace check``; a failure raises AssertionError whose message is the findings
table, naming the node, module and parameter (e.g. ``SqrtBackward0`` in module ``act``).
"""

from __future__ import annotations

import functools
import io
import math
import numbers
from typing import Any, Callable, Iterable

from .checks import (
    CHECK_DEFAULT_FAILING,
    CheckPolicy,
    TargetReport,
    Thresholds,
    check_traces,
    parse_fail_on,
    unmet_requirement,
)
from .records import Trace

__all__ = ["assert_gradients_healthy", "format_report"]

_MESSAGE_WIDTH = 160


def assert_gradients_healthy(
    model: Callable[..., Any],
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    loss_fn: Callable[[Any], Any] | None = None,
    max_grad_norm: float | None = None,
    min_grad_norm: float | None = None,
    fail_on: str | Iterable[str] = (),
    warn_on: str | Iterable[str] = (),
    loss_reduction: str = "sum",
    input_grad: bool | None = None,
    train: bool | None = None,
    gradcheck: bool = False,
    replay: bool = False,
) -> Trace:
    """Trace ``model(*args, **kwargs)`` and its backward; raise AssertionError on unhealthy gradients.

    Args:
        model: an ``nn.Module`` or any callable.
        args: positional inputs (a single tensor is one argument).
        kwargs: keyword inputs.
        loss_fn: ``loss_fn(output)`` returning the scalar to differentiate; without it the output is
            reduced as ``gradtrace run`` does (a scalar as is, ``.loss``, else the sum of every output).
        max_grad_norm: fail when a parameter's gradient norm, or the total norm, is above it.
        min_grad_norm: fail when a parameter's gradient norm, or the total norm, is below it.
        fail_on: checks that fail besides nonfinite and nograd (``"zero"``, ``"norm"``; a comma string or names).
        warn_on: checks that only warn (e.g. ``"nograd"`` for a parameter unused on purpose).
        loss_reduction, input_grad, train: as for :func:`tracer_cli.trace`.
        gradcheck: check custom autograd.Functions numerically; a failure fails the assertion.
        replay: run each node's backward again; ``fail_on="replay"`` makes a difference fail.

    Returns:
        The :class:`~tracer_cli.records.Trace`, for further assertions.

    Raises:
        AssertionError: a failing finding; the message is the findings table.
        ValueError: an unknown check name, ``min_grad_norm`` above ``max_grad_norm``, or a check named in
            ``fail_on``/``warn_on`` that would not run (``norm`` without a threshold, ``gradcheck`` or
            ``replay`` without ``gradcheck=True`` or ``replay=True``).
        tracer_cli.errors.GradtraceError: the model (or its loss) raised, or cannot be traced.
    """
    __tracebackhide__ = True  # pytest shows the test's line, not this one
    from .tracing import trace

    for keyword, value in (("max_grad_norm", max_grad_norm), ("min_grad_norm", min_grad_norm)):
        if value is not None and not (isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 <= value < math.inf):
            raise ValueError(f"{keyword} must be a number from 0 up, not {value!r}")
    thresholds = Thresholds(max_grad_norm, min_grad_norm)
    if max_grad_norm is not None and min_grad_norm is not None and min_grad_norm > max_grad_norm:
        raise ValueError(f"min_grad_norm {min_grad_norm:g} is above max_grad_norm {max_grad_norm:g}")
    fail_on, warn_on = parse_fail_on(fail_on, option="fail_on"), parse_fail_on(warn_on, option="warn_on")
    both = [check for check in fail_on if check in warn_on]
    if both:
        raise ValueError(f"{', '.join(map(repr, both))} named in both fail_on and warn_on")
    if "divergence" in fail_on + warn_on:
        raise ValueError("'divergence' compares torchrun ranks; assert_gradients_healthy traces one process")
    asked_for = [check for check, asked in (("gradcheck", gradcheck), ("replay", replay)) if asked]
    for keyword, checks in (("fail_on", fail_on), ("warn_on", warn_on)):  # a check that would pass silently
        unmet = unmet_requirement(checks, thresholds, asked_for)
        if unmet == "norm":
            raise ValueError(f"{keyword} names 'norm' but no threshold is set: pass max_grad_norm and/or min_grad_norm")
        if unmet is not None:
            raise ValueError(f"{keyword} names {unmet!r}, which runs only with {unmet}=True")
    policy = CheckPolicy.build(CHECK_DEFAULT_FAILING, fail_on=fail_on, warn_on=warn_on, thresholds=thresholds)
    step = functools.partial(
        trace, model, args, kwargs, loss_fn=loss_fn, loss_reduction=loss_reduction, input_grad=input_grad, train=train,
        gradcheck=gradcheck, replay=replay,
    )
    result = _where_forward_made_it(step)
    report = check_traces([result], policy, target=result.meta.target)
    if report.failures:
        raise AssertionError(format_report(report))
    return result


def _where_forward_made_it(step: Callable[..., Trace]) -> Trace:
    """``step()``; where its loss is NaN or infinite (forward made it), the same step again with forward values,
    which tell where, as ``gradtrace check`` does: from the same random state (dropout draws the same masks) and
    the same inputs (put back where forward changed them). The first trace stands where forward does not repeat
    itself (the second loss is finite)."""
    import torch

    from .inputs import InputSnapshot, tensors_in

    args, kwargs = step.args[1], step.args[2] or {}
    inputs = InputSnapshot(args if isinstance(args, tuple) else (args,), kwargs)
    tensors = tensors_in((args, kwargs), torch.Tensor)
    if isinstance(step.args[0], torch.nn.Module):
        tensors += list(step.args[0].parameters())
    devices = sorted({tensor.device.index or 0 for tensor in tensors if tensor.is_cuda})
    with torch.random.fork_rng(devices=devices):
        result = step()
    loss = result.meta.loss
    if loss is None or math.isfinite(loss):
        return result
    inputs.restore()
    again = step(forward_stats=True)
    return again if again.meta.loss is not None and not math.isfinite(again.meta.loss) else result


def format_report(report: TargetReport, width: int = _MESSAGE_WIDTH) -> str:
    """The findings table and verdict of one report as plain text (no colour)."""
    from rich.console import Console

    from .render.findings import render_report, verdict

    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, highlight=False, legacy_windows=False)
    console.print(verdict([report]))
    console.print(render_report(report))
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())
