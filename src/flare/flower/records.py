"""Pickle-free conversion between FLARE's objects and Flower's records.

Tensors travel as `flwr.app.ArrayRecord` entries, which Flower serialises with `numpy.save(...,
allow_pickle=False)` and reads back with `numpy.load(..., allow_pickle=False)`; everything else travels
as JSON text or plain scalars in a `ConfigRecord`. Nothing here (or anywhere in the Flower apps) calls
`pickle` or `torch.load` without `weights_only=True` on bytes a peer sent.

`pack_nested` / `unpack_nested` carry a nested structure of dicts, lists, tuples, tensors and JSON
scalars (a client's optimizer / λ-learner state between rounds) as one ArrayRecord of its tensors plus
a JSON skeleton; dict keys keep their type (optimizer states are keyed by int).
"""
from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from torch import Tensor


def state_to_record(state: dict[str, Tensor]) -> ArrayRecord:
    rec = ArrayRecord()
    for k, v in state.items():
        arr = v.detach().cpu().numpy()
        # np.ascontiguousarray would turn a 0-d tensor (BatchNorm's num_batches_tracked) into shape (1,)
        rec[str(k)] = Array.from_numpy_ndarray(arr if arr.flags.c_contiguous else arr.copy(order="C"))
    return rec


def record_to_state(rec: ArrayRecord) -> "OrderedDict[str, Tensor]":
    """Decode every array; raises ValueError/TypeError on anything that is not a plain numeric array."""
    out: OrderedDict[str, Tensor] = OrderedDict()
    for k in rec.keys():
        arr = rec[k].numpy()  # numpy.load(allow_pickle=False): object arrays raise here
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"array '{k}' has dtype {arr.dtype}, not a numeric dtype")
        out[k] = torch.from_numpy(np.array(arr, copy=True))
    return out


# ----------------------------------------------------------------------------------------------
# nested structures (client state between rounds)


def pack_nested(obj) -> tuple[ArrayRecord, str]:
    tensors: dict[str, Tensor] = {}

    def enc(o):
        if isinstance(o, Tensor):
            key = f"t{len(tensors)}"
            tensors[key] = o
            return {"__tensor__": key}
        if isinstance(o, dict):
            return {"__dict__": [[enc_key(k), enc(v)] for k, v in o.items()]}
        if isinstance(o, tuple):
            return {"__tuple__": [enc(v) for v in o]}
        if isinstance(o, list):
            return [enc(v) for v in o]
        if o is None or isinstance(o, (bool, int, float, str)):
            return o
        if isinstance(o, (np.integer, np.floating)):
            return o.item()
        raise TypeError(f"cannot carry a {type(o).__name__} between rounds")

    def enc_key(k):
        if isinstance(k, (bool, int, str)) or k is None:
            return {"k": k}
        raise TypeError(f"cannot carry a dict key of type {type(k).__name__}")

    skeleton = json.dumps(enc(obj))
    return state_to_record(tensors), skeleton


def unpack_nested(rec: ArrayRecord, skeleton: str, device: torch.device | str = "cpu"):
    tensors = record_to_state(rec)

    def dec(o):
        if isinstance(o, dict):
            if "__tensor__" in o:
                return tensors[o["__tensor__"]].to(device)
            if "__dict__" in o:
                return {k["k"]: dec(v) for k, v in o["__dict__"]}
            if "__tuple__" in o:
                return tuple(dec(v) for v in o["__tuple__"])
            raise ValueError(f"malformed skeleton entry {o!r}")
        return [dec(v) for v in o] if isinstance(o, list) else o

    return dec(json.loads(skeleton))
