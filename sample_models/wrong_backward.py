"""A custom ``autograd.Function`` whose backward forgets a term: ``--gradcheck`` catches it.

``SoftClip`` computes ``x * sigmoid(x)`` (SiLU) but its backward returns only ``sigmoid(x)``, leaving
out the ``x * sigmoid(x) * (1 - sigmoid(x))`` term. Every norm still looks plausible; only a numerical
check shows the backward is wrong. It takes a non-tensor argument (``beta``) like many real Functions.

Run it with::

    gradtrace run sample_models/wrong_backward.py --gradcheck
    gradtrace check sample_models/wrong_backward.py --gradcheck     # exit 1: the gradcheck fails
"""

import torch
from torch import nn


class SoftClip(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, beta: float):
        ctx.save_for_backward(x)
        ctx.beta = beta
        return x * torch.sigmoid(beta * x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.sigmoid(ctx.beta * x), None  # the bug: forgets the derivative of the sigmoid


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(SoftClip.apply(self.fc1(x), 1.0)).mean()


def build_model():
    return Net()


def example_inputs():
    return torch.randn(4, 8)
