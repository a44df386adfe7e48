"""What one gradient's norm costs on a device, by the ways gradtrace could take it, against the gradient's size.

    python benchmarks/norm_cost.py --device cuda

On a GPU a norm cannot be read to check its range without synchronising, so gradtrace takes the norm of a
float32, bf16 or fp16 gradient in float64 there (its squares stay in range: elements of 1e-24 or 1e20 keep
their norms), where on the CPU it takes a float32 dot product and reads it. This prints the median time of
each way (CUDA events around 50 calls, after a warm-up) for gradients of 64k to 64M elements, and the time a
plain copy of the gradient takes, for scale.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, x: torch.Tensor, device: torch.device, repeats: int = 50) -> float:
    """Median milliseconds of one call of ``fn(x)``."""
    for _ in range(3):
        fn(x)
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn(x)
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    options = parser.parse_args()
    device = torch.device(options.device)
    print(f"# {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'} · torch {torch.__version__}")
    print("| elements | dtype | copy (ms) | float32 dot (ms) | float32 norm (ms) | float64 norm (ms) | float64 / dot |")
    print("|---|---|---|---|---|---|---|")
    for numel in (1 << 16, 1 << 20, 1 << 24, 1 << 26):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(numel, device=device, dtype=dtype)
            copy = timed(torch.clone, x, device)
            dot = timed(lambda t: torch.dot(t, t), x, device) if dtype == torch.float32 else float("nan")
            norm32 = timed(lambda t: torch.linalg.vector_norm(t, dtype=torch.float32), x, device)
            norm64 = timed(lambda t: torch.linalg.vector_norm(t, dtype=torch.float64), x, device)
            base = dot if dtype == torch.float32 else norm32
            print(f"| {numel:,} | {str(dtype).removeprefix('torch.')} | {copy:.3f} | {dot:.3f} | {norm32:.3f} | "
                  f"{norm64:.3f} | {norm64 / base:.1f} |", flush=True)


if __name__ == "__main__":
    main()
