"""A ReZero-style residual block whose gate starts at 0: the block's parameters get an exactly-zero gradient.

``out = x + gate * block(x)`` with ``gate`` initialised to 0 (ReZero, LayerScale and zero-initialised
residual branches do this on purpose). On the first step the gradient reaching ``block`` is
``gate * grad = 0``, so ``block.0.weight``, ``block.0.bias``, ``block.2.weight`` and ``block.2.bias``
have all-zero gradients while ``gate`` itself gets a non-zero one.

Dead parameters are a warning in ``gradtrace check`` (as here, they can be by design); ``--fail-on
zero`` makes them fail::

    gradtrace run sample_models/zero_gate.py                   # the tree: four zero norms, dim
    gradtrace check sample_models/zero_gate.py                 # exit 0, four warnings
    gradtrace check sample_models/zero_gate.py --fail-on zero  # exit 1
"""

import torch
from torch import nn


class ZeroGate(nn.Module):
    def __init__(self, features: int = 8):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(features, features), nn.Tanh(), nn.Linear(features, features))
        self.gate = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return x + self.gate * self.block(x)


def build_model():
    return ZeroGate()


def example_inputs():
    return torch.randn(4, 8)
