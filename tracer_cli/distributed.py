"""Running under torchrun: rank detection, the process group, gathering traces, the built-in launcher.

torch.distributed is imported inside functions only.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, Sequence

from .errors import ExitCode, ModelError, UsageError

DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RankInfo:
    """Where this process stands in a torchrun job."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def prefix(self) -> str:
        """The line prefix PyTorch's own logs use."""
        return f"[rank{self.rank}] "


def rank_info(environ: Mapping[str, str] | None = None) -> RankInfo | None:
    """The torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK), or None outside torchrun.

    Raises:
        UsageError: the variables are set but are not numbers.
    """
    environ = os.environ if environ is None else environ
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return None
    try:
        rank = int(environ["RANK"])
        world_size = int(environ["WORLD_SIZE"])
        local_rank = int(environ.get("LOCAL_RANK", rank))
    except ValueError as exc:
        raise UsageError(f"cannot read the torchrun environment: {exc}") from exc
    return RankInfo(rank, world_size, local_rank)


class ProcessGroup:
    """The default process group (created unless the user's code made one) and gradtrace's own gloo group.

    gradtrace's own messages (traces, verdicts) travel on a gloo group, so they work
    whatever backend the model uses, with ``timeout_s`` so nothing waits forever.
    """

    def __init__(self, info: RankInfo, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.info = info
        self.timeout = timedelta(seconds=timeout_s)
        self.owned = False
        self.group: Any = None

    def start(self, device: str) -> str:
        """Join the job; return the device this rank should use (``cuda`` becomes ``cuda:LOCAL_RANK``)."""
        import torch
        import torch.distributed as dist

        if not dist.is_available():
            raise UsageError("this torch build has no torch.distributed support")
        if device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise UsageError(f"device {device!r} was asked for, but CUDA is not available here", hint="use --device cpu")
            device = f"cuda:{self.info.local_rank}"
            torch.cuda.set_device(self.info.local_rank)
        if not dist.is_initialized():
            backend = "nccl" if device.startswith("cuda") else "gloo"
            leftover = "run under torchrun (it sets them all), or unset RANK and WORLD_SIZE if another job left them"
            try:
                dist.init_process_group(backend=backend, timeout=self.timeout)
            except ValueError as exc:  # the env:// rendezvous without MASTER_ADDR or MASTER_PORT
                raise UsageError(f"RANK and WORLD_SIZE are set, but the rest of the torchrun environment is not: {exc}", hint=leftover) from exc
            except RuntimeError as exc:  # the other ranks never joined (DistStoreError)
                raise UsageError(
                    f"waited --timeout {self.timeout.total_seconds():g} s for the {self.info.world_size} ranks of "
                    f"WORLD_SIZE to join, in vain: {exc}",
                    hint=leftover,
                ) from exc
            self.owned = True
        self.group = dist.new_group(backend="gloo", timeout=self.timeout)
        return device

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's JSON-able ``value`` on rank 0 (None elsewhere).

        Sent as UTF-8 JSON in byte tensors: ``gather_object`` would need NumPy, which a
        torch install does not guarantee, and JSON cannot run code when read.

        Raises:
            PeerLostError: another rank went away (it failed, or was stopped).
        """
        import json

        import torch
        import torch.distributed as dist

        payload = json.dumps(value, allow_nan=False).encode()
        world = self.info.world_size
        started = time.monotonic()
        try:  # first, every rank has its trace: rank 0 learns which ranks did not arrive in time (hung, or slow)
            dist.monitored_barrier(group=self.group, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as exc:
            named = _MISSING.search(str(exc))
            # gloo names a rank that went away (it failed: its own error says why) as soon as it goes, too
            waited = time.monotonic() - started >= 0.9 * self.timeout.total_seconds()
            missing = [int(rank) for rank in re.findall(r"\d+", named.group(1))] if named and waited else []
            if self.info.rank != 0 and waited:  # the others wait for rank 0, which waits for every rank
                missing = [0]
            raise PeerLostError(f"lost contact with the other ranks: {exc}", missing=missing) from exc
        try:
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=self.group)
            longest = max(int(size) for size in sizes)
            padded = torch.zeros(longest, dtype=torch.uint8)
            if payload:
                padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if self.info.rank != 0:
                dist.gather(padded, dst=0, group=self.group)
                return None
            buffers = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
            dist.gather(padded, buffers, dst=0, group=self.group)
        except RuntimeError as exc:
            raise PeerLostError(f"lost contact with the other ranks: {exc}") from exc
        return [json.loads(_tensor_bytes(buffer, int(size))) for buffer, size in zip(buffers, sizes)]

    def broadcast(self, value: int) -> int:
        """Rank 0's integer ``value`` on every rank."""
        import torch
        import torch.distributed as dist

        box = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(box, src=0, group=self.group)
        return int(box.item())

    def close(self) -> None:
        """A barrier, then destroy what gradtrace created (gloo sometimes aborts at exit without the barrier)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        dist.barrier(group=self.group)
        dist.destroy_process_group(None if self.owned else self.group)  # None: the default group and all others


def _tensor_bytes(tensor: Any, size: int) -> bytes:
    """The first ``size`` bytes of a contiguous CPU uint8 tensor (without NumPy)."""
    import ctypes

    return ctypes.string_at(tensor.data_ptr(), size) if size else b""


class PeerLostError(ModelError):
    """Another rank went away while this one waited for it in gradtrace's own messages; ``missing``: the ranks
    that did not arrive, where known (rank 0 knows it)."""

    def __init__(self, message: str, hint: str | None = "look for the error of another rank", missing: Sequence[int] = ()):
        super().__init__(message, hint)
        self.missing = list(missing)


_MISSING = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")  # gloo's words on rank 0


def ranks_text(ranks: Sequence[int]) -> str:
    """'rank 1', 'ranks 1, 3'."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _describe_exit(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def lost_peer(error: BaseException) -> bool:
    """Whether an error is the echo of another rank's failure (its connection went away)."""
    if isinstance(error, PeerLostError):
        return True
    text = f"{error} {getattr(error, '__cause__', '') or ''}"
    return any(sign in text for sign in _PEER_LOST)


_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "NCCL communicator was aborted",
    "Broken pipe",
    "Timed out waiting",  # gloo, in a collective of the model's (DDP's all-reduce) bounded by --timeout
    "Watchdog caught collective operation timeout",  # nccl's
)


def launch(nproc_per_node: int, argv: Sequence[str]) -> int:
    """Run ``python -m tracer_cli ARGV`` on ``nproc_per_node`` local ranks with torch's elastic launcher.

    The same machinery as ``torchrun --standalone``: rendezvous on a free local port,
    no restarts; when a worker fails the others are stopped at once.

    Returns:
        0, or the exit code of the first worker that failed (torchrun would flatten it to 1). A worker
        exiting 1 gave the verdict (failing findings, printed by rank 0): nothing more is said of it.
    """
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc_per_node < 1:
        raise UsageError("--nproc-per-node must be at least 1")
    # the agent keeps its workers' error files under a log folder, by default a new torchelastic_*
    # in the temporary directory that nothing removes: one of our own, removed when the job ends
    log_folder = tempfile.TemporaryDirectory(prefix="gradtrace-launch-", ignore_cleanup_errors=True)
    if "logs_specs" in {field.name for field in dataclasses.fields(LaunchConfig)}:  # torch >= 2.3
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

        logs = {"logs_specs": DefaultLogsSpecs(log_dir=log_folder.name)}
    else:
        logs = {"log_dir": log_folder.name}
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc_per_node,
        run_id=f"gradtrace-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        **logs,
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: N ranks share the cores
    # the elastic agent logs "failed (exitcode: N) local_rank: ..." for any non-zero exit, the verdict's
    # too; which rank failed, and how, is said below
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    agent_level = agent_log.level
    agent_log.setLevel(logging.CRITICAL)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "tracer_cli", *argv)
    except ChildFailedError as exc:
        failures = sorted(exc.failures.items(), key=lambda item: item[1].timestamp)
        first_rank, first = failures[0]
        if first.exitcode == ExitCode.GRADIENT_PROBLEMS:
            return ExitCode.GRADIENT_PROBLEMS
        # the agent stops the workers still running when one fails, by SIGTERM: they did not fail
        stopped = [rank for rank, f in failures[1:] if f.exitcode == -signal.SIGTERM]
        others = ", ".join(f"rank {rank} ({_describe_exit(f.exitcode)})" for rank, f in failures[1:] if rank not in stopped)
        message = f"gradtrace: rank {first_rank} failed first ({_describe_exit(first.exitcode)})"
        if others:
            message += f"; then {others}"
        if stopped:
            message += f"; then stopped {ranks_text(stopped)} (still running)"
        sys.stderr.write(message + "\n")
        code = first.exitcode
        return code if code > 0 else 128 - code if code < 0 else 1
    except SignalException as exc:  # the agent stopped its workers: 128 + the signal, as a shell has it (Ctrl-C: 130)
        signal_number = int(getattr(exc, "sigval", 0))
        return 128 + signal_number if signal_number > 0 else ExitCode.INTERRUPTED
    finally:
        agent_log.setLevel(agent_level)
        log_folder.cleanup()
    return ExitCode.OK
