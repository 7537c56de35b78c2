"""Efficiency of local training: end-to-end samples/s divided by bare forward+backward+step samples/s.

End to end = `Client.train_round` exactly as a run does it: gather a batch by index from the device-
resident uint8 data, two per-image augmented views, the method's loss terms, λ, backward, gradient
clipping, step, logging. Bare = the same model on the same batch shapes (2B images) from a tensor that is
already normalised in memory, plain CE, backward, step. Both are measured in this process, interleaved,
and the best of `--repeats` is taken for each, so background load hurts both alike.

    python benchmarks/efficiency.py model.name=resnet18 model.width=0.25 dataset.name=synthetic-cifar10
    python benchmarks/efficiency.py model.name=cnn dataset.name=synthetic-cifar10
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F

from flare.client.trainer import Client, TrainContext
from flare.config import load_config
from flare.data.augment import TwoViewAugment, normalize
from flare.models import create_model
from flare.runner import amp_dtype_for, prepare_data, resolve_device
from flare.schedules import LRSchedule


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="fafi")
    ap.add_argument("--steps", type=int, default=8, help="training steps per measurement")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    ov = ["dataset.name=synthetic-cifar10", "batch_size=512", "model.name=resnet18", "model.width=0.25"] + args.overrides
    cfg = load_config(None, args.preset, ov)
    cfg = cfg.model_copy(update={"rounds": 1, "local_epochs": 1})
    device = resolve_device(cfg.device)
    amp = amp_dtype_for(cfg, device)
    data, _ = prepare_data(cfg)
    B = cfg.batch_size
    n = B * args.steps
    x, y = data.train_x[:n].to(device), data.train_y[:n].to(device)
    torch.manual_seed(0)
    model = create_model(cfg.model.name, data.in_channels, data.num_classes, cfg.model.width, head=cfg.head).to(device)
    cl = cfg.channels_last and device.type == "cuda"
    if cl:
        model = model.to(memory_format=torch.channels_last)
    aug = TwoViewAugment(data.image_size, data.in_channels, data.mean, data.std, per_image=cfg.augment.per_image).to(device)
    ctx = TrainContext(cfg=cfg, train_x=x, train_y=y, augment=aug, anchors=None, device=device, amp_dtype=amp,
                       lr_schedule=LRSchedule("constant", cfg.lr, 1))
    client = Client(0, torch.arange(n, device=device), copy.deepcopy(model), ctx, 1.0)

    bare_model = copy.deepcopy(model)
    opt = torch.optim.SGD(bare_model.parameters(), lr=cfg.lr, momentum=0.9)
    imgs = normalize(torch.cat([x[:B], x[:B]]), data.mean, data.std)
    if cl:
        imgs = imgs.contiguous(memory_format=torch.channels_last)
    y2 = torch.cat([y[:B], y[:B]])
    ctx_amp = (lambda: torch.autocast(device.type, dtype=amp)) if amp else (lambda: torch.autocast(device.type, enabled=False))

    def bare():
        sync(device)
        t = time.perf_counter()
        for _ in range(args.steps):
            with ctx_amp():
                _, logits = bare_model(imgs)
            loss = F.cross_entropy(logits.float(), y2)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        sync(device)
        return n / (time.perf_counter() - t)

    def e2e():
        sync(device)
        t = time.perf_counter()
        client.epochs_done = 0
        client.train_round(ctx, 0)
        sync(device)
        return n / (time.perf_counter() - t)

    bare(), e2e()  # warm-up (allocator, kernels, kornia)
    b_best, e_best = 0.0, 0.0
    for _ in range(args.repeats):
        b_best = max(b_best, bare())
        e_best = max(e_best, e2e())
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"device: {dev}   torch {torch.__version__}   amp: {amp}   channels_last: {cl}")
    print(f"config: {cfg.method} {cfg.model.name} width {cfg.model.width}, {data.name} {tuple(data.train_x.shape[1:])}, "
          f"batch {B} (x2 views), {args.steps} steps, best of {args.repeats}")
    print(f"bare forward+backward+step : {b_best:10.1f} samples/s")
    print(f"end-to-end local training  : {e_best:10.1f} samples/s")
    print(f"efficiency                 : {e_best / b_best:10.3f}")


if __name__ == "__main__":
    main()
