"""The terminal view of ``gradtrace check``: per target a line and a findings table, then one verdict line.

Pure functions of :class:`~tracer_cli.checks.TargetReport` that return Rich renderables.
"""

from __future__ import annotations

from typing import Sequence

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from ..checks import ALL_PARAMETERS, Finding, TargetReport
from .tree import ROOT, format_norm, short_name

_FAIL = "bold red"
_WARN = "yellow"


def render_report(report: TargetReport) -> RenderableType:
    """The target's line (what was traced, or why it could not be) and its findings table."""
    header = Text(report.target, style="bold")
    if report.error is not None:
        header.append(f" · could not be checked: {report.error}", style=_FAIL)
        return header
    header.append(f" · {report.summary}", style="dim")
    if not report.findings:
        return Group(header, Text(f"  no findings ({', '.join(report.checks)} checked)", style="green"))
    return Group(header, findings_table(report))


class _Findings:
    """A table where the width leaves the ``finding`` column room (it is the point of the row); in a narrow
    terminal a block per finding, its fields on a line and its text below, wrapped."""

    MIN_FINDING_WIDTH = 30

    def __init__(self, report: TargetReport):
        self.report = report

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        table = _table(self.report)
        fields = Measurement.get(console, options, Table.grid(*table.columns[:-1], padding=(0, 1))).maximum
        if options.max_width - fields - 1 >= self.MIN_FINDING_WIDTH:
            yield table
            return
        for finding in self.report.failures + self.report.warnings:
            failed = self.report.policy.fails(finding)
            line = Text("FAIL" if failed else "warn", style=_FAIL if failed else _WARN)
            parts = [finding.kind, _node(finding), _module(finding), _param(finding), format_value(finding.value)]
            line.append(" " + " · ".join(part for part in parts if part and part != "–"))
            yield line
            yield Padding(_what(finding), (0, 0, 0, 2))


def findings_table(report: TargetReport) -> RenderableType:
    """One row per finding, failing ones first: status, check, node, module, parameter, value, what."""
    return _Findings(report)


def _table(report: TargetReport) -> Table:
    table = Table(box=None, padding=(0, 1), pad_edge=False, show_edge=False, header_style="bold")
    for column in ("", "check", "node", "module", "parameter", "value", "finding"):
        table.add_column(column, no_wrap=column != "finding", overflow="fold")
    for finding in report.failures + report.warnings:
        failed = report.policy.fails(finding)
        table.add_row(
            Text("FAIL" if failed else "warn", style=_FAIL if failed else _WARN),
            finding.kind,
            _node(finding),
            _module(finding),
            _param(finding),
            format_value(finding.value),
            _what(finding),
        )
    return table


def verdict(reports: Sequence[TargetReport]) -> Text:
    """One line: healthy or not, how many targets, failing findings by check, warnings."""
    errored = [r for r in reports if r.error is not None]
    failed = [r for r in reports if r.error is None and r.failures]
    failures = [f for r in reports for f in r.failures]
    warnings = sum(len(r.warnings) for r in reports)
    targets = f"{len(reports)} target{'s' * (len(reports) != 1)}"
    tail = f", {warnings} warning{'s' * (warnings != 1)}" if warnings else ""
    if errored:
        names = ", ".join(r.target for r in errored)
        text = Text(f"ERROR: {len(errored)} of {targets} could not be checked ({names})", style=_FAIL)
        if failed:
            text.append(f"; {len(failed)} unhealthy", style=_FAIL)
        return text + Text(tail, style=_WARN)
    if failed:
        kinds = sorted({f.kind for f in failures})
        names = ", ".join(r.target for r in failed)
        count = f"{len(failures)} failing finding{'s' * (len(failures) != 1)}"
        where = names if len(reports) == 1 else f"{len(failed)} of {targets} ({names})"
        return Text(f"FAIL: {count} ({', '.join(kinds)}) in {where}", style=_FAIL) + Text(tail, style=_WARN)
    return Text(f"OK: {targets} healthy", style="bold green") + Text(tail, style=_WARN)


def format_value(value: float | str | None) -> str:
    if value is None:
        return "–"
    if isinstance(value, str):
        return value
    return "0" if value == 0 else format_norm(value)


def _node(finding: Finding) -> str:
    return "–" if finding.node is None else f"#{finding.node} {short_name(finding.name or '')}"


def _module(finding: Finding) -> str:
    if finding.param == ALL_PARAMETERS:
        return "–"
    if finding.module is None:
        return "(outside)" if finding.node is not None else "–"
    return finding.module or ROOT


def _what(finding: Finding) -> Text:
    """The finding's detail and the ranks it was found on (if not all); below, the line that created the node."""
    text = Text(finding.detail + finding.ranks_note)
    if finding.source:
        text.append(f"\ncreated at {finding.source}", style="dim")
    return text


def _param(finding: Finding) -> str:
    return finding.param if finding.param is not None else "–"
