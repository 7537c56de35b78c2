"""Random streams: seeds derived per (run, round, client, purpose), private streams for code that can only
draw from torch's default generators (kornia), and the global generators' state for checkpoints.

Every client-round draws from its own seeded streams, so sequential, concurrent and resumed training see
the same random numbers.
"""
from __future__ import annotations

import random
import threading
from contextlib import contextmanager

import numpy as np
import torch

# Guards torch's default generators while a client has swapped its augmentation streams into them.
_GLOBAL_RNG_LOCK = threading.Lock()


def augmentation_generators(device: torch.device) -> list[torch.Generator]:
    """The default generators the augmentation may draw from for images on `device`.

    kornia takes no generator argument. Where it draws depends on its version: kornia ≥ 0.8 moves its
    samplers to the module's device with `.to(device)` (0.9 on a GPU draws from the CUDA generator), older
    versions and a few samplers draw on the CPU. A client therefore owns a state for the CPU generator and,
    on a GPU, one for that GPU's generator too.
    """
    gens = [torch.default_generator]
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        gens.append(torch.cuda.default_generators[index])
    return gens


class RngStreams:
    """Private random streams for code that can only draw from torch's default generators (kornia).

    `with streams.active():` swaps this object's states into `generators`, runs the block, keeps the
    advanced states and puts back whatever was there. A lock makes the swap atomic across threads, so
    clients training concurrently each see exactly the draws they would see alone. A CUDA generator's state
    is its host-side seed and offset: reading or setting it does not wait for the GPU, and kernels already
    launched keep the offsets they were launched with.
    """

    def __init__(self, generators: list[torch.Generator], seeds: list[int]):
        if len(generators) != len(seeds):
            raise ValueError(f"{len(generators)} generators but {len(seeds)} seeds")
        self.generators = generators
        self.states = [torch.Generator(device=g.device).manual_seed(s).get_state() for g, s in zip(generators, seeds)]

    @contextmanager
    def active(self):
        with _GLOBAL_RNG_LOCK:
            outer = [g.get_state() for g in self.generators]
            for g, st in zip(self.generators, self.states):
                g.set_state(st)
            try:
                yield
            finally:
                self.states = [g.get_state() for g in self.generators]
                for g, st in zip(self.generators, outer):
                    g.set_state(st)


def derived_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from (run seed, round, client, …)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, dtype=np.uint64)[0] >> 1)


def global_rng_state() -> dict:
    """The global RNG states, as tensors and plain numbers (torch.load(weights_only=True) reads them).
    Every client-round reseeds its own streams (`derived_seed`), so these only matter to code that draws
    from the global generators outside those streams; restoring them keeps such code resumable too."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    py = random.getstate()
    st = {"torch": torch.get_rng_state(),
          "numpy": {"kind": kind, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
          "python": {"version": py[0], "state": list(py[1]), "gauss": py[2]}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_global_rng_state(st: dict | None) -> None:
    if not st:
        return
    torch.set_rng_state(st["torch"].cpu())
    n = st["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = st["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in st and torch.cuda.is_available() and len(st["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in st["cuda"]])
