import torch
import torch.nn as nn
import torch.nn.functional as F

from flare.metrics import g_protos_std, inter_client_proto_std, model_variance_mean
from flare.server.fedavg import average_state_dicts
from flare.server.fusion import aggregation_weights
from flare.server.rules import (fuse_features, fuse_outputs, iffi_reference_features, iffi_weights,
                                prototype_scores)
from flare.server.protos import mean_prototypes


def test_aggregation_weights():
    assert torch.allclose(aggregation_weights([1, 3], "size"), torch.tensor([0.25, 0.75]))
    assert torch.allclose(aggregation_weights([1, 3], "uniform"), torch.tensor([0.5, 0.5]))


def test_feature_fusion_and_prototype_match():
    feats = torch.tensor([[[2.0, 0.0]], [[0.0, 1.0]]])  # K=2, B=1, d=2
    h = fuse_features(feats, torch.tensor([0.25, 0.75]))
    assert torch.allclose(h, torch.tensor([[0.5, 0.75]]))
    G = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert prototype_scores(h, G).argmax(1).item() == 1


def test_iffi_per_model_weights_hand_example():
    feats = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]]])
    noise = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])  # model 0: u = 1−1 = 0, model 1: u = 1−0 = 1
    w = iffi_weights(feats, noise)
    assert torch.allclose(w, torch.tensor([[0.0], [1.0]]))
    noise2 = torch.tensor([[[-1.0, 0.0]], [[0.0, 1.0]]])  # u = (2, 1) → (2/3, 1/3)
    assert torch.allclose(iffi_weights(feats, noise2), torch.tensor([[2 / 3], [1 / 3]]))


def test_iffi_reference_equals_uniform_feature_fusion():
    torch.manual_seed(0)
    feats, noise = torch.randn(5, 64, 16), torch.randn(5, 64, 16)
    G = torch.randn(10, 16)
    ref = iffi_reference_features(feats, noise)
    uni = fuse_features(feats, aggregation_weights([1] * 5, "uniform"))
    assert torch.allclose(F.normalize(ref, dim=1), F.normalize(uni, dim=1), atol=1e-5)
    assert torch.equal(prototype_scores(ref, G).argmax(1), prototype_scores(uni, G).argmax(1))
    # and genuinely per-model IFFI differs from it in general
    iffi = fuse_features(feats, iffi_weights(feats, noise))
    assert not torch.allclose(F.normalize(iffi, dim=1), F.normalize(uni, dim=1), atol=1e-3)


def test_output_fusion():
    logits = torch.tensor([[[10.0, 0.0]], [[0.0, 10.0]]])
    out = fuse_outputs(logits, torch.tensor([0.3, 0.7]))
    assert out.argmax(1).item() == 1
    assert torch.allclose(out.sum(1), torch.ones(1))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.bn = nn.BatchNorm1d(2)


def test_fedavg_averages_parameters_and_batchnorm_statistics():
    a, b = Tiny(), Tiny()
    with torch.no_grad():
        a.lin.weight.fill_(1.0), b.lin.weight.fill_(3.0)
        a.bn.running_mean.fill_(0.0), b.bn.running_mean.fill_(4.0)
        a.bn.running_var.fill_(1.0), b.bn.running_var.fill_(5.0)
    a.bn.num_batches_tracked.fill_(7)
    avg = average_state_dicts([a.state_dict(), b.state_dict()], torch.tensor([0.25, 0.75]))
    assert torch.allclose(avg["lin.weight"], torch.full((2, 2), 2.5))
    assert torch.allclose(avg["bn.running_mean"], torch.full((2,), 3.0))
    assert torch.allclose(avg["bn.running_var"], torch.full((2,), 4.0))
    assert avg["bn.num_batches_tracked"].item() == 7 and avg["bn.num_batches_tracked"].dtype == torch.long


def test_diagnostics_hand_examples():
    a, b = nn.Linear(2, 1, bias=False), nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        a.weight.copy_(torch.tensor([[0.0, 0.0]]))
        b.weight.copy_(torch.tensor([[2.0, 4.0]]))
    # per-coordinate unbiased std over 2 clients: |x−y|/√2 → (√2, 2√2), mean 1.5√2
    assert abs(model_variance_mean([a, b]) - 1.5 * 2 ** 0.5) < 1e-6
    bn_model = nn.BatchNorm1d(3)  # buffers must not count: only parameters
    bn2 = nn.BatchNorm1d(3)
    bn2.running_mean.fill_(100.0)
    assert model_variance_mean([bn_model, bn2]) == 0.0

    G = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert abs(g_protos_std(G) - torch.tensor([1.0, 2, 3, 4]).std().item()) < 1e-6
    P1, P2 = torch.zeros(2, 2), torch.tensor([[2.0, 0.0], [0.0, 4.0]])
    # entrywise std over clients: (√2, 0, 0, 2√2) → mean 3√2/4
    assert abs(inter_client_proto_std([P1, P2]) - 3 * 2 ** 0.5 / 4) < 1e-6
    assert torch.allclose(mean_prototypes([P1, P2]), torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
