"""The terminal view of ``gradtrace diff``: the origin of the difference first, then the nodes that differ most."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ..records import GradStat, Node, Trace, decode_float, listed
from .tree import ROOT, format_norm, short_name

_SHOWN = 15


def _where(param: str | None, module: str | None) -> str:
    if param is not None:
        return param
    return "outside any module" if module is None else (module or ROOT)


def _norms(stats: tuple[GradStat | None, ...] | None) -> str:
    return ", ".join("–" if s is None else format_norm(s.norm) for s in (stats or ())) or "–"


def _values(kind: str, a: Node, b: Node) -> tuple[str, str]:
    """What to show for each side of a forward or backward origin: the values that differ there."""
    if kind == "forward":
        return (format_norm(a.forward.norm) if a.forward else "?", format_norm(b.forward.norm) if b.forward else "?")
    return _norms(a.grad_inputs), _norms(b.grad_inputs)


def _other_leaves_that_differ(a: Trace, comparison: dict[str, Any], origin: int) -> list[str]:
    """The parameters and inputs whose values (their leaves' forward values) differ, besides the origin."""
    rtol = comparison["rtol"]
    names = []
    for entry in comparison.get("nodes", ()):
        spread = decode_float(entry.get("forward"))
        if entry["id"] != origin and spread is not None and spread > rtol and a.nodes[entry["id"]].param is not None:
            names.append(a.nodes[entry["id"]].param)
    return names


def render_diff(
    a: Trace, b: Trace, comparison: dict[str, Any], labels: tuple[str, str], prefix_ignored: tuple[int, str] | None = None,
) -> RenderableType:
    """The origin (node, module or parameter, kind, the two values) and a table of the most different nodes.

    Args:
        prefix_ignored: which file's parameter names carry a wrapper's prefix (DDP's ``module.``) and the prefix,
            taken off them to line the files up (``compare.wrapper_prefix``).
    """
    parts: list[RenderableType] = []
    first = comparison["first_divergent"]
    if first is None and not comparison.get("unsynchronized_params"):
        parts.append(Text(f"the traces agree (rtol {comparison['rtol']:g})", style="green"))
    elif first is not None:
        # the node at the same place in each trace: the same id, but where the graphs differ (a structure
        # divergence: the id is that of one trace's graph, first["rank"]; "ids" holds each trace's, or None)
        id_a, id_b = first.get("ids") or (first["id"], first["id"])
        node_a = a.nodes[id_a] if id_a is not None and id_a < len(a.nodes) else None
        node_b = b.nodes[id_b] if id_b is not None and id_b < len(b.nodes) else None
        text = Text("first difference: ", style="bold red")
        where = _where(first["param"], first["module"])
        text.append(f"{first['kind']} at #{first['id']} {short_name(first['name'])} ({where})", style="bold red")
        if first["kind"] == "structure" and first.get("rank") in (0, 1):
            text.append(f" of {labels[first['rank']]}", style="bold red")
        parts.append(text)
        if first.get("params_only"):  # leaves are lined up by name: where the names differ, they are the difference
            only = [f"{listed(names, 4)} only in {label}" for names, label in zip(first["params_only"], labels) if names]
            parts.append(Text(f"  parameters differ: {'; '.join(only)}"))
        elif first["kind"] == "structure":  # in creation order, the first place where the graphs do not align
            shown = [f"#{node.id} {short_name(node.name)} in {_where(node.param, node.module)}" if node else "nothing (its graph ends)" for node in (node_a, node_b)]
            parts.append(Text(f"  node: {labels[0]}: {shown[0]}   {labels[1]}: {shown[1]}"))
        elif node_a is not None and node_b is not None:
            value_a, value_b = _values(first["kind"], node_a, node_b)
            what = {"forward": "forward value ‖·‖", "backward": "grad_in ‖·‖"}[first["kind"]]
            parts.append(Text(f"  {what}: {labels[0]}: {value_a}   {labels[1]}: {value_b}"))
            if first.get("shapes"):
                shape_a, shape_b = (tuple(shape) for shape in first["shapes"])
                parts.append(Text(f"  shape: {labels[0]}: {shape_a}   {labels[1]}: {shape_b}", style="red"))
            if first["kind"] == "forward" and first["param"] is not None:
                # one leaf is the origin; many at once are rather other weights or inputs (another seed, a checkpoint)
                others = _other_leaves_that_differ(a, comparison, first["id"])
                if others:
                    parts.append(Text(f"  {listed(others, 4)} differ too", style="yellow"))
    if prefix_ignored is not None:
        side, prefix = prefix_ignored
        parts.append(Text(f"parameter and module names lined up without the prefix {prefix!r} of {labels[side]} "
                          "(a wrapper's: DDP, DataParallel, FSDP, torch.compile)", style="yellow"))
    if comparison.get("note"):
        parts.append(Text(comparison["note"], style="yellow"))
    if comparison.get("unsynchronized_params") and first is None:
        parts.append(Text("parameter gradients that differ: " + ", ".join(comparison["unsynchronized_params"][:8]), style="yellow"))
    rows = []
    for entry in comparison.get("nodes", ()):
        spreads = {key: decode_float(entry.get(key)) for key in ("forward", "grad_outputs", "grad_inputs")}
        largest = max((v for v in spreads.values() if v is not None), default=0.0)
        if largest > comparison["rtol"]:
            rows.append((largest, entry["id"], spreads))
    if rows:
        table = Table(title=f"nodes that differ most ({min(len(rows), _SHOWN)} of {len(rows)})", title_justify="left", box=None)
        for column in ("node", "module / parameter", "forward", "grad_out", "grad_in"):
            table.add_column(column, justify="left" if column in ("node", "module / parameter") else "right")
        for _, node_id, spreads in sorted(rows, key=lambda row: -row[0])[:_SHOWN]:
            node = a.nodes[node_id]
            table.add_row(
                f"#{node_id} {short_name(node.name)}",
                _where(node.param, node.module),
                *(format_norm(spreads[key]) if spreads[key] is not None else "–" for key in ("forward", "grad_outputs", "grad_inputs")),
            )
        parts.append(table)
        parts.append(Text("columns: relative spread |a - b| / max(|a|, |b|) of the norms", style="dim"))
    return Group(*parts)
