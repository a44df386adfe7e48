"""A custom ``autograd.Function`` whose backward depends on hidden state: ``--replay`` catches it.

``DecayingGrad`` is the identity in forward, but its backward scales the gradient by a counter that
grows with every call, as a backward that reads a global step, a running statistic or a buffer
another call changed would. The engine's result and a replay of the same backward from the same
gradients differ, so the node is reported as not reproducible.

Run it with::

    gradtrace run sample_models/stateful_backward.py --replay
"""

import torch
from torch import nn


class DecayingGrad(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        DecayingGrad.calls += 1
        return grad / DecayingGrad.calls


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x):
        return self.fc2(DecayingGrad.apply(torch.tanh(self.fc1(x)))).sum()


def build_model():
    return Net()


def example_inputs():
    return torch.randn(4, 8)
