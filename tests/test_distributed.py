"""Distributed tracing: two CPU ranks (gloo) through torchrun and through gradtrace's own launcher.

Every two-process job here is run once per test session (a job costs a few seconds on a small
machine) and several tests read the same job. Jobs are started in their own session with a
timeout and killed as a group if they overrun, so a hang fails a test instead of blocking CI.

Conventions checked on every job:
  * every non-empty stdout line starts with ``[rank0] `` or ``[rank1] `` (torchrun's own log
    lines go to stderr, so the prefix rule is checked on stdout only);
  * no line of stdout or stderr carries two ``[rankN]`` prefixes (lines of two ranks glued);
  * on stderr, every line with gradtrace's own error message (``gradtrace: error``,
    ``gradtrace: internal error``) starts with a rank prefix (and, in a test of its own, the note
    that the merged JSON file was written).

"Tree lines" below are node lines of the Rich tree: the part after the prefix matches
``[├└]── #<id> `` (the same definition as ``node_lines`` in test_cli.py).

The sample models used (sample_models/dist_*.py) plant one rank-dependent behaviour each; their
docstrings say what and where.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from .reference import load_sample

ROOT = Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 120
FAILING_JOB_TIMEOUT_S = 90
FAILURE_WALL_LIMIT_S = 60

PREFIX = re.compile(r"^\[rank(\d+)\](?: |$)")  # an empty line is the prefix alone (no line ends in a space)
ANY_PREFIX = re.compile(r"\[rank\d+\]")
NODE_LINE = re.compile(r"[├└]── #\d+ ")
# torchrun's environment must not leak into the jobs when pytest itself runs under torchrun
TORCHRUN_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
)


def _gradtrace_script() -> str:
    beside = Path(sys.executable).parent / "gradtrace"
    if beside.exists():
        return str(beside)
    found = shutil.which("gradtrace")
    assert found, "the gradtrace console script is not installed (pip install -e .)"
    return found


GRADTRACE = _gradtrace_script()


def torchrun(*run_args: str, module: bool = False) -> list[str]:
    """``torchrun --standalone --nproc-per-node 2 (--no-python gradtrace | -m tracer_cli) run ARGS``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "tracer_cli"] if module else ["--no-python", GRADTRACE]
    return command + ["run", *run_args]


def launcher(*run_args: str) -> list[str]:
    """``gradtrace run --nproc-per-node 2 ARGS`` (the built-in launcher)."""
    return [GRADTRACE, "run", "--nproc-per-node", "2", *run_args]


@dataclass(repr=False)
class Job:
    command: list[str]
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    json_path: Path
    leftovers: list[str]
    temporary: list[str]  # what the job left in its own temporary directory (TMPDIR)

    def __repr__(self) -> str:  # shown in assertion messages
        return (
            f"$ {' '.join(self.command)}\nexit {self.returncode} after {self.wall_s:.1f} s\n"
            f"--- stdout (tail) ---\n{self.stdout[-6000:]}\n--- stderr (tail) ---\n{self.stderr[-6000:]}"
        )

    def lines(self, rank: int, stream: str = "stdout") -> list[str]:
        """The lines of one rank (prefix removed), in order."""
        text = self.stdout if stream == "stdout" else self.stderr
        out = []
        for line in text.splitlines():
            match = PREFIX.match(line)
            if match and int(match.group(1)) == rank:
                out.append(line[match.end():])
        return out

    def tree_lines(self, rank: int) -> list[str]:
        return [line for line in self.lines(rank) if NODE_LINE.search(line)]

    def document(self) -> dict[str, Any]:
        assert self.json_path.exists(), f"no merged JSON written\n{self}"
        return strict_json(self.json_path.read_text(encoding="utf-8"))


def strict_json(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"bare {constant} in JSON")

    return json.loads(text, parse_constant=refuse)


def _session_processes(sid: int) -> list[str]:
    """Live (not zombie) processes still in session ``sid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp session ...
        fields = text[text.rfind(")") + 2:].split()
        if len(fields) > 3 and int(fields[3]) == sid and fields[0] != "Z":
            found.append(f"{stat.parent.name} {text[:text.rfind(')') + 1]}")
    return found


def run_job(command: list[str], json_path: Path, timeout: float = JOB_TIMEOUT_S) -> Job:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env["NO_COLOR"] = "1"
    temporary = json_path.with_name(json_path.stem + "-tmp")
    temporary.mkdir()
    env["TMPDIR"] = str(temporary)
    start = time.monotonic()
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        encoding="utf-8", errors="replace", start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(
            f"job did not end within {timeout} s (killed):\n$ {' '.join(command)}\n"
            f"--- stdout ---\n{stdout[-6000:]}\n--- stderr ---\n{stderr[-6000:]}"
        )
    wall = time.monotonic() - start
    leftovers = _session_processes(process.pid)
    if leftovers:
        time.sleep(1.0)  # give exiting workers a moment before calling them orphans
        leftovers = _session_processes(process.pid)
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    left = sorted(path.name for path in temporary.iterdir())
    return Job(command, process.returncode, stdout, stderr, wall, json_path, leftovers, left)


# The jobs: name -> (command builder taking the JSON path, timeout). Each runs at most once.
JOBS: dict[str, tuple[Callable[[str], list[str]], float]] = {
    "ddp_torchrun": (lambda j: torchrun("sample_models/dist_ddp.py", "--json", j), JOB_TIMEOUT_S),
    "ddp_module_ranks0": (
        lambda j: torchrun("sample_models/dist_ddp.py", "--ranks", "0", "--json", j, module=True), JOB_TIMEOUT_S
    ),
    "ddp_launcher_failon": (
        lambda j: launcher(
            "sample_models/dist_ddp.py", "--fail-on", "divergence,nonfinite", "--json", j, "--dot", j.removesuffix(".json") + ".dot"
        ),
        JOB_TIMEOUT_S,
    ),
    "ddp_rank_seed": (lambda j: torchrun("sample_models/dist_ddp.py", "--rank-seed", "--json", j), JOB_TIMEOUT_S),
    "fsdp_launcher": (
        lambda j: launcher("sample_models/dist_fsdp.py", "--fail-on", "divergence,nonfinite,nograd", "--json", j),
        JOB_TIMEOUT_S,
    ),
    "structure": (lambda j: torchrun("sample_models/dist_structure.py", "--json", j), JOB_TIMEOUT_S),
    "forward": (lambda j: launcher("sample_models/dist_forward.py", "--json", j), JOB_TIMEOUT_S),
    "backward": (lambda j: torchrun("sample_models/dist_backward.py", "--json", j, module=True), JOB_TIMEOUT_S),
    "forward_failon_torchrun": (
        lambda j: torchrun("sample_models/dist_forward.py", "--fail-on", "divergence"), JOB_TIMEOUT_S
    ),
    "structure_failon_launcher": (
        lambda j: launcher("sample_models/dist_structure.py", "--fail-on", "divergence"), JOB_TIMEOUT_S
    ),
    "raise_early_torchrun": (
        lambda j: torchrun("sample_models/dist_raise_early.py", "--json", j), FAILING_JOB_TIMEOUT_S
    ),
    "raise_early_launcher": (
        lambda j: launcher("sample_models/dist_raise_early.py", "--json", j), FAILING_JOB_TIMEOUT_S
    ),
    "raise_allreduce_torchrun": (
        lambda j: torchrun("sample_models/dist_raise_in_allreduce.py", "--json", j), FAILING_JOB_TIMEOUT_S
    ),
    "raise_allreduce_launcher": (
        lambda j: launcher("sample_models/dist_raise_in_allreduce.py", "--json", j), FAILING_JOB_TIMEOUT_S
    ),
}


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Callable[[str], Job]:
    folder = tmp_path_factory.mktemp("dist")
    done: dict[str, Job] = {}

    def get(name: str) -> Job:
        if name not in done:
            build, timeout = JOBS[name]
            json_path = folder / f"{name}.json"
            done[name] = run_job(build(str(json_path)), json_path, timeout)
        return done[name]

    return get


# Checks shared by many tests -------------------------------------------------------------------


def assert_line_discipline(job: Job) -> None:
    """Prefixes on every stdout line; no glued lines anywhere; gradtrace's stderr lines prefixed."""
    for line in job.stdout.splitlines():
        if line.strip():
            match = PREFIX.match(line)
            assert match and match.group(1) in ("0", "1"), f"stdout line without a rank prefix: {line!r}\n{job}"
    for stream in (job.stdout, job.stderr):
        for line in stream.splitlines():
            assert len(ANY_PREFIX.findall(line)) <= 1, f"two ranks' output glued on one line: {line!r}\n{job}"
    for line in job.stderr.splitlines():
        if re.search(r"gradtrace: (internal )?error", line):
            assert PREFIX.match(line), f"gradtrace's error line without a rank prefix: {line!r}\n{job}"


def assert_merged_document(doc: dict[str, Any], job: Job) -> None:
    """The merged file: top level, one full trace per rank with meta.rank, and the comparison."""
    assert doc["schema"] == "gradtrace/1", job
    assert doc["world_size"] == 2
    assert isinstance(doc["ranks"], list) and len(doc["ranks"]) == 2
    for rank, trace in enumerate(doc["ranks"]):
        assert trace["schema"] == "gradtrace/1"
        assert trace["meta"]["rank"] == rank
        assert trace["meta"]["world_size"] == 2
        assert [n["id"] for n in trace["nodes"]] == list(range(len(trace["nodes"])))
        assert trace["nodes"], "a rank's trace has nodes"
        assert {"nodes", "executed", "nonfinite_nodes", "first_nonfinite"} <= set(trace["summary"])
    comparison = doc["comparison"]
    assert "first_divergent" in comparison
    assert isinstance(comparison["unsynchronized_params"], list)
    rows = comparison["ranks"]
    assert [row["rank"] for row in rows] == [0, 1]
    for row, trace in zip(rows, doc["ranks"]):
        assert {"rank", "loss", "param_grad_norm_total", "nonfinite_nodes"} <= set(row)
        assert row["loss"] == trace["meta"]["loss"]
        assert row["nonfinite_nodes"] == trace["summary"]["nonfinite_nodes"]
        total = row["param_grad_norm_total"]
        assert isinstance(total, (int, float)) and math.isfinite(total) and total > 0


def assert_origin(job: Job, kind: str, name: str, module: str) -> dict[str, Any]:
    """The merged JSON names the planted origin; rank 0's comparison section names it too."""
    assert job.returncode == 0, f"a divergence without --fail-on still exits 0\n{job}"
    assert_line_discipline(job)
    doc = job.document()
    assert_merged_document(doc, job)
    origin = doc["comparison"]["first_divergent"]
    assert origin is not None, f"no divergence found\n{job}"
    assert {"id", "name", "module", "param", "kind", "ranks"} <= set(origin)
    assert (origin["kind"], origin["name"], origin["module"]) == (kind, name, module), origin
    assert origin["param"] is None
    assert 1 in origin["ranks"], origin
    # the id is the origin's node id in (at least) one of the ranks named, or in rank 0
    assert any(
        origin["id"] < len(doc["ranks"][r]["nodes"])
        and doc["ranks"][r]["nodes"][origin["id"]]["name"] == name
        and doc["ranks"][r]["nodes"][origin["id"]]["module"] == module
        for r in {0, *origin["ranks"]}
    ), origin
    assert_comparison_names(job, kind, name, module)
    return doc


def comparison_section(job: Job) -> str:
    """Rank 0's text after both trees: its ``[rank0]`` lines after the last ``[rank1]`` line, joined
    with spaces (so a message wrapped at the terminal width reads as one)."""
    lines = [line for line in job.stdout.splitlines() if line.strip()]
    last_rank1 = max((i for i, line in enumerate(lines) if line.startswith("[rank1] ")), default=None)
    assert last_rank1 is not None, f"rank 1's tree is not printed\n{job}"
    section = [PREFIX.sub("", line).strip() for line in lines[last_rank1 + 1:] if line.startswith("[rank0] ")]
    return " ".join(section)


def assert_comparison_names(job: Job, kind: str, name: str, module: str) -> None:
    """Rank 0's comparison section names the origin's kind, node and module, and does not say "agree"."""
    section = comparison_section(job)
    assert name in section and module in section, f"the comparison does not name {name} in {module}\n{job}"
    assert re.search(rf"(?i)\b{kind}\b", section), f"the comparison does not name the kind {kind}\n{job}"
    assert "ranks agree" not in section.lower(), job


def divergence_marks(job: Job) -> list[str]:
    """stdout lines that mark a node as differing across ranks (the tree's "≠ ..." marks)."""
    return [line for line in job.stdout.splitlines() if "≠" in line or re.search(r"(?i)differs? across ranks", line)]


def assert_no_leftovers(job: Job) -> None:
    assert not job.leftovers, f"processes of the job still running after it ended: {job.leftovers}\n{job}"
    if job.command[0] == GRADTRACE:  # torchrun itself leaves its agent's log folder (torchelastic_*)
        # torch's compile cache folder (torchinductor_<user>) is shared by every run, made once
        left = [name for name in job.temporary if not name.startswith("torchinductor_")]
        assert not left, f"the launcher left {left} in the temporary directory\n{job}"


def assert_healthy(job: Job) -> dict[str, Any]:
    """A job on a healthy model: exit 0, clean lines, a merged document in which the ranks agree."""
    assert job.returncode == 0, job
    assert_line_discipline(job)
    doc = job.document()
    assert_merged_document(doc, job)
    assert doc["comparison"]["first_divergent"] is None
    assert doc["comparison"]["unsynchronized_params"] == []
    return doc


# Healthy DDP model: prefixes, merged JSON, agreement ------------------------------------------------


def test_torchrun_no_python_ddp_ranks_agree(job):
    j = job("ddp_torchrun")
    assert j.returncode == 0, j
    assert_line_discipline(j)
    doc = j.document()
    assert_merged_document(doc, j)
    comparison = doc["comparison"]
    assert comparison["first_divergent"] is None
    assert comparison["unsynchronized_params"] == []
    losses = [row["loss"] for row in comparison["ranks"]]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    # same graph on both ranks
    shape = [[(n["name"], n["module"], n["param"]) for n in t["nodes"]] for t in doc["ranks"]]
    assert shape[0] == shape[1]
    assert any("ranks agree" in line.lower() for line in j.lines(0)), j
    assert divergence_marks(j) == [], j
    assert_no_leftovers(j)


def test_torchrun_prints_every_ranks_tree_then_the_comparison(job):
    j = job("ddp_torchrun")
    assert j.returncode == 0, j
    doc = j.document()
    # --ranks defaults to all: both trees are printed, each line with its own rank's prefix,
    # one node line per node of that rank
    for rank in (0, 1):
        assert len(j.tree_lines(rank)) == len(doc["ranks"][rank]["nodes"]), j
    # lines never interleave: rank 1's lines form one contiguous block (printed by rank 0 in turn)
    ranks_in_order = [int(PREFIX.match(line).group(1)) for line in j.stdout.splitlines() if line.strip()]
    ones = [i for i, r in enumerate(ranks_in_order) if r == 1]
    assert ones == list(range(ones[0], ones[-1] + 1)), "rank 1's lines are interleaved with rank 0's"
    # the comparison comes after every tree line
    lines = [line for line in j.stdout.splitlines() if line.strip()]
    last_tree = max(i for i, line in enumerate(lines) if NODE_LINE.search(line))
    agree = [i for i, line in enumerate(lines) if "ranks agree" in line.lower()]
    assert agree and agree[-1] > last_tree and lines[agree[-1]].startswith("[rank0] ")


def test_json_written_note_on_stderr_is_prefixed(job):
    """gradtrace's own stderr note about the merged file is a rank's line like any other."""
    for name in ("ddp_torchrun", "ddp_launcher_failon"):
        j = job(name)
        notes = [line for line in j.stderr.splitlines() if "written to" in line]
        assert notes, f"no note that the merged file was written\n{j}"
        for line in notes:
            assert line.startswith("[rank0] "), f"stderr line without a rank prefix: {line!r}"
    dot = job("ddp_launcher_failon").json_path.with_suffix(".dot")
    assert dot.read_text().startswith("digraph")  # rank 0's graph, its note prefixed above


def test_torchrun_module_invocation_and_ranks_selection(job):
    """``torchrun -m tracer_cli run ... --ranks 0``: only rank 0's tree is printed.

    Precisely: at least one stdout tree line is prefixed ``[rank0]`` (rank 0's full tree) and none
    is prefixed ``[rank1]``; the merged JSON still holds both ranks' traces and the comparison.
    """
    j = job("ddp_module_ranks0")
    assert j.returncode == 0, j
    assert_line_discipline(j)
    doc = j.document()
    assert_merged_document(doc, j)
    assert len(j.tree_lines(0)) == len(doc["ranks"][0]["nodes"]), j
    assert j.tree_lines(1) == [], j
    assert doc["comparison"]["first_divergent"] is None
    assert any("ranks agree" in line.lower() for line in j.lines(0)), j


def test_builtin_launcher_ddp_ranks_agree_with_fail_on(job):
    """``gradtrace run --nproc-per-node 2 ... --fail-on divergence,nonfinite``: healthy model, exit 0."""
    j = job("ddp_launcher_failon")
    doc = assert_healthy(j)
    for rank in (0, 1):
        assert len(j.tree_lines(rank)) == len(doc["ranks"][rank]["nodes"]), j
    assert_no_leftovers(j)


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT])
def test_builtin_launcher_stopped_by_a_signal_exits_128_plus_it(tmp_path, signal_number):
    """A job stopped by SIGTERM (a CI runner cancelling it) exits 143 as a shell has it, Ctrl-C 130 (both were
    130), and leaves no rank behind."""
    started = tmp_path / "started"
    model = tmp_path / "sleeps.py"
    model.write_text(textwrap.dedent(f"""
        import pathlib, time
        import torch

        def model(x):
            pathlib.Path({str(started)!r}).touch()
            time.sleep(60)
            return (x * 2).sum()

        def example_inputs():
            return torch.randn(3)
    """))
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC_")}
    process = subprocess.Popen(
        launcher(str(model)), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not started.exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.2)
        assert started.exists(), process.communicate(timeout=30)
        process.send_signal(signal_number)
        process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 128 + signal_number
    time.sleep(1.0)
    assert not _session_processes(process.pid)


def test_rank_seed_gives_different_inputs_but_no_node_divergence(job):
    """``--rank-seed``: inputs (and so losses and local gradients) differ by rank; that is said,
    not reported as a divergent node; DDP's averaged parameter gradients still agree."""
    j = job("ddp_rank_seed")
    assert j.returncode == 0, j
    assert_line_discipline(j)
    doc = j.document()
    assert_merged_document(doc, j)
    seeds = [t["meta"]["seed"] for t in doc["ranks"]]
    assert seeds[1] == seeds[0] + 1
    losses = [row["loss"] for row in doc["comparison"]["ranks"]]
    assert losses[0] != losses[1]
    assert doc["comparison"]["first_divergent"] is None
    assert doc["comparison"]["unsynchronized_params"] == []
    notes = [line for line in j.lines(0) if re.search(r"(?i)inputs? (differ|are different)|rank.seed", line)]
    assert notes, f"rank 0's comparison does not say that the inputs differ by rank\n{j}"
    # ... and no node of either tree is marked as differing across ranks
    assert divergence_marks(j) == [], f"--rank-seed marks nodes as divergent\n{j}"
    # "params ‖grad‖" is that of the averaged .grad (the same on every rank), not of what each rank's
    # AccumulateGrad received (its local gradient, which differs by rank here)
    for row, trace in zip(doc["comparison"]["ranks"], doc["ranks"]):
        averaged = math.sqrt(sum(stat["norm"] ** 2 for stat in trace["param_grads"].values()))
        assert row["param_grad_norm_total"] == pytest.approx(averaged, rel=1e-6)
        assert trace["summary"]["param_grad_norm_total"] == pytest.approx(averaged, rel=1e-6)
    def local_total(trace: dict[str, Any]) -> float:
        leaves = [n for n in trace["nodes"] if n["param"] and not n["param"].startswith("input:")]
        return math.sqrt(sum(n["grad_outputs"][0]["norm"] ** 2 for n in leaves))

    local = [local_total(t) for t in doc["ranks"]]
    assert local[0] != pytest.approx(local[1], rel=1e-3)
    totals = [row["param_grad_norm_total"] for row in doc["comparison"]["ranks"]]
    assert totals[0] == pytest.approx(totals[1], rel=1e-5)


def _has_fsdp2() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_fsdp2(), reason="FSDP2 (torch.distributed.fsdp.fully_shard) is in torch 2.6 and later")
def test_fsdp2_unsharded_leaves_named_and_full_gradient_norms(job):
    """dist_fsdp: FSDP2's graph leaves are unsharded copies of the sharded parameters, swapped in while
    a module runs; each is named after its parameter, and each parameter's gradient (a sharded
    DTensor after backward) is normed over the whole parameter. Both match a plain single-process
    backward of the same model and input (every rank has the same input, so FSDP's average is it)."""
    j = job("fsdp_launcher")
    doc = assert_healthy(j)
    sample = load_sample("dist_fsdp")
    torch.manual_seed(0)  # what gradtrace does: the seed (default 0) before the model and again before the inputs
    model = sample.build_model()  # no process group here: the plain model
    torch.manual_seed(0)
    sample.loss_fn(model(sample.example_inputs())).backward()
    expected = {name: param.grad.norm().item() for name, param in model.named_parameters()}

    for trace in doc["ranks"]:
        leaves = {n["param"]: n for n in trace["nodes"] if n["param"] and not n["param"].startswith("input:")}
        assert set(leaves) == set(expected), trace["meta"]["rank"]
        assert trace["summary"]["params_without_grad"] == []
        for name, norm in expected.items():
            assert leaves[name]["module"] == name.rsplit(".", 1)[0]
            assert leaves[name]["grad_outputs"][0]["norm"] == pytest.approx(norm, rel=1e-5), name
            assert trace["param_grads"][name]["norm"] == pytest.approx(norm, rel=1e-5), name
            assert trace["param_grads"][name]["shape"] == list(model.get_parameter(name).shape)
    assert_no_leftovers(j)


# One sample per divergence kind ----------------------------------------------------------------------


def test_structure_divergence_origin(job):
    """dist_structure: rank 1 has an extra sigmoid in block2 (torchrun --no-python)."""
    j = job("structure")
    doc = assert_origin(j, "structure", "SigmoidBackward0", "block2")
    assert len(doc["ranks"][1]["nodes"]) == len(doc["ranks"][0]["nodes"]) + 1


def test_forward_divergence_origin(job):
    """dist_forward: block2 multiplies its activation by 1 + rank (built-in launcher)."""
    assert_origin(job("forward"), "forward", "MulBackward0", "block2")
    assert_no_leftovers(job("forward"))


def test_backward_divergence_origin_and_unsynchronized_params(job):
    """dist_backward: RankScale's backward scales by rank + 1 in block2 (torchrun -m tracer_cli)."""
    doc = assert_origin(job("backward"), "backward", "RankScaleBackward", "block2")
    # no DDP: the parameters upstream of RankScale end with different gradients, head's agree
    unsynchronized = set(doc["comparison"]["unsynchronized_params"])
    upstream = {"block1.linear.weight", "block1.linear.bias", "block2.linear.weight", "block2.linear.bias"}
    assert upstream <= unsynchronized
    assert not unsynchronized & {"head.weight", "head.bias"}


def test_fail_on_divergence_exits_1_under_torchrun(job):
    j = job("forward_failon_torchrun")
    assert j.returncode == 1, j
    assert_line_discipline(j)
    assert_comparison_names(j, "forward", "MulBackward0", "block2")
    assert_no_leftovers(j)


def test_fail_on_divergence_exits_1_under_builtin_launcher(job):
    j = job("structure_failon_launcher")
    assert j.returncode == 1, j
    assert "failed" not in j.stderr, f"the verdict is reported as a failure of the ranks\n{j}"
    assert_line_discipline(j)
    assert_comparison_names(j, "structure", "SigmoidBackward0", "block2")
    assert_no_leftovers(j)


# A rank that raises: no hang, the failing rank named, the right exit code -------------------------


@pytest.mark.parametrize(
    "name, sample, exit_code",
    [
        ("raise_early_torchrun", "dist_raise_early.py", 1),
        ("raise_early_launcher", "dist_raise_early.py", 3),
        ("raise_allreduce_torchrun", "dist_raise_in_allreduce.py", 1),
        ("raise_allreduce_launcher", "dist_raise_in_allreduce.py", 3),
    ],
)
def test_rank_that_raises_ends_the_job_quickly(job, name, sample, exit_code):
    """torchrun flattens a failing worker to exit 1; the built-in launcher passes the worker's 3 through.

    In the all-reduce case rank 0 is blocked in DDP's gradient all-reduce when rank 1 fails; the job
    must still end within seconds, not at the process-group timeout (120 s by default).
    """
    j = job(name)
    assert j.wall_s < FAILURE_WALL_LIMIT_S, f"the job took {j.wall_s:.1f} s\n{j}"
    assert j.returncode == exit_code, j
    assert_line_discipline(j)
    rank1 = j.lines(1, "stderr")
    assert any(line.startswith("gradtrace: error:") for line in rank1), f"rank 1's error is not on stderr\n{j}"
    assert any("planted failure on rank 1" in line for line in rank1), j
    assert any(sample in line for line in rank1), f"rank 1's error lacks the user's traceback\n{j}"
    assert "internal error" not in j.stderr, f"a peer's failure is reported as a gradtrace bug\n{j}"
    if name.endswith("_launcher"):  # the launcher names the rank that failed first, once
        assert "gradtrace: rank 1 failed first (exit code 3)" in j.stderr, j
        assert "failed (exitcode" not in j.stderr, f"the elastic agent's own line as well\n{j}"
    assert not j.json_path.exists(), "no merged file is written when a rank failed"
    assert_no_leftovers(j)


SLEEPS_ON_RANK1 = """
import time

import torch
import torch.distributed as dist
from torch import nn


class SleepsOnRank1(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        if dist.is_initialized() and dist.get_rank() == 1:
            time.sleep(100)  # rank 1 hangs: no error, no exit
        return self.fc(x)


model = SleepsOnRank1()


def example_inputs():
    return torch.randn(3, 4)
"""


def test_timeout_bounds_a_rank_that_hangs(tmp_path):
    """``--timeout 5``: rank 1 hangs (sleeps 100 s) in forward, rank 0 waits for it in gradtrace's
    own gather; rank 0 gives up after the timeout with a prefixed error, and the job ends long
    before rank 1 would wake up (built-in launcher)."""
    model = tmp_path / "sleeps_on_rank1.py"
    model.write_text(SLEEPS_ON_RANK1)
    j = run_job(launcher(str(model), "--timeout", "5"), tmp_path / "none.json", FAILING_JOB_TIMEOUT_S)
    assert j.wall_s < 45, f"the job took {j.wall_s:.1f} s with --timeout 5\n{j}"
    assert j.returncode != 0, j
    assert_line_discipline(j)
    assert any(line.startswith("gradtrace: error:") for line in j.lines(0, "stderr")), j
    # rank 0 names the rank that did not arrive (not "the first error above": there is none)
    assert "rank 1 did not finish tracing within --timeout 5 s" in "\n".join(j.lines(0, "stderr")), j
    # the launcher says rank 0 failed, and that it stopped rank 1 (which did not fail: it was still asleep)
    assert "gradtrace: rank 0 failed first" in j.stderr, j
    assert "then stopped rank 1 (still running)" in j.stderr, j
    assert "killed by signal" not in j.stderr, j
    assert "internal error" not in j.stderr, j
    assert_no_leftovers(j)


def test_a_check_whose_rank_hangs_still_writes_its_junit_file(tmp_path):
    """``check --junit-xml`` under the launcher with a rank that hangs: rank 0 writes the file with the target's
    error (a CI reporter found no file at all), and the job's exit code stands."""
    from xml.etree import ElementTree

    model = tmp_path / "sleeps_on_rank1.py"
    model.write_text(SLEEPS_ON_RANK1)
    report = tmp_path / "report.xml"
    command = [GRADTRACE, "check", "--nproc-per-node", "2", str(model), "--timeout", "5", "--junit-xml", str(report)]
    j = run_job(command, tmp_path / "none.json", FAILING_JOB_TIMEOUT_S)
    assert j.returncode == 3, j
    assert report.exists(), j
    errors = ElementTree.parse(report).getroot().iter("error")
    assert any("did not finish tracing within --timeout 5 s" in (e.get("message", "") + (e.text or "")) for e in errors), report.read_text()
    assert_no_leftovers(j)


def test_a_check_whose_ranks_cannot_start_is_a_usage_error(tmp_path):
    """``check`` under the launcher on a device no rank can use: the ranks' usage error (exit 2), not an internal
    error from the JUnit write that a failing rank attempts (names it reads were not set yet)."""
    command = [GRADTRACE, "check", "--nproc-per-node", "1", "sample_models/mlp.py", "--device", "cuda:99"]
    j = run_job(command, tmp_path / "none.json", FAILING_JOB_TIMEOUT_S)
    assert j.returncode == 2, j
    assert "cuda:99" in j.stderr and "internal error" not in j.stderr, j
    assert_no_leftovers(j)


def test_leftover_torchrun_variables_are_a_usage_error_not_a_crash(tmp_path):
    """RANK and WORLD_SIZE left from another job, without the rest of torchrun's environment."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env.update(RANK="0", WORLD_SIZE="2", NO_COLOR="1")
    result = subprocess.run(
        [GRADTRACE, "run", "sample_models/mlp.py", "--timeout", "5"], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=FAILING_JOB_TIMEOUT_S, check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "the rest of the torchrun environment is not" in result.stderr and "MASTER_ADDR" in result.stderr
    assert "internal error" not in result.stderr


def test_a_model_file_that_makes_its_own_process_group_is_told_to_guard_it():
    from tracer_cli.errors import UserCodeError

    error = UserCodeError("importing train.py", ValueError("trying to initialize the default process group twice!"))
    assert "torch.distributed.is_initialized()" in error.hint


# The comparison as a library function (single process) ----------------------------------------------


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out * ctx.factor, None


class _Block2(nn.Module):
    def __init__(self, features: int, scale: float, grad_factor: float, extra_sigmoid: bool):
        super().__init__()
        self.linear = nn.Linear(features, features)
        self.scale, self.grad_factor, self.extra_sigmoid = scale, grad_factor, extra_sigmoid

    def forward(self, x):
        h = self.linear(x)
        if self.extra_sigmoid:
            h = torch.sigmoid(h)
        h = torch.tanh(h) * self.scale
        return _ScaleGrad.apply(h, self.grad_factor)


class _Net(nn.Module):
    def __init__(self, scale: float = 1.0, grad_factor: float = 1.0, extra_sigmoid: bool = False):
        super().__init__()
        self.block1 = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.block2 = _Block2(6, scale, grad_factor, extra_sigmoid)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.block2(self.block1(x)))


def _trace_variant(rank: int | None = None, **variant: Any):
    """A single-process trace of _Net with fixed weights and inputs, forward values recorded;
    ``variant`` changes block2. ``rank`` sets ``meta.rank`` as a rank of a job would have it."""
    from tracer_cli import trace

    torch.manual_seed(0)
    reference = _Net()
    x = torch.randn(3, 6)
    model = _Net(**variant)
    model.load_state_dict(reference.state_dict())
    placement = {} if rank is None else {"rank": rank, "world_size": 4}
    return trace(model, (x,), forward_stats=True, **placement)


def _compare(traces, **kwargs):
    try:
        from tracer_cli.distributed import compare
    except ImportError:  # the comparison may live in its own module, shared with `gradtrace diff`
        from tracer_cli.compare import compare
    return compare(traces, **kwargs)


def test_a_job_of_one_rank_agrees_with_itself():
    """--nproc-per-node 1 (or torchrun with one process) compares one trace: nothing differs."""
    comparison = _compare([_trace_variant(rank=0)])
    assert comparison["first_divergent"] is None and comparison["unsynchronized_params"] == []
    assert [row["rank"] for row in comparison["ranks"]] == [0]
    # without forward values (--nproc-per-node 1 records none): nothing is compared, so no note says they are missing
    from tracer_cli import trace

    torch.manual_seed(0)
    assert not _compare([trace(_Net(), (torch.randn(3, 6),), rank=0, world_size=1)])["note"]


def test_an_input_of_another_shape_on_one_rank_is_said_to_be_one():
    """Uneven batches: the origin is the input, and its shapes are given (norms alone did not show why it differs),
    in the comparison and in its terminal view."""
    from rich.console import Console

    from tracer_cli import trace
    from tracer_cli.render.comparison import render_comparison

    torch.manual_seed(0)
    model, x = _Net(), torch.randn(5, 6)
    traces = [
        trace(model, (x[:rows].clone(),), forward_stats=True, input_grad=True, rank=rank, world_size=2)
        for rank, rows in enumerate((3, 5))
    ]
    first = _compare(traces)["first_divergent"]
    assert (first["param"], first["ranks"], first["shapes"]) == ("input:0", [1], [[3, 6], [5, 6]])
    console = Console(width=200, color_system=None)
    with console.capture() as captured:
        console.print(render_comparison(_compare(traces)))
    assert "its shape differs across ranks: (3, 6) on rank 0, (5, 6) on rank 1" in captured.get()
    # zeros of two shapes have one norm, 0: the shapes alone tell them apart
    zeros = [trace(model, (torch.zeros(rows, 6),), forward_stats=True, input_grad=True) for rows in (3, 5)]
    assert _compare(zeros)["first_divergent"]["shapes"] == [[3, 6], [5, 6]]


def test_of_two_ranks_neither_is_blamed_of_three_the_odd_one_is():
    """With two ranks either may be the one that is off (rank 0's weight changed read as "rank 1 differs"); with
    three, the one that disagrees with the others is named."""
    from rich.console import Console

    from tracer_cli.checks import comparison_findings
    from tracer_cli.render.comparison import render_comparison

    changed = _trace_variant(rank=0, scale=2.0)
    two = _compare([changed, _trace_variant(rank=1)])
    console = Console(width=200, color_system=None)
    with console.capture() as captured:
        console.print(render_comparison(two))
    assert "(ranks 0 and 1 differ)" in captured.get() and "rank 1 differs" not in captured.get()
    assert "ranks 0 and 1 differ here" in comparison_findings(two)[0].detail
    labelled = _compare([changed, _trace_variant(rank=1)], labels=[2, 5])  # two ranks of a larger job
    assert "ranks 2 and 5 differ here" in comparison_findings(labelled)[0].detail
    three = _compare([changed, _trace_variant(rank=1), _trace_variant(rank=2)])
    assert three["first_divergent"]["ranks"] == [0]
    assert "rank 0 differs here" in comparison_findings(three)[0].detail


def test_compare_identical_traces_agree():
    comparison = _compare([_trace_variant(rank=0), _trace_variant(rank=1)])
    assert comparison["first_divergent"] is None
    assert comparison["unsynchronized_params"] == []
    assert [row["rank"] for row in comparison["ranks"]] == [0, 1]
    assert comparison["ranks"][0]["loss"] == comparison["ranks"][1]["loss"]


@pytest.mark.parametrize(
    "variant, kind, name",
    [
        ({"extra_sigmoid": True}, "structure", "SigmoidBackward0"),
        ({"scale": 2.0}, "forward", "MulBackward0"),
        ({"grad_factor": 2.0}, "backward", "_ScaleGradBackward"),
    ],
    ids=["structure", "forward", "backward"],
)
def test_compare_finds_the_origin(variant, kind, name):
    comparison = _compare([_trace_variant(rank=0), _trace_variant(rank=1, **variant)])
    origin = comparison["first_divergent"]
    assert origin is not None
    assert (origin["kind"], origin["name"], origin["module"], origin["ranks"]) == (kind, name, "block2", [1])
    # the line of _Block2.forward that made the node, found independently; the check finding carries it
    import inspect

    from tracer_cli.checks import comparison_findings

    fragment = {"structure": "torch.sigmoid(h)", "forward": "* self.scale", "backward": "_ScaleGrad.apply"}[kind]
    lines, first = inspect.getsourcelines(_Block2.forward)
    line = first + next(i for i, text in enumerate(lines) if fragment in text)
    assert origin["source"] is not None and origin["source"].endswith(f"test_distributed.py:{line}")
    (finding,) = comparison_findings(comparison)
    assert finding.source == origin["source"]


def test_compare_n_traces_names_the_rank_that_differs():
    traces = [_trace_variant(rank=0), _trace_variant(rank=1), _trace_variant(rank=2, scale=2.0), _trace_variant(rank=3)]
    origin = _compare(traces)["first_divergent"]
    assert origin is not None
    found = (origin["kind"], origin["name"], origin["module"], origin["ranks"])
    assert found == ("forward", "MulBackward0", "block2", [2])


def test_compare_rtol():
    # a relative difference of 1e-7 is within the default rtol (1e-5) ...
    assert _compare([_trace_variant(rank=0), _trace_variant(rank=1, scale=1.0 + 1e-7)])["first_divergent"] is None
    # ... 1e-3 is not, unless rtol is raised above it
    traces = [_trace_variant(rank=0), _trace_variant(rank=1, scale=1.001)]
    assert _compare(traces)["first_divergent"]["kind"] == "forward"
    assert _compare(traces, rtol=0.1)["first_divergent"] is None


def test_compare_single_process_traces_names_them_by_position():
    """Two plain single-process traces (both ``meta.rank == 0``, as ``gradtrace diff`` of two files
    would see them): the differing trace is still named by its position, not as rank 0."""
    origin = _compare([_trace_variant(), _trace_variant(scale=2.0)])["first_divergent"]
    assert origin is not None
    found = (origin["kind"], origin["name"], origin["module"], origin["ranks"])
    assert found == ("forward", "MulBackward0", "block2", [1])


def test_every_line_of_a_rank_s_error_carries_its_prefix(capsys):
    """An error message of several lines (load_state_dict lists missing and unexpected keys on lines of their own)."""
    from tracer_cli.cli import _report
    from tracer_cli.errors import UserCodeError

    error = UserCodeError("building the model", RuntimeError("Error(s) in loading state_dict:\n\tMissing key(s): a.\n\tUnexpected key(s): b."))
    _report(error, debug=False, prefix="[rank1] ")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) >= 3 and all(line.startswith("[rank1] ") for line in lines), lines
