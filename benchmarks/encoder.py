"""Feature extraction throughput of the frozen encoder beside its bare forward pass (docs/frozen-encoder.md).

    python benchmarks/encoder.py --resolution 64 --images 256 --repeats 2 [--json OUT.json]
    python benchmarks/encoder.py --cpu-smoke

"bare forward": the timm network alone on inputs already resized and normalised, in batches, under inference_mode —
what the encoder costs and nothing else. "extraction": `flare.data.features.encode`, the path that fills the cache:
uint8 batch → normalise → resize inside the encoder (bicubic) → network → copy into the N×D output. The extraction
is meant to cost the network and little more (the target: within 15 % of the bare forward's images/s). Both are
timed over the same images (seeded random uint8 32×32: a convolution's cost does not depend on the pixels), the
best of `--repeats` passes after one warm-up batch. The layout and precision rows say why the cache runs float32 NHWC.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flare.data.augment import normalize  # noqa: E402
from flare.data.features import encode, frozen_encoder  # noqa: E402


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
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-bf16", action="store_true", help="skip the bfloat16 row")
    ap.add_argument("--json", help="also write the numbers here")
    ap.add_argument("--cpu-smoke", action="store_true", help="a few images at 32 px (tests)")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.resolution, args.images, args.batch_size, args.repeats, args.no_bf16 = 32, 8, 4, 1, True
    enc = frozen_encoder("efficientnet_lite0", args.resolution)
    x = torch.randint(0, 256, (args.images, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    plain = lambda b: normalize(b, enc.mean, enc.std)  # noqa: E731
    with torch.inference_mode():
        ready = F.interpolate(plain(x), size=(args.resolution,) * 2, mode="bicubic", align_corners=False)
    nhwc, nchw = ready.contiguous(memory_format=torch.channels_last), ready.contiguous()
    net_nhwc = enc.net
    B, n = args.batch_size, args.images

    @torch.inference_mode()
    def bare(net, inp, dtype=None):
        for s in range(0, len(inp), B):
            if dtype is None:
                net(inp[s:s + B])
            else:
                with torch.autocast("cpu", dtype=dtype):
                    net(inp[s:s + B])

    rows = {}
    bare(net_nhwc, nhwc[:B])  # warm-up: oneDNN picks its kernels for the shapes
    encode(enc, x[:B], plain, B, "warm-up", quiet=True)
    # interleaved, best of each: a load spike on a shared machine hits both paths alike
    bare_t, extract_t = [], []
    for _ in range(args.repeats):
        bare_t.append(best_rate(lambda: bare(net_nhwc, nhwc), n, 1))
        extract_t.append(best_rate(lambda: encode(enc, x, plain, B, "extraction", quiet=True), n, 1))
    rows["bare forward, float32, NHWC"] = max(bare_t)
    rows["extraction (the cache's path), float32, NHWC"] = max(extract_t)
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
    ratio = rows["extraction (the cache's path), float32, NHWC"] / ref
    res = {"resolution": args.resolution, "images": n, "batch_size": B, "repeats": args.repeats,
           "threads": torch.get_num_threads(), "torch": torch.__version__, "images_per_second": rows,
           "extraction_over_bare": ratio}
    print(f"EfficientNet-Lite0 at {args.resolution} px, {n} images, batches of {B}, {torch.get_num_threads()} "
          f"threads, best of {args.repeats}:\n")
    print("| path | images/s | vs bare float32 NHWC |\n| --- | --- | --- |")
    for k, v in rows.items():
        print(f"| {k} | {v:.1f} | {v / ref:.2f}× |")
    print(f"\nextraction / bare forward = {ratio:.3f} ({'within' if ratio >= 0.85 else 'NOT within'} 15 %)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
