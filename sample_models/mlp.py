"""A three-layer MLP (Linear/ReLU/Linear/ReLU/Linear) on float32[8, 16].

Shows module attribution on the most common model: each AddmmBackward0 and its
TBackward0 belong to the Linear that made them, the ReLU nodes to their ReLU,
and each weight's AccumulateGrad to its layer.

Run it with::

    gradtrace run sample_models/mlp.py
"""

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, in_features: int = 16, hidden: int = 32, out_features: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(hidden, hidden)
        self.act2 = nn.ReLU()
        self.fc3 = nn.Linear(hidden, out_features)

    def forward(self, x):
        return self.fc3(self.act2(self.fc2(self.act1(self.fc1(x)))))


def build_model():
    return MLP()


def example_inputs():
    return torch.randn(8, 16)
