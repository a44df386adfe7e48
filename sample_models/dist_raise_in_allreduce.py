"""A rank that raises while the other waits in DDP's gradient all-reduce.

The model is wrapped in ``DistributedDataParallel``. Rank 1 raises
``RuntimeError("planted failure on rank 1 ...")`` inside the wrapped module's
``forward``; rank 0 runs forward and then backward, where DDP's reducer blocks
in the gradient all-reduce waiting for rank 1, which will never join. No gather
of gradtrace's own can reach rank 0 there: gradtrace on rank 1 must print the
error (prefixed ``[rank1]``) and exit at once (code 3) so that torchrun stops
rank 0, and the job ends within seconds instead of at the process-group timeout.

In a single process (no process group) the model is not wrapped, behaves as
rank 0 and does not raise.

Run it with::

    torchrun --nproc-per-node 2 --no-python gradtrace run sample_models/dist_raise_in_allreduce.py
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class RaisesOnRank1(nn.Module):
    def __init__(self, in_features: int = 8, hidden: int = 16, out_features: int = 2):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, out_features)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if _rank() == 1:
            raise RuntimeError("planted failure on rank 1 (rank 0 waits in DDP's all-reduce)")
        return self.fc2(h)


def build_model():
    model = RaisesOnRank1()
    if dist.is_available() and dist.is_initialized():
        return DDP(model)
    return model


def example_inputs():
    return torch.randn(4, 8)
