"""The expert–router coupling (ERC) loss (Lv et al. 2025, "Coupling Experts and Routers in
Mixture-of-Experts via an Auxiliary Loss"): against a literal computation, its proxy-token noise, the
``erc_coef`` option of any linear router, its refusals, and the layer grid of the ``erc`` preset."""

from __future__ import annotations

import math

import pytest
import torch

import moelab
from moelab.experts import ModuleExperts
from moelab.losses import erc_loss, erc_noise
from router_grid import IMPLS, D, H, K, N, check_compile, check_kernel, check_save_load


def literal_erc(r, wg, alpha, delta):
    """``M[i][j] = ‖W_g^j (R_i ⊙ δ_i)‖`` one number at a time, then
    ``(1/N²) Σ_i Σ_{j≠i} max(0, M[i][j] − α M[i][i]) + max(0, M[j][i] − α M[i][i])``."""
    r, wg, delta = r.tolist(), wg.tolist(), delta.tolist()
    n = len(r)
    proxy = [[a * b for a, b in zip(r[i], delta[i])] for i in range(n)]
    m = [
        [math.sqrt(sum(sum(w * p for w, p in zip(row, proxy[i])) ** 2 for row in wg[j])) for j in range(n)]
        for i in range(n)
    ]
    total = 0.0
    for i in range(n):
        for j in range(n):
            if j != i:
                total += max(0.0, m[i][j] - alpha * m[i][i]) + max(0.0, m[j][i] - alpha * m[i][i])
    return total / n**2


def literal_eps(r):
    rows = r.tolist()
    out = []
    for i, ri in enumerate(rows):
        nearest = min(math.dist(ri, rj) for j, rj in enumerate(rows) if j != i)
        out.append(nearest / (2 * math.sqrt(sum(v * v for v in ri))))
    return out


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_erc_loss_is_the_literal_coupling_penalty(alpha):
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    wg = torch.randn(5, 4, 6, generator=gen, dtype=torch.float64)
    delta = 1 + 0.1 * torch.randn(5, 6, generator=gen, dtype=torch.float64)
    got = erc_loss(r, wg, alpha, delta)
    assert got.item() == pytest.approx(literal_erc(r, wg, alpha, delta), rel=1e-12)
    assert got.item() > 0  # random rows and gates violate the coupling
    assert erc_loss(r, wg, alpha).item() == pytest.approx(
        literal_erc(r, wg, alpha, torch.ones_like(r)), rel=1e-12
    )


def test_erc_loss_is_zero_when_each_expert_reacts_most_to_its_own_row():
    r = torch.eye(4, 6)
    wg = torch.stack([torch.eye(4, 6)[i : i + 1].repeat(3, 1) for i in range(4)])  # expert j sees only axis j
    assert erc_loss(r, wg, 1.0).item() == 0.0
    assert erc_loss(r, wg.flip(0), 1.0).item() > 0  # the experts swapped: each fires on another's row


def test_erc_noise_stays_within_the_bound_that_keeps_each_proxy_in_its_cluster():
    gen = torch.Generator().manual_seed(1)
    r = torch.randn(4, 3000, generator=gen, dtype=torch.float64)
    delta = erc_noise(r, generator=gen)
    eps = torch.tensor(literal_eps(r), dtype=torch.float64)
    assert (delta >= 1 - eps[:, None]).all() and (delta <= 1 + eps[:, None]).all()
    # uniform over the whole interval: its extremes are reached to within a small fraction
    assert ((delta.max(1).values - 1) / eps).min() > 0.99 and ((1 - delta.min(1).values) / eps).min() > 0.99
    proxy = r * delta
    assert torch.cdist(proxy, r).argmin(1).tolist() == [0, 1, 2, 3]  # each proxy stays nearest its own row
    assert not delta.requires_grad


def _layer(method="erc", **kw):
    torch.manual_seed(0)
    return moelab.MoE(D, N, K, d_hidden=H, method=method, activation="swiglu", **kw)


def test_erc_layer_aux_loss_is_its_coefficient_times_the_loss_with_fresh_noise():
    layer = _layer(erc_coef=2.0, erc_alpha=0.7, balance_coef=0.0, z_coef=0.0)
    assert layer.coefs == {"erc": 2.0} and layer.erc_alpha == 0.7
    x = torch.randn(6, D)
    torch.manual_seed(7)
    layer(x)  # a training forward forms the aux loss (and draws the noise)
    r, gate = layer.router.weight.detach(), layer.experts.w_in.detach()[:, :H]  # swiglu: [gate | up]
    torch.manual_seed(7)
    delta = erc_noise(r)
    assert layer.aux_loss.item() == pytest.approx(2.0 * literal_erc(r, gate, 0.7, delta), rel=1e-6)
    assert layer.aux_values()["erc"].item() == pytest.approx(layer.aux_loss.item())
    layer(x)  # the next forward draws other noise
    assert layer.aux_loss.item() != pytest.approx(2.0 * literal_erc(r, gate, 0.7, delta), rel=1e-6)
    assert layer.erc_loss(noise=None).item() == pytest.approx(
        literal_erc(r, gate, 0.7, torch.ones_like(r)), rel=1e-6
    )


def test_erc_preset_defaults():
    layer = moelab.MoE(8, 4, 2, method="erc")
    assert layer.coefs == {"balance": 0.01, "z": 0.001, "erc": 1.0}
    assert layer.erc_alpha == 1.0
    assert moelab.MoE(8, 4, 2).erc_alpha == 1.0 and "erc" not in moelab.MoE(8, 4, 2).coefs
    assert "erc" in moelab.methods()


def test_erc_gradient_reaches_the_router_rows_and_the_gates_only():
    layer = _layer(balance_coef=0.0, z_coef=0.0)
    (layer(torch.randn(4, D)) * 0).sum().backward()  # the aux gradient rides on the output
    assert layer.router.weight.grad.abs().sum() > 0
    g = layer.experts.w_in.grad
    assert g[:, :H].abs().sum() > 0 and not g[:, H:].any()  # the gate half, not the up half
    assert not layer.experts.w_out.grad.any()  # the task part is multiplied by 0


def test_erc_training_couples_the_router_and_the_experts():
    """Minimising the ERC loss alone drives it to (almost) zero: every expert's gate reacts most to
    its own router row."""
    layer = _layer(balance_coef=0.0, z_coef=0.0, erc_alpha=0.9)
    opt = torch.optim.Adam(layer.parameters(), lr=3e-2)
    x = torch.randn(4, D)
    first = None
    for _ in range(150):
        opt.zero_grad()
        (layer(x) * 0).sum().backward()  # the ERC loss alone (its gradient rides on the output)
        first = layer.aux_loss.item() if first is None else first
        opt.step()
    assert first > 0.05 and layer.erc_loss(noise=None).item() < 0.02 * first


@pytest.mark.parametrize(
    ("method", "activation"),
    [
        ("remoe", "relu"),
        ("top-p", "swiglu"),
        ("expert-choice", "gelu"),
        ("sharede-v3", "swiglu"),
        ("competesmoe", "relu"),
    ],
)
def test_erc_coef_works_with_any_linear_router(method, activation):
    torch.manual_seed(0)
    layer = moelab.MoE(D, N, K, d_hidden=H, method=method, activation=activation, erc_coef=1.0)
    layer.eval()(torch.randn(6, D))
    r = layer.router.base_router.weight.detach()
    gate = layer.experts.w_in.detach()[:, :H]
    want = literal_erc(r, gate, 1.0, torch.ones_like(r))
    assert layer.erc_loss(noise=None).item() == pytest.approx(want, rel=1e-6)
    assert "erc" in layer.coefs


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (
            lambda: moelab.MoE(8, 4, 2, method="aoe", erc_coef=1.0),
            r"^erc_coef > 0 is not allowed with method='aoe': its router has no \(num_experts, d_model\) weight "
            r"whose rows the ERC loss couples to the experts; expected a linear router \(smoe, sharede-v3, remoe, "
            r"top-p, expert-choice, ...\)$",
        ),
        (
            lambda: moelab.MoE(8, 4, 2, method="moepp", erc_coef=1.0),
            r"^erc_coef > 0 is not allowed with method='moepp'",
        ),
        (
            lambda: moelab.MoE(8, 4, 2, method="xmoe", erc_coef=1.0),
            r"^erc_coef > 0 is not allowed with method='xmoe'",
        ),
        (
            lambda: moelab.MoE(
                8, 4, 2, method="erc", experts=ModuleExperts([torch.nn.Linear(8, 8) for _ in range(4)])
            ),
            r"^erc_coef > 0 is not allowed with experts of type ModuleExperts: the ERC loss reads each expert's "
            r"gate projection; expected an ExpertBank$",
        ),
        (
            lambda: moelab.MoE(8, 4, 2, method="erc", erc_alpha=0.0),
            r"^erc_alpha=0.0 is not allowed; expected a number > 0$",
        ),
        (lambda: moelab.MoE(8, 4, 2, erc_coef=-1.0), r"^erc_coef=-1.0 is not allowed"),
    ],
)
def test_erc_is_refused_where_it_is_not_defined(build, match):
    with pytest.raises(ValueError, match=match) as e:
        build()
    assert "\n" not in str(e.value)


def test_erc_refuses_a_bank_that_holds_only_some_experts(monkeypatch):
    """An expert-parallel bank gives its local block: the coupling of all N experts is not there."""
    from moelab.experts import ExpertBank, ExpertWeights

    layer = _layer()
    local = property(lambda self: ExpertWeights(self.w_in[:2], self.w_out[:2], None, None, self.activation))
    monkeypatch.setattr(ExpertBank, "expert_weights", local)
    with pytest.raises(
        ValueError,
        match=r"^erc_coef > 0 is not allowed with expert parallelism \(this rank holds 2 of 4 experts\); "
        r"expected every expert's gate projection on every rank$",
    ):
        layer.erc_loss()


# ------------------------------------------------------------------ the layer grid
@pytest.mark.parametrize("impl", IMPLS)
def test_erc_every_kernel_gives_the_literal_output_and_gradients(impl):
    check_kernel("erc", impl)


def test_erc_compiles_as_one_graph_and_equals_eager():
    check_compile("erc")


def test_erc_survives_save_and_load_with_its_margin(tmp_path):
    back = check_save_load("erc", tmp_path, erc_alpha=0.5, erc_coef=0.3)
    assert back.erc_alpha == 0.5 and back.coefs["erc"] == 0.3


def test_erc_from_hf_trains_with_the_loss_and_to_hf_exports_the_same_inference():
    """Its inference is ``smoe``'s: the transformers block expresses it (the loss stays behind)."""
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=8, intermediate_size=12, num_local_experts=4, num_experts_per_tok=2)
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_()
    layer = moelab.from_hf(block, method="erc", erc_alpha=0.8)
    assert layer.coefs["erc"] == 1.0 and layer.erc_alpha == 0.8
    x = torch.randn(2, 3, 8)
    expected = layer.eval()(x)
    assert layer.erc_loss().item() > 0
    back = moelab.to_hf(layer)
    out = back(x)
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, expected, rtol=1e-5, atol=1e-6)
