"""Instructions executed per step, plain against traced, split by phase: counted under Valgrind's callgrind.

    python benchmarks/instructions.py                      # tiny-unary, 3 steps each
    python benchmarks/instructions.py tiny-ops tiny-param --steps 2
    python benchmarks/instructions.py resnet-small --steps 2  # per module and per node, small kernels

Wall-clock ratios (overhead.py) are what users feel, but on a shared, noisy machine a change worth a few
percent is lost in the noise of a whole step. Instruction counts are deterministic: the same code gives
the same count to within a fraction of a percent, run after run, so a change to one phase can be judged on
its own. They are a proxy for time, not time (a cache miss costs more than an add), so what they show
must be confirmed with overhead.py; and a step runs about 50 times slower under Valgrind, so the
workloads here are the tiny-op ones, where gradtrace's own Python is most of the cost, and resnet-small
(the ResNet-style CNN at batch 2, 16x16 images: what a trace adds per module and per node, with kernels
that cost little).

For each workload: one plain step and one trace to warm up, then ``--steps`` plain steps and ``--steps``
traces, each counted from a zeroed counter. A trace is split where ``_TraceSession``'s methods start
and end:

- forward: from trace()'s call to graph discovery (inputs, the model's forward with module
  attribution and creation sites, the loss);
- discover: numbering and hooking every node;
- backward: the engine's backward with the hooks, less their batched norms (flush);
- flush: batched norms of small gradients;
- close: hooks removed, parameter gradients recorded;
- finish: statistics read back and the Trace built;
- rest: restoring the model, releasing the graph and the session, returning.

Needs Valgrind, its headers (valgrind/callgrind.h: a helper compiled here with the C compiler marks the
phases) and a C compiler; the script says which is missing.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARKER_C = """#include <valgrind/callgrind.h>
void gradtrace_zero(void) { CALLGRIND_ZERO_STATS; }
void gradtrace_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
"""
PHASES = ("forward", "discover", "backward", "flush", "close", "finish", "rest")


def _measure(library: str, names: list[str], steps: int) -> None:
    """Under callgrind: run the steps, dumping the counts at every phase boundary as ``workload|mode|phase``."""
    import ctypes

    import torch

    sys.path.insert(0, str(HERE))
    import overhead
    from workloads import WORKLOADS

    from tracer_cli import tracing

    torch.set_num_threads(1)  # one thread: counts that do not depend on how work was split
    marker = ctypes.CDLL(library)
    label = ["", ""]

    def dump(phase: str) -> None:
        marker.gradtrace_dump(f"{label[0]}|{label[1]}|{phase}".encode())

    phase = ["forward"]  # the phase running now: what the instructions since the last dump belong to

    def around(method: str, name: str, after: dict[str, str]) -> None:
        """Time ``method`` as phase ``name``; then the phase ``after[phase it interrupted]``, else that one
        again (flush runs in backward when enough gradients wait, else only in finish; close runs after
        backward and again as the trace ends)."""
        function = getattr(tracing._TraceSession, method)

        def wrapped(*args, **kwargs):
            before = phase[0]
            dump(before)
            phase[0] = name
            try:
                return function(*args, **kwargs)
            finally:
                dump(name)
                phase[0] = after.get(before, before)

        setattr(tracing._TraceSession, method, wrapped)

    around("discover", "discover", {"forward": "backward"})
    around("flush", "flush", {})
    around("close", "close", {"backward": "close"})  # hooks removed; parameter gradients recorded next
    around("finish", "finish", {"close": "rest"})
    for name in names:
        model, args, loss_fn = WORKLOADS[name]()
        label[:] = [name, "warm-up"]  # (not counted)
        overhead.plain(model, args, loss_fn)
        tracing.trace(model, args, loss_fn=loss_fn)
        for _ in range(steps):
            label[1] = "plain"
            marker.gradtrace_zero()
            loss = loss_fn(model(*overhead._inputs(args)))
            dump("forward")
            loss.backward()
            del loss
            overhead._clear(model)
            dump("backward")
            label[1] = "gradtrace"
            phase[0] = "forward"
            marker.gradtrace_zero()
            tracing.trace(model, args, loss_fn=loss_fn)
            dump(phase[0])


def _counts(folder: Path) -> dict[tuple[str, str, str], int]:
    """The instructions of every dump, summed by its label."""
    totals: dict[tuple[str, str, str], int] = collections.Counter()
    for path in folder.iterdir():
        with path.open(errors="replace") as dump:
            head = dump.read(4096)  # the label and the total; the rest is per function
        label = re.search(r"Client Request: (\S+)\|(\S+)\|(\S+)", head)
        count = re.search(r"^(?:summary|totals): (\d+)", head, re.MULTILINE)
        if label and count:
            totals[label.groups()] += int(count.group(1))
    return totals


def _table(totals: dict[tuple[str, str, str], int], names: list[str], steps: int) -> str:
    """Millions of instructions per step."""
    header = ["workload", "plain (M)", "gradtrace (M)", "ratio", *(f"{phase} (+M)" for phase in PHASES)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in names:
        plain = {phase: totals.get((name, "plain", phase), 0) / steps / 1e6 for phase in ("forward", "backward")}
        traced = {phase: totals.get((name, "gradtrace", phase), 0) / steps / 1e6 for phase in PHASES}
        plain_total, traced_total = sum(plain.values()), sum(traced.values())
        if not plain_total:
            continue
        # forward and backward as what the trace adds to the plain step's
        extra = dict(traced, forward=traced["forward"] - plain["forward"], backward=traced["backward"] - plain["backward"])
        cells = [name, f"{plain_total:.1f}", f"{traced_total:.1f}", f"{traced_total / plain_total:.2f}x"]
        lines.append("| " + " | ".join(cells + [f"{extra[phase]:+.1f}" for phase in PHASES]) + " |")
    return "\n".join(lines)


def main() -> None:
    sys.path.insert(0, str(HERE))
    from workloads import WORKLOADS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workloads", nargs="*", default=["tiny-unary"], help="workload names (default: tiny-unary)")
    parser.add_argument("--steps", type=int, default=3, help="counted steps per method (default: 3)")
    parser.add_argument("--measure", metavar="LIBRARY", help=argparse.SUPPRESS)  # the run under valgrind
    options = parser.parse_args()
    unknown = [name for name in options.workloads if name not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload {', '.join(unknown)} (known: {', '.join(WORKLOADS)})")
    if options.measure:
        _measure(options.measure, options.workloads, options.steps)
        return
    include = Path("/usr/include/valgrind/callgrind.h")
    missing = [tool for tool in ("valgrind", "cc") if shutil.which(tool) is None]
    if not include.exists():
        missing.append(f"{include} (Valgrind's headers)")
    if missing:
        sys.exit(f"instructions.py needs {', '.join(missing)}")
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        (folder / "marker.c").write_text(MARKER_C)
        library = folder / "marker.so"
        subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(library), str(folder / "marker.c")], check=True)
        dumps = folder / "dumps"
        dumps.mkdir()
        # the interpreter as it was started (sys.executable is the binary even when a shim started it), not with
        # its symlinks resolved: a virtual environment's python is a symlink, and resolved it is the base
        # interpreter, without the environment's packages
        python = sys.executable
        command = [
            "valgrind", "--tool=callgrind", f"--callgrind-out-file={dumps}/callgrind.%p", python, __file__,
            *options.workloads, "--steps", str(options.steps), "--measure", str(library),
        ]  # fmt: skip
        print(f"# counting under callgrind ({len(options.workloads)} workload(s), about a minute each)...", file=sys.stderr)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        totals = _counts(dumps)
    import torch

    print(f"# {sysconfig.get_platform()} · torch {torch.__version__} · python {sys.version.split()[0]} · 1 thread")
    print(_table(totals, options.workloads, options.steps))


if __name__ == "__main__":
    main()
