"""``gradtrace check``: findings on sample models, exit codes, thresholds, JUnit XML, GitHub annotations.

Set up through the sample files, act through the CLI (CliRunner: stdout, stderr and exit code
separately), and compare with independent computations: a plain ``loss.backward()`` and
``retain_grad()`` on the tensors around the node a finding names, never gradtrace's own output.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from typer.testing import CliRunner

from tracer_cli.checks import (
    CHECK_DEFAULT_FAILING,
    CheckPolicy,
    Finding,
    TargetReport,
    Thresholds,
    check_traces,
    merge_rank_findings,
    norm_findings,
    parse_fail_on,
    trace_findings,
)
from tracer_cli.cli import app
from tracer_cli.render.github import annotations, escape_data, escape_property
from tracer_cli.tracing import trace

from .reference import load_sample

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_models"


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture(autouse=True)
def plain_environment(monkeypatch, tmp_path):
    """No GitHub annotations unless a test asks, and no pyproject.toml of the machine's folders in the way."""
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    monkeypatch.chdir(tmp_path)


def check(runner: CliRunner, *args: str):
    return runner.invoke(app, ["check", *args], catch_exceptions=False)


def sample(name: str) -> str:
    return str(SAMPLES / f"{name}.py")


def rows(stdout: str, status: str) -> list[str]:
    """The findings-table rows with this status (FAIL or warn)."""
    return [line for line in stdout.splitlines() if line.startswith(f"{status} ")]


COLUMNS = ("check", "node", "module", "parameter", "value", "finding")


def table(stdout: str, status: str | None = None) -> list[dict[str, str]]:
    """The findings-table rows as {"status", "check", "node", ...}, cut at the header's column starts."""
    found = []
    starts: list[int] = []
    for line in stdout.splitlines():
        if re.match(r"^\s+check\s+node\s+module\s+parameter\s+value\s+finding", line):
            starts = [line.index(f" {name}") + 1 for name in COLUMNS]
        elif re.match(r"^(FAIL|warn) ", line) and starts:
            cells = {"status": line[:4]}
            for name, start, end in zip(COLUMNS, starts, starts[1:] + [len(line)], strict=True):
                cells[name] = line[start:end].strip()
            if status is None or cells["status"] == status:
                found.append(cells)
    return found


def params(stdout: str, status: str) -> set[str]:
    return {row["parameter"] for row in table(stdout, status)}


def seeded(name: str):
    """A sample's model and inputs, seeded as gradtrace seeds them (0 before the model, 0 before the inputs)."""
    module = load_sample(name)
    torch.manual_seed(0)
    model = module.build_model()
    torch.manual_seed(0)
    return module, model, module.example_inputs()


def parse_junit(path: Path) -> ET.Element:
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    return root


def cases(root: ET.Element) -> dict[tuple[str, str], ET.Element]:
    return {(case.get("classname"), case.get("name")): case for case in root.iter("testcase")}


# Each finding kind on a sample model --------------------------------------------------------------


def test_nan_only_in_backward_fails_naming_sqrt(runner):
    result = check(runner, sample("nan_where"))
    assert result.exit_code == 1, result.output
    failing = rows(result.stdout, "FAIL")
    assert len(failing) == 1, result.stdout  # one origin, not one line per poisoned node
    assert re.search(r"nonfinite\s+#\d+ SqrtBackward0\s+<root>\s+–\s+nan", failing[0]), failing[0]
    assert "proj.weight" in failing[0] and "proj.bias" in failing[0]
    assert result.stdout.splitlines()[-1].startswith("FAIL: 1 failing finding (nonfinite)")

    # independently: the loss is finite, sqrt's output gradient is finite, its input gradient is NaN
    _, model, x = seeded("nan_where")
    h = model.proj(x)
    h.retain_grad()
    root = torch.sqrt(h)
    root.retain_grad()
    loss = model.head(torch.where(h > 0, root, 0.0)).mean()
    loss.backward()
    assert math.isfinite(loss.item())
    assert torch.isfinite(root.grad).all() and torch.isnan(h.grad).any()
    assert torch.isnan(model.proj.weight.grad).any()


def test_infinity_masked_by_relu_fails_naming_the_node_and_the_mask(runner):
    result = check(runner, sample("masked_inf"))
    assert result.exit_code == 1, result.output
    failing = rows(result.stdout, "FAIL")
    assert len(failing) == 1, result.stdout
    assert re.search(r"nonfinite\s+#\d+ SqrtBackward0\s+act\s+–\s+inf", failing[0]), failing[0]
    assert re.search(r"masked by #\d+ ReluBackward0", failing[0]), failing[0]

    # independently: every parameter gradient is finite, yet sqrt sends an infinity into the relu
    _, model, x = seeded("masked_inf")
    hidden = torch.relu(model.proj(x))
    hidden.retain_grad()
    model.head(torch.sqrt(hidden)).mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert torch.isinf(hidden.grad).any()


def test_forgotten_layer_fails_naming_its_parameters(runner):
    result = check(runner, sample("forgotten_layer"))
    assert result.exit_code == 1, result.output
    flagged = params(result.stdout, "FAIL")
    assert {row["check"] for row in table(result.stdout)} == {"nograd"}

    _, model, x = seeded("forgotten_layer")
    model(x).sum().backward()
    assert flagged == {name for name, p in model.named_parameters() if p.grad is None} == {"norm.weight", "norm.bias"}


def test_dead_parameters_warn_by_default_and_fail_when_asked(runner):
    _, model, x = seeded("zero_gate")
    model(x).sum().backward()
    dead = {name for name, p in model.named_parameters() if p.grad is not None and not p.grad.any()}
    assert dead == {"block.0.weight", "block.0.bias", "block.2.weight", "block.2.bias"}

    result = check(runner, sample("zero_gate"))
    assert result.exit_code == 0, result.output
    assert rows(result.stdout, "FAIL") == []
    assert params(result.stdout, "warn") == dead
    assert result.stdout.splitlines()[-1] == "OK: 1 target healthy, 4 warnings"

    result = check(runner, sample("zero_gate"), "--fail-on", "zero")
    assert result.exit_code == 1
    assert params(result.stdout, "FAIL") == dead


def test_warn_on_demotes_a_default_failure(runner):
    result = check(runner, sample("forgotten_layer"), "--warn-on", "nograd")
    assert result.exit_code == 0, result.output
    assert len(rows(result.stdout, "warn")) == 2


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "custom_function", "checkpointed"])
def test_healthy_models_pass(runner, name):
    """Healthy samples, among them a ResNet-style CNN (residual blocks, BatchNorm) and a GPT-style
    transformer (causal attention, tied LM head)."""
    result = check(runner, sample(name))
    assert result.exit_code == 0, result.output
    assert "no findings" in result.stdout
    assert result.stdout.splitlines()[-1] == "OK: 1 target healthy"
    assert result.stderr == ""


def test_readme_example_is_the_real_output(runner, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    command = (
        "$ gradtrace check sample_models/masked_inf.py sample_models/forgotten_layer.py sample_models/zero_gate.py"
    )
    shown = readme.split(command + "\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(ROOT)
    result = check(runner, *command.split()[3:])
    assert result.exit_code == 1
    assert [line.rstrip() for line in result.stdout.splitlines()] == shown.splitlines()


def test_tree_only_with_tree_flag(runner):
    plain = check(runner, sample("mlp"))
    with_tree = check(runner, sample("mlp"), "--tree", "--view", "graph")
    node_line = re.compile(r"[├└]── #\d+ ")
    assert not node_line.search(plain.stdout)
    assert len(node_line.findall(with_tree.stdout)) == 16
    assert with_tree.stdout.splitlines()[-1] == plain.stdout.splitlines()[-1]


# Thresholds ---------------------------------------------------------------------------------------


def plain_mlp_norms() -> dict[str, float]:
    """Each parameter's gradient norm from a plain backward of the mlp sample (output reduced by sum)."""
    _, model, x = seeded("mlp")
    model(x).sum().backward()
    return {name: float(p.grad.norm()) for name, p in model.named_parameters()}


def test_max_grad_norm_flags_exactly_the_parameters_above_it(runner):
    norms = plain_mlp_norms()
    total = math.sqrt(sum(v * v for v in norms.values()))
    ordered = sorted(norms.values())
    limit = (ordered[2] + ordered[3]) / 2  # between two parameters' norms: three below, the rest above
    result = check(runner, sample("mlp"), "--max-grad-norm", f"{limit:.6g}")
    assert result.exit_code == 1, result.output
    failing = table(result.stdout, "FAIL")
    assert all(row["check"] == "norm" for row in failing)
    growth = [row for row in failing if "grows past" in row["finding"]]  # where it starts, not a parameter
    assert growth and all(row["parameter"] == "–" for row in growth)
    failing = [row for row in failing if row not in growth]
    assert {row["parameter"] for row in failing} == {name for name, v in norms.items() if v > limit} | {
        "(all parameters)"
    }
    assert any(row["finding"].startswith("total ‖grad‖") for row in failing) and total > limit
    for row in failing:  # the value column shows each norm (3 significant digits)
        expected = total if row["parameter"] == "(all parameters)" else norms[row["parameter"]]
        assert float(row["value"]) == pytest.approx(expected, rel=5e-3)
    # a limit above every norm (and the total) passes
    result = check(runner, sample("mlp"), "--max-grad-norm", f"{total * 1.01:.6g}")
    assert result.exit_code == 0, result.output


def test_max_grad_norm_names_where_gradients_grow_past_it():
    """A head scaled up by 1e6: every parameter before it gets a huge gradient, but the growth starts at
    the head's AddmmBackward0, which receives a small gradient and sends on a huge one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    with torch.no_grad():
        model[4].weight.mul_(1e6)
    x, labels = torch.randn(8, 16), torch.randint(0, 4, (8,))
    seen = {}  # independently: the head's gradients, from a module backward hook of a plain backward
    handle = model[4].register_full_backward_hook(
        lambda module, grad_input, grad_output: seen.update(into=float(grad_output[0].norm()), out=float(grad_input[0].norm()))
    )
    F.cross_entropy(model(x), labels).backward()
    handle.remove()
    limit = 100.0
    assert seen["into"] < limit < seen["out"]

    model.zero_grad()
    result = trace(model, (x,), loss_fn=lambda out: F.cross_entropy(out, labels))
    (growth,) = [f for f in norm_findings(result, Thresholds(max_grad_norm=limit)) if "grows past" in f.detail]
    assert (growth.name, growth.module) == ("AddmmBackward0", "4")
    assert growth.value == pytest.approx(seen["out"], rel=1e-4)
    assert f"receives ‖{seen['into']:.3g}‖" in growth.detail
    # a limit above every gradient names no node
    assert not [f for f in norm_findings(result, Thresholds(max_grad_norm=seen["out"] * 100)) if "grows past" in f.detail]


def test_max_grad_norm_names_where_branches_add_up_past_it():
    """Two branches each send 60 back to h: neither is above 100, their sum at h's node is."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.ones(1))
    x = torch.ones(1)
    h = x * w
    h.retain_grad()
    loss = (h * 60.0).sum() + (h * 60.0).sum()
    loss.backward()  # independently: the gradient that reaches h
    assert float(h.grad.norm()) == pytest.approx(120.0)

    class TwoBranches(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = w

        def forward(self, x):
            h = x * self.w
            return (h * 60.0).sum() + (h * 60.0).sum()

    w.grad = None
    result = trace(TwoBranches(), (x,), input_grad=False)
    (growth,) = [f for f in norm_findings(result, Thresholds(max_grad_norm=100.0)) if "grows past" in f.detail]
    node = result.nodes[growth.node]
    assert node.name == "MulBackward0" and any(result.nodes[c].param == "w" for c in node.next if c is not None)
    assert "2 gradients, each within it (the largest ‖60‖), add up to ‖120‖" in growth.detail
    assert growth.value == pytest.approx(120.0)


def test_min_grad_norm_flags_the_parameters_below_it(runner):
    norms = plain_mlp_norms()
    smallest = min(norms, key=norms.get)
    limit = sorted(norms.values())[1] * 0.999  # only the smallest is below
    result = check(runner, sample("mlp"), "--min-grad-norm", f"{limit:.6g}")
    assert result.exit_code == 1, result.output
    assert [row["parameter"] for row in table(result.stdout, "FAIL")] == [smallest]
    assert "below --min-grad-norm" in result.stdout


def test_norm_findings_values_match_plain_backward():
    norms = plain_mlp_norms()
    module, model, x = seeded("mlp")
    result = trace(model, (x,))
    findings = norm_findings(result, Thresholds(max_grad_norm=0.0))
    by_param = {f.param: f.value for f in findings}
    for name, value in norms.items():
        assert by_param[name] == pytest.approx(value, rel=1e-5)
    total = math.sqrt(sum(v * v for v in norms.values()))
    assert by_param["(all parameters)"] == pytest.approx(total, rel=1e-5)
    weight = next(f for f in findings if f.param == "fc1.weight")
    assert weight.name.endswith("AccumulateGrad") and weight.module == "fc1"
    assert result.nodes[weight.node].param == "fc1.weight"


def test_threshold_makes_norm_fail_unless_demoted(runner):
    result = check(runner, sample("mlp"), "--max-grad-norm", "0.001", "--warn-on", "norm")
    assert result.exit_code == 0, result.output
    assert rows(result.stdout, "warn") and not rows(result.stdout, "FAIL")


def test_run_takes_thresholds_too(runner):
    result = runner.invoke(app, ["run", sample("mlp"), "--max-grad-norm", "0.001"], catch_exceptions=False)
    assert result.exit_code == 1
    assert "FAIL norm: parameter" in result.stdout or "FAIL norm: #" in result.stdout
    result = runner.invoke(app, ["run", sample("zero_gate")], catch_exceptions=False)
    assert result.exit_code == 0  # run fails only on what was asked for
    result = runner.invoke(app, ["run", sample("zero_gate"), "--fail-on", "zero"], catch_exceptions=False)
    assert result.exit_code == 1


# Exit codes and several targets -------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--fail-on", "gradchek"], "unknown --fail-on check 'gradchek'"),
        (["--warn-on", "nan"], "unknown --warn-on check 'nan'"),
        (["--min-grad-norm", "2", "--max-grad-norm", "1"], "above --max-grad-norm"),
        (["--filter", "("], "--filter"),
        (["--fail-on", "norm"], "--fail-on names norm, which needs a threshold"),
        (["--warn-on", "nograd,norm"], "--warn-on names norm, which needs a threshold"),
        (["--fail-on", "gradcheck"], "--fail-on names gradcheck, which needs --gradcheck"),
        (["--seed", str(2**64)], "out of range"),
        (["--seed", "-1"], "out of range"),
        (["--warn-on", "replay"], "--warn-on names replay, which needs --replay"),
    ],
)
def test_usage_errors_exit_2(runner, args, fragment):
    result = check(runner, sample("mlp"), *args)
    assert result.exit_code == 2
    assert fragment in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    "setting, fragment",
    [
        ("seed = -1", "seed in [tool.gradtrace] -1 is out of range"),
        ('fail-on = ["norm"]', "fail-on in [tool.gradtrace] names norm, which needs a threshold"),
        ("min-grad-norm = 2.0\nmax-grad-norm = 1.0", "min-grad-norm in [tool.gradtrace] 2 is above max-grad-norm in"),
    ],
)
def test_a_usage_error_in_the_config_names_its_key(runner, tmp_path, setting, fragment):
    (tmp_path / "pyproject.toml").write_text(f"[tool.gradtrace]\n{setting}\n")
    result = check(runner, sample("mlp"))
    assert result.exit_code == 2 and fragment in result.stderr, result.stderr


def test_no_targets_is_a_usage_error(runner):
    result = check(runner)
    assert result.exit_code == 2
    assert "no targets" in result.stderr and "[tool.gradtrace]" in result.stderr


def test_several_targets_each_checked_and_an_error_wins(runner, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text(
        "import torch\n\ndef model(x):\n    raise ValueError('broken model')\n\n"
        "def example_inputs():\n    return torch.ones(2)\n"
    )
    junit = tmp_path / "report.xml"
    result = check(runner, sample("mlp"), str(broken), sample("nan_where"), "--junit-xml", str(junit))
    assert result.exit_code == 3  # the model error, although nan_where also fails
    assert "ValueError: broken model" in result.stderr
    out = result.stdout
    assert "mlp.py · 16 nodes" in out and "SqrtBackward0" in out  # the targets after the broken one still ran
    assert out.splitlines()[-1].startswith("ERROR: 1 of 3 targets could not be checked")
    root = parse_junit(junit)
    assert root.get("errors") == "1" and root.get("failures") == "1"
    error = cases(root)[(str(broken), "load")].find("error")
    assert error is not None and "broken model" in error.get("message")


def test_several_healthy_targets(runner):
    result = check(runner, sample("mlp"), sample("cnn"), sample("transformer"))
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == "OK: 3 targets healthy"
    assert result.stdout.count("no findings") == 3


def test_targets_in_two_folders_each_get_their_own_neighbour_modules(tmp_path):
    """a/model.py and b/model.py each import `layers` from their own folder: checked together, each is
    the model it is when checked alone (in a process of its own), not the first one's twice."""
    for folder, body in (("a", "nn.Linear(4, 2)"), ("b", "nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "layers.py").write_text(f"from torch import nn\n\ndef make():\n    return {body}\n")
        (tmp_path / folder / "model.py").write_text(
            "import torch\nfrom layers import make\n\nmodel = make()\n\ndef example_inputs():\n    return torch.randn(3, 4)\n"
        )

    def summaries(*targets: str) -> list[str]:
        job = subprocess.run([sys.executable, "-m", "tracer_cli", "check", *targets], capture_output=True,
                             text=True, timeout=120, cwd=tmp_path)
        assert job.returncode == 0, job.stdout + job.stderr
        return [line for line in job.stdout.splitlines() if " nodes, " in line]

    alone = summaries("a/model.py") + summaries("b/model.py")
    assert alone[0] != alone[1].replace("b/", "a/")  # two different models
    assert summaries("a/model.py", "b/model.py") == alone
    assert summaries("b/model.py", "a/model.py", "b/model.py") == [alone[1], alone[0], alone[1]]


def test_a_package_two_targets_share_is_imported_once(tmp_path):
    """model.py and exp/model.py both import mypkg from the root (exp has none of its own): it stays
    imported (importing it twice would run its side effects twice, e.g. op registrations)."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text(
        "import pathlib\nwith open(pathlib.Path(__file__).parent / 'imports.txt', 'a') as f:\n    f.write('x')\n"
        "from torch import nn\n\ndef make():\n    return nn.Linear(4, 2)\n"
    )
    body = "import torch\nfrom mypkg import make\n\nmodel = make()\n\ndef example_inputs():\n    return torch.randn(3, 4)\n"
    (tmp_path / "model.py").write_text(body)
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "model.py").write_text(body)
    job = subprocess.run([sys.executable, "-m", "tracer_cli", "check", "model.py", "exp/model.py"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert job.returncode == 0, job.stdout + job.stderr
    assert (tmp_path / "mypkg" / "imports.txt").read_text() == "x"


def test_forgetting_a_targets_neighbours_spares_what_was_loaded_before(tmp_path, monkeypatch):
    """Modules loaded before the first model file (gradtrace, torch, the user's own imports) stay, even
    where they live in a target's folder; what that folder's target imported goes."""
    import importlib

    from tracer_cli import loading

    monkeypatch.setattr(loading, "_target_folders", [])
    monkeypatch.setattr(loading, "_loaded_before", set())
    folder = tmp_path / "a"
    folder.mkdir()
    (tmp_path / "b").mkdir()
    for name in ("gt_early_module", "gt_late_module"):
        (folder / f"{name}.py").write_text("VALUE = 1\n")
        (tmp_path / "b" / f"{name}.py").write_text("VALUE = 2\n")  # the next target has its own of each
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(folder))
    importlib.import_module("gt_early_module")
    loading._forget_neighbours_of_other_targets(str(folder))  # the first target, in a
    importlib.import_module("gt_late_module")  # what it imports
    loading._forget_neighbours_of_other_targets(str(tmp_path / "b"))  # the next target, elsewhere
    assert "gt_early_module" in sys.modules and "gt_late_module" not in sys.modules


def test_missing_target_exits_2(runner):
    result = check(runner, "does_not_exist.py")
    assert result.exit_code == 2
    assert "not found" in result.stderr


# JUnit XML ----------------------------------------------------------------------------------------


def test_junit_xml_mirrors_the_verdict(runner, tmp_path):
    junit = tmp_path / "out" / "gradtrace.xml"
    junit.parent.mkdir()
    targets = [sample("masked_inf"), sample("zero_gate"), sample("mlp")]
    result = check(runner, *targets, "--max-grad-norm", "1e6", "--junit-xml", str(junit))
    assert result.exit_code == 1
    assert f"JUnit XML written to {junit}" in result.stderr
    root = parse_junit(junit)
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == targets
    found = cases(root)
    checks = ("nonfinite", "nograd", "zero", "norm")
    assert set(found) == {(t, c) for t in targets for c in checks}  # one case per check and target
    assert int(root.get("tests")) == len(found) == 12
    assert root.get("failures") == "1" and root.get("errors") == "0"
    for suite in suites:
        assert int(suite.get("tests")) == len(suite.findall("testcase"))
        assert int(suite.get("failures")) == len(suite.findall("testcase/failure"))
    failure = found[(sample("masked_inf"), "nonfinite")].find("failure")
    assert failure.get("type") == "nonfinite"
    assert "SqrtBackward0 in act" in failure.get("message") and "SqrtBackward0 in act" in failure.text
    # warnings do not fail a case, they are written to its output
    zero = found[(sample("zero_gate"), "zero")]
    assert zero.find("failure") is None
    assert zero.find("system-out").text.count("warning: ") == 4
    assert all(found[(sample("mlp"), c)].find("failure") is None for c in checks)


def test_junit_xml_of_a_healthy_run_has_no_failures(runner, tmp_path):
    junit = tmp_path / "ok.xml"
    result = check(runner, sample("cnn"), "--junit-xml", str(junit))
    assert result.exit_code == 0
    root = parse_junit(junit)
    assert root.get("failures") == "0" and root.get("errors") == "0"
    assert {c.get("name") for c in root.iter("testcase")} == {"nonfinite", "nograd", "zero"}
    assert not list(root.iter("failure"))


def test_junit_xml_unwritable_is_a_usage_error(runner, tmp_path):
    result = check(runner, sample("mlp"), "--junit-xml", str(tmp_path / "missing" / "x.xml"))
    assert result.exit_code == 2
    assert "cannot write" in result.stderr


# GitHub annotations -------------------------------------------------------------------------------


def test_github_annotations_only_in_github_actions(runner, monkeypatch):
    result = check(runner, sample("forgotten_layer"), sample("zero_gate"))
    assert "::error" not in result.stdout and "::warning" not in result.stdout
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    result = check(runner, sample("forgotten_layer"), sample("zero_gate"))
    assert result.exit_code == 1
    errors = [line for line in result.stdout.splitlines() if line.startswith("::error ::")]
    warnings = [line for line in result.stdout.splitlines() if line.startswith("::warning ::")]
    assert len(errors) == 2 and len(warnings) == 4
    assert any("forgotten_layer.py" in line and "norm.weight" in line for line in errors)
    assert all("zero_gate.py" in line and "zero" in line for line in warnings)


def test_annotation_escaping():
    assert escape_data("100% done\r\nnext") == "100%25 done%0D%0Anext"
    report = check_traces(
        [trace(lambda x: (x * float("nan")).sum(), (torch.ones(2),))],
        CheckPolicy.build(["nonfinite"]),
        target="line\nbreak%",
    )
    lines = annotations([report])
    assert len(lines) == len(report.failures) == 2  # the NaN loss, and where the NaN gradient starts
    # each names this file's line that made the node (the lambda's)
    command = re.compile(r"::error file=([^,:]+),line=(\d+)::gradtrace check line%0Abreak%25: nonfinite: ")
    assert all(command.match(line) for line in lines), lines
    assert not any("\n" in line for line in lines)
    assert escape_property("C:\\a,b%\n") == "C%3A\\a%2Cb%25%0A"


def test_annotations_name_the_line_that_created_the_node(runner, monkeypatch):
    """The finding's annotation carries the file and line GitHub shows it on, relative to the checkout."""
    source = (SAMPLES / "nan_where.py").read_text().splitlines()
    # independently: the line of the model's forward that calls torch.sqrt
    (line,) = [number for number, text in enumerate(source, 1) if "= torch.where(h > 0, torch.sqrt(h)" in text]
    result = check(runner, sample("nan_where"))
    below = result.stdout.splitlines()[result.stdout.splitlines().index(rows(result.stdout, "FAIL")[0]) + 1]
    assert below.strip() == f"created at {SAMPLES / 'nan_where.py'}:{line}"  # in the table, below the finding
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_WORKSPACE", str(ROOT))
    result = check(runner, sample("nan_where"), sample("forgotten_layer"))
    errors = [line for line in result.stdout.splitlines() if line.startswith("::error")]
    assert errors[0].startswith(f"::error file=sample_models/nan_where.py,line={line}::"), errors[0]
    assert errors[0].endswith(f"(created at {SAMPLES / 'nan_where.py'}:{line})")
    # a parameter without gradient has no node, so no line: the annotation is the run's alone
    assert all(line.startswith("::error ::") and "nograd" in line for line in errors[1:]) and len(errors) == 3
    monkeypatch.setenv("GITHUB_WORKSPACE", str(ROOT / "tests"))  # a checkout the file is not in
    result = check(runner, sample("nan_where"))
    (error,) = [line for line in result.stdout.splitlines() if line.startswith("::error")]
    assert error.startswith("::error ::") and f"(created at {SAMPLES / 'nan_where.py'}:{line})" in error


def test_annotations_of_targets_that_fail_name_the_line_that_raised(runner, tmp_path, monkeypatch):
    files = {
        "broken_import.py": "import torch\n\nraise RuntimeError('broken at import')\n",
        "syntax.py": "import torch\n\ndef model(x):\n    return (x.sum(\n",
        "raises.py": "import torch\n\nw = torch.nn.Parameter(torch.ones(3))\n\ndef model(x):\n"
                     "    raise ValueError('in forward')\n\ndef example_inputs():\n    return torch.ones(3)\n",
    }
    expected = {}  # independently: the line each file fails on
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        marker = {"broken_import.py": "raise", "syntax.py": "return (", "raises.py": "raise"}[name]
        expected[name] = next(n for n, line in enumerate(text.splitlines(), 1) if marker in line)
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_WORKSPACE", str(tmp_path))
    result = check(runner, *(str(tmp_path / name) for name in files))
    assert result.exit_code == 3
    errors = [line for line in result.stdout.splitlines() if line.startswith("::error")]
    assert [line.split("::")[1] for line in errors] == [f"error file={name},line={line}" for name, line in expected.items()]


def test_annotation_file_only_for_a_file_of_the_checkout(tmp_path):
    """file= and line= where the source is a file inside the workspace; never for code with no file."""
    inside, outside = tmp_path / "repo" / "model.py", tmp_path / "lib" / "layers.py"
    # a library installed in a virtual environment made inside the checkout (a common CI setup) is no file of it
    installed = tmp_path / "repo" / ".venv" / "lib" / "python3.11" / "site-packages" / "timm" / "layers.py"
    sources = [f"{inside}:7", f"{outside}:9", "<string>:3", None, "model.py", f"{installed}:18"]  # "model.py": no line
    findings = tuple(Finding("nonfinite", "nan", node=i, name="SqrtBackward0", source=s) for i, s in enumerate(sources))
    report = TargetReport("t", checks=("nonfinite",), findings=findings, policy=CheckPolicy.build(["nonfinite"]))
    lines = annotations([report], workspace=str(tmp_path / "repo"))
    assert [line.split("::")[1] for line in lines] == ["error file=model.py,line=7"] + ["error "] * 5
    assert all(f"(created at {s})" in line for line, s in zip(lines, sources) if s)
    (tmp_path / "repo").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "repo")  # a self-hosted runner's workspace may be a link
    assert annotations([report], workspace=str(tmp_path / "link")) == lines


# Library pieces -----------------------------------------------------------------------------------


def test_parse_fail_on_lists_only_what_works():
    assert parse_fail_on("nonfinite, zero,norm") == ("nonfinite", "zero", "norm")
    assert parse_fail_on(["divergence"]) == ("divergence",)
    assert parse_fail_on("gradcheck,replay") == ("gradcheck", "replay")
    with pytest.raises(ValueError, match="known: nonfinite, nograd, zero, norm, divergence, gradcheck, replay$"):
        parse_fail_on("gradchek")


def test_policy_defaults_thresholds_and_demotion():
    assert CheckPolicy.build(["nonfinite", "nograd"]).failing == {"nonfinite", "nograd"}
    assert CheckPolicy.build([], thresholds=Thresholds(max_grad_norm=1.0)).failing == {"norm"}
    policy = CheckPolicy.build(["nonfinite", "nograd"], fail_on=["zero"], warn_on=["nograd"])
    assert policy.failing == {"nonfinite", "zero"}


def test_rank_findings_are_merged_and_say_which_ranks():
    common = Finding("nograd", "no gradient", param="a")
    only_one = Finding("zero", "zero", param="b")
    merged = merge_rank_findings([[common], [common, only_one]])
    assert merged == [common, Finding("zero", "zero", param="b", ranks=(1,))]
    assert merged[1].message.endswith("(rank 1 only)")


def test_nonfinite_loss_is_a_finding():
    result = trace(lambda x: (x * float("inf")).sum() * 0, (torch.ones(3),))
    report = check_traces([result], CheckPolicy.build(["nonfinite"]))
    assert any("the loss is nan" in f.detail for f in report.failures)


# Under torchrun -----------------------------------------------------------------------------------


def test_check_across_ranks_names_the_divergence(tmp_path):
    """``gradtrace check --nproc-per-node 2``: the divergence warns by default, fails with --fail-on."""
    junit = tmp_path / "ranks.xml"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GITHUB_ACTIONS")}
    command = [
        sys.executable,
        "-m",
        "tracer_cli",
        "check",
        "--nproc-per-node",
        "2",
        sample("dist_forward"),
        "--fail-on",
        "divergence",
        "--junit-xml",
        str(junit),
    ]
    job = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert job.returncode == 1, job.stdout + job.stderr
    assert "failed" not in job.stderr, job.stderr  # the verdict is not a failure of the ranks
    lines = [line for line in job.stdout.splitlines() if line.strip()]
    assert all(line.startswith("[rank0] ") for line in lines), job.stdout
    assert any(re.search(r"FAIL\s+divergence\s+#\d+ MulBackward0\s+block2", line) for line in lines), job.stdout
    divergence = cases(parse_junit(junit))[(sample("dist_forward"), "divergence")]
    assert "MulBackward0 in block2" in divergence.find("failure").text


def test_a_parameter_a_custom_backward_gives_none_has_no_gradient():
    """Its AccumulateGrad runs (the edge is there), but with None: no gradient, as a plain backward shows."""

    class NoneForW(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return x + w

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))
            self.fc = nn.Linear(4, 1)

        def forward(self, x):
            return self.fc(NoneForW.apply(x, self.w))

    torch.manual_seed(0)
    model, x = Model(), torch.randn(2, 4)
    model(x).sum().backward()
    assert model.w.grad is None and model.fc.weight.grad is not None
    model.zero_grad(set_to_none=True)
    result = trace(model, (x,))
    assert result.params_without_grad == ("w",)
    assert [f.param for f in trace_findings(result, Thresholds()) if f.kind == "nograd"] == ["w"]


def test_the_report_line_shows_each_rank_s_loss_where_they_differ():
    """Rank 0's finite loss must not stand for a job where another rank's is NaN."""
    from tracer_cli import trace

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x = torch.randn(2, 3)
    healthy = trace(model, (x,))
    poisoned = trace(model, (x * float("nan"),))
    same = check_traces([healthy, trace(model, (x,))], CheckPolicy.build(["nonfinite"]))
    assert f"loss {healthy.meta.loss:.6g} ·" in same.summary and "by rank" not in same.summary
    differ = check_traces([healthy, poisoned], CheckPolicy.build(["nonfinite"]))
    assert f"loss {healthy.meta.loss:.6g} / nan (by rank)" in differ.summary, differ.summary


# --- what a CI job meets --------------------------------------------------------------------------


def _gradtrace(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("GITHUB_ACTIONS", "COLUMNS")} | env
    return subprocess.run([sys.executable, "-m", "tracer_cli", *args], capture_output=True, cwd=cwd, env=environment, check=False,
                          timeout=180)


def test_a_stdout_that_cannot_encode_every_character_gets_question_marks_not_an_internal_error(tmp_path):
    """A Windows runner's code page (cp1252), or LC_ALL=C: the run and its report go on."""
    job = _gradtrace("check", sample("mlp"), "--junit-xml", "report.xml", cwd=tmp_path, PYTHONIOENCODING="ascii")
    assert job.returncode == 0, job.stderr
    assert b"OK: 1 target healthy" in job.stdout and (tmp_path / "report.xml").exists()
    assert b"params ?grad?" in job.stdout  # the norm bars, which ASCII lacks


@pytest.mark.parametrize("columns", ["0", "abc", "-5", ""])
def test_a_columns_value_that_is_no_width_is_ignored(tmp_path, columns):
    job = _gradtrace("check", sample("masked_inf"), cwd=tmp_path, COLUMNS=columns)
    assert job.returncode == 1
    (row,) = [line for line in job.stdout.decode().splitlines() if line.startswith("FAIL  nonfinite")]
    assert "a latent inf" in row  # one line, not folded at 80 columns nor at none
    error = _gradtrace("check", "missing.py", cwd=tmp_path, COLUMNS=columns)
    assert error.returncode == 2 and b"model file not found: missing.py" in error.stderr  # stderr too


def test_in_a_narrow_terminal_each_finding_keeps_its_text():
    from rich.console import Console

    from tracer_cli.render.findings import render_report

    report = check_traces([trace(load_sample("masked_inf").build_model(), load_sample("masked_inf").example_inputs())],
                          CheckPolicy.build(CHECK_DEFAULT_FAILING), target="masked_inf.py")
    for width in (40, 60, 200):
        console = Console(width=width, color_system=None)
        with console.capture() as captured:
            console.print(render_report(report))
        text = captured.get()
        assert "latent" in text and "FAIL" in text and "SqrtBackward0" in text, (width, text)
        assert max(map(len, text.splitlines())) <= width


def test_the_command_line_s_fail_on_replaces_the_config_s_warn_on(runner, tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.gradtrace]\nwarn-on = ["nograd"]\n')
    assert check(runner, sample("forgotten_layer")).exit_code == 0
    assert check(runner, sample("forgotten_layer"), "--fail-on", "nograd").exit_code == 1
    both = check(runner, sample("forgotten_layer"), "--fail-on", "nograd", "--warn-on", "nograd")
    assert both.exit_code == 2 and "nograd named in both --fail-on and --warn-on" in both.stderr


def test_divergence_asked_for_in_one_process_is_a_usage_error(runner, tmp_path):
    result = check(runner, sample("mlp"), "--fail-on", "divergence")
    assert result.exit_code == 2 and "needs torchrun" in result.stderr
    (tmp_path / "pyproject.toml").write_text('[tool.gradtrace]\nfail-on = ["divergence"]\n')  # shared with torchrun jobs
    assert check(runner, sample("mlp")).exit_code == 0


def test_an_error_in_the_options_removes_what_an_earlier_run_left_in_the_output_files(runner, tmp_path):
    assert check(runner, sample("mlp"), "--junit-xml", "report.xml").exit_code == 0
    assert (tmp_path / "report.xml").exists()
    assert check(runner, sample("mlp"), "--fail-on", "bogus", "--junit-xml", "report.xml").exit_code == 2
    assert not (tmp_path / "report.xml").exists()
    (tmp_path / "pyproject.toml").write_text("[tool.gradtrace]\nseed = 'x'\n")
    (tmp_path / "report.xml").write_text("<old/>")
    assert check(runner, sample("mlp"), "--junit-xml", "report.xml").exit_code == 2
    assert not (tmp_path / "report.xml").exists()


def test_two_outputs_naming_one_file_are_refused(runner, tmp_path):
    result = runner.invoke(app, ["run", sample("mlp"), "--svg", "out", "--json", "out"], catch_exceptions=False)
    assert result.exit_code == 2 and "both name out" in result.stderr
    assert not (tmp_path / "out").exists()


def test_diff_does_not_write_over_a_trace_it_compares(runner, tmp_path):
    for name in ("a.json", "b.json"):
        assert runner.invoke(app, ["run", sample("mlp"), "--json", name], catch_exceptions=False).exit_code == 0
    before = (tmp_path / "a.json").read_text()
    result = runner.invoke(app, ["diff", "a.json", "b.json", "--json", "a.json"], catch_exceptions=False)
    assert result.exit_code == 2 and "would write over" in result.stderr
    assert (tmp_path / "a.json").read_text() == before


def test_control_characters_of_a_user_s_error_do_not_reach_the_log(runner, tmp_path):
    (tmp_path / "model.py").write_text(
        "import torch\n\ndef model(x):\n    raise RuntimeError('\\x1b[31mred\\x1b[0m and a NUL \\x00 here')\n\n"
        "def example_inputs():\n    return torch.randn(2)\n"
    )
    result = check(runner, "model.py", "--junit-xml", "report.xml")
    assert result.exit_code == 3
    assert "\x1b" not in result.stdout and "\x00" not in result.stdout and "\\x1b[31mred" in result.stdout
    ET.parse(tmp_path / "report.xml")


def test_api_thresholds_and_checks_that_would_pass_silently_are_value_errors():
    from tracer_cli.testing import assert_gradients_healthy

    model, x = nn.Linear(4, 1), torch.randn(2, 4)
    for kwargs in ({"max_grad_norm": math.nan}, {"max_grad_norm": -1.0}, {"min_grad_norm": math.inf},
                   {"fail_on": "divergence"}, {"fail_on": "zero", "warn_on": "zero"}):
        with pytest.raises(ValueError):
            assert_gradients_healthy(model, (x,), **kwargs)


def test_thresholds_switched_off_check_no_norm(runner):
    """``--max-grad-norm inf --min-grad-norm 0`` (how a configured threshold is unset) can flag nothing: ``norm`` is
    not said to be checked, nor made to fail; a finite bound or a positive floor is."""
    assert not Thresholds(math.inf, 0.0).active and not Thresholds(math.inf, None).active
    assert Thresholds(1e9, None).active and Thresholds(None, 1e-9).active
    off = check(runner, sample("mlp"), "--max-grad-norm", "inf", "--min-grad-norm", "0")
    assert off.exit_code == 0 and "(nonfinite, nograd, zero checked)" in off.stdout, off.stdout
    on = check(runner, sample("mlp"), "--max-grad-norm", "1e9")
    assert on.exit_code == 0 and "(nonfinite, nograd, zero, norm checked)" in on.stdout, on.stdout
