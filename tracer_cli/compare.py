"""Compare traces node by node (ranks of one job, or two runs) and find where they first diverge.

``compare(traces)`` returns a plain dict (the ``comparison`` block of a merged
JSON file). The *origin* of a disagreement is reported, not merely the first
node that differs downstream of it:

* structure: the graphs differ; the parameters in them by name (leaves are
  lined up by name), else the first node, in creation order, that does not
  align (a rank made an extra or a different node).
* forward: the earliest-created node whose forward value differs while the
  values of its inputs agree (leaves first: a parameter that differs is its
  own origin).
* backward: the first node in execution order whose grad_outputs and forward
  value agree but whose grad_inputs differ (a backward that misbehaves).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any, Iterable, Sequence

from .records import GradStat, Node, Trace, encode_float

DEFAULT_RTOL = 1e-5
DEFAULT_ATOL = 1e-12  # the absolute floor: norms this close count as equal whatever their size


def values_differ(values: Sequence[float | None], rtol: float, atol: float) -> bool:
    """Whether norms from several traces disagree (None, NaN and infinities must match exactly)."""
    if any(v is None for v in values):
        return any(v is not None for v in values)
    finite = [math.isfinite(v) for v in values]
    if not all(finite):
        return len({v if not math.isnan(v) else "nan" for v in values}) > 1
    low, high = min(values), max(values)
    return high - low > atol + rtol * max(abs(low), abs(high))


def _recorded_differ(values: Sequence[float | None], rtol: float, atol: float) -> bool:
    """Whether the values that were recorded disagree: a trace made without forward values has none, which is not a
    difference."""
    present = [v for v in values if v is not None]
    return len(present) > 1 and values_differ(present, rtol, atol)


def relative_spread(values: Sequence[float | None]) -> float | None:
    """``(max - min) / max(|v|)`` over finite values; inf when non-finite values disagree."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if len(present) != len(values) or not all(math.isfinite(v) for v in present):
        return 0.0 if len({repr(v) for v in values}) == 1 else math.inf
    scale = max(abs(v) for v in present)
    return 0.0 if scale == 0 else (max(present) - min(present)) / scale


def who_differs(ranks: Sequence[int], of: Sequence[int] = ()) -> str:
    """``rank 2 differs`` / ``ranks 1, 2 differ``: those that disagree with the others. Of two ranks (``of``, the
    ranks compared), either may be the one that is off: neither is blamed (``ranks 0 and 1 differ``)."""
    if len(of) == 2:
        return f"ranks {of[0]} and {of[1]} differ"
    if len(ranks) == 1:
        return f"rank {ranks[0]} differs"
    return f"ranks {', '.join(map(str, ranks))} differ"


def _norm(stat: GradStat | None) -> float | None:
    return None if stat is None else stat.norm


def _slots(stats: Iterable[GradStat | None] | None) -> list[float | None]:
    return [_norm(s) for s in (stats or ())]


def _slots_differ(nodes: Sequence[Node], side: str, rtol: float, atol: float) -> bool:
    rows = [_slots(getattr(n, side)) for n in nodes]
    if len({len(r) for r in rows}) > 1:
        return True
    return any(values_differ(column, rtol, atol) for column in zip(*rows))


def _signature(node: Node) -> tuple:
    return (node.name, node.module, node.param, node.next)


def _creation_sequence(trace: Trace) -> list[Node]:
    """Nodes in creation order: leaves (by parameter name) first, then by ``created``."""
    leaves = sorted((n for n in trace.nodes if n.created is None), key=lambda n: (n.param or "", n.id))
    made = sorted((n for n in trace.nodes if n.created is not None), key=lambda n: n.created)
    return leaves + made


def _describe(node: Node, kind: str, ranks: list[int], rank: int, ids: list[int | None] | None = None) -> dict[str, Any]:
    """The origin, ``node`` of ``rank``'s trace (the graphs align but for a structure divergence, so its id
    names the same node on every rank but then). ``ids``: the id of the node at the same place in each trace,
    in creation order (None past its end), where they differ (a structure divergence)."""
    described = {
        "id": node.id, "name": node.name, "module": node.module, "param": node.param, "kind": kind, "ranks": ranks,
        "source": node.source, "rank": rank,
    }
    if ids is not None:
        described["ids"] = ids
    return described


def _parameter_leaves(trace: Trace) -> frozenset[str]:
    return frozenset(n.param for n in trace.nodes if n.is_leaf and n.param is not None and not n.param.startswith("input:"))


def _parameters_origin(traces: Sequence[Trace], labels: list[int]) -> dict[str, Any] | None:
    """Where the parameters in the graphs differ by name: the first that one trace alone has (leaves are lined up by
    name, so any other node would pair unrelated leaves), with ``params_only``: each trace's names that another lacks."""
    names = [_parameter_leaves(t) for t in traces]
    if len(set(names)) == 1:
        return None
    reference = Counter(names).most_common(1)[0][0] if len(traces) > 2 else names[0]
    if not any(n - reference and reference - n for n in names):
        # one graph has parameters the other lacks, and no others (an expert no token reached on one rank): the
        # names still line up, and where the graphs part in creation order says more
        return None
    common = frozenset.intersection(*names)
    only = [sorted(n - common) for n in names]
    if len(traces) > 2:
        differing = [i for i, n in enumerate(names) if n != reference]
    else:  # no majority: each trace with a name of its own
        differing = [i for i, o in enumerate(only) if o]
    # the origin is a leaf of a trace that has it (a trace that only lacks a parameter has no node to name)
    culprit = next((i for i in differing if only[i]), next(i for i, o in enumerate(only) if o))
    origin = traces[culprit].leaf(only[culprit][0])
    ids = [t.leaf(origin.param).id if origin.param in n else None for t, n in zip(traces, names)]
    described = _describe(origin, "structure", [labels[i] for i in differing], labels[culprit], ids)
    described["params_only"] = only
    return described


def _structure_origin(traces: Sequence[Trace], labels: list[int]) -> dict[str, Any] | None:
    by_name = _parameters_origin(traces, labels)
    if by_name is not None:
        return by_name
    sequences = [_creation_sequence(t) for t in traces]
    longest = max(len(s) for s in sequences)
    for position in range(longest):
        keys = [_key(s, position) for s in sequences]
        if len(set(keys)) == 1:
            continue
        if len(traces) > 2:
            reference = Counter(keys).most_common(1)[0][0]
        else:  # no majority: the trace with nodes the other lacks here (an insertion) is the one that differs
            reference = keys[1] if _inserted(sequences[0], sequences[1], position) else keys[0]
        differing = [i for i, key in enumerate(keys) if key != reference]
        culprit = next((i for i in differing if position < len(sequences[i])), 0)
        ids = [s[position].id if position < len(s) else None for s in sequences]
        return _describe(sequences[culprit][position], "structure", [labels[i] for i in differing], labels[culprit], ids)
    # same nodes in the same creation order: the edges (or ids) may still differ
    for position in range(longest):
        nodes = [s[position] for s in sequences]
        if len({(n.id, *_signature(n)) for n in nodes}) > 1:
            ids = [n.id for n in nodes]
            return _describe(nodes[-1], "structure", [labels[i] for i in range(1, len(nodes))], labels[-1], ids)
    return None


def _key(sequence: list[Node], index: int) -> tuple | None:
    """What a node is, structurally: its name, module and parameter (None past the end)."""
    return (sequence[index].name, sequence[index].module, sequence[index].param) if index < len(sequence) else None


def _inserted(first: list[Node], second: list[Node], position: int, reach: int = 16) -> bool:
    """Whether ``first`` has nodes here that ``second`` lacks: ``second``'s node at ``position`` comes later
    in ``first`` (within ``reach`` nodes), and not the other way round."""
    if position >= len(second):
        return True
    for offset in range(1, reach + 1):
        if _key(first, position + offset) == _key(second, position) and _key(first, position + offset) is not None:
            return True
        if _key(second, position + offset) == _key(first, position) and _key(second, position + offset) is not None:
            return False
    return False


def _forward_origin(traces: Sequence[Trace], labels: list[int], rtol: float, atol: float) -> dict[str, Any] | None:
    reference = traces[0]
    count = len(reference.nodes)
    known = [all(t.nodes[i].forward is not None for t in traces) for i in range(count)]
    differs = [
        known[i] and (values_differ([t.nodes[i].forward.norm for t in traces], rtol, atol) or bool(_shapes_differ(traces, i)))
        for i in range(count)
    ]
    def inputs_agree(node_id: int) -> bool:
        """Whether every value flowing into the node agrees, looking through nodes with no recorded value."""
        stack, seen = list(reference.nodes[node_id].next), set()
        while stack:
            child = stack.pop()
            if child is None or child in seen:
                continue
            seen.add(child)
            if known[child]:
                if differs[child]:
                    return False
            else:
                stack.extend(reference.nodes[child].next)
        return True

    for node in _creation_sequence(reference):
        if differs[node.id] and inputs_agree(node.id):
            ranks = _differing_ranks([t.nodes[node.id].forward.norm for t in traces], labels, rtol, atol)
            described = _describe(node, "forward", ranks, labels[0])
            shapes = _shapes_differ(traces, node.id)
            if shapes:  # (a batch of another size on one rank): said, as norms alone do not show it
                described["shapes"] = shapes
                if not ranks:  # the norms agree: the ranks whose shape is not the most common one's
                    common = Counter(map(tuple, shapes)).most_common(1)[0][0] if len(shapes) > 2 else tuple(shapes[0])
                    described["ranks"] = [label for label, shape in zip(labels, shapes) if tuple(shape) != common]
            return described
    return None


def _shapes_differ(traces: Sequence[Trace], node_id: int) -> list[list[int]] | None:
    """Each trace's shape of the node's forward value, where they differ (all recorded); else None."""
    shapes = [list(t.nodes[node_id].forward.shape) for t in traces]
    return shapes if any(shape != shapes[0] for shape in shapes) else None


def _parameter_origin(traces: Sequence[Trace], labels: list[int], rtol: float, atol: float) -> dict[str, Any] | None:
    """The first parameter (by name) whose value differs across ranks: what data parallelism must keep equal
    whatever the data (inputs, ``input:...``, are not parameters)."""
    reference = traces[0]
    for node in _creation_sequence(reference):
        if node.created is not None:
            break  # leaves come first
        if node.param is None or node.param.startswith("input:"):
            continue
        values = [t.nodes[node.id].forward for t in traces]
        if all(v is not None for v in values) and values_differ([v.norm for v in values], rtol, atol):
            return _describe(node, "forward", _differing_ranks([v.norm for v in values], labels, rtol, atol), labels[0])
    return None


def _backward_origin(traces: Sequence[Trace], labels: list[int], rtol: float, atol: float) -> dict[str, Any] | None:
    reference = traces[0]
    for node in reference.executed():
        nodes = [t.nodes[node.id] for t in traces]
        if any(n.order is None for n in nodes):
            continue
        forward = [_norm(n.forward) for n in nodes]
        if _recorded_differ(forward, rtol, atol) or _slots_differ(nodes, "grad_outputs", rtol, atol):
            continue
        if _slots_differ(nodes, "grad_inputs", rtol, atol):
            columns = list(zip(*[_slots(n.grad_inputs) for n in nodes]))
            ranks = sorted({r for column in columns for r in _differing_ranks(list(column), labels, rtol, atol)})
            return _describe(node, "backward", ranks, labels[0])
    return None


def _differing_ranks(values: list[float | None], labels: list[int], rtol: float, atol: float) -> list[int]:
    """The ranks whose value disagrees with the majority (with two, the one that is not first)."""
    if len(values) <= 2:
        return labels[1:] if values_differ(values, rtol, atol) else []
    groups: list[list[int]] = []
    for index, value in enumerate(values):
        for group in groups:
            if not values_differ([values[group[0]], value], rtol, atol):
                group.append(index)
                break
        else:
            groups.append([index])
    majority = max(groups, key=len)
    return [labels[i] for i in range(len(values)) if i not in majority]


def compare(
    traces: Sequence[Trace],
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    inputs_differ: bool = False,
    labels: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Compare traces of the same model (ranks of a job, or two runs).

    Args:
        traces: two or more traces.
        rtol: relative tolerance on norms.
        atol: absolute floor on norms.
        inputs_differ: the inputs legitimately differ (``--rank-seed``): node values
            are not compared, only the parameters and their gradients after backward,
            which must agree under data parallelism.
        labels: how to name each trace in ``ranks`` lists (default: ``meta.rank``, or the
            position in ``traces`` when those are not distinct, as for separate runs).

    Returns:
        The ``comparison`` block: ``first_divergent`` (or None), ``ranks`` (per-trace
        loss, total parameter gradient norm, non-finite node count), ``nodes`` (per-node
        relative spreads), ``unsynchronized_params``, ``rtol``, ``atol``, ``note``.
    """
    if not traces:  # one trace (a job of one rank) agrees with itself
        raise ValueError("compare() needs a trace")
    if labels is None:
        ranks = [t.meta.rank for t in traces]
        labels = ranks if len(set(ranks)) == len(ranks) else list(range(len(traces)))  # runs, not ranks: positions
    labels = list(labels)
    per_rank = []
    for label, t in zip(labels, traces):
        summary = t.summary()
        per_rank.append(
            {
                "rank": label,
                "loss": encode_float(t.meta.loss),
                "param_grad_norm_total": summary["param_grad_norm_total"],
                "nonfinite_nodes": summary["nonfinite_nodes"],
            }
        )
    unsynchronized = _unsynchronized_params(traces, rtol, atol)
    note = None
    first = _structure_origin(traces, labels)
    spreads: list[dict[str, Any]] = []
    if first is not None:
        note = "the graphs differ: node values are not compared"
    else:
        if not inputs_differ:  # with different inputs every node legitimately differs: no spreads to show
            spreads = _node_spreads(traces)
        if inputs_differ:
            note = (
                "inputs differ by rank (--rank-seed): local gradients legitimately differ, so node values are "
                "not compared; the parameters, and their gradients after backward, must still agree"
            )
            first = _parameter_origin(traces, labels, rtol, atol)
        else:
            first = _forward_origin(traces, labels, rtol, atol) or _backward_origin(traces, labels, rtol, atol)
            if len(traces) > 1 and any(t.nodes and all(n.forward is None for n in t.nodes) for t in traces):
                note = (
                    "forward values were not recorded in every trace (trace(..., forward_stats=True) records them; "
                    "--json does): they are compared only where every trace has them, and a difference is placed "
                    "where the gradients first part (a changed weight or op before that node shows there too)"
                )
    return {
        "first_divergent": first,
        "ranks": per_rank,
        "nodes": spreads,
        "unsynchronized_params": unsynchronized,
        "rtol": rtol,
        "atol": atol,
        "note": note,
    }


def _node_spreads(traces: Sequence[Trace]) -> list[dict[str, Any]]:
    spreads = []
    for node_id in range(len(traces[0].nodes)):
        nodes = [t.nodes[node_id] for t in traces]
        forward = [_norm(n.forward) for n in nodes]
        # a trace made without forward statistics has none to compare (not a difference)
        known = all(n.forward is not None for n in nodes)
        entry: dict[str, Any] = {"id": node_id, "forward": encode_float(relative_spread(forward)) if known else None}
        for side in ("grad_inputs", "grad_outputs"):
            rows = [_slots(getattr(n, side)) for n in nodes]
            columns = [relative_spread(list(column)) for column in zip(*rows)] if len({len(r) for r in rows}) == 1 else []
            present = [c for c in columns if c is not None]
            entry[side] = encode_float(max(present)) if present else None
        spreads.append(entry)
    return spreads


def _unsynchronized_params(traces: Sequence[Trace], rtol: float, atol: float) -> list[str]:
    grads = [dict(t.param_grads) for t in traces]
    names = sorted(set().union(*grads))
    return [name for name in names if values_differ([_norm(g.get(name)) for g in grads], rtol, atol)]


def _parameter_names(trace: Trace) -> set[str]:
    """Every parameter the trace names: its leaves', and those named after backward (inputs are not parameters)."""
    names = set(_parameter_leaves(trace))
    return names | {name for name, _ in trace.param_grads} | set(trace.params_without_grad)


def wrapper_prefix(a: Trace, b: Trace) -> tuple[int, str] | None:
    """Whether one trace's parameter names are all the other's with one prefix added: a wrapper's (``module.`` of
    DDP and DataParallel, ``_orig_mod.`` of torch.compile, ``_fsdp_wrapped_module.``; nested, ``module._orig_mod.``).

    Returns:
        The index of the trace whose names carry the prefix, and the prefix (it ends in a dot); None when the names
        are the same, or differ otherwise.
    """
    names = [_parameter_names(a), _parameter_names(b)]
    if names[0] == names[1] or len(names[0]) != len(names[1]):
        return None
    for wrapped in (0, 1):
        bare, sample = names[1 - wrapped], min(names[wrapped])
        # the prefix is a module path: it ends at one of the sample's dots
        for end in (i + 1 for i, char in enumerate(sample) if char == "."):
            prefix = sample[:end]
            if {prefix + name for name in bare} == names[wrapped]:
                return wrapped, prefix
    return None


def strip_prefix(trace: Trace, prefix: str) -> Trace:
    """The trace with a wrapper's prefix taken off its parameter and module names (``module.0.weight``:
    ``0.weight``; the wrapped model itself, ``module``, becomes the root, ``""``, as do wrappers within the prefix)."""

    def bare(name: str | None) -> str | None:
        if name is not None and name.startswith(prefix):
            return name[len(prefix):]
        return "" if name and prefix.startswith(name + ".") else name

    nodes = tuple(node._replace(param=bare(node.param), module=bare(node.module)) for node in trace.nodes)
    return dataclasses.replace(
        trace,
        nodes=nodes,
        params_without_grad=tuple(bare(name) for name in trace.params_without_grad),
        param_grads=tuple((bare(name), stat) for name, stat in trace.param_grads),
    )
