"""The small Fashion-MNIST/MNIST networks of the papers FLARE reproduces at their own settings (docs/papers.md);
the head FLARE adds is the reference's classifier.

* `simple-cnn` — NIID-Bench's `SimpleCNNMNIST` / `SimpleCNN` (Xtra-Computing/NIID-Bench `model.py`), the client
  network of FedLPA's Table 1: no BatchNorm, unpadded convolutions, every layer with a bias; d = 84.
* `cnn_mnist_dense` — DENSE's `CNNMnist` (zj-jayzhang/DENSE `models/nets.py`): d = 32·7·7 = 1568 at 28×28.

Both keep torch's default initialisation, as their references do (they never re-initialise)."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .pool import MaxPool2d
from .resnet import scaled


class SimpleCNN(nn.Module):
    """NIID-Bench's simple-cnn without its last Linear (the head)."""

    def __init__(self, in_channels: int = 1, width: float = 1.0):
        super().__init__()
        c1, c2 = scaled(6, width), scaled(16, width)
        h1, h2 = scaled(120, width), scaled(84, width)
        side = 4 if in_channels == 1 else 5  # 28×28 or 32×32 after two unpadded 5×5 convolutions and 2×2 pools
        self.conv1 = nn.Conv2d(int(in_channels), c1, 5)
        self.conv2 = nn.Conv2d(c1, c2, 5)
        self.pool = MaxPool2d(2, 2)
        self.fc1 = nn.Linear(c2 * side * side, h1)
        self.fc2 = nn.Linear(h1, h2)
        self.feature_dim = h2

    def forward(self, x: Tensor) -> Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        return torch.relu(self.fc2(torch.relu(self.fc1(torch.flatten(x, 1)))))


class DenseMnistCNN(nn.Module):
    """DENSE's CNNMnist without its Linear classifier (the head)."""

    def __init__(self, in_channels: int = 1, width: float = 1.0):
        super().__init__()
        c1, c2 = scaled(16, width), scaled(32, width)
        self.layer1 = nn.Sequential(nn.Conv2d(int(in_channels), c1, 5, padding=2), nn.BatchNorm2d(c1), nn.ReLU(),
                                    MaxPool2d(2))
        self.layer2 = nn.Sequential(nn.Conv2d(c1, c2, 5, padding=2), nn.BatchNorm2d(c2), nn.ReLU(), MaxPool2d(2))
        self.feature_dim = c2 * 7 * 7  # at 28×28

    def forward(self, x: Tensor) -> Tensor:
        return torch.flatten(self.layer2(self.layer1(x)), 1)
