import numpy as np
import pytest
import torch

from flare.config import build_config
from flare.data.partition import Partition, dirichlet_partition, iid_partition, shards_partition
from flare.errors import FlareError
from flare.registry import PARTITIONS, REFERENCE_PARTITIONS
from flare.data.prepare import split
from conftest import make_partition


def labels(n_per_class=(50, 37, 80, 13, 60), seed=0):
    y = np.concatenate([np.full(n, c) for c, n in enumerate(n_per_class)])
    return np.random.default_rng(seed).permutation(y)


@pytest.mark.parametrize("alpha", [0.05, 0.5, 10.0])
def test_dirichlet_uses_every_index_exactly_once(alpha):
    y = labels()
    part = dirichlet_partition(y, 7, alpha, seed=3)
    allix = np.concatenate(part.client_indices)
    assert len(allix) == len(y)
    assert np.array_equal(np.sort(allix), np.arange(len(y)))


def test_dirichlet_is_reproducible_and_seed_dependent():
    y = labels()
    a = dirichlet_partition(y, 5, 0.1, seed=1)
    b = dirichlet_partition(y, 5, 0.1, seed=1)
    c = dirichlet_partition(y, 5, 0.1, seed=2)
    assert all(np.array_equal(u, v) for u, v in zip(a.client_indices, b.client_indices))
    assert not all(np.array_equal(u, v) for u, v in zip(a.client_indices, c.client_indices))


def test_card_dealer_counts_and_leftovers_go_to_distinct_clients():
    """Replay the dealer's random draws: each client gets floor(q_i N_c) or one more, and the extras
    (N_c − Σ floor) land on distinct clients."""
    y, K, alpha, seed = labels(), 6, 0.3, 11
    part = dirichlet_partition(y, K, alpha, seed=seed)
    hist = part.histogram()
    rng = np.random.default_rng(seed)
    saw_leftover = False
    for c in range(5):
        idx = np.flatnonzero(y == c)
        rng.shuffle(idx)
        q = rng.dirichlet(alpha * np.ones(K))
        floors = np.floor(q * len(idx)).astype(int)
        extra = hist[:, c] - floors
        assert set(np.unique(extra)) <= {0, 1}          # at most one leftover per client: distinct clients
        assert extra.sum() == len(idx) - floors.sum()   # every leftover dealt
        saw_leftover |= extra.sum() > 0
        left = len(idx) - floors.sum()
        if left:
            rng.choice(K, size=left, replace=False)      # keep the replayed stream aligned
    assert saw_leftover


def test_dirichlet_slices_are_consecutive_runs_of_the_shuffled_class():
    y, K, seed = labels(), 4, 5
    part = dirichlet_partition(y, K, 0.5, seed=seed)
    rng = np.random.default_rng(seed)
    idx = np.flatnonzero(y == 0)
    rng.shuffle(idx)
    hist = part.histogram()
    start = 0
    for i in range(K):
        got = set(part.client_indices[i][y[part.client_indices[i]] == 0].tolist())
        assert got == set(idx[start:start + hist[i, 0]].tolist())
        start += hist[i, 0]


def test_small_alpha_can_leave_clients_tiny_or_empty_and_report_is_consistent():
    y = labels((5, 5, 5))
    part = dirichlet_partition(y, 8, 0.01, seed=0)
    rep = part.report()
    assert sum(c["num_samples"] for c in rep["clients"]) == len(y)
    assert any(c["num_samples"] == 0 for c in rep["clients"])
    for c in rep["clients"]:
        assert 0.0 <= c["normalized_entropy"] <= 1.0
        assert sum(c["class_histogram"]) == c["num_samples"]


def test_entropy_values():
    y = np.array([0, 0, 1, 1, 2, 3])
    part = make_partition(y, 1, "iid", seed=0)
    rep = part.report()["clients"][0]
    # p = (1/3, 1/3, 1/6, 1/6): H = 2·(1/3)log2 3 + 2·(1/6)log2 6
    h = 2 / 3 * np.log2(3) + 1 / 3 * np.log2(6)
    assert rep["label_entropy"] == pytest.approx(h)
    assert rep["normalized_entropy"] == pytest.approx(h / np.log2(4))


def test_iid_and_shards():
    y = labels()
    iid = iid_partition(y, 4, seed=0)
    assert sorted(np.concatenate(iid.client_indices).tolist()) == list(range(len(y)))
    assert max(iid.sizes) - min(iid.sizes) <= 1
    sh = shards_partition(y, 5, 2, seed=0)
    for row in sh.histogram():
        assert (row > 0).sum() == 2
    assert sorted(np.concatenate(sh.client_indices).tolist()) == list(range(len(y)))


def test_bad_partition_input():
    y = labels()
    with pytest.raises(FlareError) as e:
        build_config({"num_clients": 0})
    assert e.value.key == "num_clients"
    with pytest.raises(FlareError) as e:  # more clients than samples: refused when the data is known
        split(build_config({"num_clients": len(y) + 1}), torch.as_tensor(y), 5)
    assert e.value.key == "num_clients"
    with pytest.raises(FlareError) as e:
        build_config({"partition": {"alpha": 0.0}})
    assert e.value.key == "partition.alpha"


@pytest.fixture
def plugin_kind():
    """A plugin's partition kind ("first-half": clients share the first half of the set), no reference draw yet."""
    def first_half(facts, options):
        labels = facts.labels
        return Partition(list(np.array_split(np.arange(len(labels) // 2), facts.num_clients)), int(labels.max() + 1),
                         labels)

    PARTITIONS.register("first-half", first_half)
    yield first_half
    del PARTITIONS._entries["first-half"]
    REFERENCE_PARTITIONS._entries.pop("first-half", None)


def test_rng_legacy_draws_the_kinds_registered_reference_draw(plugin_kind):
    """partition.rng=legacy is the registered reference draw of the kind, not a flag the kind's own draw reads:
    without one the kind refuses it, naming partition.rng; with one registered, that one draws."""
    labels = np.repeat(np.arange(4), 10)
    assert make_partition(labels, 2, "first-half", 0).sizes == [10, 10]
    with pytest.raises(FlareError) as err:
        make_partition(labels, 2, "first-half", 0, rng="legacy")
    assert err.value.key == "partition.rng" and "first-half" in err.value.message
    REFERENCE_PARTITIONS.register("first-half", lambda f, _:
                                  Partition(list(np.array_split(np.arange(len(f.labels)), f.num_clients)), 4, f.labels))
    assert make_partition(labels, 2, "first-half", 0, rng="legacy").sizes == [20, 20]


def test_the_config_refuses_rng_legacy_for_a_kind_without_a_reference_draw(plugin_kind):
    with pytest.raises(FlareError) as err:
        build_config({"partition": {"kind": "first-half", "rng": "legacy"}})
    assert err.value.key == "partition.rng"
    assert build_config({"partition": {"kind": "first-half"}}).partition.rng == "generator"
