"""gradtrace: trace every node of a PyTorch backward pass.

The public API is imported lazily so that ``gradtrace --help`` never imports torch::

    from tracer_cli import trace
    result = trace(model, (x,))
    print(result.summary())
    rich.print(render_trace(result))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["trace", "Trace", "Node", "GradStat", "render_trace", "__version__"]

if TYPE_CHECKING:
    from .records import GradStat, Node, Trace
    from .render.tree import render_trace
    from .tracing import trace

_LAZY = {
    "trace": ("tracing", "trace"),
    "Trace": ("records", "Trace"),
    "Node": ("records", "Node"),
    "GradStat": ("records", "GradStat"),
    "render_trace": ("render.tree", "render_trace"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        module_name, attribute = _LAZY[name]
        return getattr(import_module(f".{module_name}", __name__), attribute)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
