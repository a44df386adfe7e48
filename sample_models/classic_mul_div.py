"""The textbook example ``out = x * y + x / y`` on two float scalars.

Shows what the node hooks report on the smallest possible graph: DivBackward0
receives the root gradient 1 and sends on (1/y, -x/y**2) = (0.5, -1.0);
MulBackward0 sends on (y, x) = (2, 4).

Run it with::

    gradtrace run sample_models/classic_mul_div.py
"""

import torch


def model(x, y):
    return x * y + x / y


def example_inputs():
    return torch.tensor(4.0), torch.tensor(2.0)
