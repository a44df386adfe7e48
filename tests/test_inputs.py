"""Tests for the input-spec grammar and inputs files (tracer_cli.inputs)."""

from __future__ import annotations

import json
import pathlib
import pickle
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tracer_cli.errors import UsageError
from tracer_cli.inputs import InputSpec, build_inputs, load_inputs_file, parse_spec

ALIASES = {
    "float32": ["float32", "f32", "float"],
    "float16": ["float16", "f16", "half"],
    "bfloat16": ["bfloat16", "bf16"],
    "float64": ["float64", "f64", "double"],
    "int64": ["int64", "i64", "long"],
    "int32": ["int32", "i32", "int"],
    "int16": ["int16"],
    "int8": ["int8"],
    "uint8": ["uint8"],
    "bool": ["bool"],
    "complex64": ["complex64"],
    "complex128": ["complex128"],
}
FLOATING = {"float32", "float16", "bfloat16", "float64"}
INTEGER = {"int64", "int32", "int16", "int8", "uint8"}
COMPLEX = {"complex64", "complex128"}


# --- valid specs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "alias, canonical", [(a, name) for name, aliases in ALIASES.items() for a in aliases]
)
def test_every_dtype_alias(alias, canonical):
    spec = parse_spec(f"{alias}[2,3]")
    assert spec.dtype == canonical
    tensor = spec.make()
    assert tensor.dtype == getattr(torch, canonical)
    assert tensor.shape == (2, 3)
    assert not tensor.requires_grad


@pytest.mark.parametrize(
    "text, name, dtype, shape, init, low, high",
    [
        ("float32[8,3,32,32]", None, "float32", (8, 3, 32, 32), "randn", None, None),
        ("float32[]", None, "float32", (), "randn", None, None),
        ("float32[ ]", None, "float32", (), "randn", None, None),
        ("f32[0,4]", None, "float32", (0, 4), "randn", None, None),
        ("  float32[ 8, 3 ] ", None, "float32", (8, 3), "randn", None, None),
        ("bf16[4,16]:ones", None, "bfloat16", (4, 16), "ones", None, None),
        ("f64[2] : zeros", None, "float64", (2,), "zeros", None, None),
        ("half[3]:rand", None, "float16", (3,), "rand", None, None),
        ("double[3]:randn", None, "float64", (3,), "randn", None, None),
        ("int64[2,128]:randint(0,50257)", None, "int64", (2, 128), "randint", 0, 50257),
        ("i32[4]:randint( -5 , 5 )", None, "int32", (4,), "randint", -5, 5),
        ("long[3]", None, "int64", (3,), "randint", 0, 2),
        ("bool[5]", None, "bool", (5,), "bool", None, None),
        ("bool[5]:ones", None, "bool", (5,), "ones", None, None),
        ("complex64[2]", None, "complex64", (2,), "randn", None, None),
        ("x=float32[2]", "x", "float32", (2,), "randn", None, None),
        (" attention_mask = bool[1,4] ", "attention_mask", "bool", (1, 4), "bool", None, None),
        ("float32[007]", None, "float32", (7,), "randn", None, None),
        ("Float32[2]:ONES", None, "float32", (2,), "ones", None, None),
        ("torch.float32[2]", None, "float32", (2,), "randn", None, None),
    ],
)
def test_valid_specs(text, name, dtype, shape, init, low, high):
    spec = parse_spec(text)
    assert spec == InputSpec(text.split("=")[-1].strip(), name, dtype, shape, init, low, high)
    tensor = spec.make()
    assert tensor.shape == shape
    assert tensor.dtype == getattr(torch, dtype)
    assert not tensor.requires_grad


@pytest.mark.parametrize("dtype", ["float32", "bf16", "int64", "uint8", "bool", "complex128"])
def test_ones_and_zeros_values(dtype):
    assert bool((parse_spec(f"{dtype}[3,2]:ones").make() == 1).all())
    assert bool((parse_spec(f"{dtype}[3,2]:zeros").make() == 0).all())


@pytest.mark.parametrize(
    "text, low, high",
    [
        ("int64[4000]:randint(0,50257)", 0, 50257),
        ("int32[4000]:randint(-3,4)", -3, 4),
        ("uint8[4000]:randint(250,256)", 250, 256),
        ("int8[4000]:randint(-128,128)", -128, 128),
        ("int64[4000]", 0, 2),
        ("float32[4000]:randint(5,9)", 5, 9),
    ],
)
def test_randint_bounds_are_respected(text, low, high):
    tensor = parse_spec(text).make()
    assert int(tensor.min()) >= low
    assert int(tensor.max()) <= high - 1


def test_integer_default_draws_both_values():
    torch.manual_seed(0)
    assert set(parse_spec("int64[1000]").make().tolist()) == {0, 1}
    assert set(parse_spec("bool[1000]").make().tolist()) == {False, True}


def test_rand_is_in_unit_interval():
    tensor = parse_spec("float64[1000]:rand").make()
    assert float(tensor.min()) >= 0.0 and float(tensor.max()) < 1.0


def test_make_uses_the_global_rng():
    torch.manual_seed(123)
    first = parse_spec("float32[5]").make()
    torch.manual_seed(123)
    assert torch.equal(first, parse_spec("float32[5]").make())


def test_make_moves_to_device():
    assert parse_spec("float32[2]").make(device="cpu").device == torch.device("cpu")
    assert parse_spec("float32[2]").make(device=torch.device("meta")).is_meta


def test_make_too_large_is_a_usage_error():
    with pytest.raises(UsageError, match="float32\\[4611686018427387904,4\\]"):
        parse_spec("float32[4611686018427387904,4]").make()


# --- invalid specs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, problem",
    [
        ("float32[8,x]", "dimension 'x' is not a non-negative integer"),
        ("float32[8,-1]", "dimension '-1' is not a non-negative integer"),
        ("float32[2.5]", "dimension '2.5' is not a non-negative integer"),
        ("float32[8,,3]", "empty dimension"),
        ("float32[8,]", "empty dimension"),
        ("float32[99999999999999999999]", "too large"),
        ("float33[8]", "unknown dtype 'float33'"),
        ("[8]", "missing DTYPE"),
        ("float32", "missing the shape"),
        ("float32:ones", "missing the shape"),
        ("float32[8", "missing ']'"),
        ("float32[8]]", "unexpected"),
        ("float32[[8]]", "expected one DTYPE"),
        ("float32(8)", "missing the shape"),
        ("", "missing the shape"),
        ("float32[8]ones", "unexpected 'ones'"),
        ("float32[8]:", "missing INIT"),
        ("float32[8]:normal", "unknown INIT 'normal'"),
        ("float32[8]:randn()", "unknown INIT"),
        ("int64[8]:randn", "use randint(lo,hi)"),
        ("i32[8]:rand", "use randint(lo,hi)"),
        ("bool[8]:randn", "use randint(lo,hi)"),
        ("int64[8]:randint(5,5)", "lo < hi"),
        ("int64[8]:randint(9,1)", "lo < hi"),
        ("int64[8]:randint(0)", "randint(lo,hi)"),
        ("int64[8]:randint(a,b)", "randint(lo,hi)"),
        ("int64[8]:randint", "randint(lo,hi)"),
        ("uint8[8]:randint(0,257)", "out of range for uint8"),
        ("uint8[8]:randint(-1,5)", "out of range for uint8"),
        ("bool[8]:randint(0,3)", "out of range for bool"),
        ("int64[8]:randint(0,9223372036854775808)", "out of range for int64"),
        ("float16[8]:randint(0,5000)", "out of range for float16"),
        ("complex64[8]:randint(0,5)", "randint does not support complex64"),
        ("1x=float32[8]", "NAME '1x'"),
        ("=float32[8]", "NAME ''"),
        ("my-arg=float32[8]", "NAME 'my-arg'"),
        ("x=y=float32[8]", "more than one '='"),
        ("float32[٣]", "is not a non-negative integer"),  # a non-ASCII digit
    ],
)
def test_invalid_specs(text, problem):
    with pytest.raises(UsageError) as caught:
        parse_spec(text)
    message = caught.value.message
    assert f"invalid input spec '{text}'" in message
    assert problem in message
    assert caught.value.hint.startswith("expected DTYPE[D0,D1,...][:INIT]")


def test_bad_dimension_message_and_hint():
    with pytest.raises(UsageError) as caught:
        parse_spec("float32[8,x]")
    assert caught.value.message == (
        "invalid input spec 'float32[8,x]': dimension 'x' is not a non-negative integer"
    )
    hint = caught.value.hint
    assert "e.g. float32[8,3,32,32], bf16[4,16]:ones, int64[2,128]:randint(0,50257)" in hint
    assert "INIT one of randn, rand, zeros, ones, randint(lo,hi)" in hint
    assert "bfloat16/bf16" in hint


def test_unknown_dtype_lists_known_names():
    with pytest.raises(UsageError) as caught:
        parse_spec("fp32[2]")
    for names in ("float32/f32/float", "float16/f16/half", "bf16", "int64/i64/long", "bool"):
        assert names in caught.value.message


def test_importing_the_module_does_not_import_torch():
    code = "import sys, tracer_cli.inputs; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=pathlib.Path(__file__).resolve().parents[1],
    )
    assert result.stdout.strip() == "False"


# --- properties -------------------------------------------------------------------------------

shapes = st.lists(st.integers(0, 4), max_size=4).map(tuple)
spaces = st.sampled_from(["", " ", "  "])


@st.composite
def valid_specs(draw):
    """(spec text, expected InputSpec fields) for a random valid spec."""
    canonical = draw(st.sampled_from(sorted(ALIASES)))
    alias = draw(st.sampled_from(ALIASES[canonical]))
    shape = draw(shapes)
    inits = ["zeros", "ones", None]
    if canonical in FLOATING | COMPLEX:
        inits += ["randn", "rand"]
    if canonical in FLOATING | INTEGER:
        inits.append("randint")
    init = draw(st.sampled_from(inits))
    low = high = None
    if init == "randint":
        smallest = 0 if canonical == "uint8" else -100
        low = draw(st.integers(smallest, 100))
        high = draw(st.integers(low + 1, 101))
    name = draw(st.none() | st.sampled_from(["x", "input_ids", "_mask"]))
    pad = draw(spaces)
    dims = f",{pad}".join(str(d) for d in shape)
    text = f"{pad}{alias}{pad}[{pad}{dims}{pad}]"
    if init == "randint":
        text += f"{pad}:{pad}randint({pad}{low},{high}{pad})"
    elif init is not None:
        text += f":{init}"
    if init is None:
        init, low, high = {"bool": ("bool", None, None)}.get(
            canonical, ("randint", 0, 2) if canonical in INTEGER else ("randn", None, None)
        )
    full = f"{name}{pad}={text}" if name else text
    return full, InputSpec(text.strip(), name, canonical, shape, init, low, high)


@settings(max_examples=150, deadline=None)
@given(valid_specs())
def test_valid_specs_round_trip(case):
    text, expected = case
    spec = parse_spec(text)
    assert spec == expected
    tensor = spec.make()
    assert tuple(tensor.shape) == expected.shape
    assert tensor.dtype == getattr(torch, expected.dtype)
    if expected.init == "randint" and tensor.numel():
        assert expected.low <= int(tensor.min()) and int(tensor.max()) < expected.high


def _parses_or_usage_error(text):
    try:
        spec = parse_spec(text)
    except UsageError as err:
        assert err.message.startswith("invalid input spec ")
        assert f"'{text}'" in err.message
    else:
        assert isinstance(spec, InputSpec)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_arbitrary_text_parses_or_is_a_usage_error(text):
    _parses_or_usage_error(text)


grammar_text = st.text(alphabet="float32intbool16[],: =()-+x randint", max_size=30)


@settings(max_examples=300, deadline=None)
@given(
    grammar_text
    | st.builds(
        "{}[{}]{}".format, st.sampled_from(["f32", "int64", "bool"]), grammar_text, grammar_text
    )
)
def test_grammar_like_text_parses_or_is_a_usage_error(text):
    _parses_or_usage_error(text)


# --- build_inputs -----------------------------------------------------------------------------


def test_build_inputs_splits_positional_and_keyword():
    args, kwargs = build_inputs(["float32[2,3]", "mask=bool[2]", "int64[4]:randint(0,10)"])
    assert [tuple(a.shape) for a in args] == [(2, 3), (4,)]
    assert [a.dtype for a in args] == [torch.float32, torch.int64]
    assert list(kwargs) == ["mask"]
    assert kwargs["mask"].dtype == torch.bool


def test_build_inputs_empty():
    assert build_inputs([]) == ((), {})


def test_build_inputs_duplicate_name():
    with pytest.raises(UsageError, match="'x' is given twice"):
        build_inputs(["x=float32[2]", "float32[1]", "x=float32[3]"])


def test_build_inputs_bad_spec():
    with pytest.raises(UsageError, match="invalid input spec 'y=float32\\[a\\]'"):
        build_inputs(["float32[2]", "y=float32[a]"])


# --- .json files ------------------------------------------------------------------------------


def test_json_list(tmp_path):
    path = tmp_path / "inputs.json"
    path.write_text(json.dumps(["float32[2,3]", "ids=int64[4]:randint(0,7)"]))
    args, kwargs = load_inputs_file(path)
    assert len(args) == 1 and args[0].shape == (2, 3)
    assert kwargs["ids"].dtype == torch.int64 and int(kwargs["ids"].max()) < 7


def test_json_object(tmp_path):
    path = tmp_path / "inputs.json"
    path.write_text(json.dumps({"x": "float32[2]", "mask": "bool[2]:ones"}))
    args, kwargs = load_inputs_file(str(path))
    assert args == ()
    assert list(kwargs) == ["x", "mask"]
    assert bool(kwargs["mask"].all())


@pytest.mark.parametrize(
    "content, problem",
    [
        ("[\"float32[2]\"", "cannot read inputs file"),
        ("", "cannot read inputs file"),
        ("\"float32[2]\"", "must hold a JSON list"),
        ("[1, 2]", "must hold a JSON list"),
        ("{\"x\": 3}", "must hold a JSON list"),
        ("[\"float32[b]\"]", "invalid input spec 'float32[b]'"),
        ("{\"not-a-name\": \"float32[2]\"}", "NAME 'not-a-name'"),
        ("[\"x=f32[1]\", \"x=f32[1]\"]", "given twice"),
    ],
)
def test_bad_json_files(tmp_path, content, problem):
    path = tmp_path / "inputs.json"
    path.write_text(content)
    with pytest.raises(UsageError) as caught:
        load_inputs_file(path)
    assert str(path) in caught.value.message
    assert problem in caught.value.message


def test_json_that_is_not_utf8(tmp_path):
    path = tmp_path / "inputs.json"
    path.write_bytes(b"\xff\xfe\x00[")
    with pytest.raises(UsageError, match="cannot read inputs file"):
        load_inputs_file(path)


# --- .pt files --------------------------------------------------------------------------------


def test_pt_tensor(tmp_path):
    path = tmp_path / "x.pt"
    torch.save(torch.arange(6.0).reshape(2, 3), path)
    args, kwargs = load_inputs_file(path)
    assert kwargs == {}
    assert torch.equal(args[0], torch.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize("container", [tuple, list])
def test_pt_sequence(tmp_path, container):
    path = tmp_path / "xs.pth"
    torch.save(container([torch.ones(2), torch.zeros(3, dtype=torch.int64)]), path)
    args, kwargs = load_inputs_file(path)
    assert isinstance(args, tuple) and kwargs == {}
    assert [tuple(a.shape) for a in args] == [(2,), (3,)]


def test_pt_dict_with_nested_containers(tmp_path):
    path = tmp_path / "kw.pt"
    torch.save({"x": torch.ones(2), "pair": (torch.zeros(1), [torch.ones(1)])}, path)
    args, kwargs = load_inputs_file(path, device="cpu")
    assert args == ()
    assert torch.equal(kwargs["x"], torch.ones(2))
    assert isinstance(kwargs["pair"], tuple) and isinstance(kwargs["pair"][1], list)


@pytest.mark.parametrize(
    "payload, found",
    [
        ({"a": "string"}, "a value of type str at ['a']"),
        (3, "a value of type int"),
        ((torch.ones(1), None), "a value of type NoneType at [1]"),
        ({"a": [torch.ones(1), 2]}, "at ['a'][1]"),
        ({1: torch.ones(1)}, "non-string keys"),
    ],
)
def test_pt_with_non_tensor_leaves(tmp_path, payload, found):
    path = tmp_path / "bad.pt"
    torch.save(payload, path)
    with pytest.raises(UsageError) as caught:
        load_inputs_file(path)
    message = caught.value.message
    assert str(path) in message and found in message
    assert "expected a tensor, a tuple/list of tensors or a dict of tensors" in message


class _TouchOnUnpickle:
    """Unpickling this object creates ``marker``: it stands for any code a pickle can run."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


def test_malicious_payload_really_runs_when_unsafe(tmp_path):
    """Guard the test below: this payload does execute when weights_only is off."""
    marker = tmp_path / "proof"
    path = tmp_path / "evil.pt"
    torch.save(_TouchOnUnpickle(marker), path)
    torch.load(path, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("write", ["torch.save", "pickle"])
def test_malicious_pt_never_executes(tmp_path, write):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    if write == "torch.save":
        torch.save({"x": _TouchOnUnpickle(marker)}, path)
    else:
        path.write_bytes(pickle.dumps(_TouchOnUnpickle(marker)))
    with pytest.raises(UsageError) as caught:
        load_inputs_file(path)
    assert not marker.exists()
    assert str(path) in caught.value.message
    assert "plain tensors (saved with torch.save of tensors)" in caught.value.message
    # torch's advice to load it with weights_only=False is not for gradtrace's users (no option does that)
    assert "weights_only" not in caught.value.message and "not plain tensors: " in caught.value.message


@pytest.mark.parametrize("content", [b"", b"not a torch file", b"PK\x03\x04garbage"])
def test_corrupt_pt(tmp_path, content):
    path = tmp_path / "junk.pt"
    path.write_bytes(content)
    with pytest.raises(UsageError, match="cannot load inputs file") as caught:
        load_inputs_file(path)
    # a file that does not even start as torch.save's do is said to be none of them (not "not plain tensors")
    assert ("not a file torch.save wrote" in caught.value.message) == (not content.startswith(b"PK"))


def test_a_pt_file_torch_wrote_the_old_way_loads(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"x": torch.arange(3.0)}, path, _use_new_zipfile_serialization=False)
    args, kwargs = load_inputs_file(path)
    assert args == () and torch.equal(kwargs["x"], torch.arange(3.0))


def test_missing_file(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        load_inputs_file(tmp_path / "nope.pt")


def test_directory_is_not_a_file(tmp_path):
    folder = tmp_path / "dir.json"
    folder.mkdir()
    with pytest.raises(UsageError, match="is not a file"):
        load_inputs_file(folder)


@pytest.mark.parametrize("name", ["inputs.npy", "inputs.txt", "inputs"])
def test_other_extensions(tmp_path, name):
    path = tmp_path / name
    path.write_text("[]")
    with pytest.raises(UsageError, match=r"must end in \.pt .* or \.json"):
        load_inputs_file(path)


def test_tensors_in_a_dataclass_or_a_dict_subclass_input_get_gradients_and_names():
    import dataclasses
    from collections import OrderedDict

    from tracer_cli import trace

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        scale: float = 1.0
        repeats: int = dataclasses.field(init=False, default=1)  # set after construction: kept as it was set

    torch.manual_seed(0)
    fc = torch.nn.Linear(4, 2)
    x = torch.randn(3, 4)
    batch = Batch(x, scale=2.0)
    batch.repeats = 3
    by_dataclass = trace(lambda batch: fc(batch.x * batch.scale) * batch.repeats / 3, batch, input_grad=True)
    by_ordered = trace(lambda batch: fc(batch["x"]) if isinstance(batch, OrderedDict) else None, OrderedDict(x=x), input_grad=True)
    expected = (fc.weight.detach().sum(0) * 2.0).expand(3, 4).norm()  # d(sum(fc(2x)))/dx
    assert [i.name for i in by_dataclass.meta.inputs] == ["input:0.x"]
    assert by_dataclass.leaf("input:0.x").grad_norm == pytest.approx(float(expected), rel=1e-6)
    assert by_ordered.leaf("input:0.x").grad_norm == pytest.approx(float(expected) / 2.0, rel=1e-6)
    assert not x.requires_grad  # the caller's tensor is not changed
