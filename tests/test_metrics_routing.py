"""The balance and stability diagnostics of Ho (2025) and CompeteSMoE (2025) Figs. 9-10, each against a
direct computation (the router's softmax top-K worked out by hand on each layer's input)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moelab
from moelab import metrics
from moelab.layer import recording_routing

D, N, K, T = 10, 5, 2, 24


def stack(method="smoe", layers=2, seed=0, **options):
    torch.manual_seed(seed)
    return nn.Sequential(*[moelab.MoE(D, N, K, method=method, impl="loop", **options) for _ in range(layers)])


def direct(model, x):
    """Per layer: its router's softmax over all experts, the top-K indices and renormalised weights."""
    out = []
    with torch.no_grad():
        for layer in model:
            p = F.linear(x, layer.router.weight).softmax(-1)
            top = p.topk(K, -1)
            out.append((p, top.indices, top.values / top.values.sum(-1, keepdim=True)))
            x = layer(x)
    return out


# ---------------------------------------------------------------- on loads
def test_jain_index_is_one_for_uniform_and_one_over_n_for_one_expert():
    assert metrics.jain_index(torch.tensor([3.0, 3.0, 3.0, 3.0])) == pytest.approx(1.0)
    assert metrics.jain_index(torch.tensor([0.0, 7.0, 0.0, 0.0])) == pytest.approx(1 / 4)
    r = [1.0, 2.0, 3.0]
    assert metrics.jain_index(torch.tensor(r)) == pytest.approx(sum(r) ** 2 / (3 * sum(v * v for v in r)))
    assert metrics.jain_index(torch.zeros(3)) == 1.0


def test_selection_entropy_is_ln_n_for_uniform_and_zero_for_one_expert():
    assert metrics.selection_entropy(torch.tensor([2.0, 2.0, 2.0, 2.0])) == pytest.approx(math.log(4))
    assert metrics.selection_entropy(torch.tensor([2.0, 2.0, 2.0, 2.0]), base=2) == pytest.approx(2.0)
    assert metrics.selection_entropy(torch.tensor([0.0, 5.0, 0.0])) == 0.0
    assert metrics.selection_entropy(torch.tensor([1.0, 3.0])) == pytest.approx(
        -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    )


def test_load_refusals_name_the_shape_or_the_negative_entry():
    with pytest.raises(ValueError, match=r"load of shape \(2, 2\) is not allowed; expected \(N,\)"):
        metrics.jain_index(torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"load has a negative entry"):
        metrics.selection_entropy(torch.tensor([1.0, -1.0]))


def test_topk_weight_entropy_renormalises_each_token():
    w = torch.tensor([[0.3, 0.3], [2.0, 0.0], [0.0, 0.0], [0.1, 0.3]])
    got = metrics.topk_weight_entropy(w)
    assert got.tolist() == pytest.approx(
        [math.log(2), 0.0, 0.0, -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    )
    with pytest.raises(ValueError, match=r"weights of shape \(4,\) is not allowed; expected \(T, K\)"):
        metrics.topk_weight_entropy(w[:, 0])


# ---------------------------------------------------------------- on models
def test_routing_balance_matches_direct_computation():
    model = stack()
    x = torch.randn(T, D)
    got = metrics.routing_balance(model, [x[:10], x[10:]])
    assert len(got) == 2
    for row, (p, idx, w) in zip(got, direct(model, x)):
        load = torch.bincount(idx.reshape(-1), minlength=N).double()
        r = load / load.sum()
        assert row["load"] == pytest.approx(r.tolist())
        assert row["jain"] == pytest.approx(float(r.sum() ** 2 / (N * (r * r).sum())))
        assert row["selection_entropy"] == pytest.approx(float(-(r[r > 0] * r[r > 0].log()).sum()))
        assert row["max_vio"] == pytest.approx(float(r.max() / r.mean() - 1))
        assert row["topk_weight_entropy"] == pytest.approx(float(-(w * w.log()).sum(-1).mean()), rel=1e-5)
        h = -(p * p.log()).sum(-1)
        assert row["router_entropy_mean"] == pytest.approx(float(h.mean()), rel=1e-5)
        assert row["router_entropy_sd"] == pytest.approx(float(h.std(unbiased=False)), rel=1e-4)
        assert row["tokens"] == T


def test_routing_balance_has_no_router_entropy_without_a_distribution():
    (row,) = metrics.routing_balance(stack("competition", layers=1), [torch.randn(T, D)])
    assert row["router_entropy_mean"] is None and row["router_entropy_sd"] is None
    assert 1 / N <= row["jain"] <= 1


def test_router_saturation_matches_direct_overlap_with_the_final_choice():
    final = stack(seed=0)
    early = stack(seed=0)
    x = torch.randn(T, D)
    assert metrics.router_saturation(early, final, [x]) == [1.0, 1.0]
    with torch.no_grad():
        early[1].router.weight.add_(torch.randn(N, D))
    expected = []
    for (_, a, _), (_, b, _) in zip(direct(early, x), direct(final, x)):
        expected.append(sum(len(set(u.tolist()) & set(v.tolist())) / K for u, v in zip(a, b)) / T)
    assert expected[0] == 1.0 and expected[1] < 1.0
    assert metrics.router_saturation(early, final, [x[:7], x[7:]]) == pytest.approx(expected)
    # consecutive checkpoints: change rate + saturation are complements for one layer pair
    assert 1 - metrics.expert_change_rate(early, final, [x]) == pytest.approx(sum(expected) / 2)


def test_router_saturation_refusals():
    x = torch.randn(T, D)
    with pytest.raises(ValueError, match=r"the models have 2 and 1 MoE layers"):
        metrics.router_saturation(stack(), stack(layers=1), [x])
    with pytest.raises(ValueError, match=r"batches is empty"):
        metrics.router_saturation(stack(), stack(), [])
    other = nn.Sequential(*[moelab.MoE(D, N, K + 1, method="smoe", impl="loop") for _ in range(2)])
    with pytest.raises(ValueError, match=r"MoE layer 0 chose \(24, 2\) and \(24, 3\) experts"):
        metrics.router_saturation(stack(), other, [x])


def test_router_distributions_are_the_softmax_of_each_layer():
    model = stack()
    x = torch.randn(T, D)
    got = metrics.router_distributions(model, x)
    for probs, (p, _, _) in zip(got, direct(model, x)):
        assert torch.allclose(probs, p, atol=1e-6)
    assert metrics.router_distributions(stack("competition", layers=1), x) == [None]


# ---------------------------------------------------------------- a variable number of experts per token
def test_slot_agreement_counts_shared_experts_and_empty_slots_left_by_both():
    a = torch.tensor([[0, 1], [2, -1], [-1, -1], [3, -1], [1, 0]])
    b = torch.tensor([[1, 3], [2, -1], [1, -1], [-1, -1], [0, 1]])
    assert metrics.slot_agreement(a, b).tolist() == [1, 2, 1, 1, 2]
    assert metrics.slot_agreement(b, a).tolist() == [1, 2, 1, 1, 2]  # symmetric
    full_a, full_b = torch.tensor([[0, 1], [2, 3]]), torch.tensor([[1, 0], [2, 4]])
    agree = metrics.slot_agreement(full_a, full_b)
    assert 1 - float(agree.sum()) / 4 == pytest.approx(metrics.assignment_change_rate(full_a, full_b))
    with pytest.raises(ValueError, match=r"indices of shapes \(2, 2\) and \(1, 2\) are not allowed"):
        metrics.slot_agreement(full_a, full_b[:1])


def test_router_saturation_of_a_variable_k_router_compares_active_slots():
    final, early = stack("top-p", seed=0), stack("top-p", seed=0)
    with torch.no_grad():
        early[0].router.weight.add_(torch.randn(N, D))
    x = torch.randn(T, D)

    def choices(model):
        """Per layer: each token's set of active experts, and K (the most a token may take)."""
        out = []
        with torch.no_grad(), recording_routing(model):
            h = x
            for layer in model:
                h = layer(h)
                r = layer.last_routing
                sets = [
                    {i for i, m in zip(row, mask) if m}
                    for row, mask in zip(r.indices.tolist(), r.mask.tolist())
                ]
                out.append((sets, r.indices.shape[1]))
        return out

    expected = []
    for (a, k), (b, _) in zip(choices(early), choices(final)):
        per_token = [len(sa & sb) + min(k - len(sa), k - len(sb)) for sa, sb in zip(a, b)]
        expected.append(sum(per_token) / (k * T))
    assert expected[0] < 1
    assert metrics.router_saturation(early, final, [x]) == pytest.approx(expected)
    assert metrics.router_saturation(final, final, [x]) == [1.0, 1.0]


def test_routing_balance_of_a_variable_k_router_counts_active_slots_only():
    model = stack("top-p", seed=1)
    x = torch.randn(T, D)
    got = metrics.routing_balance(model, [x])
    with torch.no_grad(), recording_routing(model):
        h = x
        for row, layer in zip(got, model):
            h = layer(h)
            r = layer.last_routing
            active = r.indices[r.mask]
            assert active.numel() < r.indices.numel()  # some slots are empty
            load = torch.bincount(active, minlength=N).double()
            assert row["load"] == pytest.approx((load / load.sum()).tolist())
            assert row["jain"] == pytest.approx(float(load.sum() ** 2 / (N * (load * load).sum())))


def test_a_hash_layer_is_a_router_with_no_routing_parameters_and_the_swap_keeps_its_table():
    """DeepSeek-V4's hash layers: their choice is a token id table (their gate learns the weights only),
    so metrics.routing_parameters counts 0 for them, and swap_top1 shifts the scored layers' ranks only."""
    from moelab.models.lm import LMConfig, TransformerLM

    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=11, block_size=8, n_layer=2, d_model=16, n_head=2, method="deepseek-v4",
                   num_experts=4, top_k=2, dropout=0.0, method_options={"hash_layers": 1})  # fmt: skip
    model = TransformerLM(cfg).eval()
    moelab.routing_context(model, total_steps=4)  # numbers the layers: the first is hashed
    assert [layer.router.learns_choice for layer in model.moe_layers] == [False, True]
    assert metrics.routing_parameters(model) == [0, 4 * 16]
    ids = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(1))
    own = metrics.active_choices(model, ids)
    with metrics.swap_top1(model, 0):
        swapped = metrics.active_choices(model, ids)
    assert torch.equal(swapped[0], model.moe_layers[0].router.tid2eid[ids.reshape(-1)])
    assert torch.equal(swapped[0], own[0]) and torch.equal(swapped[1][:, 0], own[1][:, 1])
    assert metrics.routing_parameters(moelab.MoE(D, N, K)) == [N * D]
