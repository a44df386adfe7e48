"""A small residual MLP sharded with FSDP2 (``fully_shard``): every rank agrees.

FSDP2 keeps each parameter sharded across the ranks (a DTensor) and swaps in an
unsharded copy, gathered from every rank, while a module runs: the graph's
leaves are those copies, not the parameters ``named_parameters()`` returns.
gradtrace names each copy after the parameter it stands for, so the tree shows
``blocks.0.fc.weight`` as usual. After ``backward()`` FSDP2 reduce-scatters the
gradients into the sharded parameters' ``.grad``; gradtrace reads each one's
norm over the whole parameter (across ranks), so ``param_grads`` and the
comparison's "params ‖grad‖" are those of the full gradient, also for the head,
whose 5 rows do not divide evenly among 2 ranks.

``build_model()`` shards the model only when a process group exists (gradtrace
creates one under torchrun before it builds the model); in a single process it
returns the plain model. FSDP2 needs torch 2.6 or later
(``torch.distributed.fsdp.fully_shard``).

Run it with::

    gradtrace run sample_models/dist_fsdp.py --nproc-per-node 2

or under torchrun::

    torchrun --nproc-per-node 2 --no-python gradtrace run sample_models/dist_fsdp.py
"""

import torch
import torch.distributed as dist
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.relu(self.fc(self.norm(x)))


class ResidualMLP(nn.Module):
    def __init__(self, width: int = 32, depth: int = 3, classes: int = 5):  # 5 rows: an uneven shard on 2 ranks
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model():
    model = ResidualMLP()
    if dist.is_available() and dist.is_initialized():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # the device the ranks run on: NCCL's GPUs (--device cuda), else the CPU, with gloo (left to itself, FSDP2
        # would move the model to a GPU wherever there is one, away from the inputs)
        mesh = init_device_mesh("cuda" if dist.get_backend() == "nccl" else "cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)  # one unit per block: its parameters are gathered when it runs
        fully_shard(model, mesh=mesh)  # the root unit: the head's parameters
    return model


def example_inputs():
    return torch.randn(8, 32)


def loss_fn(output):
    return output.square().mean()
