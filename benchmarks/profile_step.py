"""Where a traced step's time goes: cProfile over repeated ``trace()`` calls of one workload.

    python benchmarks/profile_step.py gpt2-style                  # on the CPU
    python benchmarks/profile_step.py gpt2-style --device cuda    # on a GPU
    python benchmarks/profile_step.py tiny-ops --steps 20 --top 40 --sort cumulative

Prints the median time of a plain step and of a traced one (the profiler off), then the functions that
took the most time over ``--steps`` profiled traced steps (the profiler adds its own cost per Python call,
so read the shares, not the totals).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from overhead import METHODS, build, synchronize
from workloads import WORKLOADS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=list(WORKLOADS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--sort", default="tottime", choices=["tottime", "cumulative"])
    options = parser.parse_args()
    device = torch.device(options.device)
    model, args, loss_fn = build(options.workload, device)
    plain, traced = METHODS["plain"], METHODS["gradtrace"]
    times: dict[str, list[float]] = {"plain": [], "gradtrace": []}
    for round_ in range(options.steps + 3):
        for name, method in (("plain", plain), ("gradtrace", traced)):
            synchronize(device)
            start = time.perf_counter()
            method(model, args, loss_fn)
            synchronize(device)
            if round_ >= 3:  # after a warm-up
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    print(f"{options.workload} on {device}: plain {medians['plain']:.2f} ms, traced {medians['gradtrace']:.2f} ms "
          f"({medians['gradtrace'] / medians['plain']:.2f}x)")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(options.steps):
        traced(model, args, loss_fn)
    synchronize(device)
    profiler.disable()
    pstats.Stats(profiler).strip_dirs().sort_stats(options.sort).print_stats(options.top)


if __name__ == "__main__":
    main()
