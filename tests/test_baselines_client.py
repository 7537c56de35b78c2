"""The FAFI code's client-side one-shot baselines (flare/baselines/client_baselines.py): FedProto's server
prototypes are the unweighted mean of the clients' class means and predict by the nearest one; FedETF's head is a
fixed simplex ETF that training never moves; both presets run through flare run and flare fuse."""
import json

import pytest
import torch

from conftest import flare_in_process
from flare.config import load_config
from flare.models import create_model
from flare.rundir import read_jsonl
from flare.runner import Run
from flare.server.extras import ClientData
from flare.server.strategy import ClientOutputs, ServerContext, make_strategy


def rounds_of(d):
    return [r for r in read_jsonl(d / "metrics.jsonl") if r["kind"] == "round"]


def test_fedproto_prototypes_are_the_mean_of_the_clients_class_means():
    torch.manual_seed(0)
    model = create_model("cnn", 1, 3, 0.25, head="linear").eval()
    cfg = load_config(None, "fedproto", ["device=cpu"])
    strat = make_strategy(cfg, "fedproto")
    x = torch.randint(0, 255, (12, 1, 28, 28), dtype=torch.uint8)
    norm = lambda u: u.float() / 255.0  # noqa: E731
    ys = [torch.tensor([0, 0, 1, 1, 1, 0]), torch.tensor([0, 0, 0, 0, 0, 2])]  # class 1 only on client 0
    extras = [strat.client_extras(ClientData(i, model, x[6 * i:6 * i + 6], y, norm, None, torch.device("cpu")))
              for i, y in enumerate(ys)]
    ctx = ServerContext(0, [], [model, model], torch.tensor([0.5, 0.5]), None, None, extras=extras)
    protos, present = strat.prototypes(ctx)
    with torch.no_grad():
        f = model(norm(x))[0]
    m0 = [f[:6][ys[0] == c].mean(0) for c in (0, 1)]
    m1 = [f[6:][ys[1] == c].mean(0) for c in (0, 2)]
    assert torch.allclose(protos[0], (m0[0] + m1[0]) / 2, atol=1e-5)  # unweighted over the clients holding it
    assert torch.allclose(protos[1], m0[1], atol=1e-5) and torch.allclose(protos[2], m1[1], atol=1e-5)
    assert present.tolist() == [True, True, True]
    # features at a prototype are predicted as its class (fused: Σ_k w_k f_k = the prototype)
    fused = make_strategy(cfg, "fedproto_fused").predictor(ctx)
    out = ClientOutputs(protos[None].repeat(2, 1, 1), torch.zeros(2, 3, 3))
    assert fused.scores(out).argmax(1).tolist() == [0, 1, 2]


def test_fedetf_head_is_a_fixed_simplex_etf():
    torch.manual_seed(3)
    m = create_model("cnn", 1, 5, 0.25, head="etf")
    E = m.head.etf
    assert torch.allclose(E @ E.T, torch.full((5, 5), -0.25) + 1.25 * torch.eye(5), atol=1e-5)
    assert "head.etf" in m.state_dict() and not any(n == "head.etf" for n, _ in m.named_parameters())
    torch.manual_seed(3)
    assert torch.equal(create_model("cnn", 1, 5, 0.25, head="etf").head.etf, E)  # the seeded init fixes it


@pytest.mark.parametrize("preset", ["fedproto", "fedetf"])
def test_the_presets_run_and_fuse(preset, tiny_overrides, tmp_path, capsys):
    d = tmp_path / preset
    Run(load_config(None, preset, tiny_overrides), d, quiet=True).execute()
    last = rounds_of(d)[-1]
    if preset == "fedproto":
        assert last["primary"] == "fedproto" and last["acc"] == last["acc_fedproto"]
        assert "acc_fedproto_fused" in last and last["fedproto.classes_held"] == 4
        strategies = "fedproto,fedproto_fused"
    else:
        assert last["primary"] == "fedavg" and {"acc_output", "acc_fedavg"} <= set(last)
        strategies = "fedavg,output"
    r = flare_in_process(["fuse", d, "--strategies", strategies], capsys)
    assert r.returncode == 0, r.stderr
    for f in read_jsonl(d / "fuse.jsonl"):
        assert f["acc"] == last[f"acc_{f['strategy']}"], f  # the same uploads (extras recomputed): exact
    if preset == "fedetf":
        ck = torch.load(d / "checkpoint.pt", weights_only=True)
        etfs = [c["model"]["head.etf"] for c in ck["clients"]]
        assert etfs[0].shape == (4, 4) and all(torch.equal(e, etfs[0]) for e in etfs)  # never trained
    assert json.loads((d / "state.json").read_text())["status"] == "finished"
