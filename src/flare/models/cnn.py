"""A small CNN encoder for fast CPU runs, where a ResNet-18 costs minutes per round: three conv3×3-BN-ReLU layers
of 32, 64, 128 channels (× width), max-pools after the first two, global average pooling (d = round(128·width)).
Padding 1 everywhere, so any input ≥ 4×4 works (28×28, 32×32, 64×64, ...). Same init as the ResNets."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .pool import MaxPool2d
from .resnet import init_weights, scaled


def _block(cin: int, cout: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class SmallCNN(nn.Module):
    def __init__(self, in_channels: int = 3, width: float = 1.0):
        super().__init__()
        self.in_channels = int(in_channels)
        c1, c2, c3 = scaled(32, width), scaled(64, width), scaled(128, width)
        self.body = nn.Sequential(*_block(self.in_channels, c1), MaxPool2d(2), *_block(c1, c2), MaxPool2d(2),
                                  *_block(c2, c3))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = c3
        init_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        return torch.flatten(self.pool(self.body(x)), 1)
