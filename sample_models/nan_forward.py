"""A model whose forward already makes the NaN, so the loss is NaN too.

``torch.log(self.scale(h))`` takes the log of a linear layer's output, which is
negative in places (the fix: ``F.softplus`` before the log). The NaN is made in
forward, in ``features``; backward only carries it on: the gradients that reach
the NaN values (the head's weight gradient first) are NaN, far from where it was
made. ``gradtrace run`` sees the loss is NaN,
traces the step again with forward values, and names the op that made it:
LogBackward0 in ``features``, at the ``torch.log`` line.

Run it with::

    gradtrace run sample_models/nan_forward.py
"""

import torch
from torch import nn


class LogFeatures(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.scale = nn.Linear(width, width)

    def forward(self, h):
        return torch.log(self.scale(h))


class Model(nn.Module):
    def __init__(self, in_features: int = 8, width: int = 16):
        super().__init__()
        self.embed = nn.Linear(in_features, width)
        self.features = LogFeatures(width)
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        h = torch.relu(self.embed(x))
        return self.head(self.features(h)).mean()


def build_model():
    return Model()


def example_inputs():
    return torch.randn(4, 8)
