"""Project defaults from ``[tool.gradtrace]`` in the nearest ``pyproject.toml``.

The nearest ``pyproject.toml`` is searched from the working folder upward (the first one found is the
project's, whether or not it has the table). Keys are the commands' long option names without the
dashes (``max-grad-norm = 10.0``); command-line options override them. An unknown key, or a value
of the wrong type, is a usage error naming the key and the file. Relative paths (``targets``,
``inputs``) are relative to the folder of that ``pyproject.toml``.
"""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .checks import parse_fail_on
from .errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

TABLE = "tool.gradtrace"


def _string(key: str, value: Any, base: Path) -> str:
    if not isinstance(value, str):
        raise _type_error(key, value, "a string")
    return value


def _device(key: str, value: Any, base: Path) -> str:
    """A device's name, checked now (whether it is there is checked when it is used)."""
    import torch

    try:
        torch.device(_string(key, value, base))
    except (RuntimeError, ValueError) as exc:
        raise UsageError(f"[{TABLE}] {key} = {value!r}: not a device", hint="e.g. cpu, cuda, cuda:1") from exc
    return value


def _string_list(key: str, value: Any, base: Path) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _type_error(key, value, "a string or a list of strings")
    return list(value)


def _input_specs(key: str, value: Any, base: Path) -> list[str]:
    """Spec strings, checked now: a bad one is then reported with the file it is in."""
    from .inputs import parse_spec

    specs = _string_list(key, value, base)
    for spec in specs:
        try:
            parse_spec(spec)
        except UsageError as exc:
            raise UsageError(f"[{TABLE}] {key}: {exc.message}", hint=exc.hint) from exc
    return specs


def _integer(key: str, value: Any, base: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(key, value, "an integer")
    return value


def _number(minimum: float) -> Callable[[str, Any, Path], float]:
    def convert(key: str, value: Any, base: Path) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _type_error(key, value, "a number")
        if not value >= minimum:  # also refuses nan
            raise UsageError(f"[{TABLE}] {key} = {value!r}: must be at least {minimum:g}")
        return float(value)

    return convert


def _boolean(key: str, value: Any, base: Path) -> bool:
    if not isinstance(value, bool):
        raise _type_error(key, value, "true or false")
    return value


def _loss(key: str, value: Any, base: Path) -> str:
    if value not in ("sum", "mean"):
        raise _type_error(key, value, '"sum" or "mean"')
    return value


def _checks(key: str, value: Any, base: Path) -> str:
    names = _string_list(key, value.split(",") if isinstance(value, str) else value, base)
    try:
        return ",".join(parse_fail_on(names, option=key))
    except ValueError as exc:
        raise UsageError(f"[{TABLE}] {exc}") from exc


def _path(key: str, value: Any, base: Path) -> str:
    return _relative_to(base, _string(key, value, base))


def _targets(key: str, value: Any, base: Path) -> list[str]:
    from .loading import split_target

    resolved = []
    for target in _string_list(key, value, base):
        try:
            kind, location, name = split_target(target)
        except UsageError:
            resolved.append(target)  # reported, with the usual message, when it is loaded
            continue
        if kind == "file":
            target = _relative_to(base, location) + (f":{name}" if name else "")
        resolved.append(target)
    return resolved


def _relative_to(base: Path, path: str) -> str:
    """``path`` (relative to the config's folder) as seen from the working folder."""
    full = base / os.path.expanduser(path)
    try:
        return os.path.relpath(full)
    except ValueError:  # another drive on Windows
        return str(full)


# key → converter; each key is a long option of `run` and/or `check` (targets: check's TARGET arguments)
KEYS: dict[str, Callable[[str, Any, Path], Any]] = {
    "targets": _targets,
    "input": _input_specs,
    "inputs": _path,
    "seed": _integer,
    "device": _device,
    "eval": _boolean,
    "no-input-grad": _boolean,
    "loss": _loss,
    "fail-on": _checks,
    "warn-on": _checks,
    "max-grad-norm": _number(0.0),
    "min-grad-norm": _number(0.0),
    "rank-seed": _boolean,
    "rtol": _number(0.0),
    "timeout": _number(1.0),
    "no-sources": _boolean,
}


@dataclass(frozen=True)
class ProjectConfig:
    """The ``[tool.gradtrace]`` defaults that apply here.

    Attributes:
        path: the ``pyproject.toml`` they came from (None: no file, or no table).
        values: key → value, converted (numbers as float, ``fail-on`` as a comma list, paths made
            relative to the working folder).
    """

    path: Path | None = None
    values: dict[str, Any] = field(default_factory=dict)


def find_pyproject(start: Path | None = None) -> Path | None:
    """The nearest ``pyproject.toml`` in ``start`` (default: the working folder) or a folder above it."""
    folder = Path(start or Path.cwd()).resolve()
    for candidate in (folder, *folder.parents):
        path = candidate / "pyproject.toml"
        if path.is_file():
            return path
    return None


def load_config(start: Path | None = None) -> ProjectConfig:
    """Read ``[tool.gradtrace]`` of the nearest ``pyproject.toml``.

    Raises:
        UsageError: the file is not valid TOML, the table is not a table, a key is unknown or a value
            has the wrong type.
    """
    path = find_pyproject(start)
    if path is None:
        return ProjectConfig()
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path} is not valid TOML: {exc}") from exc
    tool = document.get("tool")
    table = tool.get("gradtrace") if isinstance(tool, dict) else None
    if table is None:
        return ProjectConfig()
    if not isinstance(table, dict):
        raise UsageError(f"{path}: [{TABLE}] must be a table of settings, not a {type(table).__name__}")
    values = {}
    for key, value in table.items():
        convert = KEYS.get(key)
        if convert is None:
            close = difflib.get_close_matches(key.replace("_", "-"), KEYS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UsageError(
                f"unknown key {key!r} in [{TABLE}] of {path}",
                hint=f"{hint}known keys: {', '.join(KEYS)}",
            )
        try:
            values[key] = convert(key, value, path.parent)
        except UsageError as exc:
            raise UsageError(f"{path}: {exc.message}", hint=exc.hint) from exc
    return ProjectConfig(path, values)


def _type_error(key: str, value: Any, expected: str) -> UsageError:
    return UsageError(f"[{TABLE}] {key} must be {expected}, not {value!r}")
