"""An infinity in the backward pass that a later ReLU masks: finite loss, finite parameter gradients.

The ``act`` module computes ``sqrt(relu(h))``. Wherever ``h <= 0`` the ReLU outputs 0 and the
square root of 0 is 0, so the forward is finite. In the backward, SqrtBackward0 (in module ``act``)
computes ``grad / (2 * sqrt(0)) = inf``, and ReluBackward0 then replaces those entries with 0, so
every parameter gradient is finite. The infinity is latent: only the ReLU's mask keeps it from the
parameters, and a check of ``param.grad`` alone sees nothing.

``gradtrace check`` fails on it and names SqrtBackward0 in ``act`` as where the infinity appears and
ReluBackward0 as the node that masks it::

    gradtrace run sample_models/masked_inf.py    # the tree: SqrtBackward0 and ReluBackward0 marked inf
    gradtrace check sample_models/masked_inf.py  # exit 1
"""

import torch
from torch import nn


class SqrtReLU(nn.Module):
    def forward(self, h):
        return torch.sqrt(torch.relu(h))


class MaskedInf(nn.Module):
    def __init__(self, in_features: int = 8, hidden: int = 16):
        super().__init__()
        self.proj = nn.Linear(in_features, hidden)
        self.act = SqrtReLU()
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.head(self.act(self.proj(x))).mean()


def build_model():
    return MaskedInf()


def example_inputs():
    return torch.randn(4, 8)
