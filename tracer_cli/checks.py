"""Health findings for ``--fail-on``: which gradient problems a trace (or a comparison) shows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .records import Trace

FAIL_ON = ("nonfinite", "nograd", "zero", "divergence")


@dataclass(frozen=True)
class Finding:
    """One problem: its kind (a ``--fail-on`` name) and a sentence naming the node or parameter."""

    kind: str
    message: str


def parse_fail_on(text: str | None) -> tuple[str, ...]:
    """``"nonfinite,divergence"`` → ``("nonfinite", "divergence")``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if not text:
        return ()
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in FAIL_ON]
    if unknown:
        raise ValueError(f"unknown --fail-on check {', '.join(map(repr, unknown))}; known: {', '.join(FAIL_ON)}")
    return names


def trace_findings(trace: Trace) -> list[Finding]:
    """Non-finite gradients, parameters without gradient, parameters whose gradient is all zero."""
    findings = [
        Finding("nonfinite", f"{node.nonfinite_kind} gradient at #{node.id} {node.label()}")
        for node in trace.nonfinite_nodes()
    ]
    findings += [Finding("nograd", f"parameter {name} received no gradient") for name in trace.params_without_grad]
    findings += [
        Finding("zero", f"parameter {node.param} has an all-zero gradient")
        for node in trace.executed()
        if node.is_leaf and node.param and not node.param.startswith("input:") and node.grad_norm == 0
    ]
    return findings


def comparison_findings(comparison: dict[str, Any]) -> list[Finding]:
    """A divergence between ranks (or runs), named by its origin."""
    first = comparison.get("first_divergent")
    findings = []
    if first is not None:
        where = first["param"] or (first["module"] if first["module"] is not None else "outside any module")
        findings.append(
            Finding("divergence", f"{first['kind']} divergence at #{first['id']} {first['name']} ({where}), ranks {first['ranks']}")
        )
    else:  # with an origin, differing parameter gradients are its consequence, not news
        findings += [
            Finding("divergence", f"parameter {name} has different gradients across ranks after backward")
            for name in comparison.get("unsynchronized_params", ())
        ]
    return findings


def failing(findings: list[Finding], fail_on: tuple[str, ...]) -> list[Finding]:
    """The findings whose kind was asked for with ``--fail-on``."""
    return [finding for finding in findings if finding.kind in fail_on]
