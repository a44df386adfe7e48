"""GitHub Actions workflow commands for findings: ``::error ::MESSAGE`` and ``::warning ::MESSAGE`` lines.

GitHub shows them as annotations on the run. A finding whose node was created in a file of the checkout
names that file and line too (``::error file=model.py,line=28::MESSAGE``), so the annotation also
shows on that line of the code. They are printed (on stdout, unprefixed, since a command must start
its line) when ``GITHUB_ACTIONS=true``.
"""

from __future__ import annotations

import os
import re
from typing import Mapping, Sequence

from ..checks import TargetReport, split_source


def in_github_actions(environ: Mapping[str, str]) -> bool:
    return environ.get("GITHUB_ACTIONS", "").lower() == "true"


def escape_data(text: str) -> str:
    """Escape a command's message as GitHub's toolkit does: ``%``, ``\\r``, ``\\n``."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    """Escape a command's property value (``file=``, ``line=``): as a message, and ``:`` and ``,`` too."""
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def annotations(reports: Sequence[TargetReport], workspace: str | None = None) -> list[str]:
    """One line per finding (``::error`` when it fails, ``::warning`` when it warns), and per target error.

    ``workspace`` (``GITHUB_WORKSPACE``, the checkout): source paths inside it are given relative to it,
    as GitHub matches them to the repository's files; a line outside it is named in the message only.
    """
    def located(source: str | None) -> str:
        where = split_source(source)
        path = _in_checkout(where[0], workspace) if where else None
        return f"file={escape_property(path)},line={where[1]}" if path and where else ""

    lines = []
    for report in reports:
        if report.error is not None:  # at the line of the user's code that raised, where known
            text = f"gradtrace check {report.target}: {report.error}"
            lines.append(f"::error {located(report.error_source)}::{escape_data(text)}")
        for finding in report.failures + report.warnings:
            level = "error" if report.policy.fails(finding) else "warning"
            text = f"gradtrace check {report.target}: {finding.kind}: {finding.message}"
            lines.append(f"::{level} {located(finding.source)}::{escape_data(text)}")
    return lines


_INSTALLED = re.compile(r"[/\\](site|dist)-packages[/\\]")


def _in_checkout(path: str, workspace: str | None) -> str | None:
    """``path`` (absolute, or relative to the working folder) relative to ``workspace``; None where it lies
    outside it (a library's file, which GitHub cannot show), in an installed package (a virtual environment
    made inside the checkout: ``.venv/lib/python3.11/site-packages/...``, not the repository's) or is no file
    (``<string>``). Without a workspace, ``path`` as it is."""
    if path.startswith("<") or _INSTALLED.search(path):
        return None
    if not workspace:
        return path
    try:
        # both resolved: the working folder is (os.getcwd() resolves links), the workspace may name a link
        relative = os.path.relpath(os.path.realpath(path), os.path.realpath(workspace))
    except (ValueError, OSError):  # another drive (Windows), or the working folder was deleted
        return None
    return None if relative.startswith("..") else relative
