"""moelab.optim: weight decay on the matrices only, the groups the models own, Adam and AdamW."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from moelab import MoE
from moelab.experts import ExpertBank, ModuleExperts
from moelab.models.classifier import LMClassifier, freeze_routers
from moelab.models.lm import LMConfig, TransformerLM
from moelab.models.vision import ImageMoE, SingleModel, VisionConfig
from moelab.optim import build_optimizer, check_optimizer, decayed_parameter_names, param_groups

TINY = dict(block_size=8, n_layer=2, d_model=16, n_head=2, num_experts=4, top_k=2, dropout=0.0)
#: a vision model whose experts have a BatchNorm (stacked by BatchedExperts into (N, C) scales)
SMALL_VISION = VisionConfig(1, 8, 3, 3, ((2, 3, 1, True),), (5, 8), ((1, 3, 1, False),), (8, 8))


def _lm(method: str) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(LMConfig(vocab_size=32, method=method, **TINY))


def _ids(group: dict) -> list[int]:
    return [id(p) for p in group["params"]]


# ------------------------------------------------------------------------------ the groups
@pytest.mark.parametrize("method", ["xmoe", "sharede-v3"])
def test_an_lm_decays_exactly_its_matrices_and_holds_every_parameter_once(method):
    model = _lm(method)
    decayed, rest = model.param_groups(0.1)
    assert (decayed["weight_decay"], rest["weight_decay"]) == (0.1, 0.0)
    params = list(model.parameters())  # tied weights once
    assert sorted(_ids(decayed) + _ids(rest)) == sorted(id(p) for p in params)  # each exactly once
    assert _ids(decayed) == [id(p) for p in params if p.dim() >= 2]
    assert _ids(rest) == [id(p) for p in params if p.dim() < 2]
    names = {id(p): n for n, p in model.named_parameters()}
    undecayed = {names[i] for i in _ids(rest)}
    assert {"blocks.0.ln1.weight", "blocks.0.ln1.bias", "blocks.0.attn.qkv.bias", "ln_f.weight"} <= undecayed
    assert {"tok_emb.weight", "pos_emb.weight", "blocks.0.ffn.experts.w_in"} <= {
        names[i] for i in _ids(decayed)
    }
    if method == "xmoe":  # the learned temperature is a scalar: never decayed
        assert "blocks.0.ffn.router.temperature" in undecayed
    else:  # sharede-v3's selection bias is a buffer, which no optimizer sees
        assert "blocks.0.ffn.router.selection_bias" in dict(model.named_buffers())
        assert not any("selection_bias" in n for n in names.values())


def test_an_expert_banks_bias_stacks_are_not_decayed_but_its_weight_stacks_are():
    layer = MoE(8, 4, 2, d_hidden=16, bias=True)
    assert (
        isinstance(layer.experts, ExpertBank) and layer.experts.b_in.dim() == 2
    )  # (N, h): a stack of vectors
    assert decayed_parameter_names(layer) == ["router.weight", "experts.w_in", "experts.w_out"]


def test_module_experts_are_judged_per_module():
    bank = ModuleExperts([nn.Linear(4, 4) for _ in range(4)])  # (4, 4) weights: not stacks
    assert decayed_parameter_names(bank) == [f"experts.{i}.weight" for i in range(4)]


def test_vision_experts_decay_their_conv_and_linear_stacks_but_not_their_norms_or_biases():
    model = ImageMoE(SMALL_VISION)
    decayed = set(decayed_parameter_names(model))
    stacks = {n: p for n, p in model.named_parameters() if n.startswith("experts.")}
    assert {n for n in stacks if n in decayed} == {n for n, p in stacks.items() if p.dim() >= 3}
    assert "experts.stacked__trunk__features__1__weight" in stacks  # the BatchNorm scale, (N, C)
    assert "experts.stacked__trunk__features__1__weight" not in decayed
    assert "experts.stacked__trunk__fc1__bias" not in decayed
    assert {"experts.stacked__trunk__features__0__weight", "gate.head.weight"} <= decayed


@pytest.mark.parametrize(
    "build",
    [
        lambda: _lm("smoe"),
        lambda: LMClassifier(_lm("smoe"), 3),
        lambda: ImageMoE(SMALL_VISION),
        lambda: SingleModel(SMALL_VISION),
    ],
    ids=["TransformerLM", "LMClassifier", "ImageMoE", "SingleModel"],
)
def test_every_model_owns_groups_that_partition_its_parameters(build):
    model = build()
    groups = model.param_groups(0.05)
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0]
    assert sorted(_ids(groups[0]) + _ids(groups[1])) == sorted(id(p) for p in model.parameters())
    matrices = set(decayed_parameter_names(model))
    assert _ids(groups[0]) == [id(p) for n, p in model.named_parameters() if n in matrices]


def test_frozen_parameters_are_in_no_group():
    model = LMClassifier(_lm("smoe"), 3)
    assert freeze_routers(model) > 0
    grouped = {i for g in model.param_groups(0.1) for i in _ids(g)}
    assert grouped == {id(p) for p in model.parameters() if p.requires_grad}
    assert not any(id(p) in grouped for n, p in model.named_parameters() if ".router." in n)


def test_a_tied_weight_is_named_under_each_of_its_names():
    lm = _lm("smoe")
    assert lm.head.weight is lm.tok_emb.weight
    assert {"tok_emb.weight", "head.weight"} <= set(decayed_parameter_names(lm))


# ------------------------------------------------------------------------------ the updates
def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One update from gradients that depend only on the parameter's name (the same for every copy)."""
    for n, p in model.named_parameters():
        g = torch.Generator().manual_seed(sum(map(ord, n)))
        p.grad = torch.randn(p.shape, generator=g)
    optimizer.step()


def test_one_adamw_step_decays_the_matrices_as_torch_adamw_and_the_vectors_not_at_all():
    lr, decay = 0.1, 0.5
    model = _lm("xmoe")
    with torch.no_grad():  # no zero vector: the decay of every tensor would show
        for p in model.parameters():
            p.add_(0.5)
    decayed, full, none = model, copy.deepcopy(model), copy.deepcopy(model)
    _step(decayed, build_optimizer("adamw", decayed, lr, decay))
    _step(full, torch.optim.AdamW(full.parameters(), lr=lr, weight_decay=decay, foreach=True))
    _step(none, torch.optim.AdamW(none.parameters(), lr=lr, weight_decay=0.0, foreach=True))
    ours, with_decay, without = (dict(m.named_parameters()) for m in (decayed, full, none))
    assert ours["blocks.0.ffn.router.temperature"].dim() == 1  # xmoe's learned temperature is checked too
    for name, p in ours.items():
        expected, other = (with_decay, without) if p.dim() >= 2 else (without, with_decay)
        assert torch.equal(p, expected[name]), name
        assert not torch.equal(p, other[name]), name  # the two references differ: the check can fail


def test_adam_and_adamw_without_decay_make_the_same_updates():
    a, b = _lm("xmoe"), _lm("xmoe")
    adam, adamw = build_optimizer("adam", a, 0.01), build_optimizer("adamw", b, 0.01)
    assert type(adam) is torch.optim.Adam and type(adamw) is torch.optim.AdamW
    for _ in range(3):
        _step(a, adam)
        _step(b, adamw)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_a_model_without_its_own_groups_gets_the_matrix_rule():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    optimizer = build_optimizer("adamw", model, 1e-3, 0.1)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in optimizer.param_groups] == [1, 3]
    assert optimizer.param_groups[0]["params"][0] is model[0].weight


def test_the_optimizer_uses_the_groups_the_model_owns():
    class OneGroup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def param_groups(self, weight_decay: float) -> list[dict]:
            return [{"params": list(self.parameters()), "weight_decay": 2 * weight_decay}]

    optimizer = build_optimizer("adamw", OneGroup(), 1e-3, 0.1)
    assert len(optimizer.param_groups) == 1 and optimizer.param_groups[0]["weight_decay"] == 0.2


# ------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    "name,decay,message",
    [
        ("sgd", 0.0, "optimizer='sgd' is not allowed; expected one of ['adam', 'adamw']"),
        ("adamw", -0.1, "weight_decay=-0.1 is not allowed; expected a number >= 0"),
        ("adamw", float("inf"), "weight_decay=inf is not allowed; expected a finite number >= 0"),
        (
            "adam",
            0.1,
            "optimizer='adam' with weight_decay=0.1 is not allowed; expected weight_decay=0 with adam",
        ),
    ],
)
def test_bad_optimizer_settings_are_refused_in_one_line(name, decay, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_optimizer(name, decay)
    with pytest.raises(ValueError, match=re.escape(message)):
        build_optimizer(name, nn.Linear(2, 2), 1e-3, decay)


def test_a_negative_decay_is_refused_by_the_groups_too():
    with pytest.raises(ValueError, match="weight_decay=-1 is not allowed; expected a number >= 0"):
        param_groups(nn.Linear(2, 2), -1)


def test_a_model_with_nothing_to_train_is_refused():
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="a Linear with no trainable parameter is not allowed"):
        build_optimizer("adamw", model, 1e-3)
