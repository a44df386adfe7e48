"""pytest plugin (entry point ``gradtrace``): the ``gradtrace`` fixture.

    def test_gradients(gradtrace):
        gradtrace.assert_healthy(build_model(), (torch.randn(8, 16),))

The fixture applies the thresholds and check lists of ``[tool.gradtrace]`` in the pyproject.toml nearest
to pytest's root folder (less ``divergence``, which compares torchrun ranks); keyword arguments override them,
a check named in ``fail_on`` or ``warn_on`` what the config says of that check alone. pytest loads this module in every run of
every project that installs gradtrace, so it imports neither torch nor the tracer until a test uses
the fixture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

# [tool.gradtrace] key → assert_gradients_healthy keyword
_CONFIG_KEYWORDS = {
    "max-grad-norm": "max_grad_norm",
    "min-grad-norm": "min_grad_norm",
    "fail-on": "fail_on",
    "warn-on": "warn_on",
    "loss": "loss_reduction",
}


class GradientChecker:
    """What the ``gradtrace`` fixture gives a test.

    Attributes:
        defaults: keyword arguments from ``[tool.gradtrace]`` passed to every call.
    """

    def __init__(self, defaults: dict[str, Any]):
        self.defaults = defaults

    def assert_healthy(
        self, model: Callable[..., Any], args: Any = (), kwargs: dict[str, Any] | None = None, **options: Any
    ) -> Any:
        """:func:`tracer_cli.testing.assert_gradients_healthy` with the project's defaults; returns the Trace."""
        __tracebackhide__ = True
        from .checks import merge_checks, parse_fail_on
        from .testing import assert_gradients_healthy

        merged = {**self.defaults, **options}
        lists = ("fail_on", "warn_on")
        if any(key in options for key in lists) and any(key in self.defaults for key in lists):
            # a check named here replaces what the config says of it, and of it alone (as on the command line)
            given, configured = ({key: parse_fail_on(source.get(key), option=key) for key in lists} for source in (options, self.defaults))
            merged.update(merge_checks(configured, given))
        return assert_gradients_healthy(model, args, kwargs, **merged)

    __call__ = assert_healthy

    def trace(
        self, model: Callable[..., Any], args: Any = (), kwargs: dict[str, Any] | None = None, **options: Any
    ) -> Any:
        """:func:`tracer_cli.trace`, to look at the nodes yourself."""
        from .tracing import trace

        return trace(model, args, kwargs, **options)


@pytest.fixture
def gradtrace(request: pytest.FixtureRequest) -> GradientChecker:
    """Check a model's gradients: ``gradtrace.assert_healthy(model, args, ...)`` (see tracer_cli.testing)."""
    from .config import load_config
    from .errors import GradtraceError

    try:
        config = load_config(Path(request.config.rootpath))
    except GradtraceError as exc:
        pytest.fail(f"gradtrace: {exc.message}" + (f"\nhint: {exc.hint}" if exc.hint else ""), pytrace=False)
    defaults = {keyword: config.values[key] for key, keyword in _CONFIG_KEYWORDS.items() if key in config.values}
    for keyword in ("fail_on", "warn_on"):  # divergence compares torchrun ranks: a test traces one process
        if keyword in defaults:
            defaults[keyword] = ",".join(check for check in defaults[keyword].split(",") if check != "divergence")
    return GradientChecker(defaults)
