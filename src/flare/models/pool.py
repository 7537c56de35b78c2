"""`MaxPool2d`: torch's max-pool whose CPU forward runs in the channels-last layout — the same numbers, faster.

Why by hand: ATen's CPU max-pool forward over an NCHW tensor is a scalar loop over windows (4.1 ms for 128×8×28×28,
one thread), its channels-last one is vectorised over channels (0.7 ms), while the channels-last *backward* is the
slower one; so the forward runs channels-last and the backward NCHW. Both kernels scan a window in the same order
and keep the first maximum, and their indices are positions within a plane whatever the layout: values, indices
and gradients are torch's bit for bit (tests/test_models.py). The small CNNs spent a quarter of a training step and
a third of an evaluation in their pools. The layout change is written as permutes, which vmap maps over."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _channels_last(x: Tensor) -> Tensor:
    return x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


class _MaxPool(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, args: tuple) -> tuple[Tensor, Tensor]:
        out, idx = torch.ops.aten.max_pool2d_with_indices(_channels_last(x), *args)
        return out.contiguous(), idx.contiguous()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        (x, ctx.args), (_, idx) = inputs, output
        ctx.save_for_backward(x, idx)
        ctx.mark_non_differentiable(idx)

    @staticmethod
    def backward(ctx, grad: Tensor, _: Tensor) -> tuple[Tensor, None]:
        x, idx = ctx.saved_tensors
        return torch.ops.aten.max_pool2d_with_indices_backward(grad.contiguous(), x, *ctx.args, idx), None


class MaxPool2d(nn.MaxPool2d):
    """nn.MaxPool2d (a subclass: `isinstance` checks and state dicts see torch's module) that takes the fast path
    for a contiguous 4-d CPU input outside torch.compile (which generates its own pooling code)."""

    def forward(self, x: Tensor) -> Tensor:
        if (x.device.type != "cpu" or x.dim() != 4 or self.return_indices or not x.is_contiguous()
                or torch.compiler.is_compiling()):
            return super().forward(x)
        pair = (lambda v: (v, v) if isinstance(v, int) else tuple(v))
        args = (*map(pair, (self.kernel_size, self.stride or self.kernel_size, self.padding, self.dilation)),
                self.ceil_mode)
        if torch.is_grad_enabled() and x.requires_grad:
            return _MaxPool.apply(x, args)[0]
        return F.max_pool2d(_channels_last(x), *args).contiguous()
