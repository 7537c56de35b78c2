"""Efficiency of local training: end-to-end samples/s divided by bare forward+backward+step samples/s.

End to end = `Client.train_round` exactly as a run does it: gather a batch by index from the device-
resident uint8 data, two per-image augmented views, the method's loss terms, λ, backward, gradient
clipping, step, logging. Bare = the same model on the same batch shapes (2B images) from a tensor that is
already normalised in memory, plain CE, backward, step. Both are measured in this process, interleaved,
and the best of `--repeats` is taken for each, so background load hurts both alike.

With `--clients K` (default 5 on a GPU, 0 = skipped on a CPU) it also measures the batched engine
(`client_engine=batched`): K clients of `--steps` batches each, trained by `BatchedClients.train_round`
(compiled with compile=true), against a bare batched step (the K stacked models under vmap, plain CE, one
functional SGD step, no augmentation) on the same shapes. It prints both ratios: batched end to end ÷ bare
batched (the overhead inside the batched program) and ÷ the bare single-model step (what batching buys over
the eager ceiling of per-client training).

With `--schedules per_batch,chunked` it also times end to end under each `augment.schedule` (its own client,
same model, data and batch), interleaved with the rest, and prints each one's best and median over the repeats
and its ratio to the bare step: what chunked augmentation buys on this machine. `SCHEDULE+CROP` (e.g.
`chunked+separable`) times that schedule with `augment.crop=CROP`.

    python benchmarks/efficiency.py model.name=resnet18 model.width=0.25 dataset.name=synthetic-cifar10
    python benchmarks/efficiency.py model.name=cnn dataset.name=synthetic-cifar10
    python benchmarks/efficiency.py model.name=resnet18 model.width=1 --clients 5 compile=true    # GPU
    python benchmarks/efficiency.py model.name=cnn model.width=0.25 --schedules per_batch,chunked --repeats 5
    python benchmarks/efficiency.py dataset.name=fmnist batch_size=64 model.name=cnn model.width=0.25 \\
        --steps 30 --clock cpu --schedules per_batch,chunked,chunked+separable
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.func import functional_call, stack_module_state

from flare.client.batched import BatchedClients
from flare.client.trainer import Client
from flare.config import load_config
from flare.data.augment import normalize
from flare.models import create_model
from flare.backend import amp_dtype_for, resolve_device, use_channels_last
from flare.data.prepare import DataMeta, prepare_data
from flare.setup import make_augment, make_train_context


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(cfg, steps: int, clients: int = 0) -> SimpleNamespace:
    """The end-to-end client of one run's local training, built as a run builds it (uint8 data on the device, the
    config's augmentation and train context, `Client`), and the bare step beside it (`bare_step()`: the same model
    on 2B normalised images already in memory, plain CE, backward, SGD with momentum). Shared with
    benchmarks/step_flops.py, so the step it counts FLOPs of is the step this benchmark times."""
    device = resolve_device(cfg.device)
    amp = amp_dtype_for(cfg, device)
    data, _ = prepare_data(cfg)
    B = cfg.batch_size
    n = B * steps
    if len(data.train_y) < n * max(clients, 1):
        raise SystemExit(f"{len(data.train_y)} training samples; --clients {clients} x --steps {steps} x batch {B} "
                         "needs more: lower --steps or --clients")
    x, y = data.train_x[:n * max(clients, 1)].to(device), data.train_y[:n * max(clients, 1)].to(device)
    torch.manual_seed(0)
    model = create_model(cfg.model.name, data.in_channels, data.num_classes, cfg.model.width, head=cfg.head).to(device)
    cl = use_channels_last(cfg, device)
    if cl:
        model = model.to(memory_format=torch.channels_last)
    aug = make_augment(cfg, DataMeta.from_data(data), device)
    ctx = make_train_context(cfg, x, y, aug, None, device, amp, cl, None)
    client = Client(0, torch.arange(n, device=device), copy.deepcopy(model), ctx, 1.0)

    bare_model = copy.deepcopy(model)
    opt = torch.optim.SGD(bare_model.parameters(), lr=cfg.lr, momentum=0.9)
    imgs = normalize(torch.cat([x[:B], x[:B]]), data.mean, data.std)
    if cl:
        imgs = imgs.contiguous(memory_format=torch.channels_last)
    y2 = torch.cat([y[:B], y[:B]])
    ctx_amp = (lambda: torch.autocast(device.type, dtype=amp)) if amp else (lambda: torch.autocast(device.type, enabled=False))

    def bare_step():
        with ctx_amp():
            _, logits = bare_model(imgs)
        loss = F.cross_entropy(logits.float(), y2)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return SimpleNamespace(device=device, amp=amp, data=data, x=x, y=y, model=model, cl=cl, aug=aug, ctx=ctx,
                           client=client, bare_model=bare_model, imgs=imgs, y2=y2, ctx_amp=ctx_amp,
                           bare_step=bare_step)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="fafi")
    ap.add_argument("--steps", type=int, default=8, help="training steps per measurement")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clients", type=int, default=None,
                    help="clients of the batched-engine measurement (default 5 on a GPU, 0 = skip on a CPU)")
    ap.add_argument("--schedules", default="", metavar="S,S",
                    help="also time end to end under each of these augment.schedule values (comma-separated; "
                         "SCHEDULE+CROP also sets augment.crop)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU seconds instead of wall seconds — on a machine shared with other "
                         "processes it counts the work done rather than the waiting (with OMP_NUM_THREADS=1, and "
                         "on CPU only: it does not see GPU time)")
    ap.add_argument("--record", default=None, metavar="FILE",
                    help="with --schedules: also write the figures as JSON (what a docs block is rendered from)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)  # KEY=VALUE may come before or after the options
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    ov = ["dataset.name=synthetic-cifar10", "batch_size=512", "model.name=resnet18", "model.width=0.25"] + args.overrides
    cfg = load_config(None, args.preset, ov)
    cfg = cfg.model_copy(update={"rounds": 1, "local_epochs": 1})
    B = cfg.batch_size
    n = B * args.steps
    K = args.clients if args.clients is not None else (5 if resolve_device(cfg.device).type == "cuda" else 0)
    built = build(cfg, args.steps, K)
    device, amp, data, x, y, model, cl = built.device, built.amp, built.data, built.x, built.y, built.model, built.cl
    aug, ctx, client, imgs, y2, ctx_amp = built.aug, built.ctx, built.client, built.imgs, built.y2, built.ctx_amp

    def bare():
        sync(device)
        t = clock()
        for _ in range(args.steps):
            built.bare_step()
        sync(device)
        return n / (clock() - t)

    def e2e():
        sync(device)
        t = clock()
        client.epochs_done = 0
        client.train_round(ctx, 0)
        sync(device)
        return n / (clock() - t)

    runs = [bare, e2e]
    schedules = [s for s in args.schedules.split(",") if s]
    if args.record and not schedules:
        ap.error("--record writes the --schedules figures; give --schedules too")
    for sched in schedules:
        schedule, _, crop = sched.partition("+")  # e.g. chunked+separable: augment.crop=separable too
        cfg_s = cfg.model_copy(update={"augment": cfg.augment.model_copy(
            update={"schedule": schedule, "crop": crop or cfg.augment.crop})})
        aug_s = make_augment(cfg_s, DataMeta.from_data(data), device) if crop else aug
        ctx_s = make_train_context(cfg_s, x, y, aug_s, None, device, amp, cl, None)
        client_s = Client(0, torch.arange(n, device=device), copy.deepcopy(model), ctx_s, 1.0)

        def e2e_schedule(client_s=client_s, ctx_s=ctx_s):
            sync(device)
            t = clock()
            client_s.epochs_done = 0
            client_s.train_round(ctx_s, 0)
            sync(device)
            return n / (clock() - t)

        runs.append(e2e_schedule)
    if K:
        clients = [Client(i, torch.arange(i * n, (i + 1) * n, device=device), copy.deepcopy(model), ctx, 1.0)
                   for i in range(K)]
        engine = BatchedClients(clients, ctx, compile=cfg.compile)
        params, buffers = stack_module_state([copy.deepcopy(model) for _ in range(K)])
        template = copy.deepcopy(model)
        imgs_k, y2_k = imgs.unsqueeze(0).expand(K, *imgs.shape), y2.unsqueeze(0).expand(K, *y2.shape)

        def loss_k(p, b, xk, yk):
            with ctx_amp():
                _, logits = functional_call(template, (p, b), (xk,))
            return F.cross_entropy(logits.float(), yk)

        fwd = torch.vmap(loss_k)
        fwd = torch.compile(fwd) if cfg.compile else fwd
        plist = list(params.values())
        moms = [torch.zeros_like(q) for q in plist]

        def bare_batched():
            sync(device)
            t = clock()
            for _ in range(args.steps):
                for q in plist:
                    q.grad = None
                fwd(params, buffers, imgs_k, y2_k).sum().backward()
                with torch.no_grad():
                    torch._foreach_mul_(moms, 0.9)
                    torch._foreach_add_(moms, [q.grad for q in plist])
                    torch._foreach_add_(plist, moms, alpha=-cfg.lr)
            sync(device)
            return K * n / (clock() - t)

        def e2e_batched():
            sync(device)
            t = clock()
            for c in clients:
                c.epochs_done = 0
            engine.train_round(0)
            sync(device)
            return K * n / (clock() - t)

        runs += [bare_batched, e2e_batched]
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    for f in runs:  # warm-up (allocator, kernels, kornia, torch.compile)
        f()
    best = [0.0] * len(runs)
    every: list[list[float]] = [[] for _ in runs]
    for _ in range(args.repeats):
        for i, f in enumerate(runs):
            every[i].append(f())
            best[i] = max(best[i], every[i][-1])
    b_best, e_best = best[0], best[1]
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"device: {dev}   torch {torch.__version__}   amp: {amp}   channels_last: {cl}   clock: {args.clock}")
    config = (f"{cfg.method} {cfg.model.name} width {cfg.model.width}, {data.name} {tuple(data.train_x.shape[1:])}, "
              f"batch {B} (x2 views), {args.steps} steps, best of {args.repeats}")
    print(f"config: {config}")
    print(f"bare forward+backward+step : {b_best:10.1f} samples/s")
    print(f"end-to-end local training  : {e_best:10.1f} samples/s")
    print(f"efficiency                 : {e_best / b_best:10.3f}")
    if schedules:
        if load_before is not None:  # how busy the machine was: these figures are that machine's, at that load
            print("load average (1/5/15 min): " + "/".join(f"{v:.2f}" for v in load_before) + " before, "
                  + "/".join(f"{v:.2f}" for v in os.getloadavg()) + " after")
        med = sorted(every[0])[len(every[0]) // 2]
        print(f"augment.schedule, end to end (samples/s; ÷ bare, best and median of {args.repeats}, interleaved):")
        print(f"  {'bare step':17s}: best {b_best:9.1f}           median {med:9.1f}")
        series = {}
        for j, sched in enumerate(schedules):
            xs = sorted(every[2 + j])
            series[sched] = {"best": xs[-1], "median": xs[len(xs) // 2]}
            print(f"  {sched:17s}: best {xs[-1]:9.1f} ({xs[-1] / b_best:.3f})   median {xs[len(xs) // 2]:9.1f} "
                  f"({xs[len(xs) // 2] / med:.3f})")
        if args.record:
            Path(args.record).write_text(json.dumps(
                {"config": config, "clock": args.clock, "repeats": args.repeats,
                 "load_before": list(load_before) if load_before is not None else None,
                 "load_after": list(os.getloadavg()) if load_before is not None else None,
                 "bare_step": {"best": b_best, "median": med}, "schedules": series}, indent=1) + "\n")
    if K:
        bb, eb = best[2 + len(schedules)], best[3 + len(schedules)]
        print(f"batched engine, {K} clients{' (compiled)' if cfg.compile else ''}:")
        print(f"  bare batched fwd+bwd+step : {bb:10.1f} samples/s")
        print(f"  end-to-end batched        : {eb:10.1f} samples/s")
        print(f"  efficiency (÷ bare batched): {eb / bb:9.3f}")
        print(f"  ÷ bare single-model step  : {eb / b_best:10.3f}   (÷ sequential end to end: {eb / e_best:.3f})")


if __name__ == "__main__":
    main()
