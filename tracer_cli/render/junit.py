"""JUnit XML of ``gradtrace check``: a test suite per target, a test case per check.

A check with failing findings is a ``<failure>`` carrying their messages; warnings go to the case's
``<system-out>``; a target that could not be loaded or raised is one ``load`` case with an ``<error>``.
The result mirrors the command's verdict: the file has failures or errors exactly when it exits non-zero.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from typing import Sequence

from ..checks import TargetReport

# characters XML 1.0 cannot hold, even escaped
_INVALID_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def junit_xml(reports: Sequence[TargetReport], name: str = "gradtrace check") -> str:
    """The JUnit XML document (a string with its XML declaration)."""
    root = ET.Element("testsuites", name=name)
    stamp = datetime.now(timezone.utc).replace(microsecond=0).isoformat()
    totals = {"tests": 0, "failures": 0, "errors": 0}
    total_time = 0.0
    for report in reports:
        suite = ET.SubElement(root, "testsuite", name=report.target, timestamp=stamp)
        counts = {"tests": 0, "failures": 0, "errors": 0}
        if report.error is not None:
            case = ET.SubElement(suite, "testcase", classname=report.target, name="load", time="0")
            error = ET.SubElement(case, "error", message=_clean(report.error), type=report.error_type or "error")
            error.text = _clean(report.error)
            counts["tests"] += 1
            counts["errors"] += 1
        for check in report.checks:
            case = ET.SubElement(suite, "testcase", classname=report.target, name=check, time="0")
            failures = [f for f in report.failures if f.kind == check]
            warnings = [f for f in report.warnings if f.kind == check]
            if failures:
                count = f"{len(failures)} finding{'s' * (len(failures) != 1)}"
                failure = ET.SubElement(case, "failure", message=_clean(f"{count}: {failures[0].message}"), type=check)
                failure.text = _clean("\n".join(f.message for f in failures))
                counts["failures"] += 1
            if warnings:
                ET.SubElement(case, "system-out").text = _clean("\n".join(f"warning: {f.message}" for f in warnings))
            counts["tests"] += 1
        time_s = report.time_s or 0.0
        total_time += time_s
        suite.set("time", f"{time_s:.3f}")
        suite.set("skipped", "0")
        for key, value in counts.items():
            suite.set(key, str(value))
            totals[key] += value
    for key, value in totals.items():
        root.set(key, str(value))
    root.set("time", f"{total_time:.3f}")
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _clean(text: str) -> str:
    return _INVALID_XML.sub("?", text)
