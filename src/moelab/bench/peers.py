"""Peers of ``moelab bench``: other MoE layers built with moelab's router weights, each a
:class:`Peer` (a module mapping tokens ``(T, d)`` to ``(T, d)``, its expert FLOPs per token from
its weights, and what it does differently from moelab): transformers' Mixtral block holding a
moelab SwiGLU layer's weights, the capacity-based ``st-moe-pytorch`` and ``mixture-of-experts``
layers with their stochastic routing switched off (:func:`capacity_stats` measures what they
drop), and the dropless GPU peers of :data:`GPU_PEER_ADAPTERS`.  docs/performance-suite.md ("Candidates
and groups") and docs/performance-gpu.md describe each peer and how it is made to route like moelab.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..layer import MoE
from .harness import expert_flops_per_token

__all__ = [
    "GPU_PEER_ADAPTERS",
    "PEERS",
    "Batched",
    "Peer",
    "capacity_stats",
    "default_policy_skip",
    "lucidrains_peer",
    "mixtral_block",
    "mixtral_peers",
    "stmoe_peer",
]

PEERS = ("mixtral", "stmoe", "lucidrains")

#: the thresholds set on the stochastic second-expert policies: every token keeps its K experts
ALWAYS_ROUTE = 1e-9
#: the default threshold of both packages' stochastic policy
DEFAULT_THRESHOLD = 0.2


class Batched(nn.Module):
    """Tokens ``(T, d)`` → ``peer(x.view(1, T, d))`` (its first output if a tuple) → ``(T, d)``."""

    def __init__(self, peer: nn.Module) -> None:
        super().__init__()
        self.peer = peer

    def forward(self, x: Tensor) -> Tensor:
        out = self.peer(x.unsqueeze(0))
        return (out[0] if isinstance(out, tuple) else out).reshape(x.shape)


class SeqFirst(Batched):
    """Tokens ``(T, d)`` → ``peer(x.view(T, 1, d))`` → ``(T, d)`` (megablocks: sequence first)."""

    def forward(self, x: Tensor) -> Tensor:
        out = self.peer(x.unsqueeze(1))
        return (out[0] if isinstance(out, tuple) else out).reshape(x.shape)


@dataclass
class Peer:
    """A peer layer ready to time.  ``flops``: expert FLOPs per token of the K routed experts,
    from its weights (2 per multiply-add); ``capacity``: it drops token-slots by capacity."""

    name: str
    module: nn.Module
    flops: int
    top_k: int
    d_model: int
    capacity: bool = False
    note: str = ""


def mixtral_block(layer: MoE, impl: str, *, share: bool = False) -> nn.Module:
    """transformers' ``MixtralSparseMoeBlock`` with the ``impl`` experts implementation
    (``"eager"``, ``"grouped_mm"``) computing ``layer``'s function (a moelab SwiGLU ``smoe``
    layer): its router and expert weights copied, or with ``share=True`` its very parameters
    (nothing allocated: the GPU grid's weights take gigabytes).  Mixtral's ``gate_up_proj`` is
    ``[gate | up]`` in ``nn.Linear`` layout, as moelab's ``w_in``.  ``ImportError`` without
    transformers."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    bank = layer.experts
    config = MixtralConfig(
        hidden_size=bank.d_model,
        intermediate_size=bank.d_hidden,
        num_local_experts=bank.num_experts,
        num_experts_per_tok=layer.top_k,
        hidden_act="silu",
        router_jitter_noise=0.0,
    )
    config._experts_implementation = impl  # read by MixtralExperts.forward at every call
    with torch.device("meta"):
        block = MixtralSparseMoeBlock(config)
    take = (lambda p: p) if share else (lambda p: nn.Parameter(p.detach().clone()))
    block.gate.weight = take(layer.router.weight)
    block.experts.gate_up_proj = take(bank.w_in)
    block.experts.down_proj = take(bank.w_out)
    left = [n for n, p in block.named_parameters() if p.is_meta] + [
        n for n, b in block.named_buffers() if b.is_meta
    ]
    if left:
        raise RuntimeError(f"Mixtral parameters not taken from moelab: {left}")
    return block


def mixtral_peers(layer: MoE) -> tuple[list[Peer], str]:
    """transformers' Mixtral block, ``eager`` and ``grouped_mm``, holding copies of ``layer``'s weights."""
    try:
        blocks = {impl: mixtral_block(layer, impl) for impl in ("eager", "grouped_mm")}
    except ImportError:
        return [], "transformers is not installed: Mixtral rows skipped"
    peers = [
        Peer(
            f"mixtral {impl}",
            Batched(block),
            expert_flops_per_token(block, layer.top_k),
            layer.top_k,
            layer.d_model,
        )
        for impl, block in blocks.items()
    ]
    return peers, ""


def stmoe_peer(router_weight: Tensor, top_k: int, d_hidden: int) -> tuple[Peer | None, str]:
    """``st_moe_pytorch.MoE`` with ``router_weight (N, d)`` as its gate and experts of width ``d_hidden``."""
    if top_k < 2:
        return None, "st-moe skipped: its gate needs top_n >= 2 (K=1)"
    try:
        with warnings.catch_warnings():  # beartype's PEP 585 deprecation notes on st-moe's hints
            warnings.simplefilter("ignore")
            from st_moe_pytorch import MoE as StMoE
            from st_moe_pytorch.st_moe_pytorch import Expert
    except ImportError:
        return None, "st-moe skipped: st-moe-pytorch is not installed (pip install 'moelab[bench]')"
    N, d = router_weight.shape
    # st-moe's width is int(d · mult · 2/3); pick the multiplier that lands on d_hidden exactly
    mult = 1.5 * d_hidden / d
    if int(d * mult * 2 / 3) != d_hidden:
        mult = 1.5 * (d_hidden + 0.5) / d
    experts = [Expert(dim=d, hidden_mult=mult) for _ in range(N)]
    width = experts[0].net[0].out_features // 2
    if width != d_hidden:  # pragma: no cover - the arithmetic above is exact for integer widths
        raise RuntimeError(f"st-moe expert width {width} != d_hidden {d_hidden}")
    moe = StMoE(
        dim=d,
        num_experts=N,
        gating_top_n=top_k,
        threshold_train=ALWAYS_ROUTE,
        threshold_eval=ALWAYS_ROUTE,
        experts=nn.ModuleList(experts),  # a Module for its beartype check; Experts wraps it
    )
    with torch.no_grad():
        moe.gate.to_gates.weight.copy_(router_weight)
    lin1, lin2 = moe.experts.experts[0].net[0], moe.experts.experts[0].net[-1]
    flops = top_k * 2 * (lin1.in_features * lin1.out_features + lin2.in_features * lin2.out_features)
    note = (
        "GEGLU + biases + multiplicative bias (its group's moelab and dense: swiglu + biases, "
        "the same matmuls); 2nd..K-th expert thresholds set to 1e-9 (always routed)"
    )
    return Peer("st-moe", Batched(moe), flops, top_k, d, capacity=True, note=note), ""


def lucidrains_peer(layer: MoE) -> tuple[Peer | None, str]:
    """``mixture_of_experts.MoE`` holding the weights of ``layer`` (a moelab ``relu`` or ``gelu``
    top-2 layer without biases): ``w1 = w_inᵀ``, ``w2 = w_outᵀ``, ``w_gating = Wᵀ``."""
    if layer.top_k != 2:
        return None, f"lucidrains skipped: its gate is top-2 only (K={layer.top_k})"
    try:
        from mixture_of_experts import MoE as LucidMoE
    except ImportError:
        return None, "lucidrains skipped: mixture-of-experts is not installed (pip install 'moelab[bench]')"
    bank = layer.experts
    act = {"relu": nn.ReLU, "gelu": nn.GELU}[bank.activation]
    moe = LucidMoE(
        dim=bank.d_model,
        num_experts=bank.num_experts,
        hidden_dim=bank.d_hidden,
        activation=act,
        second_policy_train="all",
        second_policy_eval="all",
    )
    with torch.no_grad():
        moe.gate.w_gating.copy_(layer.router.weight.t())
        moe.experts.w1.copy_(bank.w_in.transpose(1, 2))
        moe.experts.w2.copy_(bank.w_out.transpose(1, 2))
    _, d, h = moe.experts.w1.shape
    flops = 2 * 2 * (d * h + h * d)
    note = (
        f"top-2, {bank.activation}, no gating; second-expert policy 'all' (default 'random', threshold 0.2)"
    )
    return Peer("lucidrains", Batched(moe), flops, 2, d, capacity=True, note=note), ""


def capacity_stats(peer: Peer, x: Tensor) -> dict:
    """One untimed forward of a capacity peer in its current mode (train / eval).

    Returns ``capacity`` (C, slots per expert, the gate's combine tensor's last dimension),
    ``kept`` ``(T, N)`` bool (token ``t`` kept a slot on expert ``e``) and ``output`` ``(T, d)``.
    """
    gate = peer.module.peer.gate
    seen: dict[str, Tensor] = {}

    def hook(module: nn.Module, inputs: tuple, outputs: tuple) -> None:
        seen["combine"] = outputs[1].detach()  # (batch, T, N, C)

    handle = gate.register_forward_hook(hook)
    try:
        with torch.no_grad():
            y = peer.module(x)
    finally:
        handle.remove()
    combine = seen["combine"][0]
    return {"capacity": combine.shape[-1], "kept": combine.ne(0).any(-1), "output": y}


def computed_flops_per_token(peer: Peer, capacity: int, tokens: int) -> int:
    """FLOPs a capacity peer computes per token: its experts on all ``N·C`` buffer rows plus the
    dispatch and combine einsums (``T·N·C·d`` multiply-adds each)."""
    N, d = peer.module.peer.num_experts, peer.d_model
    per_row = peer.flops // peer.top_k  # one expert on one row
    return (N * capacity * per_row + 2 * 2 * tokens * N * capacity * d) // tokens


def default_policy_skip(weights: Tensor) -> float:
    """Expected fraction of the 2nd..K-th slots that the packages' default stochastic policy
    (route with probability ``min(1, w / 0.2)``) would not route, for routing weights ``(T, K)``."""
    rest = weights[:, 1:].float()
    if rest.numel() == 0:
        return 0.0
    return float((1 - rest / DEFAULT_THRESHOLD).clamp_min(0).mean())


# ---------------------------------------------------------------------------------- GPU peers
def _megablocks(layer: MoE, dtype: torch.dtype) -> nn.Module:
    from megablocks.layers.arguments import Arguments
    from megablocks.layers.dmoe import dMoE

    bank, d, h, n = layer.experts, layer.d_model, layer.experts.d_hidden, layer.num_experts
    margs = Arguments(
        hidden_size=d,
        ffn_hidden_size=h,
        moe_num_experts=n,
        moe_top_k=layer.top_k,
        mlp_type="glu",
        mlp_impl="grouped",
        activation_fn=torch.nn.functional.silu,
        bf16=dtype == torch.bfloat16,
        fp16=False,
        device=bank.w_in.device,
        moe_normalize_expert_weights=1.0,
        return_bias=False,
    )
    moe = dMoE(margs)
    with torch.no_grad():
        moe.router.layer.weight.copy_(layer.router.weight)
        moe.experts.mlp.w1.copy_(bank.w_in[:, :h].reshape(n * h, d))
        moe.experts.mlp.v1.copy_(bank.w_in[:, h:].reshape(n * h, d))
        moe.experts.mlp.w2.copy_(bank.w_out.transpose(1, 2).reshape(n * h, d))
    return SeqFirst(moe.to(dtype))


def _torchtitan(layer: MoE, dtype: torch.dtype) -> nn.Module:
    """torchtitan's MoE with ``layer``'s weights (:func:`moelab.train.titan.titan_moe` for 0.3, the
    earlier ``MoEArgs`` API before it); its experts compute in bfloat16 whatever ``dtype`` is."""
    try:
        import torchtitan.models.common.moe  # noqa: F401  torchtitan ≥ 0.3
    except ImportError:
        return _torchtitan_before_0_3(layer, dtype)
    from ..hf.convert import set_method
    from ..train.titan import titan_moe

    # the peer's speed is measured: its MoE has no aux-loss channel, so it runs a copy of the layer
    # without aux losses (titan_moe refuses to drop them without a word)
    plain = copy.deepcopy(layer)
    if plain.coefs:
        set_method(plain, plain.method, **{f"{name}_coef": 0.0 for name in plain.coefs})
    return Batched(titan_moe(plain).to(dtype))


def _torchtitan_before_0_3(layer: MoE, dtype: torch.dtype) -> nn.Module:
    try:
        from torchtitan.models.moe import MoE as TitanMoE
        from torchtitan.models.moe import MoEArgs
    except ImportError:
        from torchtitan.models.moe.moe import MoE as TitanMoE
        from torchtitan.models.moe.moe import MoEArgs
    bank, h = layer.experts, layer.experts.d_hidden
    margs = MoEArgs(
        num_experts=layer.num_experts,
        num_shared_experts=layer.num_shared,
        top_k=layer.top_k,
        score_func="softmax",
        route_norm=True,
        score_before_experts=False,
        use_grouped_mm=True,
        load_balance_coeff=None,
    )
    with torch.device(bank.w_in.device):
        moe = TitanMoE(margs, dim=layer.d_model, hidden_dim=h)
    with torch.no_grad():
        moe.router.gate.weight.copy_(layer.router.weight)
        moe.experts.w1.copy_(bank.w_in[:, :h])
        moe.experts.w3.copy_(bank.w_in[:, h:])
        moe.experts.w2.copy_(bank.w_out)
        if layer.shared is not None:
            sh = layer.num_shared * h
            moe.shared_experts.w1.weight.copy_(layer.shared.fc_in.weight[:sh])
            moe.shared_experts.w3.weight.copy_(layer.shared.fc_in.weight[sh:])
            moe.shared_experts.w2.weight.copy_(layer.shared.fc_out.weight)
    return Batched(moe.to(dtype))


def _sonic(layer: MoE, dtype: torch.dtype) -> nn.Module:
    from sonicmoe import MoE as SonicMoE
    from sonicmoe.enums import ActivationType

    bank = layer.experts
    moe = SonicMoE(
        num_experts=layer.num_experts,
        num_experts_per_tok=layer.top_k,
        hidden_size=layer.d_model,
        intermediate_size=bank.d_hidden,
        activation_function=ActivationType.SWIGLU,
        add_bias=False,
        std=0.02,
    ).to(device=bank.w_in.device, dtype=dtype)
    with torch.no_grad():
        moe.router.weight.copy_(layer.router.weight)
    return Batched(moe)


#: GPU peer name → (distribution whose version is recorded, adapter from a moelab SwiGLU layer and
#: a dtype to a ``(T, d) → (T, d)`` module, what its row must say whatever its output)
GPU_PEER_ADAPTERS: dict[str, tuple[str, Callable[[MoE, torch.dtype], nn.Module], str]] = {
    "megablocks": ("megablocks", _megablocks, ""),
    "torchtitan": ("torchtitan", _torchtitan, ""),
    "sonic-moe": (
        "sonic-moe",
        _sonic,
        "expert weights its own (layout not mapped from moelab's); router weight shared",
    ),
}
