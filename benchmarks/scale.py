"""How tracing time grows with the number of graph nodes: 1k, 10k and 100k-node chains.

    python benchmarks/scale.py                  # trace() against a plain step, per node count
    python benchmarks/scale.py --modules        # the chains made of modules: Linear(8, 8) + ReLU layers
    python benchmarks/scale.py --cli            # also `gradtrace run ... --json` end to end on 100k nodes

Each row: nodes traced, a plain forward+backward, trace() (median of a few runs), their ratio, and the
time per node, which should stay flat (linear growth).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import chain, deep_linear  # noqa: E402

from tracer_cli import trace  # noqa: E402


def _plain(model, args, loss_fn) -> None:
    x = tuple(a.detach().requires_grad_(a.requires_grad) for a in args)  # a fresh leaf where the chain has one
    loss_fn(model(*x)).backward()


def measure(nodes: int, repeats: int, modules: bool = False) -> tuple[int, float, float]:
    model, args, loss_fn = deep_linear(max(1, nodes // 5)) if modules else chain(nodes)
    plain_times, trace_times, traced = [], [], 0
    for _ in range(repeats):
        if modules:
            model.zero_grad(set_to_none=True)  # as trace() finds them: a plain step's .grad is made, not added to
        start = time.perf_counter()
        _plain(model, args, loss_fn)
        plain_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        traced = len(trace(model, args, loss_fn=loss_fn).nodes)
        trace_times.append(time.perf_counter() - start)
    return traced, statistics.median(plain_times), statistics.median(trace_times)


def cli_run(nodes: int) -> None:
    """``gradtrace run FILE --json OUT`` on a chain of ``nodes`` nodes, timed end to end."""
    with tempfile.TemporaryDirectory() as folder:
        model_file = Path(folder) / "chain_model.py"
        model_file.write_text(textwrap.dedent(f"""
            import torch

            def model(x):
                for _ in range({nodes - 2}):
                    x = x * 1.000001
                return x.sum()

            def example_inputs():
                return torch.randn(4)
        """))
        out = Path(folder) / "trace.json"
        start = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-m", "tracer_cli", "run", str(model_file), "--json", str(out)],
            capture_output=True, text=True,
        )
        elapsed = time.perf_counter() - start
        document = json.loads(out.read_text()) if out.exists() else {"nodes": []}
        tree_lines = sum(1 for line in result.stdout.splitlines() if "Backward" in line)
        print(f"gradtrace run --json, {nodes} nodes: exit {result.returncode}, {elapsed:.1f} s, "
              f"{len(document['nodes'])} nodes written, {tree_lines} tree lines printed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="*", default=[1_000, 10_000, 100_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modules", action="store_true", help="chains of Linear(8, 8) + ReLU modules, not of ops")
    parser.add_argument("--cli", action="store_true", help="also time the CLI with --json on the largest graph")
    options = parser.parse_args()
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads" + (", chains of modules" if options.modules else ""))
    print("| nodes | plain (s) | trace (s) | ratio | trace µs/node |")
    print("|---|---|---|---|---|")
    for count in options.nodes:
        traced, plain, traced_time = measure(count, options.repeats, options.modules)
        print(f"| {traced} | {plain:.3f} | {traced_time:.3f} | {traced_time / plain:.2f} | "
              f"{traced_time / traced * 1e6:.1f} |", flush=True)
    if options.cli:
        cli_run(max(options.nodes))


if __name__ == "__main__":
    main()
