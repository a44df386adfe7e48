"""The terminal view of a cross-rank comparison, and printing with per-rank line prefixes."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from ..compare import who_differs
from ..records import decode_float, listed
from .tree import format_norm, short_name


def divergence_marks(comparison: dict[str, Any], rank: int | None = None) -> dict[int, str]:
    """Node id → marker for ``rank``'s tree: the origin, and every node whose values differ across ranks.

    A structure divergence's node id is that of one rank's graph (``first_divergent["rank"]``): the ranks'
    graphs differ, so the same id on another rank is another node, which is not marked."""
    rtol = comparison.get("rtol", 0.0)
    marks: dict[int, str] = {}
    for entry in comparison.get("nodes", ()):
        spreads = [decode_float(entry.get(key)) for key in ("forward", "grad_inputs", "grad_outputs")]
        if any(s is not None and (math.isnan(s) or s > rtol) for s in spreads):
            marks[entry["id"]] = "≠ differs across ranks"
    origin = divergence_origin(comparison, rank)
    if origin is not None:
        marks[origin] = f"≠ origin of the divergence ({comparison['first_divergent']['kind']})"
    return marks


def divergence_origin(comparison: dict[str, Any], rank: int | None = None) -> int | None:
    """The id of the divergence's origin in ``rank``'s trace: none where it is a structure divergence's node of
    another rank's graph (the same id is another node there)."""
    first = comparison.get("first_divergent")
    if first is not None and (first["kind"] != "structure" or rank is None or first.get("rank", rank) == rank):
        return first["id"]
    return None


def render_comparison(comparison: dict[str, Any]) -> RenderableType:
    """Per-rank table (loss, total parameter gradient norm, non-finite nodes) and the divergence origin."""
    table = Table(title="ranks compared", title_justify="left", box=None, padding=(0, 2))
    for column in ("rank", "loss", "params ‖grad‖", "non-finite nodes"):
        table.add_column(column, justify="right" if column != "rank" else "left")
    for row in comparison["ranks"]:
        table.add_row(
            str(row["rank"]),
            _format_loss(decode_float(row["loss"])),
            format_norm(decode_float(row["param_grad_norm_total"])),
            str(row["nonfinite_nodes"]),
        )
    parts: list[RenderableType] = [table]
    first = comparison.get("first_divergent")
    unsynchronized = comparison.get("unsynchronized_params") or []
    if first is None and not unsynchronized:
        # with a note (--rank-seed), node values were not compared: only the parameter gradients agree
        agree = "parameter gradients agree across ranks" if comparison.get("note") else "ranks agree"
        parts.append(Text(f"{agree} (rtol {comparison['rtol']:g})", style="green"))
    elif first is not None:
        where = first["param"] or (f"in {first['module'] or '<root>'}" if first["module"] is not None else "outside any module")
        text = Text("first divergence: ", style="bold red")
        text.append(f"{first['kind']} at #{first['id']} {short_name(first['name'])} {where}", style="bold red")
        labels = [row["rank"] for row in comparison["ranks"]]
        text.append(f"  ({who_differs(first['ranks'], labels)}", style="red")
        if first["kind"] == "structure" and first.get("rank") is not None:
            text.append(f"; #{first['id']} of rank {first['rank']}'s graph", style="red")
        text.append(")", style="red")
        parts.append(text)
        parts.append(Text(_KIND_HELP[first["kind"]], style="dim"))
        if first.get("shapes"):
            shapes = ", ".join(f"{tuple(shape)} on rank {rank}" for rank, shape in zip(labels, first["shapes"]))
            parts.append(Text(f"its shape differs across ranks: {shapes}", style="red"))
    if unsynchronized:  # not averaged across ranks (no DDP), or what the origin above led to
        shown = listed(unsynchronized, 8)
        parts.append(Text(f"parameter gradients that differ across ranks after backward: {shown}", style="yellow"))
    if comparison.get("note"):
        parts.append(Text(comparison["note"], style="yellow"))
    return Group(*parts)


def _format_loss(loss: float | None) -> str:
    return format_norm(loss) if loss is None or not math.isfinite(loss) else f"{loss:.6g}"


_KIND_HELP = {
    "structure": "the ranks built different graphs; this is the first node, in creation order, that does not align",
    "forward": "this node's forward value differs across ranks while its inputs' agree (values are compared by "
    "their norms)",
    "backward": "this node received the same gradients on every rank but sent on different ones",
}


def prefixed_lines(console: Console, renderable: RenderableType, prefix: str) -> list[Text]:
    """Render for ``console`` at its width less the prefix, and put the prefix before every line."""
    options = console.options.update_width(max(20, console.width - len(prefix)))
    lines = console.render_lines(renderable, options, pad=False)
    return [
        Text(prefix, style="dim") + Text.assemble(*((seg.text, seg.style) for seg in line if not seg.control))
        for line in lines
    ]
