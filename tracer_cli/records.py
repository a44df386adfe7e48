"""The Trace data model: frozen records of plain numbers and strings.

``trace()`` returns a :class:`Trace`; every renderer and check reads it. Nothing
here imports torch, so a Trace can be loaded from JSON on any machine.

JSON layout (schema ``gradtrace/1``)::

    {"schema": "gradtrace/1", "meta": {...}, "nodes": [...], "summary": {...}}

Non-finite norms are written as the strings "nan", "inf" and "-inf", so the
document is strict JSON.

The per-node records (:class:`Node`, :class:`GradStat`, :class:`NodeCall`) are named
tuples: a trace can hold 100k nodes, and a named tuple is built several times faster
than a frozen dataclass.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator, NamedTuple, Sequence

SCHEMA = "gradtrace/1"


def encode_float(value: float | None) -> float | str | None:
    """A float for strict JSON: non-finite values become "nan", "inf" or "-inf"."""
    if value is None or math.isfinite(value):
        return value
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"


def decode_float(value: float | int | str | None) -> float | None:
    """The inverse of :func:`encode_float`."""
    if value is None:
        return None
    return float(value)


class GradStat(NamedTuple):
    """Statistics of one tensor: a gradient, or a forward value.

    Attributes:
        shape: the tensor's shape.
        dtype: its dtype without the ``torch.`` prefix, e.g. ``"float32"``.
        norm: its L2 norm (computed in float32 or wider); ``nan`` when it holds a
            NaN, ``inf`` when it holds an infinity; ``None`` if it could not be
            computed (an exotic tensor subclass).
        layout: ``None`` for ordinary (strided) tensors, else e.g. ``"sparse_coo"``.
    """

    shape: tuple[int, ...]
    dtype: str
    norm: float | None
    layout: str | None = None

    @property
    def finite(self) -> bool | None:
        """Whether every element is finite (``None`` when the norm is unknown)."""
        return None if self.norm is None else math.isfinite(self.norm)

    @property
    def nonfinite_kind(self) -> str | None:
        """``"nan"``, ``"inf"`` or ``None``."""
        if self.norm is None or math.isfinite(self.norm):
            return None
        return "nan" if math.isnan(self.norm) else "inf"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "norm": encode_float(self.norm),
            "finite": self.finite,
        }
        if self.layout is not None:
            out["layout"] = self.layout
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GradStat:
        return cls(
            shape=tuple(data["shape"]),
            dtype=data["dtype"],
            norm=decode_float(data.get("norm")),
            layout=data.get("layout"),
        )


GradStats = tuple[GradStat | None, ...]


def _stats_to_list(stats: GradStats | None) -> list[dict[str, Any] | None] | None:
    if stats is None:
        return None
    return [None if s is None else s.to_dict() for s in stats]


def _stats_from_list(data: list[dict[str, Any] | None] | None) -> GradStats | None:
    if data is None:
        return None
    return tuple(None if s is None else GradStat.from_dict(s) for s in data)


class NodeCall(NamedTuple):
    """One run of a node that ran more than once in one backward."""

    order: int
    grad_inputs: GradStats
    grad_outputs: GradStats

    def to_dict(self) -> dict[str, Any]:
        return {
            "order": self.order,
            "grad_inputs": _stats_to_list(self.grad_inputs),
            "grad_outputs": _stats_to_list(self.grad_outputs),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeCall:
        return cls(
            order=data["order"],
            grad_inputs=_stats_from_list(data["grad_inputs"]) or (),
            grad_outputs=_stats_from_list(data["grad_outputs"]) or (),
        )


@dataclass(frozen=True)
class Replay:
    """A node's backward run again from the gradients it received, inside its hook.

    Attributes:
        max_abs_diff: largest absolute difference from what the engine produced.
        relative: ``max_abs_diff`` relative to the largest magnitude produced.
        reproducible: whether the replay matched (relative difference ≤ 1e-6).
        note: why the node could not be replayed, when it could not.
    """

    max_abs_diff: float | None
    relative: float | None
    reproducible: bool | None
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_abs_diff": encode_float(self.max_abs_diff),
            "relative": encode_float(self.relative),
            "reproducible": self.reproducible,
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Replay:
        return cls(decode_float(data.get("max_abs_diff")), decode_float(data.get("relative")), data.get("reproducible"), data.get("note"))


@dataclass(frozen=True)
class Gradcheck:
    """A custom Function's backward checked numerically in float64 on the inputs it was called with (at float32's
    precision where the Function computes in float32 inside).

    Attributes:
        passed: False if PyTorch's fast-mode ``gradcheck`` or gradtrace's own directional check
            fails; ``None`` if it could not run, or if the Function is not differentiable at those
            inputs (a kink: no verdict).
        mismatch: relative difference between the analytical and the numerical
            directional derivative (a random direction), the figure behind the verdict.
        error: why it could not run or gave no verdict.
        inputs: where it failed, the arguments of the Function's forward whose gradients disagree with the
            numerical ones, each checked alone (their names in forward's signature); empty where none does
            alone, or where it passed.
    """

    passed: bool | None
    mismatch: float | None = None
    error: str | None = None
    inputs: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "mismatch": encode_float(self.mismatch), "error": self.error, "inputs": list(self.inputs)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Gradcheck:
        return cls(data.get("passed"), decode_float(data.get("mismatch")), data.get("error"), tuple(data.get("inputs") or ()))


class Node(NamedTuple):
    """One autograd graph node and what its hook saw.

    ``grad_inputs`` are the gradients the node *sends on*, one per differentiable
    input of the forward op; ``grad_outputs`` are the gradients *arriving* at it,
    one per output of the forward op (PyTorch's ``Node.register_hook`` naming).
    ``None` entries are where PyTorch passed ``None``.

    Attributes:
        id: dense index, 0 is the loss's ``grad_fn``.
        name: ``grad_fn.name()``, e.g. ``"MulBackward0"``.
        module: dotted path of the innermost module whose forward created the
            node; ``""`` is the root module, ``None`` is outside any module.
        param: for AccumulateGrad, the parameter name (``"fc1.weight"``) or the
            input (``"input:0"``, ``"input:x"``); else ``None``.
        order: position in backward execution order (first run); ``None`` if it
            never ran.
        next: ids of ``next_functions``; ``None`` where there is no function.
        grad_inputs / grad_outputs: statistics of the first run, or for a node
            that ran several times, see ``calls``; ``None`` if it never ran.
        created: position in creation (forward) order; ``None`` for leaves.
        created_in: id of the node whose backward created this node (reentrant
            checkpointing recomputes its forward during backward); else ``None``.
        calls: every run, when the node ran more than once in one backward.
        forward: statistics of the forward value the node's op produced (for a
            leaf: the parameter or input itself), when recorded; ``None`` for
            nodes made inside an op, or when forward statistics were off.
        source: ``path:line`` of the user's code whose op created the node (the
            innermost frame outside torch and gradtrace; a custom Function's node has the
            line that applied it); ``None`` for leaves and nodes made during backward.
        stack: every user frame behind the node, innermost first (``--stack``).
        replay: the node's backward run again in its hook (``--replay``).
        gradcheck: a custom Function's numerical check (``--gradcheck``).
    """

    id: int
    name: str
    module: str | None
    param: str | None
    order: int | None
    next: tuple[int | None, ...]
    grad_inputs: GradStats | None
    grad_outputs: GradStats | None
    created: int | None = None
    created_in: int | None = None
    calls: tuple[NodeCall, ...] = ()
    forward: GradStat | None = None
    source: str | None = None
    stack: tuple[str, ...] | None = None
    replay: Replay | None = None
    gradcheck: Gradcheck | None = None

    @property
    def runs(self) -> int:
        if self.calls:
            return len(self.calls)
        return 0 if self.order is None else 1

    @property
    def executed(self) -> bool:
        return self.order is not None

    @property
    def is_leaf(self) -> bool:
        """An AccumulateGrad node: where a parameter's or input's gradient lands."""
        return self.name.endswith("AccumulateGrad")

    def stats(self) -> Iterator[tuple[str, int, GradStat]]:
        """Every recorded statistic as ``(side, index, stat)``; side is "in" or "out"."""
        for side, stats in (("in", self.grad_inputs), ("out", self.grad_outputs)):
            for index, stat in enumerate(stats or ()):
                if stat is not None:
                    yield side, index, stat
        for call in self.calls[1:]:
            for side, stats in (("in", call.grad_inputs), ("out", call.grad_outputs)):
                for index, stat in enumerate(stats):
                    if stat is not None:
                        yield side, index, stat

    @property
    def nonfinite_kind(self) -> str | None:
        """``"nan"`` if any gradient holds a NaN, else ``"inf"`` if any holds an infinity."""
        norms = [stat.norm for _, _, stat in self.stats() if stat.norm is not None]
        if all(map(math.isfinite, norms)):
            return None
        return "nan" if any(map(math.isnan, norms)) else "inf"

    @property
    def grad_norm(self) -> float | None:
        """The norm that best describes the node: a leaf's gradient, else what it received."""
        stats = [s for s in (self.grad_outputs or ()) if s is not None and s.norm is not None]
        if not stats:
            return None
        return joint_norm(s.norm for s in stats)

    def label(self) -> str:
        """``name`` with the parameter or module, for messages (``torch::autograd::`` left out)."""
        name = short_name(self.name)
        if self.param is not None:
            return f"{name} ({self.param})"
        if self.module is not None:
            return f"{name} in {self.module or '<root>'}"
        return name

    def to_dict(self, forward_recorded: bool = False) -> dict[str, Any]:
        """The node's JSON object; with ``forward_recorded`` (the trace recorded forward values), a node
        without one has ``"forward": null``."""
        out: dict[str, Any] = {
            "id": self.id,
            "name": self.name,
            "module": self.module,
            "param": self.param,
            "order": self.order,
            "next": list(self.next),
            "grad_inputs": _stats_to_list(self.grad_inputs),
            "grad_outputs": _stats_to_list(self.grad_outputs),
            "created": self.created,
        }
        if self.created_in is not None:
            out["created_in"] = self.created_in
        if self.calls:
            out["runs"] = self.runs
            out["calls"] = [call.to_dict() for call in self.calls]
        if self.forward is not None or forward_recorded:
            out["forward"] = None if self.forward is None else self.forward.to_dict()
        out["source"] = self.source
        if self.stack is not None:
            out["stack"] = list(self.stack)
        if self.replay is not None:
            out["replay"] = self.replay.to_dict()
        if self.gradcheck is not None:
            out["gradcheck"] = self.gradcheck.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Node:
        return cls(
            id=data["id"],
            name=data["name"],
            module=data.get("module"),
            param=data.get("param"),
            order=data.get("order"),
            next=tuple(data["next"]),
            grad_inputs=_stats_from_list(data.get("grad_inputs")),
            grad_outputs=_stats_from_list(data.get("grad_outputs")),
            created=data.get("created"),
            created_in=data.get("created_in"),
            calls=tuple(NodeCall.from_dict(c) for c in data.get("calls", ())),
            forward=GradStat.from_dict(data["forward"]) if data.get("forward") else None,
            source=data.get("source"),
            stack=tuple(data["stack"]) if data.get("stack") is not None else None,
            replay=Replay.from_dict(data["replay"]) if data.get("replay") else None,
            gradcheck=Gradcheck.from_dict(data["gradcheck"]) if data.get("gradcheck") else None,
        )


def short_name(name: str) -> str:
    """``torch::autograd::AccumulateGrad`` → ``AccumulateGrad``."""
    return name.rsplit("::", 1)[-1]


def a_or_an(word: str) -> str:
    """``a NoneType``, ``an int``, ``a UserDict``: the article for a word, by how it begins."""
    lower = word.lower()
    vowel = lower[:1] in ("a", "e", "i", "o", "u") and not lower.startswith(("us", "uni", "uint", "eu", "one"))
    return f"{'an' if vowel else 'a'} {word}"


def listed(items: Sequence[str], limit: int) -> str:
    """``"a, b, c and 4 more"``: the first ``limit`` items, then how many are left out."""
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


# backward nodes of ops whose output holds values of their input (or none): they cannot make a NaN or an
# infinity from finite values (a dtype conversion can overflow: not among them)
_VALUE_KEEPING = tuple(
    f"{op}Backward"
    for op in (
        "T", "View", "UnsafeView", "Transpose", "Permute", "Expand", "Unsqueeze", "Squeeze", "Slice", "Select",
        "Clone", "AsStrided", "ReshapeAlias", "Alias", "Split", "SplitWithSizes", "Unbind", "Cat", "Stack",
        "Narrow", "Index", "Gather", "Repeat", "Flip", "Roll", "ConstantPadNd",
    )
)

# the largest finite value of a floating dtype, by name: a value whose norm is no larger is held by it
_LARGEST = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38, "float64": math.inf}


@dataclass(frozen=True)
class InputInfo:
    """One input the model was called with."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class Meta:
    """How the trace was made."""

    target: str
    torch: str
    device: str
    loss: float | None
    loss_rule: str
    inputs: tuple[InputInfo, ...] = ()
    timings_s: dict[str, float] = field(default_factory=dict)
    seed: int | None = None
    rank: int = 0
    world_size: int = 1
    training: bool | None = None
    module_types: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "torch": self.torch,
            "device": self.device,
            "rank": self.rank,
            "world_size": self.world_size,
            "seed": self.seed,
            "training": self.training,
            "loss": encode_float(self.loss),
            "loss_rule": self.loss_rule,
            "inputs": [i.to_dict() for i in self.inputs],
            "timings_s": dict(self.timings_s),
            "module_types": dict(self.module_types),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Meta:
        return cls(
            target=data["target"],
            torch=data["torch"],
            device=data["device"],
            loss=decode_float(data.get("loss")),
            loss_rule=data["loss_rule"],
            inputs=tuple(
                InputInfo(i["name"], tuple(i["shape"]), i["dtype"]) for i in data.get("inputs", ())
            ),
            timings_s=dict(data.get("timings_s", {})),
            seed=data.get("seed"),
            rank=data.get("rank", 0),
            world_size=data.get("world_size", 1),
            training=data.get("training"),
            module_types=dict(data.get("module_types", {})),
        )


@dataclass(frozen=True)
class Trace:
    """Everything one traced forward+backward produced.

    Attributes:
        meta: how the trace was made.
        nodes: every node reachable from the loss (and any created during backward),
            indexed by ``id``.
        params_without_grad: parameters that require grad but received none.
        param_grads: each parameter's ``.grad`` after backward returned (under DDP,
            averaged across ranks; hooks see each rank's own contribution), by name.
    """

    meta: Meta
    nodes: tuple[Node, ...]
    params_without_grad: tuple[str, ...] = ()
    param_grads: tuple[tuple[str, GradStat | None], ...] = ()

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        """One line, whatever the size (a REPL or a notebook shows it); the tree is ``gradtrace run``'s."""
        ran = sum(1 for n in self.nodes if n.order is not None)
        parts = [f"target={self.meta.target!r}", f"nodes={len(self.nodes)}", f"ran={ran}", f"loss={self.meta.loss!r}"]
        nonfinite = self.nonfinite_nodes()
        if nonfinite:
            origin = self.nonfinite_origin() or nonfinite[0]
            parts.append(f"nonfinite={len(nonfinite)} (first: #{origin.id} {origin.name})")
        if self.params_without_grad:
            parts.append(f"params_without_grad={len(self.params_without_grad)} ({listed(self.params_without_grad, 3)})")
        return f"Trace({', '.join(parts)})"

    def __getitem__(self, node_id: int) -> Node:
        return self.nodes[node_id]

    def executed(self) -> list[Node]:
        """The nodes that ran, in execution order."""
        return list(self._executed)

    # Derived once per Trace (it is frozen): the CLI's tree, summary and checks each ask again
    @functools.cached_property
    def _executed(self) -> tuple[Node, ...]:
        return tuple(sorted((n for n in self.nodes if n.order is not None), key=lambda n: n.order))

    @functools.cached_property
    def _nonfinite_nodes(self) -> tuple[Node, ...]:
        return tuple(n for n in self._executed if n.nonfinite_kind is not None)

    def find(self, name: str | None = None, *, module: str | None = None, param: str | None = None) -> list[Node]:
        """Nodes matching every criterion given (exact matches)."""
        return [
            n
            for n in self.nodes
            if (name is None or n.name == name)
            and (module is None or n.module == module)
            and (param is None or n.param == param)
        ]

    def leaf(self, param: str) -> Node:
        """The AccumulateGrad node of a parameter or input (``"fc1.weight"``, ``"input:0"``)."""
        for node in self.nodes:
            if node.param == param:
                return node
        if param in self.params_without_grad:
            raise KeyError(f"no leaf named {param!r}: it requires grad but no op of this backward's graph used it")
        names = [node.param for node in self.nodes if node.param is not None]
        raise KeyError(
            f"no leaf named {param!r} (a parameter that does not require grad, frozen, has none; one that several "
            f"modules share is named once, by its first name); the leaves: {listed(names, 8) or 'none'}"
        )

    def parameter_grad_norms(self) -> dict[str, float]:
        """Each parameter's gradient norm, by name: its ``.grad`` after backward (under DDP, averaged
        across ranks), else what its AccumulateGrad received."""
        norms = {name: stat.norm for name, stat in self.param_grads if stat is not None and stat.norm is not None}
        if norms:
            return norms
        return {
            node.param: node.grad_norm
            for node in self.executed()
            if node.is_leaf and node.param is not None and not node.param.startswith("input:")
            and node.grad_norm is not None
        }

    def nonfinite_nodes(self) -> list[Node]:
        """Nodes with a NaN or infinite gradient, in execution order."""
        return list(self._nonfinite_nodes)

    def nonfinite_origins(self) -> list[Node]:
        """The nodes that made a NaN or infinity, in execution order: each sent one on although every
        gradient it received (in any call) was finite. Found even when a later node masks it again.

        A node whose backward ran nodes of its own (a reentrant checkpoint) sends on what they made: where
        one of them is an origin, the node is not one too."""
        return self.outermost_excluded(list(filter(_made_nonfinite, self.nonfinite_nodes())))

    def nonfinite_origin(self) -> Node | None:
        """Where the first non-finite gradient came from: the first of :meth:`nonfinite_origins`. Failing
        that (the loss itself was not finite), the first node with a non-finite gradient."""
        nonfinite = self.nonfinite_nodes()
        origins = self.nonfinite_origins()
        return origins[0] if origins else (nonfinite[0] if nonfinite else None)

    def outermost_excluded(self, nodes: list[Node]) -> list[Node]:
        """``nodes`` without those whose backward created (directly, or through nodes it created) one of
        ``nodes``: what such a node sends on, the nodes it ran made."""
        creators: set[int] = set()
        for node in nodes:
            creator = node.created_in
            while creator is not None and creator not in creators:
                creators.add(creator)
                creator = self.nodes[creator].created_in
        return [node for node in nodes if node.id not in creators]

    def computed_stats(self) -> Iterator[tuple[Node, GradStat]]:
        """Every known gradient statistic of the nodes that ran, with its node, but the seed that backward
        starts from (the loss node's grad_out, 1 for ``loss.backward()``): it says nothing of the model."""
        for node in self.executed():
            for side, _, stat in node.stats():
                if stat.norm is not None and not (node.id == 0 and side == "out"):
                    yield node, stat

    def forward_nonfinite_origin(self) -> Node | None:
        """Where forward made the NaN or infinity of a non-finite loss: a parameter or input that holds one,
        else the earliest-created op whose output does, of those the value reached the loss through (a NaN
        that ``torch.where`` masks is not it). Followed from the loss through outputs that are not finite,
        or not recorded (ops made inside an op, custom Functions). Known only where forward values were
        recorded (``forward_stats=True``; ``gradtrace run`` records them when the loss is not finite). None
        for a finite loss."""
        reached = self._forward_nonfinite_reached()
        leaves = sorted((n for n in reached if n.created is None), key=lambda n: n.id)
        return leaves[0] if leaves else min(reached, key=lambda n: n.created, default=None)

    def forward_nan_after(self, origin: Node) -> Node | None:
        """Of a NaN loss whose :meth:`forward_nonfinite_origin` made an infinity: the op that first made a NaN
        of it, of those the value reached the loss through (a softmax over a row an ``-inf`` mask filled, the
        mask being meant; an activation of a value that overflowed). None otherwise."""
        loss = self.meta.loss
        if loss is None or not math.isnan(loss) or origin.forward is None or origin.forward.nonfinite_kind != "inf":
            return None
        made = [n for n in self._forward_nonfinite_reached() if n.created is not None and n.forward.nonfinite_kind == "nan"]
        return min(made, key=lambda n: n.created, default=None)

    def forward_origin_text(self, origin: Node) -> str:
        """``"an inf first at #7 AddmmBackward0 in fc; a nan first at #5 GeluBackward0 in act"``, with the
        notes of :meth:`unrecorded_note`: the words after "forward made" in a message."""
        text = f"{a_or_an(origin.forward.nonfinite_kind)} first at #{origin.id} {origin.label()}" + self.unrecorded_note(origin)
        nan = self.forward_nan_after(origin)
        if nan is not None:
            text += f"; a nan first at #{nan.id} {nan.label()}" + (f", created at {nan.source}" if nan.source else "")
        return text

    def _forward_nonfinite_reached(self) -> list[Node]:
        """The forward nodes whose non-finite output reached a non-finite loss (see :meth:`forward_nonfinite_origin`)."""
        loss = self.meta.loss
        if not self.nodes or loss is None or math.isfinite(loss):
            return []
        reached, seen, stack = [], {0}, [0]
        while stack:
            node = self.nodes[stack.pop()]
            if node.forward is not None and node.forward.finite is not False:  # the value did not come through it
                continue
            if node.forward is not None and node.created_in is None:
                reached.append(node)
            for child in node.next:
                if child is not None and child not in seen:
                    seen.add(child)
                    stack.append(child)
        return reached

    def unrecorded_before(self, node: Node) -> list[Node]:
        """The ops that fed ``node`` without a forward value of their own (made inside one call that is seen
        as a whole, as ``F.multi_head_attention_forward`` or ``F.cross_entropy``), of those that can make a
        NaN or infinity from finite values (not views, transposes or copies), in creation order: where
        :meth:`forward_nonfinite_origin` may have been made, unseen."""
        found, seen, stack = [], set(), [child for child in node.next if child is not None]
        while stack:
            current = self.nodes[stack.pop()]
            if current.id in seen or current.forward is not None or current.created is None:
                continue  # a recorded value (it came through finite, or is the origin's input) or a leaf
            seen.add(current.id)
            if not current.name.startswith(_VALUE_KEEPING) and not self._cast_in_range(current):
                found.append(current)
            stack.extend(child for child in current.next if child is not None)
        return sorted(found, key=lambda n: n.created)

    def _cast_in_range(self, node: Node) -> bool:
        """Whether ``node`` is a dtype conversion (autocast's of a weight, say) of values recorded finite and no
        larger, by their norm, than its dtype holds: it cannot have made a NaN or an infinity."""
        if not node.name.startswith("ToCopyBackward") or not node.grad_outputs or node.grad_outputs[0] is None:
            return False
        largest = _LARGEST.get(node.grad_outputs[0].dtype)
        inputs = [self.nodes[child] for child in node.next if child is not None]
        return largest is not None and bool(inputs) and all(
            n.forward is not None and n.forward.norm is not None and math.isfinite(n.forward.norm) and n.forward.norm <= largest
            for n in inputs
        )

    def unrecorded_note(self, node: Node) -> str:
        """``", or in an op before it ..."`` naming :meth:`unrecorded_before` (empty when there is none); for a
        reentrant checkpoint, that its segment's ops are not recorded in forward."""
        if any(other.created_in == node.id for other in self.nodes):
            return (
                ", a reentrant checkpoint: the ops of its segment run without a record in forward "
                "(with use_reentrant=False they are recorded)"
            )
        unseen = self.unrecorded_before(node)
        if not unseen:
            return ""
        names = listed([f"#{n.id} {short_name(n.name)}" for n in unseen], 8)
        return f", or in an op before it whose value is not recorded (made inside one call seen as a whole: {names})"

    @staticmethod
    def origin_kind(node: Node) -> str | None:
        """``"nan"`` or ``"inf"``: what the node sent on (or, failing that, what it holds)."""
        kinds = {s.nonfinite_kind for s in iter_stats(node.grad_inputs)}
        if "nan" in kinds:
            return "nan"
        return "inf" if "inf" in kinds else node.nonfinite_kind

    def summary(self) -> dict[str, Any]:
        """The JSON ``summary`` block, derived from the nodes."""
        return copy.deepcopy(self._summary)

    @functools.cached_property
    def _summary(self) -> dict[str, Any]:
        """:meth:`summary`, derived once (a pass over every statistic: 0.6 s on 100k nodes), read by the tree and the
        summary table alike; not to be changed."""
        executed = self.executed()
        origin = self.nonfinite_origin()
        made = self.forward_nonfinite_origin()
        nonfinite = self.nonfinite_nodes()
        if origin is not None:  # the origin first, then the others in execution order
            nonfinite = [origin] + [n for n in nonfinite if n is not origin]
        norms = [(stat.norm, node) for node, stat in self.computed_stats() if math.isfinite(stat.norm)]
        grad_norms = self.parameter_grad_norms().values()
        total = joint_norm(grad_norms) if grad_norms else None

        def brief(node: Node, **extra: Any) -> dict[str, Any]:
            return {"id": node.id, "name": node.name, "module": node.module, "param": node.param, **extra}

        largest = max(norms, key=lambda item: item[0], default=None)
        nonzero = [item for item in norms if item[0] > 0]
        smallest = min(nonzero, key=lambda item: item[0], default=None)
        return {
            "nodes": len(self.nodes),
            "executed": len(executed),
            "nonfinite_nodes": len(nonfinite),
            "first_nonfinite": brief(origin, kind=self.origin_kind(origin), source=origin.source) if origin else None,
            "first_nonfinite_forward": (
                brief(made, kind=made.forward.nonfinite_kind, source=made.source) if made is not None else None
            ),
            "nonfinite": [brief(n, kind=n.nonfinite_kind, source=n.source) for n in nonfinite],
            "param_grad_norm_total": encode_float(total),
            "largest_grad": brief(largest[1], norm=largest[0]) if largest else None,
            "smallest_nonzero_grad": brief(smallest[1], norm=smallest[0]) if smallest else None,
            "params_without_grad": list(self.params_without_grad),
        }

    def to_dict(self) -> dict[str, Any]:
        """The versioned JSON document (strict JSON once dumped)."""
        recorded = any(n.forward is not None for n in self.nodes)
        return {
            "schema": SCHEMA,
            "meta": self.meta.to_dict(),
            "nodes": [n.to_dict(recorded) for n in self.nodes],
            "param_grads": {name: None if stat is None else stat.to_dict() for name, stat in self.param_grads},
            "summary": self.summary(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trace:
        """Read a document written by :meth:`to_dict`.

        Raises:
            ValueError: the document is not a ``gradtrace/1`` trace, or its nodes are not one graph (an id
                that is not the node's position, a ``next`` naming no node).
        """
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            found = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a {SCHEMA} trace (schema: {found!r})")
        nodes = tuple(Node.from_dict(n) for n in data["nodes"])
        for position, node in enumerate(nodes):  # the graph's links: each id its position, each edge to a node
            if node.id != position or type(node.id) is not int or not all(
                child is None or (type(child) is int and 0 <= child < len(nodes)) for child in node.next
            ):
                raise ValueError(f"node {position} has id {node.id!r} and next {list(node.next)}: not a graph of {len(nodes)} nodes")
        return cls(
            meta=Meta.from_dict(data["meta"]),
            nodes=nodes,
            params_without_grad=tuple(data.get("summary", {}).get("params_without_grad", ())),
            param_grads=tuple(
                sorted(
                    (name, None if stat is None else GradStat.from_dict(stat))
                    for name, stat in data.get("param_grads", {}).items()
                )
            ),
        )

    def with_meta(self, **changes: Any) -> Trace:
        """A copy with some ``meta`` fields replaced (e.g. ``rank``)."""
        return replace(self, meta=replace(self.meta, **changes))


def _made_nonfinite(node: Node) -> bool:
    """Of a node with a non-finite gradient: whether every gradient it received was finite (so it made it)."""
    return not any(side == "out" and stat.nonfinite_kind for side, _, stat in node.stats())


def joint_norm(norms: Iterable[float]) -> float:
    """The norm of several tensors taken together from theirs, without squares that underflow or overflow
    (``math.hypot``); NaN if any is NaN."""
    norms = list(norms)
    return math.nan if any(map(math.isnan, norms)) else math.hypot(*norms)


def iter_stats(stats: Iterable[GradStat | None] | None) -> Iterator[GradStat]:
    """The non-None entries of a grad_inputs / grad_outputs tuple."""
    return (s for s in (stats or ()) if s is not None)
