"""``[tool.gradtrace]`` in the nearest pyproject.toml: defaults for ``run`` and ``check``, overridden by options."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tracer_cli.cli import app
from tracer_cli.config import KEYS, find_pyproject, load_config
from tracer_cli.errors import UsageError

from .reference import load_sample

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_models"


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """An empty project folder, the working folder, with no GitHub annotations."""
    folder = tmp_path / "project"
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    return folder


def write_config(folder: Path, body: str) -> Path:
    path = folder / "pyproject.toml"
    path.write_text("[project]\nname = 'demo'\n\n[tool.gradtrace]\n" + textwrap.dedent(body))
    return path


def invoke(runner: CliRunner, *args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def sample(name: str) -> str:
    return str(SAMPLES / f"{name}.py")


def mlp_norms() -> dict[str, float]:
    """The mlp sample's parameter gradient norms from a plain backward, seeded as gradtrace seeds it."""
    module = load_sample("mlp")
    torch.manual_seed(0)
    model = module.build_model()
    torch.manual_seed(0)
    model(module.example_inputs()).sum().backward()
    return {name: float(p.grad.norm()) for name, p in model.named_parameters()}


# Finding and reading the file ---------------------------------------------------------------------


def test_nearest_pyproject_is_searched_upward(project):
    nested = project / "src" / "models"
    nested.mkdir(parents=True)
    path = write_config(project, "seed = 3\n")
    assert find_pyproject(nested) == path.resolve()
    assert load_config(nested).values == {"seed": 3}


def test_the_nearest_file_wins_even_without_the_table(project):
    write_config(project, "seed = 3\n")
    inner = project / "sub"
    inner.mkdir()
    (inner / "pyproject.toml").write_text("[project]\nname = 'inner'\n")
    config = load_config(inner)
    assert config.path is None and config.values == {}


def test_values_are_converted(project):
    write_config(
        project,
        """
        input = "float32[2,16]"
        fail-on = "zero, norm"
        warn-on = ["nograd"]
        max-grad-norm = 10
        eval = true
        loss = "mean"
        inputs = "data/inputs.pt"
        """,
    )
    values = load_config(project).values
    assert values["input"] == ["float32[2,16]"]
    assert values["fail-on"] == "zero,norm" and values["warn-on"] == "nograd"
    assert values["max-grad-norm"] == 10.0 and isinstance(values["max-grad-norm"], float)
    assert values["eval"] is True and values["loss"] == "mean"
    assert Path(values["inputs"]) == Path("data/inputs.pt")  # relative to the working folder, here the same


@pytest.mark.parametrize(
    "body, fragments",
    [
        ("max_grad_norm = 1.0\n", ["unknown key 'max_grad_norm'", "did you mean 'max-grad-norm'"]),
        ("colour = 'red'\n", ["unknown key 'colour'", "known keys: targets"]),
        ("seed = 'zero'\n", ["seed must be an integer", "'zero'"]),
        ("max-grad-norm = -1\n", ["max-grad-norm = -1", "at least 0"]),
        ("fail-on = ['nonfinite', 'gradchek']\n", ["fail-on check 'gradchek'"]),
        ("eval = 'yes'\n", ["eval must be true or false"]),
        ("input = [1, 2]\n", ["input must be a string or a list of strings"]),
        ("input = ['float32[8,17]x']\n", ["[tool.gradtrace] input: invalid input spec 'float32[8,17]x'"]),
        ("seed = \n", ["not valid TOML"]),
        ("device = 'tpu'\n", ["[tool.gradtrace] device = 'tpu': not a device"]),
    ],
)
def test_bad_config_is_a_usage_error_naming_the_key(runner, project, body, fragments):
    path = write_config(project, body)
    with pytest.raises(UsageError):
        load_config(project)
    for command in (["check", sample("mlp")], ["run", sample("mlp")]):
        result = invoke(runner, *command)
        assert result.exit_code == 2, result.output
        assert result.stdout == ""
        assert str(path.resolve()) in result.stderr or "pyproject.toml" in result.stderr
        for fragment in fragments:
            assert fragment in result.stderr, result.stderr


def test_every_key_is_an_option_of_run_or_check():
    import typer.main

    command = typer.main.get_command(app)
    options = {opt for name in ("run", "check") for p in command.commands[name].params for opt in p.opts}
    for key in KEYS:
        assert key == "targets" or f"--{key}" in options, key


# Thresholds and checks from the file --------------------------------------------------------------


def test_threshold_from_pyproject_applies_and_the_flag_overrides_it(runner, project):
    norms = mlp_norms()
    largest = max(norms, key=norms.get)
    total = math.sqrt(sum(v * v for v in norms.values()))
    limit = sorted(norms.values())[-2] * 1.001  # only the largest parameter (and the total) above it
    write_config(project, f"max-grad-norm = {limit!r}\n")
    result = invoke(runner, "check", sample("mlp"))
    assert result.exit_code == 1, result.output
    failing = [line for line in result.stdout.splitlines() if line.startswith("FAIL ") and "grows past" not in line]
    assert len(failing) == 2
    assert any(f" {largest} " in line for line in failing) and total > limit
    assert any("(all parameters)" in line for line in failing)
    result = invoke(runner, "check", sample("mlp"), "--max-grad-norm", f"{total * 2:g}")
    assert result.exit_code == 0, result.output


def test_min_threshold_from_pyproject(runner, project):
    norms = mlp_norms()
    write_config(project, f"min-grad-norm = {max(norms.values()) * 2!r}\n")
    result = invoke(runner, "check", sample("mlp"))
    assert result.exit_code == 1
    assert sum(line.startswith("FAIL ") for line in result.stdout.splitlines()) == len(norms) + 1


def test_fail_on_and_warn_on_from_pyproject(runner, project):
    """A check named on the command line replaces what the config says of it, and of it alone: adding one in a CI
    step does not switch off the project's others."""
    write_config(project, 'fail-on = ["zero"]\n')
    assert invoke(runner, "check", sample("zero_gate")).exit_code == 1
    assert invoke(runner, "check", sample("zero_gate"), "--fail-on", "nonfinite").exit_code == 1  # zero still fails
    assert invoke(runner, "check", sample("zero_gate"), "--warn-on", "zero").exit_code == 0  # named: it warns
    write_config(project, 'warn-on = "nograd"\n')
    assert invoke(runner, "check", sample("forgotten_layer")).exit_code == 0
    assert invoke(runner, "check", sample("forgotten_layer"), "--warn-on", "zero").exit_code == 0  # nograd still warns
    assert invoke(runner, "check", sample("forgotten_layer"), "--fail-on", "nograd").exit_code == 1
    write_config(project, 'fail-on = ["zero"]\nwarn-on = ["nograd"]\n')
    assert invoke(runner, "check", sample("forgotten_layer"), "--fail-on", "norm", "--max-grad-norm", "1e9").exit_code == 0


def test_a_configured_norm_check_goes_with_thresholds_switched_off(runner, project):
    """``fail-on = ["norm"]`` with a configured threshold, which ``--max-grad-norm inf`` unsets as the README says:
    the configured norm check goes with it (it was a usage error saying a threshold was needed); named on the
    command line, it still is one."""
    write_config(project, 'fail-on = ["norm"]\nmax-grad-norm = 1e-6\n')
    assert invoke(runner, "check", sample("mlp")).exit_code == 1
    off = invoke(runner, "check", sample("mlp"), "--max-grad-norm", "inf")
    assert off.exit_code == 0 and "(nonfinite, nograd, zero checked)" in off.stdout, off.output
    named = invoke(runner, "check", sample("mlp"), "--max-grad-norm", "inf", "--fail-on", "norm")
    assert named.exit_code == 2 and "--fail-on names norm, which needs a threshold" in named.stderr


@pytest.mark.parametrize("command", ["run", "check"])
def test_fail_on_and_warn_on_repeat_and_add_up(runner, project, command):
    """``--fail-on zero --fail-on nograd`` is ``--fail-on zero,nograd``, in either order (the last one alone
    was kept: a gate dropped without a word)."""
    for options in (["zero", "nograd"], ["nograd", "zero"], ["zero,nograd"]):
        args = [part for check in options for part in ("--fail-on", check)]
        result = invoke(runner, command, sample("zero_gate"), *args)
        assert result.exit_code == 1, (options, result.stdout)
    result = invoke(runner, command, sample("zero_gate"), "--fail-on", "zero", "--warn-on", "nograd", "--warn-on", "zero")
    assert result.exit_code == 2 and "zero named in both --fail-on and --warn-on" in result.stderr


def test_thresholds_from_pyproject_apply_to_run(runner, project):
    write_config(project, "max-grad-norm = 0.001\n")
    result = invoke(runner, "run", sample("mlp"))
    assert result.exit_code == 1
    assert "FAIL norm" in result.stdout


# Inputs, seed and targets from the file -----------------------------------------------------------


def test_inputs_and_seed_from_pyproject_and_overrides(runner, project):
    write_config(project, 'input = ["float32[5,16]"]\nseed = 7\n')
    document = json.loads(invoke(runner, "run", sample("mlp"), "--json", "-").stdout)
    assert document["meta"]["seed"] == 7
    assert document["meta"]["inputs"][0]["shape"] == [5, 16]
    result = invoke(runner, "run", sample("mlp"), "--json", "-", "-i", "float32[3,16]", "--seed", "1")
    document = json.loads(result.stdout)
    assert document["meta"]["seed"] == 1
    assert document["meta"]["inputs"][0]["shape"] == [3, 16]


def test_boolean_keys_from_pyproject_can_be_turned_off_on_the_command_line(runner, project):
    write_config(project, "eval = true\nno-input-grad = true\nno-sources = true\n")

    def traced(*options: str) -> dict:
        result = invoke(runner, "run", sample("mlp"), "--json", "-", *options)
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout)

    def inputs(document: dict) -> list[str]:
        return [n["param"] for n in document["nodes"] if (n["param"] or "").startswith("input:")]

    def sources(document: dict) -> list[str]:
        return [n["source"] for n in document["nodes"] if n["source"]]

    configured = traced()
    assert configured["meta"]["training"] is False and inputs(configured) == [] and sources(configured) == []
    overridden = traced("--no-eval", "--input-grad", "--sources")
    assert overridden["meta"]["training"] is True  # the mode the model is in: built in train mode
    assert inputs(overridden) == ["input:0"] and sources(overridden)


def test_command_line_overrides_reach_the_launched_ranks(runner, project, monkeypatch):
    """The ranks read [tool.gradtrace] again: what the command line gave must reach them, also where it
    equals an option's default (--seed 0 over seed = 7) or turns a boolean off (--no-eval)."""
    import tracer_cli.distributed as distributed

    write_config(project, "seed = 7\neval = true\nno-input-grad = true\n")
    launched: list[list[str]] = []
    monkeypatch.setattr(distributed, "launch", lambda n, argv: launched.append(list(argv)) or 0)
    result = invoke(runner, "run", "--nproc-per-node", "2", "--seed", "0", "--no-eval", "--input-grad", sample("mlp"))
    assert result.exit_code == 0, result.output
    (argv,) = launched
    assert "--no-eval" in argv and "--input-grad" in argv
    assert argv[argv.index("--seed") + 1] == "0"
    invoke(runner, "run", "--nproc-per-node", "2", sample("mlp"))  # nothing given: the ranks read the file
    assert launched[1] == ["run", sample("mlp")]


def test_a_missing_model_file_is_said_once_before_any_rank_starts(runner, project, monkeypatch):
    from tracer_cli import distributed

    launched: list[list[str]] = []
    monkeypatch.setattr(distributed, "launch", lambda n, argv: launched.append(list(argv)) or 0)
    result = invoke(runner, "run", "--nproc-per-node", "2", str(project / "missing.py"))
    assert result.exit_code == 2 and "model file not found" in result.stderr
    assert not launched


def test_a_usage_error_on_a_rank_other_than_0_is_said_by_it_after_a_pause(runner, project, monkeypatch):
    """Rank 0 says what is wrong when every rank has it (torchrun then stops the others); where a rank
    alone has it (a file its machine lacks), that rank says it, after a pause, with its prefix."""
    from tracer_cli import cli

    pauses: list[float] = []
    monkeypatch.setattr("time.sleep", pauses.append)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    result = invoke(runner, "run", sample("mlp"), "--ranks", "0,5")  # (as a config only rank 1's machine has)
    assert result.exit_code == 2
    assert pauses == [cli.RANK_ALONE_AFTER_S]
    (first, *_) = result.stderr.splitlines()
    assert first.startswith("[rank1] gradtrace: error: ") and "5" in first


def test_inputs_on_the_command_line_replace_config_specs(runner, project):
    write_config(project, 'input = ["float32[5,16]"]\n')
    saved = project / "inputs.pt"
    torch.save((torch.ones(2, 16),), saved)
    result = invoke(runner, "run", sample("mlp"), "--json", "-", "--inputs", str(saved))
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["meta"]["inputs"][0]["shape"] == [2, 16]


def test_config_inputs_file_is_relative_to_the_pyproject(runner, project, monkeypatch):
    (project / "data").mkdir()
    (project / "data" / "inputs.json").write_text('["float32[4,16]"]')
    write_config(project, 'inputs = "data/inputs.json"\n')
    nested = project / "deep" / "er"
    nested.mkdir(parents=True)
    monkeypatch.chdir(nested)
    result = invoke(runner, "run", sample("mlp"), "--json", "-")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["meta"]["inputs"][0]["shape"] == [4, 16]


def test_targets_from_pyproject(runner, project, monkeypatch):
    models = project / "models"
    models.mkdir()
    for name in ("mlp", "forgotten_layer"):
        (models / f"{name}.py").write_text((SAMPLES / f"{name}.py").read_text())
    write_config(project, 'targets = ["models/mlp.py", "models/forgotten_layer.py:build_model"]\n')
    sub = project / "sub"
    sub.mkdir()
    monkeypatch.chdir(sub)  # targets are relative to the pyproject.toml, not to the working folder
    result = invoke(runner, "check")
    assert result.exit_code == 1, result.output
    assert f"{Path('..') / 'models' / 'mlp.py'} · 16 nodes" in result.stdout
    assert "norm.weight" in result.stdout
    # targets on the command line replace the configured ones
    result = invoke(runner, "check", sample("mlp"))
    assert result.exit_code == 0, result.output
    assert "forgotten_layer" not in result.stdout


def test_both_input_keys_in_config_is_a_usage_error_before_the_model_is_built(runner, project):
    write_config(project, "input = 'float32[2,16]'\ninputs = 'x.pt'\n")
    result = invoke(runner, "run", sample("mlp"))
    assert result.exit_code == 2 and "[tool.gradtrace] sets both input and inputs" in result.stderr, result.stderr
    # either on the command line replaces both keys
    assert invoke(runner, "run", sample("mlp"), "-i", "float32[2,16]").exit_code == 0
