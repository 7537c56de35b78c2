"""One batched test pass that scores every strategy's predictor (server/strategy.py): the K client models run once
per batch (and once on IFFI's noise input when a predictor asks), every `ClientPredictor` reads those tensors, and
every `ModelPredictor` scores the same normalised batch with its own model. eval.bn: see server/fusion.py.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor

from flare.server.fusion import batch_statistics, snapshot_buffers
from flare.server.strategy import ClientOutputs, ClientPredictor, Predictor, rule_predictor


@torch.no_grad()
def evaluate_predictors(models: list[torch.nn.Module], predictors: dict[str, Predictor], test_x: Tensor,
                        test_y: Tensor, normalize, *, batch_size: int = 256, noise_seed: int = 0,
                        amp_dtype: torch.dtype | None = None, channels_last: bool = False, bn: str = "running",
                        shuffle_seed: int = 0) -> dict:
    """`acc_<name>` of every predictor plus `client_acc`, each client model alone (its own head).

    `normalize` maps a uint8 batch to the model's input. The IFFI noise ε ~ N(0, I) has the input's shape and is
    drawn from its own seeded generator, the same for every round and method. `bn="batch"`: the predictors that
    read features (`batch_bn`) get a train-mode pass, and the test order is the permutation seeded by
    `shuffle_seed`."""
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
    client_correct = torch.zeros(len(models), dtype=torch.long, device=device)
    n = 0
    for s in range(0, test_x.shape[0], batch_size):
        ix = order[s:s + batch_size] if order is not None else slice(s, s + batch_size)
        x = normalize(test_x[ix])
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        y = test_y[ix]
        with amp:
            outs = [m(x) for m in models]
        feats = torch.stack([o[0].float() for o in outs])   # K×B×d
        logits = torch.stack([o[1].float() for o in outs])  # K×B×C
        client_correct += (logits.argmax(-1) == y).sum(1)
        noise_feats = None
        eps = None
        if need_noise:
            eps = torch.randn(x.shape, generator=gen, device=device, dtype=x.dtype)
            if channels_last:
                eps = eps.contiguous(memory_format=torch.channels_last)
            if not batch_bn:
                with amp:
                    noise_feats = torch.stack([m(eps)[0].float() for m in models])
        if batch_bn:  # the reference's train-mode BN: the clean batch and the noise batch, each on its own
            with batch_statistics(models, saved), amp:
                feats = torch.stack([m(x)[0].float() for m in models])
                if eps is not None:
                    noise_feats = torch.stack([m(eps)[0].float() for m in models])
        out = ClientOutputs(feats, logits, noise_feats)
        for name, p in predictors.items():
            if isinstance(p, ClientPredictor):
                scores = p.scores(out)
            else:
                with amp:
                    scores = p.scores(x)
            correct[name] += (scores.argmax(1) == y).sum()
        n += y.numel()
    res = {f"acc_{name}": float(c) / n for name, c in correct.items()}
    res["client_acc"] = (client_correct.float() / n).tolist()
    return res


def evaluate(models: list[torch.nn.Module], weights: Tensor, G: Tensor | None, test_x: Tensor, test_y: Tensor,
             normalize, *, rules: tuple[str, ...], ensemble: str = "softmax", fedavg_buffers: str = "average",
             **kw) -> dict:
    """The built-in rules by name (`evaluate_predictors`' keywords pass through): for tests and scripts."""
    preds = {r: rule_predictor(r, models, weights, G, ensemble, fedavg_buffers) for r in rules}
    return evaluate_predictors(models, preds, test_x, test_y, normalize, **kw)
