"""Every method of ``moelab.methods()``: shapes, gradients, routing invariants, determinism."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moelab
from moelab.methods import Method, get_method, register_method
from router_grid import doc_inputs

METHODS = moelab.methods()
#: methods whose weights are not renormalised over the chosen K
UNNORMALISED = {
    "sigma-moe",
    "remoe",
    "top-p",
    "expert-choice",
    "moepp",
    "aoe",
    "expert-threshold",
    "emo",
    "default-moe",
    "routing-free",
}
#: methods that route a variable number of experts per token (``Routing.mask``), at most this many
VARIABLE_K = {
    "remoe": 4,
    "top-p": 4,
    "expert-choice": 4,
    "moepp": 2,
    "expert-threshold": 4,
    "routing-free": 4,
}
#: methods whose router scores experts beyond the bank's N (MoE++'s zero-computation experts), and how many
EXTRA_EXPERTS = {"moepp": 4}
D, N, K = 8, 4, 2


def make(method, **kw):
    return moelab.MoE(D, N, K, d_hidden=12, method=method, **kw)


def test_methods_lists_the_ten_baselines_in_order():
    assert METHODS[:10] == [
        "smoe",
        "smoe-fixed",
        "smoe-dropout",
        "xmoe",
        "pcosine",
        "sigma-moe",
        "sharede-v2",
        "sharede-v3",
        "stablemoe",
        "hyperrouter",
    ]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(2, 6, D), (12, D)])
def test_method_forward_backward_keeps_shape_and_gives_finite_gradients(method, shape):
    layer = make(method).train()
    x = torch.randn(*shape, requires_grad=True)
    y = layer(x, **doc_inputs(layer, x))
    assert y.shape == x.shape
    assert torch.isfinite(y).all()
    (y.square().mean() + moelab.aux_loss(layer)).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    trainable = [(n, p) for n, p in layer.named_parameters() if p.requires_grad]
    assert trainable
    for name, p in trainable:
        assert p.grad is not None, f"{method}: {name} received no gradient"
        assert torch.isfinite(p.grad).all(), f"{method}: {name} has a non-finite gradient"
    # w_out: every expert has one (aoe's w_in holds no rows with a non-GLU activation)
    expert_grads = layer.experts.w_out.grad.flatten(1).abs().sum(-1)
    r = layer.last_routing
    used = (r.indices if r.mask is None else r.indices[r.mask]).unique()
    assert (expert_grads[used] > 0).all()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_method_routing_invariants(method, mode):
    layer = make(method)
    layer.train(mode == "train")
    x = torch.randn(3, 10, D)
    layer(x, **doc_inputs(layer, x))
    r = layer.last_routing
    assert r.indices.dtype == torch.int64
    k = VARIABLE_K.get(method, K)
    assert r.indices.shape == (30, k) and r.weights.shape == (30, k)
    assert (r.mask is not None) == (method in VARIABLE_K)
    if r.mask is not None:  # inactive slots have weight 0, active ones a positive weight
        assert r.mask.shape == (30, k) and r.mask.dtype == torch.bool
        assert (r.weights[r.mask] > 0).all()
        if method in EXTRA_EXPERTS:  # inactive: the experts beyond the bank, which the router ran itself
            assert (r.indices[~r.mask] >= N).all() and (r.indices[r.mask] < N).all()
        else:
            assert (r.weights[~r.mask] == 0).all()
    assert ((r.indices >= 0) & (r.indices < N + EXTRA_EXPERTS.get(method, 0))).all()
    s = r.indices.sort(-1).values
    assert (s[:, 1:] != s[:, :-1]).all(), "experts of a token must be distinct"
    assert (r.weights >= 0).all()
    if method not in UNNORMALISED:
        torch.testing.assert_close(r.weights.sum(-1), torch.ones(30))
    if r.probs is not None:
        assert r.probs.shape == (30, N + EXTRA_EXPERTS.get(method, 0))
        torch.testing.assert_close(r.probs.sum(-1), torch.ones(30))


@pytest.mark.parametrize("method", METHODS)
def test_method_eval_forward_is_deterministic(method):
    layer = make(method).eval()
    x = torch.randn(2, 7, D)
    y1 = layer(x, **doc_inputs(layer, x))
    r1 = layer.last_routing
    y2 = layer(x, **doc_inputs(layer, x))
    assert torch.equal(y1, y2)
    assert torch.equal(r1.indices, layer.last_routing.indices)


@pytest.mark.parametrize("method", METHODS)
def test_method_last_routing_is_detached_and_aux_loss_is_0dim(method):
    layer = make(method).train()
    x = torch.randn(5, D, requires_grad=True)
    layer(x, **doc_inputs(layer, x))
    r = layer.last_routing
    for t in (r.indices, r.weights, r.probs, r.logits, *r.losses.values()):
        if t is not None:
            assert not t.requires_grad and t.grad_fn is None
    assert r.outputs is None
    assert layer.aux_loss.dim() == 0 and torch.isfinite(layer.aux_loss)


@pytest.mark.parametrize("method", METHODS)
def test_method_runs_in_float64(method):
    layer = make(method).double()
    x = torch.randn(6, D, dtype=torch.float64)
    y = layer(x, **doc_inputs(layer, x))
    assert y.dtype == torch.float64
    assert layer.last_routing.weights.dtype == torch.float64


@pytest.mark.parametrize("method", METHODS)
def test_method_is_deterministic_under_a_seed(method):
    x = torch.randn(4, D)
    torch.manual_seed(7)
    a = make(method)
    a = a(x, **doc_inputs(a, x))
    torch.manual_seed(7)
    b = make(method)
    b = b(x, **doc_inputs(b, x))
    assert torch.equal(a, b)


def test_method_presets_cite_a_paper_and_a_formula():
    for name in METHODS:
        m = get_method(name)
        assert m.name == name and m.summary and m.paper


def test_sharede_v2_is_smoe_plus_shared_experts():
    layer = make("sharede-v2")
    assert layer.num_shared == 1 and layer.shared is not None
    assert layer.router.k_max is None and not layer.router.frozen
    assert make("smoe").shared is None


def test_get_method_rejects_unknown_name_listing_methods():
    with pytest.raises(
        ValueError, match=r"method='nope' is not a moelab method; allowed: \['smoe', 'smoe-fixed'"
    ):
        get_method("nope")


def test_register_method_rejects_a_duplicate_name():
    with pytest.raises(ValueError, match=r"method 'smoe' is already registered"):
        register_method(Method("smoe", "topk", "dup", "none"))


@pytest.mark.parametrize("method", METHODS)
def test_method_accepts_an_empty_batch(method):
    layer = make(method).train()
    x = torch.randn(2, 0, D, requires_grad=True)
    y = layer(x, **doc_inputs(layer, x))
    assert y.shape == (2, 0, D)
    assert layer.aux_loss.item() == 0.0  # not NaN: no tokens, nothing to balance
    (y.sum() + moelab.aux_loss(layer)).backward()


@pytest.mark.parametrize("method", METHODS)
def test_method_layer_can_be_copied_saved_and_reloaded_after_a_forward(method, tmp_path):
    import copy

    layer = make(method).train()
    x = torch.randn(5, D)
    docs = doc_inputs(layer, x)
    layer(x, **docs)  # leaves aux_loss with an autograd graph
    layer.eval()
    expected = layer(x, **docs)
    twin = copy.deepcopy(layer)
    torch.testing.assert_close(twin(x, **docs), expected, rtol=0, atol=0)
    torch.save(layer.state_dict(), tmp_path / "w.pt")
    torch.manual_seed(123)
    fresh = make(method).eval()
    fresh.load_state_dict(torch.load(tmp_path / "w.pt"))
    torch.testing.assert_close(fresh(x, **docs), expected, rtol=0, atol=0)


#: methods whose router has nothing a task loss could train, by design: a router frozen at its
#: random init (smoe-fixed, smoe-dropout) or no router at all (competition: the experts decide)
NO_TRAINABLE_ROUTER = {"smoe-fixed", "smoe-dropout", "competition"}
#: methods whose routing scores come from parameters outside the router: Autonomy-of-Experts ranks
#: the experts by their own low-rank gate factors ``A``
ROUTING_PARAMS = {"aoe": lambda layer: [layer.experts.gate_down]}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("k", [1, 2])
def test_method_router_learns_from_the_task_loss_alone_at_k1_and_k2(method, k):
    torch.manual_seed(0)
    layer = moelab.MoE(D, N, k, d_hidden=12, method=method).train()
    params = [p for p in layer.router.parameters() if p.requires_grad]
    params += ROUTING_PARAMS.get(method, lambda _: [])(layer)
    if method in NO_TRAINABLE_ROUTER:
        assert params == []  # the exception is what the preset is, not a lost gradient
        return
    layer.config = dataclasses.replace(layer.config, coefs={})  # the task loss only: no aux gradient injected
    x = torch.randn(2, 6, D)
    layer(x, **doc_inputs(layer, x)).pow(2).mean().backward()
    total = sum(float(p.grad.abs().sum()) for p in params if p.grad is not None)
    assert total > 1e-6, f"{method} at K={k}: the router's parameters get no gradient from the task loss"


@pytest.mark.parametrize("method", ["smoe", "xmoe", "hyperrouter", "stablemoe"])
def test_top1_weight_is_switch_the_chosen_experts_probability_over_all_n(method):
    layer = moelab.MoE(D, N, 1, method=method).train()
    r = layer.router(torch.randn(10, D), layer.experts, None)
    torch.testing.assert_close(r.weights, r.probs.gather(1, r.indices))
    assert bool((r.weights < 1).all())
    forced = moelab.MoE(D, N, 1, method=method, renormalize=True).router(torch.randn(10, D), None, None)
    assert torch.equal(forced.weights, torch.ones_like(forced.weights))  # explicit: today's constant 1


def test_sharede_v3_top1_weight_is_the_sigmoid_score_and_topk_is_normalised():
    layer = moelab.MoE(D, N, 1, method="sharede-v3")
    r = layer.router(torch.randn(10, D), None, None)
    torch.testing.assert_close(r.weights, torch.sigmoid(r.logits).gather(1, r.indices))
    r2 = moelab.MoE(D, N, 2, method="sharede-v3").router(torch.randn(10, D), None, None)
    torch.testing.assert_close(r2.weights.sum(-1), torch.ones(10))


@pytest.mark.parametrize(
    "method", ["smoe", "xmoe", "pcosine", "hyperrouter", "stablemoe", "sharede-v2", "sharede-v3"]
)
def test_k2_weights_are_renormalised_by_default_as_before(method):
    torch.manual_seed(1)
    layer = moelab.MoE(D, N, 2, method=method)
    torch.manual_seed(1)
    explicit = moelab.MoE(
        D, N, 2, method=method, **{"normalize" if method == "sharede-v3" else "renormalize": True}
    )
    x = torch.randn(9, D)
    assert torch.equal(layer(x), explicit(x))


def test_renormalize_refuses_a_non_boolean():
    with pytest.raises(
        ValueError, match=r"^renormalize='yes' is not allowed; expected one of \[True, False, None\]$"
    ):
        moelab.MoE(D, N, 2, method="smoe", renormalize="yes")


def test_smoe_sg_is_sharede_v3_without_shared_experts_or_selection_bias():
    assert "smoe-sg" in moelab.methods()
    torch.manual_seed(0)
    sg = make("smoe-sg").train()
    torch.manual_seed(0)
    v3 = make("sharede-v3", num_shared=0, selection_bias=False).train()
    assert sg.shared is None and sg.router.selection_bias is None and sg.router.normalize
    assert not sg.coefs  # no aux loss, as DeepSeek-V3's router
    x = torch.randn(3, 5, D)
    torch.testing.assert_close(sg(x), v3(x), rtol=0, atol=0)
    assert torch.equal(sg.last_routing.indices, v3.last_routing.indices)
    torch.testing.assert_close(sg.last_routing.weights.sum(-1), torch.ones(15))
