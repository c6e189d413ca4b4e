"""Decoder-only Transformer language models whose FFNs are MoE layers of any method, in the setting of
CompeteSMoE (2024) §6.1 and App. C.2 (16 experts, top-2, expert width ``d_model``, ReLU experts,
dropout 0.1; pre-LayerNorm blocks with causal attention) and three arrangements (``switch``,
``glam``, ``dense``), with the size presets (:data:`PRESETS`) and their training budgets
(:data:`TRAINING`) in one place.  docs/methods.md ("Language models") gives the arrangements and
the presets with their parameter counts.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from torch import Tensor, nn

from .. import _validate
from ..adapters import adapter_config, restore_adapter
from ..experts import MLP
from ..functional import ATTENTION_ACTIVATIONS, ATTENTIONS, attention_activation, multi_head_attention
from ..io.model import Persistent
from ..layer import MoE, moe_layers
from ..methods import method_router_options
from ..optim import param_groups
from ..padding import masked_tokens

__all__ = [
    "ARCHS",
    "ATTENTIONS",
    "ATTENTION_ACTIVATIONS",
    "INITS",
    "PRESETS",
    "TRAINING",
    "LMConfig",
    "TransformerLM",
    "lm_config",
]

ARCHS = ("switch", "glam", "dense")
#: ``gpt2``: N(0, 0.02) embeddings and attention, the residual projection scaled by 1/√(2L), the MoE
#: layers' own init; ``moeut``: MoEUT's (Csordás et al. 2024), which CompeteSMoE (2025) uses for its
#: 1B model (:func:`moeut_init_`)
INITS = ("gpt2", "moeut")
#: ``standard``: softmax(QKᵀ/√d) V; ``active``: Active-Attention of Ho (2025), softmax(QKᵀ/√d) σ(V)


@dataclass
class LMConfig:
    """Everything that defines a :class:`TransformerLM`.

    Attributes:
        vocab_size: tokens in the vocabulary.
        block_size: maximum context length.
        n_layer: Transformer blocks.
        d_model: width.
        n_head: attention heads (must divide ``d_model`` unless ``d_head`` is set).
        d_head: width of each head (``None``: ``d_model / n_head``); the attention projects to
            ``n_head · d_head`` and back (CompeteSMoE (2025)'s 1B model: 32 heads of 128 at d 1024).
        arch: ``switch``, ``glam`` or ``dense`` (see the module docstring).
        method: MoE method name (:func:`moelab.methods`).
        num_experts: experts per MoE layer (16 in CompeteSMoE (2024)).
        top_k: experts per token (2 in CompeteSMoE (2024)).
        d_hidden: expert hidden width (default ``d_model``, CompeteSMoE (2024)).
        activation: expert activation (``relu`` in CompeteSMoE (2024)).
        dropout: dropout on attention, residual branches and embeddings (0.1 in CompeteSMoE (2024)).
        method_options: options passed to every :class:`moelab.MoE` (``--opt key=value``).
        attention: ``standard`` (default) or ``active``, Active-Attention of Ho (2025):
            ``softmax(QKᵀ/√d) σ(V)`` with a non-linear σ (:data:`ATTENTIONS`).
        attention_activation: σ of ``active`` attention, one of :data:`ATTENTION_ACTIVATIONS`
            (default ``gelu``); refused with ``standard`` attention.
        init: the weights' initialisation, one of :data:`INITS` (``gpt2``, the default, or ``moeut``).
    """

    vocab_size: int
    block_size: int = 512
    n_layer: int = 3
    d_model: int = 256
    n_head: int = 8
    arch: str = "switch"
    method: str = "smoe"
    num_experts: int = 16
    top_k: int = 2
    d_hidden: int | None = None
    activation: str = "relu"
    dropout: float = 0.1
    method_options: dict[str, Any] = field(default_factory=dict)
    attention: str = "standard"
    attention_activation: str | None = None
    d_head: int | None = None
    init: str = "gpt2"

    def __post_init__(self) -> None:
        self.attention_activation = attention_activation(self.attention, self.attention_activation)
        _validate.positive_int("vocab_size", self.vocab_size)
        _validate.positive_int("block_size", self.block_size)
        _validate.positive_int("n_layer", self.n_layer)
        _validate.positive_int("d_model", self.d_model)
        _validate.positive_int("n_head", self.n_head)
        _validate.one_of("arch", self.arch, ARCHS)
        _validate.positive_int("num_experts", self.num_experts)
        _validate.int_in_range("top_k", self.top_k, 1, self.num_experts)
        if self.d_hidden is not None:
            _validate.positive_int("d_hidden", self.d_hidden)
        if self.d_head is not None:
            _validate.positive_int("d_head", self.d_head)
        _validate.one_of("init", self.init, INITS)
        if self.d_head is None and self.d_model % self.n_head:
            raise ValueError(
                f"n_head={self.n_head} is not allowed for d_model={self.d_model}; n_head must divide d_model"
            )
        if not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1):
            raise ValueError(f"dropout={self.dropout!r} is not allowed; expected a number in [0, 1)")
        if self.arch == "glam" and self.n_layer < 2:
            raise ValueError(f"n_layer={self.n_layer} is not allowed for arch='glam'; expected >= 2")
        if self.arch != "dense" and _leaks_future_tokens(self.method):
            warnings.warn(
                f"method={self.method!r} routes each expert's top tokens over the whole batch, so a causal "
                "language model sees future tokens through it (its loss is not a language model's); "
                "use it as an ablation only",
                stacklevel=3,
            )

    @property
    def hidden(self) -> int:
        return self.d_model if self.d_hidden is None else self.d_hidden

    @property
    def attention_width(self) -> int:
        """``n_head · d_head``: the width of the queries, keys and values."""
        return self.d_model if self.d_head is None else self.n_head * self.d_head

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` has an MoE FFN."""
        if self.arch == "switch":
            return True
        if self.arch == "glam":
            return layer % 2 == 1
        return False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LMConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


#: the paper's model sizes (CompeteSMoE (2024) §6.1, docs/references.md) and CPU sizes; the training budget of
#: each size is :data:`TRAINING`
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layer=3, d_model=256, n_head=8, block_size=512, dropout=0.1),
    "small": dict(n_layer=6, d_model=264, n_head=8, block_size=512, dropout=0.1),
    "medium": dict(n_layer=8, d_model=352, n_head=8, block_size=512, dropout=0.1),
    # the WikiText-103 model of CompeteSMoE (2024)'s public code: 3 layers, d 128, block 256, dropout 0.7.
    # The paper's WikiText-103 runs use its small and medium models (§6.1, Table 7: sequence 512),
    # which are `small` and `medium` with `--data wikitext103` (configs/lm/wikitext103-*.yaml)
    "wt103-ref": dict(n_layer=3, d_model=128, n_head=8, block_size=256, dropout=0.7),
    # small enough that 1000 steps take minutes on 2 CPU cores; no dropout for short runs
    "cpu": dict(n_layer=2, d_model=64, n_head=4, block_size=128, dropout=0.0),
    # the cpu model with a 32-byte context: the main job (`make demo`); at a budget of ~400k tokens a
    # shorter context and more, smaller steps learn more per token than block 128 (docs/results.md)
    "demo": dict(n_layer=2, d_model=64, n_head=4, block_size=32, dropout=0.0),
    # between cpu and tiny: a model that still learns after thousands of CPU steps (our choice)
    "mini": dict(n_layer=3, d_model=96, n_head=4, block_size=128, dropout=0.0),
    # CompeteSMoE (2025)'s 1B language model (App. H.2, Table 18): 24 layers of d 1024, 32 heads of 128,
    # an MoE FFN in every block with 24 ReLU experts of width 512, K = 8, MoEUT's init.  Its context
    # (1024) is the authors' public MoEUT-framework configs' `lm.unroll`; the paper's model has
    # RoPE and an untied head, moelab's LM learned positions and a tied head (docs/methods.md).
    # A runnable shape, not trained here (about 1.0B parameters)
    "compete-1b": dict(
        n_layer=24,
        d_model=1024,
        n_head=32,
        d_head=128,
        block_size=1024,
        dropout=0.0,
        num_experts=24,
        top_k=8,
        d_hidden=512,
        activation="relu",
        init="moeut",
    ),
}


#: the training budget of each size (the ``moelab train`` defaults): CompeteSMoE (2024) App. C.2 (Adam 7e-4,
#: batch 48, sequence 512, 60k / 80k steps) for the paper sizes, and CPU settings of a few hundred steps
_PAPER = dict(
    lr=7e-4,
    schedule="inverse_sqrt",
    warmup=None,
    batch_size=48,
    eval_every=1000,
    eval_tokens=500_000,
    ckpt_every=1000,
)
TRAINING: dict[str, dict[str, Any]] = {
    "tiny": {**_PAPER, "steps": 60000},
    "small": {**_PAPER, "steps": 60000},
    "medium": {**_PAPER, "steps": 80000},
    "wt103-ref": {**_PAPER, "steps": 60000},
    # cpu: the paper's schedule, but a larger step and warm-up for a run this short (our choice:
    # 300 steps with lr 2e-3 / warm-up 30 reach a clearly lower BPC than 7e-4 / 15)
    "cpu": dict(
        lr=2e-3,
        schedule="inverse_sqrt",
        warmup=30,
        steps=300,
        batch_size=16,
        eval_every=50,
        eval_tokens=16384,
        ckpt_every=100,
    ),
    # demo: the main job, 15 runs that fit a CPU minute or two (our choice; timed in
    # docs/performance.md): 400 steps of 32 × 32 bytes at a constant 2e-3 after an 80-step warm-up;
    # the 1/√t decay halves the step size while the model is still learning fast and ends higher at
    # this budget (docs/results.md, the CPU-scale comparison)
    "demo": dict(
        lr=2e-3,
        schedule="constant",
        warmup=80,
        steps=400,
        batch_size=32,
        eval_every=100,
        eval_tokens=16384,
        ckpt_every=200,
    ),
    # compete-1b: CompeteSMoE (2025) Table 19 (MoEUT's configuration): AdamW 2.5e-4, cosine to 0.1 of it,
    # 4000 warm-up steps, batch 64, 200k steps.  The authors' public configs add weight decay 0.01 and
    # gradient clipping 0.1, which are flags with defaults of their own: docs/methods.md gives the command
    "compete-1b": dict(
        lr=2.5e-4,
        schedule="cosine",
        warmup=4000,
        steps=200_000,
        batch_size=64,
        eval_every=5000,
        eval_tokens=1_000_000,
        ckpt_every=5000,
    ),
    # mini: the cpu setting for runs of thousands of steps (docs/results.md's decisive comparison)
    "mini": dict(
        lr=2e-3,
        schedule="inverse_sqrt",
        warmup=100,
        steps=4000,
        batch_size=16,
        eval_every=250,
        eval_tokens=65536,
        ckpt_every=500,
    ),
}


def lm_config(size: str, vocab_size: int, **overrides: Any) -> LMConfig:
    """The :class:`LMConfig` of preset ``size`` (``tiny``, ``small``, ``medium``, ``cpu``)."""
    _validate.one_of("size", size, list(PRESETS))
    return LMConfig(vocab_size=vocab_size, **{**PRESETS[size], **overrides})


@torch.no_grad()
def moeut_init_(model: TransformerLM) -> None:
    """MoEUT's initialisation (Csordás et al. 2024; its public code, ``MoEUT.reset_parameters``), which
    CompeteSMoE (2025) uses for its 1B model: with ``s = √(2 / n_layer)``, the attention's queries,
    keys and values ``N(0, s²/d)`` and its output ``N(0, s²/(n_head·d_head))``; every MoE layer's
    expert input matrices ``N(0, s²/d)``, output matrices ``N(0, s²/(N·h))`` (the fan-in of all the
    experts' hidden units together, as σ-MoE's ``values``), and its router's ``(N, d)`` weight
    ``N(0, s²/d)`` with each row rescaled to one norm (``renorm_keep_std``: rows of equal norm,
    the overall std kept); the token embedding ``N(0, 1/d)`` (``kaiming_normal_``, fan-in, linear);
    biases zero and LayerNorms one / zero.  Dense FFNs and shared experts get the experts' rule with N = 1.  moelab's
    learned position embedding, which MoEUT has no counterpart of (RoPE), keeps GPT-2's N(0, 0.02²)."""
    cfg = model.cfg
    s, d = math.sqrt(2 / cfg.n_layer), cfg.d_model
    nn.init.normal_(model.tok_emb.weight, std=1 / math.sqrt(d))
    nn.init.normal_(model.pos_emb.weight, std=0.02)
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
    for block in model.blocks:
        nn.init.normal_(block.attn.qkv.weight, std=s / math.sqrt(d))
        nn.init.normal_(block.attn.proj.weight, std=s / math.sqrt(cfg.attention_width))
        nn.init.zeros_(block.attn.qkv.bias)
        nn.init.zeros_(block.attn.proj.bias)
        ffn = block.ffn
        if isinstance(ffn, MoE):
            n, h = ffn.num_experts, ffn.experts.w_out.shape[-1]
            nn.init.normal_(ffn.experts.w_in, std=s / math.sqrt(d))
            nn.init.normal_(ffn.experts.w_out, std=s / math.sqrt(n * h))
            for weight in ffn.router.parameters():
                if weight.shape == (n, d):
                    nn.init.normal_(weight, std=s / math.sqrt(d))
                    std = weight.std()
                    weight.div_(weight.norm(dim=1, keepdim=True))
                    weight.mul_(std / weight.std())
    for mlp in (m for m in model.modules() if isinstance(m, MLP)):  # dense FFNs, shared experts
        nn.init.normal_(mlp.fc_in.weight, std=s / math.sqrt(d))
        nn.init.normal_(mlp.fc_out.weight, std=s / math.sqrt(mlp.fc_out.weight.shape[1]))
        for bias in (mlp.fc_in.bias, mlp.fc_out.bias):
            if bias is not None:
                nn.init.zeros_(bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        width = cfg.attention_width
        self.qkv = nn.Linear(cfg.d_model, 3 * width)
        self.proj = nn.Linear(width, cfg.d_model)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)
        # Active-Attention (Ho (2025)): σ on the values (functional.multi_head_attention); None
        # keeps the standard attention untouched
        self.value_activation = cfg.attention_activation if cfg.attention == "active" else None

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=2)  # 3 × (B, L, n_head · d_head)
        y = multi_head_attention(
            q,
            k,
            v,
            self.n_head,
            causal=True,
            value_activation=self.value_activation,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.resid_drop(self.proj(y))


def _leaks_future_tokens(method: str) -> bool:
    """Whether ``method``'s router lets a token's routing depend on later tokens (expert-choice)."""
    from ..methods import get_method
    from ..routers import ROUTERS

    return ROUTERS[get_method(method).router].leaks_future_tokens


class Block(nn.Module):
    """Pre-LN block: ``x + attn(ln(x))``, then ``x + ffn(ln(x))`` with an MoE or dense FFN."""

    def __init__(self, cfg: LMConfig, moe: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        if moe:
            options = dict(cfg.method_options)
            if "vocab_size" in method_router_options(cfg.method):  # a router that routes by token id
                options.setdefault("vocab_size", cfg.vocab_size)
            self.ffn: nn.Module = MoE(
                cfg.d_model,
                cfg.num_experts,
                cfg.top_k,
                d_hidden=cfg.hidden,
                method=cfg.method,
                activation=cfg.activation,
                **options,
            )
        else:
            width = cfg.top_k * cfg.hidden if cfg.arch == "dense" else cfg.hidden
            self.ffn = MLP(cfg.d_model, width, activation=cfg.activation)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, idx: Tensor | None = None, doc_ids: Tensor | None = None) -> Tensor:
        """``idx``: the token ids of ``x``, for an MoE router that routes by them (DeepSeek-V4's hash
        layers); ``doc_ids``: their documents, for one that routes by document (EMO), each sequence
        one document when ``None``."""
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        if not isinstance(self.ffn, MoE):
            h = self.ffn(h)
        elif self.ffn.router.takes_doc_ids:
            h = self.ffn(
                h,
                token_ids=idx,
                doc_ids=torch.zeros_like(x[..., 0], dtype=torch.long) if doc_ids is None else doc_ids,
            )
        else:
            h = self.ffn(h) if idx is None else self.ffn(h, token_ids=idx)
        return x + self.drop(h)


class TransformerLM(Persistent, nn.Module):
    """Decoder-only LM: token + position embeddings → blocks → LayerNorm → tied LM head.

    ``forward(idx (B, L)) → logits (B, L, vocab)``; :meth:`features` gives the final hidden
    states ``(B, L, d)`` (the fine-tuning trunk, CompeteSMoE (2024) §6.3).
    """

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, cfg.is_moe(i)) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying (nanoGPT)
        # numbered as moelab.attach numbers them, so a model used without a context routes each layer
        # as its place says (DeepSeek-V4's first hash_layers are hash-routed, not every layer 0)
        for i, layer in enumerate(moe_layers(self)):
            layer.layer_index = i
        self._init_weights()

    def _init_weights(self) -> None:
        if self.cfg.init == "moeut":
            moeut_init_(self)
            return
        # GPT-2 init for embeddings and attention; FFNs (MoE routers/experts, dense MLPs) keep
        # their own init (ExpertBank / MLP: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), the routers' own)
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        nn.init.normal_(self.pos_emb.weight, std=0.02)
        for block in self.blocks:
            for fc in (block.attn.qkv, block.attn.proj):
                nn.init.normal_(fc.weight, std=0.02)
                nn.init.zeros_(fc.bias)
            # scaled residual projection (GPT-2)
            nn.init.normal_(block.attn.proj.weight, std=0.02 / math.sqrt(2 * self.cfg.n_layer))

    @property
    def moe_layers(self) -> list[nn.Module]:
        return moe_layers(self)

    def features(self, idx: Tensor, mask: Tensor | None = None, doc_ids: Tensor | None = None) -> Tensor:
        """Final hidden states ``(B, L, d)`` of token ids ``idx (B, L)``; ``mask (B, L)`` (True
        for a real token) keeps padding out of the MoE layers' routing, balance and capacity
        (:func:`moelab.padding.masked_tokens`, one host sync a forward); causal attention keeps
        right padding out of the real tokens' states.  ``doc_ids (B, L)``: each token's document,
        for the MoE layers that route by document (EMO); ``None``: each sequence is one document
        (the corpora are sampled as windows of a stream)."""
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"idx of shape {tuple(idx.shape)} and dtype {idx.dtype} is not allowed; expected token ids "
                "(B, L) of dtype int64"
            )
        if not torch.compiler.is_compiling() and idx.numel():  # one reduction; compiled graphs skip it
            low, high = int(idx.min()), int(idx.max())
            if low < 0 or high >= self.cfg.vocab_size:
                raise ValueError(
                    f"token id {low if low < 0 else high} is not allowed; expected ids in [0, "
                    f"{self.cfg.vocab_size - 1}] (vocab_size={self.cfg.vocab_size})"
                )
        L = idx.shape[1]
        if L > self.cfg.block_size:
            raise ValueError(
                f"sequence length {L} is not allowed; expected at most block_size={self.cfg.block_size}"
            )
        pos = torch.arange(L, device=idx.device)
        if mask is not None and (not isinstance(mask, Tensor) or mask.shape != idx.shape):
            got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(
                f"mask of shape {got} is not allowed; expected the shape of idx, {tuple(idx.shape)}"
            )
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, L, d)
        with masked_tokens(mask):  # the scope of this forward only
            for block in self.blocks:
                x = block(x, idx, doc_ids)
        return self.ln_f(x)

    def forward(self, idx: Tensor, mask: Tensor | None = None, doc_ids: Tensor | None = None) -> Tensor:
        """Logits ``(B, L, vocab)`` of ``idx (B, L)``; ``mask``: the real tokens, ``doc_ids`` their
        documents (:meth:`features`)."""
        return self.head(self.features(idx, mask, doc_ids))

    def moelab_config(self) -> dict[str, Any]:
        """What :func:`moelab.save` records to rebuild this model (the :class:`LMConfig`, and the
        settings of its LoRA / RepLoRA adapter if it holds one)."""
        config = self.cfg.to_dict()
        adapter = adapter_config(self)
        if adapter is not None:
            config["adapter"] = adapter
        return config

    @classmethod
    def from_moelab_config(cls, config: dict[str, Any]) -> TransformerLM:
        model = cls(LMConfig.from_dict(config))
        if config.get("adapter"):
            restore_adapter(model, config["adapter"], freeze=False)
        return model

    def param_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """The optimizer groups: weight decay on the matrices only (:func:`moelab.optim.param_groups`)."""
        return param_groups(self, weight_decay)
