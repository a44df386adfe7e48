"""A model whose blocks run under ``torch.utils.checkpoint.checkpoint``.

Shows activation checkpointing. With ``use_reentrant=True`` (the default of
``build_model``) only CheckpointFunctionBackward nodes exist before backward;
the blocks' inner nodes are created while the backward recomputes them, and
the tracer hooks them as they appear (``created_in`` names the checkpoint
node). ``shared`` is applied once outside the checkpointed region and once
inside it, so with reentrant checkpointing its AccumulateGrad node runs twice
in one backward (``runs == 2``; the top-level statistics are the total).
``build_model(use_reentrant=False)`` gives the non-reentrant variant, whose
graph is complete before backward.

Run it with::

    gradtrace run sample_models/checkpointed.py
    gradtrace run sample_models/checkpointed.py:build_model   # same thing
"""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class CheckpointedNet(nn.Module):
    def __init__(self, dim: int = 16, out_features: int = 4, use_reentrant: bool = True):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.shared = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([Block(dim), Block(dim)])
        self.head = nn.Linear(dim, out_features)

    def _last_block(self, h):
        # the shared layer again, this time inside the checkpointed region
        return self.shared(self.blocks[1](h))

    def forward(self, x):
        h = torch.tanh(self.shared(x))
        h = checkpoint(self.blocks[0], h, use_reentrant=self.use_reentrant)
        h = checkpoint(self._last_block, h, use_reentrant=self.use_reentrant)
        return self.head(h)


def build_model(use_reentrant: bool = True):
    return CheckpointedNet(use_reentrant=use_reentrant)


def example_inputs():
    return torch.randn(4, 16)
