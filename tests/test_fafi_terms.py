import math

import torch
import torch.nn.functional as F

from flare.client.terms.fafi import ce_terms, fafi_terms, proto_feature_loss, proto_proto_loss, supcon_loss

L1E = math.log(1 + math.e ** -1)  # CE of logits (1, 0) at the right class


def test_proto_proto_hand_example():
    P = torch.eye(2)
    assert abs(proto_proto_loss(P, 1.0).item() - L1E) < 1e-6
    # τ_pp halves the temperature → logits (2, 0)
    assert abs(proto_proto_loss(P, 0.5).item() - math.log(1 + math.e ** -2)) < 1e-6


def test_proto_feature_hand_example():
    P = torch.eye(2)
    z = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    y = torch.tensor([0, 1])
    expect = (L1E + math.log(1 + math.e)) / 2
    assert abs(proto_feature_loss(z, P, y).item() - expect) < 1e-6


def test_supcon_hand_example_and_anchor_without_positive():
    """anchors e1, e1, e2 with labels 0, 0, 1 at τ = base τ = 1: the two label-0 anchors each have one
    positive (logit 1) against one negative (logit 0) → log(1 + e^-1); the label-1 anchor has no
    positive and contributes 0 (not NaN). Mean over 3 anchors."""
    z = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([0, 0, 1])
    loss = supcon_loss(z, y, tau=1.0, base_tau=1.0)
    assert torch.isfinite(loss)
    assert abs(loss.item() - 2 * L1E / 3) < 1e-6


def test_supcon_all_without_positive_is_zero_not_nan():
    z = F.normalize(torch.randn(4, 8), dim=1)
    loss = supcon_loss(z, torch.arange(4), tau=0.07)
    assert loss.item() == 0.0


def test_supcon_matches_reference_loop():
    torch.manual_seed(0)
    z = F.normalize(torch.randn(8, 5), dim=1)
    y = torch.tensor([0, 1, 0, 2, 0, 1, 0, 2])
    tau, base = 0.1, 0.07
    total = 0.0
    for i in range(8):
        others = [j for j in range(8) if j != i]
        den = sum(math.exp(float(z[i] @ z[j]) / tau) for j in others)
        pos = [j for j in others if y[j] == y[i]]
        total += -(tau / base) * sum(float(z[i] @ z[j]) / tau - math.log(den) for j in pos) / len(pos)
    assert abs(supcon_loss(z, y, tau=tau, base_tau=base).item() - total / 8) < 1e-4


def test_supcon_bank_entries_add_contrast_but_are_not_anchors():
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([0, 1])
    bank = torch.tensor([[1.0, 0.0]])
    loss = supcon_loss(z, y, bank, torch.tensor([0]), tau=1.0, base_tau=1.0)
    # anchor 0: keys {z1 (logit 0, neg), bank (logit 1, pos)} → log(1+e^-1); anchor 1: no positive → 0
    assert abs(loss.item() - L1E / 2) < 1e-6


def test_fafi_terms_cls_equals_pf_at_unit_temperature():
    torch.manual_seed(1)
    feat = torch.randn(6, 4)
    P = torch.randn(3, 4)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    logits = F.normalize(feat, dim=1) @ P.T
    t = fafi_terms(feat, logits, y, P)
    assert set(t) == {"loss_cls", "loss_con", "loss_pf", "loss_pp"}
    assert abs(t["loss_cls"].item() - t["loss_pf"].item()) < 1e-6
    assert abs(ce_terms(torch.tensor([[2.0, 0.0]]), torch.tensor([0]))["loss_cls"].item()
               - math.log(1 + math.e ** -2)) < 1e-6
