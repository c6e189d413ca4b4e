"""CNN experts and gates of expert specialization (Krishnamurthy et al. (2023)), an output-mixture
MoE: experts that return their class probabilities and last hidden vector, the original and the
attentive gate (routers over an expert bank, :class:`BatchedExperts` running experts of one
architecture with ``torch.func.vmap``), the dense mixture output and its top-K sparse form at
inference; no ReLU on the output logits unless ``output_relu=True``.  docs/methods.md ("Expert
specialization models") gives the layers, the gates' formulas and the reading of the output ReLU.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, stack_module_state, vmap

from .. import _validate
from ..experts import ModuleExperts, SparseExperts, combine
from ..experts.dispatch import Slots
from ..io.model import Persistent
from ..optim import param_groups
from ..routing import Routing, RoutingContext

__all__ = [
    "CONFIGS",
    "AttentiveGate",
    "BatchedExperts",
    "ConvTrunk",
    "Expert",
    "ImageMoE",
    "MoEOutput",
    "OriginalGate",
    "VisionConfig",
    "build_experts",
    "build_gate",
    "build_model",
    "distill_gate",
    "vision_config",
]

#: one conv layer: (out_channels, kernel, padding, batch_norm); each is followed by ReLU and a 2×2
#: max-pool with stride 2 (Krishnamurthy et al. (2023) Appendix B)
Conv = tuple[int, int, int, bool]


@dataclass(frozen=True)
class VisionConfig:
    """Layer sizes of one dataset's MoE (Krishnamurthy et al. (2023) Appendix B).

    Attributes:
        in_channels, image_size: the input ``(C, S, S)``.
        num_classes: K.
        num_experts: M.
        expert_convs, gate_convs: conv layers of the expert and gate trunks.
        expert_hidden, gate_hidden: the two hidden widths ``(h1, h)``; the last one ``h`` is the
            vector the attentive gate uses (expert and gate must agree on it).
        output_relu: ReLU on the class / expert layer before the softmax (Appendix B's literal
            text; off by default, see the module docstring).
    """

    in_channels: int
    image_size: int
    num_classes: int
    num_experts: int
    expert_convs: tuple[Conv, ...]
    expert_hidden: tuple[int, int]
    gate_convs: tuple[Conv, ...]
    gate_hidden: tuple[int, int]
    output_relu: bool = False
    notes: str = field(default="", compare=False)


_MNIST_EXPERT = ((1, 3, 0, False),)
CONFIGS: dict[str, VisionConfig] = {
    # Krishnamurthy et al. (2023) App. B.1: expert conv 1→1 k3 + pool → 1·13·13 → 5 → 32 → 10;
    # gate 1·13·13 → 128 → 32 → 5
    "mnist": VisionConfig(1, 28, 10, 5, _MNIST_EXPERT, (5, 32), ((1, 3, 0, False),), (128, 32)),
    # Krishnamurthy et al. (2023) App. B.4: expert 1·13·13 → 64 → 32 → 10;
    # gate conv 1→8 k3, 8·13·13 → 512 → 32 → 5
    "fmnist": VisionConfig(1, 28, 10, 5, _MNIST_EXPERT, (64, 32), ((8, 3, 0, False),), (512, 32)),
    # Krishnamurthy et al. (2023) App. B.2: experts as MNIST with 12 classes, 6 experts;
    # gate conv k5 → 1·12·12 → 128 → 32 → 6
    "fmnist+mnist": VisionConfig(1, 28, 12, 6, _MNIST_EXPERT, (5, 32), ((1, 5, 0, False),), (128, 32)),
    # Krishnamurthy et al. (2023) App. B.3: 4 conv layers (BN on the 2nd and 4th),
    # 128·2·2 → 1024 → 256 → 100; 20 experts.
    # A 2·2 map after four pools of a 32×32 input needs padding 1 (not stated in the paper).
    "cifar100": VisionConfig(
        3,
        32,
        100,
        20,
        ((16, 3, 1, False), (32, 3, 1, True), (64, 3, 1, False), (128, 3, 1, True)),
        (1024, 256),
        ((64, 3, 1, False), (128, 3, 1, True), (256, 3, 1, False), (512, 3, 1, True)),
        (1024, 256),
    ),
    # scikit-learn digits (8×8, not in the paper): the MNIST design scaled to 8×8 — conv 1→1 k3
    # padding 1 + pool → 1·4·4, the same 5-unit bottleneck → 32 → 10; gate 16 → 128 → 32 → 5
    "digits": VisionConfig(
        1, 8, 10, 5, ((1, 3, 1, False),), (5, 32), ((1, 3, 1, False),), (128, 32), notes="moelab's 8x8 sizing"
    ),
}


def vision_config(data: str, num_experts: int | None = None, output_relu: bool = False) -> VisionConfig:
    """The :data:`CONFIGS` entry of ``data``, optionally with another number of experts."""
    _validate.one_of("data", data, sorted(CONFIGS))
    cfg = replace(CONFIGS[data], output_relu=bool(output_relu))
    if num_experts is not None:
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 2:
            raise ValueError(f"experts={num_experts!r} is not allowed; expected an integer >= 2")
        cfg = replace(cfg, num_experts=num_experts)
    return cfg


class ConvTrunk(nn.Module):
    """Convs (each + ReLU + max-pool 2) → flatten → ``h1`` (ReLU) → ``h`` (ReLU if ``final_relu``)."""

    def __init__(
        self,
        in_channels: int,
        image_size: int,
        convs: Sequence[Conv],
        hidden: tuple[int, int],
        final_relu: bool = True,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c, s = in_channels, image_size
        for out, k, pad, bn in convs:
            layers.append(nn.Conv2d(c, out, k, padding=pad))
            if bn:
                layers.append(nn.BatchNorm2d(out))
            layers += [nn.ReLU(), nn.MaxPool2d(2, 2)]
            c, s = out, (s + 2 * pad - k + 1) // 2
        if s < 1:
            raise ValueError(f"convs={list(convs)} reduce image_size={image_size} to nothing")
        self.features = nn.Sequential(*layers, nn.Flatten())
        self.fc1 = nn.Linear(c * s * s, hidden[0])
        self.fc2 = nn.Linear(hidden[0], hidden[1])
        self.final_relu = final_relu
        self.out_features = hidden[1]

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc2(F.relu(self.fc1(self.features(x))))
        return F.relu(h) if self.final_relu else h


class Expert(nn.Module):
    """One expert: trunk → class layer → softmax; returns ``[probs (K) | hidden (h)]``."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.trunk = ConvTrunk(cfg.in_channels, cfg.image_size, cfg.expert_convs, cfg.expert_hidden)
        self.head = nn.Linear(cfg.expert_hidden[1], cfg.num_classes)
        self.output_relu = cfg.output_relu
        self.num_classes = cfg.num_classes

    def forward(self, x: Tensor) -> Tensor:
        h = self.trunk(x)
        z = self.head(h)
        probs = (F.relu(z) if self.output_relu else z).softmax(dim=-1)
        return torch.cat([probs, h], dim=-1)


class BatchedExperts(SparseExperts):
    """Experts of identical architecture with stacked weights, run together with ``vmap``.

    The :class:`moelab.experts.Experts` protocol, as :class:`moelab.experts.ModuleExperts`.
    ``forward_all`` is one ``vmap(functional_call)`` over the stacked parameters and buffers: every
    layer runs as one batched kernel for all experts.  The sparse ``forward`` is the shared sorted
    dispatch, each expert on its contiguous slice with its parameters unbound once per call.

    Args:
        experts: modules of identical architecture (their current weights are copied).
    """

    def __init__(self, experts: Sequence[nn.Module]) -> None:
        super().__init__()
        experts = list(experts)
        if len(experts) < 1 or not all(isinstance(m, nn.Module) for m in experts):
            raise ValueError(f"experts={experts!r} is not allowed; expected a non-empty list of nn.Module")
        shapes = [[(n, p.shape) for n, p in m.state_dict().items()] for m in experts]
        if any(s != shapes[0] for s in shapes):
            raise ValueError(
                "experts of different architectures cannot be batched; use moelab.experts.ModuleExperts"
            )
        self.num_experts = len(experts)
        self.d_model = None  # the output width is known only by running an expert
        self.chunk_elements = 1 << 22
        params, buffers = stack_module_state(experts)
        self._pnames = list(params)
        self._bnames = list(buffers)
        for name, t in params.items():
            self.register_parameter(self._key(name), nn.Parameter(t.detach().clone()))
        for name, t in buffers.items():
            self.register_buffer(self._key(name), t.detach().clone())
        base = copy.deepcopy(experts[0]).to("meta")
        object.__setattr__(self, "_base", base)  # a template, not a submodule (no parameters)

    @staticmethod
    def _key(name: str) -> str:
        return "stacked__" + name.replace(".", "__")

    def _stacked(self) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        p = {n: getattr(self, self._key(n)) for n in self._pnames}
        b = {n: getattr(self, self._key(n)) for n in self._bnames}
        return p, b

    def _call(self, params: dict[str, Tensor], buffers: dict[str, Tensor], x: Tensor) -> Tensor:
        self._base.train(self.training)
        return functional_call(self._base, (params, buffers), (x,))

    def forward_all(self, x: Tensor) -> Tensor:
        """``(T, ...)`` → ``(T, N, d_out)``: every expert on every sample, batched."""
        p, b = self._stacked()
        out = vmap(self._call, in_dims=(0, 0, None))(p, b, x)  # (N, T, d_out)
        return out.transpose(0, 1)

    def expert_forward(self, x: Tensor, e: int) -> Tensor:
        p, b = self._stacked()
        return self._call({k: v[e] for k, v in p.items()}, {k: v[e] for k, v in b.items()}, x)

    # the sparse mixture of ModuleExperts (the shared sorted dispatch): only the run step on the
    # sorted samples, ``_run``, differs
    mix = ModuleExperts.mix

    def _run(self, xs: Tensor, slots: Slots) -> Tensor:
        """Each expert on its contiguous slice of the expert-sorted samples, its parameters
        unbound once per call."""
        p, b = self._stacked()
        pu = {k: v.unbind(0) for k, v in p.items()}  # unbound once
        bu = {k: v.unbind(0) for k, v in b.items()}
        counts = slots.counts.tolist()  # the one host sync
        outs = [
            self._call({k: v[e] for k, v in pu.items()}, {k: v[e] for k, v in bu.items()}, xe)
            for e, (xe, c) in enumerate(zip(xs.split(counts), counts))
            if c > 0
        ]
        return torch.cat(outs)


def build_experts(cfg: VisionConfig, batched: bool = True) -> nn.Module:
    """``num_experts`` independently initialised :class:`Expert` modules as a bank."""
    experts = [Expert(cfg) for _ in range(cfg.num_experts)]
    return BatchedExperts(experts) if batched else ModuleExperts(experts)


def _expert_outputs(experts: nn.Module, x: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    out = experts.forward_all(x)  # (B, N, K + h)
    return out[..., :num_classes], out[..., num_classes:]


def _topk_routing(probs: Tensor, top_k: int, logits: Tensor | None) -> Routing:
    w, idx = probs.topk(top_k, dim=-1)
    return Routing(indices=idx, weights=w / w.sum(-1, keepdim=True), probs=probs, logits=logits)


class OriginalGate(nn.Module):
    """The original MoE gate: trunk → expert layer (ReLU) → softmax.

    Krishnamurthy et al. (2023) §4.1, App. B.

    ``forward(x, experts, ctx) -> Routing`` with ``probs = p(e|x)``; ``indices`` / ``weights`` are
    the top-K experts with renormalised weights (``top_k = N``: all experts, dense).
    """

    attentive = False

    def __init__(self, cfg: VisionConfig, top_k: int | None = None) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = _validate.int_in_range("top_k", top_k or cfg.num_experts, 1, cfg.num_experts)
        self.trunk = ConvTrunk(cfg.in_channels, cfg.image_size, cfg.gate_convs, cfg.gate_hidden)
        self.head = nn.Linear(cfg.gate_hidden[1], cfg.num_experts)
        self.output_relu = cfg.output_relu
        self.layer_index = 0

    def logits(self, x: Tensor) -> Tensor:
        z = self.head(self.trunk(x))
        return F.relu(z) if self.output_relu else z

    def forward(
        self, x: Tensor, experts: nn.Module | None = None, ctx: RoutingContext | None = None
    ) -> Routing:
        logits = self.logits(x)
        return _topk_routing(logits.softmax(dim=-1), self.top_k, logits)


class AttentiveGate(nn.Module):
    """The attentive gate (Krishnamurthy et al. (2023) §5, eq. 4–6).

    ``G = trunk(x)`` (the last hidden layer without activation, App. B), ``Q = G W_q``,
    ``K_i = E_i W_k`` with ``E_i`` the hidden vector of expert ``i``, and
    ``p(e|x) = softmax(Q Kᵀ / √h)``; ``W_q, W_k`` are ``h × h`` without bias.  The gate runs every
    expert (it needs their hidden vectors), so its Routing carries the chosen experts' outputs.
    """

    attentive = True

    def __init__(self, cfg: VisionConfig, top_k: int | None = None) -> None:
        super().__init__()
        if cfg.gate_hidden[1] != cfg.expert_hidden[1]:
            raise ValueError(
                f"gate_hidden[-1]={cfg.gate_hidden[1]} must equal expert_hidden[-1]={cfg.expert_hidden[1]} "
                "for the attentive gate (Q and K share the width h)"
            )
        self.num_experts = cfg.num_experts
        self.num_classes = cfg.num_classes
        self.top_k = _validate.int_in_range("top_k", top_k or cfg.num_experts, 1, cfg.num_experts)
        self.hidden = cfg.gate_hidden[1]
        self.trunk = ConvTrunk(
            cfg.in_channels, cfg.image_size, cfg.gate_convs, cfg.gate_hidden, final_relu=False
        )
        self.w_q = nn.Linear(self.hidden, self.hidden, bias=False)
        self.w_k = nn.Linear(self.hidden, self.hidden, bias=False)
        self.layer_index = 0

    def attention(self, x: Tensor, expert_hidden: Tensor) -> tuple[Tensor, Tensor]:
        """``(probs (B, N), logits (B, N))`` from the input and the experts' hidden ``(B, N, h)``."""
        q = self.w_q(self.trunk(x))  # (B, h)    eq. 4
        k = self.w_k(expert_hidden)  # (B, N, h) eq. 5
        logits = torch.einsum("bh,bnh->bn", q, k) / math.sqrt(self.hidden)
        return logits.softmax(dim=-1), logits  # eq. 6

    def forward(self, x: Tensor, experts: nn.Module, ctx: RoutingContext | None = None) -> Routing:
        ys, hs = _expert_outputs(experts, x, self.num_classes)
        probs, logits = self.attention(x, hs)
        routing = _topk_routing(probs, self.top_k, logits)
        routing.outputs = ys.gather(1, routing.indices[..., None].expand(-1, -1, ys.shape[-1]))
        return routing


def build_gate(cfg: VisionConfig, gate: str, top_k: int | None = None) -> nn.Module:
    _validate.one_of("gate", gate, ("original", "attentive"))
    return AttentiveGate(cfg, top_k) if gate == "attentive" else OriginalGate(cfg, top_k)


def _vision_config_dict(cfg: VisionConfig) -> dict[str, Any]:
    return asdict(cfg)


def _vision_config_from(data: dict[str, Any]) -> VisionConfig:
    """A :class:`VisionConfig` from its JSON form (lists back to tuples)."""
    d = dict(data)
    for key in ("expert_convs", "gate_convs"):
        d[key] = tuple(tuple(c) for c in d[key])
    for key in ("expert_hidden", "gate_hidden"):
        d[key] = tuple(d[key])
    return VisionConfig(**d)


@dataclass
class MoEOutput:
    """``probs (B, K)`` the model's class distribution, ``gate_probs (B, N)`` p(e|x)."""

    probs: Tensor
    gate_probs: Tensor

    def nll(self, labels: Tensor, eps: float = 1e-7) -> Tensor:
        """NLL of ``log(output + 1e-7)`` (the output-mixture loss of Krishnamurthy et al. (2023)'s code)."""
        return F.nll_loss(torch.log(self.probs + eps), labels)


class ImageMoE(Persistent, nn.Module):
    """Output-mixture MoE over images: ``Σ_e p(e|x) y_e(x)`` (dense) or its top-K (sparse).

    Args:
        cfg: the layer sizes.
        gate: ``"original"`` or ``"attentive"``.
        batched: run the experts as :class:`BatchedExperts` (default) or a :class:`ModuleExperts`
            loop.
    """

    def __init__(self, cfg: VisionConfig, gate: str = "original", batched: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = build_gate(cfg, gate)
        self.experts = build_experts(cfg, batched)

    @property
    def num_classes(self) -> int:
        return self.cfg.num_classes

    def moelab_config(self) -> dict[str, Any]:
        """What :func:`moelab.save` records: the layer sizes, the gate, the expert layout."""
        return {
            "vision": _vision_config_dict(self.cfg),
            "gate": "attentive" if getattr(self.gate, "attentive", False) else "original",
            "batched": isinstance(self.experts, BatchedExperts),
        }

    @classmethod
    def from_moelab_config(cls, config: dict[str, Any]) -> ImageMoE:
        return cls(_vision_config_from(config["vision"]), config["gate"], config["batched"])

    def param_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """The optimizer groups: weight decay on the matrices only (:func:`moelab.optim.param_groups`)."""
        return param_groups(self, weight_decay)

    def forward(self, x: Tensor, top_k: int | None = None) -> MoEOutput:
        """Dense mixture when ``top_k`` is ``None`` (training), else the top-K experts' mixture with
        renormalised weights (conditional computation: with the original gate only the chosen
        experts run)."""
        k = (
            self.cfg.num_experts
            if top_k is None
            else _validate.int_in_range("top_k", top_k, 1, self.cfg.num_experts)
        )
        if getattr(self.gate, "attentive", False):
            ys, hs = _expert_outputs(self.experts, x, self.num_classes)
            p, _ = self.gate.attention(x, hs)
            if top_k is None:
                return MoEOutput(torch.einsum("bn,bnk->bk", p, ys), p)
            r = _topk_routing(p, k, None)
            chosen = ys.gather(1, r.indices[..., None].expand(-1, -1, ys.shape[-1]))
            return MoEOutput(combine(chosen, r.weights), p)
        logits = self.gate.logits(x)
        p = logits.softmax(dim=-1)
        if top_k is None:
            ys, _ = _expert_outputs(self.experts, x, self.num_classes)
            return MoEOutput(torch.einsum("bn,bnk->bk", p, ys), p)
        r = _topk_routing(p, k, logits)
        out = self.experts.mix(x, r.indices, r.weights)[..., : self.num_classes]
        return MoEOutput(out, p)


class SingleModel(Persistent, nn.Module):
    """The single-model baseline: one network with an expert's architecture.

    Krishnamurthy et al. (2023) §7 row 1."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.net = Expert(cfg)

    def moelab_config(self) -> dict[str, Any]:
        """What :func:`moelab.save` records: the layer sizes."""
        return {"vision": _vision_config_dict(self.cfg)}

    @classmethod
    def from_moelab_config(cls, config: dict[str, Any]) -> SingleModel:
        return cls(_vision_config_from(config["vision"]))

    def param_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """The optimizer groups: weight decay on the matrices only (:func:`moelab.optim.param_groups`)."""
        return param_groups(self, weight_decay)

    def forward(self, x: Tensor, top_k: int | None = None) -> MoEOutput:
        probs = self.net(x)[..., : self.cfg.num_classes]
        return MoEOutput(probs, probs.new_ones(probs.shape[0], 1))


def build_model(
    data: str, gate: str = "original", num_experts: int | None = None, batched: bool = True
) -> ImageMoE:
    return ImageMoE(vision_config(data, num_experts), gate, batched)


def distill_gate(model: ImageMoE) -> ImageMoE:
    """The distilled model of Krishnamurthy et al. (2023) §5.1: the attentive model's experts and a new gate.

    The experts are copied and frozen; the gate is a plain :class:`OriginalGate` whose trunk (convs
    and both hidden layers) starts from the attentive gate's trunk; only the gate's expert layer is
    new.  Train the result's gate on the task loss; it then supports conditional computation
    (top-K) at inference."""
    if not isinstance(model.gate, AttentiveGate):
        raise ValueError(
            f"gate={type(model.gate).__name__} is not allowed; distillation starts from an attentive gate"
        )
    new = copy.deepcopy(model)
    gate = OriginalGate(model.cfg)
    gate.trunk.load_state_dict(model.gate.trunk.state_dict())
    new.gate = gate
    for p in new.experts.parameters():
        p.requires_grad_(False)
    return new
