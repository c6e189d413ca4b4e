"""moelab.stats.models against literal per-sample loops (plain Python math, no shared code)."""

from __future__ import annotations

import math

import pytest
import torch

from moelab.stats import GaussianMoE, GaussianParams, MoEParams, RegressionMoE

torch.manual_seed(0)
R, N, D, K = 2, 5, 3, 3

ACTS = {
    "tanh": math.tanh,
    "sigmoid": lambda z: 1 / (1 + math.exp(-z)),
    "relu": lambda z: max(z, 0.0),
    "gelu": lambda z: 0.5 * z * (1 + math.erf(z / math.sqrt(2))),
}


def _norm(v):
    return math.sqrt(sum(t * t for t in v))


def _dot(u, v):
    return sum(a * b for a, b in zip(u, v))


def literal_regression(model: RegressionMoE, x, p: MoEParams):
    """f_G(x) by loops over replicates, samples and experts."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for r in range(x.shape[0]):
        for s in range(x.shape[1]):
            xs = x[r, s].tolist()
            logits, hs = [], []
            for i in range(p.beta0.shape[1]):
                b1, b0, eta = p.beta1[r, i].tolist(), float(p.beta0[r, i]), p.eta[r, i].tolist()
                if model.gate in ("linear", "sigmoid"):
                    ell = _dot(b1, xs) + b0
                elif model.gate == "cosine":
                    ell = _dot(b1, xs) / (_norm(b1) * _norm(xs)) + b0
                else:
                    ell = _dot(b1, xs) / ((_norm(b1) + model.tau1) * (_norm(xs) + model.tau2)) + b0
                logits.append(ell)
                d = len(xs)
                if model.expert == "ffn":
                    pre = _dot(eta[1 : d + 1], xs) + (eta[d + 1] if model.expert_bias else 0.0)
                    hs.append(eta[0] * ACTS[model.activation](pre))
                else:
                    lin = _dot(eta[:d], xs) + eta[d]
                    hs.append(lin if model.expert == "linear" else lin**model.degree)
            if model.gate == "sigmoid":
                w = [1 / (1 + math.exp(-v)) for v in logits]
            else:
                keep = sorted(range(len(logits)), key=lambda i: -logits[i])[: model.top_k or len(logits)]
                z = sum(math.exp(logits[i]) for i in keep)
                w = [math.exp(logits[i]) / z if i in keep else 0.0 for i in range(len(logits))]
            out[r, s] = sum(wi * hi for wi, hi in zip(w, hs))
    return out


def _params(model: RegressionMoE, d=D, k=K):
    return MoEParams(
        torch.randn(R, k, dtype=torch.float64),
        torch.randn(R, k, d, dtype=torch.float64),
        torch.randn(R, k, model.expert_dim(d), dtype=torch.float64),
    )


@pytest.mark.parametrize("gate", ["linear", "cosine", "perturbed", "sigmoid"])
@pytest.mark.parametrize(
    "expert,kw",
    [("linear", {}), ("polynomial", {"degree": 3}), ("ffn", {"activation": "tanh"}),
     ("ffn", {"activation": "sigmoid"}), ("ffn", {"activation": "gelu"}),
     ("ffn", {"activation": "relu", "expert_bias": False})],
)  # fmt: skip
def test_regression_mean_equals_literal_loop(gate, expert, kw):
    model = RegressionMoE(gate=gate, expert=expert, tau1=0.3, tau2=0.7, **kw)
    x = torch.rand(R, N, D, dtype=torch.float64) * 2 - 1
    p = _params(model)
    torch.testing.assert_close(model.mean(x, p), literal_regression(model, x, p))


def test_top_k_sparse_softmax_equals_literal_loop():
    model = RegressionMoE(gate="linear", expert="linear", top_k=2)
    x = torch.randn(R, N, D, dtype=torch.float64)
    p = _params(model)
    torch.testing.assert_close(model.mean(x, p), literal_regression(model, x, p))
    w = model.gate_weights(x, p.beta0, p.beta1)
    assert ((w > 0).sum(-1) == 2).all()


def test_perturbed_with_tau_zero_equals_cosine():
    x = torch.randn(R, N, D, dtype=torch.float64)
    cos = RegressionMoE(gate="cosine", expert="ffn")
    pert = RegressionMoE(gate="perturbed", expert="ffn", tau1=0.0, tau2=0.0)
    p = _params(cos)
    torch.testing.assert_close(pert.mean(x, p), cos.mean(x, p), rtol=0, atol=0)
    torch.testing.assert_close(pert.logits(x, p.beta0, p.beta1), cos.logits(x, p.beta0, p.beta1))


def test_perturbed_differs_from_cosine_when_tau_positive():
    x = torch.randn(R, N, D, dtype=torch.float64)
    p = _params(RegressionMoE())
    a = RegressionMoE(gate="cosine").logits(x, p.beta0, p.beta1)
    b = RegressionMoE(gate="perturbed", tau1=0.5, tau2=0.5).logits(x, p.beta0, p.beta1)
    assert not torch.allclose(a, b)


def _normal_pdf(y, mu, var):
    return math.exp(-((y - mu) ** 2) / (2 * var)) / math.sqrt(2 * math.pi * var)


@pytest.mark.parametrize("gating", ["softmax", "competition"])
def test_gaussian_log_density_equals_literal_loop(gating):
    model = GaussianMoE(gating=gating)
    p = GaussianParams(
        torch.randn(R, K, dtype=torch.float64),
        torch.randn(R, K, D, dtype=torch.float64),
        torch.randn(R, K, D, dtype=torch.float64),
        torch.randn(R, K, dtype=torch.float64),
        torch.rand(R, K, dtype=torch.float64) + 0.1,
    )
    x, y = torch.randn(R, N, D, dtype=torch.float64), torch.randn(R, N, dtype=torch.float64)
    expected = torch.zeros(R, N, dtype=torch.float64)
    for r in range(R):
        for s in range(N):
            xs = x[r, s].tolist()
            mus = [_dot(p.a[r, i].tolist(), xs) + float(p.b[r, i]) for i in range(K)]
            if gating == "softmax":
                logits = [_dot(p.beta1[r, i].tolist(), xs) + float(p.beta0[r, i]) for i in range(K)]
            else:  # CompeteSMoE (2025) eq. (13): exp(log(1 + exp(mu)))
                logits = [math.log(1 + math.exp(m)) for m in mus]
            z = sum(math.exp(v) for v in logits)
            dens = sum(
                math.exp(logits[i]) / z * _normal_pdf(float(y[r, s]), mus[i], float(p.nu[r, i]))
                for i in range(K)
            )
            expected[r, s] = math.log(dens)
    torch.testing.assert_close(model.log_density(x, y, p), expected)


@pytest.mark.parametrize(
    "kwargs,match",
    [({"gate": "quadratic"}, "gate='quadratic'"), ({"expert": "mlp"}, "expert='mlp'"),
     ({"tau1": -0.1}, "tau1=-0.1"), ({"tau2": -1}, "tau2=-1"), ({"activation": "swish"}, "activation='swish'"),
     ({"degree": 0}, "degree=0")],
)  # fmt: skip
def test_regression_model_rejects_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RegressionMoE(**kwargs)


def test_gaussian_model_rejects_unknown_gating():
    with pytest.raises(ValueError, match="gating='topk'"):
        GaussianMoE(gating="topk")


def test_unbatched_x_is_rejected_with_shape():
    model = RegressionMoE()
    p = _params(model)
    with pytest.raises(ValueError, match=r"\(R, n, d\)"):
        model.mean(torch.randn(N, D), p)


def test_competition_gate_bias_adds_to_the_softplus_affinity():
    p = GaussianParams(
        torch.randn(R, K, dtype=torch.float64),
        torch.zeros(R, K, D, dtype=torch.float64),
        torch.randn(R, K, D, dtype=torch.float64),
        torch.randn(R, K, dtype=torch.float64),
        torch.ones(R, K, dtype=torch.float64),
    )
    x = torch.randn(R, N, D, dtype=torch.float64)
    plain = GaussianMoE(gating="competition").gate_logits(x, p)
    biased = GaussianMoE(gating="competition", gate_bias=True).gate_logits(x, p)
    torch.testing.assert_close(biased - plain, p.beta0.unsqueeze(1).expand(R, N, K))
