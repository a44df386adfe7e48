"""Bug-locating tools: non-finite origins with source lines, gradtrace diff, --replay, --gradcheck, exports."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import textwrap
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn
from typer.testing import CliRunner

from tracer_cli import trace
from tracer_cli.checks import nonfinite_findings
from tracer_cli.cli import app
from tracer_cli.render.export import export_dot, export_svg
from tracer_cli.render.tree import render_trace

from .reference import SAMPLES_DIR, load_sample

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def code_line(sample: str, fragment: str) -> int:
    lines = (SAMPLES_DIR / f"{sample}.py").read_text().splitlines()
    return max(i + 1 for i, text in enumerate(lines) if fragment in text)  # the code, not the docstring


def sample_trace(name: str, **options):
    module = load_sample(name)
    torch.manual_seed(0)
    model = module.build_model() if hasattr(module, "build_model") else module.model
    torch.manual_seed(0)
    return trace(model, module.example_inputs(), loss_fn=getattr(module, "loss_fn", None), **options)


# Where the first non-finite gradient came from ---------------------------------------------------


def test_nan_origin_names_node_module_and_line():
    result = sample_trace("nan_where")
    first = result.summary()["first_nonfinite"]
    assert (first["name"], first["module"], first["kind"]) == ("SqrtBackward0", "", "nan")
    assert first["source"] == f"sample_models/nan_where.py:{code_line('nan_where', 'torch.sqrt(h)')}"
    listed = result.summary()["nonfinite"]
    assert listed[0]["id"] == first["id"] and len(listed) == len(result.nonfinite_nodes())


def test_the_lists_a_trace_answers_are_the_callers_own():
    """A Trace works out which nodes ran and which hold a NaN once; each call still hands out a new list, so
    a caller that changes one changes no later answer."""
    result = sample_trace("nan_where")
    ran, nonfinite = result.executed(), result.nonfinite_nodes()
    assert nonfinite and [n.id for n in nonfinite] == [n.id for n in ran if n.nonfinite_kind == "nan"]
    ran.clear()
    nonfinite.clear()
    assert len(result.executed()) == sum(n.order is not None for n in result.nodes)
    assert [n.id for n in result.nonfinite_nodes()] == [n.id for n in result.executed() if n.nonfinite_kind]


def test_masked_infinity_is_found_although_later_nodes_are_finite():
    result = sample_trace("masked_inf")
    first = result.summary()["first_nonfinite"]
    assert first["name"] == "SqrtBackward0" and first["kind"] == "inf"
    assert first["source"].endswith(f"masked_inf.py:{code_line('masked_inf', 'torch.sqrt(')}")
    # the ReLU behind it masks the infinity: what it sends on is finite, and so are the parameter gradients
    (relu,) = [n for n in result.nodes if n.name == "ReluBackward0" and first["id"] in (
        p.id for p in result.nodes if n.id in p.next)]
    assert all(s.finite for s in relu.grad_inputs if s is not None)
    assert all(stat.finite for _, stat in result.param_grads)


def test_healthy_model_has_no_origin():
    assert sample_trace("mlp").summary()["first_nonfinite"] is None
    assert sample_trace("mlp", forward_stats=True).summary()["first_nonfinite_forward"] is None


# Where forward made the NaN (the loss is NaN) -----------------------------------------------------


def test_forward_nan_origin_is_the_op_that_made_it():
    module = load_sample("nan_forward")
    torch.manual_seed(0)
    model = module.build_model()
    torch.manual_seed(0)
    x = module.example_inputs()
    with torch.no_grad():  # independently: what the log is taken of is finite, and negative in places
        scaled = model.features.scale(torch.relu(model.embed(x)))
    assert torch.isfinite(scaled).all() and (scaled < 0).any()

    result = sample_trace("nan_forward", forward_stats=True)
    assert math.isnan(result.meta.loss)
    made = result.forward_nonfinite_origin()
    assert (made.name, made.module) == ("LogBackward0", "features")
    assert made.source == f"sample_models/nan_forward.py:{code_line('nan_forward', 'torch.log(')}"
    assert result.summary()["first_nonfinite_forward"] == {
        "id": made.id, "name": "LogBackward0", "module": "features", "param": None, "kind": "nan", "source": made.source,
    }
    # every op before it made a finite value
    assert all(n.forward.finite for n in result.nodes if n.forward is not None and n.created is not None and n.created < made.created)
    (finding,) = [f for f in nonfinite_findings(result) if f.detail.startswith("the loss is nan")]
    assert finding.node == made.id and f"#{made.id} LogBackward0 in features" in finding.detail
    # without forward values it cannot be known, and the finding says how to find it
    plain = sample_trace("nan_forward")
    assert plain.forward_nonfinite_origin() is None and plain.summary()["first_nonfinite_forward"] is None
    (finding,) = [f for f in nonfinite_findings(plain) if f.detail.startswith("the loss is nan")]
    assert "forward_stats=True" in finding.detail and "--json" in finding.detail


class _Poisoned(nn.Module):
    """A NaN written in place, three ways: an index assignment, a boolean mask, a method on a view."""

    def __init__(self, how: str):
        super().__init__()
        self.up, self.down, self.how = nn.Linear(4, 8), nn.Linear(8, 2), how

    def forward(self, x):
        h = self.up(x)
        if self.how == "setitem":
            h[0, 3] = float("nan")
        elif self.how == "mask":
            h[h > 10.0 ** 6 - 1] = float("nan")  # every element of x is 1e6: all of h is above
        else:
            h[:, 1].fill_(float("nan"))
        return self.down(h)


@pytest.mark.parametrize("how", ["setitem", "mask", "view"])
def test_a_nan_written_in_place_is_placed_at_the_node_of_that_write(how):
    """h[0, 3] = nan returns None: the tensor it changed is what forward made, at the line of the write
    (not at the next op, in the next module)."""
    with torch.no_grad():
        model = _Poisoned(how)
        model.up.weight.fill_(1.0 / 4)  # x of 1e6: every element of h is 1e6 + bias
    result = trace(model, torch.full((2, 4), 1e6), forward_stats=True)
    made = result.forward_nonfinite_origin()
    assert made.module == "" and made.name in ("torch::autograd::CopySlices", "IndexPutBackward0"), made.label()
    write = {"setitem": "h[0, 3] =", "mask": "h[h >", "view": ".fill_("}[how]
    line = Path(__file__).read_text().splitlines()[int(made.source.rpartition(":")[2]) - 1]
    assert made.source.startswith("tests/test_bugtools.py:") and write in line, (made.source, line)


def test_forward_nan_origin_is_the_one_that_reaches_the_loss():
    """A NaN that torch.where masks is made first, but the loss's NaN comes from a later 0/0: that is named."""

    class MaskedThenReal(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            safe = torch.where(h > 0, torch.log(h), 0.0)  # log's NaN, masked
            return safe + (h - h) / (h - h)  # 0/0: the NaN that reaches the loss

    torch.manual_seed(0)
    model, x = MaskedThenReal(), torch.randn(3, 4)
    with torch.no_grad():  # independently: the log makes a NaN, where() masks it, the division makes one
        h = model.fc(x)
        assert torch.log(h).isnan().any() and torch.where(h > 0, torch.log(h), 0.0).isfinite().all()
    result = trace(model, (x,), forward_stats=True)
    made = result.forward_nonfinite_origin()
    assert made.name == "DivBackward0"
    logs = [n for n in result.nodes if n.name == "LogBackward0"]
    assert logs and not logs[0].forward.finite and logs[0].created < made.created  # made first, not named


def test_forward_nan_made_in_a_custom_function_names_it():
    class BadLog(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return torch.log(x)

        @staticmethod
        def backward(ctx, grad):
            return grad

    torch.manual_seed(0)
    result = trace(lambda x: BadLog.apply(x - 2.0).tanh().sum(), (torch.rand(4),), forward_stats=True)
    made = result.forward_nonfinite_origin()
    assert made.name.endswith("BadLogBackward") and not made.forward.finite


def test_forward_nan_in_a_parameter_is_named_by_the_parameter():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    with torch.no_grad():
        model[2].weight[0, 1] = float("nan")
    result = trace(model, (torch.randn(2, 4),), forward_stats=True)
    assert math.isnan(result.meta.loss)
    assert result.forward_nonfinite_origin().param == "2.weight"


def test_forward_nan_made_inside_one_call_names_the_ops_not_seen_one_by_one():
    """F.multi_head_attention_forward is one call to a TorchFunctionMode: its ops have no forward values. With a
    sequence all padding its softmax makes the NaN, which comes out at the call's output: the ops inside are named
    as where it may have been made (and a Linear's transpose, which cannot make one, is not)."""
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(8, 2, batch_first=True)
    padding = torch.tensor([[False, False, True], [True, True, True]])  # the second sequence is all padding
    x = torch.randn(2, 3, 8)
    result = trace(lambda x: attention(x, x, x, key_padding_mask=padding)[0].sum(), (x,), forward_stats=True)
    assert math.isnan(result.meta.loss)
    made = result.forward_nonfinite_origin()
    unseen = [node.name for node in result.unrecorded_before(made)]
    assert "SoftmaxBackward0" in unseen and "TBackward0" not in unseen, unseen
    assert "SoftmaxBackward0" in result.unrecorded_note(made)
    finding = nonfinite_findings(result)[0]
    assert "the loss is nan: forward made a nan first" in finding.message and "SoftmaxBackward0" in finding.message
    # where forward values tell the op itself, nothing is added
    plain = sample_trace("nan_forward", forward_stats=True)
    assert plain.unrecorded_note(plain.forward_nonfinite_origin()) == ""


def _cpu_autocast_takes(dtype: torch.dtype) -> bool:
    try:
        with torch.autocast("cpu", dtype=dtype):
            nn.functional.linear(torch.ones(1, 2), torch.ones(2, 2))
    except RuntimeError:  # torch before 2.2: CPU autocast in bfloat16 only
        return False
    return True


# (autocast dtype, the weights' value, whether their cast is named): float16 where this torch's CPU autocast has it,
# else bfloat16, whose range is float32's (a weight of 5e36 fits it, 8x8 of 1e38 has a norm past it)
_AUTOCAST_CASES = (
    [(torch.float16, 5e3, False), (torch.float16, 1e5, True)]
    if _cpu_autocast_takes(torch.float16)
    else [(torch.bfloat16, 5e36, False), (torch.bfloat16, 1e38, True)]
)


@pytest.mark.parametrize("dtype, weight, cast_named", _AUTOCAST_CASES)
def test_autocasts_of_weights_in_range_are_not_named_as_unseen_origins(dtype, weight, cast_named):
    """Under autocast a Linear's weight and bias are cast to float16 (bfloat16) inside F.linear's one call: the casts
    have no forward values of their own. A cast of values whose norm the dtype holds (8x8 of 5e3: 4e4) cannot
    have made the infinity, so it is not named beside the Linear that overflowed; one of values it cannot hold
    (1e5) may have, and is."""
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    with torch.no_grad():
        first.weight.fill_(weight)

    def model(x):
        with torch.autocast("cpu", dtype=dtype):
            return torch.softmax(second(first(x)), -1).float().sum()  # first's output overflows float16 either way

    result = trace(model, (torch.full((4, 8), 10.0),), forward_stats=True, input_grad=True)
    assert math.isnan(result.meta.loss)
    made = result.forward_nonfinite_origin()
    named = [node.name for node in result.unrecorded_before(made)]
    assert ("ToCopyBackward0" in named) == cast_named, (made, named)
    if not cast_named:
        assert (made.name, made.module) == ("AddmmBackward0", "first")


def test_run_traces_a_nan_loss_again_to_name_where_forward_made_it():
    result = invoke("run", str(SAMPLES_DIR / "nan_forward.py"))
    assert result.exit_code == 0
    line = code_line("nan_forward", "torch.log(")
    assert "tracing the step again with forward values" in result.stderr
    assert re.search(rf"the loss is nan: forward made it first at #\d+ LogBackward0 in features \(nan\), created at \S*nan_forward.py:{line}", result.stdout)
    assert f"← forward made the nan here (sample_models/nan_forward.py:{line})" in result.stdout
    assert "starts here" not in result.stdout  # backward only carries it on from the loss
    checked = invoke("check", str(SAMPLES_DIR / "nan_forward.py"))
    assert checked.exit_code == 1 and "forward made a nan first at #" in checked.stdout
    # head's weight gradient is NaN because its input is: one finding, not a second origin in backward
    assert checked.stdout.count("FAIL  nonfinite") == 1 and "backward sends it on from 1 node that uses it" in checked.stdout
    # a finite loss is traced once
    assert "tracing the step again" not in invoke("run", str(SAMPLES_DIR / "nan_where.py")).stderr


def test_a_nan_loss_that_does_not_repeat_keeps_the_first_steps_findings(tmp_path):
    """Traced again, a forward that keeps state (or draws from another generator) may not make the NaN: the
    first step's findings stand, and the note says where it was made is not known."""
    model = tmp_path / "first_call_only.py"
    model.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class FirstCallOnly(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 16)
                self.calls = 0

            def forward(self, x):
                self.calls += 1
                h = self.fc(x)
                return (torch.log(h) if self.calls == 1 else h).sum()

        model = FirstCallOnly()

        def example_inputs():
            return torch.randn(4, 8)
    """))
    result = invoke("check", str(model))
    assert result.exit_code == 1 and "the loss is nan" in result.stdout
    assert "does not repeat itself" in result.stderr


def test_extremes_leave_out_the_seed_of_backward():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    result = trace(model, (torch.randn(3, 4),), loss_fn=lambda out: out.sum() * 100.0)
    summary = result.summary()
    # the seed (1 at the loss node) is the smallest gradient, but not one the model computed: the smallest is
    # what the loss's product sends on, 100
    assert summary["smallest_nonzero_grad"]["norm"] == pytest.approx(100.0)
    assert summary["largest_grad"]["norm"] > 100.0


def test_terminal_names_the_origin_and_its_line():
    result = invoke("run", str(SAMPLES_DIR / "nan_where.py"))
    line = code_line("nan_where", "torch.sqrt(h)")
    assert "starts here" in result.stdout
    assert "it starts at #" in result.stdout and f"nan_where.py:{line}" in result.stdout


def test_no_sources_records_no_lines_and_still_finds_the_origin(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sample, path = str(SAMPLES_DIR / "nan_where.py"), tmp_path / "trace.json"

    def sources() -> list:
        return [node["source"] for node in json.loads(path.read_text())["nodes"]]

    invoke("run", sample, "--json", str(path))
    assert any(sources())
    result = invoke("run", sample, "--no-sources", "--json", str(path))
    assert "starts here" in result.stdout and "nan_where.py:" not in result.stdout
    assert not any(sources())
    assert json.loads(path.read_text())["summary"]["first_nonfinite"]["name"] == "SqrtBackward0"
    (tmp_path / "pyproject.toml").write_text("[tool.gradtrace]\nno-sources = true\n")
    invoke("run", sample, "--json", str(path))
    assert not any(sources())


def test_stack_records_every_user_frame():
    def helper(x, w):
        return (x * w).sqrt()

    w = nn.Parameter(torch.ones(3))

    def model(x):
        return helper(x, w).sum()

    result = trace(model, torch.ones(3), stacks=True)
    (sqrt,) = result.find("SqrtBackward0")
    assert [frame.rsplit(" in ", 1)[1] for frame in sqrt.stack] == ["helper", "model"]
    assert sqrt.source == sqrt.stack[0].rsplit(" in ", 1)[0]


# gradtrace diff ---------------------------------------------------------------------------------


CHANGEABLE = """
import os
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    if os.environ.get("GRADTRACE_TEST_CHANGE"):
        with torch.no_grad():
            model[2].weight.mul_(1.1)
    return model

def example_inputs():
    return torch.randn(4, 8)
"""


@pytest.fixture
def two_runs(tmp_path, monkeypatch):
    path = tmp_path / "changeable.py"
    path.write_text(textwrap.dedent(CHANGEABLE))
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    assert invoke("run", str(path), "--json", str(before)).exit_code == 0
    monkeypatch.setenv("GRADTRACE_TEST_CHANGE", "1")
    assert invoke("run", f"{path}:build_model", "--json", str(after)).exit_code == 0
    return before, after


def test_diff_of_identical_runs_exits_0(two_runs):
    before, _ = two_runs
    result = invoke("diff", str(before), str(before))
    assert result.exit_code == 0
    assert "agree" in result.stdout


def test_diff_names_the_changed_layer(two_runs, tmp_path):
    before, after = two_runs
    out = tmp_path / "diff.json"
    result = invoke("diff", str(before), str(after), "--json", str(out))
    assert result.exit_code == 1
    document = json.loads(out.read_text())
    first = document["first_divergent"]
    assert first["kind"] == "forward" and first["param"] == "2.weight" and first["module"] == "2"
    assert "2.weight" in result.stdout.splitlines()[0]
    differing = [n for n in document["nodes"] if any(n[k] not in (None, 0.0) for k in ("forward", "grad_inputs", "grad_outputs"))]
    assert len(differing) > 1  # downstream nodes differ too; the origin is still the layer
    from tracer_cli.compare import DEFAULT_ATOL

    assert (document["rtol"], document["atol"]) == (1e-5, DEFAULT_ATOL)  # the tolerances, as a merged torchrun file has them


def test_diff_says_when_other_weights_differ_too(two_runs, tmp_path):
    """One changed parameter is the origin alone; weights of another seed all differ, which is said."""
    before, after = two_runs
    assert "differ too" not in invoke("diff", str(before), str(after)).stdout
    seeds = []
    for seed in ("0", "1"):
        seeds.append(tmp_path / f"seed{seed}.json")
        assert invoke("run", str(SAMPLES_DIR / "mlp.py"), "--seed", seed, "--json", str(seeds[-1])).exit_code == 0
    result = invoke("diff", *map(str, seeds))
    assert result.exit_code == 1
    (line,) = [line for line in result.stdout.splitlines() if line.endswith("differ too")]
    origin = json.loads(seeds[0].read_text())
    params = {n["param"] for n in origin["nodes"] if n["param"] is not None}
    named = re.findall(r"[\w.:]+", line.split(" and ")[0])
    assert named and set(named) <= params and "2 more" in line  # 6 parameters and input:0, less the origin


STRUCTURES = """
import os
import torch
from torch import nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.first(x)
        if os.environ.get("GRADTRACE_TEST_EXTRA"):
            h = h.sigmoid() * 2
        return self.second(h.tanh()).sum()

def build_model():
    return Model()

def example_inputs():
    return torch.randn(3, 4)
"""


@pytest.mark.parametrize("extra_first", [False, True])
def test_diff_of_graphs_that_differ_shows_each_files_node_at_the_place_they_part(tmp_path, monkeypatch, extra_first):
    """Where the graphs differ, the same id names unrelated nodes: the origin's id is said to be of the file
    whose graph has it, and each file's node at that place in creation order is shown and written (``ids``)."""
    path = tmp_path / "model.py"
    path.write_text(STRUCTURES)
    plain, extra = tmp_path / "plain.json", tmp_path / "extra.json"
    assert invoke("run", str(path), "--json", str(plain)).exit_code == 0
    monkeypatch.setenv("GRADTRACE_TEST_EXTRA", "1")
    assert invoke("run", str(path), "--json", str(extra)).exit_code == 0
    documents = {file: json.loads(file.read_text()) for file in (plain, extra)}
    first_file, second_file = (extra, plain) if extra_first else (plain, extra)
    out = tmp_path / "diff.json"
    result = invoke("diff", str(first_file), str(second_file), "--json", str(out))
    assert result.exit_code == 1
    origin = json.loads(out.read_text())["first_divergent"]
    assert origin["kind"] == "structure" and origin["file"] == str(extra)
    assert documents[extra]["nodes"][origin["id"]]["name"] == origin["name"] in ("SigmoidBackward0", "MulBackward0")

    def created_at(document, position):  # the node at a place in creation order, independently of gradtrace's
        made = sorted((n for n in document["nodes"] if n["created"] is not None), key=lambda n: n["created"])
        return made[position]["id"]

    position = sorted(n["created"] for n in documents[extra]["nodes"] if n["created"] is not None).index(
        documents[extra]["nodes"][origin["id"]]["created"]
    )
    want = [created_at(documents[file], position) for file in (first_file, second_file)]
    assert origin["ids"] == want and want[0] != want[1]
    lines = result.stdout.splitlines()
    assert f"of {extra}" in lines[0]
    (node_line,) = [line for line in lines if line.lstrip().startswith("node:")]
    for file, node_id in zip((first_file, second_file), want):
        name = documents[file]["nodes"][node_id]["name"].removesuffix("0").removesuffix("Backward")
        assert f"{file}: #{node_id} {name}" in node_line


def test_diff_lines_are_not_folded_when_stdout_is_not_a_terminal(tmp_path, monkeypatch):
    """In a CI log the header and the table keep a long module path whole (Rich folds at 80 columns)."""
    path = tmp_path / "nested.py"
    path.write_text(textwrap.dedent("""
        import os
        import torch
        from torch import nn

        def build_model():
            inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
            model = nn.ModuleDict({"encoder_with_a_long_name": nn.ModuleDict({"attention_projection_block": inner})})
            if os.environ.get("GRADTRACE_TEST_CHANGE"):
                with torch.no_grad():
                    inner[0].weight.mul_(1.5)
            return lambda x: model["encoder_with_a_long_name"]["attention_projection_block"](x)

        def example_inputs():
            return torch.randn(3, 4)
        """))
    monkeypatch.delenv("COLUMNS", raising=False)
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    assert invoke("run", str(path), "--json", str(before)).exit_code == 0
    monkeypatch.setenv("GRADTRACE_TEST_CHANGE", "1")
    assert invoke("run", str(path), "--json", str(after)).exit_code == 0
    result = invoke("diff", str(before), str(after))
    assert result.exit_code == 1
    name = "encoder_with_a_long_name.attention_projection_block.0.weight"
    header = result.stdout.splitlines()[0]
    assert name in header and len(header) > 80, result.stdout
    assert any(name in line for line in result.stdout.splitlines()[2:]), result.stdout


def test_diff_of_incompatible_files_exits_2(tmp_path, two_runs):
    before, _ = two_runs
    other = tmp_path / "other.json"
    other.write_text('{"schema": "gradtrace/99", "nodes": []}')
    result = invoke("diff", str(before), str(other))
    assert result.exit_code == 2
    assert "gradtrace/99" in result.stderr
    not_json = tmp_path / "notes.txt"
    not_json.write_text("hello")
    assert invoke("diff", str(before), str(not_json)).exit_code == 2
    assert invoke("diff", str(before), str(tmp_path / "missing.json")).exit_code == 2
    assert invoke("diff", f"{before}#1", str(before)).exit_code == 2  # not a merged file
    # a hand-edited file whose graph links point nowhere, or are gone: no comparison of a graph that is not one
    document = json.loads(before.read_text())
    for damage in ("dangling", "missing"):
        broken = json.loads(json.dumps(document))
        node = next(n for n in broken["nodes"] if n["next"])
        if damage == "dangling":
            node["next"][0] = len(broken["nodes"]) + 5
        else:
            del node["next"]
        edited = tmp_path / f"{damage}.json"
        edited.write_text(json.dumps(broken))
        result = invoke("diff", str(before), str(edited))
        assert result.exit_code == 2 and "not a complete gradtrace trace" in result.stderr, (damage, result.stderr)


def test_diff_reads_one_rank_of_a_merged_file(tmp_path, two_runs):
    before, after = two_runs
    merged = tmp_path / "merged.json"
    merged.write_text(json.dumps({"schema": "gradtrace/1", "world_size": 2,
                                  "ranks": [json.loads(before.read_text()), json.loads(after.read_text())]}))
    assert invoke("diff", f"{merged}#0", str(before)).exit_code == 0
    assert invoke("diff", f"{merged}#1", str(before)).exit_code == 1
    assert invoke("diff", f"{merged}#2", str(before)).exit_code == 2


WRAPPABLE = """
import os
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    if os.environ.get("GRADTRACE_TEST_CHANGE"):
        with torch.no_grad():
            model[2].weight.mul_(1.1)
    if os.environ.get("GRADTRACE_TEST_WRAP"):  # as DDP wraps it (DataParallel: the same prefix, and no GPU needed)
        model = nn.DataParallel(model)
    return model

def example_inputs():
    return torch.randn(4, 8)
"""


def test_diff_lines_up_a_wrapped_model_with_the_bare_one(tmp_path, monkeypatch):
    """Under DDP (or DataParallel, torch.compile, FSDP) every parameter name has the wrapper's prefix: the diff
    sets it aside, says so, and compares the values."""
    path = tmp_path / "wrappable.py"
    path.write_text(WRAPPABLE)
    bare, wrapped, changed = tmp_path / "bare.json", tmp_path / "wrapped.json", tmp_path / "changed.json"
    assert invoke("run", str(path), "--json", str(bare)).exit_code == 0
    monkeypatch.setenv("GRADTRACE_TEST_WRAP", "1")
    assert invoke("run", str(path), "--json", str(wrapped)).exit_code == 0
    monkeypatch.setenv("GRADTRACE_TEST_CHANGE", "1")
    assert invoke("run", str(path), "--json", str(changed)).exit_code == 0
    assert "module.2.weight" in {n["param"] for n in json.loads(wrapped.read_text())["nodes"]}
    out = tmp_path / "diff.json"
    result = invoke("diff", str(wrapped), str(bare), "--json", str(out))
    assert result.exit_code == 0, result.stdout
    assert f"prefix 'module.' of {wrapped}" in result.stdout and "agree" in result.stdout
    document = json.loads(out.read_text())
    assert document["prefix_ignored"] == {"file": str(wrapped), "prefix": "module."}
    assert document["first_divergent"] is None
    result = invoke("diff", str(bare), str(changed), "--json", str(out))
    assert result.exit_code == 1
    document = json.loads(out.read_text())
    assert document["prefix_ignored"] == {"file": str(changed), "prefix": "module."}
    first = document["first_divergent"]
    assert (first["kind"], first["param"], first["module"]) == ("forward", "2.weight", "2")
    assert "2.weight" in result.stdout.splitlines()[0]
    assert json.loads(invoke("diff", str(bare), str(bare), "--json", "-").stdout)["prefix_ignored"] is None


# --replay -------------------------------------------------------------------------------------


def test_replay_reproduces_builtin_and_correct_custom_nodes():
    result = sample_trace("custom_function", replay=True)
    replayed = [n for n in result.nodes if n.replay is not None and n.replay.reproducible is not None]
    assert {"MyLinearBackward", "SumBackward0"} <= {n.name for n in replayed} | {"SumBackward0"}
    assert all(n.replay.reproducible for n in replayed), [(n.name, n.replay) for n in replayed]
    leaves = [n for n in result.nodes if n.is_leaf]
    assert all(n.replay.reproducible is None and "not replayed" in n.replay.note for n in leaves)


def test_replay_of_a_node_with_an_empty_gradient():
    """A cat with a zero-element input (Hugging Face's DynamicCache on its first step) sends an empty
    gradient: nothing to differ there, the node is reproducible."""

    class Cache(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = self.fc(x)
            return torch.cat([h.new_zeros(0, 8) * h.sum(), h], 0)

    torch.manual_seed(0)
    (cat,) = trace(Cache(), torch.randn(4, 8), replay=True).find("CatBackward0")
    assert [s.shape for s in cat.grad_inputs] == [(0, 8), (4, 8)]
    assert cat.replay.reproducible is True, cat.replay


class _TwoOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2, x[:2] * 3

    @staticmethod
    def backward(ctx, first, second):  # written for materialized gradients: `second` is never None
        grad = first * 2
        grad[:2] += second * 3
        return grad


def test_replay_hands_a_custom_backward_zeros_for_an_unused_output_as_the_engine_does():
    result = trace(lambda x: _TwoOutputs.apply(x)[0].sum(), torch.randn(5), replay=True)
    (node,) = result.find("_TwoOutputsBackward")
    assert node.grad_outputs[1] is None  # what the engine's hooks see; the backward itself got zeros
    assert node.replay.reproducible is True, node.replay


def test_replay_of_a_node_that_makes_the_same_nan_again_is_reproducible():
    """sqrt's backward at 0 gives inf, and where() turns the unused branch's inf * 0 into NaN: the same each time."""
    x = torch.tensor([0.0, 1.0, 4.0, 0.0])
    result = trace(lambda x: torch.where(x > 0, x.sqrt(), torch.zeros_like(x)).sum(), x, replay=True)
    (sqrt,) = result.find("SqrtBackward0")
    assert sqrt.nonfinite_kind == "nan"
    judged = [n for n in result.nodes if n.replay is not None and n.replay.reproducible is not None]
    assert sqrt in judged and all(n.replay.reproducible for n in judged), [(n.name, n.replay) for n in judged]


class _Hooked(nn.Module):
    """Three ways a user's hook changes what a node sends on: a node post hook, a module's full backward
    hook, and one that only looks."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.inner = nn.Linear(8, 8)
        self.inner.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 3,))
        self.seen = []

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        h.grad_fn.register_hook(lambda grad_inputs, grad_outputs: (grad_inputs[0] * 0.1,))
        g = torch.sigmoid(self.inner(h))
        g.grad_fn.register_hook(lambda grad_inputs, grad_outputs: self.seen.append(len(grad_inputs)))
        return g


def test_replay_gives_no_verdict_where_a_users_hook_changes_the_gradients():
    torch.manual_seed(0)
    model = _Hooked()
    result = trace(model, torch.randn(4, 8), replay=True)
    (tanh,) = result.find("TanhBackward0")
    assert tanh.replay.reproducible is None and tanh.replay.relative > 1 and "hooks of your own" in tanh.replay.note
    hooked = [n for n in result.find("BackwardHookFunctionBackward") if n.replay.reproducible is not True]
    assert hooked and all(n.replay.reproducible is None for n in hooked)
    (sigmoid,) = result.find("SigmoidBackward0")  # its hook only looks: replayed and judged
    assert sigmoid.replay.reproducible is True and model.seen
    assert not [n for n in result.nodes if n.replay and n.replay.reproducible is False]


class _OffloadOnce(torch.autograd.graph.saved_tensors_hooks):
    """Activation offloading as torchtune's: each saved tensor stashed when packed, released when unpacked (once
    per saved tensor, as the engine unpacks it)."""

    def __init__(self):
        self.stash = {}

        def pack(tensor):
            key = len(self.stash) + 1000 * id(self)
            self.stash[key] = tensor.detach().clone()
            return key

        def unpack(key):
            return self.stash.pop(key)  # freed once backward has used it

        super().__init__(pack, unpack)


def test_replay_gives_no_verdict_where_the_users_saved_tensor_hooks_refuse_a_second_unpack():
    """A built-in node whose saved tensors a hook of the user's released once unpacked cannot run again: no
    verdict (not a finding of hidden state), and the rest is judged as usual."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 1)

        def forward(self, x):
            with _OffloadOnce():
                h = torch.tanh(self.fc1(x))
            return self.fc2(h.sigmoid())

    torch.manual_seed(0)
    result = trace(Net(), torch.randn(4, 8), replay=True)
    (tanh,) = result.find("TanhBackward0")
    assert tanh.replay.reproducible is None and "saved-tensor hook" in tanh.replay.note, tanh.replay
    assert not [n for n in result.nodes if n.replay and n.replay.reproducible is False]
    (sigmoid,) = result.find("SigmoidBackward0")  # saved outside the hooks: replayed and judged
    assert sigmoid.replay.reproducible is True


def test_replay_flags_a_stateful_backward():
    result = sample_trace("stateful_backward", replay=True)
    (node,) = result.find("DecayingGradBackward")
    assert node.replay.reproducible is False and node.replay.relative == pytest.approx(0.5)
    others = [n for n in result.nodes if n.replay and n.replay.reproducible is not None and n is not node]
    assert others and all(n.replay.reproducible for n in others)


def test_replay_gives_no_verdict_inside_a_non_reentrant_checkpoint():
    """A non-reentrant checkpoint recomputes its nodes' saved tensors once per backward and refuses to hand them
    out again: torch refusing a second run is no sign of a nondeterministic backward (it failed every such node)."""
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.ff, self.out = nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 1)

        def forward(self, x):
            return self.out(checkpoint(self.ff, x, use_reentrant=False))

    torch.manual_seed(0)
    result = trace(Checkpointed(), torch.randn(4, 8), replay=True)
    # the nodes that saved tensors inside it (TBackward0 saves none: it runs again)
    inside = [n for n in result.nodes if n.module in ("ff.0", "ff.1") and n.name in ("AddmmBackward0", "TanhBackward0")]
    assert len(inside) == 2 and all(n.replay.reproducible is None and "checkpoint" in n.replay.note for n in inside), inside
    outside = [n for n in result.nodes if n.module == "out" and n.replay is not None and n.replay.reproducible is not None]
    assert outside and all(n.replay.reproducible for n in outside)
    assert not [n for n in result.nodes if n.replay and n.replay.reproducible is False]


class _DoublesInPlace(torch.autograd.Function):
    """Identity forward; a backward that doubles the gradient it receives in place and returns that tensor."""

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return grad.mul_(2)


class _DoublesThroughData(torch.autograd.Function):
    """The same through ``.data``, which the version counter does not see."""

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        grad.data.mul_(2)
        return grad


@pytest.mark.parametrize("function, rows", [(_DoublesInPlace, 4), (_DoublesInPlace, 4096), (_DoublesThroughData, 4)])
@pytest.mark.parametrize("replay", [False, True])
def test_a_backward_that_changes_its_incoming_gradient_in_place(replay, function, rows):
    """A custom backward that doubles what it receives in place: the node shows what it received (the norm the node
    before it sent, not the doubled one), and ``--replay`` neither runs it on the doubled tensor (which the engine
    passes on: every gradient below was doubled again) nor calls it reproducible."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

        def forward(self, x):
            return self.b(function.apply(self.a(x))).pow(2).mean()

    torch.manual_seed(0)
    model, x = Net(), torch.randn(rows, 8)
    identity = copy.deepcopy(model)
    output = identity.a(x) * 1
    output.retain_grad()  # what the Function's node receives: the gradient of its output, in a copy without it
    identity.b(output).pow(2).mean().backward()
    received = output.grad.norm().item()
    plain = copy.deepcopy(model)
    plain(x).backward()  # the parameters' gradients, the Function's doubling included
    result = trace(model, x, replay=replay)
    (node,) = result.find(f"{function.__name__}Backward")
    assert node.grad_outputs[0].norm == pytest.approx(received, rel=1e-5)
    assert node.grad_inputs[0].norm == pytest.approx(2 * received, rel=1e-5)
    for name, parameter in plain.named_parameters():
        assert dict(result.param_grads)[name].norm == pytest.approx(parameter.grad.norm().item(), rel=1e-5), name
    if replay:
        assert node.replay.reproducible is None and "changed the gradients it received in place" in node.replay.note


class _BackwardRunsAutograd(torch.autograd.Function):
    """``sin`` forward; a backward that builds a graph of its own, a custom Function in it, and runs it with
    ``autograd.grad(create_graph=True)``: the gradient of ``sin(u) * u`` along the incoming gradient."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            u = x.detach().requires_grad_()
            (gu,) = torch.autograd.grad(_DoublesInPlace.apply(u).sin() * u, u, grad_outputs=grad, create_graph=True)
        return gu.detach()


@pytest.mark.parametrize("replay", [False, True])
def test_a_custom_backward_that_runs_autograd_on_a_function_of_its_own_is_traced(replay):
    """The nodes such a backward makes are traced where it runs them (a custom Function among them, which changes
    what it receives in place); run again by --replay, what it makes then is not this backward's (finish() failed
    with a KeyError on a node the replay made)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return _BackwardRunsAutograd.apply(self.fc(x)).pow(2).sum()

    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 4)
    plain = copy.deepcopy(model)
    plain(x).backward()
    result = trace(model, x, replay=replay)
    assert dict(result.param_grads)["fc.weight"].norm == pytest.approx(plain.fc.weight.grad.norm().item(), rel=1e-5)
    (doubles,) = result.find("_DoublesInPlaceBackward")
    assert doubles.grad_inputs[0].norm == pytest.approx(2 * doubles.grad_outputs[0].norm, rel=1e-6)


class _RunsThroughItself(torch.autograd.Function):
    """A backward that first runs a backward through its own node again (``autograd.grad`` of a second use of its
    output), then doubles what it received in place."""

    @staticmethod
    def forward(ctx, x):
        ctx.depth = 0
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        ctx.depth += 1
        if ctx.depth == 1:
            with torch.enable_grad():
                torch.autograd.grad(_RunsThroughItself.second_use, _RunsThroughItself.source, retain_graph=True)
            grad.mul_(2)
        return grad


def test_a_custom_node_run_again_inside_its_own_backward_shows_what_each_run_received():
    """Each run of the node shows what arrived at it, the outer one too (the inner run's record took its place)."""
    torch.manual_seed(0)
    layer, x = nn.Linear(8, 8), torch.randn(4, 8)

    def model(x):
        h = layer(x)
        y = _RunsThroughItself.apply(h)
        _RunsThroughItself.second_use, _RunsThroughItself.source = (y * 3).sum(), h
        return y.pow(2).mean()

    result = trace(model, (x,))
    (node,) = result.find("_RunsThroughItselfBackward")
    inner, outer = node.calls
    assert inner.grad_outputs[0].norm == pytest.approx(3 * math.sqrt(32), rel=1e-6)  # d(3 y.sum())/dy
    h = layer(x).detach()
    arrived = (2 * h / h.numel()).norm().item()  # d(mean(y^2))/dy
    assert outer.grad_outputs[0].norm == pytest.approx(arrived, rel=1e-5)
    assert outer.grad_inputs[0].norm == pytest.approx(2 * arrived, rel=1e-5)


def test_replay_leaves_gradients_unchanged():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    x = torch.randn(3, 4)
    with_replay = trace(model, x, replay=True)
    without = trace(model, x)
    # with --replay every norm is taken at once; without, small gradients are normed in batches
    # (the same sums in another order: float32 rounding apart)
    for replayed, plain in zip(with_replay.nodes, without.nodes):
        assert [(s.shape, s.dtype) for s in replayed.grad_outputs] == [(s.shape, s.dtype) for s in plain.grad_outputs]
        assert [s.norm for s in replayed.grad_outputs] == pytest.approx([s.norm for s in plain.grad_outputs], rel=1e-6)


# --gradcheck ----------------------------------------------------------------------------------


def test_gradcheck_passes_correct_functions_with_non_tensor_arguments():
    result = sample_trace("custom_function", gradcheck=True)
    nodes = result.find("MyLinearBackward")
    assert nodes and all(n.gradcheck.passed is True and n.gradcheck.mismatch < 1e-6 for n in nodes)


def test_gradcheck_fails_a_backward_that_forgets_a_term():
    result = sample_trace("wrong_backward", gradcheck=True)
    (node,) = result.find("SoftClipBackward")
    assert node.gradcheck.passed is False and node.gradcheck.mismatch > 1e-3
    assert node.module == ""


class _ScaledBy(torch.autograd.Function):
    """``x * w``, its backward scaling the gradients of the arguments named in ``wrong`` by 1.5, in the style of
    Function whose forward takes no ``ctx`` (``setup_context``)."""

    wrong: tuple[str, ...] = ()

    @staticmethod
    def forward(x, w):
        return x * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @classmethod
    def backward(cls, ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w * (1.5 if "x" in cls.wrong else 1.0), (grad * x).sum(0) * (1.5 if "w" in cls.wrong else 1.0)


@pytest.mark.parametrize("wrong", [("x",), ("w",), ("x", "w"), ()])
@pytest.mark.parametrize("inside", [torch.float64, torch.float32])
def test_gradcheck_names_the_argument_whose_gradient_is_wrong(wrong, inside):
    """Of a Function of two tensors, the failing check names the arguments (by forward's signature) whose gradients
    disagree, each checked alone; float32 inside too."""
    name = f"Scaled{''.join(wrong)}{str(inside)[-2:]}"
    function = type(name, (_ScaledBy,), {"wrong": wrong})
    if inside is torch.float32:
        function.forward = staticmethod(lambda x, w: (x.float() * w.float()).to(x.dtype))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16))

        def forward(self, x):
            return function.apply(x, self.w).pow(2).sum()

    torch.manual_seed(0)
    result = trace(Net(), torch.randn(8, 16), input_grad=True, gradcheck=True)
    (node,) = result.find(f"{name}Backward")
    check = node.gradcheck
    assert check.passed is (not wrong) and check.inputs == wrong, check
    from tracer_cli.checks import gradcheck_findings
    from tracer_cli.records import Gradcheck

    assert Gradcheck.from_dict(check.to_dict()) == check
    details = [finding.detail for finding in gradcheck_findings(result)]
    assert len(details) == bool(wrong) and all(d.endswith(f"); wrong: the gradient for {', '.join(wrong)}") for d in details), details


def test_gradcheck_names_arguments_whatever_forward_calls_its_context():
    """``forward(self, x, w)`` (a context not named ``ctx``) and ``forward(ctx, scale, *ts)``: the arguments of
    ``apply()`` are named as forward's signature has them (the first was taken for ``x``)."""

    class NamedSelf(torch.autograd.Function):
        @staticmethod
        def forward(self, x, w):  # noqa: PLW0211 - the context, named as some code names it
            self.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(self, grad):  # noqa: PLW0211
            x, w = self.saved_tensors
            return grad * w, (grad * x).sum(0) * 1.5  # wrong for w

    class Starred(torch.autograd.Function):
        @staticmethod
        def forward(ctx, scale, *ts):
            ctx.save_for_backward(*ts)
            ctx.scale = scale
            return ts[0] * ts[1] * scale

        @staticmethod
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            return None, grad * w * ctx.scale, (grad * x).sum(0) * ctx.scale * 1.5  # wrong for the second

    w = nn.Parameter(torch.randn(16))
    torch.manual_seed(0)
    for function, call, name in ((NamedSelf, lambda x: NamedSelf.apply(x, w), "w"), (Starred, lambda x: Starred.apply(2.0, x, w), "ts[1]")):
        result = trace(lambda x, call=call: call(x).pow(2).sum(), (torch.randn(8, 16),), input_grad=True, gradcheck=True)
        (node,) = result.find(f"{function.__name__}Backward")
        assert node.gradcheck.passed is False and node.gradcheck.inputs == (name,), node.gradcheck


def _elementwise_function(name: str, forward, derivative) -> type:
    """A custom Function ``forward(x)`` whose backward multiplies by ``derivative(x)``."""

    def forward_(ctx, x):
        ctx.save_for_backward(x)
        return forward(x)

    def backward_(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * derivative(x)

    methods = {"forward": staticmethod(forward_), "backward": staticmethod(backward_)}
    return type(name, (torch.autograd.Function,), methods)


def _gradcheck_of(function: type, x: torch.Tensor):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(x.shape[-1]))

        def forward(self, x):
            return function.apply(x * self.scale)

    (node,) = trace(Net(), x, gradcheck=True).find(f"{function.__name__}Backward")
    return node.gradcheck


def test_gradcheck_fails_a_backward_a_few_percent_off_on_a_large_tensor():
    """tanh with ``1 - tanh(x)`` for ``1 - tanh(x)**2``: on small inputs that is a few percent off. On
    4,352 elements PyTorch's fast gradcheck passes it (its tolerance grows with the size); the
    directional comparison does not."""
    torch.manual_seed(0)
    x = 0.05 * torch.randn(2, 34, 64)
    wrong = _elementwise_function("AlmostTanh", torch.tanh, lambda x: 1 - torch.tanh(x))
    check = _gradcheck_of(wrong, x)
    assert check.passed is False and check.mismatch > 1e-2
    right = _elementwise_function("RightTanh", torch.tanh, lambda x: 1 - torch.tanh(x) ** 2)
    check = _gradcheck_of(right, x)
    assert check.passed is True and check.mismatch < 1e-6


@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0])
def test_gradcheck_passes_correct_functions_small_and_saturated(scale):
    """Tiny inputs, and saturated ones whose derivative is tiny beside the values (rounding matters)."""
    torch.manual_seed(0)
    x = scale * torch.randn(64, 128)
    sigmoid = _elementwise_function("Sig", torch.sigmoid, lambda x: torch.sigmoid(x) * (1 - torch.sigmoid(x)))
    softplus = _elementwise_function("Softplus", nn.functional.softplus, torch.sigmoid)
    for function in (sigmoid, softplus):
        check = _gradcheck_of(function, x)
        assert check.passed is True, (function.__name__, check)


def _computing_in(dtype: torch.dtype, name: str, forward, derivative) -> type:
    """An elementwise custom Function that casts its input down to ``dtype`` and computes there, as mixed-precision
    code does, its backward multiplying by ``derivative``."""
    return _elementwise_function(
        name, lambda x: forward(x.to(dtype)).to(x.dtype), lambda x: derivative(x.to(dtype)).to(x.dtype)
    )


@pytest.mark.parametrize("size", [(32, 64), (4, 16, 128)])
def test_gradcheck_judges_a_function_that_computes_in_float32_inside(size):
    """A Function computing in float32 (its float64 inputs cast down) rounds a float64 check's steps away: it
    is checked at float32's precision, right ones passing and wrong ones failing (it read as a kink before:
    no verdict, so a backward off by 2x passed under check)."""
    torch.manual_seed(0)
    x = torch.randn(*size)
    softplus = nn.functional.softplus
    for factor, verdict in ((1.0, True), (2.0, False), (1.1, False)):
        function = _computing_in(torch.float32, f"Softplus32x{factor}", softplus, lambda x, f=factor: torch.sigmoid(x) * f)
        check = _gradcheck_of(function, x)
        assert check.passed is verdict, (factor, check)
    tanh = _computing_in(torch.float32, "Tanh32", torch.tanh, lambda x: 1 - torch.tanh(x) ** 2)
    assert _gradcheck_of(tanh, x).passed is True
    # small inputs (a weight's, a scale's), sharp curvature, a fast sine at large inputs: right ones pass
    reciprocal = _computing_in(torch.float32, "Recip32", torch.reciprocal, lambda x: -1 / (x * x))
    assert _gradcheck_of(reciprocal, 0.01 + 0.01 * torch.rand(*size)).passed is True
    sine = _computing_in(torch.float32, "Sin32", lambda x: torch.sin(10 * x), lambda x: 10 * torch.cos(10 * x))
    assert _gradcheck_of(sine, 3 * x).passed is True
    for scale in (3.0, 30.0):  # saturated: a derivative float32's rounding may hide (no verdict), never a failure
        saturated = _gradcheck_of(tanh, scale * x)
        assert saturated.passed is not False, (scale, saturated)
        assert saturated.passed is True or "rounding hides the derivative" in saturated.error


def test_gradcheck_gives_no_verdict_on_a_function_that_computes_in_16_bits():
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    for dtype in (torch.bfloat16, torch.float16):
        function = _computing_in(dtype, "Softplus16", nn.functional.softplus, lambda x: 2 * torch.sigmoid(x))
        check = _gradcheck_of(function, x)
        assert check.passed is None and f"computes in {str(dtype)[6:]} inside" in check.error


def test_gradcheck_of_a_rounding_or_constant_function_is_not_taken_for_low_precision():
    """Outputs on a coarse grid (whole numbers, a fake quantizer's sixteenths) or constant are exactly float32's
    (bf16's) values too: not a sign of a narrow computation. A straight-through estimator (round forward,
    identity backward) is checked as before, and its backward, which is not round's derivative, fails."""
    from tracer_cli.gradcheck import _inner_dtype

    torch.manual_seed(0)
    x = 5 * torch.randn(32, 64)
    for name, quantize in (("StraightThrough", torch.round), ("FakeQuant", lambda x: torch.round(x * 16) / 16)):
        straight_through = _elementwise_function(name, quantize, torch.ones_like)
        check = _gradcheck_of(straight_through, x)
        assert check.passed is False and "computes in" not in (check.error or ""), (name, check)
    wide = x.double().requires_grad_()
    assert _inner_dtype(lambda t: (torch.full_like(t, 0.5),), [wide]) is torch.float64
    assert _inner_dtype(lambda t: (t.float().exp().double(),), [wide]) is torch.float32


def test_gradcheck_gives_no_verdict_at_a_kink():
    """A correct ReLU called on exact zeros has no derivative there: neither pass nor fail."""
    torch.manual_seed(0)
    x = torch.relu(torch.randn(16, 32))  # half the inputs are exactly 0
    relu = _elementwise_function("MyRelu", torch.relu, lambda x: (x > 0).to(x.dtype))
    check = _gradcheck_of(relu, x)
    assert check.passed is None and "not differentiable" in check.error
    check = _gradcheck_of(relu, x + 0.5)  # away from the kink it is checked
    assert check.passed is True


def test_gradcheck_checks_a_smooth_function_where_its_derivative_vanishes():
    """``x * x`` at exact zeros: the forward and backward differences disagree there too (by the
    curvature), but that is no kink: a verdict all the same, right or wrong."""
    x = torch.zeros(16, 32)
    square = _elementwise_function("MySquare", torch.square, lambda x: 2 * x)
    check = _gradcheck_of(square, x)
    assert check.passed is True and check.error is None
    wrong = _elementwise_function("WrongSquare", torch.square, lambda x: 2 * x + 1)  # 1 where 0 is right
    check = _gradcheck_of(wrong, x)
    assert check.passed is False and check.error is None


def test_gradcheck_quotes_an_error_of_the_function_in_one_printable_line():
    """A Function that refuses float64 with a bare ``assert`` (no message), or with a message holding
    a terminal escape code: no verdict, and the note says why without breaking."""

    def only_float32(x):
        if x.dtype != torch.float32:
            raise AssertionError  # as a bare assert outside pytest's rewriting
        return x * 2

    def loud(x):
        if x.dtype != torch.float32:
            raise TypeError("\x1b[31mfloat32 only\x1b[0m\nsecond line")
        return x * 2

    x = torch.randn(4, 8)
    check = _gradcheck_of(_elementwise_function("Float32Only", only_float32, lambda x: 2 + 0 * x), x)
    assert check.passed is None and check.error == "AssertionError"
    check = _gradcheck_of(_elementwise_function("Loud", loud, lambda x: 2 + 0 * x), x)
    assert check.passed is None and check.error == "TypeError: \\x1b[31mfloat32 only\\x1b[0m"


class _ScaleWithMask(torch.autograd.Function):
    """``(x * k, x > 0)``, the mask marked non-differentiable; the backward is ``wrong`` times too large."""

    @staticmethod
    def forward(ctx, x, k, wrong):
        ctx.k, ctx.wrong = k, wrong
        mask = x > 0
        ctx.mark_non_differentiable(mask)
        return x * k, mask

    @staticmethod
    def backward(ctx, grad, _):
        return grad * ctx.k * ctx.wrong, None, None


class _ComplexScale(torch.autograd.Function):
    """``z * w`` for complex tensors; ``conj=False`` forgets the conjugates PyTorch's convention needs."""

    @staticmethod
    def forward(ctx, z, w, conj):
        ctx.save_for_backward(z, w)
        ctx.conj = conj
        return z * w

    @staticmethod
    def backward(ctx, grad):
        z, w = ctx.saved_tensors
        if ctx.conj:
            z, w = z.conj(), w.conj()
        return grad * w, grad * z, None


def test_gradcheck_leaves_out_a_bool_output_and_checks_the_rest():
    """PyTorch's gradcheck fails on the differences of a bool output: it is left out, not a reason to skip."""

    def verdict(wrong: float):
        def model(x):
            y, mask = _ScaleWithMask.apply(x, 3.0, wrong)
            return y * mask

        (node,) = trace(model, torch.randn(4, 5), gradcheck=True).find("_ScaleWithMaskBackward")
        return node.gradcheck

    assert verdict(1.1).passed is False and verdict(1.1).error is None
    assert verdict(1.0).passed is True


def test_gradcheck_checks_complex_functions():
    def verdict(conj: bool):
        w = torch.randn(5, dtype=torch.complex64, requires_grad=True)
        result = trace(lambda z: torch.view_as_real(_ComplexScale.apply(z, w, conj)).pow(2).sum(),
                       torch.randn(3, 5, dtype=torch.complex64), gradcheck=True)
        (node,) = result.find("_ComplexScaleBackward")
        return node.gradcheck

    wrong, right = verdict(False), verdict(True)
    assert wrong.passed is False and wrong.error is None and wrong.mismatch > 1e-3
    assert right.passed is True and right.mismatch < 1e-6
    # the reference: PyTorch's own gradcheck on the same Function, in complex128
    z = torch.randn(3, 5, dtype=torch.complex128, requires_grad=True)
    w = torch.randn(5, dtype=torch.complex128, requires_grad=True)
    for conj, expected in ((False, False), (True, True)):
        assert torch.autograd.gradcheck(lambda a, b, c=conj: _ComplexScale.apply(a, b, c), (z, w), raise_exception=False) is expected


def test_a_function_that_could_not_be_gradchecked_is_counted_and_fails_nothing(tmp_path):
    path = tmp_path / "float32_only.py"
    path.write_text(textwrap.dedent('''
        import torch
        from torch import nn

        class Float32Only(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                if x.dtype != torch.float32:
                    raise RuntimeError("no float64 kernel")
                return x * 2

            @staticmethod
            def backward(ctx, grad):
                return grad * 2

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(3, 3)

            def forward(self, x):
                return Float32Only.apply(self.fc(x))

        def build_model():
            return Net()

        def example_inputs():
            return torch.randn(2, 3)
    '''))
    ran = invoke("run", str(path), "--gradcheck")
    assert ran.exit_code == 0
    assert "gradcheck not run: RuntimeError: no float64 kernel" in ran.stdout
    assert re.search(r"0 custom Functions checked, 0 failed; 1 not checked \(#\d+ Float32OnlyBackward", ran.stdout)
    checked = invoke("check", str(path), "--gradcheck")
    assert checked.exit_code == 0
    assert "1 custom Function not gradchecked" in checked.stdout


class _NanBack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class _Segment(nn.Module):
    def __init__(self, last):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.last = last

    def forward(self, x):
        return self.last(torch.tanh(self.fc(x)))


class _Checkpointed(nn.Module):
    def __init__(self, last):
        super().__init__()
        self.pre, self.segment, self.head = nn.Linear(4, 4), _Segment(last), nn.Linear(4, 1)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.segment, self.pre(x), use_reentrant=True))


def test_a_custom_function_made_again_in_a_reentrant_checkpoint_is_traced_and_gradchecked():
    """The recompute in backward applies the Function again: its node is hooked and its backward checked,
    also as the segment's last op (whose node the checkpoint's nested backward starts from)."""
    wrong = _elementwise_function("Doubled", lambda x: 2 * x, lambda x: 3 + 0 * x)
    torch.manual_seed(0)
    model = _Checkpointed(lambda x: wrong.apply(x))
    result = trace(model, torch.randn(2, 4), gradcheck=True)
    (node,) = result.find("DoubledBackward")
    assert node.created_in is not None and node.executed and node.module == "segment"
    assert node.gradcheck.passed is False
    # what it sent: the independent computation, with a tensor hook on the Function's input
    seen = []

    def last(x):
        if x.requires_grad:  # the recompute, not the first forward (under no_grad)
            x.register_hook(lambda grad: seen.append(grad.norm().item()))
        return wrong.apply(x)

    model.segment.last = last
    x = torch.randn(2, 4, requires_grad=True)
    torch.manual_seed(0)
    model(x).sum().backward()
    assert [s.norm for s in node.grad_inputs] == pytest.approx(seen, rel=1e-5)


def test_a_custom_functions_node_made_in_backward_is_named_and_placed_after_its_graph_is_freed(monkeypatch):
    """The recompute's graph is freed before the trace ends; torch 2.1 then refuses a custom Function's node its
    name and crashes on its sequence number. As there, this Function's node answers neither once its backward
    has run: the trace still names it and puts it in the segment, as a plain backward shows the segment ran."""
    ran = []

    class Halved(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x / 2

        @staticmethod
        def backward(ctx, grad):
            ran.append(True)
            return grad / 2

    backward_type = Halved._backward_cls

    def refused(method):
        def read(node):
            if ran:
                raise RuntimeError("Attribute is invalid for this instance of _C._FunctionBase (freed)")
            return method(node)

        return read

    monkeypatch.setattr(backward_type, "_sequence_nr", refused(torch._C._FunctionBase._sequence_nr), raising=False)
    monkeypatch.setattr(backward_type, "name", refused(torch._C._FunctionBase.name), raising=False)
    torch.manual_seed(0)
    result = trace(_Checkpointed(lambda x: Halved.apply(x)), torch.randn(2, 4))
    (node,) = result.find("HalvedBackward")
    assert ran and node.created_in is not None and node.module == "segment" and node.executed


@pytest.mark.parametrize("last", ["function", "sqrt"])
def test_a_nan_made_inside_a_reentrant_checkpoint_has_one_origin(last):
    """The checkpoint's node sends on the NaN its nested backward made: the node that made it is the one
    origin, the checkpoint is not a second (its finding reaches what the checkpoint sends to)."""
    torch.manual_seed(0)
    make_nan = (lambda x: _NanBack.apply(x)) if last == "function" else (lambda x: torch.sqrt(x - x))  # sqrt'(0) = inf, times 0
    result = trace(_Checkpointed(make_nan), torch.randn(2, 4))
    (origin,) = result.nonfinite_origins()
    assert origin.name == ("_NanBackBackward" if last == "function" else "SqrtBackward0")
    assert origin.created_in is not None and result.nonfinite_origin() is origin
    (finding,) = nonfinite_findings(result)
    assert finding.node == origin.id and "pre.weight" in finding.detail


def test_a_function_applied_through_an_alias_taken_before_the_trace_is_said_not_checked():
    """``swish = Swish.apply`` at import holds the apply gradtrace cannot see: no silent pass."""
    doubled = _elementwise_function("Twice", lambda x: 2 * x, lambda x: 2 + 0 * x)
    alias = doubled.apply
    (node,) = trace(lambda x: alias(x) * 1.5, torch.randn(3), gradcheck=True).find("TwiceBackward")
    assert node.gradcheck.passed is None and "alias of .apply" in node.gradcheck.error
    (node,) = trace(lambda x: doubled.apply(x) * 1.5, torch.randn(3), gradcheck=True).find("TwiceBackward")
    assert node.gradcheck.passed is True


def test_growth_inside_a_reentrant_checkpoint_is_not_pinned_on_the_checkpoint_too():
    from tracer_cli.checks import Thresholds, norm_findings

    big = _elementwise_function("Times1e4", lambda x: x * 1e4, lambda x: 1e4 + 0 * x)
    result = trace(_Checkpointed(lambda x: big.apply(x)), torch.randn(2, 4))
    growth = [f for f in norm_findings(result, Thresholds(max_grad_norm=100.0)) if "grows past" in f.detail]
    names = [f.name for f in growth]
    assert "Times1e4Backward" in names and "CheckpointFunctionBackward" not in names


def test_check_fails_on_gradcheck_and_passes_correct_functions():
    bad = invoke("check", str(SAMPLES_DIR / "wrong_backward.py"), "--gradcheck")
    assert bad.exit_code == 1
    assert "SoftClipBackward" in bad.stdout and "gradcheck" in bad.stdout
    good = invoke("check", str(SAMPLES_DIR / "custom_function.py"), "--gradcheck")
    assert good.exit_code == 0, good.stdout
    assert invoke("check", str(SAMPLES_DIR / "wrong_backward.py")).exit_code == 0  # not asked for: not run


# Exports ------------------------------------------------------------------------------------------


def test_svg_parses_and_is_byte_stable_for_the_same_trace():
    result = sample_trace("mlp")

    def svg() -> str:
        console = Console(width=100, record=True, file=open(os.devnull, "w"), color_system="truecolor")
        console.print(render_trace(result))
        return export_svg(console)

    first = svg()
    assert first == svg()
    root = ElementTree.fromstring(first)
    assert root.tag.endswith("svg")


def test_cli_exports(tmp_path):
    paths = {kind: tmp_path / f"out.{kind}" for kind in ("svg", "html", "dot")}
    result = invoke("run", str(SAMPLES_DIR / "nan_where.py"), *[f"--{k}={p}" for k, p in paths.items()])
    assert result.exit_code == 0
    ElementTree.fromstring(paths["svg"].read_text())
    assert "<html" in paths["html"].read_text().lower() and "SqrtBackward0" in paths["html"].read_text()
    dot = paths["dot"].read_text()
    assert dot.startswith("digraph gradtrace {") and dot.rstrip().endswith("}")


def test_dot_has_one_box_per_node_and_an_edge_per_next_function():
    result = sample_trace("nan_where")
    dot = export_dot(result)
    boxes = [line for line in dot.splitlines() if re.match(r"\s*n\d+ \[", line)]
    edges = [line for line in dot.splitlines() if "->" in line]
    assert len(boxes) == len(result.nodes)
    assert len(edges) == sum(1 for n in result.nodes for c in n.next if c is not None)
    nonfinite = {n.id for n in result.nonfinite_nodes()}
    red = {int(line.split()[0][1:]) for line in boxes if "#e53935" in line}
    assert red == nonfinite
    assert dot == export_dot(result)


def test_diff_does_not_say_agree_when_parameter_gradients_differ():
    """Every node agrees, but one run's ``.grad`` differs afterwards (as where DDP failed to average it): not
    "the traces agree"."""
    from dataclasses import replace

    from tracer_cli.compare import compare
    from tracer_cli.render.diff import render_diff

    torch.manual_seed(0)
    a = trace(nn.Linear(4, 2), torch.ones(3, 4), forward_stats=True)
    scaled = tuple((name, stat._replace(norm=stat.norm * 3.0) if name == "weight" else stat) for name, stat in a.param_grads)
    b = replace(a, param_grads=scaled)
    comparison = compare([a, b])
    assert comparison["first_divergent"] is None and comparison["unsynchronized_params"] == ["weight"]
    console = Console(width=200, color_system=None)
    with console.capture() as captured:
        console.print(render_diff(a, b, comparison, ("a", "b")))
    text = captured.get()
    assert "agree" not in text and "parameter gradients that differ: weight" in text, text


def test_gradcheck_checks_a_function_that_changes_its_input_in_place():
    """mark_dirty: the check runs on copies (before, it failed on a leaf used in an in-place operation)."""

    class Triple(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.mark_dirty(x)
            return x.mul_(3)

        @staticmethod
        def backward(ctx, grad):
            return grad * 3

    class WrongTriple(Triple):
        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    for function, passed in ((Triple, True), (WrongTriple, False)):
        result = trace(lambda x, function=function: function.apply(x * 1.0).sum(), (torch.randn(4),), gradcheck=True)
        (node,) = [n for n in result.nodes if n.gradcheck is not None]
        assert node.gradcheck.error is None and node.gradcheck.passed is passed


class _InfToParameter(torch.autograd.Function):
    """``x * w``; the backward sends ``x`` its correct gradient and ``w`` an infinite one."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0) * float("inf")


class _InfToInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def test_an_origin_that_sends_a_finite_gradient_to_another_origin_does_not_hide_it():
    """Two independent origins, the first sending a finite gradient straight into the second: each is found,
    and each reaches only what its own non-finite gradient reached."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(3, 3)
            self.scale = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return _InfToParameter.apply(_InfToInput.apply(self.enc(x)), self.scale)

    result = trace(Net(), torch.randn(2, 3))
    findings = {f.name: f for f in nonfinite_findings(result)}
    assert set(findings) == {"_InfToParameterBackward", "_InfToInputBackward"}
    assert "scale" in findings["_InfToParameterBackward"].detail and "enc" not in findings["_InfToParameterBackward"].detail
    assert "enc.weight" in findings["_InfToInputBackward"].detail


def test_a_nan_through_several_reentrant_checkpoints_has_one_origin():
    """The NaN a later checkpointed block makes reaches an earlier block's recomputed graph through that
    block's checkpoint node (its nested backward): not a second place where a NaN 'arrives'."""
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(_Segment(lambda x: x) for _ in range(2))
            self.blocks[1].last = lambda x: torch.sqrt(x - x)  # sqrt'(0) = inf, times the 0 of x - x: nan
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=True)
            return self.head(x)

    torch.manual_seed(0)
    result = trace(Net(), torch.randn(2, 4), input_grad=True)
    (finding,) = nonfinite_findings(result)
    assert finding.name == "SqrtBackward0" and finding.module == "blocks.1"
    assert "blocks.0.fc.weight" in finding.detail


def test_a_nan_loss_made_from_an_infinity_names_both_where_the_infinity_and_the_nan_were_made():
    """An attention row masked entirely with -inf: the -inf may be meant; the softmax over it makes the NaN."""

    def attention(x):
        scores = x @ x.transpose(-1, -2)
        keep = torch.tensor([True, True, False])
        masked = scores.masked_fill(~(keep[:, None] & keep[None, :]), float("-inf"))
        return torch.softmax(masked, dim=-1).sum()

    result = trace(attention, torch.randn(3, 4), forward_stats=True)
    made = result.forward_nonfinite_origin()
    assert made.name == "MaskedFillBackward0" and made.forward.nonfinite_kind == "inf"
    nan = result.forward_nan_after(made)
    assert nan.name == "SoftmaxBackward0" and nan.forward.nonfinite_kind == "nan"
    (finding,) = nonfinite_findings(result)
    assert f"an inf first at #{made.id} MaskedFillBackward0" in finding.detail
    assert f"a nan first at #{nan.id} SoftmaxBackward0" in finding.detail
    # where forward made a NaN itself, nothing more is said
    log = trace(lambda x: torch.log(x - 2).sum(), torch.rand(3), forward_stats=True)
    assert log.forward_nan_after(log.forward_nonfinite_origin()) is None


def test_a_forward_nan_inside_a_reentrant_checkpoint_says_its_ops_are_not_recorded():
    torch.manual_seed(0)
    result = trace(_Checkpointed(lambda x: torch.log(x - x - 1)), torch.randn(2, 4), forward_stats=True)
    made = result.forward_nonfinite_origin()
    assert made.name == "CheckpointFunctionBackward"
    assert "reentrant checkpoint" in result.unrecorded_note(made) and "use_reentrant=False" in result.unrecorded_note(made)
    (finding,) = nonfinite_findings(result)
    assert finding.node == made.id


def test_torchs_own_backward_hook_functions_are_not_gradchecked():
    """A module's full backward hook puts torch's BackwardHookFunction around the module (identity functions):
    PyTorch's own, not checked nor counted as the user's custom Functions."""
    doubled = _elementwise_function("Doubled", lambda x: 2 * x, lambda x: 2 + 0 * x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 1)
            self.fc2.register_full_backward_hook(lambda module, grad_input, grad_output: None)

        def forward(self, x):
            return self.fc2(doubled.apply(self.fc1(x)))

    result = trace(Net(), torch.randn(2, 4), gradcheck=True)
    checked = [n.name for n in result.nodes if n.gradcheck is not None]
    assert checked == ["DoubledBackward"]
    assert any(n.name == "BackwardHookFunctionBackward" for n in result.nodes)


# swish, its backward 3% off in every element, up in some and down in others (the signs of sin(1000 x))
_SwishOffBy3Percent = _elementwise_function(
    "SwishOffBy3Percent",
    lambda x: x * torch.sigmoid(x),
    lambda x: torch.sigmoid(x) * (1 + x * (1 - torch.sigmoid(x))) * (1 + 0.03 * torch.sign(torch.sin(1000 * x))),
)


@pytest.mark.parametrize("seed", [29, 30, 60, 76])  # inputs where one random direction let it pass
def test_gradcheck_fails_a_backward_a_few_percent_off_whatever_the_inputs(seed):
    """Errors of both signs can cancel along one random direction: the check does not rest on one."""
    from tracer_cli.gradcheck import check

    torch.manual_seed(seed)
    x = torch.randn(2, 240, 4, 4, requires_grad=True)
    result = check(_SwishOffBy3Percent, (x,), {})
    assert result.passed is False, result
