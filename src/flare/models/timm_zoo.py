"""`model.name=timm/<name>`: any architecture timm knows, as a FLARE encoder (docs/models.md#timm): its pooled
features under FLARE's head. timm is an optional extra (`pip install 'flare-ofl[zoo]'`), imported on the first `timm/`
lookup, so the core runs without it. Nothing is ever downloaded: weights come from `model.checkpoint` only. With
`stem: small` (the default) the ImageNet stem keeps a small input's resolution (`small_stem`)."""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from ..errors import FlareError
from ..registry import MODELS, Entry

PREFIX = "timm/"
INSTALL = "pip install 'flare-ofl[zoo]' (or pip install timm)"
# create_model's own arguments, which FLARE sets: an option may not override them.
RESERVED = ("pretrained", "num_classes", "in_chans", "pretrained_cfg", "pretrained_cfg_overlay", "checkpoint_path",
            "cache_dir")


class TimmOptions(BaseModel):
    """`model.options` of a timm model: `stem`, plus any keyword of the family's constructor (drop_rate,
    drop_path_rate, img_size, patch_size, ...), passed to `timm.create_model` as they are."""

    model_config = ConfigDict(extra="allow")
    stem: Literal["small", "timm"] = Field("small", description="small: the stem keeps a 32×32/28×28 input's "
                                                                "resolution (docs/models.md#timm); timm: as built")


def _timm():
    try:
        import timm  # lazy: the optional zoo extra, imported on the first timm/ name
    except ImportError as e:
        raise FlareError(f"timm/ model names need timm, which is not installed ({e}).", key="model.name",
                         fix=f"{INSTALL}, or pick a built-in model (`flare models`).") from None
    return timm


@lru_cache(maxsize=1)
def _names() -> tuple[str, ...]:
    return tuple(_timm().list_models())


def timm_names() -> list[str]:
    """Every architecture name timm has (`timm.list_models()`), without the `timm/` prefix."""
    return list(_names())


def small_stem(model: nn.Module) -> nn.Module:
    """The small-input stem rule (module docstring), in place: the stem's strided convolutions (patchify ones
    excepted) get stride 1 and its max-pools become Identity. Returns the model."""
    modules = list(model.named_modules())
    stages = [f["module"] for f in getattr(model, "feature_info", None) or [] if f.get("reduction", 0) >= 4]
    names = [n for n, _ in modules]
    if stages and stages[0] in names:
        stem = modules[:names.index(stages[0])]
    else:
        first_conv = (getattr(model, "pretrained_cfg", None) or {}).get("first_conv")
        stem = [(n, m) for n, m in modules if n == first_conv]
    for name, m in stem:
        if isinstance(m, nn.Conv2d) and max(m.stride) > 1 and tuple(m.kernel_size) != tuple(m.stride):
            m.stride = (1, 1)
        elif isinstance(m, nn.MaxPool2d):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, nn.Identity())
    return model


def _builder(name: str):
    def build(facts, options: TimmOptions) -> nn.Module:  # facts: a models.ModelFacts
        in_channels, width = facts.in_channels, facts.width
        if width != 1:
            raise FlareError(f"timm/{name} has the width its name gives; model.width={width:g} cannot scale it.",
                             key="model.width", fix="set model.width=1 and pick a narrower variant (e.g. "
                                                    "timm/mobilenetv3_small_050), or pass the family's own width "
                                                    "argument in model.options.")
        kwargs: dict[str, Any] = {k: v for k, v in options.model_dump().items() if k != "stem"}
        if bad := [k for k in kwargs if k in RESERVED]:
            raise FlareError(f"model.options.{bad[0]} is set by FLARE for a timm model.", key=f"model.options.{bad[0]}",
                             fix="remove it (weights come from model.checkpoint; classes and channels from the "
                                 "dataset).")
        try:
            model = _timm().create_model(name, pretrained=False, num_classes=0, in_chans=int(in_channels), **kwargs)
        except (TypeError, ValueError, AssertionError) as e:
            raise FlareError(f"timm could not build {name} with options {kwargs}: {type(e).__name__}: {e}.",
                             key="model.options", fix="pass only keywords the family's constructor takes "
                                                      "(see timm's model source), or none.") from None
        if options.stem == "small":
            small_stem(model)
        # the pooled feature size: head_hidden_size where a pre-logits layer follows the pooling (MobileNetV3)
        model.feature_dim = int(getattr(model, "head_hidden_size", None) or model.num_features)
        return model

    return build


MODELS.add_namespace(PREFIX, names=timm_names,
                     entry=lambda name: Entry(PREFIX + name, _builder(name), TimmOptions,
                                              f"timm's {name} (pooled features, pretrained=False)"),
                     description="any name timm.list_models() gives, with a small-input stem; the zoo extra")
