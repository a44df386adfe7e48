"""Golden files for the terminal tree (fixed width, no colour) and JSON round trips.

Regenerate the golden files after an intended change of the output with
``GRADTRACE_UPDATE_GOLDEN=1 python -m pytest tests/test_render.py``.
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import pytest
import torch
from rich.console import Console

from tracer_cli import trace
from tracer_cli.records import Trace
from tracer_cli.render.json import dumps, loads
from tracer_cli.render.tree import TreeOptions, render_trace

from .reference import load_sample

GOLDEN = Path(__file__).parent / "golden"
FIXED_TIMES = {"forward": 0.001, "backward": 0.002, "total": 0.004}


def sample_trace(name: str, **kwargs) -> Trace:
    module = load_sample(name)
    torch.manual_seed(0)
    model = module.build_model() if hasattr(module, "build_model") else module.model
    torch.manual_seed(0)
    inputs = module.example_inputs()
    args, kw = ((inputs,), {}) if isinstance(inputs, torch.Tensor) else ((), inputs) if isinstance(inputs, dict) else (inputs, {})
    result = trace(model, args, kw, loss_fn=getattr(module, "loss_fn", None), target=f"sample_models/{name}.py", **{"input_grad": True, **kwargs})
    return result.with_meta(timings_s=FIXED_TIMES, torch="2.x")


def render_text(result: Trace, options: TreeOptions) -> str:
    console = Console(width=120, color_system=None, record=True, file=open(os.devnull, "w"))
    console.print(render_trace(result, options))
    return console.export_text()


@pytest.mark.parametrize(
    "name, options, golden",
    [
        ("classic_mul_div", TreeOptions(), "classic_mul_div.modules.txt"),
        ("mlp", TreeOptions(), "mlp.modules.txt"),
        ("mlp", TreeOptions(view="graph"), "mlp.graph.txt"),
        ("nan_where", TreeOptions(view="graph"), "nan_where.graph.txt"),
        ("checkpointed", TreeOptions(view="graph"), "checkpointed.graph.txt"),
        ("cnn", TreeOptions(depth=1), "cnn.depth1.txt"),
    ],
)
def test_tree_golden(name, options, golden):
    text = render_text(sample_trace(name), options)
    path = GOLDEN / golden
    if os.environ.get("GRADTRACE_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text()


@pytest.mark.parametrize("limit", [3, 10, 25])
def test_module_view_cut_short_says_what_each_module_hides(limit):
    """Once --max-nodes is spent, a module still to come is one line with the number of its nodes not
    shown (no empty headings, no expanded submodules); a module cut in the middle says how many of
    its own nodes are left. Every hidden node is counted exactly once, and the footer agrees."""
    import re

    result = sample_trace("transformer")
    text = render_text(result, TreeOptions(max_nodes=limit))
    lines = text.splitlines()
    shown = [line for line in lines if re.search(r"[├└]── #\d+ ", line)]
    assert len(shown) == limit
    hidden = [int(n) for n in re.findall(r"(\d+) (?:more )?nodes? not shown", text)]
    (footer,) = [int(n) for n in re.findall(r"… (\d+) more node lines not shown", text)]
    assert footer == len(result.nodes) - limit
    assert sum(hidden) == footer
    # the nodes the summary names are drawn (their lines were set aside); after the last line of any other
    # node, every module heading carries its count, but those of the modules the named nodes are in
    summary = result.summary()
    named = {summary["largest_grad"]["id"], summary["smallest_nonzero_grad"]["id"]}
    drawn = [int(re.search(r"#(\d+) ", line).group(1)) for line in shown]
    assert named <= set(drawn)
    last_other = max(i for i, line in enumerate(lines) if line in shown and drawn[shown.index(line)] not in named)
    after = lines[last_other + 1 :]
    around = {
        part
        for node_id in named
        for module in [result.nodes[node_id].module]
        for part in (module.split(".") if module else [])
    }
    headings = [line for line in after if re.search(r"[├└]── \S+ \(", line)]
    assert headings and all("not shown" in line or line.split("── ")[1].split(" ")[0] in around for line in headings)
    tree_end = next(i for i, line in enumerate(after) if line.startswith("…"))
    entries = [line for line in after[:tree_end] if "── " in line]
    assert all("not shown" in line or line in headings or line in shown for line in entries)


def _residual_stack(blocks: int) -> Trace:
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(8)
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return x + self.fc(self.norm(x))

    torch.manual_seed(0)
    return trace(torch.nn.Sequential(*[Block() for _ in range(blocks)]), torch.randn(2, 8))


@pytest.mark.parametrize("blocks", [2, 12])
def test_graph_view_keeps_a_residual_stream_on_one_level(blocks):
    """Each residual add is reached from the add after it and from the block between: it is shown after
    its block, at the stream's level, so depth does not grow with the number of blocks. Every node is
    shown exactly once; every other arrival at it is a reference."""
    import re

    result = _residual_stack(blocks)
    text = render_text(result, TreeOptions(view="graph", max_nodes=None))
    lines = [line for line in text.splitlines() if re.search(r"[├└]── ", line)]
    shown = [int(m.group(1)) for line in lines if (m := re.search(r"[├└]── #(\d+) ", line))]
    assert sorted(shown) == list(range(len(result.nodes)))
    depth = max(len(re.match(r"^[ │├└─]*", line).group(0)) // 4 for line in lines)
    assert depth == _graph_depth(_residual_stack(2))
    adds = [line for line in lines if re.search(r"[├└]── #\d+ AddBackward0 ", line)]
    assert len(adds) == blocks and len({line.index("#") for line in adds}) == 1  # the stream: one column
    below = {int(n) for n in re.findall(r"↓ #(\d+) \S+ \(shown below\)", text)}
    assert below and below <= set(shown)


def _post_norm_stack(blocks: int) -> Trace:
    """Blocks that norm after the residual add (post-LN, as BERT's): the stream passes a LayerNorm, whose weight
    and bias leaves end there."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.norm = torch.nn.LayerNorm(8)

        def forward(self, x):
            return self.norm(x + self.fc(x))

    torch.manual_seed(0)
    return trace(torch.nn.Sequential(*[Block() for _ in range(blocks)]), torch.randn(2, 8))


@pytest.mark.parametrize("blocks", [2, 12])
def test_graph_view_keeps_a_stream_through_layer_norms_on_one_level(blocks):
    """A LayerNorm on the stream sends on the stream's gradient and two to its leaves: the leaves are lines of
    the chain, which goes on at its level (each post-LN block indented the rest once more: 12 BERT layers
    took 28 levels)."""
    import re

    result = _post_norm_stack(blocks)
    text = render_text(result, TreeOptions(view="graph", max_nodes=None))
    lines = [line for line in text.splitlines() if re.search(r"[├└]── ", line)]
    shown = [int(m.group(1)) for line in lines if (m := re.search(r"[├└]── #(\d+) ", line))]
    assert sorted(shown) == list(range(len(result.nodes)))  # every node once
    norms = [line for line in lines if re.search(r"[├└]── #\d+ NativeLayerNormBackward0 ", line)]
    assert len(norms) == blocks and len({line.index("#") for line in norms}) == 1  # the stream: one column
    assert _graph_depth(result) == _graph_depth(_post_norm_stack(2))


def test_graph_view_depth_keeps_the_residual_stream():
    """--depth cuts inside the blocks; the stream's adds, drawn at the top level, are all still shown."""
    import re

    result = _residual_stack(4)
    text = render_text(result, TreeOptions(view="graph", max_nodes=None, depth=1))
    assert len(re.findall(r"[├└]── #\d+ AddBackward0 ", text)) == 4
    assert "nodes below" in text


def test_graph_view_depth_counts_in_words():
    result = trace(lambda x, y: (x * y).sum(), (torch.randn(3), torch.randn(3)))
    text = render_text(result, TreeOptions(view="graph", max_nodes=None, depth=0))
    assert text.count("… 1 node below (raise --depth to see it)") == 2, text


@pytest.mark.parametrize("limit", [5, 40])
def test_graph_view_cut_short_is_bounded(limit):
    """Past --max-nodes nothing more is drawn (no placeholder line per branch); the footer counts the rest."""
    import re

    result = _residual_stack(12)
    text = render_text(result, TreeOptions(view="graph", max_nodes=limit))
    tree_lines = [line for line in text.splitlines() if re.search(r"[├└]── ", line)]
    shown = [line for line in tree_lines if re.search(r"[├└]── #\d+ ", line)]
    assert len(shown) == limit
    assert len(tree_lines) <= 2 * limit  # references included
    (footer,) = [int(n) for n in re.findall(r"… (\d+) more node lines not shown", text)]
    assert footer == len(result.nodes) - limit


def _graph_depth(result: Trace) -> int:
    import re

    text = render_text(result, TreeOptions(view="graph", max_nodes=None))
    return max(len(re.match(r"^[ │├└─]*", line).group(0)) // 4 for line in text.splitlines() if re.search(r"[├└]── ", line))


@pytest.mark.parametrize("name", ["mlp", "nan_where", "checkpointed", "custom_function", "transformer"])
def test_json_round_trip(name):
    result = sample_trace(name)
    text = dumps(result)
    json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c}"))
    again = loads(text)
    if not result.nonfinite_nodes():  # nan != nan, so compare those through to_dict only
        assert again == result
    assert again.to_dict() == result.to_dict()


def test_unknown_schema_is_refused():
    with pytest.raises(ValueError, match="gradtrace/1"):
        Trace.from_dict({"schema": "gradtrace/99", "meta": {}, "nodes": []})


def test_graph_view_refers_to_a_folded_node_as_not_shown():
    """A node behind a "… N nodes below" line, reached again from a node that is shown, is not "shown
    above": the reference says it is among the nodes left out."""
    import re

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4))
            self.v = torch.nn.Parameter(torch.randn(4))

        def forward(self, x):
            folded = (x * self.w).sin() + (x * self.v).cos()  # two levels down: folded by --depth 1
            return (folded + x * self.w).sum()  # w again, one level down

    torch.manual_seed(0)
    result = trace(Shared(), torch.randn(4))
    text = render_text(result, TreeOptions(view="graph", max_nodes=None, depth=1))
    drawn = {int(n) for n in re.findall(r"[├└]── #(\d+) ", text)}
    referred = {int(n): where for n, where in re.findall(r"↑ #(\d+) \S+ \(([^)]*)\)", text)}
    leaf_w = next(n.id for n in result.nodes if n.param == "w")
    assert leaf_w not in drawn and referred[leaf_w] == "among the nodes not shown above", text
    assert all(where == "shown above" for n, where in referred.items() if n in drawn)


@pytest.mark.parametrize("options", [TreeOptions(view="graph", max_nodes=None, depth=0)])
def test_lines_for_nodes_not_shown_say_where_the_nan_starts(options):
    """Where the origin of a NaN is behind a line for nodes not shown (--depth in the graph view), that line
    says so and counts the non-finite nodes it stands for (the module view draws it: the test below)."""
    import re

    result = sample_trace("nan_where")
    origin = result.nonfinite_origin()
    text = render_text(result, options)
    assert not re.search(rf"[├└]── #{origin.id} ", text)  # not drawn
    (line,) = [line for line in text.splitlines() if f"where it starts (#{origin.id} SqrtBackward0)" in line]
    assert re.search(r", (\d+) non-finite", line)
    counted = sum(int(n) for n in re.findall(r", (\d+) non-finite", text))
    drawn_bad = len(re.findall(r"[├└]── #\d+ .*← nan", text))
    assert counted + drawn_bad == len(result.nonfinite_nodes())


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_module_view_cut_short_still_draws_where_the_nan_starts(limit):
    """--max-nodes in the module view: the node where the NaN starts is drawn, in its module, however early the
    lines run out; the other nodes the summary names follow while lines are left; every node is drawn or counted."""
    import re

    result = sample_trace("nan_where")
    origin = result.nonfinite_origin()
    text = render_text(result, TreeOptions(max_nodes=limit))
    drawn = [int(n) for n in re.findall(r"[├└]── #(\d+) ", text)]
    assert len(drawn) == limit and drawn.count(origin.id) == 1
    assert re.search(rf"[├└]── #{origin.id} SqrtBackward0 .*← nan starts here", text)
    summary = result.summary()
    if limit >= 3:
        assert {summary["largest_grad"]["id"], summary["smallest_nonzero_grad"]["id"]} <= set(drawn)
    counted = sum(int(n) for n in re.findall(r"(\d+) (?:more )?nodes? not shown", text))
    (footer,) = [int(n) for n in re.findall(r"… (\d+) more node lines not shown", text)]
    assert counted == footer == len(result.nodes) - limit


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_module_view_with_depth_holds_back_no_line_for_a_node_it_does_not_draw(depth):
    """--depth summarises deeper modules: a node the summary names in one of them gets no line set aside, so
    --max-nodes lines all go to nodes that are drawn (two were held back for nodes never drawn)."""
    import re

    result = sample_trace("transformer")
    limit = 6
    text = render_text(result, TreeOptions(max_nodes=limit, depth=depth))
    drawn = re.findall(r"[├└]── #(\d+) ", text)
    shown_at_all = [n for n in result.nodes if n.module is None or (n.module.count(".") + 1 if n.module else 0) <= depth]
    assert len(drawn) == min(limit, len(shown_at_all)), text


def test_module_view_cut_short_still_draws_a_pinned_node():
    """A node pinned (where ranks start to differ) is drawn with its mark, however early --max-nodes cuts, and
    however many other nodes are marked (every node after it differs too: they are not drawn for that)."""
    result = sample_trace("transformer")
    last = max(result.nodes, key=lambda node: (node.module or "").count(".") * 1000 + node.id)  # deep, and late
    marks = {node.id: "≠ differs across ranks" for node in result.nodes}
    marks[last.id] = "≠ origin of the divergence"
    text = render_text(result, TreeOptions(max_nodes=2, marks=marks, pinned=(last.id,)))
    (line,) = [line for line in text.splitlines() if f"── #{last.id} " in line]
    assert "origin of the divergence" in line


def test_a_node_with_a_thousand_gradients_is_one_short_line():
    """A stack of 1,000 tensors: the first few gradients, then how many more and the largest, or how many
    are non-finite, so that a NaN among them still shows."""
    x = torch.randn(2, 4)
    for poisoned in (False, True):
        weights = torch.ones(1000, 1, 1)
        if poisoned:
            weights[700] = float("nan")  # the gradient stack sends its 701st input
        result = trace(lambda t, w=weights: (torch.stack([t * 1.0 for _ in range(1000)]) * w).sum(), x)
        console = Console(width=2000, color_system=None, record=True, file=io.StringIO())
        console.print(render_trace(result, TreeOptions(view="graph")))
        (line,) = [line for line in console.export_text().splitlines() if "StackBackward0  grad_in" in line]
        assert "… 986 more" in line and len(line) < 600, line
        assert ("(1 non-finite)" in line) == poisoned, line


def test_the_module_view_folds_siblings_past_the_node_budget_into_one_line():
    """300 sibling modules: past --max-nodes, ten of them a line each, the rest one line that counts them."""
    model = torch.nn.Sequential(*[torch.nn.Tanh() for _ in range(300)])
    result = trace(model, torch.randn(2, 2))
    text = render_text(result, TreeOptions(max_nodes=3))
    lines = text.splitlines()
    assert len(lines) < 40, text
    (folded,) = [line for line in lines if "more modules" in line]
    assert "… 289 more modules, 289 nodes not shown" in folded
    folded_modules = [m.groups() for line in lines if (m := re.search(r"── (\d+) \(Tanh\)  1 node not shown, largest grad_out ‖(\S+)‖", line))]
    assert len(folded_modules) == 10
    for index, shown in folded_modules:  # each the norm of what that module's node received
        (node,) = [n for n in result.nodes if n.module == index]
        assert shown == f"{node.grad_outputs[0].norm:.2e}"


def test_the_filter_matches_names_as_the_tree_shows_them_and_says_when_nothing_matches():
    import re

    result = trace(load_sample("mlp").build_model(), load_sample("mlp").example_inputs())
    leaves = render_text(result, TreeOptions(pattern="^AccumulateGrad$", max_nodes=None))
    assert len(re.findall(r"#\d+ AccumulateGrad", leaves)) == sum(1 for n in result.nodes if n.is_leaf) > 0
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.fc(x) * 2.0  # the multiplication is the model's own op: module "", shown as <root>

    scaled = trace(Scaled(), torch.randn(2, 3))
    root = render_text(scaled, TreeOptions(pattern="^<root>$", max_nodes=None))
    at_root = [n for n in scaled.nodes if n.module == ""]
    assert at_root and all(f"#{n.id} " in root for n in at_root)
    nothing = render_text(result, TreeOptions(pattern=r"No\dSuch Node"))  # quoted as it would be typed
    assert "no node matches --filter 'No\\dSuch Node'" in nothing and "no node matches" not in leaves


@pytest.mark.parametrize(
    "word, phrase",
    [("int", "an int"), ("NoneType", "a NoneType"), ("UserDict", "a UserDict"), ("uint8", "a uint8"), ("inf", "an inf"), ("nan", "a nan")],
)
def test_messages_take_the_article_a_word_is_read_with(word, phrase):
    from tracer_cli.records import a_or_an

    assert a_or_an(word) == phrase


def test_a_loss_whose_value_could_not_be_read_shows_as_unknown():
    """``meta.loss`` is None where its value could not be read back (a tensor subclass's): the summary says ``?``."""
    result = sample_trace("mlp")
    text = render_text(result.with_meta(loss=None), TreeOptions())
    (line,) = [line for line in text.splitlines() if line.startswith("loss")]
    assert line.split()[1] == "?"


def test_summary_is_a_fresh_copy_each_time():
    """The summary is derived once per trace (the tree and the summary table both read it); a caller that changes
    what ``summary()`` returned changes neither the next call's nor the tree's."""
    result = sample_trace("nan_where")
    before = render_text(result, TreeOptions())
    first = result.summary()
    expected = json.loads(json.dumps(first))
    first["largest_grad"]["id"] = -1
    first["nonfinite"].clear()
    assert result.summary() == expected
    assert render_text(result, TreeOptions()) == before
