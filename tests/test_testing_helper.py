"""``tracer_cli.testing.assert_gradients_healthy`` and the ``gradtrace`` pytest fixture, also inside a pytest run."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from tracer_cli.testing import assert_gradients_healthy

from .reference import load_sample

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]


def seeded(name: str):
    module = load_sample(name)
    torch.manual_seed(0)
    model = module.build_model()
    torch.manual_seed(0)
    return model, module.example_inputs()


# The function -------------------------------------------------------------------------------------


def test_healthy_model_returns_the_trace():
    model, x = seeded("mlp")
    result = assert_gradients_healthy(model, (x,))
    model(x).sum().backward()  # independently: the same gradients
    for name, p in model.named_parameters():
        assert result.leaf(name).grad_outputs[0].norm == pytest.approx(float(p.grad.norm()), rel=1e-5)


def test_masked_infinity_fails_naming_sqrt_in_act():
    model, x = seeded("masked_inf")
    with pytest.raises(AssertionError) as raised:
        assert_gradients_healthy(model, (x,))
    message = str(raised.value)
    assert message.startswith("FAIL: 1 failing finding (nonfinite)")
    row = next(line for line in message.splitlines() if line.startswith("FAIL  nonfinite"))
    assert "SqrtBackward0" in row and " act " in row and " inf " in row
    assert "ReluBackward0" in row


def test_nan_in_backward_and_forgotten_layer_fail():
    model, x = seeded("nan_where")
    with pytest.raises(AssertionError, match=r"#\d+ SqrtBackward0\s+<root>"):
        assert_gradients_healthy(model, (x,))
    model, x = seeded("forgotten_layer")
    with pytest.raises(AssertionError, match="norm.weight") as raised:
        assert_gradients_healthy(model, (x,))
    assert "norm.bias" in str(raised.value)
    assert_gradients_healthy(model, (x,), warn_on="nograd")  # demoted: passes


def test_a_nan_forward_made_is_placed_where_forward_made_it():
    """A NaN weight in the middle of the model: the loss is NaN, and every gradient after it. The message names the
    module whose forward made it first (the CLI's way: the step traced again with forward values), not nodes that
    merely passed the NaN on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    with torch.no_grad():
        model[2].weight[3, 5] = float("nan")
    x = torch.randn(2, 4)
    with pytest.raises(AssertionError) as failed:
        assert_gradients_healthy(model, x)
    message = str(failed.value)
    assert "forward made a nan first" in message and "2.weight" in message, message
    assert "grad_in nan" not in message, message  # no node is said to have made it in backward
    assert torch.equal(x, x.clone()) and model.training  # (the model as it was)


def test_thresholds_loss_fn_and_fail_on():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    x = torch.randn(5, 4)
    loss_fn = lambda out: out.pow(2).mean()  # noqa: E731
    loss_fn(model(x)).backward()
    norms = {name: float(p.grad.norm()) for name, p in model.named_parameters()}
    largest = max(norms, key=norms.get)
    limit = sorted(norms.values())[-2] * 1.001
    with pytest.raises(AssertionError) as raised:
        assert_gradients_healthy(model, (x,), loss_fn=loss_fn, max_grad_norm=limit)
    failing = [line for line in str(raised.value).splitlines() if line.startswith("FAIL ")]
    assert [line for line in failing if "(all parameters)" not in line] == [
        next(line for line in failing if f" {largest} " in line)
    ]
    assert_gradients_healthy(model, (x,), loss_fn=loss_fn, max_grad_norm=max(norms.values()) * 10)
    gated, gx = seeded("zero_gate")
    assert_gradients_healthy(gated, (gx,))  # dead parameters warn
    with pytest.raises(AssertionError, match="block.0.weight"):
        assert_gradients_healthy(gated, (gx,), fail_on=["zero"])


def test_bad_arguments():
    model, x = seeded("mlp")
    with pytest.raises(ValueError, match="gradchek"):
        assert_gradients_healthy(model, (x,), fail_on="gradchek")
    for threshold in (True, "1.0", -1.0, float("nan")):
        with pytest.raises(ValueError, match="a number from 0 up"):
            assert_gradients_healthy(model, (x,), max_grad_norm=threshold)
    with pytest.raises(ValueError, match="above max_grad_norm"):
        assert_gradients_healthy(model, (x,), max_grad_norm=1.0, min_grad_norm=2.0)
    # a check that would not run must not pass a test silently (as the command line refuses it)
    with pytest.raises(ValueError, match="no threshold"):
        assert_gradients_healthy(model, (x,), fail_on="norm")
    with pytest.raises(ValueError, match="no threshold"):
        assert_gradients_healthy(model, (x,), warn_on=["norm"])
    with pytest.raises(ValueError, match="gradcheck=True"):
        assert_gradients_healthy(model, (x,), fail_on="gradcheck")
    with pytest.raises(ValueError, match="replay=True"):
        assert_gradients_healthy(model, (x,), fail_on="replay")
    assert_gradients_healthy(model, (x,), fail_on="norm,gradcheck", max_grad_norm=1e6, gradcheck=True)


def test_gradcheck_failure_names_the_function():
    model, x = seeded("wrong_backward")
    with pytest.raises(AssertionError, match="SoftClipBackward"):
        assert_gradients_healthy(model, (x,), gradcheck=True)
    model, x = seeded("custom_function")
    assert_gradients_healthy(model, (x,), gradcheck=True)


# The plugin ---------------------------------------------------------------------------------------


def test_plugin_is_registered_by_entry_point():
    from tracer_cli.config import tomllib  # tomli on Python 3.10

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["pytest11"] == {"gradtrace": "tracer_cli.pytest_plugin"}


def test_plugin_does_not_import_torch():
    code = "import sys, tracer_cli.pytest_plugin\nprint('torch' in sys.modules)\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert result.stdout.strip() == "False"


MODELS = """
import torch
from torch import nn


class SqrtReLU(nn.Module):
    def forward(self, h):
        return torch.sqrt(torch.relu(h))


def masked():
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(8, 16))
    model.add_module("act", SqrtReLU())
    model.add_module("head", nn.Linear(16, 1))
    return model, torch.randn(4, 8)


def healthy():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)), torch.randn(4, 8)
"""


@pytest.fixture
def suite(pytester, monkeypatch):
    """A project with a model module, its pytest run loading the plugin through its entry point."""
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    pytester.makepyfile(models=MODELS)
    pytester.syspathinsert()
    return pytester


def test_helper_fails_a_test_inside_pytest(suite):
    suite.makepyfile(
        test_gradients=textwrap.dedent(
            """
            from tracer_cli.testing import assert_gradients_healthy

            from models import healthy, masked


            def test_healthy():
                model, x = healthy()
                assert_gradients_healthy(model, (x,))


            def test_masked():
                model, x = masked()
                assert_gradients_healthy(model, (x,))
            """
        )
    )
    result = suite.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*AssertionError: FAIL: 1 failing finding (nonfinite)*"])
    result.stdout.re_match_lines([r".*FAIL  nonfinite  #\d+ SqrtBackward0\s+act\s+.*inf.*"])
    assert "def assert_gradients_healthy" not in result.stdout.str()  # the traceback stops at the test


def test_fixture_inside_pytest_with_pyproject_thresholds(suite):
    suite.makepyfile(
        test_fixture=textwrap.dedent(
            """
            from models import healthy, masked


            def test_healthy(gradtrace):
                model, x = healthy()
                result = gradtrace.assert_healthy(model, (x,))
                assert result.leaf("0.weight").grad_outputs[0].norm > 0


            def test_masked(gradtrace):
                model, x = masked()
                gradtrace(model, (x,), warn_on="nonfinite")  # demoted: passes
                gradtrace.assert_healthy(model, (x,))
            """
        )
    )
    result = suite.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.re_match_lines([r".*SqrtBackward0\s+act\s+.*inf.*"])

    # thresholds from [tool.gradtrace] of the project's pyproject.toml apply to the fixture
    suite.makepyprojecttoml("[tool.gradtrace]\nmax-grad-norm = 1e-6\n")
    result = suite.runpytest("-p", "no:cacheprovider", "-k", "healthy")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*FAIL: * failing finding* (norm)*", "*above --max-grad-norm 1e-06*"])


def test_fixture_keywords_override_the_config_check_by_check(suite):
    """``warn_on="nonfinite"`` over a config's ``fail-on``/``warn-on`` lists changes nonfinite alone (it raised a
    ValueError for a check named in both); a config's ``divergence``, meant for torchrun jobs, is left out of a
    test's single process (every test using the fixture raised a ValueError)."""
    suite.makepyprojecttoml('[tool.gradtrace]\nfail-on = ["zero", "divergence"]\nwarn-on = ["nonfinite"]\n')
    suite.makepyfile(
        test_override=textwrap.dedent(
            """
            import pytest

            from models import healthy, masked


            def test_healthy(gradtrace):
                model, x = healthy()
                gradtrace.assert_healthy(model, (x,))


            def test_config_demotes_nonfinite(gradtrace):
                model, x = masked()
                gradtrace.assert_healthy(model, (x,))


            def test_promoted_here(gradtrace):
                model, x = masked()
                with pytest.raises(AssertionError, match="nonfinite"):
                    gradtrace.assert_healthy(model, (x,), fail_on="nonfinite")


            def test_zero_still_fails_from_config(gradtrace):
                model, x = healthy()
                with model[0].weight.register_hook(lambda g: g * 0), pytest.raises(AssertionError, match="zero"):
                    gradtrace.assert_healthy(model, (x,), warn_on="nograd")
            """
        )
    )
    result = suite.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)


def test_fixture_reports_a_bad_config(suite):
    suite.makepyprojecttoml("[tool.gradtrace]\nmax_grad_norm = 1.0\n")
    suite.makepyfile(test_cfg="def test_uses(gradtrace):\n    pass\n")
    result = suite.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*unknown key 'max_grad_norm'*"])
