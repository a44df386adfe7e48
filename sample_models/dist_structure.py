"""A structure divergence: rank 1 applies an extra op inside ``block2``.

On rank 1 (and only there) ``block2`` passes its linear layer's output through
an extra ``torch.sigmoid`` before its ``tanh``, so rank 1's graph has one node
more than rank 0's: a ``SigmoidBackward0`` created in module ``block2``. The
cross-rank comparison should report a divergence of kind ``structure`` whose
origin is that ``SigmoidBackward0`` in ``block2`` (on rank 1).

The rank is read with ``torch.distributed.get_rank()`` inside ``forward``; in a
single process (no process group) the model behaves as rank 0.

Run it with::

    torchrun --nproc-per-node 2 --no-python gradtrace run sample_models/dist_structure.py
"""

import torch
import torch.distributed as dist
from torch import nn


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Block(nn.Module):
    """``tanh(linear(x))``."""

    def __init__(self, features: int):
        super().__init__()
        self.linear = nn.Linear(features, features)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class ExtraOpOnRank1(nn.Module):
    """``tanh(linear(x))`` on rank 0; ``tanh(sigmoid(linear(x)))`` on rank 1."""

    def __init__(self, features: int):
        super().__init__()
        self.linear = nn.Linear(features, features)

    def forward(self, x):
        h = self.linear(x)
        if _rank() == 1:
            h = torch.sigmoid(h)  # the planted extra node: SigmoidBackward0 in block2
        return torch.tanh(h)


class StructureNet(nn.Module):
    def __init__(self, features: int = 8, out_features: int = 2):
        super().__init__()
        self.block1 = Block(features)
        self.block2 = ExtraOpOnRank1(features)
        self.head = nn.Linear(features, out_features)

    def forward(self, x):
        return self.head(self.block2(self.block1(x)))


def build_model():
    return StructureNet()


def example_inputs():
    return torch.randn(4, 8)
