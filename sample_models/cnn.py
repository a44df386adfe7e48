"""A small CNN: a conv stem, two residual blocks with BatchNorm, a classifier head.

Shows convolution, batch-norm and residual-add nodes, attributed to nested
modules (``blocks.0.bn1`` ...); the model is traced in training mode, so
BatchNorm uses batch statistics. Input float32[4, 3, 16, 16].

Run it with::

    gradtrace run sample_models/cnn.py
"""

import torch
from torch import nn


class ResidualBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        h = self.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return self.relu(x + h)


class SmallCNN(nn.Module):
    def __init__(self, channels: int = 8, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
        )
        self.blocks = nn.Sequential(ResidualBlock(channels), ResidualBlock(channels))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x):
        h = self.blocks(self.stem(x))
        return self.head(torch.flatten(self.pool(h), 1))


def build_model():
    return SmallCNN()


def example_inputs():
    return torch.randn(4, 3, 16, 16)
