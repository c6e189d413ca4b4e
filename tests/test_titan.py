"""A moelab router in torchtitan's MoE (torchtitan 0.3; skipped where it is not installed)."""

from __future__ import annotations

import pytest
import torch

import moelab
from moelab.train.titan import TitanRouter, titan_moe

D, N, K, H = 16, 4, 2, 8
NO_AUX = {"balance_coef": 0.0, "z_coef": 0.0}  # torchtitan's MoE has no aux-loss channel


def _titan_with_moelab_router(method: str):
    """torchtitan's MoE with the router of a moelab layer and that layer's expert weights."""
    pytest.importorskip("torchtitan.models.common.moe")
    # no shared experts: the comparison is of the routed part (torchtitan adds its own shared experts)
    layer = moelab.MoE(
        D, N, K, d_hidden=H, activation="swiglu", method=method, num_shared=0, balance_coef=0.0, z_coef=0.0
    )
    return layer, titan_moe(layer, router=TitanRouter(layer))


@pytest.mark.parametrize(
    ("method", "top_k", "num_shared", "options"),
    [("smoe", K, 0, {}), ("smoe", K, 1, {}), ("smoe", 1, 0, {}), ("sharede-v2", K, 1, {"scale": 2.5})],
)
def test_titan_moe_computes_a_softmax_top_k_layer_with_its_weights(method, top_k, num_shared, options):
    pytest.importorskip("torchtitan.models.common.moe")
    torch.manual_seed(0)
    layer = moelab.MoE(
        D,
        N,
        top_k,
        d_hidden=H,
        activation="swiglu",
        method=method,
        num_shared=num_shared,
        **NO_AUX,
        **options,
    )
    layer.eval()
    titan = titan_moe(layer)
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        ours, theirs = layer(x), titan(x)
    # torchtitan's experts compute in bfloat16: agreement to its rounding, not bit for bit
    assert (theirs - ours).abs().max() < 2e-2 * ours.abs().max()


def test_titan_moe_refuses_what_torchtitans_moe_cannot_compute():
    pytest.importorskip("torchtitan.models.common.moe")
    with pytest.raises(ValueError, match=r"^layer of type Linear is not allowed; expected a moelab\.MoE$"):
        titan_moe(torch.nn.Linear(D, D))
    with pytest.raises(
        ValueError, match=r"^layer with activation='relu', bias=False is not allowed; expected SwiGLU"
    ):
        titan_moe(moelab.MoE(D, N, K, d_hidden=H, activation="relu"))
    with pytest.raises(ValueError, match=r"^layer with activation='swiglu', bias=True is not allowed"):
        titan_moe(moelab.MoE(D, N, K, d_hidden=H, activation="swiglu", bias=True))
    with pytest.raises(
        ValueError, match=r"^capacity_factor=1.0 is not allowed; expected None \(torchtitan's MoE keeps"
    ):
        titan_moe(moelab.MoE(D, N, K, d_hidden=H, activation="swiglu", capacity_factor=1.0, **NO_AUX))
    swiglu = {"d_hidden": H, "activation": "swiglu", **NO_AUX}
    for method, options in [("xmoe", {}), ("smoe-dropout", {}), ("sharede-v3", {}), ("smoe", {"eval_k": 1})]:
        with pytest.raises(
            ValueError, match=rf"^method='{method}' is not allowed without router=: its routing is not"
        ):
            titan_moe(moelab.MoE(D, N, K, method=method, **swiglu, **options))


@pytest.mark.slow
def test_torchtitans_moe_with_a_moelab_router_compiles():
    torch.manual_seed(0)
    layer, titan = _titan_with_moelab_router("smoe")
    x = torch.randn(2, 5, D)
    eager = titan(x).detach()
    compiled = torch.compile(titan)(x)
    assert (compiled - eager).abs().max().item() < 3e-2 * eager.abs().max().item()  # bfloat16 experts
    compiled.pow(2).sum().backward()
    assert layer.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("method", ["smoe", "sharede-v3", "xmoe"])
def test_a_moelab_router_decides_in_torchtitans_moe_as_in_moelabs_layer(method):
    torch.manual_seed(0)
    layer, titan = _titan_with_moelab_router(method)
    x = torch.randn(2, 5, D)
    ours = layer(x)
    theirs = titan(x)
    # torchtitan's grouped experts compute in bfloat16
    assert (theirs - ours).abs().max().item() < 3e-2 * ours.abs().max().item()
    theirs.pow(2).sum().backward()
    grads = [p.grad for p in layer.router.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_what_torchtitans_moe_cannot_give_a_moelab_router_is_refused():
    with pytest.raises(ValueError, match=r"^layer of type Linear is not allowed; expected a moelab\.MoE$"):
        TitanRouter(torch.nn.Linear(D, D))
    with pytest.raises(ValueError, match=r"^method='smoe' with aux-loss coefficients \{'balance': 0\.01"):
        TitanRouter(moelab.MoE(D, N, K, method="smoe"))
    with pytest.raises(
        ValueError, match=r"^method='competesmoe' is not allowed in torchtitan's MoE: its router"
    ):
        TitanRouter(moelab.MoE(D, N, K, method="competesmoe", balance_coef=0.0, competition_balance_coef=0.0,
                               distill_coef=0.0, diversity_coef=0.0, z_coef=0.0))  # fmt: skip
    router = TitanRouter(moelab.MoE(D, N, K, method="smoe", balance_coef=0.0, z_coef=0.0))
    with pytest.raises(ValueError, match=r"^torchtitan's expert_bias_E is not allowed with a moelab router"):
        router(torch.randn(1, 3, D), torch.zeros(N))


def test_titan_refuses_the_aux_losses_and_the_capacity_its_moe_would_drop():
    pytest.importorskip("torchtitan.models.common.moe")
    swiglu = {"d_hidden": H, "activation": "swiglu"}
    with pytest.raises(
        ValueError, match=r"^method='smoe' with aux-loss coefficients \{'balance': 0\.01.*dropped"
    ):
        titan_moe(moelab.MoE(D, N, K, **swiglu))  # torchtitan's own router: the balance loss is lost
    with pytest.raises(ValueError, match=r"^method='smoe' with aux-loss coefficients \{'z': 0\.001\}"):
        titan_moe(moelab.MoE(D, N, K, balance_coef=0.0, z_coef=0.001, **swiglu))
    capped = moelab.MoE(D, N, K, capacity_factor=1.0, **NO_AUX, **swiglu)
    with pytest.raises(
        ValueError,
        match=r"^capacity_factor=1.0 is not allowed; expected None \(torchtitan's MoE keeps every token, the capacity would not be applied\)$",
    ):
        TitanRouter(capped)


def test_titan_refuses_a_router_that_changes_the_experts_input():
    """latent-prototype's aligner adds to the routed experts' input, which torchtitan's MoE would not
    see; without the aligner the router decides as in moelab's layer."""
    no_aux = {"latent_kl_coef": 0.0, "prototype_diversity_coef": 0.0, "prototype_alignment_coef": 0.0}
    router = TitanRouter(moelab.MoE(D, N, K, method="latent-prototype", **NO_AUX, **no_aux))
    with pytest.raises(
        ValueError,
        match=r"^a router that changes the experts' input \(latent-prototype's aligner\) is not allowed in "
        r"torchtitan's MoE; use moelab's layer, or aligner=False$",
    ):
        router(torch.randn(1, 3, D))
    plain = TitanRouter(moelab.MoE(D, N, K, method="latent-prototype", aligner=False, **NO_AUX, **no_aux))
    weights, indices, _ = plain(torch.randn(1, 3, D))
    assert weights.shape == indices.shape == (1, 3, K)
