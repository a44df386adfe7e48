"""gradtrace's error kinds and exit codes.

The library raises :class:`GradtraceError` subclasses; only ``cli.py`` turns them
into messages and exit codes. Anything else that escapes is a gradtrace bug.
"""

from __future__ import annotations

import os
import re
import traceback
from enum import IntEnum


class ExitCode(IntEnum):
    """Process exit codes, as documented in the README."""

    OK = 0
    GRADIENT_PROBLEMS = 1
    USAGE = 2
    MODEL = 3
    INTERNAL = 70
    INTERRUPTED = 130


class GradtraceError(Exception):
    """An error with a message meant for the user.

    Args:
        message: what went wrong, and where.
        hint: what to do about it (optional).
    """

    exit_code = ExitCode.INTERNAL

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def details(self) -> str | None:
        """Extra text shown under the message (e.g. the user's traceback)."""
        return None

    @property
    def source(self) -> str | None:
        """``path:line`` of the user's code the error points at (a syntax error's line), where known."""
        cause = self.__cause__
        if isinstance(cause, SyntaxError) and cause.filename and cause.lineno:
            return f"{cause.filename}:{cause.lineno}"
        return None


class UsageError(GradtraceError):
    """Bad command line, target or input spec (exit 2)."""

    exit_code = ExitCode.USAGE


class ModelError(GradtraceError):
    """The model could not be loaded, or it (or its loss) cannot be traced (exit 3)."""

    exit_code = ExitCode.MODEL


# What the user's code may raise that gradtrace reports as its error (exit 3): any Exception, and SystemExit
# (a model file that calls sys.exit(), or parses the command line at import: gradtrace's own arguments),
# which would otherwise end gradtrace silently with the model's exit code. KeyboardInterrupt stays itself.
USER_CODE_ERRORS = (Exception, SystemExit)


class UserCodeError(ModelError):
    """The user's own code raised; carries the exception to show its trimmed traceback.

    Args:
        phase: what gradtrace was doing ("importing model.py", "forward", ...).
        exc: the exception the user's code raised.
        hint: what to check.
    """

    def __init__(self, phase: str, exc: BaseException, hint: str | None = None):
        summary = printable("".join(traceback.format_exception_only(type(exc), exc)).strip())
        if isinstance(exc, SystemExit) and hint is None:
            hint = (
                "the model's code called sys.exit() or os._exit() (argparse does on an argument it does not know, or on a "
                "required one: sys.argv is [path] here): a model file is "
                'imported, so keep script code under if __name__ == "__main__":'
            )
        if hint is None and "default process group twice" in message_of(exc):
            hint = (
                "under torchrun gradtrace creates the process group before it imports your file: create yours only "
                "if not torch.distributed.is_initialized()"
            )
        if hint is None and phase == "backward" and "backward through the graph a second time" in message_of(exc):
            hint = (
                "where your loss_fn or forward calls .backward() itself, return the loss instead: gradtrace runs "
                "backward (and a step of yours that does so is traced without its own backward)"
            )
        if hint is None and "returned nan values" in message_of(exc):
            hint = (
                "anomaly detection is on (torch.autograd.set_detect_anomaly(True) or detect_anomaly() in your code): it "
                "stops backward at the first NaN, before gradtrace can show where it starts; turn it off for the trace"
            )
        super().__init__(f"{phase} raised {summary}", hint)
        self.phase = phase
        self.original = exc

    @property
    def source(self) -> str | None:
        """``path:line`` of the innermost frame of the user's code in the traceback."""
        frames = user_frames(self.original)
        return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None

    def details(self) -> str | None:
        frames = user_frames(self.original)
        if not frames:
            return None
        lines = ["Traceback (your code, most recent call last):"]
        lines += traceback.format_list(frames)
        lines.append("".join(traceback.format_exception_only(type(self.original), self.original)))
        return printable("".join(line if line.endswith("\n") else line + "\n" for line in lines).rstrip())


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def printable(text: str) -> str:
    """``text`` with control characters other than newlines and tabs written out (``\\x1b``): a message of the
    user's that holds terminal escape codes or a NUL must not reach a CI log or a terminal as they are."""
    return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", text)


def message_of(exc: BaseException) -> str:
    """``str(exc)``, or ``""`` for an exception of the user's whose ``__str__`` raises."""
    try:
        return str(exc)
    except Exception:
        return ""


def first_line(exc: BaseException, limit: int) -> str:
    """``Type: the message's first line``, cut at ``limit`` characters and printable: a note that quotes an
    error of the user's code in one line (a message may be empty, or hold escape codes)."""
    lines = message_of(exc).strip().splitlines()
    return printable(f"{type(exc).__name__}: {lines[0][:limit]}" if lines else type(exc).__name__)


class InternalError(GradtraceError):
    """A bug in gradtrace itself (exit 70)."""

    exit_code = ExitCode.INTERNAL


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _library_dirs() -> tuple[str, ...]:
    dirs = [_PACKAGE_DIR + os.sep]
    try:  # torch's own frames are noise in a user's traceback
        import torch

        dirs.append(os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return tuple(dirs)


def user_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The frames of ``exc``'s traceback that belong to the user's code.

    Frames inside gradtrace, torch and importlib's bootstrap are dropped; a
    SyntaxError keeps none (its message already names the file and line).
    """
    if isinstance(exc, SyntaxError):
        return []
    skip = _library_dirs()
    stdlib = _stdlib_dir()
    return [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if not frame.filename.startswith(skip)
        and not frame.filename.startswith("<frozen ")
        # the standard library's frames (argparse, importlib), not the packages installed beside it
        and not (stdlib and frame.filename.startswith(stdlib) and not _SITE.search(frame.filename))
    ]


_SITE = re.compile(r"[/\\](site|dist)-packages[/\\]")


def _stdlib_dir() -> str | None:
    import sysconfig

    try:
        return os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep
    except (KeyError, OSError):
        return None
