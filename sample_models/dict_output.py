"""A model that returns a dict of tensors with no ``"loss"`` entry.

Shows the default loss rule: with no ``loss_fn``, no 0-dim output and no
``loss``, the tracer sums every floating-point output (``logits.sum() +
aux.sum()``) and skips the int64 ``"pred"`` entry.

Run it with::

    gradtrace run sample_models/dict_output.py
"""

import torch
from torch import nn


class TwoHeads(nn.Module):
    def __init__(self, in_features: int = 10, hidden: int = 12, classes: int = 5):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh())
        self.classifier = nn.Linear(hidden, classes)
        self.aux_head = nn.Linear(hidden, 1)

    def forward(self, x):
        h = self.body(x)
        logits = self.classifier(h)
        return {
            "logits": logits,
            "aux": torch.sigmoid(self.aux_head(h)).squeeze(-1),
            "pred": logits.argmax(-1),
        }


def build_model():
    return TwoHeads()


def example_inputs():
    return torch.randn(6, 10)
