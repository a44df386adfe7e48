"""The textbook example ``x.exp().sum()`` with ``x = zeros(15)``.

Shows how shapes change along the backward: SumBackward0 receives a 0-dim
gradient and sends on a (15,) one; ExpBackward0 receives and sends (15,); the
input's AccumulateGrad receives (15,) ones (norm sqrt(15)) and sends nothing.

Run it with::

    gradtrace run sample_models/classic_exp_sum.py
"""

import torch


def model(x):
    return x.exp().sum()


def example_inputs():
    return torch.zeros(15)
