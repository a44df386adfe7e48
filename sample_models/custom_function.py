"""A hand-written ``torch.autograd.Function`` (``MyLinear``) inside an nn.Module.

Shows a custom Function's node (``MyLinearBackward``) beside the built-in ones:
its grad_outputs (the gradient of its output) and grad_inputs (one per tensor
input: x, weight, bias; the float ``scale`` and the bool ``transpose`` are not
tensors, so the node has no gradient slot for them). The backward is exact, so the traced
norms match a plain ``loss.backward()``. ``loss_fn`` takes the mean square of
the output.

Run it with::

    gradtrace run sample_models/custom_function.py
"""

import torch
from torch import nn


class MyLinear(torch.autograd.Function):
    """``scale * (x @ W.T + b)``, or ``scale * (x @ W + b)`` when ``transpose`` is set."""

    @staticmethod
    def forward(ctx, x, weight, bias, scale: float, transpose: bool):
        ctx.save_for_backward(x, weight, bias)
        ctx.scale = scale
        ctx.transpose = transpose
        w = weight if transpose else weight.t()
        return scale * (x @ w + bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias = ctx.saved_tensors
        g = grad_out * ctx.scale
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = g @ (weight.t() if ctx.transpose else weight)
        if ctx.needs_input_grad[1]:
            grad_w = x.t() @ g if ctx.transpose else g.t() @ x
        if ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b, None, None


class ScaledMLP(nn.Module):
    def __init__(self, in_features: int = 6, hidden: int = 5, out_features: int = 3):
        super().__init__()
        # weight stored [out, in] (the usual layout) ...
        self.w1 = nn.Parameter(torch.randn(hidden, in_features) * 0.5)
        self.b1 = nn.Parameter(torch.randn(hidden) * 0.1)
        # ... and [in, out] (used with transpose=True)
        self.w2 = nn.Parameter(torch.randn(hidden, out_features) * 0.5)
        self.b2 = nn.Parameter(torch.randn(out_features) * 0.1)

    def forward(self, x):
        h = torch.tanh(MyLinear.apply(x, self.w1, self.b1, 2.0, False))
        return MyLinear.apply(h, self.w2, self.b2, 0.5, True)


def build_model():
    return ScaledMLP()


def example_inputs():
    return torch.randn(4, 6)


def loss_fn(output):
    return output.pow(2).mean()
