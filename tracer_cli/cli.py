"""The ``gradtrace`` command: parse options, call the library, render, map errors to exit codes.

torch is imported inside command bodies only, so ``gradtrace --help`` stays instant.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer

from . import __version__
from .errors import ExitCode, GradtraceError

app = typer.Typer(
    name="gradtrace",
    help="Trace every node of a PyTorch backward pass: gradient shapes, norms, NaN/Inf, and the module "
    "that created each node.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class View(str, Enum):
    modules = "modules"
    graph = "graph"


class LossReduction(str, Enum):
    sum = "sum"
    mean = "mean"


def _version(value: bool) -> None:
    if value:
        typer.echo(f"gradtrace {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Show the version and exit."
    ),
) -> None:
    """Trace every node of a PyTorch backward pass."""


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def _error_lines(error: BaseException, debug: bool) -> tuple[list[tuple[str, str]], int]:
    """The message for an error as ``(text, style)`` lines, and the exit code."""
    if isinstance(error, KeyboardInterrupt):
        return [("gradtrace: interrupted", "bold red")], ExitCode.INTERRUPTED
    full = "".join(traceback.format_exception(error)).rstrip()
    if isinstance(error, GradtraceError):
        lines = [(f"gradtrace: error: {error.message}", "bold red")]
        details = error.details()
        if details:
            lines += [(line, "dim") for line in details.splitlines()]
        if error.hint:
            lines.append((f"hint: {error.hint}", "bold"))
        if debug:
            lines += [(line, "") for line in full.splitlines()]
        return lines, error.exit_code
    lines = [(f"gradtrace: internal error: {type(error).__name__}: {error}", "bold red")]
    if debug:
        lines += [(line, "") for line in full.splitlines()]
    else:
        lines.append(("This is a bug in gradtrace. Rerun with --debug and report the output.", ""))
    return lines, ExitCode.INTERNAL


def _report(error: BaseException, debug: bool, prefix: str = "") -> int:
    """Print one clear message for an error on stderr, every line prefixed; return the exit code.

    The message is written in one piece, so that lines of several ranks never interleave.
    """
    import io

    from rich.console import Console
    from rich.text import Text

    lines, code = _error_lines(error, debug)
    stderr = _stderr_console()
    buffer = io.StringIO()
    console = Console(
        file=buffer, force_terminal=stderr.is_terminal, color_system=stderr.color_system, soft_wrap=True, highlight=False
    )
    for text, style in lines:
        console.print(Text(prefix, style="dim") + Text(text, style=style))
    sys.stderr.flush()
    try:
        sys.stderr.write(buffer.getvalue())
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed: the exit code still says it
        pass
    return code


def _guarded(debug: bool, body: Callable[[], int]) -> None:
    """Run a command body; exit with its code, or with the code of the error it raised."""
    try:
        code = body()
    except typer.Exit:
        raise
    except (GradtraceError, KeyboardInterrupt) as error:
        code = _report(error, debug)
    except Exception as error:  # anything else is a gradtrace bug
        code = _report(error, debug)
    raise typer.Exit(int(code))


class _Status:
    """A transient spinner on stderr, only when stderr is a terminal."""

    def __init__(self, enabled: bool = True) -> None:
        console = _stderr_console()
        self._status = console.status("") if enabled and console.is_terminal else None
        if self._status is not None:
            self._status.start()

    def update(self, message: str) -> None:
        if self._status is not None:
            self._status.update(message)

    def stop(self) -> None:
        if self._status is not None:
            self._status.stop()


@dataclass
class _RunOptions:
    """The parsed options of ``gradtrace run``."""

    target: str
    input_specs: list[str]
    inputs_file: str | None
    seed: int
    device: str
    eval_mode: bool
    input_grad: bool
    loss: str
    json_path: str | None
    tree: Any  # TreeOptions
    ranks: str
    rank_seed: bool
    rtol: float
    timeout: float
    fail_on: tuple[str, ...]
    debug: bool


@app.command()
def run(
    ctx: typer.Context,
    target: str = typer.Argument(
        ...,
        metavar="TARGET",
        help="Model file or import path: model.py, model.py:NAME or package.module:NAME.",
        show_default=False,
    ),
    input: Optional[List[str]] = typer.Option(
        None,
        "--input",
        "-i",
        metavar="SPEC",
        help="Input spec DTYPE[D0,D1,...][:INIT], e.g. float32[8,3,32,32], int64[2,128]:randint(0,50257). "
        "Repeat for more arguments; NAME=SPEC for keyword arguments. Overrides example_inputs().",
        show_default=False,
    ),
    inputs: Optional[Path] = typer.Option(
        None, "--inputs", metavar="FILE", help="Inputs from a .pt file of tensors (loaded with "
        "weights_only=True) or a .json list of specs.", show_default=False,
    ),
    seed: int = typer.Option(0, "--seed", help="Seed set before the model and the inputs are built."),
    device: str = typer.Option(
        "cpu", "--device", help="Device for the model and inputs, e.g. cpu, cuda, cuda:1 (under torchrun, cuda means "
        "cuda:LOCAL_RANK)."
    ),
    eval_mode: bool = typer.Option(
        False, "--eval", help="Trace in eval mode (default: the mode the model is in). The mode is restored."
    ),
    no_input_grad: bool = typer.Option(
        False, "--no-input-grad", help="Do not make floating-point inputs require grad (no input:N leaves)."
    ),
    loss: LossReduction = typer.Option(
        LossReduction.sum, "--loss", help="Without loss_fn, reduce each floating-point output with .sum() or .mean()."
    ),
    json_path: Optional[str] = typer.Option(
        None, "--json", metavar="PATH", help="Write the trace as JSON to PATH; '-' writes it alone to stdout. "
        "Under torchrun rank 0 writes one file with every rank and the comparison.",
        show_default=False,
    ),
    view: View = typer.Option(
        View.modules, "--view", help="modules: nodes grouped under the module tree; graph: the backward graph from the loss."
    ),
    max_nodes: int = typer.Option(200, "--max-nodes", min=1, help="Show at most this many node lines."),
    depth: Optional[int] = typer.Option(
        None, "--depth", min=0, help="Show modules (or graph branches) down to this depth; deeper ones are summarised.",
        show_default=False,
    ),
    pattern: Optional[str] = typer.Option(
        None, "--filter", metavar="REGEX", help="Show only nodes whose name, module or parameter matches.",
        show_default=False,
    ),
    show_all: bool = typer.Option(False, "--all", help="Show every node line (no --max-nodes bound)."),
    fail_on: Optional[str] = typer.Option(
        None, "--fail-on", metavar="CHECKS", help="Exit 1 when any of these is found (comma list): nonfinite "
        "(NaN/Inf gradients), nograd (parameters without gradient), zero (all-zero parameter gradients), "
        "divergence (ranks disagree).", show_default=False,
    ),
    nproc_per_node: Optional[int] = typer.Option(
        None, "--nproc-per-node", min=1, metavar="N", help="Launch N local ranks with torch's elastic launcher "
        "(as torchrun --standalone) and compare them.", show_default=False,
    ),
    ranks: str = typer.Option("all", "--ranks", metavar="RANKS", help="Under torchrun: whose trees to print, "
        "e.g. 0,2 or all."),
    rank_seed: bool = typer.Option(
        False, "--rank-seed", help="Under torchrun: offset the seed by the rank (different data per rank)."
    ),
    rtol: float = typer.Option(1e-5, "--rtol", min=0.0, help="Relative tolerance when comparing ranks."),
    timeout: float = typer.Option(
        120.0, "--timeout", min=1.0, metavar="SECONDS", help="Under torchrun: how long to wait for the other ranks."
    ),
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks, gradtrace's own frames included."),
) -> None:
    """Run forward and backward with a hook on every autograd node and show what each node saw.

    Prints a tree of backward nodes (name, module, grad_in/grad_out shapes and norms) and a summary. Under torchrun
    (or with --nproc-per-node) every rank traces and rank 0 compares them.

    Exit codes: 0 ok, 1 a --fail-on check failed, 2 usage or input-spec error, 3 the model could not be loaded or
    raised, 70 internal error, 130 interrupted.
    """

    def body() -> int:
        import re

        from .checks import parse_fail_on
        from .errors import UsageError
        from .render.tree import TreeOptions

        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise UsageError(f"invalid --filter regular expression {pattern!r}: {exc}") from exc
        try:
            checks = parse_fail_on(fail_on)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        options = _RunOptions(
            target=target,
            input_specs=list(input or []),
            inputs_file=str(inputs) if inputs is not None else None,
            seed=seed,
            device=device,
            eval_mode=eval_mode,
            input_grad=not no_input_grad,
            loss=loss.value,
            json_path=json_path,
            tree=TreeOptions(view=view.value, max_nodes=None if show_all else max_nodes, depth=depth, pattern=pattern),
            ranks=ranks,
            rank_seed=rank_seed,
            rtol=rtol,
            timeout=timeout,
            fail_on=checks,
            debug=debug,
        )
        from .distributed import launch, rank_info

        info = rank_info()
        if nproc_per_node is not None:
            if info is not None:
                raise UsageError("--nproc-per-node launches ranks itself: do not combine it with torchrun")
            return launch(nproc_per_node, _forwarded_args(ctx, drop={"nproc_per_node"}))
        if info is None:
            return _run_single(options)
        return _run_ranks(options, info)

    _guarded(debug, body)


def _forwarded_args(ctx: typer.Context, drop: set[str]) -> list[str]:
    """The command line that reproduces this invocation's parameters (for the launched workers)."""
    args: list[str] = []
    for param in ctx.command.params:
        if param.name in drop or param.param_type_name != "option":
            continue
        value = ctx.params.get(param.name)
        if value is None or value == param.default or value == ():
            continue
        flag = param.opts[-1] if param.opts[-1].startswith("--") else param.opts[0]
        if param.is_flag:
            args.append(flag)
        elif isinstance(value, (list, tuple)):
            for item in value:
                args += [flag, str(item)]
        else:
            args += [flag, str(value.value if isinstance(value, Enum) else value)]
    for param in ctx.command.params:
        if param.param_type_name == "argument":
            args.append(str(ctx.params[param.name]))
    return ["run", *args]


def _trace(options: _RunOptions, *, seed: int, device: str, rank: int = 0, world_size: int = 1) -> Any:
    """Load the target, make the inputs and trace: the library calls behind ``run``."""
    from .loading import prepare_run
    from .tracing import trace

    prepared = prepare_run(
        options.target, input_specs=options.input_specs, inputs_file=options.inputs_file, seed=seed, device=device
    )
    return trace(
        prepared.loaded.model,
        prepared.args,
        prepared.kwargs,
        loss_fn=prepared.loaded.loss_fn,
        loss_reduction=options.loss,
        input_grad=options.input_grad,
        train=False if options.eval_mode else None,
        target=options.target,
        seed=seed,
        forward_stats=world_size > 1,
        rank=rank,
        world_size=world_size,
    )


def _run_single(options: _RunOptions) -> int:
    from .checks import failing, trace_findings

    status = _Status()
    try:
        status.update("loading the model, then running forward and backward")
        result = _trace(options, seed=options.seed, device=options.device)
    finally:
        status.stop()
    findings = failing(trace_findings(result), options.fail_on)
    if options.json_path is not None:
        from .render.json import dumps

        _write_json(options.json_path, dumps(result))
        if options.json_path == "-":
            return _verdict(findings)
    from rich.console import Console

    from .render.tree import render_trace

    console = Console(highlight=False)
    console.print(render_trace(result, options.tree))
    _print_findings(console, findings, "")
    if options.json_path is not None:
        _stderr_console().print(f"trace written to {options.json_path}", style="dim", markup=False)
    return _verdict(findings)


def _run_ranks(options: _RunOptions, info: Any) -> int:
    """Every rank traces; rank 0 gathers, compares, prints every rank's lines with their prefix."""
    import os

    from .distributed import ProcessGroup

    group = ProcessGroup(info, timeout_s=options.timeout)
    try:
        device = group.start(options.device)
        seed = options.seed + info.rank if options.rank_seed else options.seed
        result = _trace(options, seed=seed, device=device, rank=info.rank, world_size=info.world_size)
        documents = group.gather(result.to_dict())
        code = _compare_and_show(options, documents) if info.rank == 0 else ExitCode.OK
        code = group.broadcast(int(code))
        group.close()
        return code
    except BaseException as error:  # noqa: BLE001 - every failure ends this rank at once
        code = _report(error, options.debug, prefix=info.prefix)
        # Exit now, skipping interpreter shutdown: the process group's destructors could wait on ranks
        # that are blocked in a collective. torchrun's agent sees the exit and stops the other ranks.
        os._exit(int(code))


def _compare_and_show(options: _RunOptions, documents: list[dict[str, Any]]) -> int:
    """Rank 0's part: compare the gathered traces, print the trees and the verdict, write the merged JSON."""
    from dataclasses import replace

    from rich.console import Console

    from .checks import comparison_findings, failing, trace_findings
    from .compare import compare
    from .records import Trace
    from .render.comparison import divergence_marks, prefixed_lines, render_comparison
    from .render.json import dumps_merged
    from .render.tree import render_trace

    traces = [Trace.from_dict(document) for document in documents]
    comparison = compare(traces, rtol=options.rtol, inputs_differ=options.rank_seed)
    findings = [f for t in traces for f in trace_findings(t)] + comparison_findings(comparison)
    failed = failing(findings, options.fail_on)
    if options.json_path is not None:
        _write_json(options.json_path, dumps_merged(traces, comparison))
        if options.json_path == "-":
            return _verdict(failed)
    console = Console(highlight=False)
    shown = _selected_ranks(options.ranks, len(traces))
    tree_options = replace(options.tree, marks=divergence_marks(comparison))
    lines = []
    for rank in shown:
        lines += prefixed_lines(console, render_trace(traces[rank], tree_options), f"[rank{rank}] ")
    lines += prefixed_lines(console, render_comparison(comparison), "[rank0] ")
    for line in lines:
        console.print(line, soft_wrap=True)
    _print_findings(console, failed, "[rank0] ")
    if options.json_path is not None:
        _stderr_console().print(f"[rank0] merged trace of {len(traces)} ranks written to {options.json_path}", style="dim", markup=False)
    return _verdict(failed)


def _selected_ranks(text: str, world_size: int) -> list[int]:
    from .errors import UsageError

    if text.strip() == "all":
        return list(range(world_size))
    try:
        chosen = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError as exc:
        raise UsageError(f"--ranks takes 'all' or a comma list of ranks, not {text!r}") from exc
    outside = [r for r in chosen if not 0 <= r < world_size]
    if outside:
        raise UsageError(f"--ranks {text}: no rank {outside[0]} in a job of {world_size}")
    return chosen


def _print_findings(console: Any, findings: list[Any], prefix: str) -> None:
    from rich.console import Group
    from rich.text import Text

    from .render.comparison import prefixed_lines

    lines = [Text(f"FAIL {finding.kind}: {finding.message}", style="bold red") for finding in findings]
    for line in prefixed_lines(console, Group(*lines), prefix) if lines else ():
        console.print(line, soft_wrap=True)


def _verdict(findings: list[Any]) -> int:
    return ExitCode.GRADIENT_PROBLEMS if findings else ExitCode.OK


def _write_json(json_path: str, text: str) -> None:
    from .errors import UsageError

    if json_path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        Path(json_path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write {json_path}: {exc.strerror or exc}") from exc


def main() -> None:
    """Console-script entry point."""
    app(prog_name="gradtrace")


if __name__ == "__main__":  # pragma: no cover
    main()
