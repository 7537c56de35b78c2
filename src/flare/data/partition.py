"""Splitting the training set over K clients (docs/method.md#partitions) and the per-client report.

Every partition draws from its own seeded streams, so the split depends only on (labels, K, kind, α, rng, seed):
`flare compare` runs every method on the very same split. `rng="generator"` (default) draws from a numpy Generator;
`rng="legacy"` draws exactly as the reference code did, so that the per-client class counts equal the notes': numpy's
legacy RandomState seeded with the seed (the fork's `np.random.seed(seed)`, no draw before the partition) for the
Dirichlet proportions and leftovers, and Python's `random.Random(seed)` for the shuffles of index lists. Python's
stream only decides *which* samples a client gets, and equals the reference's only if the training set is in the same
order (torchvision's); the counts never depend on it."""
from __future__ import annotations

import math
import random
import warnings
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from pydantic import BaseModel, Field

from flare.errors import FlareError
from flare.registry import PARTITIONS, REFERENCE_PARTITIONS


@dataclass(frozen=True)
class PartitionFacts:
    """What a split is drawn from: the training labels, K clients, the seed, C (None: from the labels), and the
    partition section's keys any kind may read (the Dirichlet α, `shards`' classes per client)."""
    labels: np.ndarray
    num_clients: int
    seed: int
    num_classes: int | None = None
    alpha: float = 0.5
    shards_per_client: int = 2


class PartitionFn(Protocol):
    """What `PARTITIONS` (and `REFERENCE_PARTITIONS`, the reference code's draws) hold: the clients' sample indices,
    built by `create(kind, facts, partition.options)`, the options validated by the kind's options model."""
    def __call__(self, facts: PartitionFacts, options: BaseModel | None) -> Partition: ...


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
            q = row[row > 0] / max(row.sum(), 1)
            out.append(float(-(q * np.log2(q)).sum()) if len(q) else 0.0)
        return out

    def report(self) -> dict:
        hist = self.histogram()
        ent = self.entropies()
        clients = [{"client": i, "num_samples": int(hist[i].sum()), "class_histogram": hist[i].tolist(),
                    "label_entropy": ent[i],
                    "normalized_entropy": ent[i] / math.log2(self.num_classes) if self.num_classes > 1 else 0.0}
                   for i in range(len(self.client_indices))]
        return {"num_clients": len(self.client_indices), "num_classes": self.num_classes, "clients": clients}


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
        if leftover := n_c - int(counts.sum()):  # leftover < K because each floor loses less than one sample
            counts[rng.choice(num_clients, size=leftover, replace=False)] += 1
        for b, part in zip(buckets, np.split(idx, np.cumsum(counts)[:-1])):
            b.append(part)
    return _finish(buckets, labels, C, rng)


def _class_lists(labels: np.ndarray, C: int) -> list[list[int]]:
    """{class: ascending indices} as lists, the reference's `build_dataset_idxs`."""
    return [np.flatnonzero(labels == c).tolist() for c in range(C)]


def dirichlet_partition_legacy(labels: np.ndarray, num_clients: int, alpha: float, seed: int,
                               num_classes: int | None = None) -> Partition:
    """The card dealer drawn as the fork did (`387836b` on): per class, Python-shuffle the class, draw
    p ~ Dir(α) from the legacy RandomState, floor(p·N_c), then `choice(range(K), leftover, replace=False)` — which
    consumes a permutation of K even when nothing is left over — and deal consecutive slices; finally
    Python-shuffle every client's list."""
    C = int(num_classes or labels.max() + 1)
    npr, pyr = np.random.RandomState(seed), random.Random(seed)
    buckets: list[list[int]] = [[] for _ in range(num_clients)]
    for idx in _class_lists(labels, C):
        pyr.shuffle(idx)
        p = npr.dirichlet(np.repeat(alpha, num_clients))
        n = (p * len(idx)).astype(int)
        for c in npr.choice(range(num_clients), len(idx) - int(n.sum()), replace=False):
            n[c] += 1
        start = 0
        for i in range(num_clients):
            buckets[i] += idx[start:start + n[i]]
            start += n[i]
    for b in buckets:
        pyr.shuffle(b)
    return Partition([np.asarray(b, dtype=np.int64) for b in buckets], C, labels)


def dirichlet_fafi_partition(labels: np.ndarray, num_clients: int, alpha: float, seed: int,
                             num_classes: int | None = None, rng: str = "legacy") -> Partition:
    """The official FAFI partition (`dataset_helper.py::dirichlet`): for every class n, with N_0 the size of class 0,
    client u gets min(N_n, round(10·N_0·q_u)) samples, q ~ Dir(α·1_K), each client drawing from its own reshuffle of
    the class — so clients overlap (never within a client) and a client with q_u ≥ 0.1 gets the whole class. With
    rng="legacy" the draws follow the reference's order exactly; with "generator" the same algorithm draws from a
    numpy Generator and a Python Random seeded from it."""
    C = int(num_classes or labels.max() + 1)
    if rng == "legacy":
        dirichlet, pyr = np.random.RandomState(seed).dirichlet, random.Random(seed)
    else:
        g = np.random.default_rng(seed)
        dirichlet, pyr = g.dirichlet, random.Random(int(g.integers(2**31)))
    lists = _class_lists(labels, C)
    n0 = len(lists[0])
    buckets: list[list[int]] = [[] for _ in range(num_clients)]
    for idx in lists:
        pyr.shuffle(idx)
        s = 10 * n0 * dirichlet(np.array(num_clients * [alpha]))
        for u in range(num_clients):
            buckets[u] += idx[:min(len(idx), int(round(s[u])))]
            pyr.shuffle(idx)
    return Partition([np.asarray(b, dtype=np.int64) for b in buckets], C, labels)


def labeldir_partition(labels: np.ndarray, num_clients: int, alpha: float, seed: int,
                       num_classes: int | None = None, *, min_size: int = 10, rng: str = "legacy") -> Partition:
    """NIID-Bench's `noniid-labeldir` (`utils.py::partition_data`; FedLPA's code copies it, DENSE's `dirichlet`
    restates it): per class, shuffle the class, draw q ~ Dir(β·1_K), zero the share of every client that already holds
    N/K samples or more, renormalise, and cut the class at floor(cumsum(q)·N_c); redraw the whole split until every
    client has at least `min_size` samples; finally shuffle every client's list. rng="legacy": every draw from a
    RandomState seeded with the seed (the references' `np.random.seed(seed)` before `partition_data`), so the same
    seed gives their client index sets; "generator": the same algorithm drawing from a numpy Generator."""
    C = int(num_classes or labels.max() + 1)
    draw = np.random.RandomState(seed) if rng == "legacy" else np.random.default_rng(seed)
    N, K = len(labels), num_clients
    if K * min_size > N:
        raise FlareError(f"noniid-labeldir needs at least min_size={min_size} samples per client, but "
                         f"{N} samples cannot give {K} clients that many.", key="partition.options.min_size",
                         fix="lower partition.options.min_size or use fewer clients.")
    while True:  # the reference's `while min_size < min_require_size`, which always draws once
        batches: list[list[int]] = [[] for _ in range(K)]
        for c in range(C):
            idx = np.flatnonzero(labels == c)
            draw.shuffle(idx)
            q = draw.dirichlet(np.repeat(alpha, K))
            q = np.array([p * (len(b) < N / K) for p, b in zip(q, batches)])
            q = q / q.sum()
            cuts = (np.cumsum(q) * len(idx)).astype(int)[:-1]
            batches = [b + part.tolist() for b, part in zip(batches, np.split(idx, cuts))]
        if min(len(b) for b in batches) >= min_size:
            break
    for b in batches:
        draw.shuffle(b)
    return Partition([np.asarray(b, dtype=np.int64) for b in batches], C, labels)


def iid_partition(labels: np.ndarray, num_clients: int, seed: int, num_classes: int | None = None,
                  rng: str = "generator") -> Partition:
    """A random permutation cut in K (`array_split`); rng="legacy": the reference's `np.random.permutation(N)` from
    the legacy RandomState."""
    draw = np.random.RandomState(seed) if rng == "legacy" else np.random.default_rng(seed)
    perm = draw.permutation(len(labels))
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
    if unused := [c for c, h in holders.items() if not h]:
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


class LabeldirOptions(BaseModel):
    min_size: int = Field(10, ge=0, description="redraw the split until every client holds at least this many "
                                                "samples (NIID-Bench's min_require_size)")


PARTITIONS.register(
    "dirichlet", lambda f, _: dirichlet_partition(f.labels, f.num_clients, f.alpha, f.seed, f.num_classes),
    description="card dealer: every sample once, Dir(α) class shares")
PARTITIONS.register(
    "dirichlet-fafi", lambda f, _: dirichlet_fafi_partition(f.labels, f.num_clients, f.alpha, f.seed, f.num_classes,
                                                            rng="generator"),
    description="the official FAFI partition (overlapping)")
PARTITIONS.register(
    "noniid-labeldir", lambda f, o: labeldir_partition(f.labels, f.num_clients, f.alpha, f.seed, f.num_classes,
                                                       min_size=o.min_size, rng="generator"),
    options=LabeldirOptions, description="NIID-Bench's Dirichlet label split (FedLPA, DENSE): balanced, redrawn until "
                                         "every client has min_size samples")
PARTITIONS.register("iid", lambda f, _: iid_partition(f.labels, f.num_clients, f.seed, f.num_classes),
                    description="uniform random split")
PARTITIONS.register(
    "shards", lambda f, _: shards_partition(f.labels, f.num_clients, f.shards_per_client, f.seed, f.num_classes),
    description="partition.shards_per_client classes per client")


# The reference code's draws (partition.rng=legacy, the reference protocol's item g): the same kinds drawn from
# numpy's legacy RandomState and Python's random in the fork's order, which give the notes' exact class counts.
REFERENCE_PARTITIONS.register(
    "dirichlet", lambda f, _: dirichlet_partition_legacy(f.labels, f.num_clients, f.alpha, f.seed, f.num_classes),
    description="the fork's card dealer")
REFERENCE_PARTITIONS.register(
    "dirichlet-fafi", lambda f, _: dirichlet_fafi_partition(f.labels, f.num_clients, f.alpha, f.seed, f.num_classes,
                                                            rng="legacy"),
    description="the official FAFI partition in the reference's order")
REFERENCE_PARTITIONS.register(
    "noniid-labeldir", lambda f, o: labeldir_partition(f.labels, f.num_clients, f.alpha, f.seed, f.num_classes,
                                                       min_size=o.min_size, rng="legacy"),
    options=LabeldirOptions, description="NIID-Bench's split from the references' RandomState stream")
REFERENCE_PARTITIONS.register(
    "iid", lambda f, _: iid_partition(f.labels, f.num_clients, f.seed, f.num_classes, rng="legacy"),
    description="the reference's permutation split")
