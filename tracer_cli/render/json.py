"""The JSON document of a Trace: strict JSON (no bare NaN/Infinity), keys sorted."""

from __future__ import annotations

import json

from ..records import SCHEMA, Trace


def dumps(trace: Trace) -> str:
    """Serialise a trace as the versioned ``gradtrace/1`` document, one line per node."""
    document = trace.to_dict()
    nodes = document.pop("nodes")
    encode = json.JSONEncoder(allow_nan=False, sort_keys=True).encode  # json.dumps(..., allow_nan=False, sort_keys=True)
    head = encode(document)
    lines = ",\n".join(map(encode, nodes))
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


def read_trace(spec: str) -> tuple[Trace, str | None]:
    """Read a trace from ``FILE.json`` or one rank of a merged file, ``FILE.json#N``.

    Returns:
        The trace, and a note for the reader (which rank of a merged file was taken), or None.

    Raises:
        ValueError: the file is missing, is not JSON, is not a gradtrace/1 document, or has no such rank.
    """
    path, _, rank_text = spec.rpartition("#") if "#" in spec else (spec, "", "")
    try:
        with open(path, encoding="utf-8") as handle:
            document = json.load(handle)
    except FileNotFoundError as exc:
        raise ValueError(f"{path}: no such file") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON file ({exc})") from exc
    if not isinstance(document, dict) or document.get("schema") != SCHEMA:
        found = document.get("schema") if isinstance(document, dict) else None
        raise ValueError(
            f"{path}: schema {found!r} is not {SCHEMA!r}: not a gradtrace trace, or one from another version"
        )
    note = None
    if "ranks" in document:
        ranks = document["ranks"]
        if rank_text:
            if not rank_text.isdigit() or int(rank_text) >= len(ranks):
                raise ValueError(f"{path}: no rank {rank_text!r} in a merged file of {len(ranks)} ranks")
            document = ranks[int(rank_text)]
        else:
            document, note = ranks[0], f"{path} holds {len(ranks)} ranks: rank 0 taken (pick one with {path}#N)"
    elif rank_text:
        raise ValueError(f"{path}: #{rank_text} names a rank, but this file holds a single trace")
    try:
        return Trace.from_dict(document), note
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not a complete gradtrace trace ({exc})") from exc
