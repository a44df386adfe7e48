"""The ``gradtrace`` command: parse options, call the library, render, map errors to exit codes.

torch is imported inside command bodies only, so ``gradtrace --help`` stays instant.
"""

from __future__ import annotations

import sys
import traceback
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


def _report(error: BaseException, debug: bool) -> int:
    """Print one clear message for an error on stderr; return the exit code."""
    console = _stderr_console()
    if isinstance(error, KeyboardInterrupt):
        console.print("[bold red]gradtrace: interrupted[/]")
        return ExitCode.INTERRUPTED
    if isinstance(error, GradtraceError):
        console.print(f"[bold red]gradtrace: error:[/] {error.message}", markup=True, highlight=False)
        details = error.details()
        if details:
            console.print(details, markup=False, highlight=False, style="dim")
        if error.hint:
            console.print(f"[bold]hint:[/] {error.hint}", highlight=False)
        if debug:
            console.print("".join(traceback.format_exception(error)), markup=False, highlight=False)
        return error.exit_code
    console.print(
        f"[bold red]gradtrace: internal error:[/] {type(error).__name__}: {error}", markup=True, highlight=False
    )
    if debug:
        console.print("".join(traceback.format_exception(error)), markup=False, highlight=False)
    else:
        console.print("This is a bug in gradtrace. Rerun with --debug and report the output.", highlight=False)
    return ExitCode.INTERNAL


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

    def __init__(self) -> None:
        console = _stderr_console()
        self._status = console.status("") if console.is_terminal else None
        if self._status is not None:
            self._status.start()

    def update(self, message: str) -> None:
        if self._status is not None:
            self._status.update(message)

    def stop(self) -> None:
        if self._status is not None:
            self._status.stop()


@app.command()
def run(
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
    device: str = typer.Option("cpu", "--device", help="Device for the model and inputs, e.g. cpu, cuda, cuda:1."),
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
        None, "--json", metavar="PATH", help="Write the trace as JSON to PATH; '-' writes it alone to stdout.",
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
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks, gradtrace's own frames included."),
) -> None:
    """Run forward and backward with a hook on every autograd node and show what each node saw.

    Prints a tree of backward nodes (name, module, grad_in/grad_out shapes and norms) and a summary.
    Exit codes: 0 ok, 2 usage or input-spec error, 3 the model could not be loaded or raised,
    70 internal error, 130 interrupted.
    """

    def body() -> int:
        import re

        from .errors import UsageError

        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise UsageError(f"invalid --filter regular expression {pattern!r}: {exc}") from exc
        status = _Status()
        try:
            status.update("loading the model")
            from .loading import prepare_run
            from .tracing import trace

            prepared = prepare_run(
                target,
                input_specs=list(input or []),
                inputs_file=str(inputs) if inputs is not None else None,
                seed=seed,
                device=device,
            )
            status.update("running forward and backward")
            result = trace(
                prepared.loaded.model,
                prepared.args,
                prepared.kwargs,
                loss_fn=prepared.loaded.loss_fn,
                loss_reduction=loss.value,
                input_grad=not no_input_grad,
                train=False if eval_mode else None,
                target=target,
                seed=seed,
            )
        finally:
            status.stop()
        _emit(result, json_path, view.value, None if show_all else max_nodes, depth, pattern)
        return ExitCode.OK

    _guarded(debug, body)


def _emit(result: Any, json_path: str | None, view: str, max_nodes: int | None, depth: int | None, pattern: str | None) -> None:
    from .errors import UsageError
    from .render.json import dumps

    if json_path is not None:
        text = dumps(result)
        if json_path == "-":
            sys.stdout.write(text)
            sys.stdout.flush()
            return
        try:
            Path(json_path).write_text(text, encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot write {json_path}: {exc.strerror or exc}") from exc
    from rich.console import Console

    from .render.tree import TreeOptions, render_trace

    console = Console(highlight=False, soft_wrap=False)
    console.print(render_trace(result, TreeOptions(view=view, max_nodes=max_nodes, depth=depth, pattern=pattern)))
    if json_path is not None:
        _stderr_console().print(f"trace written to {json_path}", style="dim")


def main() -> None:
    """Console-script entry point."""
    app(prog_name="gradtrace")


if __name__ == "__main__":  # pragma: no cover
    main()
