"""Pickle-free conversion between FLARE's objects and Flower's records (nothing unpickles bytes a peer sent): tensors
travel as `flwr.app.ArrayRecord` entries (numpy, allow_pickle=False), everything else as JSON text or scalars.
`pack_nested` carries a client's state between rounds as one ArrayRecord of its tensors plus a JSON skeleton, torch's
pytree spec, so dict keys keep their type (optimizer states are keyed by int).
"""
from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps, treespec_loads


def state_to_record(state: dict[str, Tensor]) -> ArrayRecord:
    """Flower's own conversion of a state dict, from contiguous tensors: every array travels in C order (a transposed
    one would otherwise arrive in Fortran order, with other strides)."""
    return ArrayRecord({str(k): v.contiguous() for k, v in state.items()})


def record_to_state(rec: ArrayRecord) -> "OrderedDict[str, Tensor]":
    """Decode every array; raises ValueError/TypeError on anything that is not a plain numeric array (not Flower's
    `to_torch_state_dict`, which would take a complex array and refuse a string one in torch's words)."""
    out: OrderedDict[str, Tensor] = OrderedDict()
    for k in rec.keys():
        arr = rec[k].numpy()  # numpy.load(allow_pickle=False): object arrays raise here
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"array '{k}' has dtype {arr.dtype}, not a numeric dtype")
        out[k] = torch.from_numpy(np.array(arr, copy=True))
    return out


# ----------------------------------------------------------------------------------------------
# nested structures (client state between rounds)


def _scalar(o):
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    raise TypeError(f"cannot carry a {type(o).__name__} between rounds")


def pack_nested(obj) -> tuple[ArrayRecord, str]:
    """`obj` as an ArrayRecord of its tensors plus a JSON skeleton: torch's pytree spec and the other leaves."""
    leaves, spec = tree_flatten(obj)
    tensors = {str(i): v for i, v in enumerate(leaves) if isinstance(v, Tensor)}
    others = [None if isinstance(v, Tensor) else v for v in leaves]
    return state_to_record(tensors), json.dumps([treespec_dumps(spec), others], default=_scalar)


def unpack_nested(rec: ArrayRecord, skeleton: str, device: torch.device | str = "cpu"):
    tensors = record_to_state(rec)
    spec, others = json.loads(skeleton)
    leaves = [tensors[str(i)].to(device) if str(i) in tensors else v for i, v in enumerate(others)]
    return tree_unflatten(leaves, treespec_loads(spec))
