"""On-device two-view augmentation: the FAFI "SupCon" policy (docs/method.md#local-objective-fafi).

The training loop keeps each client's images as one uint8 tensor on the training device and slices batches out
of it, so there is no DataLoader and no PIL: `TwoViewAugment` takes a uint8 batch B×C×H×W and returns two
independently augmented, normalised float32 views, computed with batched kornia ops on the batch's device.

Policy (torchvision's SupCon recipe, in this order): RandomResizedCrop(image_size, scale=(0.2, 1.0), ratio=(3/4,
4/3)), bilinear; RandomHorizontalFlip(p=0.5); ColorJitter(0.4, 0.4, 0.4, 0.1) with p=0.8; RandomGrayscale(p=0.2);
then `(x/255 - mean) / std` (the arithmetic of `normalize`, which the evaluation path uses). Where and why it departs
from torchvision: the list under the policy in docs/method.md#local-objective-fafi."""
from __future__ import annotations

from typing import Sequence

import kornia.augmentation as K
import torch
from torch import Tensor, nn

__all__ = ["SeparableResizedCrop", "TwoViewAugment", "normalize"]


def _as_stats(v, channels: int, device, name: str) -> Tensor:
    t = torch.as_tensor(v, dtype=torch.float32, device=device).flatten()
    if t.numel() == 1:
        t = t.expand(channels)
    if t.numel() != channels:
        raise ValueError(f"{name} has {t.numel()} entries but the images have {channels} channels")
    return t.reshape(1, channels, 1, 1)


def normalize(x_uint8: Tensor, mean, std) -> Tensor:
    """uint8 B×C×H×W (or C×H×W) → float32 `(x/255 - mean) / std` on x's device (the evaluation transform)."""
    if x_uint8.dtype != torch.uint8:
        raise TypeError(f"normalize expects a uint8 tensor, got {x_uint8.dtype}")
    c = x_uint8.shape[-3]
    m = _as_stats(mean, c, x_uint8.device, "mean")
    s = _as_stats(std, c, x_uint8.device, "std")
    if x_uint8.dim() == 3:
        m, s = m[0], s[0]
    return (x_uint8.float().div_(255.0) - m) / s


def _resize_matrix(lo: Tensor, hi: Tensor, n_out: int, n_in: int) -> Tensor:
    """N×n_out×n_in: row i holds the two bilinear weights of sample lo + i·(hi − lo)/(n_out − 1) (corner-aligned)."""
    pos = torch.lerp(lo[:, None], hi[:, None], torch.linspace(0, 1, n_out, device=lo.device))
    first = pos.floor().clamp_(0, n_in - 1)
    frac, first = (pos - first)[..., None], first.long()[..., None]
    m = torch.zeros(lo.shape[0], n_out, n_in, device=lo.device).scatter_add_(2, first, 1 - frac)
    return m.scatter_add_(2, (first + 1).clamp_(max=n_in - 1), frac)


class SeparableResizedCrop(K.RandomResizedCrop):
    """kornia's RandomResizedCrop (its draws, boxes, corner-aligned bilinear values) as two small matrix products per
    image: an axis-aligned crop is separable, and kornia's eager sampling grid costs more than the sampling on small
    images (docs/performance.md#chunked-augmentation). Other last digits: `augment.crop=separable`, not the default."""

    def apply_transform(self, input: Tensor, params: dict, flags: dict, transform: Tensor | None = None) -> Tensor:
        box = params["src"].to(input)  # corners (x, y): top-left first, bottom-right third
        (h, w), (hi, wi) = flags["size"], input.shape[-2:]
        rows = _resize_matrix(box[:, 0, 1], box[:, 2, 1], h, hi)
        return rows[:, None] @ input @ _resize_matrix(box[:, 0, 0], box[:, 2, 0], w, wi).transpose(1, 2)[:, None]


class TwoViewAugment(nn.Module):
    """Two independently augmented, normalised float32 views of a uint8 batch (see module docstring).

    The keyword-only arguments change the policy away from the SupCon recipe (tests use them to switch parts off);
    the defaults are the SupCon policy."""

    def __init__(self, image_size: int | Sequence[int], in_channels: int, mean, std, per_image: bool = True, *,
                 crop_scale: tuple[float, float] = (0.2, 1.0), crop_ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
                 flip_p: float = 0.5, jitter: tuple[float, float, float, float] = (0.4, 0.4, 0.4, 0.1),
                 jitter_p: float = 0.8, gray_p: float = 0.2, pre_mean=None, pre_std=None, crop: str = "kornia"):
        super().__init__()
        size = (image_size, image_size) if isinstance(image_size, int) else image_size[:2]
        self.image_size = size = (int(size[0]), int(size[1]))
        self.in_channels = int(in_channels)
        self.per_image = bool(per_image)
        same = not self.per_image
        rgb = self.in_channels == 3
        brightness, contrast, saturation, hue = jitter
        if not rgb:  # saturation / hue / grayscale only make sense for RGB
            saturation, hue = 0.0, 0.0

        resized_crop = {"kornia": K.RandomResizedCrop, "separable": SeparableResizedCrop}[crop]
        ops: list[nn.Module] = [resized_crop(size, scale=tuple(crop_scale), ratio=tuple(crop_ratio),
                                             same_on_batch=same, cropping_mode="resample", align_corners=True)]
        if flip_p > 0:
            ops.append(K.RandomHorizontalFlip(p=flip_p, same_on_batch=same))
        if jitter_p > 0 and any(v != 0 for v in (brightness, contrast, saturation, hue)):
            ops.append(K.ColorJitter(brightness, contrast, saturation, hue, p=jitter_p, same_on_batch=same))
        if rgb and gray_p > 0:
            ops.append(K.RandomGrayscale(p=gray_p, same_on_batch=same))
        self.policy = nn.Sequential(*ops)

        self.register_buffer("mean", _as_stats(mean, self.in_channels, None, "mean"), persistent=False)
        self.register_buffer("std", _as_stats(std, self.in_channels, None, "std"), persistent=False)
        self.pre = None
        if pre_mean is not None:
            self.register_buffer("pre_mean", _as_stats(pre_mean, self.in_channels, None, "pre_mean"), persistent=False)
            self.register_buffer("pre_std", _as_stats(pre_std, self.in_channels, None, "pre_std"), persistent=False)
            self.pre = True

    def single_view(self, x_uint8: Tensor) -> Tensor:
        """One augmented, normalised float32 view."""
        if x_uint8.dtype != torch.uint8:
            raise TypeError(f"TwoViewAugment expects a uint8 batch, got {x_uint8.dtype}")
        if x_uint8.dim() != 4 or x_uint8.shape[1] != self.in_channels:
            raise ValueError(f"expected a B×{self.in_channels}×H×W batch, got shape {tuple(x_uint8.shape)}")
        with torch.no_grad(), torch.autocast(x_uint8.device.type, enabled=False):
            x = x_uint8.float().div_(255.0)
            if self.pre is not None:
                x = (x - self.pre_mean.to(x.device)) / self.pre_std.to(x.device)
            x = self.policy(x)
            return ((x - self.mean.to(x.device)) / self.std.to(x.device)).contiguous()

    def forward(self, x_uint8: Tensor) -> tuple[Tensor, Tensor]:
        return self.single_view(x_uint8), self.single_view(x_uint8)
