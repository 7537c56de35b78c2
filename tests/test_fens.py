"""FENS (flare/baselines/fens.py), the strategy that talks back: its FedAdam step and a client's local step equal
hand-written computations of the reference's (sacs-epfl/fens) on identical tensors, and it runs end to end through
`flare run` and `flare fuse` (which reproduces the run's own accuracy), its extra rounds and bytes reported; the
same through the Flower server and nodes, whose numbers are flare run's."""
import pytest
import torch
import torch.nn.functional as F

from flare.baselines.fens import FENS, FENSOptions, aggregator, fedadam_step, local_batches, stacked_logits
from flare.config import load_config
from flare.errors import FlareError
from flare.rundir import read_jsonl
from flare.runner import Run
from flare.server.strategy import strategy_facts


def reference_fedadam(x, client_params, ratios, rounds_state, slr, beta1, beta2, eps):
    """The reference's server update written out as its comments state it (distoptim/FedAdam.py: average):
    Δ = Σ_i r_i (x_i − x), then m, v (no bias correction) and x + η m / (√v + ε)."""
    delta = {k: torch.zeros_like(v) for k, v in x.items()}
    for p, r in zip(client_params, ratios):
        for k in x:
            delta[k] += (p[k] - x[k]) * r
    new = {}
    for k in x:
        if k not in rounds_state:
            m, v = delta[k] * (1 - beta1), (delta[k] ** 2) * (1 - beta2)
        else:
            m0, v0 = rounds_state[k]
            m, v = m0 * beta1 + delta[k] * (1 - beta1), v0 * beta2 + (delta[k] ** 2) * (1 - beta2)
        rounds_state[k] = (m, v)
        new[k] = x[k] + slr * (m / (torch.sqrt(v) + eps))
    return new


def test_two_fedadam_steps_equal_the_reference_computation():
    g = torch.Generator().manual_seed(0)
    x = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(4, generator=g)}
    ref_state, moments, ours, ref = {}, {}, dict(x), dict(x)
    for _ in range(2):
        clients = [{k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in ours.items()} for _ in range(3)]
        ratios = [0.5, 0.3, 0.2]
        delta = {k: sum(r * (c[k] - ours[k]) for r, c in zip(ratios, clients)) for k in ours}
        ours = fedadam_step(ours, delta, moments, 1e-3, 0.9, 0.99, 1e-3)
        ref = reference_fedadam(ref, clients, ratios, ref_state, 1e-3, 0.9, 0.99, 1e-3)
        for k in x:
            torch.testing.assert_close(ours[k], ref[k], rtol=1e-6, atol=1e-7)
    assert not torch.equal(ours["w"], x["w"])  # it moved


def test_a_clients_local_step_equals_plain_sgd_on_cross_entropy(tiny_overrides):
    """One `client_round` from given aggregator weights: the reference's client is SGD (lr 1, no momentum) on the
    cross-entropy of SmallNN over the concatenated logits, one batch of 128 from a shuffled pass."""
    cfg = load_config(None, "fedavg", tiny_overrides)
    K, C, N = 3, 4, 150
    fens = FENS(strategy_facts(cfg), FENSOptions())
    g = torch.Generator().manual_seed(1)
    z, y = torch.randn(N, K * C, generator=g), torch.randint(0, C, (N,), generator=g)
    net = aggregator(K, C, 2)
    sent = {k: v.detach().clone() for k, v in net.state_dict().items()}

    class Data:  # what client_round reads of a ClientData once its logits are cached
        model = type("M", (), {"num_classes": C})()
        cid, device = 0, torch.device("cpu")

    Data.y = y
    memory = {"inputs": z, "gen": torch.Generator().manual_seed(7).get_state()}
    reply = fens.client_round(1, sent, Data, memory)
    ix = torch.randperm(N, generator=torch.Generator().manual_seed(7))[:128]
    W1, b1, W2, b2 = (sent[k].clone().requires_grad_() for k in ("0.weight", "0.bias", "2.weight", "2.bias"))
    loss = F.cross_entropy(torch.relu(z[ix] @ W1.T + b1) @ W2.T + b2, y[ix])
    grads = torch.autograd.grad(loss, (W1, b1, W2, b2))
    for k, p, gr in zip(("0.weight", "0.bias", "2.weight", "2.bias"), (W1, b1, W2, b2), grads):
        torch.testing.assert_close(reply[k], p.detach() - 1.0 * gr, rtol=1e-6, atol=1e-7)
    assert not torch.equal(reply["0.weight"], sent["0.weight"])


def test_local_batches_walk_shuffled_passes_like_a_dataloader():
    got = list(local_batches(5, 2, 4, torch.Generator().manual_seed(3)))
    g = torch.Generator().manual_seed(3)
    p1, p2 = torch.randperm(5, generator=g), torch.randperm(5, generator=g)
    want = [p1[0:2], p1[2:4], p1[4:5], p2[0:2]]
    assert [t.tolist() for t in got] == [t.tolist() for t in want]


def test_stacked_logits_put_client_k_in_its_own_columns():
    logits = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)  # K=2, B=3, C=4
    z = stacked_logits(logits)
    assert torch.equal(z, torch.hstack([logits[0], logits[1]]))


def test_fens_through_flare_run_and_flare_fuse(tiny_overrides, tmp_path):
    from flare.fuse import fuse_runs
    rounds = 6
    cfg = load_config(None, "fedavg", tiny_overrides + ["eval.rules=[primary,fens]",
                                                        f"server.strategies.fens.rounds={rounds}"])
    d = tmp_path / "run"
    Run(cfg, d, quiet=True).execute()
    recs = [r for r in read_jsonl(d / "metrics.jsonl") if r["kind"] == "round"]
    assert "acc_fens" not in recs[0]  # every_round=False: the last round only
    last = recs[-1]
    assert 0 <= last["acc_fens"] <= 1 and last["fens.rounds"] == rounds
    # bytes: round 0 sends every client model and the aggregator to each client, later rounds the aggregator
    ck = torch.load(d / "checkpoint.pt", map_location="cpu", weights_only=False)
    model_bytes = sum(t.numel() * t.element_size() for t in ck["clients"][0]["model"].values())
    K, C = 3, 4
    agg = sum(p.numel() * 4 for p in aggregator(K, C, 2).parameters())
    assert last["fens.bytes_down"] == K * (K * model_bytes + agg) + (rounds - 1) * K * agg
    assert last["fens.bytes_up"] == rounds * K * agg
    ((_, (f,)),) = fuse_runs([str(d)], "fens")
    assert f["acc"] == last["acc_fens"] and f["fens.bytes_up"] == last["fens.bytes_up"]


def test_fens_through_the_flower_server_and_nodes_equals_flare_run(tiny_overrides, tmp_path):
    """The ServerApp's logic and the ClientApp's handlers, called directly (tests/test_flower_protocol.py's
    stand-in for the grid): each node computes its replies from its own upload and samples, and the numbers are
    `flare run`'s; a node that stops answering in those rounds fails the federation, naming the strategy."""
    pytest.importorskip("flwr")
    from test_flower_protocol import Nodes
    ov = tiny_overrides + ["eval.rules=[primary,fens]", "server.strategies.fens.rounds=4"]
    Run(load_config(None, "fedavg", ov), tmp_path / "run", quiet=True).execute()
    Nodes().federate(ov, tmp_path / "fed", preset="fedavg")
    a, b = (read_jsonl(tmp_path / d / "metrics.jsonl")[-1] for d in ("run", "fed"))
    assert b["acc_fens"] == a["acc_fens"] and b["fens.rounds"] == 4
    assert (b["fens.bytes_down"], b["fens.bytes_up"]) == (a["fens.bytes_down"], a["fens.bytes_up"])
    nodes = Nodes()
    real = nodes.talk
    nodes.talk = lambda task, name, rnd, message, ids: real(task, name, rnd, message, ids[:-1] if rnd == 2 else ids)
    with pytest.raises(FlareError, match=r"round 3 of the rounds server strategy 'fens'.*client 2 did not answer"):
        nodes.federate(ov, tmp_path / "fed2", preset="fedavg")


def test_an_engine_that_cannot_talk_refuses_a_strategy_that_does(tiny_overrides, tmp_path):
    from flare.flower.server import FederationSettings, ServerSession
    cfg = load_config(None, "fedavg", tiny_overrides + ["eval.rules=[primary,fens]"])
    with pytest.raises(FlareError, match="fens"):
        ServerSession(cfg, FederationSettings(out_dir=str(tmp_path / "fl")), log=lambda m: None)
    assert not (tmp_path / "fl").exists()
