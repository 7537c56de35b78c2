"""The protocol switch: `protocol: clean | reference`.

The notes' numbers came out of the reference code's *protocol* (how it evaluated, scaled inputs, trained the
baselines, measured progress, ...), not only out of its formulas. `protocol=reference` reproduces that protocol;
`clean` (the default) is ours. Every item is also a key of its own (`ITEMS`), so that an ablation can flip one;
the items, their two values and the evidence for each: docs/reproduction.md.

Layering. Before the schema validates a config, `fill_protocol` writes the reference value of every item key the
mapping (defaults ← preset ← file ← overrides) does *not* set, so an item set anywhere wins over the protocol
and `protocol=clean` (the schema's defaults) changes nothing. Some reference values depend on other keys, because
the reference code changed between the notes' two batches of runs and its partition tells which batch a setting
belongs to: `dirichlet-fafi` came with drop_last and the per-round progress reset, the card dealer without them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

PROTOCOLS = ("clean", "reference")
DIRICHLET_KINDS = ("dirichlet", "dirichlet-fafi")
_UNSET = object()


def _get(mapping: dict, key: str, default: Any) -> Any:
    """A dotted key's value in a raw (possibly partial) config mapping; sections may be dicts or pydantic models."""
    node: Any = mapping
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif hasattr(node, "model_fields_set") and part in node.model_fields_set:
            node = getattr(node, part)
        else:
            return default
    return node


def _reference_progress(m: dict) -> str:
    """λ/s(p) granularity of the reference code of the batch the setting belongs to.

    * learned λ (V10–V14, later batch only): V12/V14's logged s(p) is 1 − (r+1)/R, i.e. p = (e+1)/(R·E)
      (`epoch-end`); V11's logged a(p) is a(r/R), the progress at the start of the round (`epoch`);
    * dirichlet-fafi (first batch): p = (e − start)/E, reset every round (`round-reset`: λ constant when E = 1);
    * otherwise (later batch): p = e/(R·E) per epoch (`epoch`)."""
    learner = _get(m, "lam.learner", "none")
    if learner == "decoupled":
        return "epoch-end"
    if learner != "none":
        return "epoch"
    return "round-reset" if _get(m, "partition.kind", "dirichlet") == "dirichlet-fafi" else "epoch"


@dataclass(frozen=True)
class ProtocolItem:
    key: str                                  # the dotted config key
    clean: Any                                # the schema default
    reference: Any | Callable[[dict], Any]    # a value, or a function of the (raw) mapping
    item: str                                 # the item letter
    what: str                                 # what it changes, for reports and docs

    def reference_value(self, mapping: dict) -> Any:
        return self.reference(mapping) if callable(self.reference) else self.reference


ITEMS: tuple[ProtocolItem, ...] = (
    ProtocolItem("eval.bn", "running", "batch", "a",
                 "BatchNorm at evaluation: feature/IFFI fusion with per-batch statistics of shuffled test batches"),
    ProtocolItem("augment.input_scaling", "dataset", "reference", "b",
                 "input scaling: the reference's per-dataset transforms (CIFAR-10: train [-1,1], test [0,1])"),
    ProtocolItem("augment.per_image", True, False, "b",
                 "augmentation parameters drawn once per batch (torchvision on a batch tensor)"),
    ProtocolItem("loss.ce_input", "augmented", "plain", "c",
                 "FedAvg/Ensemble clients train one un-augmented view with CE"),
    ProtocolItem("server.strategies.output.ensemble", "softmax",
                 lambda m: "logits" if _get(m, "loss.objective", "fafi") == "ce" else "softmax", "c",
                 "the Ensemble of plain classifiers is a data-size-weighted sum of raw logits"),
    ProtocolItem("server.strategies.fedavg.buffers", "average", "first", "c",
                 "one-shot FedAvg averages parameters only and keeps client 0's BN buffers"),
    ProtocolItem("progress", "epoch", _reference_progress, "d",
                 "annealing progress: per-round reset (first batch), e/(R·E) (later batch), (e+1)/(R·E) (V12+)"),
    ProtocolItem("align.target_progress", "global", "round-reset", "d",
                 "V8's progressive target restarts every round (with E = 1 it stays at P⁰)"),
    ProtocolItem("server.protos_flow", "spec", "reference", "d",
                 "Plan B: G from the anchors, kept across rounds, clients align to G, prediction with the mean"),
    ProtocolItem("amp", "auto", "off", "e", "precision: fp32 (no bf16 autocast)"),
    ProtocolItem("drop_last", False, lambda m: _get(m, "partition.kind", "dirichlet") == "dirichlet-fafi", "f",
                 "clients drop their last incomplete batch (the official partition's loader)"),
    ProtocolItem("partition.rng", "generator",
                 lambda m: "legacy" if _get(m, "partition.kind", "dirichlet") in DIRICHLET_KINDS + ("iid",)
                 else "generator", "g",
                 "partition drawn with numpy's legacy global RNG in the fork's order (the notes' exact counts)"),
)

ITEM_KEYS = tuple(i.key for i in ITEMS)


def _set(mapping: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = mapping
    for p in parts[:-1]:
        sub = node.get(p)
        if sub is None:
            sub = {}
        elif hasattr(sub, "model_dump"):  # a section given as a model instance: keep what it set
            sub = sub.model_dump(exclude_unset=True)
        else:
            sub = dict(sub)
        node[p] = sub
        node = sub
    node[parts[-1]] = value


def fill_protocol(data: Any) -> Any:
    """The raw mapping with every unset item key filled from `protocol` (only `reference` fills anything: the
    clean values are the schema defaults). Anything but a mapping, or an unknown protocol, is passed through for
    the schema to report."""
    if not isinstance(data, dict) or data.get("protocol", "clean") != "reference":
        return data
    out = dict(data)
    for it in ITEMS:
        if _get(data, it.key, _UNSET) is _UNSET:
            _set(out, it.key, it.reference_value(data))
    return out


def protocol_values(mapping: dict, protocol: str) -> dict[str, Any]:
    """What each item would be under `protocol` for a (full) config mapping."""
    if protocol == "clean":
        return {it.key: it.clean for it in ITEMS}
    return {it.key: it.reference_value(mapping) for it in ITEMS}


def protocol_deviations(mapping: dict) -> dict[str, Any]:
    """The items a config sets away from its own protocol: {key: value}. A config written before the protocol
    switch existed (no `protocol`, no item keys) is clean with no deviations."""
    proto = mapping.get("protocol", "clean")
    want = protocol_values(mapping, proto if proto in PROTOCOLS else "clean")
    return {k: _get(mapping, k, v) for k, v in want.items() if _get(mapping, k, v) != v}


def protocol_label(mapping: dict) -> str:
    """`clean`, `reference`, or e.g. `reference, eval.bn=running` — the protocol a run directory's config.yaml
    says produced it (reports and summary.md print this)."""
    deviations = protocol_deviations(mapping).items()
    return mapping.get("protocol", "clean") + "".join(f", {k}={_fmt(v)}" for k, v in deviations)


def _fmt(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)
