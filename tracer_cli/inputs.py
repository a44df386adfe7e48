"""The input-spec grammar: ``[NAME=]DTYPE[D0,D1,...][:INIT]`` and inputs files.

A spec names a tensor to synthesise, e.g. ``float32[8,3,32,32]``, ``bf16[4,16]:ones``,
``int64[2,128]:randint(0,50257)`` or ``float32[]`` (a 0-dim scalar). ``--inputs FILE``
reads a ``.json`` list of specs (or an object of ``name: spec``) or a ``.pt`` file of
plain tensors, always with ``weights_only=True``.

torch is imported inside functions only, so ``--help`` never pays for it.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracer_cli.errors import UsageError

# canonical torch dtype name -> (kind, aliases); kind picks the default INIT and valid INITs
_DTYPES: dict[str, tuple[str, tuple[str, ...]]] = {
    "float32": ("float", ("f32", "float")),
    "float16": ("float", ("f16", "half")),
    "bfloat16": ("float", ("bf16",)),
    "float64": ("float", ("f64", "double")),
    "int64": ("int", ("i64", "long")),
    "int32": ("int", ("i32", "int")),
    "int16": ("int", ()),
    "int8": ("int", ()),
    "uint8": ("int", ()),
    "bool": ("bool", ()),
    "complex64": ("complex", ()),
    "complex128": ("complex", ()),
}
_ALIASES = {alias: name for name, (_, aliases) in _DTYPES.items() for alias in (name, *aliases)}

# the values randint(lo,hi) may draw: lo and hi-1 must lie in [min, max]. Floats are
# limited to integers they represent exactly, as torch.randint itself requires.
_RANDINT_RANGE = {
    "float32": (-(2**24), 2**24),
    "float16": (-(2**11), 2**11),
    "bfloat16": (-(2**8), 2**8),
    "float64": (-(2**53), 2**53),
    "int64": (-(2**63), 2**63 - 2),  # hi itself must fit in int64
    "int32": (-(2**31), 2**31 - 1),
    "int16": (-(2**15), 2**15 - 1),
    "int8": (-(2**7), 2**7 - 1),
    "uint8": (0, 2**8 - 1),
    "bool": (0, 1),
}
_MAX_DIM = 2**63 - 1

DTYPE_NAMES = ", ".join("/".join((name, *aliases)) for name, (_, aliases) in _DTYPES.items())
INIT_NAMES = "randn, rand, zeros, ones, randint(lo,hi)"
SPEC_HINT = (
    "expected DTYPE[D0,D1,...][:INIT], e.g. float32[8,3,32,32], bf16[4,16]:ones, "
    f"int64[2,128]:randint(0,50257); DTYPE one of {DTYPE_NAMES}; INIT one of {INIT_NAMES}; "
    "prefix NAME= to pass a keyword argument"
)

_SPEC_RE = re.compile(r"(?P<dtype>[^\[\]]*)\[(?P<dims>[^\[\]]*)\](?P<rest>.*)", re.DOTALL)
_DIM_RE = re.compile(r"[0-9]+")
_RANDINT_RE = re.compile(
    r"randint\s*\(\s*(?P<low>[-+]?[0-9]+)\s*,\s*(?P<high>[-+]?[0-9]+)\s*\)", re.IGNORECASE
)


@dataclass(frozen=True)
class InputSpec:
    """One parsed input spec.

    Attributes:
        text: the spec as written, without ``NAME=``.
        name: the keyword argument's name, or None for a positional argument.
        dtype: the canonical torch dtype name ("float32", "bfloat16", "int64", ...).
        shape: the tensor's shape; ``()`` for a 0-dim scalar.
        init: "randn", "rand", "zeros", "ones", "randint" or "bool" (random True/False).
        low: randint's inclusive lower bound.
        high: randint's exclusive upper bound.
    """

    text: str
    name: str | None
    dtype: str
    shape: tuple[int, ...]
    init: str
    low: int | None = None
    high: int | None = None

    def make(self, device: Any = "cpu") -> Any:
        """Create the tensor from torch's global RNG (the caller seeds it).

        Values are drawn on the CPU and then moved, so a seed gives the same
        inputs on every device. The tensor never requires grad.

        Args:
            device: where the tensor goes (anything ``Tensor.to`` accepts).

        Returns:
            A ``torch.Tensor`` of this spec's dtype and shape.

        Raises:
            UsageError: the tensor is too large to allocate.
        """
        import torch

        dtype = getattr(torch, self.dtype)
        try:
            if self.init == "randint":
                tensor = torch.randint(self.low, self.high, self.shape, dtype=dtype)
            elif self.init == "bool":
                tensor = torch.randint(0, 2, self.shape, dtype=torch.bool)
            else:
                tensor = getattr(torch, self.init)(self.shape, dtype=dtype)
        except (RuntimeError, MemoryError) as err:
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise UsageError(
                f"cannot create input spec '{self.text}': {reason}",
                "use smaller dimensions",
            ) from err
        return tensor.to(device)


def parse_spec(text: str) -> InputSpec:
    """Parse ``[NAME=]DTYPE[D0,D1,...][:INIT]``.

    Args:
        text: the spec as given on the command line.

    Returns:
        The parsed spec.

    Raises:
        UsageError: the spec is malformed; the message quotes it and says what is wrong.
    """
    name = None
    spec = text
    if "=" in text:
        name, spec = text.split("=", 1)
        name = name.strip()
        if not name.isidentifier():
            raise _invalid(text, f"NAME '{name}' before '=' is not a Python identifier")
        if "=" in spec:
            raise _invalid(text, "more than one '='; write NAME=SPEC with a single '='")
    return _parse(spec, name, shown=text)


def build_inputs(specs: Sequence[str], device: Any = "cpu") -> tuple[tuple, dict]:
    """Create the model's arguments from specs.

    Positional specs become the args tuple in the order given (a positional spec
    may follow a keyword one); ``NAME=SPEC`` specs become keyword arguments.

    Args:
        specs: spec strings, each optionally ``NAME=SPEC``.
        device: where the tensors go.

    Returns:
        ``(args, kwargs)``.

    Raises:
        UsageError: a spec is malformed or a NAME is given twice.
    """
    return _make_all([parse_spec(text) for text in specs], device)


def load_inputs_file(path: str | os.PathLike, device: Any = "cpu") -> tuple[tuple, dict]:
    """Read the model's arguments from a ``.json`` specs file or a ``.pt`` tensors file.

    A ``.json`` file holds a list of specs (each may be ``NAME=SPEC``) or an object
    ``{"name": "spec"}`` of keyword arguments. A ``.pt``/``.pth`` file holds a tensor,
    a tuple/list of tensors (positional) or a dict of tensors (keyword); containers
    nested inside are passed as they are. ``.pt`` files are untrusted: they are always
    loaded with ``weights_only=True``.

    Args:
        path: the file.
        device: where the tensors go.

    Returns:
        ``(args, kwargs)``.

    Raises:
        UsageError: the file is missing, of another kind, or does not hold what it should.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".pt", ".pth"):
        raise UsageError(
            f"inputs file '{path}' must end in .pt (tensors) or .json (input specs)",
            "save tensors with torch.save(...) as .pt, or list specs in a .json file",
        )
    if not path.exists():
        raise UsageError(f"inputs file '{path}' does not exist")
    if not path.is_file():
        raise UsageError(f"inputs file '{path}' is not a file")
    if suffix == ".json":
        return _load_json(path, device)
    return _load_tensors(path, device)


def _invalid(shown: str, problem: str) -> UsageError:
    return UsageError(f"invalid input spec '{shown}': {problem}", SPEC_HINT)


def _parse(spec: str, name: str | None, shown: str) -> InputSpec:
    """Parse DTYPE[D0,...][:INIT]; ``shown`` is the text that error messages quote."""
    match = _SPEC_RE.fullmatch(spec.strip())
    if match is None:
        raise _invalid(shown, _why_no_shape(spec))
    dtype = _parse_dtype(match["dtype"], shown)
    shape = _parse_shape(match["dims"], shown)
    rest = match["rest"].strip()
    if rest and not rest.startswith(":"):
        raise _invalid(shown, f"unexpected '{rest}' after the shape; put INIT after ':'")
    init, low, high = _parse_init(rest[1:].strip() if rest else None, dtype, shown)
    return InputSpec(spec.strip(), name, dtype, shape, init, low, high)


def _why_no_shape(spec: str) -> str:
    if "[" not in spec:
        return "missing the shape in brackets after the dtype, e.g. float32[8,3] or float32[]"
    if "]" not in spec.split("[", 1)[1]:
        return "missing ']' to close the shape"
    return "expected one DTYPE followed by one [D0,D1,...] shape"


def _parse_dtype(written: str, shown: str) -> str:
    word = written.strip()
    if not word:
        raise _invalid(shown, "missing DTYPE before '['")
    key = word.lower().removeprefix("torch.")
    if key not in _ALIASES:
        raise _invalid(shown, f"unknown dtype '{word}'; known dtypes: {DTYPE_NAMES}")
    return _ALIASES[key]


def _parse_shape(written: str, shown: str) -> tuple[int, ...]:
    if not written.strip():
        return ()
    shape = []
    for dim in written.split(","):
        dim = dim.strip()
        if not dim:
            raise _invalid(shown, "empty dimension; dimensions are separated by single commas")
        if not _DIM_RE.fullmatch(dim):
            raise _invalid(shown, f"dimension '{dim}' is not a non-negative integer")
        if int(dim) > _MAX_DIM:
            raise _invalid(shown, f"dimension '{dim}' is too large")
        shape.append(int(dim))
    return tuple(shape)


def _parse_init(written: str | None, dtype: str, shown: str) -> tuple[str, int | None, int | None]:
    """Return (init, low, high) for INIT as written (None when the spec has no ':')."""
    kind = _DTYPES[dtype][0]
    if written is None:
        if kind == "int":
            return "randint", 0, 2
        return ("bool" if kind == "bool" else "randn"), None, None
    word = written.lower()
    if not word:
        raise _invalid(shown, f"missing INIT after ':'; INIT one of {INIT_NAMES}")
    if word in ("randn", "rand"):
        if kind in ("int", "bool"):
            raise _invalid(
                shown, f"{word} needs a floating dtype; for {dtype} use randint(lo,hi)"
            )
        return word, None, None
    if word in ("zeros", "ones"):
        return word, None, None
    if word.startswith("randint"):
        return _parse_randint(written, dtype, shown)
    raise _invalid(shown, f"unknown INIT '{written}'; INIT one of {INIT_NAMES}")


def _parse_randint(written: str, dtype: str, shown: str) -> tuple[str, int, int]:
    match = _RANDINT_RE.fullmatch(written)
    if match is None:
        raise _invalid(shown, f"'{written}' should be randint(lo,hi) with integer bounds")
    low, high = int(match["low"]), int(match["high"])
    if dtype not in _RANDINT_RANGE:
        raise _invalid(shown, f"randint does not support {dtype}; use randn, rand, zeros or ones")
    if low >= high:
        raise _invalid(shown, f"randint({low},{high}) needs lo < hi (hi is exclusive)")
    smallest, largest = _RANDINT_RANGE[dtype]
    if low < smallest or high - 1 > largest:
        raise _invalid(
            shown,
            f"randint({low},{high}) is out of range for {dtype}: "
            f"lo must be >= {smallest} and hi <= {largest + 1}",
        )
    return "randint", low, high


def _make_all(specs: Iterable[InputSpec], device: Any) -> tuple[tuple, dict]:
    specs = list(specs)
    seen: set[str] = set()
    for spec in specs:
        if spec.name is None:
            continue
        if spec.name in seen:
            raise UsageError(
                f"input '{spec.name}' is given twice",
                "give each NAME=SPEC keyword argument once",
            )
        seen.add(spec.name)
    args = tuple(spec.make(device) for spec in specs if spec.name is None)
    kwargs = {spec.name: spec.make(device) for spec in specs if spec.name is not None}
    return args, kwargs


def _load_json(path: Path, device: Any) -> tuple[tuple, dict]:
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    # ValueError covers malformed JSON and undecodable bytes
    except (OSError, ValueError, RecursionError) as err:
        raise UsageError(
            f"cannot read inputs file '{path}': {err}",
            'write a JSON list of specs, e.g. ["float32[8,3]", "mask=bool[8]"]',
        ) from err
    if isinstance(document, list) and all(isinstance(item, str) for item in document):
        entries = [(None, item) for item in document]
    elif isinstance(document, dict) and all(isinstance(v, str) for v in document.values()):
        entries = list(document.items())
    else:
        raise UsageError(
            f"inputs file '{path}' must hold a JSON list of spec strings "
            'or an object of {"name": "spec"}',
            'e.g. ["float32[8,3]", "mask=bool[8]"] or {"x": "float32[8,3]"}',
        )
    try:
        specs = [
            parse_spec(spec) if name is None else _parse_named(name, spec)
            for name, spec in entries
        ]
        return _make_all(specs, device)
    except UsageError as err:
        raise UsageError(f"{path}: {err.message}", err.hint) from err


def _parse_named(name: str, spec: str) -> InputSpec:
    shown = f"{name}={spec}"
    if not name.isidentifier():
        raise _invalid(shown, f"NAME '{name}' is not a Python identifier")
    return _parse(spec, name, shown)


def _load_tensors(path: Path, device: Any) -> tuple[tuple, dict]:
    import torch

    plain_tensors = "it must contain plain tensors (saved with torch.save of tensors)"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            loaded = torch.load(path, map_location=device, weights_only=True)
    # any failure to load an untrusted file is the file's fault, whatever torch raises
    except Exception as err:  # noqa: BLE001
        reason = _load_failure(err) if _may_be_torch_save(path) else "it is not a file torch.save wrote"
        raise UsageError(
            f"cannot load inputs file '{path}': {reason}; {plain_tensors}",
            "save a tensor, a tuple/list of tensors or a dict of tensors with torch.save",
        ) from err
    if isinstance(loaded, torch.Tensor):
        return (loaded,), {}
    if isinstance(loaded, dict) and not all(isinstance(key, str) for key in loaded):
        problem = "a dict with non-string keys"
    else:
        problem = _first_non_tensor(loaded, "", torch.Tensor)
    if problem is not None:
        raise UsageError(
            f"inputs file '{path}' holds {problem}: expected a tensor, a tuple/list "
            f"of tensors or a dict of tensors; {plain_tensors}",
            "save a tensor, a tuple/list of tensors or a dict of tensors with torch.save",
        )
    if isinstance(loaded, dict):
        return (), dict(loaded)
    return tuple(loaded), {}


def _first_non_tensor(value: Any, where: str, tensor_type: type) -> str | None:
    """Describe the first leaf of ``value`` that is not a tensor, or return None."""
    if isinstance(value, tensor_type):
        return None
    if isinstance(value, (list, tuple)):
        items = ((f"{where}[{i}]", item) for i, item in enumerate(value))
    elif isinstance(value, dict):
        items = ((f"{where}[{key!r}]", item) for key, item in value.items())
    else:
        found = f"a value of type {type(value).__name__}"
        return f"{found} at {where}" if where else found
    for place, item in items:
        problem = _first_non_tensor(item, place, tensor_type)
        if problem is not None:
            return problem
    return None


def _may_be_torch_save(path: Path) -> bool:
    """Whether the file starts as torch.save's files do: a zip archive, or (before torch 1.6, or with
    ``_use_new_zipfile_serialization=False``) a pickle."""
    try:
        with open(path, "rb") as file:
            start = file.read(4)
    except OSError:
        return True  # (then torch's own error says why)
    return start.startswith((b"PK\x03\x04", b"\x80"))


def _load_failure(err: Exception) -> str:
    """The useful part of torch.load's error (its advice to drop weights_only is not)."""
    text = str(err)
    marker = "WeightsUnpickler error:"
    if marker in text:
        reason = text.split(marker, 1)[1].strip().split("\n\n", 1)[0]
        return "not plain tensors: " + reason.split(". Please use", 1)[0].strip()
    if text.startswith("Weights only load failed"):  # newer torch: the reason is a paragraph between advice
        advice = ("Weights only load failed", "Check the documentation")
        reasons = [part.strip() for part in text.split("\n\n") if part.strip() and not part.strip().startswith(advice)]
        if reasons:
            return "not plain tensors: " + reasons[0].splitlines()[0].rstrip(".")
    first_line = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(err).__name__}: {first_line}" if first_line else type(err).__name__


class InputSnapshot:
    """The values of the input tensors before a step, to put back before the step is traced again: a forward
    that changes its inputs in place (``ids.add_(1)``, ``x.sub_(mean)``) would otherwise be traced again on
    what the first attempt left in them. A copy of each tensor is kept, in host memory (inputs are small
    beside a step's activations; a device's memory is not doubled); only those changed since are written back.
    Inference tensors (made under ``torch.inference_mode``), which nothing outside it can change, and tensors
    without data to copy (the meta device's, a subclass's that wraps none) are not kept."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        import torch

        self._torch = torch
        self._saved: list[tuple[Any, int, Any]] = []
        with torch.no_grad():
            for tensor in tensors_in((args, kwargs), torch.Tensor):
                if tensor.is_inference() or tensor.is_meta:
                    continue
                try:
                    self._saved.append((tensor, tensor._version, tensor.detach().to("cpu", copy=True)))
                except Exception:  # noqa: BLE001, S112 - no data to copy (a subclass that wraps none, ...): not kept
                    continue

    def restore(self) -> None:
        with self._torch.no_grad():
            for index, (tensor, version, value) in enumerate(self._saved):
                if tensor._version != version:
                    tensor.copy_(value)
                    self._saved[index] = (tensor, tensor._version, value)


def tensors_in(value: Any, tensor_type: type) -> list[Any]:
    """The tensors in nested tuples, lists and dicts (arguments, keyword arguments), each once."""
    if isinstance(value, tensor_type):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    found = [tensor for item in items for tensor in tensors_in(item, tensor_type)]
    return list({id(tensor): tensor for tensor in found}.values())
