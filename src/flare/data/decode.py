"""Decoding encoded images (JPEG, PNG, ...) into one uint8 N×C×H×W tensor per split, in parallel, with a
progress bar: what the image-folder and Tiny-ImageNet readers share."""
from __future__ import annotations

import io
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from flare.errors import FlareError

_WORKERS = min(8, os.cpu_count() or 1)
# train_x, train_y, test_x, test_y, classes
Arrays = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[str]]


def decode_image(data: bytes, where: str) -> torch.Tensor:
    """One encoded image -> C×H×W uint8 with C = 1 (grayscale) or 3 (RGB).

    JPEGs go through torchvision's libjpeg-turbo decoder: it releases the GIL and skips Pillow's
    per-image Python overhead (~3x faster on 32x32 images, identical pixels). Everything else (PNG with
    palettes, BMP, TIFF, ...) goes through Pillow."""
    if data[:3] == b"\xff\xd8\xff":
        # lazy: imported on the first JPEG, not with the module: torchvision pulls in torch._dynamo, seconds
        # of start-up for every process that never decodes one
        from torchvision.io import ImageReadMode, decode_jpeg

        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        try:
            img = decode_jpeg(buf, mode=ImageReadMode.UNCHANGED)
            return img if img.shape[0] in (1, 3) else decode_jpeg(buf, mode=ImageReadMode.RGB)  # e.g. CMYK
        except RuntimeError:
            pass  # let Pillow try, and word the error if it fails too
    try:
        with Image.open(io.BytesIO(data)) as im:
            arr = np.array(im.convert("L" if im.mode in ("1", "L", "LA", "I", "I;16", "F") else "RGB"))
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise FlareError(f"cannot decode image {where}: {e}.", key="dataset.root",
                         fix="replace or delete the broken file.") from None
    t = torch.from_numpy(arr)
    return t.unsqueeze(0) if t.ndim == 2 else t.permute(2, 0, 1).contiguous()


def _decode_chunk(chunk: list[tuple[str, Path | bytes, int]]) -> list[torch.Tensor]:
    out = []
    for where, payload, _ in chunk:
        if isinstance(payload, Path):
            try:
                payload = payload.read_bytes()
            except OSError as e:
                raise FlareError(f"cannot read {where}: {e}.", key="dataset.root",
                                 fix="check the file's permissions.") from None
        out.append(decode_image(payload, where))
    return out


def _decode_all(items: list[tuple[str, Path | bytes, int]], desc: str) -> list[torch.Tensor]:
    """Decode in chunks on a thread pool (the JPEG decoder releases the GIL), with a progress bar."""
    quiet = os.environ.get("FLARE_QUIET", "") not in ("", "0") or not sys.stderr.isatty()
    chunks = [items[i:i + 256] for i in range(0, len(items), 256)]
    out: list[torch.Tensor] = []
    pool = ThreadPoolExecutor(_WORKERS)
    try:
        with tqdm(total=len(items), desc=desc, unit="img", disable=quiet, file=sys.stderr) as bar:
            for part in pool.map(_decode_chunk, chunks):
                out += part
                bar.update(len(part))
    finally:
        pool.shutdown(cancel_futures=True)
    return out


def decode_splits(name: str, train: list, test: list, classes: list[str]) -> Arrays:
    """Decode both splits into uint8 tensors: one size for all, gray only if every image is gray."""
    images = {s: _decode_all(items, f"decoding {name} {s}") for s, items in (("train", train), ("test", test))}
    every = [(img, where) for s, items in (("train", train), ("test", test))
             for img, (where, _, _) in zip(images[s], items)]
    if not every:
        raise FlareError(f"no images found for {name}.", key="dataset.root", fix="check dataset.root.")
    ref, ref_where = every[0][0].shape[1:], every[0][1]
    for img, where in every:
        if img.shape[1:] != ref:
            raise FlareError(f"images differ in size: {where} is {img.shape[2]}x{img.shape[1]}, "
                             f"{ref_where} is {ref[1]}x{ref[0]}.", key="dataset.root",
                             fix="resize all images to one size first (e.g. `mogrify -resize WxH! ...`).")
    channels = 1 if all(img.shape[0] == 1 for img, _ in every) else 3

    def stack(imgs: list[torch.Tensor]) -> torch.Tensor:
        if not imgs:
            return torch.empty((0, channels, *ref), dtype=torch.uint8)
        return torch.stack([img.expand(channels, -1, -1) for img in imgs])

    def labels(items: list) -> torch.Tensor:
        return torch.tensor([y for _, _, y in items], dtype=torch.int64)

    return stack(images["train"]), labels(train), stack(images["test"]), labels(test), classes
