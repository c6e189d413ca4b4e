"""``expert-choice`` (Zhou et al. 2022): each expert takes its top ``k = ⌈T·c/N⌉`` tokens, against a
literal computation; the balance by construction; the causal-LM warning; and the layer grid."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import moelab
from moelab.models.lm import LMConfig
from moelab.routers import build_router
from router_grid import IMPLS_WITH_SLOW_TRITON, check_compile, check_hf_refusal, check_kernel, check_save_load


def literal_expert_choice(x, weight, c):
    """Softmax over experts per token; each expert's k tokens by decreasing score (ties by token
    index); per token, the experts that chose it by decreasing score, then the others."""
    rows = []
    for xt in x.tolist():
        logits = [sum(a * b for a, b in zip(xt, we)) for we in weight.tolist()]
        z = sum(math.exp(v) for v in logits)
        rows.append([math.exp(v) / z for v in logits])
    t, n = len(rows), len(rows[0])
    k = min(t, math.ceil(t * c / n))
    chosen = [[False] * n for _ in range(t)]
    for e in range(n):
        for tok in sorted(range(t), key=lambda i: (-rows[i][e], i))[:k]:
            chosen[tok][e] = True
    order = [sorted(range(n), key=lambda e: (-(rows[i][e] if chosen[i][e] else -1.0), e)) for i in range(t)]
    mask = [[chosen[i][e] for e in order[i]] for i in range(t)]
    w = [[rows[i][e] if chosen[i][e] else 0.0 for e in order[i]] for i in range(t)]
    return (
        torch.tensor(order),
        torch.tensor(mask),
        torch.tensor(w, dtype=x.dtype),
        torch.tensor(rows, dtype=x.dtype),
        k,
    )


@pytest.mark.parametrize(("t", "c"), [(10, 2.0), (7, 1.0), (5, 3.5)])
def test_expert_choice_each_expert_takes_its_top_k_tokens_weighted_by_the_softmax(t, c):
    router = build_router("expert-choice", 6, 4, 2, capacity_factor=c).double()
    x = torch.randn(t, 6, dtype=torch.float64)
    r = router(x)
    order, mask, w, probs, k = literal_expert_choice(x, router.weight.detach(), c)
    assert r.indices.tolist() == order.tolist()
    assert r.mask.tolist() == mask.tolist()
    torch.testing.assert_close(r.weights, w)
    torch.testing.assert_close(r.probs, probs)
    load = torch.bincount(r.active_indices, minlength=4)
    assert load.tolist() == [k] * 4  # balanced by construction


def test_expert_choice_capacity_factor_defaults_to_top_k_and_is_the_mean_experts_per_token():
    layer = moelab.MoE(8, 4, 2, method="expert-choice")
    assert layer.router.capacity_factor == 2.0 and layer.coefs == {}
    layer(torch.randn(16, 8))
    assert layer.last_routing.mask.sum().item() == 16 * 2  # k = 16·2/4 = 8 tokens for each of 4 experts
    assert layer.aux_loss.item() == 0.0


def test_expert_choice_gives_a_token_nobody_chose_zero_output():
    layer = moelab.MoE(4, 2, 1, method="expert-choice", capacity_factor=0.5)
    x = torch.randn(8, 4)
    y = layer(x)
    nobody = ~layer.last_routing.mask.any(1)
    assert nobody.sum() >= 4  # 2 experts × k = 2 tokens: at most 4 of 8 tokens are taken
    assert torch.equal(y[nobody], torch.zeros_like(y[nobody]))


def test_expert_choice_router_trains_from_the_task_loss():
    layer = moelab.MoE(8, 4, 2, method="expert-choice")
    layer(torch.randn(16, 8)).square().mean().backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0


def test_expert_choice_in_a_causal_lm_warns_that_it_sees_future_tokens():
    kw = dict(vocab_size=10, block_size=8, n_layer=1, d_model=8, n_head=2, num_experts=4, top_k=2)
    with pytest.warns(
        UserWarning,
        match=r"^method='expert-choice' routes each expert's top tokens over the whole batch, so a causal language model sees future tokens",
    ):
        LMConfig(**kw, method="expert-choice")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LMConfig(**kw, method="smoe")
        LMConfig(**kw, method="expert-choice", arch="dense")  # no MoE layer: nothing routes


def test_expert_choice_output_of_a_token_depends_on_other_tokens():
    """The leak, pinned: changing a later token changes an earlier token's routing."""
    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, 1, method="expert-choice")
    x = torch.randn(8, 8)
    y = layer(x)
    changed = False
    for scale in (5.0, -5.0, 10.0):
        x2 = x.clone()
        x2[-1] = scale * layer.router.weight[layer.last_routing.indices[0, 0]].detach()
        changed |= not torch.allclose(layer(x2)[0], y[0])
    assert changed


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"capacity_factor": 0.0}, r"^capacity_factor=0.0 is not allowed; expected a number > 0$"),
        ({"capacity_factor": 5.0}, r"^capacity_factor=5.0 is not allowed; expected a number in \(0, 4\]"),
        ({"init_std": -1.0}, r"^init_std=-1.0 is not allowed; expected a number > 0$"),
    ],
)
def test_expert_choice_options_are_validated(options, match):
    with pytest.raises(ValueError, match=match):
        moelab.MoE(8, 4, 2, method="expert-choice", **options)


# ------------------------------------------------------------------ the layer grid
@pytest.mark.parametrize("impl", IMPLS_WITH_SLOW_TRITON)
def test_expert_choice_every_kernel_gives_the_literal_output_and_gradients(impl):
    check_kernel("expert-choice", impl)


@pytest.mark.slow  # the masked dispatch under compile: remoe's default test runs it
def test_expert_choice_compiles_as_one_graph_and_equals_eager():
    check_compile("expert-choice")


def test_expert_choice_survives_save_and_load(tmp_path):
    assert check_save_load("expert-choice", tmp_path, capacity_factor=1.5).router.capacity_factor == 1.5


def test_expert_choice_from_hf_runs_and_to_hf_refuses_in_one_line():
    check_hf_refusal("expert-choice")
