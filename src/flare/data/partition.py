"""Splitting the training set over K clients (SPEC §1) and the per-client report.

All partitions are seeded with their own numpy Generator, so the split depends only on (labels, K,
kind, α, seed) — `flare compare` runs every method on the very same split.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

from flare.errors import FlareError


@dataclass
class Partition:
    client_indices: list[np.ndarray]  # per client, indices into the training set
    num_classes: int
    labels: np.ndarray

    @property
    def sizes(self) -> list[int]:
        return [len(ix) for ix in self.client_indices]

    def histogram(self) -> np.ndarray:
        """K×C matrix of class counts."""
        h = np.zeros((len(self.client_indices), self.num_classes), dtype=np.int64)
        for i, ix in enumerate(self.client_indices):
            if len(ix):
                h[i] = np.bincount(self.labels[ix], minlength=self.num_classes)
        return h

    def entropies(self) -> list[float]:
        """Label entropy H_i in bits (0 for an empty client)."""
        out = []
        for row in self.histogram():
            n = row.sum()
            if n == 0:
                out.append(0.0)
                continue
            q = row[row > 0] / n
            out.append(float(-(q * np.log2(q)).sum()))
        return out

    def report(self) -> dict:
        hist = self.histogram()
        ent = self.entropies()
        return {
            "num_clients": len(self.client_indices),
            "num_classes": self.num_classes,
            "clients": [
                {
                    "client": i,
                    "num_samples": int(hist[i].sum()),
                    "class_histogram": hist[i].tolist(),
                    "label_entropy": ent[i],
                    "normalized_entropy": ent[i] / math.log2(self.num_classes) if self.num_classes > 1 else 0.0,
                }
                for i in range(len(self.client_indices))
            ],
        }


def dirichlet_partition(labels: np.ndarray, num_clients: int, alpha: float, seed: int,
                        num_classes: int | None = None) -> Partition:
    """The 'card dealer': per class, q ~ Dir(α·1_K), client i gets floor(q_i·N_c), the leftovers go one
    each to distinct random clients, and consecutive slices of the shuffled class are dealt out.
    Every sample is used exactly once."""
    rng = np.random.default_rng(seed)
    C = int(num_classes or labels.max() + 1)
    buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(C):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        n_c = len(idx)
        q = rng.dirichlet(alpha * np.ones(num_clients))
        counts = np.floor(q * n_c).astype(np.int64)
        leftover = n_c - int(counts.sum())
        if leftover:  # leftover < K because each floor loses less than one sample
            counts[rng.choice(num_clients, size=leftover, replace=False)] += 1
        start = 0
        for i in range(num_clients):
            buckets[i].append(idx[start:start + counts[i]])
            start += counts[i]
    return _finish(buckets, labels, C, rng)


def iid_partition(labels: np.ndarray, num_clients: int, seed: int, num_classes: int | None = None) -> Partition:
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(labels))
    C = int(num_classes or labels.max() + 1)
    return Partition([p.astype(np.int64) for p in np.array_split(perm, num_clients)], C, labels)


def shards_partition(labels: np.ndarray, num_clients: int, k: int, seed: int,
                     num_classes: int | None = None) -> Partition:
    """Pathological label skew: every client holds exactly k classes (k ≤ C). Classes are handed out
    round-robin over a shuffled class order so that they are covered evenly; each class's samples are
    split equally among the clients holding it."""
    rng = np.random.default_rng(seed)
    C = int(num_classes or labels.max() + 1)
    if k > C:
        raise FlareError(f"shards_per_client={k} exceeds the number of classes ({C}).",
                         key="partition.shards_per_client", fix=f"use a value between 1 and {C}.")
    order = rng.permutation(C)
    holders: dict[int, list[int]] = {c: [] for c in range(C)}
    for i in range(num_clients):
        for j in range(k):
            holders[int(order[(i * k + j) % C])].append(i)
    unused = [c for c, h in holders.items() if not h]
    if unused:
        warnings.warn(f"shards partition: classes {unused} are held by no client (K·k < C).", stacklevel=2)
    buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, hs in holders.items():
        if not hs:
            continue
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        for h, part in zip(hs, np.array_split(idx, len(hs))):
            buckets[h].append(part)
    return _finish(buckets, labels, C, rng)


def _finish(buckets, labels, C, rng) -> Partition:
    out = []
    for b in buckets:
        ix = np.concatenate(b) if b else np.zeros(0, dtype=np.int64)
        rng.shuffle(ix)
        out.append(ix.astype(np.int64))
    return Partition(out, C, labels)


def make_partition(labels: np.ndarray, num_clients: int, kind: str, seed: int, *, alpha: float = 0.5,
                   shards_per_client: int = 2, num_classes: int | None = None) -> Partition:
    if num_clients < 1:
        raise FlareError("need at least one client.", key="num_clients", fix="set num_clients >= 1.")
    if num_clients > len(labels):
        raise FlareError(f"num_clients={num_clients} exceeds the {len(labels)} training samples.",
                         key="num_clients", fix="use fewer clients or a larger dataset.train_subset.")
    if kind == "dirichlet":
        if alpha <= 0:
            raise FlareError(f"alpha must be > 0 (got {alpha}).", key="partition.alpha",
                             fix="use e.g. 0.05, 0.1, 0.5.")
        part = dirichlet_partition(labels, num_clients, alpha, seed, num_classes)
    elif kind == "iid":
        part = iid_partition(labels, num_clients, seed, num_classes)
    elif kind == "shards":
        part = shards_partition(labels, num_clients, shards_per_client, seed, num_classes)
    else:
        raise FlareError(f"unknown partition kind '{kind}'.", key="partition.kind",
                         fix="use dirichlet, iid or shards.")
    return part
