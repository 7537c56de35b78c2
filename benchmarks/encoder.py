"""Feature extraction throughput of a frozen encoder beside its bare forward pass (docs/frozen-encoder.md).

    python benchmarks/encoder.py --resolution 64 --images 256 --repeats 2 [--json OUT.json]
    python benchmarks/encoder.py --encoder efficientnet_lite0 --resolution 224 --resize bilinear --stages 8
    python benchmarks/encoder.py --cpu-smoke

"bare forward": the timm network alone on inputs already resized and normalised, in batches, under inference_mode —
what the encoder costs and nothing else. "extraction": `flare.data.features.extract_features`, the path that fills
the cache: uint8 batch → normalise → resize inside the encoder → network (with `--stages` > 1, the block stages'
outputs pooled too) → chunks of 16 batches saved atomically to disk → the N×D tensors. The extraction is meant to
cost the network and little more (the target: within 15 % of the bare forward's images/s). Both are timed over the
same images (seeded random uint8 32×32: a convolution's cost does not depend on the pixels), interleaved, the best of
`--repeats` passes after one warm-up batch. The layout and precision rows say why the cache runs float32 NHWC.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flare.data.augment import normalize  # noqa: E402
from flare.data.datasets import ImageData  # noqa: E402
from flare.data.features import FeatureOptions, extract_features, frozen_encoder  # noqa: E402


def best_rate(fn, n: int, repeats: int) -> float:
    """Images per second of the best of `repeats` timed calls of fn()."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return n / best


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--encoder", default="efficientnet_lite0")
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--resize", default="bicubic", choices=("bicubic", "bilinear"))
    ap.add_argument("--stages", type=int, default=1, help="pooled stages the extraction keeps (8: all)")
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-bf16", action="store_true", help="skip the bfloat16 row")
    ap.add_argument("--no-nchw", action="store_true", help="skip the NCHW row")
    ap.add_argument("--json", help="also write the numbers here")
    ap.add_argument("--cpu-smoke", action="store_true", help="a few images at 32 px (tests)")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.resolution, args.images, args.batch_size, args.repeats, args.no_bf16 = 32, 8, 4, 1, True
    opts = FeatureOptions(encoder=args.encoder, resolution=args.resolution, resize=args.resize,
                          batch_size=args.batch_size)
    enc = frozen_encoder(args.encoder, args.resolution, args.resize)
    B, n = args.batch_size, args.images
    x = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    data = ImageData("random", x[B:], torch.zeros(n - B, dtype=torch.long), x[:B], torch.zeros(B, dtype=torch.long),
                     ["0"], (0.5,) * 3, (0.5,) * 3)  # the extraction's train and test sets: n images in all
    with torch.inference_mode():
        ready = F.interpolate(normalize(x, enc.mean, enc.std), size=(args.resolution,) * 2, mode=args.resize,
                              align_corners=False)
    nhwc, nchw = ready.contiguous(memory_format=torch.channels_last), ready.contiguous()
    net_nhwc = enc.net

    @torch.inference_mode()
    def bare(net, inp, dtype=None):
        for s in range(0, len(inp), B):
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                net(inp[s:s + B])

    def extraction(stages):
        with tempfile.TemporaryDirectory() as tmp:
            extract_features(opts, data, Path(tmp) / "parts", stages, quiet=True)

    rows, path = {}, f"extraction (the cache's path, {args.stages} stage{'s' * (args.stages > 1)}), float32, NHWC"
    bare(net_nhwc, nhwc[:B])  # warm-up: oneDNN picks its kernels for the shapes
    # interleaved, best of each: a load spike on a shared machine hits both paths alike
    bare_t, extract_t = [], []
    for _ in range(args.repeats):
        bare_t.append(best_rate(lambda: bare(net_nhwc, nhwc), n, 1))
        extract_t.append(best_rate(lambda: extraction(args.stages), n, 1))
    rows["bare forward, float32, NHWC"], rows[path] = max(bare_t), max(extract_t)
    if not args.no_nchw:
        net_nchw = enc.net.to(memory_format=torch.contiguous_format)
        bare(net_nchw, nchw[:B])
        rows["bare forward, float32, NCHW"] = best_rate(lambda: bare(net_nchw, nchw), n, args.repeats)
        net_nhwc = enc.net.to(memory_format=torch.channels_last)
    if not args.no_bf16:  # slow on a CPU without bf16 units: one pass over at most one batch
        m = min(n, B)
        bare(net_nhwc, nhwc[:2], torch.bfloat16)
        rows["bare forward, bfloat16 autocast, NHWC"] = best_rate(
            lambda: bare(net_nhwc, nhwc[:m], torch.bfloat16), m, 1)
    ref = rows["bare forward, float32, NHWC"]
    ratio = rows[path] / ref
    res = {"encoder": args.encoder, "resolution": args.resolution, "resize": args.resize, "stages": args.stages,
           "images": n, "batch_size": B, "repeats": args.repeats, "threads": torch.get_num_threads(),
           "torch": torch.__version__, "images_per_second": rows, "extraction_over_bare": ratio}
    print(f"{args.encoder} at {args.resolution} px ({args.resize}), {n} images, batches of {B}, "
          f"{torch.get_num_threads()} threads, best of {args.repeats}:\n")
    print("| path | images/s | vs bare float32 NHWC |\n| --- | --- | --- |")
    for k, v in rows.items():
        print(f"| {k} | {v:.1f} | {v / ref:.2f}× |")
    print(f"\nextraction / bare forward = {ratio:.3f} ({'within' if ratio >= 0.85 else 'NOT within'} 15 %)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
