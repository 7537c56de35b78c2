"""What a client sends the server, once: its model weights, its prototypes, its sample count, and the statistics
the run's server strategies asked for (`extras`, server/extras.py); and `validate_upload`, the server's gate, which
the round loop runs on every upload whatever the engine (flare/loop.py, `gate_uploads`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]  # name → (shape, dtype) of the tensors a gate expects
UPLOADS = "uploads.pt"  # in a run directory: the uploads the server scored last (`save_uploads`)


@dataclass
class Upload:
    client: int
    state: dict[str, Tensor]      # encoder (+ head) state dict, BatchNorm statistics included
    num_samples: int
    prototypes: Tensor | None     # C×d for prototype heads, None for plain classifiers
    extras: dict[str, Tensor] = field(default_factory=dict)  # statistics strategies asked for (server/extras.py)


def upload_of(client: int, model: torch.nn.Module, num_samples: int, extras: dict[str, Tensor] | None = None,
              state: dict[str, Tensor] | None = None) -> Upload:
    """The one way an `Upload` is made, so that every engine hands the server the same thing. `model` holds the
    weights, or, with `state` (weights as they arrived, unchecked), only tells where the prototypes are."""
    protos = getattr(model, "prototypes", None)
    if state is None:
        state, P = model.state_dict(), (protos.detach() if protos is not None else None)
    else:
        key = next((k for k, p in model.named_parameters() if p is protos), None) if protos is not None else None
        P = state.get(key) if key is not None else None
    return Upload(client=client, state=state, num_samples=num_samples, prototypes=P, extras=extras or {})


def save_uploads(out, r: int, uploads: list[Upload], server_state: dict) -> None:
    """The uploads the server scored at round r, and the state it scored them with, as uploads.pt in the run
    directory `out` (replaced at each evaluated round): `flare fuse` scores exactly what the server received."""
    out.save_torch(UPLOADS, {"round": r, "server": server_state, "uploads": [dict(vars(u)) for u in uploads]})


def load_uploads(path, device) -> tuple[int, dict, list[Upload]]:
    """(the round, the server's state, the uploads) `save_uploads` wrote; raises what torch.load raises."""
    saved = torch.load(path, map_location=device, weights_only=True)
    return int(saved["round"]), saved["server"], [Upload(**u) for u in saved["uploads"]]


@dataclass(frozen=True)
class UploadSpec:
    """What a well-formed upload looks like for one run (`from_model`: the shapes of an architecture's init)."""

    shapes: Shapes
    num_classes: int
    feature_dim: int
    prototype_head: bool
    extras: Shapes = field(default_factory=dict)  # what the strategies' client statistics must be (server/extras.py)

    @classmethod
    def from_model(cls, model: torch.nn.Module, num_classes: int) -> "UploadSpec":
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
        return cls(shapes, int(num_classes), int(model.feature_dim), getattr(model, "prototypes", None) is not None)


def check_tensors(what: str, got, shapes: Shapes, *, max_listed: int = 5) -> list[str]:
    """Every reason `got` is not exactly the tensors `shapes` describes: missing or unexpected names, a wrong shape
    or dtype, non-finite floating values, negative integer counters."""
    reasons: list[str] = []
    if not isinstance(got, dict):
        return [f"{what} is a {type(got).__name__}, not a mapping of tensors"]
    missing, extra = [k for k in shapes if k not in got], [k for k in got if k not in shapes]
    for names, how in ((missing, "is missing {} tensor(s)"), (extra, "has {} unexpected tensor(s)")):
        if names:
            reasons.append(f"{what} {how.format(len(names))}: {', '.join(map(str, names[:max_listed]))}"
                           + (" …" if len(names) > max_listed else ""))
    for k, (shape, dtype) in shapes.items():
        t = got.get(k)
        if t is None:
            continue
        if not isinstance(t, Tensor):
            reasons.append(f"'{k}' is a {type(t).__name__}, not a tensor")
            continue
        if tuple(int(s) for s in t.shape) != tuple(shape):
            reasons.append(f"'{k}' has shape {list(t.shape)}, expected {list(shape)}")
        if t.dtype != dtype:
            reasons.append(f"'{k}' has dtype {t.dtype}, expected {dtype}")
            continue
        if t.is_floating_point():  # a finite sum proves every value finite in one pass (25x cheaper on 340 MB of
            # statistics than isfinite); only a sum that is not (a bad value, or an overflow) pays for the exact count
            if not torch.isfinite(t.sum()) and (bad := int((~torch.isfinite(t)).sum())):
                reasons.append(f"'{k}' holds {bad} non-finite value(s)")
        elif t.numel() and t.dtype != torch.bool and int(t.min()) < 0:
            reasons.append(f"'{k}' (a counter) is negative")
    return reasons


def validate_upload(upload: Upload, spec: UploadSpec) -> list[str]:
    """Every reason to reject `upload` (an empty list: accept): its sample count (the client id is the loop's,
    `why_rejected`), its state and extras (`check_tensors`), and its prototypes, a finite C×d matrix of the run's
    class count C, present exactly when the head has prototypes."""
    reasons: list[str] = []
    n = upload.num_samples
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        reasons.append(f"sample count {n!r} is not a positive integer")

    reasons += check_tensors("state", upload.state, spec.shapes)
    if spec.extras or upload.extras:
        reasons += check_tensors("extras", upload.extras, spec.extras)

    P, C, d = upload.prototypes, spec.num_classes, spec.feature_dim
    if spec.prototype_head != (P is not None):
        reasons.append("no prototypes, but the run's head has prototypes" if spec.prototype_head
                       else "prototypes were sent, but the run's head has none")
    elif P is not None and not isinstance(P, Tensor):
        reasons.append(f"prototypes are a {type(P).__name__}, not a tensor")
    elif P is not None:
        if P.dim() != 2:
            reasons.append(f"prototypes have shape {list(P.shape)}, expected a {C}×{d} matrix")
        else:
            if P.shape[0] != C:
                reasons.append(f"prototypes have {P.shape[0]} classes, the run has {C}")
            if P.shape[1] != d:
                reasons.append(f"prototypes have dimension {P.shape[1]}, the encoder's is {d}")
        if not P.is_floating_point():
            reasons.append(f"prototypes have dtype {P.dtype}, expected a floating dtype")
        elif not bool(torch.isfinite(P).all()):
            reasons.append("prototypes hold non-finite values")
    return reasons
