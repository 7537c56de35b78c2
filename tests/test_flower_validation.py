"""The server's upload gate (flare.server.upload.validate_upload): needs no Flower."""
import pytest
import torch

from flare.models import create_model
from flare.server.upload import Upload, UploadSpec, validate_upload

C = 4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return create_model("cnn", 3, C, 0.25, head="prototype")


@pytest.fixture
def spec(model):
    return UploadSpec.from_model(model, C)


def good(model, **kw):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    up = Upload(client=1, state=state, num_samples=10, prototypes=state["head.prototypes"])
    for k, v in kw.items():
        setattr(up, k, v)
    return up


def test_a_well_formed_upload_passes(model, spec):
    assert validate_upload(good(model), spec) == []


def test_wrong_shape_is_rejected(model, spec):
    up = good(model)
    up.state["encoder.body.0.weight"] = torch.zeros(8, 3, 5, 5)
    (r,) = validate_upload(up, spec)
    assert "encoder.body.0.weight" in r and "shape [8, 3, 5, 5]" in r


def test_wrong_dtype_is_rejected(model, spec):
    up = good(model)
    up.state["encoder.body.1.running_var"] = up.state["encoder.body.1.running_var"].double()
    up.state["encoder.body.1.num_batches_tracked"] = torch.tensor(3.0)
    reasons = validate_upload(up, spec)
    assert any("running_var" in r and "float64" in r for r in reasons)
    assert any("num_batches_tracked" in r and "dtype" in r for r in reasons)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_are_rejected(model, spec, bad):
    up = good(model)
    up.state["encoder.body.4.weight"][0, 0, 0, 0] = bad
    (r,) = validate_upload(up, spec)
    assert "non-finite" in r and "encoder.body.4.weight" in r


def test_non_finite_prototypes_are_rejected(model, spec):
    up = good(model)
    P = up.prototypes.clone()
    P[0, 0] = float("nan")
    up.prototypes = P
    assert any("prototypes hold non-finite" in r for r in validate_upload(up, spec))


def test_a_class_count_that_does_not_match_is_rejected(model, spec):
    other = create_model("cnn", 3, C + 2, 0.25, head="prototype")
    up = good(model)
    up.state["head.prototypes"] = other.state_dict()["head.prototypes"]
    up.prototypes = up.state["head.prototypes"]
    reasons = validate_upload(up, spec)
    assert any(f"prototypes have {C + 2} classes, the run has {C}" in r for r in reasons)
    assert any("head.prototypes" in r and "shape" in r for r in reasons)


def test_missing_and_unexpected_tensors_are_rejected(model, spec):
    up = good(model)
    del up.state["encoder.body.8.weight"]
    up.state["backdoor.weight"] = torch.zeros(3)
    reasons = validate_upload(up, spec)
    assert any("missing 1 tensor" in r and "encoder.body.8.weight" in r for r in reasons)
    assert any("unexpected" in r and "backdoor.weight" in r for r in reasons)


@pytest.mark.parametrize("n", [0, -5, 2.5, True, "10"])
def test_impossible_sample_counts_are_rejected(model, spec, n):
    assert any("sample count" in r for r in validate_upload(good(model, num_samples=n), spec))


def test_a_negative_counter_and_a_non_tensor_are_rejected(model, spec):
    up = good(model)
    up.state["encoder.body.1.num_batches_tracked"] = torch.tensor(-1)
    up.state["encoder.body.1.bias"] = [0.0] * 8
    reasons = validate_upload(up, spec)
    assert any("negative" in r for r in reasons) and any("not a tensor" in r for r in reasons)


def test_prototypes_must_match_the_head(model, spec):
    assert any("no prototypes" in r for r in validate_upload(good(model, prototypes=None), spec))
    lin = create_model("cnn", 3, C, 0.25, head="linear")
    lspec = UploadSpec.from_model(lin, C)
    state = dict(lin.state_dict())
    assert validate_upload(Upload(0, state, 5, None), lspec) == []
    assert any("head has none" in r for r in validate_upload(Upload(0, state, 5, torch.zeros(C, 32)), lspec))
