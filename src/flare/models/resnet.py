"""CIFAR-style ResNet encoders (docs/method.md#model, docs/models.md).

Unlike the ImageNet ResNet, the stem is one 3×3 stride-1 convolution + BN + ReLU with NO max-pool, so a 32×32 input
keeps its resolution through the first stage. Four stages of widths round(64·2^s·width), strides 1, 2, 2, 2, then
global average pooling: f(x) ∈ R^{B×d}, d = `encoder.feature_dim` (512·width, or 2048·width for Bottleneck).
Only stock layers are used, so the encoders run in channels_last and under torch.autocast."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn


def scaled(channels: int | float, width: float) -> int:
    """round(channels·width), at least 1."""
    return max(1, int(round(channels * width)))


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False)


def shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    """A residual block's shortcut: the identity, or a strided 1×1 convolution + BN where the shape changes."""
    if stride != 1 or cin != cout:
        return nn.Sequential(conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))
    return nn.Identity()


def init_weights(module: nn.Module) -> None:
    """torchvision's initialisation: kaiming-normal (fan_out, relu) convolutions with zero biases, BN weight 1 and
    bias 0."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int = 1):
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = conv3x3(cin, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = shortcut(cin, cout, stride)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1):
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = conv1x1(cin, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)  # stride on the 3×3 (torchvision "ResNet v1.5")
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, cout)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = shortcut(cin, cout, stride)

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + self.shortcut(x))


class ResNetEncoder(nn.Module):
    """f: B×C×H×W → B×d. Submodules `stem`, `layer1`..`layer4`, `pool` are public for inspection."""

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: Sequence[int], in_channels: int = 3,
                 width: float = 1.0):
        super().__init__()
        stem_out = scaled(64, width)  # create_model has refused a width ≤ 0
        self.stem = nn.Sequential(conv3x3(int(in_channels), stem_out), nn.BatchNorm2d(stem_out),
                                  nn.ReLU(inplace=True))  # no max-pool (CIFAR-style)
        cin, stages = stem_out, []
        for s, (n, stride) in enumerate(zip(layers, (1, 2, 2, 2))):
            planes = scaled(64 * 2**s, width)
            stages.append(nn.Sequential(block(cin, planes, stride),
                                        *(block(planes * block.expansion, planes) for _ in range(n - 1))))
            cin = planes * block.expansion
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = cin
        init_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        x = self.layer4(self.layer3(self.layer2(self.layer1(self.stem(x)))))
        return torch.flatten(self.pool(x), 1)
