"""Pictures of a trace: the terminal view as SVG or HTML (Rich's console recording), the graph as Graphviz DOT.

All outputs are byte-stable for the same trace: a fixed ``unique_id`` for SVG, sorted attributes for DOT.
"""

from __future__ import annotations

import math
from typing import Any

from ..records import Node, Trace
from .tree import ROOT, format_norm, short_name

SVG_ID = "gradtrace"


def export_svg(console: Any, title: str = "gradtrace") -> str:
    """What a recording console printed, as SVG (the fixed id keeps the file byte-stable), as wide as its
    widest line: a console that is not a terminal is far wider than what it prints."""
    from rich.cells import cell_len

    widest = max(map(cell_len, console.export_text(clear=False).splitlines()), default=1)
    console.width = min(console.width, max(widest, 1))
    return console.export_svg(title=title, unique_id=SVG_ID, clear=False)


def export_html(console: Any) -> str:
    """What a recording console printed, as a standalone HTML page with inline styles."""
    return console.export_html(inline_styles=True, clear=False)


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _fill(norm: float | None, low: float, high: float) -> str:
    """A blue shade by log-norm between the trace's smallest and largest norms (white: no gradient)."""
    if norm is None or norm <= 0 or not math.isfinite(norm):
        return "#ffffff"
    if high <= low:
        share = 1.0
    else:
        share = (math.log10(norm) - low) / (high - low)
    share = min(1.0, max(0.0, share))
    # from a pale blue to a deep blue
    red, green, blue = (int(round(a + (b - a) * share)) for a, b in zip((0xE8, 0xF0, 0xFF), (0x2B, 0x57, 0xC6)))
    return f"#{red:02x}{green:02x}{blue:02x}"


def _label(node: Node) -> str:
    lines = [f"#{node.id} {short_name(node.name)}"]
    if node.param is not None:
        lines.append(node.param)
    elif node.module is not None:
        lines.append(node.module or ROOT)
    norm = node.grad_norm
    if node.order is None:
        lines.append("did not run")
    else:
        kind = node.nonfinite_kind
        lines.append(f"‖grad_out‖ {format_norm(norm)}" + (f" ({kind})" if kind else ""))
    return "\n".join(lines)


def export_dot(trace: Trace) -> str:
    """The backward graph in Graphviz DOT: a box per node, edges along ``next_functions``.

    Labels hold name, module or parameter and the norm of what the node received; boxes are filled
    by log-norm, non-finite ones red, nodes that never ran grey and dashed. Render with
    ``dot -Tsvg trace.dot -o trace.svg``.
    """
    logs = [math.log10(n.grad_norm) for n in trace.nodes if n.grad_norm and math.isfinite(n.grad_norm) and n.grad_norm > 0]
    low, high = (min(logs), max(logs)) if logs else (0.0, 0.0)
    lines = [
        "digraph gradtrace {",
        "  rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
        f"  label={_quote(f'{trace.meta.target} · loss {format_norm(trace.meta.loss)} ({trace.meta.loss_rule})')};",
        "  labelloc=t;",
    ]
    for node in trace.nodes:
        attributes = {"label": _quote(_label(node))}
        if node.nonfinite_kind:
            attributes.update(fillcolor='"#e53935"', fontcolor='"#ffffff"', color='"#b71c1c"')
        elif node.order is None:
            attributes.update(fillcolor='"#eeeeee"', style='"rounded,filled,dashed"')
        else:
            attributes["fillcolor"] = _quote(_fill(node.grad_norm, low, high))
            if node.grad_norm and node.grad_norm > 0 and high > low and (math.log10(node.grad_norm) - low) / (high - low) > 0.6:
                attributes["fontcolor"] = '"#ffffff"'
        rendered = ", ".join(f"{key}={value}" for key, value in sorted(attributes.items()))
        lines.append(f"  n{node.id} [{rendered}];")
    for node in trace.nodes:
        for child in node.next:
            if child is not None:
                lines.append(f"  n{node.id} -> n{child};")
        if node.created_in is not None:
            lines.append(f'  n{node.created_in} -> n{node.id} [style=dotted, label="created"];')
    lines.append("}")
    return "\n".join(lines) + "\n"
