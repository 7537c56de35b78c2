"""One batched test pass that scores every strategy's predictor (server/strategy.py): the K client models run once
per batch (server/fusion.py `client_outputs`), every `ClientPredictor` reads those tensors, and every
`ModelPredictor` scores the same normalised batch with its own model.

It is where a strategy's output is checked before anything is written from it: a predictor of one of the two kinds
whose scores are a finite batch × classes tensor. Anything else is a FlareError naming the strategy, its plugin
module, the round and what was wrong — never a traceback after all the training, nor a NaN written as an accuracy.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor

from flare.errors import FlareError, TrainingDiverged
from flare.registry import STRATEGIES
from flare.server.fusion import Ticker, client_outputs, snapshot_buffers
from flare.server.strategy import ClientPredictor, ModelPredictor, Predictor


def refuse(name: str, round_idx: int | None, what: str, numeric: bool = False) -> FlareError:
    """The error for a strategy whose output cannot be scored (`round_idx` 0-based, as in metrics.jsonl). A wrong
    kind or shape is its author's to fix; non-finite scores (`numeric`) of a built-in strategy come from the values
    it was given, so the fix names its options rather than advising a plugin's author."""
    entry = STRATEGIES.entry(name) if name in STRATEGIES else None
    origin = f" (plugin module '{entry.plugin}')" if entry is not None and entry.plugin else ""
    when = f" in round {round_idx + 1}" if round_idx is not None else ""
    key = f"server.strategies.{name}"
    if numeric and entry is not None and not entry.plugin:
        fix = (f"check the values of {key} (`flare parts` lists its options; a step size or regulariser that "
               "overflows shows up here) and the clients' own accuracies in metrics.jsonl.")
    else:
        fix = ("make its predictor() return a ClientPredictor or ModelPredictor (flare.server.strategy) whose "
               "scores(...) are a finite batch × classes tensor (docs/extending.md).")
    return FlareError(f"server strategy '{name}'{origin}{when}: {what}; no accuracy is written for it.", key=key,
                      fix=fix)


def check_predictor(name: str, p: object, round_idx: int | None = None) -> None:
    if not isinstance(p, (ClientPredictor, ModelPredictor)):
        raise refuse(name, round_idx, f"predictor() returned {type(p).__name__}, which is not a ClientPredictor "
                                      "or ModelPredictor")


def _check_scores(name: str, scores: object, batch: int, classes: int, round_idx: int | None) -> None:
    if not isinstance(scores, Tensor):
        raise refuse(name, round_idx, f"its predictor's scores are a {type(scores).__name__}, not a tensor")
    if tuple(scores.shape) != (batch, classes):
        raise refuse(name, round_idx, f"its predictor's scores have shape {tuple(scores.shape)} for a batch of "
                                      f"{batch} images of {classes} classes (want {batch} × {classes})")


@torch.no_grad()
def evaluate_predictors(models: list[torch.nn.Module], predictors: dict[str, Predictor], test_x: Tensor,
                        test_y: Tensor, normalize, *, batch_size: int = 256, noise_seed: int = 0,
                        amp_dtype: torch.dtype | None = None, channels_last: bool = False, bn: str = "running",
                        shuffle_seed: int = 0, round_idx: int | None = None) -> dict:
    """`acc_<name>` of every predictor plus `client_acc`, each client model alone (its own head), and on CPU
    `seconds_eval_parts`: the seconds of the shared passes (`clients`, `noise`, `batch_bn`: `client_outputs`) and
    each predictor's own. Off CPU it is left out: timing a device's asynchronous kernels would sync every batch.

    The IFFI noise is drawn from its own generator seeded with `noise_seed`, the same for every round and method.
    `bn="batch"`: the test order is the permutation seeded by `shuffle_seed`. The predictors' kinds were checked by
    the caller (`check_predictor`); `round_idx` names the round in the error of one whose output is refused."""
    device = test_x.device
    for m in models:
        m.eval()
    on_clients = [p for p in predictors.values() if isinstance(p, ClientPredictor)]
    need_noise = any(p.needs_noise for p in on_clients)
    gen = torch.Generator(device=device).manual_seed(noise_seed) if need_noise else None
    amp = (torch.autocast(device_type=device.type, dtype=amp_dtype) if amp_dtype is not None else nullcontext())
    batch_bn = bn == "batch" and any(p.batch_bn for p in on_clients)
    order = (torch.randperm(test_x.shape[0], generator=torch.Generator().manual_seed(shuffle_seed)).to(device)
             if batch_bn else None)
    saved = snapshot_buffers(models) if batch_bn else None
    correct = {name: 0 for name in predictors}
    nonfinite = {name: torch.zeros((), dtype=torch.long, device=device) for name in predictors}
    client_correct = torch.zeros(len(models), dtype=torch.long, device=device)
    client_bad = torch.zeros((), dtype=torch.long, device=device)
    clock = {} if device.type == "cpu" else None
    n = 0
    for s in range(0, test_x.shape[0], batch_size):
        ix = order[s:s + batch_size] if order is not None else slice(s, s + batch_size)
        x = normalize(test_x[ix])
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        y = test_y[ix]
        out = client_outputs(models, x, noise=gen, batch_bn=saved, amp=amp, channels_last=channels_last, clock=clock)
        client_correct += (out.logits.argmax(-1) == y).sum(1)
        client_bad += (~torch.isfinite(out.logits)).sum()
        tick = Ticker(clock)
        for name, p in predictors.items():
            if isinstance(p, ClientPredictor):
                scores = p.scores(out)
            else:
                with amp:
                    scores = p.scores(x)
            _check_scores(name, scores, y.numel(), out.logits.shape[-1], round_idx)
            nonfinite[name] += (~torch.isfinite(scores)).sum()  # read once at the end: no sync per batch
            correct[name] += (scores.argmax(1) == y).sum()
            tick(name)
        n += y.numel()
    if int(client_bad):  # the clients' own weights diverged: no strategy is at fault, the training settings are
        raise TrainingDiverged(f"the client models output {int(client_bad)} non-finite logits on the test set"
                               f"{f' after round {round_idx + 1}' if round_idx is not None else ''}: their weights "
                               "diverged in training though no loss term did.", key="lr",
                               fix="lower lr, keep optim.grad_clip on, or check the λ settings of this method.")
    for name, c in nonfinite.items():
        if int(c):
            raise refuse(name, round_idx, f"its predictor's scores hold {int(c)} non-finite values (NaN or ±inf) "
                                          f"over the {n} test images", numeric=True)
    res = {f"acc_{name}": float(c) / n for name, c in correct.items()}
    res["client_acc"] = (client_correct.float() / n).tolist()
    if clock is not None:
        res["seconds_eval_parts"] = {k: round(v, 4) for k, v in clock.items()}
    return res
