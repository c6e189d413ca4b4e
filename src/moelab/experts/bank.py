"""N MLP experts stored as stacked weights (:class:`ExpertBank`) and the dense FFN (:class:`MLP`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

try:  # sharded weights (expert parallelism, FSDP2); a torch without torch.distributed has none
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = ()

from .. import _validate
from ..functional import ACTIVATIONS, GATED_ACTIVATIONS
from ..functional import activation as get_activation
from .base import SparseExperts
from .dispatch import tracks_grad
from .kernels import (
    KERNELS,
    ExpertWeights,
    ShapeClass,
    WinnerMLP,
    choose_kernel,
    expert_mlp,
    padded_rows,
    run_kernel,
)

__all__ = ["MLP", "ExpertBank"]


class ExpertBank(SparseExperts):
    """N MLP experts stored as stacked weights.

    Expert ``e`` computes ``W_out[e] · act(W_in[e] x + b_in[e]) + b_out[e]``.  Weights use the
    ``nn.Linear`` layout per expert, the layout of transformers' Mixtral experts:
    ``w_in (N, h_in, d)`` with ``h_in = 2h`` laid out ``[gate | up]`` for ``swiglu`` / ``swiglu_clamp`` (else ``h``),
    ``w_out (N, d, h)``.  Init: ``U(-1/√fan_in, 1/√fan_in)`` per matrix (PyTorch's ``nn.Linear``
    bound), biases zero.

    Args:
        num_experts: N.
        d_model: input and output width d.
        d_hidden: hidden width h of each expert.
        activation: a name of :data:`moelab.functional.ACTIVATIONS` (``relu``, ``gelu``, ``silu``,
            ``swiglu``, DeepSeek-V4's ``swiglu_clamp``, ...).
        bias: whether the experts have biases.
        impl: the kernel of :meth:`forward`: ``"auto"`` (chosen per call by
            :func:`moelab.experts.kernels.choose_kernel`) or a name of
            :data:`moelab.experts.KERNELS` (``"loop"``, ``"grouped"``, ``"stream"``, ``"triton"``,
            or one a user added), which then always runs.
        chunk_elements: bound on the hidden activations (elements) that :meth:`forward_all`
            materialises at once.
        gate_rank: ``r`` to factorise each expert's gate projection ``W_g`` (the gate half of
            ``w_in`` for ``swiglu``, all of it otherwise) into ``W_g = B A`` of rank ``r``:
            ``gate_down = A (N, r, d)``, ``gate_up = B (N, h, r)``, and ``w_in`` holds the rest (the
            ``up`` half for ``swiglu``; no rows otherwise).  Autonomy-of-Experts (Lv et al. 2025,
            "Autonomy-of-Experts Models") ranks the experts by ``‖A x‖`` (:meth:`gate_low_rank`,
            the ``aoe`` router); the chosen experts compute with ``B A`` (:attr:`expert_weights`
            composes the full ``w_in``, so every kernel runs unchanged and the gradient reaches
            ``A`` and ``B``).  Init ``A ~ U(±1/√d)``, ``B ~ U(±1/√r)`` (the ``nn.Linear`` bound of
            each factor).  ``None`` (default): a full-rank ``w_in``.
    """

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        d_hidden: int,
        activation: str = "relu",
        bias: bool = False,
        impl: str = "auto",
        chunk_elements: int = 1 << 24,
        gate_rank: int | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = _validate.positive_int("num_experts", num_experts)
        self.d_model = _validate.positive_int("d_model", d_model)
        self.d_hidden = _validate.positive_int("d_hidden", d_hidden)
        _validate.one_of("activation", activation, sorted(ACTIVATIONS))
        self.impl = _validate.one_of("impl", impl, ("auto", *KERNELS))
        self.chunk_elements = _validate.positive_int("chunk_elements", chunk_elements)
        self.activation = activation
        self.act = get_activation(activation)
        h_in = 2 * d_hidden if activation in GATED_ACTIVATIONS else d_hidden
        self.h_in = h_in
        self.gate_rank = None if gate_rank is None else _validate.positive_int("gate_rank", gate_rank)
        if self.gate_rank is None:
            self.w_in = nn.Parameter(torch.empty(num_experts, h_in, d_model))
            self.gate_down = self.gate_up = None
        else:  # W_g = B A; w_in keeps the rows that are not the gate's (swiglu's up half)
            self.w_in = nn.Parameter(torch.empty(num_experts, h_in - d_hidden, d_model))
            self.gate_down = nn.Parameter(torch.empty(num_experts, self.gate_rank, d_model))
            self.gate_up = nn.Parameter(torch.empty(num_experts, d_hidden, self.gate_rank))
        self.w_out = nn.Parameter(torch.empty(num_experts, d_model, d_hidden))
        self.b_in = nn.Parameter(torch.zeros(num_experts, h_in)) if bias else None
        self.b_out = nn.Parameter(torch.zeros(num_experts, d_model)) if bias else None
        #: the kernels :func:`moelab.experts.autotune` picked for this bank, per shape class (set by
        #: that explicit call, never by a forward; not saved with the weights: a timing is the host's)
        self.tuned: dict[ShapeClass, str] = {}
        self.reset_parameters()

    def mix(self, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        """``Σ_k w_k · expert_{i_k}(x)`` for every token, by the kernel :meth:`resolved_impl` names.

        Args:
            x: ``(T, d)`` tokens.
            indices: ``(T, K)`` int64 chosen experts.
            weights: ``(T, K)`` their weights.

        Returns:
            ``(T, d)``.
        """
        w = self.expert_weights  # read once: a parametrized weight (an adapter's W + ΔW) is composed per read
        impl = self.resolved_impl(x, indices.shape[1], tracks_grad(self, x, weights), w)
        return run_kernel(impl, x, indices, weights, w)  # in autocast's dtype under it

    def mix_padded(self, xs: Tensor) -> Tensor:
        """Every expert on its ``C`` rows ``xs (N, C, d)`` as one batched matmul of fixed shape
        (:func:`moelab.experts.kernels.padded_rows`), whatever the routing."""
        return padded_rows(xs, self.expert_weights)

    @property
    def expert_weights(self) -> ExpertWeights:
        """The weight tensors and activation the kernels run (:mod:`moelab.experts.kernels`).

        Every method reads its weights here: the sharded bank of expert parallelism
        (:class:`moelab.experts.parallel.ExpertParallelBank`) gives its local block instead.  A bank
        computes on whole experts, so weights that are ``DTensor`` in any other way (a tensor-parallel
        style applied by hand, ``distribute_tensor``) are refused: taking their local part would
        compute another model."""
        w = (self.w_in, self.w_out, self.b_in, self.b_out)
        for name, t in zip(
            ("w_in", "w_out", "b_in", "b_out", "gate_down", "gate_up"), (*w, self.gate_down, self.gate_up)
        ):
            if isinstance(t, DTensor):
                raise ValueError(
                    f"ExpertBank weight {name} as a DTensor with placements {tuple(t.placements)} is not allowed; "
                    "a bank computes on whole experts: split the experts with moelab.train.parallelize "
                    "(parallelize(model, ep=...) or its ExpertParallel style)"
                )
        if self.gate_rank is not None:  # the gate rows [W_g | ...] composed from their factors
            w = (torch.cat([self.gate_up @ self.gate_down, self.w_in], dim=1), *w[1:])
        return ExpertWeights(*w, self.activation)

    def gate_low_rank(self, x: Tensor) -> Tensor:
        """``A_e x`` for every expert: ``x (T, d)`` → ``(T, N, r)``, the low-rank gate
        pre-activations Autonomy-of-Experts ranks the experts by (``gate_rank`` banks only)."""
        if self.gate_down is None:
            raise ValueError(
                "gate_low_rank is not allowed on an ExpertBank with gate_rank=None; expected a bank built "
                "with gate_rank=r (its gate projections factorised, as method='aoe' builds it)"
            )
        # in x's dtype: a router computing in float32 (router_dtype) reads A x of a bf16 bank in float32
        return torch.einsum("td,nrd->tnr", x, self.gate_down.to(x.dtype))

    @property
    def out_features(self) -> int:
        return self.d_model

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.w_in, -1 / math.sqrt(self.d_model), 1 / math.sqrt(self.d_model))
        if self.gate_rank is not None:
            nn.init.uniform_(self.gate_down, -1 / math.sqrt(self.d_model), 1 / math.sqrt(self.d_model))
            nn.init.uniform_(self.gate_up, -1 / math.sqrt(self.gate_rank), 1 / math.sqrt(self.gate_rank))
        nn.init.uniform_(self.w_out, -1 / math.sqrt(self.d_hidden), 1 / math.sqrt(self.d_hidden))
        for b in (self.b_in, self.b_out):
            if b is not None:
                nn.init.zeros_(b)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, d_model={self.d_model}, d_hidden={self.d_hidden}, "
            f"activation={self.activation!r}, bias={self.b_in is not None}, impl={self.impl!r}"
            + ("" if self.gate_rank is None else f", gate_rank={self.gate_rank}")
        )

    # ------------------------------------------------------------------ per-expert calls
    def expert_forward(self, x: Tensor, e: int) -> Tensor:
        """Expert ``e`` applied to tokens ``x (T, d)`` → ``(T, d)``."""
        w = self.expert_weights
        b_in = None if w.b_in is None else w.b_in[e]
        b_out = None if w.b_out is None else w.b_out[e]
        return expert_mlp(x, w.w_in[e], w.w_out[e], b_in, b_out, self.act)

    def _all_experts(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Every expert on the tokens ``x (t, d)``: pre-activations ``(t, N, h_in)`` and outputs ``(t, N, d)``."""
        w = self.expert_weights
        h = torch.einsum("td,nhd->tnh", x, w.w_in)
        if w.b_in is not None:
            h = h + w.b_in
        y = torch.einsum("tnh,ndh->tnd", self.act(h), w.w_out)
        if w.b_out is not None:
            y = y + w.b_out
        return h, y

    def forward_all(self, x: Tensor) -> Tensor:
        """Every expert on every token: ``x (T, d)`` → ``(T, N, d)``.

        Computed in token chunks so that at most ``chunk_elements`` hidden activations exist at
        once (plus the ``(T, N, d)`` result).
        """
        h_in = self.h_in
        chunk = max(1, self.chunk_elements // (self.num_experts * h_in))
        outs = []
        for xc in x.split(chunk):
            outs.append(self._all_experts(xc)[1])
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def forward_winners(self, x: Tensor, choose) -> tuple[Tensor, Tensor, Any]:
        """Every expert on every token once, and the chosen experts' outputs with autograd.

        The competition's pass (CompeteSMoE (2024) §3.1; CompeteSMoE (2025) §2.2): all N experts run without autograd in token
        chunks; ``choose(outputs (t, N, d)) -> (indices (t, K), extra)`` picks each token's winners
        from their outputs; the winners' outputs and pre-activations are kept and the rest
        dropped.  The returned outputs back-propagate to the winners only, through the kept
        activations (:class:`WinnerMLP`): no expert runs twice, and the activation memory is that
        of a K-expert step.

        Returns:
            ``(indices (T, K), outputs (T, K, d), extra)``, ``extra`` concatenated over chunks.
        """
        h_in = self.h_in
        chunk = max(1, min(self.chunk_elements, 1 << 22) // (self.num_experts * h_in))
        idx_l, h_l, y_l, extra_l = [], [], [], []
        with torch.no_grad():
            for xc in x.split(chunk):
                h, y = self._all_experts(xc)
                idx, extra = choose(y)
                pick = idx.unsqueeze(-1)
                idx_l.append(idx)
                h_l.append(h.gather(1, pick.expand(-1, -1, h_in)))
                y_l.append(y.gather(1, pick.expand(-1, -1, y.shape[-1])))
                extra_l.append(extra)
        cat = lambda ts: torch.cat(ts) if len(ts) > 1 else ts[0]
        winners, h_w, y_w, extra = cat(idx_l), cat(h_l), cat(y_l), cat(extra_l)
        if torch.is_grad_enabled():
            w = self.expert_weights
            y_w = WinnerMLP.apply(
                x, w.w_in, w.w_out, w.b_in, w.b_out, winners, h_w, y_w, self.activation, self.act
            )
        return winners, y_w, extra

    def resolved_impl(
        self, x: Tensor, top_k: int = 1, grad: bool = True, weights: ExpertWeights | None = None
    ) -> str:
        """The kernel :meth:`forward` runs for ``x (T, d)`` routed to ``top_k`` experts per token,
        with (``grad``) or without autograd: an explicit ``impl`` as it is (that kernel always
        runs, and raises a ``ValueError`` where it cannot), ``"auto"`` by
        :func:`moelab.experts.kernels.choose_kernel` (on ``weights``, the caller's
        :attr:`expert_weights`, when it has them)."""
        if self.impl != "auto":
            return self.impl
        return choose_kernel(x, top_k, self.expert_weights if weights is None else weights, grad, self.tuned)


class MLP(nn.Module):
    """A dense two-layer FFN ``W_out · act(W_in x + b_in) + b_out``.

    The shared experts of ``sharede-v2`` / ``sharede-v3`` (S shared experts of width h are one
    MLP of width S·h: their outputs add with weight 1) and the dense-limit baseline of the
    benchmarks.  Initialisation as :class:`ExpertBank`.
    """

    def __init__(self, d_model: int, d_hidden: int, activation: str = "relu", bias: bool = False) -> None:
        super().__init__()
        _validate.positive_int("d_model", d_model)
        _validate.positive_int("d_hidden", d_hidden)
        self.act = get_activation(activation)
        width = 2 * d_hidden if activation in GATED_ACTIVATIONS else d_hidden
        self.fc_in = nn.Linear(d_model, width, bias=bias)
        self.fc_out = nn.Linear(d_hidden, d_model, bias=bias)
        for fc in (self.fc_in, self.fc_out):
            bound = 1.0 / math.sqrt(fc.in_features)
            nn.init.uniform_(fc.weight, -bound, bound)
            if bias:
                nn.init.zeros_(fc.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_out(self.act(self.fc_in(x)))
