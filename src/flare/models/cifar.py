"""The CIFAR-sized networks of the heterogeneous one-shot FL literature that timm lacks (docs/models.md): `wrn16_1`,
`wrn40_1` (DENSE's pre-activation Wide ResNets), `cnn_dense` (DENSE's "cnn1") and `cnn_coboost` (Co-Boosting's `cnn`,
DENSE's "cnn2"). As in the papers, the CNNs have no BatchNorm and their convolutions a bias; an adaptive average pool
to 4×4 (the identity at 32×32, as in their papers) keeps d the same at other sizes. Initialisation is
`resnet.init_weights` and torch's default Linear — for the WRNs the same N(0, 2/(k²·out)) their code draws."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..errors import FlareError
from .pool import MaxPool2d
from .resnet import conv1x1, conv3x3, init_weights, scaled


class WideBlock(nn.Module):
    """Pre-activation basic block; the shortcut is the identity or a 1×1 convolution of the activated input."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = conv3x3(cin, cout, stride)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = conv3x3(cout, cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = conv1x1(cin, cout, stride) if cin != cout or stride != 1 else None

    def forward(self, x: Tensor) -> Tensor:
        a = self.relu(self.bn1(x))
        out = self.conv2(self.relu(self.bn2(self.conv1(a))))
        return out + (self.shortcut(a) if self.shortcut is not None else x)


class WideResNet(nn.Module):
    """WRN-depth-k for CIFAR: f: B×C×H×W → B×d with d = round(64·k·width)."""

    def __init__(self, depth: int, widen: int, in_channels: int = 3, width: float = 1.0):
        super().__init__()
        n = (depth - 4) // 6
        c0 = scaled(16, width)
        self.conv1 = conv3x3(int(in_channels), c0)
        groups, cin = [], c0
        for c, stride in ((16 * widen, 1), (32 * widen, 2), (64 * widen, 2)):
            cout = scaled(c, width)
            groups.append(nn.Sequential(*(WideBlock(cin if i == 0 else cout, cout, stride if i == 0 else 1)
                                          for i in range(n))))
            cin = cout
        self.block1, self.block2, self.block3 = groups
        self.bn = nn.BatchNorm2d(cin)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = cin
        init_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        x = self.block3(self.block2(self.block1(self.conv1(x))))
        return torch.flatten(self.pool(self.relu(self.bn(x))), 1)


class PaperCNN(nn.Module):
    """conv3×3-ReLU-maxpool2, conv3×3-ReLU-maxpool2, conv3×3-ReLU (unpadded), pooled to 4×4 and flattened, then
    an optional Linear + ReLU to `fc` features."""

    def __init__(self, channels: tuple[int, int, int], fc: int | None, in_channels: int = 3, width: float = 1.0):
        super().__init__()
        c1, c2, c3 = (scaled(c, width) for c in channels)
        self.body = nn.Sequential(nn.Conv2d(int(in_channels), c1, 3), nn.ReLU(inplace=True), MaxPool2d(2),
                                  nn.Conv2d(c1, c2, 3), nn.ReLU(inplace=True), MaxPool2d(2),
                                  nn.Conv2d(c2, c3, 3), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(4), nn.Flatten(1))
        self.fc: nn.Module = nn.Identity()
        self.feature_dim = c3 * 16
        if fc is not None:
            self.fc = nn.Sequential(nn.Linear(c3 * 16, scaled(fc, width)), nn.ReLU(inplace=True))
            self.feature_dim = scaled(fc, width)
        init_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        if min(x.shape[-2:]) < 18:  # else a conv fails deep inside with torch's message about kernel sizes
            raise FlareError(f"this CNN needs images of at least 18×18 (three unpadded 3×3 convolutions, two 2×2 "
                             f"pools), got {x.shape[-2]}×{x.shape[-1]}.", key="model.name",
                             fix="pick another model for these images (e.g. cnn or wrn16_1).")
        return self.fc(self.body(x))
