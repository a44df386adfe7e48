"""The terminal view of a Trace: a Rich tree (by module or by graph), a legend and a summary.

Pure functions of a Trace that return Rich renderables; printing is the caller's job.
"""

from __future__ import annotations

import math
import re
import shlex
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from ..records import GradStat, Node, Trace, listed, short_name

VIEWS = ("modules", "graph")
DEFAULT_MAX_NODES = 200
OUTSIDE = "(outside any module)"
LEGEND = (
    "grad_in: the gradients a node sends on, one per input of its forward op · "
    "grad_out: the gradients arriving at it, one per output · "
    "‖x‖ L2 norm · – no gradient (None) · AccumulateGrad: where a parameter's or input's gradient lands"
)

_NONFINITE = "bold red"
_LARGE = "bold yellow"
_ZERO = "dim"


@dataclass(frozen=True)
class TreeOptions:
    """What the tree shows.

    Attributes:
        view: "modules" (nodes grouped under the module tree) or "graph" (the
            backward graph from the loss).
        max_nodes: at most this many node lines; None shows all.
        depth: module (or graph branch) nesting shown; deeper levels are summarised.
        pattern: a regular expression; only nodes whose name, module or parameter
            match are shown.
        marks: node id → a note shown in red on its line (e.g. a divergence).
        show_stack: show each node's recorded user stack (``--stack``) under its line.
        pinned: nodes the module view draws however early ``max_nodes`` cuts, besides those the summary names
            (e.g. where ranks start to differ).
    """

    view: str = "modules"
    max_nodes: int | None = DEFAULT_MAX_NODES
    depth: int | None = None
    pattern: str | None = None
    marks: Mapping[int, str] = field(default_factory=dict)
    show_stack: bool = False
    pinned: tuple[int, ...] = ()


def format_norm(norm: float | None) -> str:
    if norm is None:
        return "?"
    if math.isnan(norm):
        return "nan"
    if math.isinf(norm):
        return "inf" if norm > 0 else "-inf"
    return f"{norm:.2e}"


class _Styler:
    """Picks the style of a norm (non-finite red, zero dim, the largest highlighted); holds the marks."""

    def __init__(self, trace: Trace, marks: Mapping[int, str] | None = None, top: int = 3):
        self.marks = marks or {}
        self.show_stack = False
        origin = trace.nonfinite_origin()
        self.origin = None if origin is None else origin.id
        made = trace.forward_nonfinite_origin()
        self.forward_origin = None if made is None else made.id
        if made is not None:  # what backward carries on from a non-finite loss starts at the loss, not there
            self.origin = None
        norms = sorted({stat.norm for _, stat in trace.computed_stats() if math.isfinite(stat.norm) and stat.norm > 0}, reverse=True)
        self.large = norms[min(top, len(norms)) - 1] if len(norms) > top else math.inf

    def style(self, stat: GradStat) -> str:
        if stat.norm is None:
            return ""
        if not math.isfinite(stat.norm):
            return _NONFINITE
        if stat.norm == 0:
            return _ZERO
        return _LARGE if stat.norm >= self.large else ""


def _stat_text(stat: GradStat | None, styler: _Styler) -> Text:
    if stat is None:
        return Text("–", style="dim")
    text = Text(f"{tuple(stat.shape)} ", style="")
    text.append(f"‖{format_norm(stat.norm)}‖", style=styler.style(stat))
    if stat.dtype != "float32":
        text.append(f" {stat.dtype}", style="magenta")
    if stat.layout is not None:
        text.append(f" {stat.layout}", style="magenta")
    return text


STATS_SHOWN = 16  # a node with more gradients (a stack of 1,000 tensors) shows the first few and a summary


def _stats_text(label: str, stats: Iterable[GradStat | None], styler: _Styler) -> Text:
    stats = list(stats)
    shown = stats if len(stats) <= STATS_SHOWN else stats[: STATS_SHOWN - 2]
    text = Text(f"  {label} ", style="dim")
    for index, stat in enumerate(shown):
        if index:
            text.append(", ", style="dim")
        text.append_text(_stat_text(stat, styler))
    rest = [stat for stat in stats[len(shown):] if stat is not None]
    if len(shown) < len(stats):
        text.append(f", … {len(stats) - len(shown)} more", style="dim")
        nonfinite = [stat for stat in rest if stat.finite is False]
        norms = [stat.norm for stat in rest if stat.norm is not None and stat.finite is not False]
        if nonfinite:
            text.append(f" ({len(nonfinite)} non-finite)", style=styler.style(nonfinite[0]))
        elif norms:
            text.append(f" (largest ‖{format_norm(max(norms))}‖)", style="dim")
    return text


def node_line(node: Node, styler: _Styler, *, show_module: bool) -> Text:
    """One node: id, name, parameter or module, grad_in and grad_out, and its mark if it has one."""
    text = _node_text(node, styler, show_module=show_module)
    mark = styler.marks.get(node.id)
    if mark:
        text.append(f"  {mark}", style=_NONFINITE)
    _append_checks(text, node)
    if styler.show_stack and node.stack:
        for frame in node.stack:
            text.append(f"\n    at {frame}", style="dim")
    return text


def _append_checks(text: Text, node: Node) -> None:
    """The results of --gradcheck and --replay on a node line (replay only when it is worth a look)."""
    check = node.gradcheck
    if check is not None:
        if check.passed:
            text.append(f"  gradcheck ✓ ({format_norm(check.mismatch)})", style="green")
        elif check.passed is False:
            text.append(f"  gradcheck ✗ mismatch {format_norm(check.mismatch)}", style=_NONFINITE)
            if check.inputs:
                text.append(f" (the gradient for {listed(list(check.inputs), 4)})", style=_NONFINITE)
        elif check.mismatch is not None:  # it ran, without a verdict
            text.append(f"  gradcheck ? {check.error}", style="dim")
        else:
            text.append(f"  gradcheck not run: {check.error}", style="dim")
    replay = node.replay
    if replay is not None and replay.reproducible is False:
        detail = replay.note or f"differs by {format_norm(replay.relative)} (relative)"
        text.append(f"  replay ✗ {detail}", style=_NONFINITE)
    elif replay is not None and replay.reproducible is None and replay.relative is not None:  # ran, no verdict
        text.append(f"  replay ? differs by {format_norm(replay.relative)}: {replay.note}", style="dim")


def _node_text(node: Node, styler: _Styler, *, show_module: bool) -> Text:
    kind = node.nonfinite_kind
    text = Text(f"#{node.id} ", style="dim")
    text.append(short_name(node.name), style=_NONFINITE if kind else "bold")
    if node.param is not None:
        text.append(f" {node.param}", style="cyan")
    elif node.is_leaf:
        text.append(" (leaf)", style="cyan")
    if show_module and node.module is not None:
        text.append(f" [{node.module or '<root>'}]", style="blue")
    if node.order is None:
        text.append("  did not run", style="dim italic")
        return text
    if not node.is_leaf or node.grad_inputs:
        text.append_text(_stats_text("grad_in", node.grad_inputs or (), styler))
    text.append_text(_stats_text("grad_out" if not node.is_leaf else "grad", node.grad_outputs or (), styler))
    if node.runs > 1:
        total = " (total)" if node.is_leaf else " (first run)"
        text.append(f"  ran {node.runs}×{total}", style="yellow")
    if node.created_in is not None and not show_module:  # the graph view groups these under their creator
        text.append(f"  created in backward of #{node.created_in}", style="dim")
    if node.name == "CompiledFunctionBackward":
        text.append(
            "  torch.compile region: its ops are fused into this node; TORCH_COMPILE_DISABLE=1 shows them",
            style="italic",
        )
    if kind:
        text.append(f"  ← {kind}", style=_NONFINITE)
        if styler.origin == node.id:  # also where no source line is known (custom Functions, --no-sources)
            text.append(" starts here" + (f" ({node.source})" if node.source else ""), style=_NONFINITE)
    if styler.forward_origin == node.id and node.forward is not None:
        made = f"  ← forward made the {node.forward.nonfinite_kind} here" + (f" ({node.source})" if node.source else "")
        text.append(made, style=_NONFINITE)
    return text


class _Budget:
    """Node lines left to draw. Lines for the pinned nodes (:func:`_pinned`) are set aside first: they are drawn
    wherever they come, so the rest runs out before them."""

    def __init__(self, limit: int | None, pinned: Iterable[int] = ()):
        self.limit = limit
        self.pinned = set(pinned)
        self.reserved = len(self.pinned)
        self.shown = 0
        self.hidden = 0

    @property
    def spent(self) -> bool:
        """No node line is left but the pinned nodes': what remains is counted, not drawn."""
        return self.limit is not None and self.shown + self.reserved >= self.limit

    def take(self, node_id: int | None = None) -> bool:
        if node_id in self.pinned:
            self.pinned.discard(node_id)
            self.reserved -= 1
            self.shown += 1
            return True
        if self.spent:
            self.hidden += 1
            return False
        self.shown += 1
        return True


def _matcher(pattern: str | None):
    if pattern is None:
        return lambda node: True
    regex = re.compile(pattern)
    # the names as the tree shows them (AccumulateGrad, <root>) and as the JSON has them (torch::autograd::…, "")
    return lambda node: any(
        value is not None and regex.search(value)
        for value in (node.name, short_name(node.name), node.module, ROOT if node.module == "" else None, node.param)
    )


ROOT = "<root>"  # how the tree shows the model itself as a module


def _execution_key(node: Node) -> tuple[int, int]:
    return (0, node.order) if node.order is not None else (1, node.id)


def _module_depth(path: str) -> int:
    return 0 if path == "" else path.count(".") + 1


def _module_tree(trace: Trace, options: TreeOptions, styler: _Styler, budget: _Budget) -> Tree:
    matches = _matcher(options.pattern)
    by_module: dict[str | None, list[Node]] = defaultdict(list)
    for node in sorted(trace.nodes, key=_execution_key):
        if matches(node):
            by_module[node.module].append(node)
    known = list(trace.meta.module_types)
    has_root = "" in trace.meta.module_types

    def parent_of(path: str) -> str | None:
        if path == "":
            return None
        if "." in path:
            return path.rpartition(".")[0]
        return "" if has_root else None  # a plain callable's modules are top-level

    paths: set[str] = set()
    for module in by_module:
        while module is not None and module not in paths:
            paths.add(module)
            module = parent_of(module)
    ordered = [p for p in known if p in paths] + sorted(paths.difference(known))
    children: dict[str | None, list[str]] = defaultdict(list)
    for path in ordered:
        if path != "":
            children[parent_of(path)].append(path)

    def add_nodes(branch: Tree, nodes: list[Node]) -> None:
        hidden = []
        for node in nodes:
            if budget.take(node.id):
                branch.add(node_line(node, styler, show_module=False))
            else:
                hidden.append(node)
        if hidden:
            more = " more" if len(hidden) < len(nodes) else ""
            text = Text(f"… {len(hidden)}{more} {_plural(len(hidden), 'node')} not shown", style="dim")
            branch.add(text.append_text(_largest(hidden)).append_text(_hidden_marks(hidden, styler)))

    root = Tree(Text(trace.meta.target, style="bold"), guide_style="dim")
    if by_module.get(None):
        add_nodes(root.add(Text(OUTSIDE, style="blue")), by_module[None])

    def count(path: str) -> list[Node]:
        found = list(by_module.get(path, ()))
        for child in children.get(path, ()):
            found += count(child)
        return found

    def add_module(parent: Tree, path: str) -> None:
        kind = trace.meta.module_types.get(path)
        label = Text(path.rpartition(".")[2] if path else ROOT, style="bold blue")
        if kind:
            label.append(f" ({kind})", style="blue")
        if budget.spent and not holds_pinned(path):  # one line for the whole module
            hidden = count(path)
            budget.hidden += len(hidden)
            label.append(f"  {len(hidden)} {_plural(len(hidden), 'node')} not shown", style="dim")
            parent.add(label.append_text(_largest(hidden)).append_text(_hidden_marks(hidden, styler)))
            return
        branch = parent.add(label)
        if options.depth is not None and _module_depth(path) >= options.depth and children.get(path):
            own = by_module.get(path, [])
            add_nodes(branch, own)
            _summarise(branch, count(path)[len(own):], styler)
            return
        add_nodes(branch, by_module.get(path, []))
        add_modules(branch, children.get(path, []))

    pinned_paths: set[str | None] = set()  # the modules a pinned node is in, and theirs
    for node in trace.nodes:
        if node.id in budget.pinned:
            module = node.module
            while module is not None and module not in pinned_paths:
                pinned_paths.add(module)
                module = parent_of(module)

    def holds_pinned(path: str) -> bool:
        return path in pinned_paths

    def add_modules(branch: Tree, paths: list[str]) -> None:
        """Each module; once the budget is spent, a line each for the first FOLDED_MODULES, then one for the rest
        (a module that holds a pinned node is shown, wherever it comes)."""
        folded, rest = 0, []
        for path in paths:
            if budget.spent and not holds_pinned(path):
                if folded == FOLDED_MODULES:
                    rest.append(path)
                    continue
                folded += 1
            add_module(branch, path)
        if rest:
            hidden = [node for other in rest for node in count(other)]
            budget.hidden += len(hidden)
            text = Text(
                f"… {len(rest)} more {_plural(len(rest), 'module')}, {len(hidden)} "
                f"{_plural(len(hidden), 'node')} not shown",
                style="dim",
            )
            branch.add(text.append_text(_largest(hidden)).append_text(_hidden_marks(hidden, styler)))

    add_modules(root, [""] if "" in paths else children.get(None, []))
    return root


FOLDED_MODULES = 10  # modules past --max-nodes shown as a line each, per parent; the rest are one line


def _plural(count: int, word: str) -> str:
    return word if count == 1 else word + "s"


def _summarise(branch: Tree, nodes: list[Node], styler: _Styler) -> None:
    if not nodes:
        return
    text = Text(f"… {len(nodes)} {_plural(len(nodes), 'node')} in submodules", style="dim")
    text.append_text(_largest(nodes))
    text.append_text(_hidden_marks(nodes, styler))
    text.append(" (raise --depth to see them)", style="dim")
    branch.add(text)


def _largest(nodes: Iterable[Node]) -> Text:
    """The largest finite gradient norm of nodes not shown (each node's grad_norm: what it received, a leaf's
    gradient): where gradients grow, to look at with --filter."""
    norms = [n.grad_norm for n in nodes if n.grad_norm is not None and math.isfinite(n.grad_norm)]
    return Text(f", largest grad_out ‖{format_norm(max(norms))}‖" if norms else "", style="dim")


def _hidden_marks(nodes: Iterable[Node], styler: _Styler) -> Text:
    """What a line standing for nodes not shown says of them: how many are non-finite, and whether the
    NaN or infinity starts among them."""
    text = Text()
    nodes = list(nodes)
    bad = sum(1 for n in nodes if n.nonfinite_kind)
    if bad:
        text.append(f", {bad} non-finite", style=_NONFINITE)
    for node in nodes:
        if node.id == styler.origin:
            text.append(f", where it starts (#{node.id} {short_name(node.name)})", style=_NONFINITE)
        if node.id == styler.forward_origin:
            text.append(f", where forward made it (#{node.id} {short_name(node.name)})", style=_NONFINITE)
    return text


def _graph_tree(trace: Trace, options: TreeOptions, styler: _Styler, budget: _Budget) -> Tree:
    root = Tree(Text(trace.meta.target, style="bold"), guide_style="dim")
    if options.pattern is not None:  # a filtered graph has no shape left: list the matches in execution order
        matches = _matcher(options.pattern)
        for node in sorted(trace.nodes, key=_execution_key):
            if matches(node) and budget.take():
                root.add(node_line(node, styler, show_module=True))
        return root
    nodes = trace.nodes
    visited: set[int] = set()
    branch_of: dict[int, Tree] = {}
    # A node reached by several parents (a residual stream's add, reached from the add after it and from
    # the block between) waits while its other parents are still to come in the branch being drawn, then
    # continues at the level where it was first reached: the stream stays on one level and each block is
    # one branch, instead of every add indenting once more. Until then it is referenced ("shown below").
    parents = Counter(child for node in nodes for child in set(node.next) if child is not None)
    shown_parents: Counter[int] = Counter()
    waiting: set[int] = set()

    def show(node_id: int) -> None:
        visited.add(node_id)
        shown_parents.update(set(c for c in nodes[node_id].next if c is not None))

    folded: set[int] = set()  # nodes behind a "… N nodes below" line (--depth)

    def reference(node_id: int, where: str) -> Text:
        arrow = "↑" if where == "above" else "↓"
        shown = "among the nodes not shown above" if node_id in folded else f"shown {where}"
        return Text(f"{arrow} #{node_id} {short_name(nodes[node_id].name)} ({shown})", style="dim")

    def walk(container: Tree, start: int, level: int) -> None:
        # (parent, node, depth, continues): a node that continues parent's chain is added to it as one more
        # node of the chain, not as the head of a new branch
        pending = [(container, start, level, False)]
        while pending:
            parent, node_id, depth, continues = pending.pop()
            waiting.discard(node_id)
            if node_id in visited:
                if not continues and not budget.spent:
                    parent.add(reference(node_id, "above"))
                continue
            if not continues and options.depth is not None and depth > options.depth:
                below = _reachable_unvisited(nodes, node_id, visited, waiting)  # a waiting node is shown later
                visited.update(below)
                folded.update(below)
                budget.hidden += len(below)
                if not budget.spent:
                    them = "it" if len(below) == 1 else "them"
                    text = Text(f"… {len(below)} {_plural(len(below), 'node')} below", style="dim")
                    text.append_text(_hidden_marks(map(nodes.__getitem__, sorted(below)), styler))
                    parent.add(text.append(f" (raise --depth to see {them})", style="dim"))
                continue
            show(node_id)
            branch = parent
            if budget.take():
                label = node_line(nodes[node_id], styler, show_module=True)
                if continues:
                    parent.add(label)
                else:
                    branch = parent.add(label)
            branch_of[node_id] = branch
            current = node_id
            while True:
                kids = list(dict.fromkeys(c for c in nodes[current].next if c is not None))
                for kid in kids:
                    if budget.spent:
                        break
                    if kid in visited:
                        branch.add(reference(kid, "above"))
                    elif kid in waiting:
                        branch.add(reference(kid, "below"))
                fresh = [c for c in kids if c not in visited and c not in waiting]
                later = [c for c in fresh if shown_parents[c] < parents[c]]
                ready = [c for c in fresh if shown_parents[c] >= parents[c]]
                # a straight chain stays on one level, also past nodes whose other children end there (a
                # LayerNorm's weight and bias leaves: each on a line of the chain, which then goes on), so that
                # a residual stream through a LayerNorm (post-LN, as BERT's) does not indent once per layer
                going = [c for c in ready if any(child is not None for child in nodes[c].next)]
                if not later and (len(ready) == 1 or len(going) == 1):
                    following = ready[0] if len(ready) == 1 else going[0]
                    for current in [c for c in ready if c != following] + [following]:  # the ends, then the chain
                        show(current)
                        branch_of[current] = branch
                        if budget.take():
                            branch.add(node_line(nodes[current], styler, show_module=True))
                    continue
                waiting.update(later)
                pending.extend((branch, child, depth, True) for child in reversed(later))  # after the branches
                pending.extend((branch, child, depth + 1, False) for child in reversed(ready))
                break

    if nodes:
        walk(root, 0, 0)
    # Nodes created during backward hang under the node that created them, walked from their own roots.
    has_parent = {child for node in nodes for child in node.next if child is not None}
    groups: dict[int, Tree] = {}
    created = [n for n in nodes if n.created_in is not None]
    for node in sorted(created, key=lambda n: (n.id in has_parent, n.id)):
        if node.id in visited or node.created_in not in branch_of:
            continue
        if node.created_in not in groups:
            label = Text(f"created during backward of #{node.created_in}", style="dim")
            groups[node.created_in] = branch_of[node.created_in] if budget.spent else branch_of[node.created_in].add(label)
        walk(groups[node.created_in], node.id, 1)
    for node in nodes:
        if node.id not in visited:
            walk(root, node.id, 0)
    return root


def _reachable_unvisited(nodes: tuple[Node, ...], start: int, visited: set[int], waiting: set[int]) -> set[int]:
    found: set[int] = set()
    stack = [start]
    while stack:
        node_id = stack.pop()
        if node_id in found or node_id in visited or node_id in waiting:
            continue
        found.add(node_id)
        stack.extend(c for c in nodes[node_id].next if c is not None)
    return found


def render_tree(trace: Trace, options: TreeOptions | None = None) -> tuple[Tree, int]:
    """The node tree and how many node lines were left out by the bound.

    Raises:
        ValueError: unknown view, or a pattern that is not a regular expression.
    """
    options = options or TreeOptions()
    if options.view not in VIEWS:
        raise ValueError(f"unknown view {options.view!r}; expected one of {', '.join(VIEWS)}")
    styler = _Styler(trace, options.marks)
    styler.show_stack = options.show_stack
    modules = options.view == "modules"
    budget = _Budget(options.max_nodes, _pinned(trace, options) if modules and options.max_nodes is not None else ())
    build = _module_tree if modules else _graph_tree
    return build(trace, options, styler, budget), budget.hidden


def _pinned(trace: Trace, options: TreeOptions) -> list[int]:
    """The nodes the module view shows however many lines the others take (at most ``max_nodes`` of them, in
    this order): where a NaN or infinity starts, those the caller pins (where ranks start to differ), failed
    checks, and the nodes the summary names for the largest and the smallest gradient, among those ``--filter``
    keeps."""
    summary = trace._summary
    wanted = [entry["id"] for entry in (summary["first_nonfinite"], summary["first_nonfinite_forward"]) if entry]
    wanted += options.pinned
    wanted += [n.id for n in trace.nodes if n.gradcheck is not None and n.gradcheck.passed is False]
    wanted += [n.id for n in trace.nodes if n.replay is not None and n.replay.reproducible is False]
    wanted += [entry["id"] for entry in (summary["largest_grad"], summary["smallest_nonzero_grad"]) if entry]
    matches = _matcher(options.pattern)

    def drawn(node: Node) -> bool:
        """Kept by --filter, and not in a module --depth summarises (one deeper than it)."""
        deep = options.depth is not None and node.module is not None and _module_depth(node.module) > options.depth
        return matches(node) and not deep

    kept = [node_id for node_id in dict.fromkeys(wanted) if 0 <= node_id < len(trace.nodes) and drawn(trace.nodes[node_id])]
    return kept[: options.max_nodes]


def render_summary(trace: Trace) -> Table:
    """The summary block: counts, loss, inputs, non-finite nodes, extremes, parameters without gradient, times."""
    summary = trace._summary
    meta = trace.meta
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    table.add_row("nodes", f"{summary['nodes']} traced, {summary['executed']} ran")
    if meta.loss is None:  # its value could not be read (a tensor subclass's)
        loss = Text("?")
    else:
        loss = Text(format_norm(meta.loss) if not math.isfinite(meta.loss) else f"{meta.loss:.6g}")
    if meta.loss is not None and not math.isfinite(meta.loss):
        loss.stylize(_NONFINITE)
    loss.append(f"  ({meta.loss_rule})", style="dim")
    table.add_row("loss", loss)
    if meta.inputs:  # the tensors forward was called with, in the -i grammar: what -i or example_inputs() gave
        specs = [f"{i.name} {i.dtype}[{','.join(map(str, i.shape))}]" for i in meta.inputs]
        table.add_row("inputs", listed(specs, 6))
    nonfinite = trace.nonfinite_nodes()
    origin = trace.nonfinite_origin()
    made = trace.forward_nonfinite_origin()
    if made is not None:  # backward only carries it on from the loss: say where forward made it
        text = Text(f"{len(nonfinite)} nodes; the loss is {format_norm(meta.loss)}: forward made it first at ", style=_NONFINITE)
        text.append(f"#{made.id} {short_name(made.name)} {_where(made)} ({made.forward.nonfinite_kind})", style=_NONFINITE)
        if made.source:
            text.append(f", created at {made.source}", style=_NONFINITE)
        text.append(trace.unrecorded_note(made), style=_NONFINITE)
        nan = trace.forward_nan_after(made)
        if nan is not None:  # an infinity (a mask's -inf, an overflow) that an op later made a NaN of
            text.append(f"; a nan first at #{nan.id} {short_name(nan.name)} {_where(nan)}", style=_NONFINITE)
            if nan.source:
                text.append(f", created at {nan.source}", style=_NONFINITE)
        table.add_row("non-finite", text)
    elif origin is not None:
        text = Text(f"{len(nonfinite)} nodes; it starts at ", style=_NONFINITE)
        text.append(f"#{origin.id} {short_name(origin.name)} {_where(origin)} ({trace.origin_kind(origin)})", style=_NONFINITE)
        if origin.source:
            text.append(f", created at {origin.source}", style=_NONFINITE)
        table.add_row("non-finite", text)
    else:
        table.add_row("non-finite", Text("none", style="green"))
    for key, title in (("largest_grad", "largest grad"), ("smallest_nonzero_grad", "smallest grad")):
        entry = summary[key]
        if entry is not None:
            node = trace.nodes[entry["id"]]
            table.add_row(title, f"‖{format_norm(entry['norm'])}‖  #{node.id} {short_name(node.name)} {_where(node)}")
    if summary["param_grad_norm_total"] is not None:
        table.add_row("params ‖grad‖", format_norm(float(summary["param_grad_norm_total"])))
    checked = [n for n in trace.nodes if n.gradcheck is not None and n.gradcheck.passed is not None]
    _add_check_row(
        table, "gradcheck", checked, [n for n in checked if not n.gradcheck.passed],
        "custom Functions checked", "failed", lambda n: f"(mismatch {format_norm(n.gradcheck.mismatch)})",
        unchecked=[n for n in trace.nodes if n.gradcheck is not None and n.gradcheck.passed is None],
    )
    replayed = [n for n in trace.nodes if n.replay is not None and n.replay.reproducible is not None]
    _add_check_row(
        table, "replay", replayed, [n for n in replayed if not n.replay.reproducible],
        "nodes replayed", "not reproducible", _where,
    )
    if trace.params_without_grad:
        names = list(trace.params_without_grad)
        shown = listed(names, 8)
        table.add_row("no gradient", Text(f"{shown}  (parameters that require grad but received none)", style="yellow"))
    if meta.timings_s:
        t = meta.timings_s
        table.add_row(
            "time",
            f"forward {t.get('forward', 0):.3f} s · backward {t.get('backward', 0):.3f} s · total {t.get('total', 0):.3f} s",
        )
    return table


def _add_check_row(
    table: Table,
    title: str,
    ran: list[Node],
    failed: list[Node],
    ran_text: str,
    failed_text: str,
    detail: Any,
    unchecked: Sequence[Node] = (),
) -> None:
    """A summary row for --gradcheck or --replay: how many ran, how many failed, the first failures; and
    how many could not be checked (their nodes say why)."""
    if not ran and not unchecked:
        return
    text = Text(f"{len(ran)} {ran_text}, {len(failed)} {failed_text}", style=_NONFINITE if failed else "green")
    for node in failed[:5]:
        text.append(f"; #{node.id} {short_name(node.name)} {detail(node)}", style=_NONFINITE)
    if unchecked:
        names = listed([f"#{n.id} {short_name(n.name)}" for n in unchecked], 5)
        text.append(f"; {len(unchecked)} not checked ({names}; the tree says why)", style="yellow")
    table.add_row(title, text)


def _where(node: Node) -> str:
    if node.param is not None:
        return node.param
    if node.module is None:
        return "(outside any module)"
    return f"in {node.module or '<root>'}"


def render_trace(trace: Trace, options: TreeOptions | None = None) -> RenderableType:
    """Header, node tree, the omitted-lines note, the legend and the summary."""
    options = options or TreeOptions()
    meta = trace.meta
    header = Text("gradtrace ", style="bold")
    header.append(f"{meta.target} · torch {meta.torch} · {meta.device}", style="dim")
    if meta.world_size > 1:
        header.append(f" · rank {meta.rank}/{meta.world_size}", style="dim")
    view_title = (
        "backward nodes by module, execution order within each" if options.view == "modules" else "backward graph from the loss"
    )
    header.append(f"\n{view_title}", style="dim")
    tree, hidden = render_tree(trace, options)
    parts: list[RenderableType] = [header, tree]
    if options.pattern is not None and not any(map(_matcher(options.pattern), trace.nodes)):
        parts.append(Text(f"no node matches --filter {shlex.quote(options.pattern)} (node names, modules, parameters)", style="yellow"))
    if hidden:
        parts.append(
            Text(
                f"… {hidden} more node lines not shown: --max-nodes N, --depth N, --filter REGEX or --all",
                style="yellow",
            )
        )
    parts += [Text(LEGEND, style="dim"), Text(""), render_summary(trace)]
    return Group(*parts)
