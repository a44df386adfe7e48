"""A backward divergence: a custom ``autograd.Function`` whose backward depends on the rank.

``RankScale`` is the identity in forward, but its backward multiplies the
gradient by ``rank + 1`` (a stand-in for a custom communication backward that
misbehaves on one rank). It is applied in ``block2``. The forward values and the
gradient arriving at ``RankScaleBackward`` (its grad_outputs) agree across
ranks, but the gradient it sends on (its grad_inputs) is twice as large on
rank 1. The cross-rank comparison should report a divergence of kind
``backward`` whose origin is the ``RankScaleBackward`` node in module
``block2``. The parameters of ``block1`` and ``block2.linear`` (upstream of it)
end with different gradients on the two ranks; ``head``'s gradients agree.

The rank is read with ``torch.distributed.get_rank()`` inside ``backward``; in
a single process (no process group) the model behaves as rank 0, where the
backward is exact.

Run it with::

    torchrun --nproc-per-node 2 --no-python gradtrace run sample_models/dist_backward.py
"""

import torch
import torch.distributed as dist
from torch import nn


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class RankScale(torch.autograd.Function):
    """Identity in forward; backward scales the gradient by ``rank + 1``."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad_out):
        return grad_out * float(_rank() + 1)


class Block(nn.Module):
    """``tanh(linear(x))``."""

    def __init__(self, features: int):
        super().__init__()
        self.linear = nn.Linear(features, features)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class RankScaleBlock(nn.Module):
    """``RankScale(tanh(linear(x)))``: the planted backward divergence."""

    def __init__(self, features: int):
        super().__init__()
        self.linear = nn.Linear(features, features)

    def forward(self, x):
        return RankScale.apply(torch.tanh(self.linear(x)))


class BackwardNet(nn.Module):
    def __init__(self, features: int = 8, out_features: int = 2):
        super().__init__()
        self.block1 = Block(features)
        self.block2 = RankScaleBlock(features)
        self.head = nn.Linear(features, out_features)

    def forward(self, x):
        return self.head(self.block2(self.block1(x)))


def build_model():
    return BackwardNet()


def example_inputs():
    return torch.randn(4, 8)
