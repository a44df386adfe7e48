"""GitHub Actions workflow commands for findings: ``::error ::MESSAGE`` and ``::warning ::MESSAGE`` lines.

GitHub shows them as annotations on the run. They are printed (on stdout, unprefixed, since a command
must start its line) when ``GITHUB_ACTIONS=true``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ..checks import TargetReport


def in_github_actions(environ: Mapping[str, str]) -> bool:
    return environ.get("GITHUB_ACTIONS", "").lower() == "true"


def escape_data(text: str) -> str:
    """Escape a command's message as GitHub's toolkit does: ``%``, ``\\r``, ``\\n``."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def annotations(reports: Sequence[TargetReport]) -> list[str]:
    """One line per finding (``::error`` when it fails, ``::warning`` when it warns), and per target error."""
    lines = []
    for report in reports:
        if report.error is not None:
            lines.append(f"::error ::{escape_data(f'gradtrace check {report.target}: {report.error}')}")
        for finding in report.failures + report.warnings:
            level = "error" if report.policy.fails(finding) else "warning"
            text = f"gradtrace check {report.target}: {finding.kind}: {finding.message}"
            lines.append(f"::{level} ::{escape_data(text)}")
    return lines
