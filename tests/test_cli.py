"""The command line as users call it: exit codes, stdout and stderr separately, clean errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tracer_cli.cli import app

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "sample_models"


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def invoke(runner: CliRunner, *args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def write_model(tmp_path: Path, body: str, name: str = "model_file.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def node_lines(text: str) -> list[str]:
    """The tree's node lines (not the summary's)."""
    return [line for line in text.splitlines() if re.search(r"[├└]── #\d+ ", line)]


def strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"bare {constant} in JSON")

    return json.loads(text, parse_constant=refuse)


MLP_FILE = """
    import torch
    import torch.nn as nn

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def example_inputs():
        return torch.randn(3, 4)
"""


def test_run_prints_tree_and_summary(runner, tmp_path):
    path = write_model(tmp_path, MLP_FILE)
    result = invoke(runner, "run", str(path))
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    for expected in ("AddmmBackward0", "TBackward0", "AccumulateGrad", "0.weight", "grad_in", "grad_out", "loss"):
        assert expected in out
    assert "11 traced, 11 ran" in out
    assert result.stderr == ""


def test_json_to_stdout_is_strict_and_alone(runner):
    result = invoke(runner, "run", str(SAMPLES / "nan_where.py"), "--json", "-")
    assert result.exit_code == 0, result.stderr
    document = strict_json(result.stdout)  # the JSON document alone: no tree around it
    assert document["schema"] == "gradtrace/1"
    assert [n["id"] for n in document["nodes"]] == list(range(len(document["nodes"])))
    norms = [s["norm"] for n in document["nodes"] for s in (n["grad_inputs"] or []) if s]
    assert "nan" in norms  # non-finite norms are strings
    assert document["summary"]["first_nonfinite"]["kind"] == "nan"
    assert set(document["meta"]) >= {
        "target", "torch", "device", "rank", "world_size", "seed", "loss", "loss_rule", "inputs", "timings_s"
    }
    assert set(document["meta"]["timings_s"]) == {"forward", "backward", "total"}


def test_json_to_stdout_stays_alone_when_the_model_prints(tmp_path):
    """With --json -, what the model file prints (print(), or C code writing to file descriptor 1) goes to
    stderr: stdout is the JSON document alone, for a pipe into jq."""
    path = write_model(
        tmp_path,
        """
        import os

        import torch
        import torch.nn as nn

        print("loading the model file")


        class Chatty(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 2)

            def forward(self, x):
                print("in forward")
                os.write(1, b"straight to fd 1\\n")
                return self.fc(x)


        def build_model():
            return Chatty()


        def example_inputs():
            return torch.randn(3, 4)
        """,
    )
    result = subprocess.run(
        [sys.executable, "-m", "tracer_cli", "run", str(path), "--json", "-"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    document = strict_json(result.stdout)
    assert document["meta"]["module_types"] == {"": "Chatty", "fc": "Linear"}
    for printed in ("loading the model file", "in forward", "straight to fd 1"):
        assert printed in result.stderr
    result = subprocess.run([sys.executable, "-m", "tracer_cli", "run", str(path)], capture_output=True, text=True)
    assert "in forward" in result.stdout and "straight to fd 1" in result.stdout  # without --json -: as printed


@pytest.mark.parametrize("closed", [1, 2])
def test_a_closed_stdout_or_stderr_is_no_internal_error(tmp_path, closed):
    """``gradtrace run model.py ... >&-`` (a CI step that closes stdout): the exit code is the verdict's, and the
    JSON file is written (it was exit 70, "internal error", as Python's sys.stdout is None there)."""
    out = tmp_path / "trace.json"
    for sample, verdict in (("mlp", 0), ("nan_where", 1)):
        command = [sys.executable, "-m", "tracer_cli", "run", str(SAMPLES / f"{sample}.py"), "--json", str(out), "--fail-on", "nonfinite"]
        result = subprocess.run(command, preexec_fn=lambda: os.close(closed), capture_output=closed != 1, text=True, check=False)
        assert result.returncode == verdict, result.stderr
        assert strict_json(out.read_text())["meta"]["target"].endswith(f"{sample}.py")


def test_torchrun_options_in_one_process_say_they_are_ignored(runner):
    """--ranks and --rank-seed on the command line of one process: traced as usual, with a note that they do
    nothing here (they were accepted without a word); none where neither is given."""
    result = invoke(runner, "run", str(SAMPLES / "mlp.py"), "--ranks", "0", "--rank-seed")
    assert result.exit_code == 0, result.output
    assert "--rank-seed and --ranks only apply under torchrun" in result.stderr
    assert "only appl" not in invoke(runner, "run", str(SAMPLES / "mlp.py")).stderr


def test_json_file_and_tree(runner, tmp_path):
    out = tmp_path / "trace.json"
    result = invoke(runner, "run", str(SAMPLES / "mlp.py"), "--json", str(out))
    assert result.exit_code == 0, result.stderr
    assert "AddmmBackward0" in result.stdout
    document = strict_json(out.read_text())
    assert document["meta"]["inputs"][0]["name"] == "input:0"
    assert document["summary"]["nodes"] == len(document["nodes"])
    # forward values are recorded with --json: a node made inside an op (the Linear's TBackward0) has null
    assert all("forward" in node for node in document["nodes"])
    inside = [n["forward"] for n in document["nodes"] if n["name"] == "TBackward0"]
    assert inside and inside == [None] * len(inside)


def test_input_specs_override_example_inputs(runner, tmp_path):
    path = write_model(tmp_path, MLP_FILE)
    result = invoke(runner, "run", str(path), "-i", "float64[5,4]", "--json", "-")
    # float64 input into a float32 Linear raises in the user's forward: a model error, not a crash
    assert result.exit_code == 3
    result = invoke(runner, "run", str(path), "-i", "float32[5,4]", "--json", "-")
    document = strict_json(result.stdout)
    assert document["meta"]["inputs"] == [{"name": "input:0", "shape": [5, 4], "dtype": "float32"}]


def test_keyword_inputs_and_named_attribute(runner, tmp_path):
    path = write_model(
        tmp_path,
        """
        import torch

        def scale(x, *, w):
            return (x * w).sum()

        def other():
            return scale
        """,
    )
    result = invoke(runner, "run", f"{path}:scale", "-i", "float32[3]", "-i", "w=float32[3]:ones", "--json", "-")
    assert result.exit_code == 0, result.stderr
    document = strict_json(result.stdout)
    params = {n["param"] for n in document["nodes"]}
    assert {"input:0", "input:w"} <= params
    # a factory (no required parameters) is called to build the model
    result = invoke(runner, "run", f"{path}:other", "-i", "float32[3]", "-i", "w=float32[3]", "--json", "-")
    assert result.exit_code == 0, result.stderr


def test_package_module_target(runner, tmp_path, monkeypatch):
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(
        textwrap.dedent(
            """
            import torch.nn as nn

            def build_small():
                return nn.Sequential(nn.Linear(3, 2), nn.Tanh())
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = invoke(runner, "run", "mypkg.models:build_small", "-i", "float32[2,3]", "--view", "graph")
    assert result.exit_code == 0, result.stderr
    assert "TanhBackward0" in result.stdout


def test_model_file_sees_its_own_path_as_argv(runner, tmp_path):
    """As under ``python model.py``: argparse at import takes its defaults, and gradtrace's argv comes back."""
    path = write_model(
        tmp_path,
        """
        import argparse
        import json
        import pathlib
        import sys

        import torch
        import torch.nn as nn

        pathlib.Path(__file__).with_name("argv.json").write_text(json.dumps(sys.argv))
        parser = argparse.ArgumentParser()
        parser.add_argument("--width", type=int, default=3)
        args = parser.parse_args()
        model = nn.Linear(4, args.width)

        def example_inputs():
            return torch.randn(2, 4)
        """,
    )
    before = list(sys.argv)
    result = invoke(runner, "run", str(path), "--json", "-")
    assert result.exit_code == 0, result.stderr
    assert [n["grad_outputs"][0]["shape"] for n in strict_json(result.stdout)["nodes"] if n["param"] == "bias"] == [[3]]
    assert json.loads((tmp_path / "argv.json").read_text()) == [str(path)]
    assert sys.argv == before


@pytest.mark.parametrize("option", ["--json", "--svg", "--html", "--dot"])
def test_unwritable_output_is_refused_before_the_model_runs(runner, tmp_path, option):
    marker = tmp_path / "imported"
    path = write_model(tmp_path, f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n" + textwrap.dedent(MLP_FILE))
    result = invoke(runner, "run", str(path), option, str(tmp_path / "missing" / "out"))
    assert result.exit_code == 2, result.stderr
    assert "cannot write" in result.stderr and "no folder" in result.stderr
    result = invoke(runner, "run", str(path), option, str(tmp_path))  # a folder, not a file
    assert result.exit_code == 2 and "it is a folder" in result.stderr
    assert not marker.exists()  # refused before the model file was imported
    result = invoke(runner, "run", str(path), option, str(tmp_path / "out"))
    assert result.exit_code == 0, result.stderr
    assert marker.exists() and (tmp_path / "out").stat().st_size > 0


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no file can be made")
def test_output_that_cannot_be_created_is_refused_before_the_model_runs(runner, tmp_path):
    """/proc is a folder that passes every permission test, even as root, and holds no new file."""
    marker = tmp_path / "imported"
    path = write_model(tmp_path, f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n" + textwrap.dedent(MLP_FILE))
    result = invoke(runner, "run", str(path), "--dot", "/proc/gradtrace-test.dot")
    assert result.exit_code == 2 and "cannot write /proc/gradtrace-test.dot" in result.stderr
    assert not marker.exists()


def test_output_check_tolerates_other_ranks_checking_the_same_path(tmp_path, monkeypatch):
    """Every rank of a job checks the output path at once: a file another rank's check just made, or just
    removed, is not an error. A file an earlier run left is removed (a failing run leaves no stale result)."""
    from tracer_cli.cli import _check_writable

    out = tmp_path / "out.json"
    out.write_text("earlier")
    _check_writable(str(out), "--json")
    assert not out.exists()
    out.write_text("kept")
    monkeypatch.setattr(Path, "exists", lambda self: False)  # another rank made it after this rank looked
    _check_writable(str(out), "--json")
    assert out.read_text() == "kept"
    monkeypatch.undo()
    out.unlink()
    monkeypatch.setattr(Path, "exists", lambda self: self == out or Path.is_dir(self))  # ... removed it meanwhile
    _check_writable(str(out), "--json")
    monkeypatch.undo()
    assert not out.exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_json_to_a_named_pipe_is_written_whole(runner, tmp_path):
    """The output check must not open a pipe (its reader would see the end and leave; the write would hang)."""
    import threading

    pipe = tmp_path / "out.fifo"
    os.mkfifo(pipe)
    received = []
    reader = threading.Thread(target=lambda: received.append(pipe.read_text()), daemon=True)
    reader.start()
    command = [sys.executable, "-m", "tracer_cli", "run", str(SAMPLES / "mlp.py"), "--json", str(pipe)]
    job = subprocess.run(command, capture_output=True, text=True, timeout=120)  # a hang fails here
    reader.join(timeout=60)
    assert job.returncode == 0 and received, job.stderr
    assert strict_json(received[0])["schema"] == "gradtrace/1"


def test_output_check_leaves_no_file_when_the_model_fails(runner, tmp_path):
    path = write_model(tmp_path, "import torch\n\ndef model(x):\n    raise RuntimeError('boom')\n\n"
                       "def example_inputs():\n    return torch.ones(2)\n")
    out = tmp_path / "out.json"
    result = invoke(runner, "run", str(path), "--json", str(out))
    assert result.exit_code == 3
    assert not out.exists()


def test_eval_flag_and_mode_restored(runner, tmp_path):
    path = write_model(
        tmp_path,
        """
        import torch
        import torch.nn as nn

        model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
        model.train()

        def example_inputs():
            return torch.randn(2, 4)
        """,
    )
    result = invoke(runner, "run", str(path), "--eval", "--json", "-")
    assert strict_json(result.stdout)["meta"]["training"] is False
    result = invoke(runner, "run", str(path), "--json", "-")
    assert strict_json(result.stdout)["meta"]["training"] is True


@pytest.mark.parametrize(
    "body, args, code, fragments",
    [
        (None, ["run", "does_not_exist.py"], 2, ["not found", "does_not_exist.py"]),
        ("def broken(:\n    pass\n", [], 3, ["syntax error", "model_file.py:1"]),
        ("x = 1\n", [], 3, ["neither `model` nor `build_model`"]),
        (MLP_FILE, [":nothing"], 3, ["no attribute 'nothing'", "hint"]),
        (
            "import torch.nn as nn\nbig = nn.Linear(8, 8)\ndef build_small(width=4):\n    return nn.Linear(width, width)\n"
            "def helper(x):\n    return x\ndef example_inputs():\n    return None\n",
            [":nothing"],
            3,
            ["models found there: big, build_small\n"],
        ),
        ("import torch.nn as nn\nmodel = nn.Linear(2, 2)\n", [], 2, ["no inputs", "-i"]),
        (MLP_FILE, ["-i", "float32[8,x]"], 2, ["'float32[8,x]'", "DTYPE"]),
        (MLP_FILE, ["-i", "float32[3,5]"], 3, ["forward in module '0' (Linear)", "RuntimeError", "input:0 float32[3,5]"]),
        (MLP_FILE, ["--filter", "("], 2, ["--filter"]),
        (
            "import torch\nimport torch.nn as nn\ndef build_model(width):\n    return nn.Linear(width, width)\n"
            "def example_inputs():\n    return torch.randn(2, 4)\n",
            [],
            3,
            ["model_file.py:build_model takes arguments (width)", "give its parameters defaults"],
        ),
        (
            "import torch\ndef model(x=None):\n    return x\ndef example_inputs():\n    return torch.randn(2, 4)\n",
            [],
            3,
            ["model() returned a NoneType, not a model", "called as a factory because all its parameters have defaults"],
        ),
        (MLP_FILE, ["-i", "float32[3,4]", "--inputs", "x.pt"], 2, ["use either --input specs or --inputs FILE"]),
        (MLP_FILE, ["--device", "nonsense"], 2, ["invalid device"]),
        (MLP_FILE, ["--device", "meta"], 2, ["'meta' holds no values"]),
        (
            "import torch.nn as nn\n\nclass Net(nn.Module):\n    def __init__(self, hidden):\n"
            "        super().__init__()\n",
            [":Net"],
            3,
            ["missing 1 required positional argument", "Net takes arguments (hidden)", "build_model()"],
        ),
        (
            "import torch\nimport torch.nn as nn\nmodel = nn.Linear(2, 2)\nfor p in model.parameters():\n"
            "    p.requires_grad_(False)\ndef example_inputs():\n    return torch.randn(1, 2)\n",
            ["--no-input-grad"],
            3,
            ["does not require grad"],
        ),
        (
            "import torch\nimport torch.nn as nn\n\nclass Bad(nn.Module):\n    def forward(self, x):\n"
            "        raise ValueError('my model is broken')\n\nmodel = Bad()\n"
            "def example_inputs():\n    return torch.randn(1)\n",
            [],
            3,
            ["ValueError: my model is broken", "model_file.py\", line 6", "raise ValueError"],
        ),
        ("raise ImportError('missing dependency foo')\n", [], 3, ["importing", "missing dependency foo"]),
        ("import sys\nsys.exit('bye')\n", [], 3, ["importing", "SystemExit: bye", "sys.exit()"]),
        (
            "import argparse\nparser = argparse.ArgumentParser()\nparser.add_argument('--data', required=True)\n"
            "args = parser.parse_args()\n",
            [],
            3,
            ["SystemExit: 2", "argparse", "__main__"],
        ),
        (
            "import sys\nimport torch\nimport torch.nn as nn\n\nclass Quits(nn.Module):\n    def forward(self, x):\n"
            "        sys.exit(5)\n\nmodel = Quits()\ndef example_inputs():\n    return torch.randn(1)\n",
            [],
            3,
            ["forward", "SystemExit: 5", "model_file.py\", line 7"],
        ),
    ],
)
def test_errors_are_one_clear_message(runner, tmp_path, body, args, code, fragments):
    if body is None:
        argv = args
    else:
        path = write_model(tmp_path, body)
        extra = list(args)
        target = str(path)
        if extra and extra[0].startswith(":"):
            target += extra.pop(0)
        argv = ["run", target, *extra]
    result = invoke(runner, *argv)
    assert result.exit_code == code, (result.stdout, result.stderr)
    assert result.stdout == ""
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr
    assert "tracer_cli" not in result.stderr  # no gradtrace-internal frames
    assert "Traceback (most recent call last)" not in result.stderr


def test_cuda_unavailable_is_usage_error(runner, tmp_path):
    if torch.cuda.is_available():  # pragma: no cover - CPU CI
        pytest.importorskip("this_module_does_not_exist_on_gpu_machines")
    path = write_model(tmp_path, MLP_FILE)
    result = invoke(runner, "run", str(path), "--device", "cuda")
    assert result.exit_code == 2
    assert "CUDA is not available" in result.stderr


def _usable(device: str) -> bool:
    try:
        torch.empty(0, device=device)
    except Exception:  # noqa: BLE001 (any refusal: not usable here)
        return False
    return True


@pytest.mark.parametrize("device", ["mps", "xpu", f"cuda:{torch.cuda.device_count()}"])
def test_a_device_this_torch_cannot_use_is_a_usage_error(runner, tmp_path, device):
    """A device of a type this torch was not built for, or a GPU index past the last one: exit 2 and why, not
    an internal error."""
    if _usable(device):  # pragma: no cover - a Mac's MPS, an Intel GPU
        pytest.skip(f"{device} is usable here")
    path = write_model(tmp_path, MLP_FILE)
    result = invoke(runner, "run", str(path), "--device", device)
    assert result.exit_code == 2, result.stderr
    assert f"device {device!r}" in result.stderr and "internal error" not in result.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sample", ["mlp", "transformer", "nan_where"])
def test_a_run_on_cuda_traces_what_a_run_on_the_cpu_does(runner, tmp_path, sample):  # pragma: no cover - GPU only
    """``--device cuda``: the same nodes, modules and gradient norms (float32 rounding apart) as on the CPU, the
    same findings, forward values included (the inputs are made on the CPU and moved, so they are the same)."""
    documents = {}
    for device in ("cpu", "cuda"):
        path = tmp_path / f"{device}.json"
        result = invoke(runner, "run", str(SAMPLES / f"{sample}.py"), "--device", device, "--json", str(path))
        assert result.exit_code in (0, 1), result.stderr
        documents[device] = (result.exit_code, strict_json(path.read_text()))
    (cpu_code, cpu), (cuda_code, cuda) = documents["cpu"], documents["cuda"]
    assert cuda["meta"]["device"].startswith("cuda") and cuda_code == cpu_code
    assert [(n["name"], n["module"], n["param"]) for n in cuda["nodes"]] == [(n["name"], n["module"], n["param"]) for n in cpu["nodes"]]

    def norms(document):
        return [
            stat and stat["norm"]
            for node in document["nodes"]
            for stat in [*node["grad_inputs"], *node["grad_outputs"], node["forward"]]
        ]

    assert norms(cuda) == pytest.approx(norms(cpu), rel=1e-4, abs=1e-6, nan_ok=True)


def test_malicious_pt_inputs_never_execute(runner, tmp_path):
    import pickle

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    bad = tmp_path / "inputs.pt"
    with open(bad, "wb") as handle:
        pickle.dump(Payload(), handle)
    path = write_model(tmp_path, MLP_FILE)
    result = invoke(runner, "run", str(path), "--inputs", str(bad))
    assert result.exit_code == 2
    assert "inputs.pt" in result.stderr
    assert not marker.exists()


def test_inputs_file_pt_and_json(runner, tmp_path):
    path = write_model(tmp_path, MLP_FILE)
    saved = tmp_path / "inputs.pt"
    torch.save((torch.ones(2, 4),), saved)
    result = invoke(runner, "run", str(path), "--inputs", str(saved), "--json", "-")
    assert result.exit_code == 0, result.stderr
    assert strict_json(result.stdout)["meta"]["inputs"][0]["shape"] == [2, 4]
    specs = tmp_path / "inputs.json"
    specs.write_text('["float32[6,4]"]')
    result = invoke(runner, "run", str(path), "--inputs", str(specs), "--json", "-")
    assert strict_json(result.stdout)["meta"]["inputs"][0]["shape"] == [6, 4]


def test_internal_error_exit_70_and_debug(runner, tmp_path, monkeypatch):
    path = write_model(tmp_path, MLP_FILE)

    def explode(*args, **kwargs):
        raise RuntimeError("boom inside gradtrace")

    monkeypatch.setattr("tracer_cli.tracing.trace", explode)
    result = invoke(runner, "run", str(path))
    assert result.exit_code == 70
    assert "internal error" in result.stderr and "--debug" in result.stderr
    assert "Traceback" not in result.stderr
    result = invoke(runner, "run", str(path), "--debug")
    assert result.exit_code == 70
    assert "Traceback" in result.stderr and "explode" in result.stderr


def test_interrupt_exits_130(runner, tmp_path, monkeypatch):
    path = write_model(tmp_path, MLP_FILE)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("tracer_cli.tracing.trace", interrupted)
    result = invoke(runner, "run", str(path))
    assert result.exit_code == 130
    assert "interrupted" in result.stderr


def test_bounded_output_and_all(runner, tmp_path):
    path = write_model(
        tmp_path,
        """
        import torch

        def model(x):
            for _ in range(300):
                x = x * 1.001
            return x.sum()

        def example_inputs():
            return torch.ones(2)
        """,
    )
    result = invoke(runner, "run", str(path))
    assert result.exit_code == 0
    assert "more node lines not shown" in result.stdout
    assert len(node_lines(result.stdout)) == 200
    result = invoke(runner, "run", str(path), "--all")
    assert sum("MulBackward0" in line for line in node_lines(result.stdout)) == 300
    assert "not shown" not in result.stdout
    result = invoke(runner, "run", str(path), "--max-nodes", "10", "--view", "graph")
    assert len(node_lines(result.stdout)) == 10
    # a straight chain does not indent a level per node
    widths = [len(line) - len(line.lstrip(" │├└─")) for line in result.stdout.splitlines() if "MulBackward0" in line]
    assert max(widths) <= 8


def test_node_lines_are_not_folded_when_stdout_is_not_a_terminal(runner, monkeypatch):
    """In a CI log or a file each node line stays whole (Rich folds at 80 columns there by default)."""
    monkeypatch.delenv("COLUMNS", raising=False)
    result = invoke(runner, "run", str(SAMPLES / "transformer.py"))
    assert result.exit_code == 0
    lines = [line for line in node_lines(result.stdout) if "AccumulateGrad" not in line]
    assert lines and all("grad_in" in line and line.rstrip().endswith("‖") for line in lines), result.stdout
    assert max(map(len, lines)) > 80  # long enough that 80 columns would fold them


WIDE_FILE = """
    import torch
    from torch import nn

    class CatMany(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.name = "encoder_layer_with_a_rather_long_name_" * 3
            self.add_module(self.name, nn.Linear(4, 4))

        def forward(self, x):
            parts = [self.proj(x) * i for i in range(12)]
            return torch.cat(parts, dim=1) + 0 * getattr(self, self.name)(x).sum()

    def build_model():
        return CatMany()

    def example_inputs():
        return torch.randn(2, 4)
"""


def test_lines_longer_than_any_terminal_are_not_folded_either(runner, monkeypatch, tmp_path):
    """A node with a dozen inputs, a finding with a long parameter name: hundreds of columns, one line each."""
    monkeypatch.delenv("COLUMNS", raising=False)
    path = write_model(tmp_path, WIDE_FILE)
    result = invoke(runner, "run", str(path))
    assert result.exit_code == 0
    (cat,) = [line for line in node_lines(result.stdout) if "CatBackward0" in line]
    assert cat.count("(2, 4)") == 12 and "grad_out (2, 48)" in cat and len(cat) > 250, result.stdout
    result = invoke(runner, "check", str(path), "--warn-on", "zero")
    assert result.exit_code == 0
    rows = [line for line in result.stdout.splitlines() if "AccumulateGrad" in line]
    assert len(rows) == 2 and all(line.rstrip().endswith("(a dead parameter, or one whose output meets only zeros: LoRA's A while B is 0)") for line in rows), result.stdout
    assert all(line.startswith("warn") and len(line) > 250 for line in rows), result.stdout


def test_filter(runner):
    result = invoke(runner, "run", str(SAMPLES / "mlp.py"), "--filter", "fc2", "--all")
    assert result.exit_code == 0
    lines = node_lines(result.stdout)
    assert len(lines) == 4  # AddmmBackward0, TBackward0 and the two AccumulateGrad of fc2
    assert "fc1" not in "".join(lines) and "fc3" not in "".join(lines)


def test_help_does_not_import_torch():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from tracer_cli.cli import app\n"
        "for args in (['run', '--help'], ['check', '--help'], ['--help']):\n"
        "    r = CliRunner().invoke(app, args)\n"
        "    assert r.exit_code == 0, r.output\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_every_option_has_help():
    import typer.main

    command = typer.main.get_command(app)
    for name, sub in command.commands.items():
        assert sub.help, name
        for param in sub.params:
            if param.param_type_name == "option":
                assert param.help, f"{name} {param.opts}"


@pytest.mark.parametrize("command", ["run", "check", "diff"])
def test_help_in_80_columns_keeps_every_word_of_every_option(command):
    """Piped, or in an 80-column terminal, the help is wrapped, not cut short: every option and every word of its
    help is there (Typer's boxed help squeezed the descriptions into a 20-column strip and cut words with "…")."""
    import typer.main

    code = f"import sys\nsys.argv = ['gradtrace', {command!r}, '-h']\nfrom tracer_cli.cli import main\nmain()\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    assert max(map(len, result.stdout.splitlines())) <= 80 and "…" not in result.stdout
    squeezed = "".join(result.stdout.split())
    for param in typer.main.get_command(app).commands[command].params:
        if param.param_type_name == "option":
            assert all(opt in result.stdout for opt in param.opts), param.opts
            assert "".join(param.help.split()) in squeezed, param.help


def test_module_entry_point_and_console_script(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "tracer_cli", "run", str(SAMPLES / "classic_mul_div.py"), "--json", "-"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    document = strict_json(result.stdout)
    div = next(n for n in document["nodes"] if n["name"] == "DivBackward0")
    assert [s["norm"] for s in div["grad_inputs"]] == pytest.approx([0.5, 1.0])
    version = subprocess.run([sys.executable, "-m", "tracer_cli", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("gradtrace ")


def test_usage_error_exit_code_2(runner):
    result = runner.invoke(app, ["run"])
    assert result.exit_code == 2
    result = runner.invoke(app, ["run", str(SAMPLES / "mlp.py"), "--view", "sideways"])
    assert result.exit_code == 2


def test_reports_user_frames_only(tmp_path):
    path = write_model(
        tmp_path,
        """
        import torch

        def helper(x):
            return x.view(7, 7)

        def model(x):
            return helper(x).sum()

        def example_inputs():
            return torch.ones(3)
        """,
    )
    result = subprocess.run([sys.executable, "-m", "tracer_cli", "run", str(path)], capture_output=True, text=True)
    assert result.returncode == 3
    assert "in helper" in result.stderr and "in model" in result.stderr
    frames = [line for line in result.stderr.splitlines() if line.strip().startswith('File "')]
    assert len(frames) == 2  # model, then helper: nothing of gradtrace's or torch's
    assert not any("tracer_cli" in line or f"{os.sep}torch{os.sep}" in line for line in frames)


def test_readme_documents_every_option():
    import typer.main

    readme = (ROOT / "README.md").read_text()
    command = typer.main.get_command(app)
    for name, sub in command.commands.items():
        assert f"gradtrace {name}" in readme
        for param in sub.params:
            if param.param_type_name == "option" and "--help" not in param.opts:
                assert any(opt in readme for opt in param.opts), f"README does not mention {param.opts}"


def test_torchs_numpy_warning_does_not_open_the_output():
    """Where NumPy is not installed, importing torch warns about it; gradtrace does not use NumPy."""
    code = (
        "import sys\n"
        "sys.modules['numpy'] = None  # as where NumPy is not installed\n"
        f"sys.argv = ['gradtrace', 'run', {str(SAMPLES / 'mlp.py')!r}]\n"
        "from tracer_cli.cli import main\n"
        "main()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "NumPy" not in result.stderr and "AddmmBackward0" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--bogus", "x"], "No such option: --bogus"),
        (["run", str(SAMPLES / "mlp.py"), "--seed", "abc"], "Invalid value for '--seed'"),
        (["bogus"], "No such command 'bogus'."),
    ],
)
def test_an_option_that_does_not_parse_is_one_error_line_and_a_hint(args, message):
    """Typer's own parse errors are written as gradtrace's other usage errors (no box): exit 2."""
    code = f"import sys\nsys.argv = ['gradtrace', *{args!r}]\nfrom tracer_cli.cli import main\nmain()\n"
    environment = {**os.environ, "COLUMNS": "200"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, check=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("gradtrace: error: ") and message in lines[0]
    assert len(lines) == 2 and lines[1].startswith("hint: see gradtrace") and lines[1].endswith(" -h")
    assert result.stdout == ""


def test_a_bad_input_spec_is_reported_before_the_model_file_runs(runner, tmp_path):
    marker = tmp_path / "imported"
    model = write_model(
        tmp_path,
        f"""
        import pathlib
        import torch
        pathlib.Path({str(marker)!r}).write_text("imported")
        model = torch.nn.Linear(3, 1)
        """,
    )
    result = invoke(runner, "run", str(model), "-i", "float33[2,3]")
    assert result.exit_code == 2 and "unknown dtype 'float33'" in result.stderr
    assert not marker.exists()
    assert invoke(runner, "run", str(model), "-i", "float32[2,3]").exit_code == 0 and marker.exists()


def test_a_run_puts_back_only_the_modes_that_changed():
    """Putting back torch's deterministic mode imports torch._inductor's config and torch._dynamo (about a second
    on every run): a model that leaves the modes alone costs none of that."""
    code = (
        "import sys\n"
        "import torch\n"
        "before = set(sys.modules)\n"
        f"sys.argv = ['gradtrace', 'run', {str(SAMPLES / 'mlp.py')!r}]\n"
        "from tracer_cli.cli import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "print(sorted(m for m in set(sys.modules) - before if m.startswith(('torch._inductor', 'torch._dynamo'))))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


def test_a_model_file_that_changes_folder_or_torch_modes_does_not_move_the_rest(runner, tmp_path, monkeypatch):
    """``os.chdir`` to the file's own folder (a common idiom) and torch's global modes set at import are put
    back after each target: later targets, --json and --junit-xml are found where they were given."""
    (tmp_path / "models").mkdir()
    (tmp_path / "elsewhere").mkdir()
    first = write_model(
        tmp_path / "models",
        f"""
        import os
        import torch
        os.chdir({str(tmp_path / "elsewhere")!r})
        torch.set_default_dtype(torch.float64)
        torch.use_deterministic_algorithms(True)
        model = torch.nn.Linear(3, 1)
        def example_inputs():
            return torch.randn(2, 3)
        """,
        name="first.py",
    )
    write_model(
        tmp_path / "models",
        """
        import torch
        model = torch.nn.Linear(3, 1)
        def example_inputs():
            return torch.randn(2, 3, dtype=torch.float32)  # float64 weights would refuse it
        """,
        name="second.py",
    )
    monkeypatch.chdir(tmp_path)
    dtype, deterministic = torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled()
    result = invoke(runner, "check", "models/first.py", "models/second.py", "--junit-xml", "gate.xml")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "gate.xml").exists() and not (tmp_path / "elsewhere" / "gate.xml").exists()
    assert invoke(runner, "run", str(first), "--json", "out.json").exit_code == 0
    assert (tmp_path / "out.json").exists()
    assert torch.get_default_dtype() == dtype and torch.are_deterministic_algorithms_enabled() == deterministic
    assert os.getcwd() == str(tmp_path)


def test_a_helper_two_targets_import_registers_its_module_hooks_for_both(runner, tmp_path, monkeypatch):
    """A module both targets import (once, from one place) registers a hook for every module when imported: the
    second target is checked with it too, as it is alone (the verdict does not depend on the targets' order)."""
    (tmp_path / "guard.py").write_text(textwrap.dedent(
        """
        import torch
        from torch.nn.modules.module import register_module_forward_hook

        def guard(module, args, output):
            if isinstance(output, torch.Tensor) and not torch.isfinite(output).all():
                raise RuntimeError(f"guard: {type(module).__name__} made a non-finite output")

        register_module_forward_hook(guard)
        """
    ))
    body = """
        import torch
        import guard
        model = torch.nn.Linear(3, 1)
        with torch.no_grad():
            model.weight.fill_({value})
        def example_inputs():
            return torch.randn(2, 3)
        """
    write_model(tmp_path, body.format(value="1.0"), name="a.py")
    write_model(tmp_path, body.format(value="float('nan')"), name="b.py")
    monkeypatch.chdir(tmp_path)
    from torch.nn.modules import module as torch_module

    before = dict(torch_module._global_forward_hooks)
    try:
        alone = invoke(runner, "check", "b.py")
        both = invoke(runner, "check", "a.py", "b.py")
    finally:
        torch_module._global_forward_hooks.clear()
        torch_module._global_forward_hooks.update(before)
    assert alone.exit_code == 3 and "guard: Linear made a non-finite output" in alone.output, alone.output
    assert both.exit_code == 3 and "guard: Linear made a non-finite output" in both.output, both.output


def test_a_model_on_the_meta_device_is_a_model_error(runner, tmp_path):
    model = write_model(
        tmp_path,
        """
        import torch
        model = torch.nn.Linear(3, 1, device="meta")
        def example_inputs():
            return torch.randn(2, 3)
        """,
    )
    result = invoke(runner, "run", str(model))
    assert result.exit_code == 3 and "meta device" in result.stderr and "Traceback" not in result.output


def test_a_template_module_on_the_meta_device_stays_there(runner, tmp_path):
    """torch's model ensembling keeps a template copy of the module on the meta device and runs it with the
    stacked parameters (``functional_call`` under ``vmap``): the rest of the model is moved, the template left
    where it is (``.to()`` of it raised, and the model was refused), and its parameters, which have no values
    to train, are not said to have received no gradient."""
    source = """
        import copy

        import torch
        from torch import nn
        from torch.func import functional_call, stack_module_state, vmap

        class Ensemble(nn.Module):
            def __init__(self, members=3):
                super().__init__()
                nets = [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)) for _ in range(members)]
                params, _ = stack_module_state(nets)
                self.names = list(params)
                self.stacked = nn.ParameterDict({k.replace(".", "_"): nn.Parameter(v) for k, v in params.items()})
                self.template = copy.deepcopy(nets[0]).to("meta")

            def forward(self, x):
                params = {name: self.stacked[name.replace(".", "_")] for name in self.names}
                return vmap(lambda p, x: functional_call(self.template, p, (x,)), in_dims=(0, None))(params, x).pow(2).mean()

        def build_model():
            torch.manual_seed(0)
            return Ensemble()

        def example_inputs():
            torch.manual_seed(1)
            return torch.randn(5, 4)
        """
    model = write_model(tmp_path, source)
    result = invoke(runner, "check", str(model), "--max-grad-norm", "1e9")
    assert result.exit_code == 0, result.output
    assert "nograd" not in result.stdout.replace("(nonfinite, nograd, zero", "")
    namespace: dict = {}
    exec(textwrap.dedent(source), namespace)  # noqa: S102 - the test's own model, run plainly
    plain = namespace["build_model"]()
    plain(namespace["example_inputs"]()).backward()
    total = torch.stack([p.grad.norm() for p in plain.stacked.values()]).norm().item()
    assert f"params ‖grad‖ {total:.3g}" in result.stdout, result.stdout


def test_json_to_stdout_still_writes_exports_and_says_why_it_fails(runner, tmp_path):
    dot, svg = tmp_path / "graph.dot", tmp_path / "tree.svg"
    args = ["run", str(SAMPLES / "nan_where.py"), "--json", "-", "--fail-on", "nonfinite", "--dot", str(dot), "--svg", str(svg)]
    result = invoke(runner, *args)
    assert result.exit_code == 1
    document = strict_json(result.stdout)  # stdout holds the JSON alone
    assert document["summary"]["first_nonfinite"]["name"] == "SqrtBackward0"
    assert "FAIL nonfinite" in result.stderr and "SqrtBackward0" in result.stderr
    # on stderr too, a finding stays one line in a log, longer than 80 columns, and ends in no space
    fail = next(line for line in result.stderr.splitlines() if line.startswith("FAIL nonfinite"))
    assert len(fail) > 80 and "SqrtBackward0" in fail and not fail.endswith(" "), result.stderr
    assert dot.read_text().startswith("digraph") and "SqrtBackward0" in svg.read_text()


@pytest.mark.parametrize("where", ["import", "forward"])
def test_os_exit_in_the_model_is_a_model_error_not_a_silent_success(tmp_path, where):
    """os._exit() would end gradtrace at once with the model's status, 0: a green CI job without a report."""
    call = "os._exit(0)"
    model = write_model(
        tmp_path,
        f"""
        import os
        import torch
        {call if where == "import" else ""}
        class Quits(torch.nn.Module):
            def forward(self, x):
                {call if where == "forward" else "return x.sum()"}
        model = Quits()
        def example_inputs():
            return torch.randn(2, requires_grad=True)
        """,
    )
    junit = tmp_path / "gate.xml"
    # in a process of its own: were os._exit() not caught, it would end this test session, with status 0
    command = [sys.executable, "-m", "tracer_cli", "check", str(SAMPLES / "mlp.py"), str(model), "--junit-xml", str(junit)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 3 and "SystemExit: 0" in result.stderr
    assert junit.exists() and "SystemExit" in junit.read_text()


@pytest.mark.parametrize("command", ["run", "check"])
def test_no_line_of_a_log_ends_in_spaces(runner, command, monkeypatch):
    """Rich pads table cells (the summary, the findings table with a two-line row); a log (not a terminal)
    gets each line as long as what it says, with colours (FORCE_COLOR) or without."""
    for colour in ("", "1"):
        monkeypatch.setenv("FORCE_COLOR", colour) if colour else monkeypatch.delenv("FORCE_COLOR", raising=False)
        result = invoke(runner, command, str(SAMPLES / "nan_forward.py"), "--max-grad-norm", "1")
        lines = result.stdout.splitlines()
        assert len(lines) > 10 and any("FAIL" in line for line in lines)
        assert not [line for line in lines if re.sub(r"\x1b\[[0-9;]*m", "", line).endswith(" ")], result.stdout
        assert ("\x1b[" in result.stdout) == bool(colour)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["run", "sample_models/mlp.py:"], "no NAME after ':' in target 'sample_models/mlp.py:'"),
        (["run", "sample_models"], "sample_models is a folder, not a Python file"),
        (["run", "pyproject.toml"], "the model file must be a .py file"),  # a file, not the module toml of a package
        (["run", "LICENSE"], "the model file must be a .py file"),
        (["run", "sample_models/mlp.py", "--json", ""], "--json was given an empty path"),
        (["run", "sample_models/mlp.py", "--json", "sample_models/mlp.py/out.json"], "'sample_models/mlp.py' is a file"),
        (["run", "sample_models/mlp.py", "--dot", "-"], "--dot -: only --json writes to stdout"),
        (["run", "sample_models/mlp.py", "--json", "sample_models/mlp.py"], "would write over a file this run reads"),
        (["check", "sample_models/mlp.py", "--junit-xml", "./sample_models/mlp.py"], "would write over a file this run reads"),
        (["check", "sample_models/mlp.py", "--junit-xml", "-"], "--junit-xml -: only --json writes to stdout"),
        (["run", "sample_models/mlp.py", "--ranks", "x"], "--ranks takes 'all' or a comma list"),
        (["run", "sample_models/mlp.py", "--ranks", ""], "--ranks takes 'all' or a comma list"),  # (printed no tree)
    ],
)
def test_usage_errors_say_what_is_wrong(runner, monkeypatch, args, fragment):
    monkeypatch.chdir(ROOT)
    result = invoke(runner, *args)
    assert result.exit_code == 2 and fragment in result.stderr, result.stderr
    assert not (ROOT / "-").exists()


def test_a_model_that_sets_requires_grad_on_its_inputs_work_is_traced_without_input_gradients(runner, tmp_path):
    """Hugging Face's Wav2Vec2 sets ``hidden_states.requires_grad = True`` in train mode, which torch refuses
    on a tensor made from inputs that require grad: the step is traced again without input gradients."""
    model = write_model(
        tmp_path,
        """
        import torch
        from torch import nn

        class SetsRequiresGrad(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 1)

            def forward(self, x):
                hidden = x * 2.0
                hidden.requires_grad = True
                return self.fc(hidden)

        model = SetsRequiresGrad()

        def example_inputs():
            return torch.randn(3, 4)
        """,
    )
    result = invoke(runner, "run", str(model), "--json", str(tmp_path / "out.json"))
    assert result.exit_code == 0, result.output
    assert "traced again without gradients for the inputs (--no-input-grad)" in result.stderr
    document = json.loads((tmp_path / "out.json").read_text())
    assert not [n for n in document["nodes"] if (n["param"] or "").startswith("input:")]
    assert {n["param"] for n in document["nodes"] if n["param"]} == {"fc.weight", "fc.bias"}


@pytest.mark.parametrize("changed", ["input", "parameter"])
def test_a_model_that_changes_its_input_in_place_is_traced_without_input_gradients(runner, tmp_path, changed):
    """``x.sub_(mean)`` on an input torch refuses only because gradtrace made the input require grad: traced
    again without. The same error from a parameter changed in place is the model's own, and stands."""
    model = write_model(
        tmp_path,
        f"""
        import torch
        from torch import nn

        class Normalises(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 1)

            def forward(self, x):
                {"x.sub_(x.mean())" if changed == "input" else "self.fc.weight.mul_(0.5)"}
                return self.fc(x)

        model = Normalises()

        def example_inputs():
            return torch.randn(3, 4)
        """,
    )
    result = invoke(runner, "run", str(model), "--json", str(tmp_path / "out.json"))
    if changed == "parameter":
        assert result.exit_code == 3 and "in-place operation" in result.stderr, result.output
        assert "traced again" not in result.stderr
        return
    assert result.exit_code == 0, result.output
    assert "the model changes an input in place" in result.stderr
    document = json.loads((tmp_path / "out.json").read_text())
    assert {n["param"] for n in document["nodes"] if n["param"]} == {"fc.weight", "fc.bias"}


@pytest.mark.parametrize("again", ["input-grad", "nan"])
def test_a_step_traced_again_starts_from_the_inputs_the_first_one_had(runner, tmp_path, again):
    """A forward that changes its inputs in place (``ids.add_(1)``) and is traced again, without input gradients
    (it also changes a float input in place) or with forward values (its loss is NaN), is traced on the inputs as
    they were: the second attempt saw ``ids + 2``, and numbers silently off."""
    changes = "x.mul_(2)" if again == "input-grad" else "pass"
    # NaN from ids as the first attempt changes them ([1, 2, 3] - 2 has a negative root), not from [2, 3, 4]
    loss = "(self.emb(ids) * x).pow(2).sum()" if again == "input-grad" else "(self.emb(ids) * x).sum() + (ids - 2.0).sqrt().sum()"
    source = f"""
        import torch
        from torch import nn

        class ChangesItsInputs(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(10, 4)

            def forward(self, ids, x):
                ids.add_(1)
                {changes}
                return {loss}

        def build_model():
            torch.manual_seed(0)
            return ChangesItsInputs()

        def example_inputs():
            return torch.tensor([0, 1, 2]), torch.ones(3, 4)
        """
    model = write_model(tmp_path, source)
    out = tmp_path / "out.json"
    result = invoke(runner, "check", str(model)) if again == "nan" else invoke(runner, "run", str(model), "--json", str(out))
    if again == "nan":
        assert result.exit_code == 1, result.output
        assert "does not repeat itself" not in result.stderr and "forward made a nan first at" in result.stdout, result.output
        return
    assert result.exit_code == 0, result.output
    namespace: dict = {}
    exec(textwrap.dedent(source), namespace)  # noqa: S102 - the test's own model, run plainly
    plain = namespace["build_model"]()
    loss = plain(*namespace["example_inputs"]())
    loss.backward()
    document = json.loads(out.read_text())
    assert document["meta"]["loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert document["param_grads"]["emb.weight"]["norm"] == pytest.approx(plain.emb.weight.grad.norm().item(), rel=1e-5)


def test_the_input_copy_puts_back_parameters_and_subclasses_and_leaves_out_inference_tensors():
    """What a second attempt starts from: a Parameter or a tensor subclass given as an input is put back as it was;
    an inference tensor (which nothing outside inference mode can change) is left out."""
    from tracer_cli.inputs import InputSnapshot

    class Tagged(torch.Tensor):
        pass

    parameter, tagged = torch.nn.Parameter(torch.randn(3)), torch.randn(2, 3).as_subclass(Tagged)
    with torch.inference_mode():
        frozen = torch.ones(2)
    before = [parameter.detach().clone(), tagged.detach().clone()]
    snapshot = InputSnapshot((parameter,), {"x": {"nested": [tagged, frozen]}})
    with torch.no_grad():
        parameter.mul_(2)
        tagged.t().add_(1)  # through a transposed view
    snapshot.restore()
    assert torch.equal(parameter.detach(), before[0]) and torch.equal(tagged.detach(), before[1])


@pytest.mark.parametrize("options", [[], ["--no-input-grad"]])
def test_inputs_made_in_inference_mode_are_traced(runner, tmp_path, options):
    """Inference tensors (``example_inputs()`` under ``torch.inference_mode``) track no version counter: the copy
    kept for a second attempt leaves them out (it ended the run with exit 70)."""
    model = write_model(
        tmp_path,
        """
        import torch

        model = torch.nn.Linear(4, 2)

        def example_inputs():
            with torch.inference_mode():
                return torch.ones(3, 4)
        """,
    )
    result = invoke(runner, "run", str(model), *options)
    assert result.exit_code == 0, result.output
    assert "AddmmBackward0" in result.stdout


def test_an_input_seed_changes_the_inputs_but_not_the_model(tmp_path):
    """--rank-seed gives each rank its own data and the same model, as data parallelism has it."""
    from tracer_cli.loading import prepare_run

    path = tmp_path / "seeded.py"
    path.write_text(
        "import torch\n"
        "from torch import nn\n"
        "def build_model():\n"
        "    return nn.Linear(4, 4)\n"
        "def example_inputs():\n"
        "    return torch.randn(2, 4)\n"
    )
    base = prepare_run(str(path), seed=0)
    offset = prepare_run(str(path), seed=0, input_seed=1)
    assert torch.equal(base.loaded.model.weight, offset.loaded.model.weight)
    assert not torch.equal(base.args[0], offset.args[0])
    assert torch.equal(offset.args[0], prepare_run(str(path), seed=1).args[0])


def test_a_run_that_fails_leaves_no_earlier_result_behind(runner, tmp_path):
    """A CI job that reads --json or --junit-xml after a failed run must not read the previous run's."""
    model = write_model(
        tmp_path,
        """
        import torch

        def model(x):
            raise RuntimeError("planted")

        def example_inputs():
            return torch.ones(2)
        """,
    )
    stale_json, stale_xml = tmp_path / "out.json", tmp_path / "out.xml"
    stale_json.write_text('{"stale": true}')
    stale_xml.write_text("<stale/>")
    assert invoke(runner, "run", str(model), "--json", str(stale_json)).exit_code == 3
    assert not stale_json.exists()
    assert invoke(runner, "check", str(model), "--junit-xml", str(stale_xml)).exit_code == 3
    assert "stale" not in (stale_xml.read_text() if stale_xml.exists() else "")
    # a symbolic link is written through, as before, not replaced by a file
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text('{"old": true}')
    link.symlink_to(real)
    assert invoke(runner, "run", str(SAMPLES / "mlp.py"), "--json", str(link)).exit_code == 0
    assert link.is_symlink() and json.loads(real.read_text())["schema"] == "gradtrace/1"


def test_a_model_whose_forward_takes_no_arguments_is_called_with_none(runner, tmp_path):
    """A model that makes its own input (a learned query, a generator's fixed noise): no -i needed."""
    path = write_model(
        tmp_path,
        """
        import torch
        from torch import nn

        class Noargs(nn.Module):
            def __init__(self):
                super().__init__()
                self.query = nn.Parameter(torch.ones(4, 3))

            def forward(self):
                return self.query.pow(2).sum()

        model = Noargs()
        """,
    )
    result = invoke(runner, "run", str(path), "--json", "-")
    assert result.exit_code == 0, result.stderr
    doc = strict_json(result.stdout)
    (leaf,) = [n for n in doc["nodes"] if n["param"] == "query"]
    assert leaf["grad_outputs"][0]["norm"] == pytest.approx(2.0 * (12 ** 0.5))  # d(sum q^2)/dq = 2q, all ones


def test_the_traceback_of_a_user_error_leaves_out_the_standard_library(runner, tmp_path):
    """argparse exits from six frames of its own: the user's line that called it is what helps."""
    path = write_model(
        tmp_path,
        """
        import argparse

        parser = argparse.ArgumentParser()
        parser.add_argument("--data", required=True)
        args = parser.parse_args()
        """,
    )
    result = invoke(runner, "run", str(path))
    assert result.exit_code == 3
    assert "args = parser.parse_args()" in result.stderr and "argparse.py" not in result.stderr
    assert "required one" in result.stderr


def test_a_package_module_run_by_path_gets_its_import_path_as_a_hint(runner, tmp_path, monkeypatch):
    package = tmp_path / "hintpkg" / "sub"
    package.mkdir(parents=True)
    for folder in (tmp_path / "hintpkg", package):
        (folder / "__init__.py").write_text("")
    (tmp_path / "hintpkg" / "layers.py").write_text("import torch\n\ndef make():\n    return torch.nn.Linear(2, 2)\n")
    (package / "models.py").write_text(
        "import torch\nfrom ..layers import make\n\nmodel = make()\n\ndef example_inputs():\n    return torch.randn(3, 2)\n"
    )
    monkeypatch.chdir(tmp_path)
    result = invoke(runner, "run", "hintpkg/sub/models.py")
    assert result.exit_code == 3 and "gradtrace run hintpkg.sub.models" in result.stderr
    assert invoke(runner, "run", "hintpkg.sub.models").exit_code == 0  # and the hint works


def test_an_exception_whose_str_raises_is_the_models_error_not_gradtraces(runner, tmp_path):
    """Exit 3 with the user's traceback (the message quoted as Python does), never an internal error."""
    path = write_model(tmp_path, """
        import torch
        from torch import nn

        class Unprintable(Exception):
            def __str__(self):
                raise RuntimeError("no str")

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                raise Unprintable()

        model = Net()

        def example_inputs():
            return torch.randn(2, 4)

        def factory():
            raise Unprintable()
    """)
    for target in (str(path), f"{path}:factory"):
        result = invoke(runner, "run", target)
        assert result.exit_code == 3, result.output
        assert "Unprintable: <exception str() failed>" in result.stderr
        assert "internal error" not in result.stderr



@pytest.mark.filterwarnings("ignore:Error detected in")  # torch anomaly mode's own
def test_anomaly_detection_left_on_by_a_model_file_gets_a_hint(runner, tmp_path):
    """A model file that turns anomaly detection on (left from earlier debugging): torch stops backward at the
    first NaN with its own error. The error says why, and what to do."""
    model = write_model(
        tmp_path,
        """
        import torch
        torch.autograd.set_detect_anomaly(True)

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(3, 3)

            def forward(self, x):
                return torch.sqrt(self.fc(x) - 100.0).sum()

        model = Model()
        def example_inputs():
            return torch.randn(2, 3)
        """,
    )
    result = invoke(runner, "run", str(model))
    assert result.exit_code == 3, result.output
    assert "returned nan values" in result.output and "anomaly detection is on" in result.output
    assert not torch.is_anomaly_enabled()  # put back after the target
