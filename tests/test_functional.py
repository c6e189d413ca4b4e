"""moelab.functional against literal computations of the formulas."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moelab.functional import (
    activation,
    competition_affinity,
    cosine_logits,
    normalized_weights,
    resolve_renormalize,
    topk_gate,
    topk_softmax,
)


def test_topk_softmax_is_softmax_over_the_k_largest_logits():
    logits = torch.randn(6, 5, dtype=torch.float64)
    weights, indices = topk_softmax(logits, 3)
    assert indices.dtype == torch.int64
    for t in range(6):
        order = sorted(range(5), key=lambda i: -logits[t, i].item())[:3]
        assert indices[t].tolist() == order
        exp = [math.exp(logits[t, i].item()) for i in order]
        expected = [e / sum(exp) for e in exp]
        torch.testing.assert_close(weights[t], torch.tensor(expected, dtype=torch.float64))


def test_topk_softmax_equals_mixtral_renormalised_full_softmax():
    logits = torch.randn(10, 8, dtype=torch.float64)
    weights, indices = topk_softmax(logits, 2)
    probs = logits.softmax(-1).gather(1, indices)
    torch.testing.assert_close(weights, probs / probs.sum(-1, keepdim=True))


def test_topk_softmax_with_one_expert_is_the_argmax_with_weight_one():
    logits = torch.randn(7, 5, requires_grad=True)
    weights, indices = topk_softmax(logits, 1)
    top, expected = logits.topk(1, dim=-1)
    assert torch.equal(indices, expected) and indices.dtype == torch.int64
    assert torch.equal(weights, top.softmax(-1)) and weights.dtype == logits.dtype


def test_normalized_weights_divide_by_the_sum():
    s = torch.rand(4, 3, dtype=torch.float64)
    out = normalized_weights(s)
    for t in range(4):
        for k in range(3):
            assert out[t, k].item() == pytest.approx(s[t, k].item() / sum(s[t].tolist()))


def _literal_cosine(x, e, tau_x, tau_e):
    out = torch.empty(x.shape[0], e.shape[0], dtype=x.dtype)
    for t in range(x.shape[0]):
        for i in range(e.shape[0]):
            nx = math.sqrt(sum(v * v for v in x[t].tolist()))
            ne = math.sqrt(sum(v * v for v in e[i].tolist()))
            dot = sum(a * b for a, b in zip(x[t].tolist(), e[i].tolist()))
            out[t, i] = dot / ((nx + tau_x) * (ne + tau_e))
    return out


@pytest.mark.parametrize("tau", [0.0, 0.1, 1.0])
def test_cosine_logits_match_the_perturbed_cosine_formula(tau):
    x = torch.randn(5, 4, dtype=torch.float64)
    e = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(cosine_logits(x, e, tau, tau), _literal_cosine(x, e, tau, tau))


def test_cosine_logits_with_zero_perturbation_is_cosine_similarity():
    x = torch.randn(5, 4, dtype=torch.float64)
    e = torch.randn(3, 4, dtype=torch.float64)
    expected = F.cosine_similarity(x[:, None, :], e[None, :, :], dim=-1)
    torch.testing.assert_close(cosine_logits(x, e), expected)


def test_activation_swiglu_is_silu_gate_times_up():
    h = torch.randn(3, 8)
    gate, up = h[:, :4], h[:, 4:]
    torch.testing.assert_close(activation("swiglu")(h), F.silu(gate) * up)


@pytest.mark.parametrize(("name", "fn"), [("relu", F.relu), ("gelu", F.gelu), ("silu", F.silu)])
def test_activation_returns_the_named_function(name, fn):
    h = torch.randn(3, 8)
    torch.testing.assert_close(activation(name)(h), fn(h))


def test_activation_rejects_unknown_name_listing_allowed():
    with pytest.raises(ValueError, match=r"activation='tanh'.*allowed.*'gelu'.*'relu'.*'silu'.*'swiglu'"):
        activation("tanh")


@pytest.mark.parametrize("act", ["softplus", "silu", "sigmoid", "relu"])
def test_competition_affinity_is_mean_of_kappa(act):
    out = torch.randn(4, 3, 6, dtype=torch.float64)
    kappa = {"softplus": F.softplus, "silu": F.silu, "sigmoid": torch.sigmoid, "relu": F.relu}[act]
    torch.testing.assert_close(competition_affinity(out, act), kappa(out).mean(-1))


def test_competition_affinity_norm_is_l2_norm():
    out = torch.randn(4, 3, 6, dtype=torch.float64)
    torch.testing.assert_close(competition_affinity(out, reduce="norm"), out.norm(dim=-1))


def test_competition_affinity_exp_is_stable_and_keeps_normalised_weights():
    out = torch.randn(4, 3, 6, dtype=torch.float64)
    exact = out.exp().mean(-1)
    got = competition_affinity(out, "exp")
    torch.testing.assert_close(normalized_weights(got), normalized_weights(exact))
    big = torch.full((1, 2, 3), 1000.0)
    assert torch.isfinite(competition_affinity(big, "exp")).all()


def test_competition_affinity_rejects_unknown_activation_and_reduce():
    out = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match=r"activation='tanh' is not a competition activation; allowed"):
        competition_affinity(out, "tanh")
    with pytest.raises(ValueError, match=r"reduce='max' is not supported; allowed: \['mean', 'norm'\]"):
        competition_affinity(out, reduce="max")


def test_topk_gate_renormalises_for_k_above_one_and_is_switch_at_k1():
    logits = torch.randn(6, 5, dtype=torch.float64)
    w2, i2, p = topk_gate(logits, 2)
    ref_w, ref_i = topk_softmax(logits, 2)
    assert torch.equal(w2, ref_w) and torch.equal(i2, ref_i)
    torch.testing.assert_close(p, logits.softmax(-1))
    w1, i1, _ = topk_gate(logits, 1)
    assert torch.equal(i1, logits.argmax(-1, keepdim=True))
    torch.testing.assert_close(w1, p.gather(1, i1))  # Switch: the chosen expert's probability over N
    w1r, _, _ = topk_gate(logits, 1, renormalize=True)
    assert torch.equal(w1r, torch.ones_like(w1r))
    w2n, _, _ = topk_gate(logits, 2, renormalize=False)
    torch.testing.assert_close(w2n, p.gather(1, i2))


def test_topk_gate_bias_changes_the_choice_not_the_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    w, i, p = topk_gate(logits, 2, bias=bias)
    assert i.tolist() == [[3, 0]]
    torch.testing.assert_close(w, logits[:, [3, 0]].softmax(-1))
    w1, i1, _ = topk_gate(logits, 1, bias=bias)
    assert i1.tolist() == [[3]]
    torch.testing.assert_close(w1, p[:, [3]])


def test_resolve_renormalize_defaults_to_k_above_one():
    assert resolve_renormalize(None, 1) is False and resolve_renormalize(None, 2) is True
    assert resolve_renormalize(True, 1) is True and resolve_renormalize(False, 3) is False


def test_document_index_numbers_each_sequences_documents_by_their_row_and_id():
    """One index per (row, id) pair, in the pairs' sorted order, whatever the ids (a literal relabel)."""
    from moelab.functional import document_index

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(-3, 4, (40,), generator=gen)
    rows = torch.arange(40) // 10
    pairs = sorted({(int(r), int(i)) for r, i in zip(rows, ids)})
    want = [pairs.index((int(r), int(i))) for r, i in zip(rows, ids)]
    assert document_index(ids, rows).tolist() == want
    assert document_index(ids[:0], rows[:0]).tolist() == []
    compiled = torch.compile(document_index, backend="aot_eager", fullgraph=True)
    assert compiled(ids, rows).tolist() == want
