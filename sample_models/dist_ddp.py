"""A small MLP wrapped in ``DistributedDataParallel``: every rank agrees.

Shows a healthy data-parallel model under gradtrace: every rank gets the same
inputs (same seed), builds the same weights (DDP also broadcasts rank 0's), and
so every node agrees across ranks. Under DDP the node hooks (AccumulateGrad
included) see each rank's own gradient, while ``param.grad`` is averaged by
DDP's all-reduce after ``backward()`` returns; both agree here, so the
comparison reports "ranks agree" and no unsynchronized parameters. With
``--rank-seed`` the inputs, losses and local gradients differ by rank, but the
averaged parameter gradients still agree.

``build_model()`` wraps the model in DDP only when a process group exists
(gradtrace creates one under torchrun before it builds the model); in a single
process it returns the plain MLP.

Run it with::

    torchrun --nproc-per-node 2 --no-python gradtrace run sample_models/dist_ddp.py

or with gradtrace's own launcher::

    gradtrace run --nproc-per-node 2 sample_models/dist_ddp.py
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class MLP(nn.Module):
    def __init__(self, in_features: int = 8, hidden: int = 16, out_features: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, out_features)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def build_model():
    model = MLP()
    if dist.is_available() and dist.is_initialized():
        return DDP(model)
    return model


def example_inputs():
    return torch.randn(4, 8)
