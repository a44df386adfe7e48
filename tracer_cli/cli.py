"""The ``gradtrace`` command: parse options, call the library, render, map errors to exit codes.

torch is imported inside command bodies only, so ``gradtrace --help`` stays instant.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import re
import shutil
import sys
import traceback
import warnings
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Iterator, List, NoReturn, Optional

import typer

from . import __version__
from .errors import ExitCode, GradtraceError, message_of

app = typer.Typer(
    name="gradtrace",
    help="Trace every node of a PyTorch backward pass: gradient shapes, norms, NaN/Inf, and the module "
    "that created each node.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    rich_markup_mode=None,
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

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    width = _width(console.is_terminal)
    if width is not None:
        console.width = width
    return console


def _width(terminal: bool) -> int | None:
    """The width for a console where ``COLUMNS`` is set but is no width (0, empty, ``abc``: Rich took 0, and
    printed nothing); None where Rich's own choice stands."""
    import os

    columns = os.environ.get("COLUMNS")
    if columns is None or (columns.strip().isdigit() and int(columns) > 0):
        return None
    return shutil.get_terminal_size().columns if terminal else _LOG_WIDTH


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
        file=buffer, force_terminal=stderr.is_terminal, color_system=stderr.color_system, soft_wrap=True, highlight=False,
        width=stderr.width,
    )
    for text, style in lines:
        for line in text.splitlines() or [""]:  # a message of several lines (load_state_dict's): each prefixed
            console.print(Text(prefix, style="dim") + Text(line, style=style))
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

    def __init__(self) -> None:
        console = _stderr_console()
        try:  # a terminal, not a log that keeps colours (FORCE_COLOR), where each frame would be a line
            terminal = console.is_terminal and sys.stderr.isatty()
        except (AttributeError, ValueError):
            terminal = False
        self._status = console.status("") if terminal else None
        if self._status is not None:
            self._status.start()

    def update(self, message: str) -> None:
        if self._status is not None:
            self._status.update(message)

    def stop(self) -> None:
        if self._status is not None:
            self._status.stop()

    def note(self, message: str) -> None:
        """A line on stderr that stays, above the spinner while it spins."""
        if self._status is not None:
            self._status.console.print(message, style="dim", markup=False)
        else:
            _note(message)


# The options of `run` and `check`, defined once. Both commands list them; `_options` reads their values
# from the click context (after `[tool.gradtrace]` defaults), so neither command body copies them.
_INPUT = typer.Option(
    None,
    "--input",
    "-i",
    metavar="SPEC",
    help="Input spec DTYPE[D0,D1,...][:INIT], e.g. float32[8,3,32,32], int64[2,128]:randint(0,50257). "
    "Repeat for more arguments; NAME=SPEC for keyword arguments. Overrides example_inputs().",
    show_default=False,
)
_INPUTS = typer.Option(
    None, "--inputs", metavar="FILE", help="Inputs from a .pt file of tensors (loaded with "
    "weights_only=True) or a .json list of specs (or an object of NAME: SPEC, keyword arguments).", show_default=False,
)
_SEED = typer.Option(0, "--seed", help="Seed set before the model and the inputs are built.")
_DEVICE = typer.Option(
    "cpu", "--device", help="Device for the model and inputs, e.g. cpu, cuda, cuda:1 (under torchrun, cuda means "
    "cuda:LOCAL_RANK)."
)
_EVAL = typer.Option(
    False, "--eval/--no-eval", help="Trace in eval mode (default: the mode the model is in). The mode is restored. "
    "--no-eval undoes eval = true in the tool.gradtrace table."
)
_NO_INPUT_GRAD = typer.Option(
    False, "--no-input-grad/--input-grad", help="Do not make floating-point inputs require grad (no input:N "
    "leaves). --input-grad undoes no-input-grad = true in the tool.gradtrace table."
)
_LOSS = typer.Option(
    LossReduction.sum, "--loss", help="Without loss_fn, reduce each floating-point output with .sum() or .mean()."
)
_VIEW = typer.Option(
    View.modules, "--view", help="modules: nodes grouped under the module tree; graph: the backward graph from the loss."
)
_MAX_NODES = typer.Option(200, "--max-nodes", min=1, help="Show at most this many node lines.")
_DEPTH = typer.Option(
    None, "--depth", min=0, help="Show modules (or graph branches) down to this depth; deeper ones are summarised.",
    show_default=False,
)
_FILTER = typer.Option(
    None, "--filter", metavar="REGEX", help="Show only nodes whose name, module or parameter matches.",
    show_default=False,
)
_ALL = typer.Option(False, "--all", help="Show every node line (no --max-nodes bound).")
_CHECK_NAMES = "nonfinite (NaN/Inf gradients), nograd (parameters without gradient), zero (all-zero parameter " \
    "gradients), norm (outside --max-grad-norm/--min-grad-norm), divergence (ranks disagree), gradcheck (a custom " \
    "Function failed --gradcheck), replay (a backward not reproducible under --replay)"
_FAIL_ON = typer.Option(
    None, "--fail-on", metavar="CHECKS", help=f"Exit 1 when any of these is found (comma list; repeatable): {_CHECK_NAMES}. "
    "Added to the checks that fail anyway (check: nonfinite, nograd, gradcheck; run and check: norm when a "
    "threshold is set).",
    show_default=False,
)
_WARN_ON = typer.Option(
    None, "--warn-on", metavar="CHECKS", help="Only warn about these checks (comma list; repeatable), even where they would "
    "fail, e.g. nograd for a model with a parameter it does not use on purpose.", show_default=False,
)
_MAX_GRAD_NORM = typer.Option(
    None, "--max-grad-norm", min=0.0, metavar="X", help="Flag parameters whose gradient norm is above X, and a total "
    "norm (all parameters) above X. Setting it makes the norm check fail.", show_default=False,
)
_MIN_GRAD_NORM = typer.Option(
    None, "--min-grad-norm", min=0.0, metavar="X", help="Flag parameters whose gradient norm is below X (vanishing), "
    "and a total norm below X. Setting it makes the norm check fail.", show_default=False,
)
_NPROC_PER_NODE = typer.Option(
    None, "--nproc-per-node", min=1, metavar="N", help="Launch N local ranks with torch's elastic launcher "
    "(as torchrun --standalone) and compare them.", show_default=False,
)
_RANKS = typer.Option(
    "all", "--ranks", metavar="RANKS", help="Under torchrun: whose trees to print, e.g. 0,2 or all."
)
_RANK_SEED = typer.Option(
    False, "--rank-seed/--no-rank-seed", help="Under torchrun: offset the seed of the inputs by the rank (different data per rank, the same model)."
)
_RTOL = typer.Option(1e-5, "--rtol", min=0.0, help="Relative tolerance when comparing ranks.")
_TIMEOUT = typer.Option(
    120.0, "--timeout", min=1.0, metavar="SECONDS", help="Under torchrun: how long to wait for the other ranks."
)
_DEBUG = typer.Option(False, "--debug", help="Show full tracebacks, gradtrace's own frames included.")
_REPLAY = typer.Option(
    False, "--replay", help="Run each node's backward again inside its hook, from the gradients it received, and "
    "report nodes whose backward is not reproducible (hidden state, nondeterminism, communication)."
)
_GRADCHECK = typer.Option(
    False, "--gradcheck", help="Check every custom autograd.Function's backward numerically (float64, along "
    "random directions) on the inputs it was called with."
)
_STACK = typer.Option(False, "--stack", help="Record the full user stack behind every node and show it.")
_NO_SOURCES = typer.Option(
    False, "--no-sources/--sources", help="Do not record the source line that created each node (a Python trace "
    "function while forward runs); non-finite origins are then named without their line."
)


@dataclass
class _Options:
    """The parsed options of ``run`` or ``check``, with ``[tool.gradtrace]`` defaults applied."""

    command: str  # "run" or "check"
    targets: list[str]
    input_specs: list[str]
    inputs_file: str | None
    seed: int
    device: str
    eval_mode: bool
    input_grad: bool
    loss: str
    json_path: str | None
    junit_xml: str | None
    show_tree: bool
    tree: Any  # TreeOptions
    ranks: str
    rank_seed: bool
    rtol: float
    timeout: float
    policy: Any  # CheckPolicy
    debug: bool
    replay: bool = False
    gradcheck: bool = False
    stack: bool = False
    sources: bool = True
    exports: dict[str, str] = field(default_factory=dict)  # "svg" / "html" / "dot" -> path


@app.command(short_help="Trace one forward and backward: every node's gradients.")
def run(
    ctx: typer.Context,
    target: str = typer.Argument(
        ...,
        metavar="TARGET",
        help="Model file or import path: model.py, model.py:NAME or package.module:NAME.",
        show_default=False,
    ),
    input: Optional[List[str]] = _INPUT,
    inputs: Optional[Path] = _INPUTS,
    seed: int = _SEED,
    device: str = _DEVICE,
    eval_mode: bool = _EVAL,
    no_input_grad: bool = _NO_INPUT_GRAD,
    loss: LossReduction = _LOSS,
    json_path: Optional[str] = typer.Option(
        None, "--json", metavar="PATH", help="Write the trace as JSON to PATH; '-' writes it alone to stdout "
        "(what the model prints goes to stderr). Under torchrun rank 0 writes one file with every rank and the "
        "comparison. The file holds each node's forward value too (for gradtrace diff), recorded per op in "
        "forward, which makes the step slower.",
        show_default=False,
    ),
    view: View = _VIEW,
    max_nodes: int = _MAX_NODES,
    depth: Optional[int] = _DEPTH,
    pattern: Optional[str] = _FILTER,
    show_all: bool = _ALL,
    fail_on: Optional[List[str]] = _FAIL_ON,
    warn_on: Optional[List[str]] = _WARN_ON,
    max_grad_norm: Optional[float] = _MAX_GRAD_NORM,
    min_grad_norm: Optional[float] = _MIN_GRAD_NORM,
    nproc_per_node: Optional[int] = _NPROC_PER_NODE,
    ranks: str = _RANKS,
    rank_seed: bool = _RANK_SEED,
    rtol: float = _RTOL,
    timeout: float = _TIMEOUT,
    replay: bool = _REPLAY,
    gradcheck: bool = _GRADCHECK,
    stack: bool = _STACK,
    no_sources: bool = _NO_SOURCES,
    svg: Optional[str] = typer.Option(
        None, "--svg", metavar="PATH", help="Also save what is printed as an SVG picture.", show_default=False
    ),
    html: Optional[str] = typer.Option(
        None, "--html", metavar="PATH", help="Also save what is printed as an HTML page.", show_default=False
    ),
    dot: Optional[str] = typer.Option(
        None, "--dot", metavar="PATH", help="Save the backward graph in Graphviz DOT (render: dot -Tsvg PATH).",
        show_default=False,
    ),
    debug: bool = _DEBUG,
) -> None:
    """Run forward and backward with a hook on every autograd node; show what each saw.

    Prints a tree of backward nodes (name, module, grad_in/grad_out shapes and
    norms) and a summary. Under torchrun (or with --nproc-per-node) every rank
    traces and rank 0 compares them. Defaults come from the tool.gradtrace table
    of the nearest pyproject.toml.

    Exit codes: 0 ok, 1 a --fail-on check (or a norm threshold) failed, 2 usage or input-spec error,
    3 the model could not be loaded or raised, 70 internal error, 130 interrupted.
    """
    _guarded(debug, lambda: _execute(ctx))


@app.command(short_help="Check gradient health and fail on problems (for CI).")
def check(
    ctx: typer.Context,
    targets: Optional[List[str]] = typer.Argument(
        None,
        metavar="TARGET...",
        help="Model files or import paths (model.py, model.py:NAME, package.module:NAME); default: the targets "
        "key of the tool.gradtrace table in pyproject.toml.",
        show_default=False,
    ),
    input: Optional[List[str]] = _INPUT,
    inputs: Optional[Path] = _INPUTS,
    seed: int = _SEED,
    device: str = _DEVICE,
    eval_mode: bool = _EVAL,
    no_input_grad: bool = _NO_INPUT_GRAD,
    loss: LossReduction = _LOSS,
    fail_on: Optional[List[str]] = _FAIL_ON,
    warn_on: Optional[List[str]] = _WARN_ON,
    max_grad_norm: Optional[float] = _MAX_GRAD_NORM,
    min_grad_norm: Optional[float] = _MIN_GRAD_NORM,
    junit_xml: Optional[str] = typer.Option(
        None, "--junit-xml", metavar="PATH", help="Write a JUnit XML report to PATH: a test case per check and "
        "target, failures carrying the findings.", show_default=False,
    ),
    tree: bool = typer.Option(False, "--tree", help="Also print each target's node tree and summary."),
    view: View = _VIEW,
    max_nodes: int = _MAX_NODES,
    depth: Optional[int] = _DEPTH,
    pattern: Optional[str] = _FILTER,
    show_all: bool = _ALL,
    nproc_per_node: Optional[int] = _NPROC_PER_NODE,
    ranks: str = _RANKS,
    rank_seed: bool = _RANK_SEED,
    rtol: float = _RTOL,
    timeout: float = _TIMEOUT,
    replay: bool = _REPLAY,
    gradcheck: bool = _GRADCHECK,
    stack: bool = _STACK,
    no_sources: bool = _NO_SOURCES,
    debug: bool = _DEBUG,
) -> None:
    """Check gradient health: trace each target, fail on unhealthy gradients (for CI).

    Findings: non-finite gradients anywhere in the graph (also masked ones),
    parameters without gradient, all-zero parameter gradients, norms outside
    --max-grad-norm/--min-grad-norm, ranks that disagree. Failing by default:
    nonfinite, nograd, gradcheck (with --gradcheck), and norm when a threshold
    is set; the others warn unless named in --fail-on. Prints a findings table per target and a verdict line;
    with GITHUB_ACTIONS=true also ::error/::warning annotation lines. Defaults
    come from the tool.gradtrace table of the nearest pyproject.toml.

    Exit codes: 0 healthy, 1 failing findings, 2 usage or input-spec error,
    3 a model could not be loaded or raised, 70 internal error, 130 interrupted.
    """
    _guarded(debug, lambda: _execute(ctx))


RANK_ALONE_AFTER_S = 2.0  # how long a rank other than 0 waits before it reports a usage error of its own


def _execute(ctx: typer.Context) -> int:
    """The body of ``run`` and ``check``: options, then one process, torchrun ranks, or the launcher."""
    from .distributed import launch, rank_info
    from .errors import UsageError

    info = rank_info()
    nproc_per_node = ctx.params["nproc_per_node"]
    try:
        options = _options(ctx)
        world_size = nproc_per_node or (info.world_size if info is not None else 0)
        if world_size > 0:  # --ranks beyond the job: said before any rank traces
            _selected_ranks(options.ranks, world_size)
    except UsageError as error:
        if info is not None and info.rank != 0 and nproc_per_node is None:
            # Every rank has the same options, so rank 0 says what is wrong, once, and torchrun's agent stops
            # this rank meanwhile. One wrong on this rank alone (a file that only rank 0's machine has) is
            # said here, with the rank's prefix.
            import time

            time.sleep(RANK_ALONE_AFTER_S)
            return _report(error, ctx.params.get("debug", False), prefix=info.prefix)
        raise
    if nproc_per_node is not None:
        if info is not None:
            raise UsageError("--nproc-per-node launches ranks itself: do not combine it with torchrun")
        if options.command == "run":  # a model file that is not there: said once, before any rank starts
            from .loading import check_file, split_target

            kind, location, _ = split_target(options.targets[0])
            if kind == "file":
                check_file(location)
        return launch(nproc_per_node, _forwarded_args(ctx, drop={"nproc_per_node"}))
    if info is not None:
        return _run_ranks(options, info)
    if options.command == "check":
        return _check_single(options)
    return _run_single(options)


_CHECK_LISTS = (("fail_on", "fail-on"), ("warn_on", "warn-on"))  # parameter, and the option's (and config key's) name


def _options(ctx: typer.Context) -> _Options:
    """Validate the command's parameters, with ``[tool.gradtrace]`` defaults for those not given."""
    import re

    from .checks import (
        CHECK_DEFAULT_FAILING,
        CheckPolicy,
        Thresholds,
        merge_checks,
        parse_fail_on,
        unmet_requirement,
    )
    from .config import load_config
    from .distributed import rank_info
    from .errors import UsageError
    from .render.tree import TreeOptions

    command = ctx.info_name or "run"
    try:
        config = load_config()
    except UsageError:
        _check_outputs(command, dict(ctx.params))  # those given on the command line: no stale result is left
        raise
    params = _with_config(ctx, config)
    # first: an error found below leaves no result of an earlier run behind, for a CI job to read as this one's
    exports = _check_outputs(command, params)
    pattern = params["pattern"]
    if pattern is not None:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise UsageError(f"invalid --filter regular expression {pattern!r}: {exc}") from exc
    given = _given(ctx)
    try:  # --fail-on and --warn-on are comma lists, and repeats add up
        command_line = {key: parse_fail_on(",".join(ctx.params[key] or ()), option=f"--{option}") for key, option in _CHECK_LISTS}
        configured = {key: parse_fail_on(config.values.get(option), option=option) for key, option in _CHECK_LISTS}
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    for lists, where in ((command_line, "--fail-on and --warn-on"), (configured, "fail-on and warn-on in [tool.gradtrace]")):
        both = [check for check in lists["fail_on"] if check in lists["warn_on"]]
        if both:
            raise UsageError(f"{', '.join(both)} named in both {where}", hint="name each check in one of them")
    thresholds = Thresholds(params["max_grad_norm"], params["min_grad_norm"])
    if not thresholds.active and {"max_grad_norm", "min_grad_norm"} & given:
        # the thresholds switched off on the command line (--max-grad-norm inf): the config's norm check goes with them
        configured = {key: tuple(check for check in checks if check != "norm") for key, checks in configured.items()}
    merged = merge_checks(configured, command_line)
    fail_on, warn_on = merged["fail_on"], merged["warn_on"]
    one_process = ctx.params.get("nproc_per_node") is None and rank_info() is None
    # asked for on the command line of one process, it would check nothing (a config shared with torchrun jobs may)
    divergence_options = [f"--{option}" for key, option in _CHECK_LISTS if "divergence" in command_line[key]]
    if divergence_options and one_process:
        raise UsageError(
            f"{divergence_options[0]} divergence compares ranks: it needs torchrun (or --nproc-per-node N)",
            hint="run under torchrun --nproc-per-node N --no-python gradtrace check ..., or leave divergence out",
        )
    ignored = [option for name, option in (("rank_seed", "--rank-seed"), ("ranks", "--ranks")) if name in given]
    if one_process and ignored:  # (a config shared with torchrun jobs may set them: said only of the command line)
        verb = "apply" if len(ignored) > 1 else "applies"
        _note(f"{' and '.join(ignored)} only {verb} under torchrun (or --nproc-per-node N): ignored here, where one process traces")
    from_config = {name for name in params if name not in given and params[name] != ctx.params.get(name)}

    def named(param: str, option: str) -> str:
        """How the user set it: ``--seed``, or ``seed in [tool.gradtrace]``."""
        return f"{option[2:]} in [tool.gradtrace]" if param in from_config else option

    asked_for = [check for check in ("gradcheck", "replay") if params.get(check, False)]
    named_here = {*command_line["fail_on"], *command_line["warn_on"]}  # (the config's word on these is replaced)
    named_checks = [(f"--{option}", command_line[key]) for key, option in _CHECK_LISTS]
    named_checks += [(f"{option} in [tool.gradtrace]", [c for c in configured[key] if c not in named_here]) for key, option in _CHECK_LISTS]
    for option, checks in named_checks:
        unmet = unmet_requirement(checks, thresholds, asked_for)  # checks that would find nothing, silently
        if unmet == "norm":
            raise UsageError(
                f"{option} names norm, which needs a threshold to check against",
                hint="add --max-grad-norm X and/or --min-grad-norm Y (max-grad-norm = X in [tool.gradtrace])",
            )
        if unmet is not None:
            raise UsageError(f"{option} names {unmet}, which needs --{unmet}: only then does the check run", hint=f"add --{unmet}")
    if None not in (thresholds.max_grad_norm, thresholds.min_grad_norm) and (
        thresholds.min_grad_norm > thresholds.max_grad_norm  # type: ignore[operator]
    ):
        raise UsageError(
            f"{named('min_grad_norm', '--min-grad-norm')} {thresholds.min_grad_norm:g} is above "
            f"{named('max_grad_norm', '--max-grad-norm')} {thresholds.max_grad_norm:g}"
        )
    if params["ranks"].strip() != "all":  # its form, also in one process (which ranks: under torchrun)
        _selected_ranks(params["ranks"], sys.maxsize)
    if not 0 <= params["seed"] < 2**63:  # torch.manual_seed's range, with room for --rank-seed's seed + rank
        raise UsageError(f"{named('seed', '--seed')} {params['seed']} is out of range", hint=f"use a seed from 0 to {2**63 - 1}")
    targets = _targets_of(command, params)
    if not targets:
        raise UsageError(
            "no targets to check",
            hint="name model files (gradtrace check model.py other.py) or set targets = [...] in [tool.gradtrace] "
            "of pyproject.toml",
        )
    inputs = params["inputs"]
    if params["input"] and inputs is not None:  # either on the command line replaces both config keys
        both_in_config = not {"input", "inputs"} & _given(ctx)
        raise UsageError(
            "[tool.gradtrace] sets both input and inputs" if both_in_config else "use either --input specs or --inputs FILE, not both",
            hint="keep one of the two keys in pyproject.toml" if both_in_config else None,
        )
    return _Options(
        command=command,
        targets=targets,
        input_specs=list(params["input"] or []),
        inputs_file=str(inputs) if inputs is not None else None,
        seed=params["seed"],
        device=params["device"],
        eval_mode=params["eval_mode"],
        input_grad=not params["no_input_grad"],
        loss=_plain(params["loss"]),
        json_path=params.get("json_path"),
        junit_xml=params.get("junit_xml"),
        show_tree=command == "run" or params.get("tree", False),
        tree=TreeOptions(
            view=_plain(params["view"]),
            max_nodes=None if params["show_all"] else params["max_nodes"],
            depth=params["depth"],
            pattern=pattern,
            show_stack=params.get("stack", False),
        ),
        ranks=params["ranks"],
        rank_seed=params["rank_seed"],
        rtol=params["rtol"],
        timeout=params["timeout"],
        policy=CheckPolicy.build(
            CHECK_DEFAULT_FAILING if command == "check" else (), fail_on=fail_on, warn_on=warn_on, thresholds=thresholds
        ),
        debug=params["debug"],
        replay=params.get("replay", False),
        gradcheck=params.get("gradcheck", False),
        stack=params.get("stack", False),
        sources=not params.get("no_sources", False),
        exports=exports,
    )


def _targets_of(command: str, params: dict[str, Any]) -> list[str]:
    return [params["target"]] if command == "run" else list(params.get("targets") or [])


def _check_outputs(command: str, params: dict[str, Any]) -> dict[str, str]:
    """Refuse output files that cannot be written, or that name a file this run reads or another output
    writes; then remove what earlier runs left there (:func:`_check_writable`). Returns the exports."""
    exports = {kind: params[kind] for kind in ("svg", "html", "dot") if params.get(kind) is not None}
    outputs = [("--json", params.get("json_path")), ("--junit-xml", params.get("junit_xml"))]
    outputs += [(f"--{kind}", path) for kind, path in exports.items()]
    read = [params.get("inputs"), *_targets_of(command, params)]
    _refuse_outputs(outputs, [str(p).rpartition(":")[0] or p for p in read if p], "a model file, or --inputs")
    return exports


def _refuse_outputs(outputs: list[tuple[str, str | None]], read: list[str], what_is_read: str) -> None:
    import os

    from .errors import UsageError

    read_paths = {os.path.realpath(path) for path in read}
    written: dict[str, str] = {}
    for option, path in outputs:
        if path is None or (path == "-" and option == "--json"):
            continue
        if path == "-":  # it would write a file named "-"
            raise UsageError(f"{option} -: only --json writes to stdout", hint=f"name a file for {option}")
        real = os.path.realpath(path) if path else path
        if real in read_paths:
            raise UsageError(f"{option} {path} would write over a file this run reads ({what_is_read})")
        if os.path.splitext(path)[1].lower() in _SOURCE_SUFFIXES:  # a module the model imports, an import-path target's file
            raise UsageError(
                f"{option} {path} would write over Python code", hint=f"name a file for {option} such as out{_SUFFIX[option]}"
            )
        if real in written:
            raise UsageError(f"{written[real]} and {option} both name {path}: each output needs a file of its own")
        written[real] = option
    for option, path in outputs:  # only once nothing is refused: a refused command removes nothing
        if path is not None and not (path == "-" and option == "--json"):
            _check_writable(path, option)


_SOURCE_SUFFIXES = (".py", ".pyi", ".pyc", ".pyd", ".so", ".pth")
_SUFFIX = {"--json": ".json", "--junit-xml": ".xml", "--svg": ".svg", "--html": ".html", "--dot": ".dot"}


def _check_writable(path: str, option: str) -> None:
    """Refuse an output file that cannot be written before the model runs, not after (a folder that is
    missing or not writable, or a folder given as the file). A file already there is removed: a run that
    fails leaves no earlier result behind, for a CI job to read as this one's."""
    import os

    from .errors import UsageError

    if not path:
        raise UsageError(f"{option} was given an empty path", hint=f"name a file for {option}")
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise UsageError(f"cannot write {path}: it is a folder")
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"cannot write {path}: {str(folder)!r} is a file, not a folder")
    if not folder.is_dir():
        raise UsageError(f"cannot write {path}: no folder {str(folder)!r}")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"cannot write {path}: permission denied")
    if target.exists() and not target.is_file():  # /dev/stdout, a named pipe: opening it is not harmless
        return
    # What access() cannot tell (a read-only file system, /proc, root's writes): try, and leave no trace.
    # Every rank of a job checks the same path at once: one rank's probe file is not an error for another.
    try:
        if target.exists():
            try:
                os.close(os.open(target, os.O_WRONLY | os.O_APPEND))
                # what an earlier run wrote goes now: should this one fail, no stale result is left to read
                # (not through a symbolic link, which the write will follow: the link stays)
                if not target.is_symlink():
                    target.unlink()
            except FileNotFoundError:  # another rank's probe (or its removal of the old file), meanwhile
                pass
        else:
            try:
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            except FileExistsError:  # another rank's probe
                return
            with contextlib.suppress(FileNotFoundError):
                target.unlink()
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None


def _with_config(ctx: typer.Context, config: Any) -> dict[str, Any]:
    """The command's parameter values, where ``[tool.gradtrace]`` replaces those left at their defaults.

    ``--input`` and ``--inputs`` are one choice: either on the command line replaces both config keys.
    Keys for options this command does not have (``targets`` for ``run``) are ignored.
    """
    params = dict(ctx.params)
    by_key = {opt[2:]: param.name for param in ctx.command.params for opt in param.opts if opt.startswith("--")}
    if "targets" in params:
        by_key["targets"] = "targets"
    given = _given(ctx)
    if given & {"input", "inputs"}:
        given |= {"input", "inputs"}
    for key, value in config.values.items():
        name = by_key.get(key)
        if name is not None and name not in given:
            params[name] = value
    return params


def _given(ctx: typer.Context) -> set[str]:
    """The names of the parameters given on the command line (not left at their defaults)."""
    # by name: Typer may run on its own copy of click, whose ParameterSource is another enum
    defaulted = {None, "DEFAULT", "DEFAULT_MAP"}
    return {name for name in ctx.params if getattr(ctx.get_parameter_source(name), "name", None) not in defaulted}


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


def _forwarded_args(ctx: typer.Context, drop: set[str]) -> list[str]:
    """The command line that reproduces this invocation's parameters (for the launched workers)."""
    args: list[str] = []
    given = _given(ctx)
    for param in ctx.command.params:
        if param.name in drop or param.param_type_name != "option":
            continue
        value = ctx.params.get(param.name)
        # given on the command line, it is forwarded even at its default: it overrides [tool.gradtrace],
        # which the workers read again (--seed 0 over seed = 7, --no-eval over eval = true)
        if value is None or value == () or (value == param.default and param.name not in given):
            continue
        flag = param.opts[-1] if param.opts[-1].startswith("--") else param.opts[0]
        if param.is_flag:
            if value:
                args.append(flag)
            elif param.secondary_opts:
                args.append(param.secondary_opts[0])
        elif isinstance(value, (list, tuple)):
            for item in value:
                args += [flag, str(item)]
        else:
            args += [flag, str(_plain(value))]
    for param in ctx.command.params:
        if param.param_type_name == "argument":
            value = ctx.params[param.name]
            if isinstance(value, (list, tuple)):
                args += [str(item) for item in value]
            elif value is not None:
                args.append(str(value))
    return [ctx.info_name or "run", *args]


def _trace(
    options: _Options,
    target: str,
    *,
    seed: int,
    device: str,
    input_seed: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    note: Callable[[str], None] | None = None,
) -> Any:
    """Load one target, make its inputs and trace it: the library calls behind ``run`` and ``check``.
    ``input_seed`` (``--rank-seed``) seeds the inputs and what forward draws, where it differs from the
    model's seed. ``note`` says what takes longer than usual (on stderr, by default)."""
    from .loading import prepare_run
    from .tracing import trace

    with _user_output_to_stderr(options.json_path == "-"), _process_state_kept():
        prepared = prepare_run(
            target,
            input_specs=options.input_specs,
            inputs_file=options.inputs_file,
            seed=seed,
            input_seed=input_seed,
            device=device,
        )
        step = functools.partial(
            trace,
            prepared.loaded.model,
            prepared.args,
            prepared.kwargs,
            loss_fn=prepared.loaded.loss_fn,
            loss_reduction=options.loss,
            input_grad=options.input_grad,
            train=False if options.eval_mode else None,
            target=target,
            seed=seed if input_seed is None else input_seed,
            rank=rank,
            world_size=world_size,
            replay=options.replay,
            gradcheck=options.gradcheck,
            sources=options.sources,
            stacks=options.stack,
        )
        import torch

        from .errors import UserCodeError
        from .inputs import InputSnapshot

        devices = [torch.device(device).index or 0] if device.startswith("cuda") else []
        # forward values let ranks, or two JSON files (gradtrace diff), be compared
        forward_stats = world_size > 1 or options.json_path is not None
        # a step traced again (below: in one process, without input gradients or for forward values) starts from
        # the same inputs
        again_possible = world_size == 1 and (options.input_grad or not forward_stats)
        inputs = InputSnapshot(*((prepared.args, prepared.kwargs) if again_possible else ((), {})))
        try:
            with torch.random.fork_rng(devices=devices):  # a step traced again starts from the same random state
                result = step(forward_stats=forward_stats)
        except UserCodeError as error:
            refused = _input_grad_refused(error)
            if world_size > 1 or not options.input_grad or refused is None:
                raise
            step = functools.partial(step, input_grad=False)
            inputs.restore()
            try:
                with torch.random.fork_rng(devices=devices):
                    result = step(forward_stats=forward_stats)
            except UserCodeError:
                raise error  # not the inputs' doing after all (a parameter changed in place): the first error stands
            (note or _note)(
                f"{refused}, which torch refuses while the inputs require grad: traced again without gradients for "
                "the inputs (--no-input-grad)"
            )
        if forward_stats:
            return result
        loss = result.meta.loss
        if loss is None or math.isfinite(loss):
            return result
        # a non-finite loss: forward made it, and only forward values tell where. The same step again, from the
        # same random state (dropout draws the same masks), its buffers and .grad put back by trace()
        (note or _note)(f"the loss is {loss}: tracing the step again with forward values, to find where forward made it")
        inputs.restore()
        again = step(forward_stats=True)
        if again.meta.loss is not None and not math.isfinite(again.meta.loss):
            return again
        # forward did not repeat itself (state it keeps, another random generator): the first step's findings stand
        value = "unknown" if again.meta.loss is None else f"{again.meta.loss:.6g}"
        (note or _note)(
            f"traced again, the loss was {value}: this model's forward does not repeat itself, so where it "
            "made the first loss's non-finite value is not known (gradtrace run --json records forward values in "
            "the first step)"
        )
        return result


def _input_grad_refused(error: BaseException) -> str | None:
    """What the model did that torch refuses because gradtrace made its inputs require grad, or None: its own
    ``tensor.requires_grad = True`` on a tensor made from them (Hugging Face's Wav2Vec2 in train mode), or an
    in-place op on an input (preprocessing, ``x.sub_(mean)``). The same error from a parameter's in-place
    op is the model's own: the step without input gradients raises it again."""
    cause = error.__cause__
    if not isinstance(cause, RuntimeError):
        return None
    if "requires_grad flags of leaf variables" in str(cause):
        return "the model sets requires_grad on a tensor it makes from its inputs"
    if "leaf Variable that requires grad is being used in an in-place operation" in str(cause):
        return "the model changes an input in place"
    return None


def _note(message: str) -> None:
    _stderr_console().print(message, style="dim", markup=False)


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """Put back what a model file may change for the whole process: the working folder (``os.chdir`` to its own
    folder, a common idiom, moved where later targets and --json, --junit-xml and export paths were found)
    and torch's global modes (a default dtype, deterministic algorithms or anomaly mode set by one target of
    ``check`` would apply to the next). Module hooks a file registers for every module stay, as its imports
    do: a helper module two targets import is imported once, and its hooks would be gone for the second.
    Meanwhile ``os._exit()`` in this process raises SystemExit, as
    ``sys.exit()`` does: it would end gradtrace at once, with the model's status (0: a green CI job) and
    no report; a forked child (a DataLoader worker) still exits."""
    import os

    import torch

    real_exit, pid = os._exit, os.getpid()

    def exit_in_model(status: int) -> None:
        if os.getpid() != pid:
            real_exit(status)
        raise SystemExit(status)

    try:
        folder: str | None = os.getcwd()
    except OSError:  # the working folder was deleted: nowhere to go back to
        folder = None
    dtype = torch.get_default_dtype()
    deterministic = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    anomaly = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    os._exit = exit_in_model
    try:
        yield
    finally:
        os._exit = real_exit
        if folder is not None:
            os.chdir(folder)
        # each put back only where it changed: use_deterministic_algorithms imports torch._inductor's config
        # (and torch._dynamo with it), about a second, where nothing else of a run needs them
        if torch.get_default_dtype() != dtype:
            torch.set_default_dtype(dtype)
        if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != deterministic:
            torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        if (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) != anomaly:
            torch.set_anomaly_enabled(*anomaly)


@contextlib.contextmanager
def _user_output_to_stderr(active: bool) -> Iterator[None]:
    """With ``--json -``, what the user's code prints goes to stderr, so that stdout carries the JSON alone:
    ``print()`` (sys.stdout) and writes to file descriptor 1 (C code, subprocesses) alike."""
    if not active:
        yield
        return
    import os

    sys.stdout.flush()
    saved: int | None = None
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no file descriptor 1 or 2: Python-level output only
        if saved is not None:
            os.close(saved)
            saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if sys.stderr is not None:  # None where Python started with file descriptor 2 closed
            sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _traced(options: _Options, target: str) -> Any:
    """``_trace`` in this process, with the spinner."""
    status = _Status()
    try:
        status.update(f"{target}: loading the model, then running forward and backward")
        return _trace(options, target, seed=options.seed, device=options.device, note=status.note)
    finally:
        status.stop()


def _run_single(options: _Options) -> int:
    from .tracing import collection_paused

    result = _traced(options, options.targets[0])
    with collection_paused():  # the outputs of a Trace of up to 100k nodes (on those, a third of the JSON's time)
        return _show_single(options, result)


def _show_single(options: _Options, result: Any) -> int:
    """``run``'s outputs of one trace: the JSON, the tree, the findings; the exit code."""
    from .checks import trace_findings

    findings = [f for f in trace_findings(result, options.policy.thresholds) if options.policy.fails(f)]
    to_stdout = options.json_path == "-"  # stdout carries the JSON alone: the tree is only exported, findings go to stderr
    if options.json_path is not None:
        from .render.json import dumps

        _write_json(options.json_path, dumps(result))

    from .render.tree import render_trace

    console = _log_console(record=bool(options.exports), silent=to_stdout)
    if not to_stdout or options.exports:
        console.print(render_trace(result, options.tree))
    _print_findings(_log_console(stderr=True) if to_stdout else console, findings, "")
    _save_exports(options, console, result)
    if options.json_path is not None and not to_stdout:
        _stderr_console().print(f"trace written to {options.json_path}", style="dim", markup=False)
    return _verdict(findings)


def _save_exports(options: _Options, console: Any, result: Any, prefix: str = "") -> None:
    """--svg / --html (what the console printed) and --dot (the graph of ``result``: under torchrun, rank 0's)."""
    from .render.export import export_dot, export_html, export_svg

    makers = {"svg": lambda: export_svg(console), "html": lambda: export_html(console), "dot": lambda: export_dot(result)}
    for kind, path in options.exports.items():
        _write_file(path, makers[kind]())
        _stderr_console().print(f"{prefix}{kind} written to {path}", style="dim", markup=False)


def _check_single(options: _Options) -> int:
    """Trace and check each target in turn; one that fails to load or raises is reported, the rest still run."""
    from .checks import check_traces
    from .render.findings import render_report
    from .render.tree import render_trace
    from .tracing import collection_paused

    console = _log_console()
    reports = []
    for target in options.targets:
        try:
            result = _traced(options, target)
        except GradtraceError as error:
            reports.append(_error_report(options, target, error, _report(error, options.debug)))
            console.print(render_report(reports[-1]), soft_wrap=True)
            continue
        with collection_paused():  # as in _run_single
            if options.show_tree:
                console.print(render_trace(result, options.tree))
            reports.append(check_traces([result], options.policy, target=target))
            console.print(render_report(reports[-1]))
    return _finish_check(options, reports, console, "")


def _error_report(options: _Options, target: str, error: GradtraceError, code: int) -> Any:
    from .checks import TargetReport

    return TargetReport(
        target, policy=options.policy, error=error.message, error_type=type(error).__name__, exit_code=code,
        error_source=error.source,
    )


def _finish_check(options: _Options, reports: list[Any], console: Any, prefix: str) -> int:
    """The verdict line, the JUnit file, GitHub annotations; the exit code (a target's error wins over findings)."""
    import os

    from .render.comparison import prefixed_lines
    from .render.findings import verdict
    from .render.github import annotations, in_github_actions

    for line in prefixed_lines(console, verdict(reports), prefix):
        console.print(line, soft_wrap=True)
    if options.junit_xml is not None:
        from .errors import UsageError
        from .render.junit import junit_xml

        try:
            Path(options.junit_xml).write_text(junit_xml(reports), encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot write {options.junit_xml}: {exc.strerror or exc}") from exc
        _stderr_console().print(f"{prefix}JUnit XML written to {options.junit_xml}", style="dim", markup=False)
    if in_github_actions(os.environ):
        lines = annotations(reports, workspace=os.environ.get("GITHUB_WORKSPACE"))
        sys.stdout.write("".join(line + "\n" for line in lines))
        sys.stdout.flush()
    errors = [r.exit_code for r in reports if r.error is not None]
    if errors:
        return errors[0]
    return ExitCode.GRADIENT_PROBLEMS if any(r.failures for r in reports) else ExitCode.OK


def _log_console(record: bool = False, silent: bool = False, stderr: bool = False) -> Any:
    """stdout (``stderr``: stderr); when it is not a terminal (a CI log, a pipe, a file), wide enough that a
    node line or a table row is not folded (Rich's default there is 80 columns), so that each can be
    grepped whole. Nothing printed fills the width: each line is as long as what it says. ``silent``:
    nowhere (what it prints is only recorded, for --svg and --html)."""
    import os

    from rich.console import Console

    if silent:
        return Console(highlight=False, record=record, file=_Discard(), width=_LOG_WIDTH)
    stream = sys.stderr if stderr else sys.stdout
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):  # no stream, or a closed one
        terminal = False
    if terminal:
        return Console(highlight=False, record=record, stderr=stderr, width=_width(terminal=True))
    # a log, also one that keeps colours (FORCE_COLOR): a table pads its cells, but no line of it ends in spaces
    width = _width(terminal=False) if "COLUMNS" in os.environ else _LOG_WIDTH
    return Console(highlight=False, record=record, width=width, file=_LineEndsTrimmed(stream))


_LOG_WIDTH = 10_000


class _LineEndsTrimmed(io.TextIOBase):
    """Writes to ``out`` each line without the spaces that end it (before any closing style codes)."""

    _END = re.compile(r" +((?:\x1b\[[0-9;]*m)*)$", re.MULTILINE)

    def __init__(self, out: Any):
        super().__init__()
        self._out = out
        self._line = ""  # the start of a line not ended yet

    def write(self, text: str) -> int:
        done, ended, self._line = (self._line + text).rpartition("\n")
        if ended:
            self._out.write(self._END.sub(r"\1", done) + "\n")
        return len(text)

    def flush(self) -> None:
        if self._line:  # a line without its end yet (a prompt, a progress line): as it is
            self._out.write(self._line)
            self._line = ""
        self._out.flush()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._out, "encoding", None) or "utf-8"


class _Discard(io.TextIOBase):
    """A text file that keeps nothing."""

    def write(self, text: str) -> int:
        return len(text)


def _run_ranks(options: _Options, info: Any) -> NoReturn:
    """Every rank traces each target; rank 0 gathers, compares, prints every rank's lines with their prefix.
    The rank process then exits, skipping interpreter shutdown: with the verdict (the same on every rank), or
    with its own error's code."""
    import os

    from .distributed import ProcessGroup

    group = ProcessGroup(info, timeout_s=options.timeout)
    reports: list[Any] = []
    target = options.targets[0]
    try:
        device = group.start(options.device)
        # --rank-seed: each rank's own data (inputs, dropout), the same model on every rank
        input_seed = options.seed + info.rank if options.rank_seed else None
        console = _log_console() if options.command == "check" else None
        code: int = ExitCode.OK
        for target in options.targets:
            result = _trace(
                options, target, seed=options.seed, input_seed=input_seed, device=device, rank=info.rank,
                world_size=info.world_size,
            )
            documents = group.gather(result.to_dict())
            if info.rank != 0:
                continue
            if options.command == "run":
                code = _compare_and_show(options, documents)
            else:
                reports.append(_check_ranks(options, target, documents, console))
        if info.rank == 0 and options.command == "check":
            code = _finish_check(options, reports, console, info.prefix)
        code = group.broadcast(int(code))
        group.close()
    except BaseException as error:  # noqa: BLE001 - every failure ends this rank at once
        from .distributed import lost_peer, ranks_text
        from .errors import ModelError

        echo = lost_peer(error) and not isinstance(error, KeyboardInterrupt)
        missing = getattr(error, "missing", None)  # the ranks that did not arrive, where known
        if echo and missing == [0] and info.rank != 0:
            error = ModelError(
                f"rank 0 did not answer within --timeout {options.timeout:g} s: it waited for a rank that hangs "
                "(rank 0's error names it), or hangs itself",
                hint=_SLOW_RANK_HINT,
            )
        elif echo and missing:
            error = ModelError(
                f"{ranks_text(missing)} did not finish tracing within --timeout {options.timeout:g} s (hung, or "
                "that much slower than the others)",
                hint=_SLOW_RANK_HINT,
            )
        elif echo and _timed_out(error):  # no rank failed: one is slow, or stuck
            error = ModelError(
                f"another rank did not answer within --timeout {options.timeout:g} s (it hangs, or is that much "
                f"slower): {error}",
                hint=_SLOW_RANK_HINT,
            )
        elif echo:  # not this rank's fault: say so, and let the failing rank be seen first
            # torch's account names the barrier's time limit ("... in 120000 ms") as if it had been waited for
            said = "" if "monitoredBarrier" in message_of(error) else f": {error}"
            error = ModelError(
                f"another rank failed or went away while this one waited for it{said}",
                hint="the first error above, from another rank, is the cause",
            )
        code = _report(error, options.debug, prefix=info.prefix)
        checking = options.command == "check" and target not in {report.target for report in reports}
        if info.rank == 0 and checking and options.junit_xml is not None:
            # a CI job's reporter reads the file whatever happened: the targets checked, and this one's error (a
            # failure after every target was checked leaves the file the verdict wrote, if it got that far)
            _write_junit_quietly(options, [*reports, _error_report(options, target, _as_gradtrace_error(error), code)])
        if echo:
            import time

            time.sleep(2.0)  # torchrun's agent usually stops this rank first, naming the real culprit
        # Exit now, skipping interpreter shutdown: the process group's destructors could wait on ranks
        # that are blocked in a collective. torchrun's agent sees the exit and stops the other ranks.
        os._exit(int(code))
    # A rank that succeeded exits the same way once its output is out: interpreter shutdown can still
    # abort in gloo's threads ("terminate called without an active exception", SIGABRT: seen once in
    # this project's CI, on a healthy 2-rank run), which would fail a healthy run.
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed pipe: the exit code still says it
            pass
    os._exit(int(code))


_SLOW_RANK_HINT = "raise --timeout if a rank is only slow; a rank that hangs is stopped when this one exits"


def _as_gradtrace_error(error: BaseException) -> GradtraceError:
    if isinstance(error, GradtraceError):
        return error
    from .errors import InternalError

    return InternalError(message_of(error) or type(error).__name__)


def _write_junit_quietly(options: _Options, reports: list[Any]) -> None:
    """The JUnit file of a rank that is failing: written if it can be, as the error itself is what is reported."""
    from .render.junit import junit_xml

    try:
        Path(options.junit_xml).write_text(junit_xml(reports), encoding="utf-8")
    except Exception:  # noqa: BLE001, S110 - the rank's own error is reported already
        pass


def _timed_out(error: BaseException) -> bool:
    """Whether an error (or its cause: a collective in the model's own code) is a timeout."""
    return any("timed out" in str(e).lower() for e in (error, error.__cause__) if e is not None)


def _compared(options: _Options, documents: list[dict[str, Any]]) -> tuple[list[Any], dict[str, Any]]:
    """The gathered traces and their comparison."""
    from .compare import compare
    from .records import Trace

    traces = [Trace.from_dict(document) for document in documents]
    return traces, compare(traces, rtol=options.rtol, inputs_differ=options.rank_seed)


def _rank_lines(options: _Options, console: Any, traces: list[Any], comparison: dict[str, Any]) -> list[Any]:
    """The selected ranks' trees (divergent nodes marked) and the comparison, each line prefixed."""
    from dataclasses import replace

    from .render.comparison import (
        divergence_marks,
        divergence_origin,
        prefixed_lines,
        render_comparison,
    )
    from .render.tree import render_trace

    lines = []
    if options.show_tree:
        for rank in _selected_ranks(options.ranks, len(traces)):
            origin = divergence_origin(comparison, rank)
            tree_options = replace(
                options.tree, marks=divergence_marks(comparison, rank), pinned=() if origin is None else (origin,)
            )
            lines += prefixed_lines(console, render_trace(traces[rank], tree_options), f"[rank{rank}] ")
    return lines + prefixed_lines(console, render_comparison(comparison), "[rank0] ")


def _compare_and_show(options: _Options, documents: list[dict[str, Any]]) -> int:
    """Rank 0's part of ``run``: compare the gathered traces, print the trees and the verdict, write the merged JSON."""

    from .checks import comparison_findings, merge_rank_findings, trace_findings
    from .render.json import dumps_merged
    from .tracing import collection_paused

    with collection_paused():  # as in _run_single
        traces, comparison = _compared(options, documents)
        findings = merge_rank_findings([trace_findings(t, options.policy.thresholds) for t in traces])
        failed = [f for f in findings + comparison_findings(comparison) if options.policy.fails(f)]
        to_stdout = options.json_path == "-"  # as in _run_single
        if options.json_path is not None:
            _write_json(options.json_path, dumps_merged(traces, comparison))
        console = _log_console(record=bool(options.exports), silent=to_stdout)
        if not to_stdout or options.exports:
            for line in _rank_lines(options, console, traces, comparison):
                console.print(line, soft_wrap=True)
        _print_findings(_log_console(stderr=True) if to_stdout else console, failed, "[rank0] ")
        _save_exports(options, console, traces[0], "[rank0] ")
        if options.json_path is not None and not to_stdout:
            _stderr_console().print(f"[rank0] merged trace of {len(traces)} ranks written to {options.json_path}", style="dim", markup=False)
        return _verdict(failed)


def _check_ranks(options: _Options, target: str, documents: list[dict[str, Any]], console: Any) -> Any:
    """Rank 0's part of ``check`` for one target: compare, check, print (prefixed); return the report."""
    from .checks import check_traces
    from .render.comparison import prefixed_lines
    from .render.findings import render_report

    traces, comparison = _compared(options, documents)
    report = check_traces(traces, options.policy, comparison, target=target)
    lines = _rank_lines(options, console, traces, comparison)
    for line in lines + prefixed_lines(console, render_report(report), "[rank0] "):
        console.print(line, soft_wrap=True)
    return report


def _selected_ranks(text: str, world_size: int) -> list[int]:
    from .errors import UsageError

    if text.strip() == "all":
        return list(range(world_size))
    try:
        chosen = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError as exc:
        raise UsageError(f"--ranks takes 'all' or a comma list of ranks, not {text!r}") from exc
    if not chosen:
        raise UsageError(f"--ranks takes 'all' or a comma list of ranks, not {text!r}", hint="e.g. --ranks 0,2")
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


def _write_file(path: str, text: str) -> None:
    from .errors import UsageError

    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _write_json(json_path: str, text: str) -> None:
    if json_path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    _write_file(json_path, text)


@app.command(short_help="Compare two traces; name where they first differ.")
def diff(
    first: str = typer.Argument(..., metavar="A.json", help="A trace written by --json (FILE#N: rank N of a merged file).",
                                show_default=False),
    second: str = typer.Argument(..., metavar="B.json", help="The trace to compare it with.", show_default=False),
    rtol: float = typer.Option(1e-5, "--rtol", min=0.0, help="Relative tolerance on norms (e.g. 1e-2 for fp32 vs bf16)."),
    json_path: Optional[str] = typer.Option(
        None, "--json", metavar="OUT", help="Write the differences as JSON: first_divergent and per-node spreads.",
        show_default=False,
    ),
    debug: bool = _DEBUG,
) -> None:
    """Compare two traces node by node and name where they first differ.

    Uses the comparison of torchrun ranks: structure (the graphs differ), forward (the earliest node whose forward
    value differs while its inputs agree: a changed layer or parameter), backward (the first node that received the
    same gradients but sent on different ones). Traces written by --json carry the forward values it needs.

    Exit codes: 0 the traces agree, 1 they differ, 2 a file is unreadable or not a gradtrace/1 trace.
    """

    def body() -> int:
        import json

        from .compare import compare, strip_prefix, wrapper_prefix
        from .errors import UsageError
        from .render.diff import render_diff
        from .render.json import read_trace

        if json_path is not None:
            files = [spec.rpartition("#")[0] if "#" in spec else spec for spec in (first, second)]  # FILE#N: FILE
            _refuse_outputs([("--json", json_path)], files, "a trace being compared")
        try:
            (a, note_a), (b, note_b) = read_trace(first), read_trace(second)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
        # a wrapper's prefix on every parameter name of one file (DDP's module.): lined up without it
        wrapped = wrapper_prefix(a, b)
        if wrapped is not None:
            side, prefix = wrapped
            a, b = (strip_prefix(a, prefix), b) if side == 0 else (a, strip_prefix(b, prefix))
        comparison = compare([a, b], rtol=rtol, labels=[0, 1])
        for note in (note_a, note_b):
            if note:
                _stderr_console().print(note, style="dim", markup=False)
        if json_path is not None:
            origin, first_divergent = comparison["first_divergent"], None
            if origin is not None:
                first_divergent = {k: origin[k] for k in ("id", "name", "module", "param", "kind", "source")}
                # the file whose graph the id is of, and each file's node at that place: where the graphs differ
                # (a structure divergence) they are two ids, else the same
                first_divergent["file"] = (first, second)[origin["rank"]]
                first_divergent["ids"] = origin.get("ids", [origin["id"]] * 2)
                if "params_only" in origin:
                    first_divergent["params_only"] = origin["params_only"]
            prefix_ignored = None if wrapped is None else {"file": (first, second)[wrapped[0]], "prefix": wrapped[1]}
            document = {"first_divergent": first_divergent, "nodes": comparison["nodes"],
                        "unsynchronized_params": comparison["unsynchronized_params"], "rtol": rtol, "atol": comparison["atol"],
                        "note": comparison["note"], "prefix_ignored": prefix_ignored, "a": first, "b": second}
            _write_json(json_path, json.dumps(document, allow_nan=False, sort_keys=True, indent=1) + "\n")
        if json_path != "-":
            _log_console().print(render_diff(a, b, comparison, (first, second), wrapped))
        differs = comparison["first_divergent"] is not None or bool(comparison["unsynchronized_params"])
        return ExitCode.GRADIENT_PROBLEMS if differs else ExitCode.OK

    _guarded(debug, body)


def _tolerant_streams() -> None:
    """Where stdout or stderr cannot encode every character (a Windows code page, ``LC_ALL=C``), a ``?`` for
    those: a UnicodeEncodeError ended every run there, with exit 70 and no report."""
    # a stream the caller closed (`gradtrace check model.py >&-`) is None in Python: what goes there goes nowhere
    # (the file opened takes the closed descriptor, so writes to the descriptor itself go nowhere too)
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - open as long as the process
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("_", "-")
        if not encoding.startswith("utf") and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors="replace")
            except (ValueError, OSError):  # a closed or detached stream
                pass


def main() -> None:
    """Console-script entry point."""
    _tolerant_streams()
    # Where NumPy is not installed, importing torch warns that it could not load it. gradtrace does not use
    # NumPy (a model that does fails where it does), and the warning would open the output of every run.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    from typer import rich_utils

    if hasattr(rich_utils, "rich_format_error"):  # where typer boxes a parse error: gradtrace's usual lines
        rich_utils.rich_format_error = _report_parse_error
    # Parse errors come back here rather than being shown by click, as typer leaves them to it where help is
    # plain (rich_markup_mode=None, typer 0.2x). A click exception (click's own, or the copy typer 0.2x
    # carries) is known by its exit code and message
    try:
        code = typer.main.get_command(app).main(prog_name="gradtrace", standalone_mode=False)
    except typer.Abort:
        sys.stderr.write("Aborted!\n")
        sys.exit(1)
    except Exception as error:
        if not (hasattr(error, "exit_code") and hasattr(error, "format_message")):
            raise
        _report_parse_error(error)
        sys.exit(error.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


def _report_parse_error(error: Any) -> None:
    """An option or argument Typer could not parse (a ``click.ClickException``), written as gradtrace's other
    usage errors are: ``gradtrace: error: ...`` on one line and a hint (Typer then exits with its code, 2)."""
    from .errors import UsageError

    if type(error).__name__ == "NoArgsIsHelpError":  # no arguments at all: the help (click 8.2 and later)
        error.show()
        return
    context = getattr(error, "ctx", None)
    command = context.command_path if context is not None else "gradtrace"
    message = " ".join(error.format_message().split())
    _report(UsageError(message, hint=f"see {command} -h"), debug=False)


if __name__ == "__main__":  # pragma: no cover
    main()
