"""The paper-study models of moelab.stats.mixtures against direct computations, and their
batched fit."""

from __future__ import annotations

import math

import pytest
import torch

from moelab.stats.mixtures import LoRAMixture, Mixture, fit_params

D = torch.float64
ACT = {"tanh": math.tanh, "relu": lambda z: max(z, 0.0)}


def _params(model: Mixture, R: int, k: int, d: int, k1: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = model.q(d)
    p = {
        "beta0": torch.randn(R, k, generator=gen, dtype=D),
        "beta1": torch.randn(R, k, d, generator=gen, dtype=D),
        "eta": torch.randn(R, k, q, generator=gen, dtype=D),
        "quad": torch.randn(R, k, d * (d + 1) // 2, generator=gen, dtype=D),
        "nu": 0.1 + torch.rand(R, k, generator=gen, dtype=D),
        "omega": torch.randn(R, k1, generator=gen, dtype=D),
        "kappa": torch.randn(R, k1, q, generator=gen, dtype=D),
        "tau": 0.1 + torch.rand(R, k1, generator=gen, dtype=D),
    }
    return p


def _expert(model: Mixture, x: list[float], eta: list[float]) -> float:
    d = len(x)
    if model.expert in ("linear", "polynomial"):
        lin = sum(a * b for a, b in zip(eta[:d], x)) + eta[d]
        return lin if model.expert == "linear" else lin**2
    if model.expert == "ffn":
        return eta[0] * ACT[model.activation](sum(a * b for a, b in zip(eta[1 : d + 1], x)) + eta[d + 1])
    norm = math.sqrt(sum(v * v for v in x))
    return ACT[model.activation](sum(a * b / norm for a, b in zip(eta[:d], x)) + eta[d])


def _gate(model: Mixture, x: list[float], p: dict, r: int) -> list[float]:
    k = p["beta0"].shape[1]
    d = len(x)
    h = [_expert(model, x, p["eta"][r, i].tolist()) for i in range(k)]
    if model.gate == "competition":
        logits = [math.log1p(math.exp(h[i])) + p["beta0"][r, i].item() for i in range(k)]
    elif model.gate == "competition-v1":
        a = [abs(v) for v in h]
        keep = sorted(range(k), key=lambda i: -a[i])[: model.top_k]
        z = sum(math.exp(a[i]) for i in keep)
        return [math.exp(a[i]) / z if i in keep else 0.0 for i in range(k)]
    else:
        logits = []
        for i in range(k):
            b1 = p["beta1"][r, i].tolist()
            if model.gate in ("cosine", "perturbed"):
                tau = model.tau if model.gate == "perturbed" else 0.0
                nb, nx = math.sqrt(sum(v * v for v in b1)), math.sqrt(sum(v * v for v in x))
                raw = sum(a * b for a, b in zip(b1, x)) / ((nb + tau) * (nx + tau))
            else:
                raw = sum(a * b for a, b in zip(b1, x))
            if model.gate == "quadratic":
                pairs = [(u, v) for u in range(d) for v in range(u, d)]
                raw += sum(c * x[u] * x[v] for c, (u, v) in zip(p["quad"][r, i].tolist(), pairs))
            logits.append(raw + p["beta0"][r, i].item())
        if model.gate == "normalized-sigmoid":
            s = [1 / (1 + math.exp(-v)) for v in logits]
            return [v / sum(s) for v in s]
    m = max(logits)
    e = [math.exp(v - m) for v in logits]
    return [v / sum(e) for v in e]


CASES = [
    ("softmax", "linear", "tanh", False),
    ("normalized-sigmoid", "ffn", "relu", True),
    ("quadratic", "ffn", "tanh", False),
    ("cosine", "polynomial", "tanh", False),
    ("perturbed", "ffn", "relu", False),
    ("competition", "ffn", "tanh", False),
    ("competition-v1", "linear", "tanh", False),
    ("softmax", "normalized-input", "tanh", True),
]


@pytest.mark.parametrize("gate,expert,act,shared", CASES)
def test_the_regression_function_and_density_match_a_direct_computation(gate, expert, act, shared):
    model = Mixture("gaussian", gate, expert, act, shared=shared, top_k=2, tau=0.5)
    R, n, k, d = 2, 5, 3, 3
    p = _params(model, R, k, d)
    x = torch.randn(R, n, d, generator=torch.Generator().manual_seed(9), dtype=D)
    y = torch.randn(R, n, generator=torch.Generator().manual_seed(10), dtype=D)
    mean, logp = model.mean(x, p), model.log_density(x, y, p)
    for r in range(R):
        for t in range(n):
            xs = x[r, t].tolist()
            g = _gate(model, xs, p, r)
            h = [_expert(model, xs, p["eta"][r, i].tolist()) for i in range(k)]
            routed = sum(a * b for a, b in zip(g, h))
            dens = sum(g[i] * math.exp(-0.5 * (y[r, t].item() - h[i]) ** 2 / p["nu"][r, i].item())
                       / math.sqrt(2 * math.pi * p["nu"][r, i].item()) for i in range(k))  # fmt: skip
            if shared:
                om = p["omega"][r].softmax(-1).tolist()
                hs = [_expert(model, xs, p["kappa"][r, i].tolist()) for i in range(2)]
                routed = 0.5 * routed + 0.5 * sum(a * b for a, b in zip(om, hs))
                dens = 0.5 * dens + 0.5 * sum(
                    om[i] * math.exp(-0.5 * (y[r, t].item() - hs[i]) ** 2 / p["tau"][r, i].item())
                    / math.sqrt(2 * math.pi * p["tau"][r, i].item()) for i in range(2))  # fmt: skip
            assert mean[r, t].item() == pytest.approx(routed, rel=1e-10, abs=1e-12)
            assert logp[r, t].item() == pytest.approx(math.log(dens), rel=1e-10, abs=1e-10)


def test_the_lora_row_matches_a_direct_computation_and_the_reparameterisation_ties_q_and_v():
    R, n, d, J = 2, 4, 3, 3
    gen = torch.Generator().manual_seed(4)
    p = {"fixed": torch.randn(R, 3 * J + 1, d, d, generator=gen, dtype=D), "a": torch.randn(R, 1, d, generator=gen, dtype=D),
         "b": torch.randn(R, d, 1, generator=gen, dtype=D)}  # fmt: skip
    x = torch.randn(R, n, d, generator=gen, dtype=D)
    model = LoRAMixture("shared", positions=J)
    got = model.mean(x, p)
    for r in range(R):
        delta = torch.tanh(p["b"][r]) @ torch.tanh(p["a"][r])
        C, Dm, Rm, W = (
            p["fixed"][r, :J],
            p["fixed"][r, J : 2 * J],
            p["fixed"][r, 2 * J : 3 * J],
            p["fixed"][r, 3 * J],
        )
        v = W[:, 0]
        for t in range(n):
            xv = x[r, t]
            logits = torch.stack([xv @ (C[j] + delta @ Dm[j]) @ xv for j in range(J)])
            experts = torch.stack([v @ (W + delta).T @ Rm[j] @ xv for j in range(J)])
            assert got[r, t].item() == pytest.approx(float((logits.softmax(0) * experts).sum()), rel=1e-10)
    separate = LoRAMixture("separate", positions=J)
    b, a = torch.tanh(p["b"]), torch.tanh(p["a"])
    ps = {"fixed": p["fixed"], "bq": b, "aq": a, "bv": b, "av": a}
    torch.testing.assert_close(separate.mean(x, ps), got)


@pytest.mark.parametrize(
    "model", [Mixture("gaussian", "softmax", "ffn", shared=True), Mixture("regression", "quadratic")]
)
def test_a_batched_fit_equals_the_separate_fits_on_loss(model):
    R, n, k, d = 3, 100, 2, 2
    p = _params(model, R, k, d, k1=1, seed=5)
    gen = torch.Generator().manual_seed(6)
    x = torch.rand(R, n, d, generator=gen, dtype=D) * 2 - 1
    y = model.sample(x, p, 0.01, gen)
    start = {
        kk: v + 0.1 * torch.randn(v.shape, generator=gen, dtype=D) if kk not in ("nu", "tau") else v
        for kk, v in p.items()
    }
    batched = fit_params(model, x, y, start, steps=25)
    for r in range(R):
        alone = fit_params(
            model, x[r : r + 1], y[r : r + 1], {kk: v[r : r + 1] for kk, v in start.items()}, steps=25
        )
        assert alone.loss.item() == pytest.approx(batched.loss[r].item(), rel=1e-9, abs=1e-12)
        assert alone.n_iter.item() == batched.n_iter[r].item()
    assert (batched.loss <= model.objective(x, y, start)).all()


def test_a_fit_whose_loss_is_not_finite_is_not_converged_and_says_why():
    model = Mixture("regression", "softmax")
    p = _params(model, 2, 2, 2)
    x = torch.rand(2, 50, 2, dtype=D)
    y = torch.full((2, 50), 1e308, dtype=D)  # (y − f)² overflows: the loss is inf from the start
    res = fit_params(model, x, y, p, steps=20)
    assert not res.converged.any() and res.reason == ["loss not finite"] * 2 and (res.n_iter == 0).all()


def test_bad_model_options_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"gate='topk' is not allowed; expected one of"):
        Mixture(gate="topk")
    with pytest.raises(
        ValueError, match=r"mode='joint' is not allowed; expected one of \['separate', 'shared'\]"
    ):
        LoRAMixture(mode="joint")
