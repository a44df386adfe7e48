"""Tracing overhead against a plain forward+backward, and against peers, in one process.

    python benchmarks/overhead.py                 # every workload, 9 interleaved rounds
                                                  # (hf-gpt2 where transformers is installed,
                                                  # tv-resnet18 where torchvision is)
    python benchmarks/overhead.py tiny-ops --rounds 15
    python benchmarks/overhead.py resnet18 hf-bert hf-gpt2-base --rounds 7
                                                  # larger models, run only when named
    python benchmarks/overhead.py --memory        # also peak memory, one subprocess per method
    python benchmarks/overhead.py --device cuda   # on a GPU: each step timed to its end (synchronised);
                                                  # --memory then reads the allocator's peak, in process
    python benchmarks/overhead.py gpt2-style-large tv-resnet50 --device cuda --rounds 5
                                                  # GPU-sized steps (GPT-2 small at batch 8 x 512,
                                                  # ResNet-50 at batch 64 x 224x224)

For each workload, every method runs once per round, in turn (interleaved, so that a busy machine
slows all of them alike); the table shows each method's median time and its ratio to the plain
step's median, and the quartiles of gradtrace's ratio to the plain step of the same round (the spread
that the machine's noise gives the ratio). Methods:

- plain: ``loss_fn(model(*args)).backward()``, the inputs as a user passes them (a model's images do
  not require grad; a chain of ops without parameters has an input that does);
- gradtrace: ``tracer_cli.trace()`` with its defaults (attribution, creation sites, every node hooked,
  statistics; the inputs as given where the model has parameters, so the same gradients as the plain
  step; a parameterless chain's input requires grad in both);
- input-grad: ``trace(..., input_grad=True)``, as ``gradtrace run`` traces: floating inputs require
  grad, which costs a model a backward through its first layer to the input that the plain step skips;
- forward-values: ``trace(..., forward_stats=True)``, as ``gradtrace run --json`` and torchrun runs trace:
  also the norm of every op's output in forward (a TorchFunctionMode call per op);
- anomaly: the plain step under ``torch.autograd.detect_anomaly(check_nan=True)``;
- floor: a minimal hook on every node that keeps one norm per gradient tensor (no attribution,
  no shapes): the least any per-node tracer can do;
- torchviz: the plain step plus ``torchviz.make_dot`` of the graph (only if torchviz is installed).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import DEFAULT, WORKLOADS, big_activations  # noqa: E402

from tracer_cli import trace  # noqa: E402


def _inputs(args: tuple) -> tuple:
    """Fresh leaves that require grad where the workload's inputs do (a plain step as users run it: a
    model's images do not, so no input gradient is computed; trace() computes one by default)."""
    return tuple(a.detach().requires_grad_(a.requires_grad) for a in args)


def _clear(model: Any) -> None:
    if isinstance(model, torch.nn.Module):
        model.zero_grad(set_to_none=True)


def plain(model, args, loss_fn) -> None:
    loss_fn(model(*_inputs(args))).backward()
    _clear(model)


def traced(model, args, loss_fn) -> None:
    trace(model, args, loss_fn=loss_fn)


def traced_input_grad(model, args, loss_fn) -> None:
    trace(model, args, loss_fn=loss_fn, input_grad=True)


def traced_forward_values(model, args, loss_fn) -> None:
    trace(model, args, loss_fn=loss_fn, forward_stats=True)


def anomaly(model, args, loss_fn) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.detect_anomaly(check_nan=True):
            plain(model, args, loss_fn)


def floor(model, args, loss_fn) -> None:
    """Hook every node, keep one norm per gradient tensor (the grad_outputs each node receives)."""
    loss = loss_fn(model(*_inputs(args)))
    norms: list[torch.Tensor] = []

    def hook(grad_inputs, grad_outputs):
        for g in grad_outputs:
            if g is not None:
                norms.append(torch.linalg.vector_norm(g, dtype=torch.float32))

    handles, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        handles.append(node.register_hook(hook))
        stack.extend(next_node for next_node, _ in node.next_functions)
    loss.backward()
    for handle in handles:
        handle.remove()
    torch.stack(norms).tolist() if norms else None
    _clear(model)


def torchviz_dot(model, args, loss_fn) -> None:
    from torchviz import make_dot

    loss = loss_fn(model(*_inputs(args)))
    make_dot(loss)
    loss.backward()
    _clear(model)


METHODS: dict[str, Callable[..., None]] = {
    "plain": plain,
    "gradtrace": traced,
    "input-grad": traced_input_grad,
    "forward-values": traced_forward_values,
    "anomaly": anomaly,
    "floor": floor,
}
try:
    import torchviz  # noqa: F401

    METHODS["torchviz"] = torchviz_dot
except ImportError:
    pass


def build(name: str, device: torch.device) -> tuple[Any, tuple, Callable[[Any], torch.Tensor]]:
    """A workload with its parameters, inputs and any other tensors it holds made on ``device``."""
    torch.manual_seed(0)
    with device:
        return WORKLOADS[name]()


def synchronize(device: torch.device) -> None:
    """Wait for a device's queued work: a step on a GPU is timed to its end, not to its last launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, rounds: int, device: torch.device) -> dict[str, list[float]]:
    """Each method's time in every round (seconds; NaN where torchviz hit its recursion limit)."""
    model, args, loss_fn = build(name, device)
    for method in METHODS.values():  # warm-up: allocator, lazy inits
        method(model, args, loss_fn)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    gc.collect()
    for _ in range(rounds):
        for method_name, method in METHODS.items():
            synchronize(device)
            start = time.perf_counter()
            try:
                method(model, args, loss_fn)
                synchronize(device)
            except RecursionError:  # torchviz on deep graphs
                times[method_name].append(float("nan"))
                continue
            times[method_name].append(time.perf_counter() - start)
    return times


def spread(traced: list[float], plain: list[float]) -> str:
    """The quartiles of gradtrace's ratio to the plain step of the same round: how much the machine's noise
    moves the median ratio (rounds are paired, so a slow stretch of the machine slows both alike)."""
    ratios = [t / p for t, p in zip(traced, plain)]
    if len(ratios) < 2:
        return "–"
    low, _, high = statistics.quantiles(ratios, n=4)
    return f"{low:.2f}–{high:.2f}"


def peak_memory(method: str) -> float:
    """Peak RSS growth (MiB) of one step of ``method`` on the large-activation workload, in a fresh process.

    On Linux the peak (VmHWM) is reset just before the step, so what importing torch touched does not
    count; elsewhere the growth of ``ru_maxrss`` is taken.
    """
    code = (
        "import resource, sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
        "import overhead, workloads\n"
        "torch.manual_seed(0)\n"
        "model, args, loss_fn = workloads.big_activations()\n"
        "def status(key):\n"
        "    with open('/proc/self/status') as f:\n"
        "        return next(int(line.split()[1]) for line in f if line.startswith(key))\n"
        "try:\n"
        "    with open('/proc/self/clear_refs', 'w') as f:\n"
        "        f.write('5')\n"  # resets the peak RSS to the current RSS
        "    before, peak = status('VmRSS:'), lambda: status('VmHWM:')\n"
        "except OSError:\n"
        "    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"overhead.METHODS[{method!r}](model, args, loss_fn)\n"
        "print((peak() - before) / 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def peak_device_memory(method: str, device: torch.device) -> float:
    """Peak growth (MiB) of the memory the caching allocator hands out during one step of ``method`` on the
    large-activation workload, on a GPU (in process: the allocator counts exactly what the step holds)."""
    torch.manual_seed(0)
    with device:
        model, args, loss_fn = big_activations()
    METHODS[method](model, args, loss_fn)  # warm-up: cuDNN's choices and workspaces
    synchronize(device)
    gc.collect()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    METHODS[method](model, args, loss_fn)
    synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "workloads", nargs="*", default=DEFAULT, help=f"any of {', '.join(WORKLOADS)} (default: {', '.join(DEFAULT)})"
    )
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--memory", action="store_true", help="also measure peak memory (subprocesses)")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--device", default="cpu", help="where models and inputs are made: cpu (default) or cuda[:N]")
    options = parser.parse_args()
    device = torch.device(options.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    unknown = [name for name in options.workloads if name not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload {', '.join(unknown)}: choose from {', '.join(WORKLOADS)}")
    if options.threads:
        torch.set_num_threads(options.threads)
    where = f" · {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    print(f"# {platform.machine()} · {os.cpu_count()} cores · torch {torch.__version__} · "
          f"{torch.get_num_threads()} threads · python {platform.python_version()}{where}")
    header = "| workload | plain (ms) | " + " | ".join(f"{m} (x)" for m in METHODS if m != "plain") + " | gradtrace per round |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    results: dict[str, Any] = {}
    for name in options.workloads:
        times = measure(name, options.rounds, device)
        medians = {m: statistics.median(t) for m, t in times.items()}
        results[name] = medians
        ratios = " | ".join(f"{medians[m] / medians['plain']:.2f}" for m in METHODS if m != "plain")
        print(f"| {name} | {medians['plain'] * 1e3:.1f} | {ratios} | {spread(times['gradtrace'], times['plain'])} |", flush=True)
    if options.memory:
        methods = ("plain", "gradtrace", "forward-values", "floor")
        if device.type == "cuda":
            peaks = {m: peak_device_memory(m, device) for m in methods}
        else:
            peaks = {m: peak_memory(m) for m in methods}
        results["peak_memory_mib"] = peaks
        print(f"\npeak memory growth of one step, large activations ({big_activations.__doc__.strip()}):")
        for m, mib in peaks.items():
            print(f"  {m}: {mib:.0f} MiB ({mib / peaks['plain']:.2f}x plain)")
    if options.json:
        Path(options.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
