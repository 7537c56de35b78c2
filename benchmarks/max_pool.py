"""What `flare.models.pool.MaxPool2d` saves on this CPU: torch's nn.MaxPool2d against it, interleaved in one process.

For each model (default: the CNN at widths 0.25 and 0.5, the main job's) the same network is built twice — once
with flare's pools, once with them swapped for torch's `nn.MaxPool2d` — and timed alternately, `--repeats` times
each, in CPU seconds of this process (run it with OMP_NUM_THREADS=1: on a shared VM wall time mostly measures the
neighbours): a training step (forward, CE, backward, SGD with momentum) on 2 × batch images, the two views of a
FAFI step, and evaluation (forward under no_grad) of `--eval-images` images in batches of 500. Prints medians,
the ratio, and checks that both networks gave the same loss and logits bit for bit.

    OMP_NUM_THREADS=1 python benchmarks/max_pool.py [--models cnn@0.25,cnn@0.5] [--in-shape 1,28,28] [--batch 64]
                                                    [--record FILE]

`--record` also writes the rows as JSON: what docs/performance.md's generated block renders from.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from flare.models import create_model
from flare.models.pool import MaxPool2d


def torch_pools(model: nn.Module) -> nn.Module:
    """A copy of `model` with every flare MaxPool2d replaced by torch's, same settings."""
    model = copy.deepcopy(model)
    for name, m in list(model.named_modules()):
        if type(m) is MaxPool2d:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child,
                    nn.MaxPool2d(m.kernel_size, m.stride, m.padding, m.dilation, ceil_mode=m.ceil_mode))
    return model


HEADER = ("| model | training step, torch's pool (images/s) | flare's | ratio | evaluation, torch's pool (images/s) "
          "| flare's | ratio | same bits |\n| --- | --- | --- | --- | --- | --- | --- | --- |")


def table_row(r: dict) -> str:
    tr, ev = r["train"], r["eval"]
    return (f"| {r['model']} | {tr['torch']:.0f} | {tr['flare']:.0f} | {tr['flare'] / tr['torch']:.2f}× | "
            f"{ev['torch']:.0f} | {ev['flare']:.0f} | {ev['flare'] / ev['torch']:.2f}× | "
            f"{'yes' if r['same_bits'] else 'NO'} |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="cnn@0.25,cnn@0.5", help="NAME@WIDTH,... (default %(default)s)")
    ap.add_argument("--in-shape", default="1,28,28", help="C,H,W of the input (default Fashion-MNIST's)")
    ap.add_argument("--batch", type=int, default=64, help="batch size; a step sees 2 × batch images")
    ap.add_argument("--steps", type=int, default=10, help="training steps per timing")
    ap.add_argument("--eval-images", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--record", default=None, metavar="FILE", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    shape = tuple(int(v) for v in args.in_shape.split(","))
    setting = (f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), CPU capability "
               f"{torch.backends.cpu.get_cpu_capability()}, input {shape}, batch {args.batch} (x2 views), "
               f"{args.steps} steps and {args.eval_images} evaluation images a timing, median of {args.repeats} "
               "interleaved repeats, CPU seconds")
    print(setting)
    print(HEADER)
    rows = []
    for spec in args.models.split(","):
        name, _, width = spec.partition("@")
        torch.manual_seed(0)
        ours = create_model(name, shape[0], 10, float(width or 1), head="linear")
        nets = {"torch": torch_pools(ours), "flare": ours}
        x, y = torch.randn(2 * args.batch, *shape), torch.randint(0, 10, (2 * args.batch,))
        xe = torch.randn(args.eval_images, *shape)
        opts = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for k, m in nets.items()}
        train, evals, last = {k: [] for k in nets}, {k: [] for k in nets}, {}

        def step(k):
            _, logits = nets[k](x)
            loss = F.cross_entropy(logits, y)
            opts[k].zero_grad(set_to_none=True)
            loss.backward()
            opts[k].step()
            return loss.detach()

        for k in nets:  # warm-up
            step(k)
        for _ in range(args.repeats):
            for k in nets:
                nets[k].train()
                t = time.process_time()
                for _ in range(args.steps):
                    loss = step(k)
                train[k].append(args.steps * len(y) / (time.process_time() - t))
                nets[k].eval()
                with torch.no_grad():
                    t = time.process_time()
                    out = torch.cat([nets[k](xe[i:i + 500])[1] for i in range(0, len(xe), 500)])
                    evals[k].append(len(xe) / (time.process_time() - t))
                last[k] = (loss, out)
        same = all(torch.equal(a, b) for a, b in zip(last["torch"], last["flare"]))
        tr, ev = {k: statistics.median(v) for k, v in train.items()}, {k: statistics.median(v) for k, v in evals.items()}
        rows.append({"model": f"{name} width {width}", "train": tr, "eval": ev, "same_bits": same})
        print(table_row(rows[-1]))
    if args.record:
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        Path(args.record).write_text(json.dumps({"setting": setting, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
