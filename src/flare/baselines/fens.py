"""FENS (Allouah et al., "Revisiting Ensembling in One-Shot Federated Learning", NeurIPS 2024), a server strategy
that talks back: `fens`. After the upload the server sends every client model to every client, which computes the
frozen models' logits on its own samples; then federated rounds train a small aggregator over those logits with
FedAdam, and it is the predictor. The reference's lines (sacs-epfl/fens) and the departure: docs/baselines.md, `fens`.
Its rounds and bytes each way are in the round record (`fens.rounds`, `fens.bytes_down`, `fens.bytes_up`).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from flare.baselines.kd import generator, private_stream
from flare.registry import STRATEGIES
from flare.rng import derived_seed
from flare.server.strategy import ClientOutputs, ClientPredictor, ServerContext, Strategy

TAG = 2401  # this strategy's seed stream
MODEL = "model{}/"  # the prefix of client k's weights in round 0's message


class FENSOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rounds: int = Field(500, ge=1, description="federated rounds that train the aggregator (--rounds 500)")
    hidden: int = Field(2, ge=1, description="aggregator width per client, d (--d 2)")
    client_lr: float = Field(1.0, gt=0, description="the clients' SGD learning rate (--lr 1)")
    local_steps: int = Field(1, ge=1, description="SGD steps per client and round (--lowE/--highE 1)")
    batch_size: int = Field(128, ge=1, description="samples per local step (--bs 128)")
    server_lr: float = Field(1e-3, gt=0, description="FedAdam's η (--slr 0.001)")
    beta1: float = Field(0.9, ge=0, lt=1, description="FedAdam's β1 (--gmf 0.9)")
    beta2: float = Field(0.99, ge=0, lt=1, description="FedAdam's β2")
    eps: float = Field(1e-3, gt=0, description="FedAdam's ε, added to √v")


def aggregator(clients: int, classes: int, hidden: int) -> nn.Sequential:
    """FENS's SmallNN over the K clients' concatenated logits."""
    return nn.Sequential(nn.Linear(clients * classes, clients * hidden), nn.ReLU(),
                         nn.Linear(clients * hidden, classes))


def fedadam_step(x: dict[str, Tensor], delta: dict[str, Tensor], moments: dict, lr: float, beta1: float,
                 beta2: float, eps: float) -> dict[str, Tensor]:
    """One FedAdam server step from the weighted client delta Δ: the new x; `moments` ("m", "v": name → tensor,
    empty before the first round) updated in place."""
    m, v = moments.setdefault("m", {}), moments.setdefault("v", {})
    out = {}
    for k, d in delta.items():
        if k not in m:
            m[k], v[k] = (1 - beta1) * d, (1 - beta2) * (d * d)
        else:
            m[k] = beta1 * m[k] + (1 - beta1) * d
            v[k] = beta2 * v[k] + (1 - beta2) * (d * d)
        out[k] = x[k] + lr * m[k] / (v[k].sqrt() + eps)
    return out


def local_batches(n: int, size: int, steps: int, gen: torch.Generator):
    """`steps` index batches over n samples as the reference's loop draws them: consecutive batches of a shuffled
    pass, a new shuffle when a pass ends (the last batch of a pass may be smaller)."""
    done = 0
    while True:
        perm = torch.randperm(n, generator=gen)
        for s in range(0, n, size):
            yield perm[s:s + size]
            done += 1
            if done == steps:
                return


def stacked_logits(logits: Tensor) -> Tensor:
    """K×B×C → B×(K·C), client k's logits in columns k·C … (k+1)·C − 1 (torch.hstack of the K outputs)."""
    return logits.float().permute(1, 0, 2).reshape(logits.shape[1], -1)


class AggregatorPredictor(ClientPredictor):
    def __init__(self, net: nn.Module, logs: dict[str, float]):
        self.net, self.logs = net.eval(), logs

    def scores(self, out: ClientOutputs) -> Tensor:
        return self.net(stacked_logits(out.logits).to(next(self.net.parameters()).device)).float()


@STRATEGIES.register("fens", options=FENSOptions)
class FENS(Strategy):
    """An aggregator over the frozen client models' logits, trained with the clients in extra FedAdam rounds."""

    every_round = False  # 500 rounds with every client: the last round only
    one_architecture_why = "each client rebuilds every client's model from the weights it receives, in its own network"

    def extra_rounds(self) -> int:
        return self.options.rounds

    def configure_round(self, rnd: int, ctx: ServerContext) -> dict[str, Tensor]:
        """Round 0: every client model and the aggregator's seeded init; then the aggregator alone."""
        st = ctx.state
        if rnd == 0:
            K, C = len(ctx.uploads), int(ctx.models[0].num_classes)
            with private_stream(derived_seed(self.facts.seed, ctx.round, TAG)):
                net = aggregator(K, C, self.options.hidden)
            st.update(x={k: p.detach().to(ctx.device) for k, p in net.state_dict().items()}, moments={}, K=K, C=C)
        message = {k: v.clone() for k, v in st["x"].items()}
        if rnd == 0:
            message.update({MODEL.format(k) + n: t for k, u in enumerate(ctx.uploads) for n, t in u.state.items()})
        return message

    def client_round(self, rnd: int, received: dict[str, Tensor], data, memory: dict) -> dict[str, Tensor]:
        """The frozen models' logits on this client's samples (computed once), then `local_steps` SGD steps of the
        aggregator on batches of them; the reply is the aggregator's new weights."""
        o = self.options
        if "inputs" not in memory:  # tensors only: a Flower node keeps them in its state between messages
            memory["inputs"] = self._client_logits(received, data)
            memory["gen"] = generator(self.facts.seed, 0, TAG, data.cid, 1).get_state()
        gen = torch.Generator()
        gen.set_state(memory["gen"])
        z, y, C = memory["inputs"].to(data.device), data.y, int(data.model.num_classes)
        net = aggregator(z.shape[1] // C, C, o.hidden).to(z.device)
        net.load_state_dict({k: v for k, v in received.items() if "/" not in k})
        opt = torch.optim.SGD(net.parameters(), lr=o.client_lr, momentum=0.0)
        net.train()
        for ix in local_batches(z.shape[0], o.batch_size, o.local_steps, gen):
            ix = ix.to(z.device)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(z[ix]), y[ix]).backward()
            opt.step()
        memory["gen"] = gen.get_state()
        return {k: v.detach() for k, v in net.state_dict().items()}

    @staticmethod
    def _client_logits(received: dict[str, Tensor], data) -> Tensor:
        """N×(K·C): every received client model (in this client's network) on this client's plain samples."""
        owners = sorted({int(k.split("/")[0][len("model"):]) for k in received if "/" in k})
        net = copy.deepcopy(data.model).eval()
        outs = []
        with torch.no_grad():
            for k in owners:
                pre = MODEL.format(k)
                net.load_state_dict({n[len(pre):]: t for n, t in received.items() if n.startswith(pre)})
                outs.append(torch.cat([net(data.normalize(data.x[s:s + 256]))[1].float()
                                       for s in range(0, data.x.shape[0], 256)]))
        return stacked_logits(torch.stack(outs))

    def aggregate_round(self, rnd: int, replies: list[dict[str, Tensor]], ctx: ServerContext) -> None:
        o, st = self.options, ctx.state
        seen = torch.tensor([min(u.num_samples, o.batch_size * o.local_steps) for u in ctx.uploads],
                            dtype=torch.float64)
        r = (seen / seen.sum()).tolist()
        delta = {k: sum(ri * (rep[k].to(x.device) - x) for ri, rep in zip(r, replies)) for k, x in st["x"].items()}
        st["x"] = fedadam_step(st["x"], delta, st["moments"], o.server_lr, o.beta1, o.beta2, o.eps)

    def predictor(self, ctx: ServerContext) -> AggregatorPredictor:
        st = ctx.state
        net = aggregator(st["K"], st["C"], self.options.hidden).to(ctx.device)
        net.load_state_dict(st["x"])
        return AggregatorPredictor(net, {})
