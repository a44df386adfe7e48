"""Health findings: which gradient problems a trace (or a comparison of ranks) shows, and which of them fail.

A finding names where a problem is (node, module, parameter) and its value. Whether it fails or only
warns is the :class:`CheckPolicy`'s decision: ``check`` fails on non-finite gradients, parameters
without gradient and any norm threshold the user set; ``--fail-on`` adds checks, ``--warn-on``
demotes them. Nothing here imports torch.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Sequence

from .compare import who_differs
from .loss import COMPLEX_LEFT_OUT
from .records import Node, Trace, joint_norm, listed, short_name

CHECKS = ("nonfinite", "nograd", "zero", "norm", "divergence", "gradcheck", "replay")
CHECK_DEFAULT_FAILING = ("nonfinite", "nograd", "gradcheck")  # gradcheck and replay run only when asked for
ALL_PARAMETERS = "(all parameters)"  # the parameter column of the total-norm finding
_LISTED = 5  # parameter names listed in a message before "and N more"


@dataclass(frozen=True)
class Finding:
    """One problem found in a trace.

    Attributes:
        kind: the check that found it (a ``--fail-on`` name).
        detail: what is wrong, without the location (e.g. ``"‖grad‖ 3.1e+03 above --max-grad-norm 1000"``).
        node: the node's id, when a node shows it.
        name: that node's name (``"SqrtBackward0"``).
        module: the module path (``""`` the root module); ``None`` outside any module or not applicable.
        param: the parameter (or input) concerned, or ``ALL_PARAMETERS`` for the total norm.
        value: the value found: a norm, or ``"nan"`` / ``"inf"``, or a divergence kind.
        ranks: under torchrun, the ranks where it was found (empty: a single process, or every rank).
        source: ``path:line`` of the user's source line that created the node, where known.
    """

    kind: str
    detail: str
    node: int | None = None
    name: str | None = None
    module: str | None = None
    param: str | None = None
    value: float | str | None = None
    ranks: tuple[int, ...] = ()
    source: str | None = None

    @property
    def location(self) -> str:
        """``#5 SqrtBackward0 in act``, ``#9 AccumulateGrad (fc.weight)``, ``parameter fc.bias``."""
        if self.node is not None:
            where = f"#{self.node} {(self.name or '').rsplit('::', 1)[-1]}"  # torch::autograd::AccumulateGrad
            if self.param is not None:
                return f"{where} ({self.param})"
            return f"{where} in {self.module or '<root>'}" if self.module is not None else f"{where} outside any module"
        if self.param == ALL_PARAMETERS:
            return "all parameters"
        if self.param is not None:
            return f"parameter {self.param}"
        return "the model"

    @property
    def message(self) -> str:
        """One self-contained sentence: where, then what."""
        created = f" (created at {self.source})" if self.source else ""
        return f"{self.location}: {self.detail}{self.ranks_note}{created}"

    @property
    def ranks_note(self) -> str:
        """`` (rank 1 only)`` where the finding is on some ranks only; else empty."""
        return f" (rank {', '.join(map(str, self.ranks))} only)" if self.ranks else ""

    @property
    def file_and_line(self) -> tuple[str, int] | None:
        """``source`` split into its path and line number; None where unknown."""
        return split_source(self.source)


def split_source(source: str | None) -> tuple[str, int] | None:
    """``path:line`` split into its path and line number; None where there is none."""
    if not source:
        return None
    path, _, line = source.rpartition(":")
    return (path, int(line)) if path and line.isdigit() else None


@dataclass(frozen=True)
class Thresholds:
    """Gradient-norm bounds, each applied to every parameter and to the total norm; None: not set."""

    max_grad_norm: float | None = None
    min_grad_norm: float | None = None

    @property
    def active(self) -> bool:
        """Whether a bound can be crossed (``--max-grad-norm inf`` and ``--min-grad-norm 0`` unset a configured one)."""
        return (self.max_grad_norm is not None and self.max_grad_norm < math.inf) or bool(self.min_grad_norm)


@dataclass(frozen=True)
class CheckPolicy:
    """Which checks fail (the rest warn) and the norm thresholds."""

    failing: frozenset[str] = frozenset()
    thresholds: Thresholds = field(default_factory=Thresholds)

    @classmethod
    def build(
        cls,
        defaults: Iterable[str],
        *,
        fail_on: Iterable[str] = (),
        warn_on: Iterable[str] = (),
        thresholds: Thresholds | None = None,
    ) -> CheckPolicy:
        """The failing set: the command's ``defaults``, plus ``norm`` when a threshold is set (a threshold
        someone set is meant to be enforced), plus ``fail_on``, less ``warn_on``."""
        thresholds = thresholds or Thresholds()
        failing = set(defaults) | set(fail_on) | ({"norm"} if thresholds.active else set())
        return cls(frozenset(failing - set(warn_on)), thresholds)

    def fails(self, finding: Finding) -> bool:
        return finding.kind in self.failing


def unmet_requirement(checks: Iterable[str], thresholds: Thresholds, asked_for: Iterable[str]) -> str | None:
    """The first of ``checks`` (named to fail or warn) that would find nothing, silently: ``norm`` without a
    threshold, ``gradcheck`` or ``replay`` where that check is not in ``asked_for`` (so does not run)."""
    checks, asked_for = set(checks), set(asked_for)
    if "norm" in checks and not thresholds.active:
        return "norm"
    return next((check for check in ("gradcheck", "replay") if check in checks and check not in asked_for), None)


def merge_checks(configured: dict[str, tuple[str, ...]], given: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """``fail_on`` and ``warn_on`` (the keys of both mappings): those ``given`` (on the command line, a test's
    keywords), and the ``configured`` ones (``[tool.gradtrace]``) less the checks ``given`` names: a check named
    there replaces what the config says of it, and of it alone."""
    named = {*given["fail_on"], *given["warn_on"]}
    return {
        key: tuple(dict.fromkeys([check for check in configured[key] if check not in named] + list(given[key])))
        for key in ("fail_on", "warn_on")
    }


def parse_fail_on(text: str | Iterable[str] | None, option: str = "--fail-on") -> tuple[str, ...]:
    """``"nonfinite,divergence"`` (or a list of names) → ``("nonfinite", "divergence")``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if not text:
        return ()
    parts = text.split(",") if isinstance(text, str) else list(text)
    names = tuple(str(name).strip() for name in parts if str(name).strip())
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        raise ValueError(f"unknown {option} check {', '.join(map(repr, unknown))}; known: {', '.join(CHECKS)}")
    return names


def trace_findings(trace: Trace, thresholds: Thresholds | None = None) -> list[Finding]:
    """Non-finite gradients, parameters without gradient, all-zero parameter gradients, norms beyond thresholds."""
    findings = nonfinite_findings(trace)
    unused = "not used in forward, or detached"
    if COMPLEX_LEFT_OUT in (trace.meta.loss_rule or ""):
        unused += ", or used only for a complex output, which the loss leaves out"
    findings += [
        Finding(
            "nograd",
            f"requires grad but received no gradient ({unused})",
            module=_owner(name, trace.meta.module_types),
            param=name,
        )
        for name in trace.params_without_grad
    ]
    findings += [
        Finding(
            "zero",
            "gradient is exactly zero (a dead parameter, or one whose output meets only zeros: LoRA's A while B is 0)",
            node=node.id,
            name=node.name,
            module=node.module,
            param=node.param,
            value=0.0,
        )
        for node in trace.executed()
        if _is_parameter_leaf(node) and node.grad_norm == 0
    ]
    if thresholds is not None and thresholds.active:
        findings += norm_findings(trace, thresholds)
    findings += gradcheck_findings(trace) + replay_findings(trace)
    return findings


def _wrong_inputs(names: Sequence[str]) -> str:
    return f"; wrong: the gradient for {', '.join(names)}" if names else ""


def gradcheck_findings(trace: Trace) -> list[Finding]:
    """Custom Functions whose backward failed the numerical check (``--gradcheck``)."""
    return [
        Finding(
            "gradcheck",
            "backward does not match the numerical gradient (along random directions; mismatch "
            f"{_number(node.gradcheck.mismatch)})" + _wrong_inputs(node.gradcheck.inputs),
            node=node.id,
            name=node.name,
            module=node.module,
            value=node.gradcheck.mismatch,
            source=node.source,
        )
        for node in trace.nodes
        if node.gradcheck is not None and node.gradcheck.passed is False
    ]


def replay_findings(trace: Trace) -> list[Finding]:
    """Nodes whose backward, run again from the same gradients, gave something else (``--replay``)."""
    findings = []
    for node in trace.nodes:
        replay = node.replay
        if replay is None or replay.reproducible is not False:
            continue
        detail = replay.note or f"relative difference {_number(replay.relative)}"
        findings.append(
            Finding(
                "replay",
                f"backward is not reproducible from its inputs ({detail}): hidden state, nondeterminism or "
                "communication",
                node=node.id,
                name=node.name,
                module=node.module,
                value=replay.relative,
                source=node.source,
            )
        )
    return findings


def _number(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.2e}"


def nonfinite_findings(trace: Trace) -> list[Finding]:
    """One finding per *origin* of a NaN or infinity, plus one for a non-finite loss.

    An origin is a node that sends on a non-finite gradient although the gradients it received were
    finite. Its finding says which parameters (and inputs) the value reaches, or, when it reaches none,
    which later node masks it: a latent NaN that parameter gradients alone would never show.
    """
    findings = []
    made = None
    if trace.meta.loss is not None and not math.isfinite(trace.meta.loss):
        kind = "nan" if math.isnan(trace.meta.loss) else "inf"
        made = trace.forward_nonfinite_origin()
        root = made or (trace.nodes[0] if trace.nodes else None)
        if made is not None:
            message = f"the loss is {kind}: forward made {trace.forward_origin_text(made)}"
        else:
            message = f"the loss is {kind}: the forward pass already produced it (forward values tell where: --json, or trace(forward_stats=True))"
        findings.append(
            Finding(
                "nonfinite",
                message,
                node=root.id if root else None,
                name=root.name if root else None,
                module=root.module if root else None,
                param=root.param if root else None,
                value=kind,
                source=root.source if root else None,
            )
        )
    bad = trace.nonfinite_nodes()
    bad_ids = {node.id for node in bad}
    made_by: dict[int, list[int]] = {}  # a reentrant checkpoint's node -> the non-finite nodes its backward ran
    for node in bad:
        if node.created_in is not None:
            made_by.setdefault(node.created_in, []).append(node.id)
    covered: set[int] = set()
    carried = 0  # origins in backward that only carry on forward's value (a weight's gradient from a NaN input)
    for node in trace.nonfinite_origins() + bad:  # nodes reached from no origin (their input came from nowhere visible) count as origins
        if node.id in covered:
            continue
        reached = _reach(trace, node.id, bad_ids, made_by)
        creator = node.created_in  # a reentrant checkpoint that ran it sends on what it made
        while creator is not None:
            if creator in bad_ids:
                reached |= _reach(trace, creator, bad_ids, made_by)
            creator = trace.nodes[creator].created_in
        covered |= reached
        if made is not None and _uses_nonfinite_forward(trace, node):
            carried += 1
            continue
        findings.append(_nonfinite_finding(trace, node, reached))
    if carried:
        first = findings[0]
        nodes = "1 node that uses it" if carried == 1 else f"{carried} nodes that use it"
        findings[0] = replace(first, detail=f"{first.detail}; backward sends it on from {nodes}")
    return findings


def _uses_nonfinite_forward(trace: Trace, node: Node) -> bool:
    """Whether the node's op had a non-finite input or output in forward (its backward multiplies by it)."""
    values = [trace.nodes[child].forward for child in node.next if child is not None] + [node.forward]
    return any(value is not None and value.finite is False for value in values)


def _reach(trace: Trace, start: int, within: set[int], made_by: dict[int, list[int]]) -> set[int]:
    """Ids of the nodes of ``within`` that a non-finite gradient reaches from ``start``: along each edge of
    ``next`` that carried one (a finite gradient sent to a node that has a non-finite one from elsewhere
    does not make it this one's), and from a node whose backward ran nodes of its own (a reentrant
    checkpoint: ``made_by``) into those."""
    seen = {start}
    queue = deque([start])
    while queue:
        node = trace.nodes[queue.popleft()]
        carried = [child for position, child in enumerate(node.next) if child is not None and _sent_nonfinite(node, position)]
        for child in carried + made_by.get(node.id, []):
            if child in within and child not in seen:
                seen.add(child)
                queue.append(child)
    return seen


def _sent_nonfinite(node: Node, position: int) -> bool:
    """Whether the node sent a non-finite gradient on edge ``position`` (in any call; unknown counts)."""
    calls = [node.grad_inputs, *(call.grad_inputs for call in node.calls)]
    known = [stats[position] for stats in calls if stats is not None and position < len(stats)]
    if not known:
        return True  # not recorded (the node did not say): followed, as before it was known
    return any(stat is not None and stat.nonfinite_kind is not None for stat in known)


def _nonfinite_finding(trace: Trace, origin: Node, reached: set[int]) -> Finding:
    kind = origin.nonfinite_kind or "nan"
    nodes = sorted((trace.nodes[i] for i in reached), key=lambda n: (n.order is None, n.order or 0))
    params = [n.param for n in nodes if n.is_leaf and n.param is not None]
    if origin.is_leaf:
        detail = f"{kind} gradient"
    elif any(side == "out" and stat.nonfinite_kind for side, _, stat in origin.stats()):
        detail = f"{kind} gradient arrives here (grad_out)"
    else:
        detail = f"{kind} first appears here: grad_out finite, grad_in {kind}"
    if params:
        others = len(nodes) - 1
        detail += f"; reaches {others} more node{'s' * (others != 1)} and the gradient of {_names(params)}"
    elif not origin.is_leaf:
        maskers = [
            n
            for n in nodes
            if not n.is_leaf and not any(side == "in" and stat.nonfinite_kind for side, _, stat in n.stats())
        ]
        by = f" by #{maskers[0].id} {short_name(maskers[0].name)}" if maskers and maskers[0].id != origin.id else " further on"
        detail += f"; masked{by}, so no parameter gradient shows it (a latent {kind})"
    return Finding(
        "nonfinite",
        detail,
        node=origin.id,
        name=origin.name,
        module=origin.module,
        param=origin.param,
        value=kind,
        source=origin.source,
    )


def norm_findings(trace: Trace, thresholds: Thresholds) -> list[Finding]:
    """Parameter gradient norms (each, and the total) above ``max_grad_norm`` or below ``min_grad_norm``.

    Norms are those of each parameter's ``.grad`` after backward (under DDP: averaged across ranks).
    Non-finite norms are left to the non-finite check.
    """
    norms = trace.parameter_grad_norms()
    leaves = {node.param: node for node in trace.nodes if _is_parameter_leaf(node)}
    findings = []

    def judge(norm: float, **where: Any) -> None:
        if not math.isfinite(norm):
            return
        if thresholds.max_grad_norm is not None and norm > thresholds.max_grad_norm:
            detail = f"‖grad‖ {norm:.4g} above --max-grad-norm {thresholds.max_grad_norm:g}"
        elif thresholds.min_grad_norm is not None and norm < thresholds.min_grad_norm:
            detail = f"‖grad‖ {norm:.4g} below --min-grad-norm {thresholds.min_grad_norm:g}"
        else:
            return
        if where["param"] == ALL_PARAMETERS:
            detail = f"total {detail} ({len(norms)} parameters)"
        findings.append(Finding("norm", detail, value=norm, **where))

    for name, norm in norms.items():
        leaf = leaves.get(name)
        judge(
            norm,
            node=leaf.id if leaf else None,
            name=leaf.name if leaf else None,
            module=leaf.module if leaf else _owner(name, trace.meta.module_types),
            param=name,
        )
    # the most extreme first: largest above the maximum, then smallest below the minimum
    findings.sort(key=lambda f: -f.value if "above" in f.detail else f.value)  # type: ignore[operator]
    if norms:
        judge(joint_norm(norms.values()), param=ALL_PARAMETERS)
    if thresholds.max_grad_norm is not None:
        findings[:0] = _growth_findings(trace, thresholds.max_grad_norm)
    return findings


GROWTH_SHOWN = 5  # nodes where gradients grow past --max-grad-norm, named at most


def _growth_findings(trace: Trace, limit: float) -> list[Finding]:
    """Where gradients grow past ``limit`` (the parameters above it only show where the growth ends up):
    nodes that send one on above it although every gradient they received was within it, and nodes that
    receive one above it summed from several, each within it (a residual stream's branches adding up).
    The first GROWTH_SHOWN in execution order."""

    def within(norms: list[float]) -> bool:
        return all(math.isfinite(norm) and norm <= limit for norm in norms)

    executed = trace.executed()
    sent_to: dict[int, list[float]] = {}  # node id -> the norm of each gradient another node sent it
    for node in executed:
        for child, stat in zip(node.next, node.grad_inputs or ()):
            if child is not None and stat is not None and stat.norm is not None:
                sent_to.setdefault(child, []).append(stat.norm)
    found = []
    for node in executed:
        received = [stat.norm for side, _, stat in node.stats() if side == "out" and stat.norm is not None]
        sent = [stat.norm for side, _, stat in node.stats() if side == "in" and stat.norm is not None and math.isfinite(stat.norm)]
        parts = sent_to.get(node.id, [])
        if received and max(received) > limit and len(parts) > 1 and within(parts):
            why = f"{len(parts)} gradients, each within it (the largest ‖{max(parts):.3g}‖), add up to ‖{max(received):.3g}‖"
            found.append((node, why, max(received)))
        elif sent and received and max(sent) > limit and within(received):
            found.append((node, f"it receives ‖{max(received):.3g}‖ and sends on ‖{max(sent):.3g}‖", max(sent)))
    kept = {node.id for node in trace.outermost_excluded([node for node, _, _ in found])}  # not a checkpoint as well
    found = [entry for entry in found if entry[0].id in kept]
    findings = [
        Finding(
            "norm",
            f"‖grad‖ grows past --max-grad-norm {limit:g} here: {why}",
            node=node.id,
            name=node.name,
            module=node.module,
            value=value,
            source=node.source,
        )
        for node, why, value in found[:GROWTH_SHOWN]
    ]
    if len(found) > GROWTH_SHOWN:
        more = len(found) - GROWTH_SHOWN
        findings[-1] = replace(findings[-1], detail=f"{findings[-1].detail} ({more} more such {'node' if more == 1 else 'nodes'})")
    return findings


def comparison_findings(comparison: dict[str, Any]) -> list[Finding]:
    """A divergence between ranks (or runs), named by its origin."""
    first = comparison.get("first_divergent")
    findings = []
    if first is not None:
        findings.append(
            Finding(
                "divergence",
                f"{first['kind']} divergence: {who_differs(first['ranks'], [row['rank'] for row in comparison.get('ranks') or ()])} here",
                node=first["id"],
                name=first["name"],
                module=first["module"],
                param=first["param"],
                value=first["kind"],
                source=first.get("source"),
            )
        )
    else:  # with an origin, differing parameter gradients are its consequence, not news
        findings += [
            Finding("divergence", "gradients differ across ranks after backward", module=_owner(name), param=name)
            for name in comparison.get("unsynchronized_params", ())
        ]
    return findings


def merge_rank_findings(per_rank: Sequence[Sequence[Finding]]) -> list[Finding]:
    """The findings of every rank, each once; one found on some ranks only says which."""
    seen: dict[Finding, list[int]] = {}
    for rank, findings in enumerate(per_rank):
        for finding in findings:
            seen.setdefault(finding, []).append(rank)
    everywhere = len(per_rank)
    return [
        finding if len(ranks) == everywhere else replace(finding, ranks=tuple(ranks)) for finding, ranks in seen.items()
    ]


@dataclass(frozen=True)
class TargetReport:
    """The verdict on one target: the checks run, every finding, and which of them fail.

    Attributes:
        target: the target as given.
        checks: the checks that ran (``norm`` only with a threshold, ``divergence`` only across ranks).
        findings: every finding, failing or not.
        policy: what fails.
        error: why the target could not be checked (it did not load, or raised); then ``checks`` is empty.
        error_source: ``path:line`` of the user's code the error points at, where known.
        error_type: the error's class name.
        exit_code: the exit code the error maps to.
        time_s: how long loading and tracing took.
        summary: a line about the trace (nodes, loss, total norm) for the report.
    """

    target: str
    checks: tuple[str, ...] = ()
    findings: tuple[Finding, ...] = ()
    policy: CheckPolicy = field(default_factory=CheckPolicy)
    error: str | None = None
    error_type: str | None = None
    exit_code: int | None = None
    time_s: float | None = None
    summary: str = ""
    error_source: str | None = None

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if self.policy.fails(f)]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if not self.policy.fails(f)]

    @property
    def passed(self) -> bool:
        return self.error is None and not self.failures


def check_traces(
    traces: Sequence[Trace], policy: CheckPolicy, comparison: dict[str, Any] | None = None, target: str | None = None
) -> TargetReport:
    """Evaluate every check on the traces of one target (one per rank) and, across ranks, their comparison."""
    per_rank = [trace_findings(t, policy.thresholds) for t in traces]
    findings = merge_rank_findings(per_rank) if len(per_rank) > 1 else per_rank[0]
    checks = ["nonfinite", "nograd", "zero"] + (["norm"] if policy.thresholds.active else [])
    checks += [name for name, field_name in (("gradcheck", "gradcheck"), ("replay", "replay"))
               if any(getattr(n, field_name) is not None for t in traces for n in t.nodes)]
    if comparison is not None:
        findings += comparison_findings(comparison)
        checks.append("divergence")
    first = traces[0]
    return TargetReport(
        target=target or first.meta.target,
        checks=tuple(checks),
        findings=tuple(findings),
        policy=policy,
        time_s=max(t.meta.timings_s.get("total", 0.0) for t in traces),
        summary=_trace_line(traces),
    )


def _trace_line(traces: Sequence[Trace]) -> str:
    """Nodes, ranks, loss and total parameter gradient norm: rank 0's counts, and each rank's values where
    they differ (a NaN on one rank is not hidden behind rank 0's finite loss)."""
    summaries = [t.summary() for t in traces]
    parts = [f"{summaries[0]['nodes']} nodes, {summaries[0]['executed']} ran"]
    if len(traces) > 1:
        parts.append(f"{len(traces)} ranks")

    def values(texts: list[str | None]) -> str | None:
        present = [text for text in texts if text is not None]
        if not present:
            return None
        if len(set(texts)) == 1:
            return present[0]
        return " / ".join("?" if text is None else text for text in texts[:8]) + (" / ..." if len(texts) > 8 else "") + " (by rank)"

    loss = values([None if t.meta.loss is None else f"{t.meta.loss:.6g}" for t in traces])
    if loss is not None:
        parts.append(f"loss {loss}")
    total = values([None if s["param_grad_norm_total"] is None else f"{float(s['param_grad_norm_total']):.3g}" for s in summaries])
    if total is not None:
        parts.append(f"params ‖grad‖ {total}")
    unchecked = sum(1 for n in traces[0].nodes if n.gradcheck is not None and n.gradcheck.passed is None)
    if unchecked:  # not a finding (it fails nothing), but no silent pass either: `run --gradcheck` says why
        parts.append(f"{unchecked} custom Function{'s' * (unchecked != 1)} not gradchecked")
    return " · ".join(parts)


def _is_parameter_leaf(node: Node) -> bool:
    return node.is_leaf and node.param is not None and not node.param.startswith("input:")


def _owner(param: str, modules: dict[str, str] | None = None) -> str | None:
    """The module path that owns a parameter name (``"fc1.weight"`` → ``"fc1"``, ``"weight"`` → ``""``).

    With the trace's module paths known, a name owned by none of them (a plain function's global
    tensor) gives None: outside any module.
    """
    owner = param.rpartition(".")[0]
    if modules is not None and owner not in modules:
        return None
    return owner


def _names(names: list[str]) -> str:
    return listed(names, _LISTED)
