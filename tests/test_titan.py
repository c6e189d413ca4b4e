"""A moelab router in torchtitan's MoE (torchtitan 0.3; skipped where it is not installed)."""

from __future__ import annotations

import pytest
import torch

import moelab
from moelab.train.titan import TitanRouter

D, N, K, H = 16, 4, 2, 8


def _titan_moe(load_balance_coeff=None):
    moe = pytest.importorskip("torchtitan.models.common.moe")
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    config = moe.MoE.Config(
        num_experts=N,
        routed_experts=moe.RoutedExperts.Config(
            inner_experts=moe.GroupedExperts.Config(dim=D, hidden_dim=H, num_experts=N),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=N, top_k=K),
        ),
        router=moe.TokenChoiceTopKRouter.Config(
            gate=Linear.Config(in_features=D, out_features=N), num_experts=N, top_k=K
        ),
        load_balance_coeff=load_balance_coeff,
    )
    return config.build()


def _titan_with_moelab_router(method: str):
    """torchtitan's MoE with the router of a moelab layer and that layer's expert weights."""
    # no shared experts: the comparison is of the routed part (torchtitan adds its own shared experts)
    layer = moelab.MoE(
        D, N, K, d_hidden=H, activation="swiglu", method=method, num_shared=0, balance_coef=0.0, z_coef=0.0
    )
    titan = _titan_moe()
    titan.router = TitanRouter(layer)
    experts = titan.routed_experts.inner_experts
    with torch.no_grad():  # moelab's swiglu w_in is [gate | up]; torchtitan's w1 gate, w3 up
        experts.w1_EFD.copy_(layer.experts.w_in[:, :H])
        experts.w3_EFD.copy_(layer.experts.w_in[:, H:])
        experts.w2_EDF.copy_(layer.experts.w_out)
    return layer, titan


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
