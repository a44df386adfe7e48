"""A layer that is built but never called: its parameters require grad and receive no gradient.

``norm`` (a LayerNorm) is created in ``__init__`` but ``forward`` forgets to apply it, so
``norm.weight`` and ``norm.bias`` end every backward without a gradient. An optimizer would silently
never update them (and DDP would complain about unused parameters).

``gradtrace check`` fails on it (``nograd``) and names both parameters::

    gradtrace run sample_models/forgotten_layer.py    # the summary lists them under "no gradient"
    gradtrace check sample_models/forgotten_layer.py  # exit 1
"""

import torch
from torch import nn


class ForgottenLayer(nn.Module):
    def __init__(self, in_features: int = 16, hidden: int = 32, out_features: int = 4):
        super().__init__()
        self.encoder = nn.Linear(in_features, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, out_features)

    def forward(self, x):
        h = torch.relu(self.encoder(x))  # should be self.norm(torch.relu(self.encoder(x)))
        return self.head(h)


def build_model():
    return ForgottenLayer()


def example_inputs():
    return torch.randn(8, 16)
