"""The JSON document of a Trace: strict JSON (no bare NaN/Infinity), keys sorted."""

from __future__ import annotations

import json

from ..records import SCHEMA, Trace


def dumps(trace: Trace) -> str:
    """Serialise a trace as the versioned ``gradtrace/1`` document, one line per node."""
    document = trace.to_dict()
    nodes = document.pop("nodes")
    head = json.dumps(document, allow_nan=False, sort_keys=True)
    lines = ",\n".join(json.dumps(node, allow_nan=False, sort_keys=True) for node in nodes)
    # {"meta":..., "nodes": [\n node,\n node\n], "schema":..., "summary":...} keeps diffs and greps line-based
    return head[:-1] + ', "nodes": [\n' + lines + "\n]}\n"


def loads(text: str) -> Trace:
    """Read a document written by :func:`dumps` (or ``Trace.to_dict``)."""
    return Trace.from_dict(json.loads(text))


def dumps_merged(traces: list[Trace], comparison: dict) -> str:
    """The merged file of a torchrun job: every rank's trace and the comparison."""
    document = {
        "schema": SCHEMA,
        "world_size": len(traces),
        "ranks": [t.to_dict() for t in traces],
        "comparison": comparison,
    }
    return json.dumps(document, allow_nan=False, sort_keys=True) + "\n"
