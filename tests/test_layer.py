"""The MoE layer: dispatch through the layer, aux losses, bad input, parity with Mixtral."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import moelab
from moelab.experts import ModuleExperts, grouped_mm_available
from moelab.losses import importance_loss, mean_entropy_loss, switch_balance_loss, z_loss
from router_grid import doc_inputs

GROUPED = grouped_mm_available(torch.device("cpu"), torch.float32)
IMPLS = ["loop", "auto"] + (["grouped"] if GROUPED else [])


def literal_layer_output(layer, x):
    """``Σ_k w_k · expert_forward(x, i_k) (+ shared(x))`` from the layer's last routing, per token (its
    active slots, plus the output of the experts the router ran itself; the routed experts on the
    router's inputs where it changes them, latent-prototype's aligner)."""
    r = layer.last_routing
    xin = x if r.inputs is None else r.inputs
    rows = []
    for t in range(x.shape[0]):
        y = sum(
            r.weights[t, k] * layer.experts.expert_forward(xin[t : t + 1], int(r.indices[t, k]))[0]
            for k in range(r.indices.shape[1])
            if r.mask is None or r.mask[t, k]
        ) + (x.new_zeros(x.shape[-1]) if r.direct is None else r.direct[t])
        if layer.shared is not None:
            y = y + layer.shared(x[t : t + 1])[0]
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method", moelab.methods())
def test_layer_output_is_weighted_sum_of_chosen_experts_plus_shared(impl, method):
    layer = moelab.MoE(8, 5, 2, d_hidden=4, method=method, activation="swiglu", bias=True, impl=impl).eval()
    with torch.no_grad():
        layer.experts.b_in.normal_()
        layer.experts.b_out.normal_()
    x = torch.randn(11, 8)
    y = layer(x, **doc_inputs(layer, x))
    torch.testing.assert_close(y, literal_layer_output(layer, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t", [1, 3])
def test_layer_with_k_equal_n_and_single_token(t):
    layer = moelab.MoE(6, 3, 3, method="sharede-v2", activation="gelu")
    x = torch.randn(t, 6)
    y = layer(x)
    assert layer.last_routing.indices.shape == (t, 3)
    torch.testing.assert_close(y, literal_layer_output(layer, x), rtol=1e-5, atol=1e-6)


def test_layer_keeps_the_input_shape_and_flattens_tokens():
    layer = moelab.MoE(8, 4, 2)
    x = torch.randn(2, 3, 5, 8)
    y = layer(x)
    assert y.shape == x.shape
    assert layer.last_routing.indices.shape == (30, 2)
    torch.testing.assert_close(
        y.reshape(-1, 8), literal_layer_output(layer, x.reshape(-1, 8)), rtol=1e-5, atol=1e-6
    )


def test_layer_d_hidden_defaults_to_d_model():
    layer = moelab.MoE(12, 4, 2)
    assert layer.experts.d_hidden == 12


def test_layer_with_module_experts_equals_weighted_sum():
    experts = ModuleExperts([nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 6)) for _ in range(4)])
    layer = moelab.MoE(6, 4, 2, method="xmoe", experts=experts)
    x = torch.randn(2, 5, 6)
    y = layer(x)
    assert y.shape == x.shape
    torch.testing.assert_close(
        y.reshape(-1, 6), literal_layer_output(layer, x.reshape(-1, 6)), rtol=1e-5, atol=1e-6
    )
    y.sum().backward()
    used = set(layer.last_routing.indices.unique().tolist())
    for e, module in enumerate(layer.experts.experts):
        assert all((p.grad is not None) == (e in used) for p in module.parameters())


def test_layer_shared_experts_width_is_num_shared_times_d_hidden():
    layer = moelab.MoE(8, 4, 2, d_hidden=6, method="sharede-v2", num_shared=2)
    assert layer.shared.fc_out.in_features == 12
    assert moelab.MoE(8, 4, 2, method="sharede-v2", num_shared=0).shared is None


# ------------------------------------------------------------------------------------------ aux loss
def test_aux_loss_is_the_weighted_sum_of_the_losses():
    layer = moelab.MoE(
        8, 4, 2, method="smoe", balance_coef=0.5, z_coef=0.1, importance_coef=0.2, entropy_coef=0.3
    )
    layer(torch.randn(10, 8))
    r = layer.last_routing
    expected = (
        0.5 * switch_balance_loss(r.probs, r.indices, 4)
        + 0.1 * z_loss(r.logits)
        + 0.2 * importance_loss(r.probs)
        + 0.3 * mean_entropy_loss(r.probs)
    )
    torch.testing.assert_close(layer.aux_loss.detach(), expected)


def test_aux_loss_preset_coefficients_and_zero_switches_a_loss_off():
    layer = moelab.MoE(8, 4, 2, method="smoe")
    assert layer.coefs == {"balance": 0.01, "z": 0.001}
    off = moelab.MoE(8, 4, 2, method="smoe", balance_coef=0, z_coef=0.0)
    off(torch.randn(5, 8))
    assert off.coefs == {} and off.aux_loss.item() == 0.0


def test_aux_loss_gradient_reaches_the_router_through_the_output():
    """A training forward attaches ``∂aux`` to its output: a backward through the output (with a
    zero task gradient) gives the router exactly the gradient of the weighted losses."""
    layer = moelab.MoE(8, 4, 2, method="smoe", balance_coef=1.0)
    x = torch.randn(10, 8)
    (layer(x) * 0).sum().backward()
    r = layer.router(x)
    want = torch.autograd.grad(
        switch_balance_loss(r.probs, r.indices, 4) + 0.001 * z_loss(r.logits), layer.router.weight
    )[0]
    assert want.abs().sum() > 0
    torch.testing.assert_close(layer.router.weight.grad, want)


@pytest.mark.parametrize(
    ("options", "shape"),
    [
        ({}, (10, 8)),
        ({}, (2, 5, 8)),
        ({"balance_scope": "global", "importance_coef": 0.1}, (10, 8)),
        ({"balance_coef": 0.0, "z_coef": 0.0}, (2, 5, 8)),
    ],
)
def test_the_training_output_is_a_new_tensor_that_may_be_modified_in_place(options, shape):
    """The aux gradient rides on the output, yet the output is no view (FSDP2 warns of a view on
    every step, and an in-place change of a custom function's view is refused): ``y *= 2`` trains
    as ``y = y * 2`` does."""
    results = []
    for in_place in (False, True):
        torch.manual_seed(0)
        layer = moelab.MoE(8, 4, 2, method="smoe", **{"balance_coef": 1.0, **options})
        balance = moelab.balance.StepBalance(layer) if "balance_scope" in options else None
        y = layer(torch.randn(shape, generator=torch.Generator().manual_seed(1)))
        assert y._base is None
        if in_place:
            y *= 2
        else:
            y = y * 2
        loss = y.square().mean()
        if balance is not None:
            balance.record()
            loss = loss + balance.loss()
        loss.backward()
        results.append({n: p.grad for n, p in layer.named_parameters()})
    for name, grad in results[0].items():
        torch.testing.assert_close(results[1][name], grad, rtol=0, atol=0, msg=name)


def test_aux_loss_is_a_value_with_no_path_to_the_parameters():
    """``layer.aux_loss`` is the aux loss's value: its gradient reaches the parameters through the
    layer's output (injected in the forward), so differentiating the value itself finds no path and
    torch says so, rather than returning a zero gradient; added to a loss it changes no gradient."""
    layer = moelab.MoE(8, 4, 2, method="smoe")
    x = torch.randn(6, 8)
    y = layer(x)
    assert layer.aux_loss.item() > 0 and layer.aux_loss.grad_fn is None
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(layer.aux_loss, [layer.router.weight])
    with_value = torch.autograd.grad(y.sum() + layer.aux_loss, [layer.router.weight], retain_graph=True)[0]
    without = torch.autograd.grad(y.sum(), [layer.router.weight])[0]
    assert torch.equal(with_value, without)  # the aux gradient is in both, counted once


def test_aux_gradient_is_weighted_by_set_aux_scale():
    layer = moelab.MoE(8, 4, 2, method="smoe", balance_coef=1.0)
    x = torch.randn(10, 8)
    grads = []
    for scale in (1.0, 0.25):
        moelab.set_aux_scale(layer, scale)
        layer.zero_grad()
        (layer(x) * 0).sum().backward()
        grads.append(layer.router.weight.grad.clone())
    torch.testing.assert_close(grads[1], 0.25 * grads[0])


def test_adding_aux_loss_to_the_loss_does_not_count_its_gradient_twice():
    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, 2, method="smoe", balance_coef=1.0)
    x, g = torch.randn(10, 8), torch.randn(10, 8)
    (layer(x) * g).sum().backward()
    without = layer.router.weight.grad.clone()
    layer.zero_grad()
    ((layer(x) * g).sum() + moelab.aux_loss(layer)).backward()
    torch.testing.assert_close(layer.router.weight.grad, without)


def test_aux_loss_weighed_otherwise_than_the_scale_is_refused_in_backward():
    layer = moelab.MoE(8, 4, 2, method="smoe")
    y = layer(torch.randn(10, 8))
    with pytest.raises(
        ValueError, match=r"aux_loss enters this loss with weight 0.5, but .* weight 1; .*set_aux_scale"
    ):
        ((y.sum() + moelab.aux_loss(layer)) / 2).backward()
    moelab.set_aux_scale(layer, 0.5)
    y = layer(torch.randn(10, 8))
    ((y.sum() + moelab.aux_loss(layer)) / 2).backward()  # the same weight: accepted


def test_a_bf16_layer_keeps_its_aux_scale_exact():
    layer = moelab.MoE(8, 4, 2, method="smoe").to(torch.bfloat16)
    assert layer.aux_scale.dtype == layer._aux_values.dtype == torch.float32
    moelab.set_aux_scale(layer, 1 / 3)
    y = layer(torch.randn(10, 8, dtype=torch.bfloat16))
    ((y.float().sum() + moelab.aux_loss(layer)) / 3).backward()  # the weight 1/3, exactly: accepted
    assert layer.router.weight.grad is not None


def test_set_aux_scale_refuses_a_non_number():
    with pytest.raises(ValueError, match=r"scale=nan is not allowed; expected a finite number"):
        moelab.set_aux_scale(moelab.MoE(8, 4, 2), float("nan"))


def test_moelab_aux_loss_sums_every_layer():
    model = nn.Sequential(moelab.MoE(8, 4, 2), nn.ReLU(), moelab.MoE(8, 4, 1, method="xmoe"))
    model(torch.randn(6, 8))
    total = moelab.aux_loss(model)
    torch.testing.assert_close(total, model[0].aux_loss + model[2].aux_loss)
    assert total.item() > 0
    assert moelab.aux_loss(nn.Linear(2, 2)).item() == 0.0


# ------------------------------------------------------------------------------------------ attach
def test_attach_numbers_layers_in_module_order():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = moelab.MoE(4, 2, 1)
            self.blocks = nn.ModuleList(
                [nn.Sequential(nn.Linear(4, 4), moelab.MoE(4, 2, 1)) for _ in range(2)]
            )
            self.z = moelab.MoE(4, 2, 1)

    net = Net()
    ctx = moelab.RoutingContext(total_steps=10)
    layers = moelab.attach(net, ctx)
    assert layers == [net.a, net.blocks[0][1], net.blocks[1][1], net.z]
    assert [layer.layer_index for layer in layers] == [0, 1, 2, 3]
    assert [layer.router.layer_index for layer in layers] == [0, 1, 2, 3]
    assert all(layer.ctx is ctx for layer in layers)


def test_attach_rejects_a_schedule_for_another_depth():
    class Schedule:
        num_layers = 3

        def active(self, layer, step):
            return False

    model = nn.Sequential(moelab.MoE(4, 2, 1), moelab.MoE(4, 2, 1))
    with pytest.raises(
        ValueError, match=r"schedule.num_layers=3 does not match the model, which has 2 MoE layers"
    ):
        moelab.attach(model, moelab.RoutingContext(schedule=Schedule()))
    Schedule.num_layers = 2
    assert len(moelab.attach(model, moelab.RoutingContext(schedule=Schedule()))) == 2


def test_attach_rejects_something_that_is_not_a_context():
    with pytest.raises(
        ValueError, match=r"ctx=\{'step': 0\} is not allowed; expected a moelab.RoutingContext"
    ):
        moelab.attach(moelab.MoE(4, 2, 1), {"step": 0})


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": 0}, r"top_k=0 is not allowed; expected an integer in \[1, 4\]"),
        ({"top_k": 5}, r"top_k=5 is not allowed; expected an integer in \[1, 4\]"),
        ({"top_k": 1.5}, r"top_k=1.5 is not allowed; expected an integer$"),
        ({"d_model": 0}, r"d_model=0 is not allowed; expected a positive integer"),
        ({"num_experts": -1, "top_k": 1}, r"num_experts=-1 is not allowed; expected a positive integer"),
        ({"d_hidden": 0}, r"d_hidden=0 is not allowed; expected a positive integer"),
        ({"method": "moe"}, r"method='moe' is not a moelab method; allowed: \['smoe', .*'hyperrouter'"),
        (
            {"activation": "tanh"},
            r"activation='tanh' is not allowed; expected one of \[.*'gelu', .*'swiglu', 'swiglu_clamp'\]",
        ),
        (
            {"impl": "cuda"},
            r"impl='cuda' is not allowed; expected one of \['auto', 'loop', 'grouped', 'stream', 'triton'\]",
        ),
        ({"balance_coef": -0.1}, r"balance_coef=-0.1 is not allowed; expected a number >= 0"),
        ({"z_coef": float("nan")}, r"z_coef=nan is not allowed; expected a number >= 0"),
        ({"num_shared": -1}, r"num_shared=-1 is not allowed; expected an integer >= 0$"),
        (
            {"temperature": 0.3},
            r"option 'temperature' is not accepted by method='smoe'; allowed: \['balance_coef', 'balance_scope', 'bias_update_rate', 'capacity_factor', 'densemixer', 'entropy_coef', 'erc_alpha', 'erc_coef', 'eval_k', 'frozen', 'importance_coef', 'init_std', 'k_max', 'min_capacity', 'num_shared', 'pad_to_capacity', 'renormalize', 'rounding_tile', 'router_dtype', 'scale', 'selection_bias', 'token_drop_policy', 'token_rounding', 'z_coef'\]",
        ),
        ({"distill_coef": 1.0}, r"option 'distill_coef' is not accepted by method='smoe'"),
        (
            {"method": "stablemoe", "distill_coef": -1.0},
            r"distill_coef=-1.0 is not allowed; expected a number >= 0",
        ),
        ({"method": "xmoe", "temperature": -1.0}, r"temperature=-1.0 is not allowed; expected a number > 0"),
        (
            {"experts": ModuleExperts([nn.Linear(8, 8)] * 3)},
            r"experts.num_experts=3 does not match num_experts=4",
        ),
    ],
)
def test_layer_constructor_rejects_bad_arguments(kwargs, match):
    args = {"d_model": 8, "num_experts": 4, "top_k": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        moelab.MoE(**args)


def test_stablemoe_accepts_its_distill_coefficient():
    assert moelab.MoE(8, 4, 2, method="stablemoe", distill_coef=0.5).coefs["distill"] == 0.5


@pytest.mark.parametrize("shape", [(3, 7), (2, 3, 9), ()])
def test_layer_forward_rejects_a_wrong_last_dimension(shape):
    layer = moelab.MoE(8, 4, 2)
    with pytest.raises(
        ValueError, match=r"input of shape .* is not allowed; expected the last dimension to be d_model=8"
    ):
        layer(torch.randn(shape))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("method", moelab.methods())
def test_non_finite_router_logits_raise_a_clear_error(method, bad):
    layer = moelab.MoE(8, 4, 2, method=method)
    layer.layer_index = 3
    x = torch.randn(5, 8)
    x[2, 1] = bad
    if method == "moepp" and bad == float("inf"):  # its two-layer gate's tanh saturates: finite logits
        layer(x)
        assert torch.isfinite(layer.last_routing.logits).all()
        return
    with pytest.raises(
        RuntimeError,
        match=rf"MoE layer 3 \(method='{method}'\): router logits are not finite.*check_finite=False",
    ):
        layer(x, **doc_inputs(layer, x))


def test_check_finite_false_switches_the_check_off():
    layer = moelab.MoE(8, 4, 2, check_finite=False)
    x = torch.randn(5, 8)
    x[0, 0] = float("nan")
    y = layer(x)
    assert torch.isnan(y[0]).all()
    assert torch.isfinite(y[1:]).all()


# ------------------------------------------------------------------------------------------ Mixtral parity
def test_smoe_swiglu_equals_transformers_mixtral_sparse_block():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = transformers.MixtralConfig(
        hidden_size=16,
        intermediate_size=24,
        num_local_experts=6,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
    )
    hf = MixtralSparseMoeBlock(config).double().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = moelab.MoE(16, 6, 2, d_hidden=24, method="smoe", activation="swiglu").double().eval()
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
        ours.experts.w_in.copy_(hf.experts.gate_up_proj)
        ours.experts.w_out.copy_(hf.experts.down_proj)
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    expected = hf(x)
    y = ours(x)
    _, _, hf_indices = hf.gate(x.reshape(-1, 16))
    assert torch.equal(ours.last_routing.indices.sort(-1).values, hf_indices.sort(-1).values)
    # transformers computes the router softmax in float32, hence the float32-level tolerance
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "method", ["smoe", "xmoe", "pcosine", "sigma-moe", "sharede-v2", "sharede-v3", "hyperrouter"]
)
def test_layer_passes_gradcheck_in_float64(method):
    layer = moelab.MoE(4, 3, 2, d_hidden=3, method=method, activation="silu", impl="loop").double().eval()
    names = [n for n, p in layer.named_parameters() if p.requires_grad]
    params = [p.detach().clone().requires_grad_() for n, p in layer.named_parameters() if p.requires_grad]
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)

    def f(x, *ps):
        y = torch.func.functional_call(layer, dict(zip(names, ps)), (x,))
        return y, layer.aux_loss

    assert torch.autograd.gradcheck(f, (x, *params))


def test_an_inference_forward_computes_no_aux_loss_and_keeps_no_tensor(monkeypatch):
    """Under ``torch.no_grad`` the layer neither computes the aux losses nor keeps its input or
    routing: every tensor it held before the forward is all it holds after."""
    layer = moelab.MoE(8, 4, 2, method="smoe", record_routing=False)
    layer(torch.randn(6, 8))  # a training forward first: nothing of it may survive either
    calls = []
    original = moelab.layer.aux_terms_of
    monkeypatch.setattr(moelab.layer, "aux_terms_of", lambda *a: calls.append(1) or original(*a))

    def held() -> set[int]:
        seen = {id(t) for t in [*layer.parameters(), *layer.buffers()]}
        return {id(v) for v in vars(layer).values() if torch.is_tensor(v)} - seen

    with torch.no_grad():
        layer(torch.randn(3, 8))
    assert calls == [] and layer.recorded_routing is None and held() == set()
    assert layer.aux_loss.item() == 0.0
    layer(torch.randn(3, 8))
    assert calls == [1] and layer.recorded_routing is None and held() == set()


def test_recording_routing_keeps_the_routing_of_an_inference_forward():
    layer = moelab.MoE(8, 4, 2, method="smoe")
    with torch.no_grad(), moelab.recording_routing(layer):
        layer(torch.randn(3, 8))
    layer.record_routing = False
    with torch.no_grad(), moelab.recording_routing(layer):
        layer(torch.randn(3, 8))
    assert layer.last_routing.indices.shape == (3, 2) and layer.record_routing is False
    off = moelab.MoE(8, 4, 2, method="smoe", record_routing=False)
    off(torch.randn(3, 8))
    assert off.recorded_routing is None


def test_record_routing_refuses_a_non_bool():
    with pytest.raises(
        ValueError, match=r"record_routing='yes' is not allowed; expected None, True or False"
    ):
        moelab.MoE(8, 4, 2, record_routing="yes")


@pytest.mark.parametrize("method", moelab.methods())
def test_a_layer_built_on_the_meta_device_works_after_to_empty_and_reset_parameters(method):
    with torch.device("meta"):
        layer = moelab.MoE(8, 4, 2, d_hidden=16, method=method)
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
        assert torch.isfinite(t).all(), name
    # (aoe's w_in holds no rows with a non-GLU activation: nothing to draw)
    # (Default MoE's EMA of expert outputs starts at zero, as a statistic does: not drawn)
    state = [t for n, t in layer.named_buffers() if not n.startswith("router.default_")]
    weights = [t for t in [*layer.parameters(), *state] if t.dim() >= 2 and t.numel()]
    assert weights and all(t.std() > 0 for t in weights)  # drawn, not left as zeros or garbage
    x = torch.randn(5, 8)
    y = layer.eval()(x, **doc_inputs(layer, x))
    assert y.shape == (5, 8) and torch.isfinite(y).all()


def test_reset_parameters_draws_the_init_of_construction():
    torch.manual_seed(3)
    built = moelab.MoE(8, 4, 2, method="xmoe")
    torch.manual_seed(3)
    again = moelab.MoE(8, 4, 2, method="xmoe")
    torch.manual_seed(3)
    again.router.reset_parameters()
    torch.testing.assert_close(again.router.proj.weight, built.router.proj.weight)


def test_inputs_of_a_wrong_dtype_are_refused_in_one_line():
    layer = moelab.MoE(8, 4, 2)
    with pytest.raises(
        ValueError, match=r"input of dtype torch.int64 is not allowed; expected a floating-point tensor"
    ):
        layer(torch.ones(3, 8, dtype=torch.long))
    with pytest.raises(
        ValueError,
        match=r"input of dtype torch.float16 is not allowed; expected the layer's dtype torch.float32",
    ):
        layer(torch.ones(3, 8, dtype=torch.float16))


class _AlwaysCompete:
    def active(self, layer: int, step: int) -> bool:
        return True

    def state_dict(self) -> dict:
        return {}


@pytest.mark.parametrize("method", moelab.methods())
def test_every_method_trains_under_bf16_autocast(method):
    """A training step under ``torch.autocast(bfloat16)`` on float32 parameters, on a competition
    step for the competition methods (whose expert backward once refused bf16 rows): finite
    float32 gradients for every parameter that gets one."""
    layer = moelab.MoE(16, 4, 2, 32, method=method)
    moelab.attach(layer, moelab.RoutingContext(total_steps=10, schedule=_AlwaysCompete()))
    x = torch.randn(32, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x, **doc_inputs(layer, x))
    y.float().square().mean().backward()
    grads = [p.grad for p in layer.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


# ------------------------------------------------------------------------------------------ router dtype
def test_router_dtype_float32_routes_under_bf16_autocast_as_in_float32():
    """Under bf16 autocast the router's logits run in bf16 and some tokens change their experts;
    ``router_dtype="float32"`` computes logits, softmax and top-K in float32: the experts chosen
    are those of a float32 forward."""
    torch.manual_seed(0)
    x = torch.randn(4096, 32)
    plain = moelab.MoE(32, 16, 2, method="smoe")
    fp32 = moelab.MoE(32, 16, 2, method="smoe", router_dtype="float32")
    fp32.load_state_dict(plain.state_dict())
    want = plain.router(x).indices
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain(x)
        fp32(x)
    assert not torch.equal(plain.last_routing.indices, want)  # bf16 logits move some tokens
    assert torch.equal(fp32.last_routing.indices, want)
    assert fp32.last_routing.logits.dtype == torch.float32


def test_router_dtype_applies_to_the_base_router_of_competesmoe():
    layer = moelab.MoE(16, 4, 2, method="competesmoe", router_dtype="float32")
    assert layer.router.base.compute_dtype == torch.float32 and layer.router.compute_dtype is None


def test_router_dtype_refusals():
    with pytest.raises(
        ValueError, match=r"router_dtype='float16' is not allowed; expected one of \['float32'\]"
    ):
        moelab.MoE(8, 4, 2, router_dtype="float16")
    with pytest.raises(
        ValueError, match=r"router_dtype='float32' is not allowed with method='competition', which"
    ):
        moelab.MoE(8, 4, 2, method="competition", router_dtype="float32")
    layer = moelab.MoE(8, 4, 2, router_dtype="float32").to(torch.bfloat16)
    with pytest.raises(ValueError) as err:
        layer(torch.randn(3, 8, dtype=torch.bfloat16))
    assert str(err.value) == (
        "router_dtype='float32' needs the router's parameters in float32; weight is torch.bfloat16 (keep the "
        "router in float32, layer.router.float(), and run the rest under torch.autocast or in bf16; under FSDP2 "
        "mixed precision use parallelize(..., mp_policy=...), which keeps it float32)"
    )


def test_router_dtype_float32_routes_a_bf16_layer_on_bf16_tokens_with_a_float32_router():
    """A bf16 layer whose router is kept in float32 (what FSDP2 mixed precision gathers) takes bf16
    tokens without autocast (the input's dtype is the experts' then, not the router's): the
    routing of the float32 router on those tokens, the output in bf16."""
    torch.manual_seed(0)
    layer = moelab.MoE(16, 4, 2, router_dtype="float32", record_routing=True)
    layer.to(torch.bfloat16).router.float()
    x = torch.randn(32, 16).bfloat16()
    y = layer(x)
    assert y.dtype == torch.bfloat16 and layer.last_routing.logits.dtype == torch.float32
    assert torch.equal(layer.last_routing.indices, layer.router(x.float()).indices)


# ------------------------------------------------------------------------------------------ token mask
def test_masked_tokens_count_in_no_statistic_and_get_output_zero():
    """A padded batch with a mask: the real tokens get the outputs, aux loss and routing of the
    batch without the padding (transformers' balance loss with attention_mask)."""
    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, 2, method="sharede-v3")
    x = torch.randn(2, 5, 8)
    mask = torch.tensor([[True, True, True, False, False], [True, True, True, True, False]])
    y = layer(x, token_mask=mask)
    aux, routing = layer.aux_loss, layer.last_routing
    real = layer(x[mask])
    torch.testing.assert_close(y[mask], real)
    assert (y[~mask] == 0).all()
    torch.testing.assert_close(aux, layer.aux_loss)
    assert torch.equal(routing.indices, layer.last_routing.indices) and routing.indices.shape == (7, 2)


def test_token_mask_refusals():
    layer = moelab.MoE(8, 4, 2)
    with pytest.raises(
        ValueError, match=r"token_mask of shape \(2, 4\) is not allowed; expected .*, \(2, 5\)"
    ):
        layer(torch.randn(2, 5, 8), token_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(
        ValueError, match=r"token_mask of dtype torch.int64 is not allowed; expected torch.bool"
    ):
        layer(torch.randn(2, 5, 8), token_mask=torch.ones(2, 5, dtype=torch.long))
    scoped = moelab.MoE(8, 4, 2, balance_scope="sequence")
    with pytest.raises(
        ValueError, match=r"token_mask is not allowed with balance_scope='sequence' \(the masked"
    ):
        scoped(torch.randn(2, 5, 8), token_mask=torch.ones(2, 5, dtype=torch.bool))


# ------------------------------------------------------------------------------------------ capacity
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_the_slots_over_each_experts_capacity(policy):
    """Each expert keeps at most ``ceil(factor · T · K / N)`` slots — its highest weights
    (``probs``) or its earliest tokens (``position``) — and a dropped slot adds nothing."""
    torch.manual_seed(0)
    T, N, K, factor = 64, 4, 2, 0.5
    free = moelab.MoE(8, N, K, method="smoe")
    capped = moelab.MoE(8, N, K, method="smoe", capacity_factor=factor, token_drop_policy=policy)
    capped.load_state_dict(free.state_dict())
    x = torch.randn(T, 8)
    r = free.router(x)
    capacity = math.ceil(factor * T * K / N)
    keep = torch.zeros(T, K, dtype=torch.bool)
    for e in range(N):  # the literal rule, expert by expert
        t, k = (r.indices == e).nonzero(as_tuple=True)
        order = (
            r.weights[t, k].argsort(descending=True, stable=True)
            if policy == "probs"
            else torch.arange(len(t))
        )
        keep[t[order[:capacity]], k[order[:capacity]]] = True
    want = free.experts.mix(x, r.indices, r.weights * keep)
    torch.testing.assert_close(capped(x), want)
    assert capped.dropped_fraction == pytest.approx(1 - keep.float().mean().item())
    assert capped.dropped_fraction > 0


def test_a_large_capacity_drops_nothing():
    torch.manual_seed(0)
    free = moelab.MoE(8, 4, 2, method="xmoe")
    capped = moelab.MoE(8, 4, 2, method="xmoe", capacity_factor=4.0)
    capped.load_state_dict(free.state_dict())
    x = torch.randn(32, 8)
    torch.testing.assert_close(capped(x), free(x))
    assert capped.dropped_fraction == 0.0


def test_capacity_refusals():
    with pytest.raises(ValueError, match=r"capacity_factor=0 is not allowed; expected a number > 0"):
        moelab.MoE(8, 4, 2, capacity_factor=0)
    with pytest.raises(ValueError, match=r"token_drop_policy='random' is not allowed; expected one of"):
        moelab.MoE(8, 4, 2, capacity_factor=1.0, token_drop_policy="random")
    with pytest.raises(
        ValueError, match=r"token_drop_policy='position' is not allowed without capacity_factor"
    ):
        moelab.MoE(8, 4, 2, token_drop_policy="position")
    with pytest.raises(
        ValueError, match=r"capacity_factor=1.0 is not allowed with method='top-p': it routes a variable"
    ):
        moelab.MoE(8, 4, 2, method="top-p", capacity_factor=1.0)
    with pytest.raises(ValueError, match=r"^min_capacity=4 is not allowed without capacity_factor; expected"):
        moelab.MoE(8, 4, 2, min_capacity=4)
    with pytest.raises(ValueError, match=r"^min_capacity=-1 is not allowed; expected an integer >= 0$"):
        moelab.MoE(8, 4, 2, capacity_factor=1.0, min_capacity=-1)


def test_min_capacity_keeps_that_many_slots_per_expert_where_the_factor_would_keep_fewer():
    """DeepSpeed's ``min_capacity``: C = min(max(ceil(f·T·K/N), min_capacity), T); the default 0
    leaves the factor's C."""
    from moelab.experts.capacity import expert_capacity

    assert expert_capacity(0.5, 6, 1, 4) == 1 and expert_capacity(0.5, 6, 1, 4, minimum=3) == 3
    assert expert_capacity(0.5, 2, 1, 4, minimum=3) == 2  # never more than one slot a token
    torch.manual_seed(0)
    low = moelab.MoE(8, 4, 1, capacity_factor=0.5)
    floor = moelab.MoE(8, 4, 1, capacity_factor=0.5, min_capacity=3)
    floor.load_state_dict(low.state_dict())
    x = torch.randn(6, 8)
    with torch.no_grad(), moelab.recording_routing(low), moelab.recording_routing(floor):
        low(x), floor(x)
    kept = [int(layer.last_routing.keep.sum()) for layer in (low, floor)]
    per_expert = torch.bincount(floor.last_routing.indices[floor.last_routing.keep], minlength=4)
    assert kept[1] > kept[0] and int(per_expert.max()) <= 3
    assert low.dropped_fraction > floor.dropped_fraction


def _padded_pair(K: int, policy: str, factor: float = 0.6, **kw) -> tuple[moelab.MoE, moelab.MoE]:
    """A capacity layer and its ``pad_to_capacity`` twin with the same weights (float64)."""
    torch.manual_seed(0)
    opts = dict(
        method="smoe", activation="swiglu", bias=True, capacity_factor=factor, token_drop_policy=policy
    )
    plain = moelab.MoE(8, 4, K, 16, **opts, **kw).double()
    padded = moelab.MoE(8, 4, K, 16, **opts, pad_to_capacity=True, **kw).double()
    padded.load_state_dict(plain.state_dict())
    return plain, padded


def _forward_backward(layer: moelab.MoE, x: torch.Tensor, g: torch.Tensor):
    x = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    ((y * g).sum() + layer.aux_loss).backward()
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("K", [1, 2])
def test_pad_to_capacity_equals_the_unpadded_capacity_path_forward_and_gradients(policy, K):
    plain, padded = _padded_pair(K, policy)
    gen = torch.Generator().manual_seed(1)
    x, g = (
        torch.randn(48, 8, generator=gen, dtype=torch.float64),
        torch.randn(48, 8, generator=gen, dtype=torch.float64),
    )
    want, got = _forward_backward(plain, x, g), _forward_backward(padded, x, g)
    assert padded.dropped_fraction == plain.dropped_fraction > 0.1  # the capacity drops slots here
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        assert got[2][name] is not None, name
        torch.testing.assert_close(got[2][name], want[2][name], msg=name)


def test_pad_to_capacity_gives_every_expert_exactly_c_rows_kept_tokens_first(monkeypatch):
    """The experts see ``(N, C, d)`` for two routings with different per-expert loads: each
    expert's kept tokens (in token order), then zero rows; the dropped slots are not there."""
    from moelab.experts import bank as bank_module
    from moelab.experts.capacity import capacity_keep

    _, padded = _padded_pair(2, "probs", factor=1.25)
    seen = []
    real = bank_module.padded_rows

    def spy(xs, experts):
        seen.append(xs.detach().clone())
        return real(xs, experts)

    monkeypatch.setattr(bank_module, "padded_rows", spy)
    T, N, K = 40, 4, 2
    C = math.ceil(1.25 * T * K / N)
    loads = []
    for seed in (0, 1):
        x = torch.randn(T, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        with torch.no_grad():
            padded(x)
            r = padded.router(x)
        keep = capacity_keep(r.indices, r.weights, N, C, "probs")
        xs = seen[-1]
        assert xs.shape == (N, C, 8)
        load = []
        for e in range(N):
            tokens = (r.indices == e).logical_and(keep).any(1).nonzero().squeeze(1)  # kept, in token order
            n = tokens.numel()
            load.append(n)
            torch.testing.assert_close(xs[e, :n], x[tokens], rtol=0, atol=0)
            assert (xs[e, n:] == 0).all()
        loads.append(load)
    assert loads[0] != loads[1]  # different routings, the same shape
    assert min(min(load) for load in loads) < C  # padding rows
    assert max(max(load) for load in loads) == C  # and dropped slots


def test_pad_to_capacity_under_bfloat16_autocast_returns_the_unpadded_dtype_to_bf16_rounding():
    torch.manual_seed(0)
    plain = moelab.MoE(64, 8, 2, 128, activation="swiglu", capacity_factor=1.0, router_dtype="float32")
    padded = moelab.MoE(
        64, 8, 2, 128, activation="swiglu", capacity_factor=1.0, router_dtype="float32", pad_to_capacity=True
    )
    padded.load_state_dict(plain.state_dict())
    x = torch.randn(256, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = plain(x), padded(x)
    assert got.dtype == want.dtype == torch.float32
    assert padded.dropped_fraction == plain.dropped_fraction > 0
    assert (got - want).abs().max() < 2e-2 * want.abs().max()  # bf16 matmuls in both (8 mantissa bits)


def test_pad_to_capacity_runs_another_bank_through_its_forward():
    torch.manual_seed(0)
    experts = [nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 8)) for _ in range(4)]
    plain = moelab.MoE(8, 4, 2, experts=ModuleExperts(experts), capacity_factor=0.5).double()
    twins = ModuleExperts(copy.deepcopy(experts))
    padded = moelab.MoE(8, 4, 2, experts=twins, capacity_factor=0.5, pad_to_capacity=True).double()
    padded.load_state_dict(plain.state_dict())
    x, g = torch.randn(32, 8, dtype=torch.float64), torch.randn(32, 8, dtype=torch.float64)
    want, got = _forward_backward(plain, x, g), _forward_backward(padded, x, g)
    assert padded.dropped_fraction > 0
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], msg=name)


def test_pad_to_capacity_compiles_once_for_different_routings():
    """``torch.compile(fullgraph=True, dynamic=False)``: two batches whose experts receive
    different numbers of tokens run the one graph (no recompilation), equal to eager."""
    import torch._dynamo.testing
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    layer = moelab.MoE(16, 4, 2, 32, activation="swiglu", capacity_factor=1.0, pad_to_capacity=True)
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=False)
    loads = []
    try:
        for seed in (0, 1):
            x = torch.randn(32, 16, generator=torch.Generator().manual_seed(seed)) * (1 + seed)
            y = compiled(x)
            y.sum().backward()
            torch.testing.assert_close(y, layer(x))
            loads.append(torch.bincount(layer.router(x).indices.flatten(), minlength=4).tolist())
        assert loads[0] != loads[1]
        assert counter.frame_count == 1
        assert sum(counters["recompiles"].values()) == 0
    finally:
        torch._dynamo.reset()


def test_pad_to_capacity_refusals():
    with pytest.raises(
        ValueError,
        match=r"^pad_to_capacity=True is not allowed without capacity_factor; expected capacity_factor",
    ):
        moelab.MoE(8, 4, 2, pad_to_capacity=True)
    with pytest.raises(ValueError, match=r"^pad_to_capacity='yes' is not allowed; expected True or False$"):
        moelab.MoE(8, 4, 2, capacity_factor=1.0, pad_to_capacity="yes")
    with pytest.raises(
        ValueError, match=r"^pad_to_capacity=True is not allowed with method='competesmoe': its router runs"
    ):
        moelab.MoE(8, 4, 2, method="competesmoe", capacity_factor=1.0, pad_to_capacity=True)
    with pytest.raises(
        ValueError, match=r"^pad_to_capacity=True is not allowed with densemixer=True: DenseMixer"
    ):
        moelab.MoE(8, 4, 2, capacity_factor=1.0, pad_to_capacity=True, densemixer=True)
    with pytest.raises(
        ValueError, match=r"^pad_to_capacity=True is not allowed with impl='loop': the padded"
    ):
        moelab.MoE(8, 4, 2, impl="loop", capacity_factor=1.0, pad_to_capacity=True)
    moelab.MoE(8, 4, 2, capacity_factor=1.0, pad_to_capacity=False)  # False needs nothing


def test_an_input_that_is_not_a_tensor_or_model_is_refused_naming_it():
    layer = moelab.MoE(4, 2, 1)
    with pytest.raises(
        ValueError,
        match=r"^input of type list is not allowed; expected a torch.Tensor of shape \(..., d_model=4\)$",
    ):
        layer([[1.0, 2.0, 3.0, 4.0]])
    for call in (
        moelab.aux_loss,
        moelab.layer.moe_layers,
        lambda m: moelab.attach(m, moelab.RoutingContext()),
    ):
        with pytest.raises(ValueError, match=r"^model=3 is not allowed; expected a torch.nn.Module$"):
            call(3)


# ------------------------------------------------------------ a context that drives step-dependent routing
STEP_DEPENDENT = ["sharede-v3", "stablemoe", "smoe-dropout", "competesmoe", "densemoe", "competesmoe-v1"]


def _train(model, steps, ctx=None, advance=False, before_step=False, micro=1):
    """``steps`` optimizer steps of a toy loss; the warnings they give."""
    import warnings

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    model.train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(steps):
            for _ in range(micro):  # gradient accumulation: several forwards per optimizer step
                (model(x).pow(2).mean() + moelab.aux_loss(model)).backward()
            if advance and before_step:
                ctx.advance()
            opt.step()
            opt.zero_grad()
            if advance and not before_step:
                ctx.advance()
    return [str(w.message) for w in caught if "RoutingContext" in str(w.message)]


def _two_layers(method):
    return nn.Sequential(moelab.MoE(16, 8, 2, method=method), moelab.MoE(16, 8, 2, method=method))


@pytest.fixture
def _fresh_context_warnings():
    """Python's default warning filter: a warning shown once per place and text (the no-context
    warning relies on it, as any library warning)."""
    import warnings

    with warnings.catch_warnings():
        warnings.resetwarnings()
        yield


@pytest.mark.usefixtures("_fresh_context_warnings")
@pytest.mark.parametrize("method", STEP_DEPENDENT)
def test_a_step_dependent_method_says_once_that_it_trains_without_a_context(method):
    told = _train(_two_layers(method), 4)
    assert len(told) == 1, told  # once, for both layers and every step, naming the method itself
    assert told[0].startswith(f"MoE layer of method={method!r} trains without a RoutingContext that drives")
    assert "no RoutingContext" in told[0] and "moelab.routing_context(model, total_steps)" in told[0]


@pytest.mark.usefixtures("_fresh_context_warnings")
@pytest.mark.parametrize("method", STEP_DEPENDENT)
def test_a_step_dependent_method_says_once_that_its_context_does_not_advance(method):
    model = _two_layers(method)
    ctx = moelab.routing_context(model, total_steps=20)
    told = _train(model, 4, ctx)
    assert len(told) == 1, told
    assert told[0].startswith(
        f"MoE layer of method={method!r} trains with a RoutingContext that does not advance: an optimizer "
        "stepped since the last training forward, but ctx.step stayed 0; "
    )
    assert told[0].endswith("Call ctx.advance() once after every optimizer step")


@pytest.mark.usefixtures("_fresh_context_warnings")
def test_a_context_that_advances_in_either_order_or_accumulates_is_not_told_anything():
    for before_step, micro in [(False, 1), (True, 1), (False, 3)]:
        model = _two_layers("sharede-v3")
        ctx = moelab.routing_context(model, total_steps=20)
        assert _train(model, 4, ctx, advance=True, before_step=before_step, micro=micro) == []
        assert all(m.router.selection_bias.abs().sum() > 0 for m in model)  # it balanced
    for method in ("smoe", "xmoe", "sigma-moe"):  # nothing of theirs depends on the step
        assert _train(_two_layers(method), 3) == []


@pytest.mark.usefixtures("_fresh_context_warnings")
def test_a_context_without_what_the_router_needs_is_named():
    model = _two_layers("smoe-dropout")
    moelab.attach(model, moelab.RoutingContext())  # no total_steps: K never grows
    assert "the RoutingContext has no total_steps; its K grows from top_k=2 to k_max=8" in _train(model, 2)[0]
    model = _two_layers("sharede-v3")
    ctx = moelab.RoutingContext(total_steps=10)
    for layer in model:  # set by hand, not by attach: the bias hook is not registered
        layer.ctx = ctx
    assert (
        "its step hook is not registered with the RoutingContext (moelab.attach registers it)"
        in (_train(model, 2, ctx, advance=True)[0])
    )
    model = _two_layers("competesmoe")
    moelab.attach(model, moelab.RoutingContext(total_steps=10))
    assert "the RoutingContext holds no schedule; it competes on the steps" in _train(model, 2)[0]


def test_a_training_forward_sets_no_router_attribute():
    def plain(model):  # the routers' (the layer keeps its last routing and aux loss by design)
        return {
            (i, name, k): v
            for i, layer in enumerate(model)
            for name, m in layer.router.named_modules()
            for k, v in vars(m).items()
            if isinstance(v, (bool, int, float, str, type(None)))
        }

    for method in STEP_DEPENDENT:
        model = _two_layers(method).train()
        before = plain(model)
        model(torch.randn(8, 16))  # no context: it warns, and records that outside the modules
        assert plain(model) == before, method


def test_reading_a_routing_that_was_not_recorded_says_how_to_record_it():
    """An evaluation forward without gradients records no routing: reading ``last_routing`` then
    refuses in one line naming ``record_routing=True`` and ``moelab.recording_routing``, rather than
    an ``AttributeError`` on ``None``; ``recorded_routing`` is ``None`` for code that tolerates it."""
    layer = moelab.MoE(8, 4, 2).eval()
    with torch.no_grad():
        layer(torch.randn(3, 8))
    assert layer.recorded_routing is None
    with pytest.raises(
        RuntimeError,
        match=r"^MoE layer 0 kept no routing of its last forward .*record_routing=True or the forward "
        r"inside moelab.recording_routing\(model\)$",
    ):
        layer.last_routing  # noqa: B018
    with torch.no_grad(), moelab.recording_routing(layer):
        layer(torch.randn(3, 8))
    assert layer.last_routing.probs.shape == (3, 4)
