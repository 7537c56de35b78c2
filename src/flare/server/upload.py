"""What a client sends the server, once: its model weights, its prototypes and its sample count."""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class Upload:
    client: int
    state: dict[str, Tensor]      # encoder (+ head) state dict, BatchNorm statistics included
    num_samples: int
    prototypes: Tensor | None     # C×d for prototype heads, None for plain classifiers
