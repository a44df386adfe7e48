"""A forward-value divergence: ``block2`` multiplies its activation by ``1 + rank``.

Every rank builds the same graph with the same weights and inputs, but
``block2`` scales its ReLU output by ``1 + rank`` (by 1 on rank 0, by 2 on
rank 1). The input of that multiplication (the ReLU's output) agrees across
ranks, its output does not, so the cross-rank comparison should report a
divergence of kind ``forward`` whose origin is the ``MulBackward0`` created in
module ``block2``. Every node after it (in forward order) differs too, as a
consequence.

The rank is read with ``torch.distributed.get_rank()`` inside ``forward``; in a
single process (no process group) the model behaves as rank 0.

Run it with::

    torchrun --nproc-per-node 2 --no-python gradtrace run sample_models/dist_forward.py
"""

import torch
import torch.distributed as dist
from torch import nn


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Block(nn.Module):
    """``relu(linear(x))``."""

    def __init__(self, features: int):
        super().__init__()
        self.linear = nn.Linear(features, features)

    def forward(self, x):
        return torch.relu(self.linear(x))


class RankScaledBlock(nn.Module):
    """``relu(linear(x)) * (1 + rank)``: the planted forward divergence."""

    def __init__(self, features: int):
        super().__init__()
        self.linear = nn.Linear(features, features)

    def forward(self, x):
        h = torch.relu(self.linear(x))
        return h * float(1 + _rank())  # MulBackward0 in block2: differs on rank 1


class ForwardNet(nn.Module):
    def __init__(self, features: int = 8, out_features: int = 2):
        super().__init__()
        self.block1 = Block(features)
        self.block2 = RankScaledBlock(features)
        self.head = nn.Linear(features, out_features)

    def forward(self, x):
        return self.head(self.block2(self.block1(x)))


def build_model():
    return ForwardNet()


def example_inputs():
    return torch.randn(4, 8)
