"""N MLP experts stored as stacked weights (:class:`ExpertBank`) and the dense FFN (:class:`MLP`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from .. import _validate
from ..functional import ACTIVATIONS
from ..functional import activation as get_activation
from .dispatch import tracks_grad
from .kernels import KERNELS, _WinnerMLP, expert_mlp, grouped_mm_available

__all__ = ["MLP", "ExpertBank"]


class ExpertBank(nn.Module):
    """N MLP experts stored as stacked weights.

    Expert ``e`` computes ``W_out[e] · act(W_in[e] x + b_in[e]) + b_out[e]``.  Weights use the
    ``nn.Linear`` layout per expert, the layout of transformers' Mixtral experts:
    ``w_in (N, h_in, d)`` with ``h_in = 2h`` laid out ``[gate | up]`` for ``swiglu`` (else ``h``),
    ``w_out (N, d, h)``.  Init: ``U(-1/√fan_in, 1/√fan_in)`` per matrix (PyTorch's ``nn.Linear``
    bound), biases zero.

    Args:
        num_experts: N.
        d_model: input and output width d.
        d_hidden: hidden width h of each expert.
        activation: ``relu``, ``gelu``, ``silu`` or ``swiglu``.
        bias: whether the experts have biases.
        impl: the kernel of :meth:`forward`: ``"auto"`` (chosen per call by :meth:`resolved_impl`)
            or a name of :data:`moelab.experts.KERNELS` (``"loop"``, ``"grouped"``, ``"stream"``),
            which then always runs.
        chunk_elements: bound on the hidden activations (elements) that :meth:`forward_all`
            materialises at once.
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
        h_in = 2 * d_hidden if activation == "swiglu" else d_hidden
        self.w_in = nn.Parameter(torch.empty(num_experts, h_in, d_model))
        self.w_out = nn.Parameter(torch.empty(num_experts, d_model, d_hidden))
        self.b_in = nn.Parameter(torch.zeros(num_experts, h_in)) if bias else None
        self.b_out = nn.Parameter(torch.zeros(num_experts, d_model)) if bias else None
        self.reset_parameters()

    def forward(self, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        """``Σ_k w_k · expert_{i_k}(x)`` for every token, by the kernel :meth:`resolved_impl` names.

        Args:
            x: ``(T, d)`` tokens.
            indices: ``(T, K)`` int64 chosen experts.
            weights: ``(T, K)`` their weights.

        Returns:
            ``(T, d)``.
        """
        impl = self.resolved_impl(x, indices.shape[1], tracks_grad(self, x, weights))
        return KERNELS[impl](self, x, indices, weights)

    @property
    def out_features(self) -> int:
        return self.d_model

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.w_in, -1 / math.sqrt(self.d_model), 1 / math.sqrt(self.d_model))
        nn.init.uniform_(self.w_out, -1 / math.sqrt(self.d_hidden), 1 / math.sqrt(self.d_hidden))
        for b in (self.b_in, self.b_out):
            if b is not None:
                nn.init.zeros_(b)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, d_model={self.d_model}, d_hidden={self.d_hidden}, "
            f"activation={self.activation!r}, bias={self.b_in is not None}, impl={self.impl!r}"
        )

    # ------------------------------------------------------------------ per-expert calls
    def expert_forward(self, x: Tensor, e: int) -> Tensor:
        """Expert ``e`` applied to tokens ``x (T, d)`` → ``(T, d)``."""
        b_in = None if self.b_in is None else self.b_in[e]
        b_out = None if self.b_out is None else self.b_out[e]
        return expert_mlp(x, self.w_in[e], self.w_out[e], b_in, b_out, self.act)

    def _all_experts(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Every expert on the tokens ``x (t, d)``: pre-activations ``(t, N, h_in)`` and outputs ``(t, N, d)``."""
        h = torch.einsum("td,nhd->tnh", x, self.w_in)
        if self.b_in is not None:
            h = h + self.b_in
        y = torch.einsum("tnh,ndh->tnd", self.act(h), self.w_out)
        if self.b_out is not None:
            y = y + self.b_out
        return h, y

    def forward_all(self, x: Tensor) -> Tensor:
        """Every expert on every token: ``x (T, d)`` → ``(T, N, d)``.

        Computed in token chunks so that at most ``chunk_elements`` hidden activations exist at
        once (plus the ``(T, N, d)`` result).
        """
        h_in = self.w_in.shape[1]
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
        activations (:class:`_WinnerMLP`): no expert runs twice, and the activation memory is that
        of a K-expert step.

        Returns:
            ``(indices (T, K), outputs (T, K, d), extra)``, ``extra`` concatenated over chunks.
        """
        h_in = self.w_in.shape[1]
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
            y_w = _WinnerMLP.apply(
                x, self.w_in, self.w_out, self.b_in, self.b_out, winners, h_w, y_w, self.activation, self.act
            )
        return winners, y_w, extra

    # ------------------------------------------------------------------ choosing the kernel
    def grouped_aligned(self, dtype: torch.dtype) -> bool:
        """Whether ``d_model`` and ``d_hidden`` give ``grouped_mm`` the 16-byte aligned row strides
        it requires (multiples of 4 in float32, of 8 in bfloat16 / float16)."""
        per = 16 // torch.empty((), dtype=dtype).element_size()
        return self.d_model % per == 0 and self.d_hidden % per == 0

    def grouped_ok(self, x: Tensor) -> bool:
        """Whether the ``"grouped"`` implementation runs for ``x`` (device, dtype, alignment)."""
        return grouped_mm_available(x.device, x.dtype) and self.grouped_aligned(x.dtype)

    #: on the CPU with one torch thread, ``"auto"`` trains with ``"loop"`` from this many token slots
    #: per expert on (``T·K/N``): there the loop's activation on each expert's rows while they are in
    #: cache beats ``grouped_mm``'s one activation pass over all ``T·K`` rows (T=2048, 16 experts
    #: top-2: 1.11x dense against 1.16x); below it ``grouped_mm``'s C++ loop over the experts beats
    #: the Python one.  With more threads the loop runs whole experts on each thread
    #: (:mod:`moelab.experts.threads`) and is ahead at every size measured, T = 16 to 8192
    #: (``moelab bench layer``, docs/performance.md)
    LOOP_ROWS_PER_EXPERT = 256
    #: on the CPU with one torch thread, ``"auto"`` infers with ``"stream"`` from this many slots
    #: per expert on (no ``(T·K, d)`` buffers; below it ``grouped_mm`` wins)
    STREAM_ROWS_PER_EXPERT = 256

    def resolved_impl(self, x: Tensor, top_k: int = 1, grad: bool = True) -> str:
        """The implementation ``forward`` uses for ``x (T, d)`` routed to ``top_k`` experts per token,
        with (``grad``) or without autograd.

        An explicit ``impl`` (``"loop"``, ``"grouped"``, ``"stream"``, any kernel of
        :data:`moelab.experts.KERNELS`) is returned as it is: that kernel always runs, and raises a
        ``ValueError`` where it cannot.  ``"auto"`` follows this rule, on the CPU: ``"stream"`` for
        decoding-sized inference (``T·K ≤ N``) and wherever ``grouped_mm`` cannot run without
        autograd; with several torch threads ``"loop"`` (experts spread over the threads); with one,
        inference takes ``"stream"`` from :attr:`STREAM_ROWS_PER_EXPERT` slots per expert on and
        training ``"loop"`` from :attr:`LOOP_ROWS_PER_EXPERT` on.  Otherwise, and on other devices,
        ``"grouped"`` wherever :meth:`grouped_ok` (no host sync), else ``"loop"`` (float64,
        unaligned sizes, older torch).  While torch.compile traces, never ``"stream"`` (its host
        sync would break the graph) and never the threaded loop (``"grouped"`` where it can run).
        """
        if self.impl != "auto":
            return self.impl
        cpu = x.device.type == "cpu" and not torch.compiler.is_compiling()
        slots, n = x.shape[0] * top_k, self.num_experts
        grouped = self.grouped_ok(x)
        one = cpu and torch.get_num_threads() == 1  # not read while tracing: a graph break
        if not grad and cpu:
            decoding = slots <= n
            large = slots >= self.STREAM_ROWS_PER_EXPERT * n and one
            if not grouped or decoding or large:
                return "stream"
        if not grouped or (cpu and (not one or slots >= self.LOOP_ROWS_PER_EXPERT * n)):
            return "loop"
        return "grouped"


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
        width = 2 * d_hidden if activation == "swiglu" else d_hidden
        self.fc_in = nn.Linear(d_model, width, bias=bias)
        self.fc_out = nn.Linear(d_hidden, d_model, bias=bias)
        for fc in (self.fc_in, self.fc_out):
            bound = 1.0 / math.sqrt(fc.in_features)
            nn.init.uniform_(fc.weight, -bound, bound)
            if bias:
                nn.init.zeros_(fc.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_out(self.act(self.fc_in(x)))
