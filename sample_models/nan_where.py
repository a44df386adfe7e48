"""A model whose forward is finite but whose backward produces NaN.

``torch.where(h > 0, torch.sqrt(h), 0)`` is the classic trap: the forward picks
0 wherever ``h <= 0``, but ``sqrt(h)`` was still computed there (NaN for
``h < 0``). In the backward, WhereBackward0 sends a zero gradient into the sqrt
branch and SqrtBackward0 computes ``0 / (2 * sqrt(h)) = 0 / NaN = NaN``, so the
gradients of ``proj`` (and everything before it) become NaN while the loss is
finite. The first non-finite gradient appears in SqrtBackward0, created by the
root module's own forward.

Run it with::

    gradtrace run sample_models/nan_where.py
"""

import torch
from torch import nn


class SqrtFeatures(nn.Module):
    def __init__(self, in_features: int = 8, hidden: int = 16):
        super().__init__()
        self.proj = nn.Linear(in_features, hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        h = self.proj(x)
        features = torch.where(h > 0, torch.sqrt(h), 0.0)
        return self.head(features).mean()


def build_model():
    return SqrtFeatures()


def example_inputs():
    return torch.randn(4, 8)
