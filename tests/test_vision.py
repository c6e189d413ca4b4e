"""CNN experts and gates of 002: batched experts, the attentive gate, the output mixture, distillation."""

import math

import pytest
import torch

from moelab.data.images import ImageData
from moelab.experts import ModuleExperts
from moelab.models.vision import (
    AttentiveGate,
    BatchedExperts,
    Expert,
    ImageMoE,
    OriginalGate,
    distill_gate,
    vision_config,
)
from moelab.train import TrainConfig, Trainer
from moelab.train.images import ImageTask


@pytest.fixture
def cfg():
    return vision_config("digits")


def x_of(cfg, b=6, seed=0):
    return torch.randn(
        b, cfg.in_channels, cfg.image_size, cfg.image_size, generator=torch.Generator().manual_seed(seed)
    )


def test_batched_experts_match_each_module(cfg):
    torch.manual_seed(0)
    mods = [Expert(cfg) for _ in range(4)]
    bank = BatchedExperts(mods)
    x = x_of(cfg)
    out = bank.forward_all(x)
    assert out.shape == (6, 4, cfg.num_classes + cfg.expert_hidden[1])
    for e, m in enumerate(mods):
        torch.testing.assert_close(out[:, e], m(x))
        torch.testing.assert_close(bank.expert_forward(x, e), m(x))


def test_batched_sparse_forward_combines_only_the_chosen_experts(cfg):
    torch.manual_seed(0)
    mods = [Expert(cfg) for _ in range(3)]
    bank, loop = BatchedExperts(mods), ModuleExperts(mods)
    x = x_of(cfg, 5)
    idx = torch.tensor([[0, 2], [1, 0], [2, 1], [2, 0], [1, 2]])
    w = torch.rand(5, 2)
    expected = torch.stack(
        [sum(w[t, k] * mods[int(idx[t, k])](x[t : t + 1])[0] for k in range(2)) for t in range(5)]
    )
    torch.testing.assert_close(bank.mix(x, idx, w), expected)
    torch.testing.assert_close(loop.mix(x, idx, w), expected)


def test_batched_experts_train_every_expert(cfg):
    bank = BatchedExperts([Expert(cfg) for _ in range(3)])
    out = bank.forward_all(x_of(cfg))
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(0))).sum().backward()
    assert all(
        p.grad is not None and p.grad.abs().sum(dim=tuple(range(1, p.dim()))).gt(0).all()
        for p in bank.parameters()
    )


def test_experts_of_different_architectures_are_refused(cfg):
    with pytest.raises(ValueError, match="different architectures"):
        BatchedExperts([Expert(cfg), Expert(vision_config("mnist"))])


def test_attentive_gate_is_the_scaled_dot_product_softmax(cfg):
    torch.manual_seed(0)
    model = ImageMoE(cfg, "attentive")
    x = x_of(cfg)
    out = model(x)
    assert out.gate_probs.shape == (6, cfg.num_experts) and out.probs.shape == (6, cfg.num_classes)
    torch.testing.assert_close(out.gate_probs.sum(-1), torch.ones(6))
    torch.testing.assert_close(out.probs.sum(-1), torch.ones(6))
    gate: AttentiveGate = model.gate
    h = cfg.expert_hidden[1]
    g = gate.trunk(x)  # (B, h), no activation on the last hidden layer
    q = g @ gate.w_q.weight.T  # eq. 4
    expert_out = torch.stack([model.experts.expert_forward(x, e) for e in range(cfg.num_experts)], 1)
    k = expert_out[..., cfg.num_classes :] @ gate.w_k.weight.T  # eq. 5
    scores = torch.stack([(q * k[:, e]).sum(-1) for e in range(cfg.num_experts)], 1) / math.sqrt(h)
    torch.testing.assert_close(out.gate_probs, scores.softmax(-1))  # eq. 6
    mix = (scores.softmax(-1)[..., None] * expert_out[..., : cfg.num_classes]).sum(1)
    torch.testing.assert_close(out.probs, mix)
    r = gate(x, model.experts)
    assert r.indices.shape == (6, cfg.num_experts) and r.outputs.shape == (
        6,
        cfg.num_experts,
        cfg.num_classes,
    )


@pytest.mark.parametrize("gate", ["original", "attentive"])
def test_top_k_inference_is_the_renormalised_top_k_mixture(cfg, gate):
    torch.manual_seed(1)
    model = ImageMoE(cfg, gate).eval()
    x = x_of(cfg)
    dense = model(x)
    torch.testing.assert_close(model(x, top_k=cfg.num_experts).probs, dense.probs)
    top1 = model(x, top_k=1)
    best = dense.gate_probs.argmax(-1)
    expected = torch.stack(
        [model.experts.expert_forward(x[t : t + 1], int(best[t]))[0, : cfg.num_classes] for t in range(6)]
    )
    torch.testing.assert_close(top1.probs, expected)
    with pytest.raises(ValueError, match="top_k=9"):
        model(x, top_k=9)


def test_original_gate_routing_is_a_softmax_over_experts(cfg):
    gate = OriginalGate(cfg, top_k=2)
    r = gate(x_of(cfg))
    torch.testing.assert_close(r.probs, gate.logits(x_of(cfg)).softmax(-1))
    torch.testing.assert_close(r.weights.sum(-1), torch.ones(6))
    assert r.indices.shape == (6, 2)


def test_distillation_copies_the_trunk_and_leaves_the_experts_unchanged(cfg):
    torch.manual_seed(0)
    teacher = ImageMoE(cfg, "attentive")
    student = distill_gate(teacher)
    assert isinstance(student.gate, OriginalGate)
    for a, b in zip(teacher.gate.trunk.state_dict().values(), student.gate.trunk.state_dict().values()):
        torch.testing.assert_close(a, b)
    before = {k: v.clone() for k, v in student.experts.state_dict().items()}
    gate_before = student.gate.head.weight.clone()
    g = torch.Generator().manual_seed(0)
    data = ImageData(
        "t",
        torch.randn(64, 1, 8, 8, generator=g),
        torch.randint(0, 10, (64,), generator=g),
        torch.randn(8, 1, 8, 8),
        torch.zeros(8, dtype=torch.long),
        10,
        [str(i) for i in range(10)],
    )
    task = ImageTask(data, 16, frozen=(student.experts,))
    steps = 2 * task.steps_per_epoch
    Trainer(
        student, task, TrainConfig(steps, 16, 1e-3, "constant", 0, optimizer="adam"), progress=False
    ).fit()
    for k, v in student.experts.state_dict().items():
        torch.testing.assert_close(v, before[k])
    assert not torch.equal(student.gate.head.weight, gate_before)  # the gate did train
    for k, v in teacher.experts.state_dict().items():  # the teacher is untouched too
        torch.testing.assert_close(v, before[k])


def test_distillation_needs_an_attentive_gate(cfg):
    with pytest.raises(ValueError, match="attentive gate"):
        distill_gate(ImageMoE(cfg, "original"))


def test_expert_count_below_two_is_refused():
    with pytest.raises(ValueError, match="experts=1"):
        vision_config("mnist", 1)
    with pytest.raises(ValueError, match="data='svhn'"):
        vision_config("svhn")


@pytest.mark.parametrize("data", ["mnist", "fmnist", "fmnist+mnist", "cifar100"])
def test_paper_models_have_the_appendix_b_shapes(data):
    cfg = vision_config(data)
    model = ImageMoE(cfg, "attentive")
    out = model(x_of(cfg, 2))
    assert out.probs.shape == (2, cfg.num_classes) and out.gate_probs.shape == (2, cfg.num_experts)
    expert_fc1 = {"mnist": (5, 169), "fmnist": (64, 169), "fmnist+mnist": (5, 169), "cifar100": (1024, 512)}[
        data
    ]
    assert tuple(model.experts.stacked__trunk__fc1__weight.shape[1:]) == expert_fc1
    gate_fc1 = {
        "mnist": (128, 169),
        "fmnist": (512, 8 * 169),
        "fmnist+mnist": (128, 144),
        "cifar100": (1024, 2048),
    }[data]
    assert tuple(model.gate.trunk.fc1.weight.shape) == gate_fc1
