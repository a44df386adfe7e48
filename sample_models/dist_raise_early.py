"""A rank that raises before any communication: rank 1's forward raises.

Rank 1 raises ``RuntimeError("planted failure on rank 1 ...")`` at the start
of ``forward``, before any collective; rank 0 traces normally and then reaches
gradtrace's own gather of the traces. gradtrace on rank 1 prints the error
(prefixed ``[rank1]``, with the traceback of this file) and exits with code 3;
torchrun then stops rank 0, and the job ends within seconds instead of waiting
for the process-group timeout.

In a single process (no process group) the model behaves as rank 0 and does not
raise.

Run it with::

    torchrun --nproc-per-node 2 --no-python gradtrace run sample_models/dist_raise_early.py
"""

import torch
import torch.distributed as dist
from torch import nn


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class RaisesOnRank1(nn.Module):
    def __init__(self, in_features: int = 8, out_features: int = 2):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)

    def forward(self, x):
        if _rank() == 1:
            raise RuntimeError("planted failure on rank 1 (before any communication)")
        return self.fc(x)


def build_model():
    return RaisesOnRank1()


def example_inputs():
    return torch.randn(4, 8)
