"""FedLPA's server as its reference code builds it: a plugin strategy, `fedlpa_reference`, for the FedLPA table's
diagnostic (docs/papers.md, "FedLPA at β = 0.1").

FLARE's `fedlpa` departs from lebronlambert/FedLPA_NeurIPS2024 in how it builds the clients' Kronecker factors and
damps them (docs/baselines.md). To measure what those departures move, this strategy builds the factors as the
reference does and leaves the solve to FLARE's (same system, same closed form, same refinement):

* over the client's **whole training set** (the reference's one pass of its train loader, `experiments_our.py`
  `local_train_net_blockoffline`), not `batches × batch_size` samples;
* at the reference's **scale**: its K-FAC hooks (`kfac_utils.py` ComputeCovA / ComputeCovG, `batch_averaged=True`)
  divide a conv layer's A by the layer's output positions H·W and multiply its G by them; linear layers agree;
* damped by the reference's **absolute** √(1 − coor)·I on every client's A and G (`--coor=0.999` in
  `scripts/experiments.sh`: 0.0316), where FLARE's `fedlpa` adds a λ relative to the factors' mean diagonal.

Those three change where the damping bites: at the reference's scale 0.0316·I outweighs a conv layer's A by orders
of magnitude and is small beside its G, which a relative λ never does. The solve: `refine_steps: 0` is the
reference's closed form ("biased"); the default 50 conjugate-gradient steps reach the exact system's solution,
which the reference's "newton" (10,000 gradient steps on a mean-squared residual, from the closed form) approaches.
The reference prints the better of its two on the test set; fuse both and take the larger for that rule.

Use it with `flare fuse RUN --plugin flare_fedlpa_reference --strategies fedlpa_reference`, this directory on
PYTHONPATH. It is a plugin rather than an option of `fedlpa` because it exists to reproduce one reference's
arithmetic for one diagnostic, through the interfaces any plugin has.
"""
from __future__ import annotations

import math

import torch
from pydantic import Field
from torch import nn

from flare.baselines.fedlpa import FedLPA, FedLPAOptions
from flare.registry import STRATEGIES


class ReferenceOptions(FedLPAOptions):
    batches: int = Field(1_000_000, ge=1, description="batches of the client's samples: by default all of them "
                                                      "(the reference's one pass over its training set)")
    damping: float = Field(0.0, ge=0, description="FLARE's relative damping on top of the reference's: off")
    coor: float = Field(0.999, ge=0, lt=1, description="the reference's --coor: √(1 − coor)·I added to every "
                                                       "client's A and G")


def conv_positions(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Each Conv2d's output positions H·W for inputs shaped like x (one forward pass of x's first image)."""
    out, handles = {}, []
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d):
            handles.append(m.register_forward_hook(
                lambda mod, args, y, name=name: out.__setitem__(name, int(y.shape[-2] * y.shape[-1]))))
    try:
        with torch.no_grad():
            model(x[:1])
    finally:
        for h in handles:
            h.remove()
    return out


@STRATEGIES.register("fedlpa_reference", options=ReferenceOptions)
class FedLPAReference(FedLPA):
    """FedLPA over factors built, scaled and damped as lebronlambert/FedLPA_NeurIPS2024 builds them."""

    _name = "fedlpa_reference"

    def client_extras(self, data) -> dict[str, torch.Tensor]:
        out = super().client_extras(data)
        hw = conv_positions(data.model, data.normalize(data.x[:1]).float())
        c = math.sqrt(1.0 - self.options.coor)
        for L in self._layers(data.model):
            s = hw.get(L.name, 1)
            for key, scale in ((f"{L.name}.A", 1.0 / s), (f"{L.name}.G", float(s))):
                f = out[key] * scale
                out[key] = f + c * torch.eye(f.shape[-1], dtype=f.dtype)
        return out
