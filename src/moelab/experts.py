"""Expert banks: stacked-weight MLP experts with fast dispatch, and a bank of arbitrary modules.

Dispatch (both banks) follows torchtitan / transformers: the ``T·K`` token slots are sorted by
expert once, the per-expert counts give contiguous slices, each expert runs once on its slice,
and the outputs return to slot order through the inverse permutation, where they are weighted and
summed over K.  There is no Python loop over tokens, and the stacked weights are never indexed per
expert by autograd.

:class:`ExpertBank` has three implementations (measured in docs/performance.md, ``moelab bench
suite``), chosen by ``impl="auto"`` from the device, the slots per expert ``T·K/N`` and whether
autograd records (:meth:`ExpertBank.resolved_impl`):

- ``"loop"``: one custom autograd node (``_ExpertMLP``) runs every expert on its slice — matmul,
  activation while the rows are in cache, matmul — with one host sync for the counts; its
  backward writes each expert's weight gradient straight into one ``(N, ·, ·)`` buffer (no
  ``unbind``/``stack`` copies, no per-expert autograd nodes; experts with no tokens get zeros).
- ``"grouped"``: ``grouped_mm`` with offsets, no host sync at all, in one autograd node
  (``_GroupedMLP``) with a fused activation backward.
- ``"stream"`` (CPU inference): expert after expert gathers its tokens, runs and scatter-adds its
  weighted output; no ``(T·K, d)`` buffer exists (at ``T·K ≤ N`` the slots are sorted on the host).

The token gather (``_GatherTokens``) and the weighted way back (``_CombineSlots``) are shared; on
the CPU the way back is an ``index_add`` in slot order (deterministic there), on other devices a
gather (no atomics), so results are deterministic everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from . import _validate
from .functional import ACTIVATIONS, expert_counts
from .functional import activation as get_activation

__all__ = ["MLP", "ExpertBank", "ModuleExperts", "grouped_mm_available", "sort_slots"]

IMPLS = ("auto", "loop", "grouped")  # and "stream": CPU inference of "auto" / "loop"


def _grouped_mm_fn():
    fn = getattr(F, "grouped_mm", None)
    return fn if fn is not None else getattr(torch, "_grouped_mm", None)


_GROUPED_MM = _grouped_mm_fn()


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``grouped_mm`` runs for this device and dtype with this torch.

    CPU kernels exist from torch 2.9 (float32; bfloat16 needs 16-byte aligned strides); CUDA
    needs compute capability 8.0 or newer.  float64 is not supported anywhere.
    """
    if _GROUPED_MM is None or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type == "cpu":
        version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
        return version >= (2, 9) and dtype == torch.float32
    return False


def sort_slots(
    indices: Tensor, num_experts: int, inverse: bool = True
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Sort the ``T·K`` token slots by expert, once.

    Args:
        indices: ``(T, K)`` chosen experts.
        inverse: also compute the inverse permutation (else ``None`` is returned in its place).

    Returns:
        ``(order, counts, tokens, inverse)``: ``order (S,)`` slot ids sorted by expert (stable),
        ``counts (N,)`` slots per expert, ``tokens (S,)`` the token of each sorted slot, and
        ``inverse (S,)`` with ``sorted[inverse] == slots`` in their original order.
    """
    flat = indices.reshape(-1)  # (S,) S = T*K
    order = flat.argsort(stable=True)
    counts = expert_counts(flat, num_experts)  # bincount, traceable by torch.compile
    tokens = order // indices.shape[-1]
    if not inverse:
        return order, counts, tokens, None
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return order, counts, tokens, inverse


def combine(outputs: Tensor, weights: Tensor) -> Tensor:
    """``Σ_k w_k · out_k``: ``(T, K, d)`` outputs and ``(T, K)`` weights to ``(T, d)``."""
    # an elementwise product and a sum over K: ``bmm`` with T batches of (1, K) x (K, d) is
    # several times slower on the CPU, in its backward above all (one copy per token).
    return (outputs * weights.unsqueeze(-1).to(outputs.dtype)).sum(1)


def _scatter_adds(device: torch.device) -> bool:
    """Whether dispatch sums slots into tokens by scatter-add on ``device`` (the CPU, where
    ``index_add`` is sequential and deterministic) rather than by gathers (elsewhere)."""
    return device.type == "cpu"


def _scatter_rows(rows: Tensor, index: Tensor, num: int) -> Tensor:
    """``out[index[i]] += rows[i]`` into ``num`` zero rows: an ``index_add`` that reads ``rows``
    in order and writes a small table.  Used on the CPU only, where ``index_add`` adds in index
    order (deterministic); on the GPU it would use atomics, so CUDA gathers instead.  Out of place
    while torch.compile traces (see :class:`_CombineSlots`)."""
    out = rows.new_zeros(num, rows.shape[-1])
    if torch.compiler.is_compiling():
        return out.index_add(0, index, rows)
    return out.index_add_(0, index, rows)


def _row_dots(a: Tensor, b: Tensor) -> Tensor:
    """``(S,)``: ``<a_i, b_i>`` per row, as a batched matrix product (no ``a * b`` temporary)."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


class _GatherTokens(torch.autograd.Function):
    """``x.index_select(0, tokens)`` for the sorted slots.  Backward sums each token's K slot
    gradients: on the CPU by a scatter-add in slot order (sequential reads of the large slot
    gradient, :func:`_scatter_rows`), elsewhere by a gather with ``inverse`` and a sum over K
    (no atomics).  Deterministic on every device."""

    @staticmethod
    def forward(ctx, x: Tensor, tokens: Tensor, inverse: Tensor, top_k: int) -> Tensor:
        ctx.save_for_backward(tokens, inverse)
        ctx.top_k, ctx.num_tokens = top_k, x.shape[0]
        return x.index_select(0, tokens)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        tokens, inverse = ctx.saved_tensors
        if _scatter_adds(grad.device):
            return _scatter_rows(grad, tokens, ctx.num_tokens), None, None, None
        slots = grad.index_select(0, inverse)  # (T*K, d) in (token, k) order
        return slots.view(-1, ctx.top_k, grad.shape[-1]).sum(1), None, None, None


def _combine_slots(
    ys: Tensor, weights: Tensor, inverse: Tensor, order: Tensor, tokens: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(out (T, d), kept, w_sorted)``: the expert outputs ``ys`` (sorted-slot order) weighted
    and summed into their tokens (the forward of :class:`_CombineSlots`, and the whole of it
    without autograd).

    CPU: ``ys`` scaled by each sorted slot's weight and scatter-added into the ``(T, d)`` output
    in slot order (:func:`_scatter_rows`: sequential reads of the large ``(T·K, d)`` rows; a gather
    by ``inverse`` reads them at random, which costs a TLB miss per row once they outgrow the
    cache); ``kept`` is ``ys``.  Elsewhere: a gather back to ``(token, k)`` order and K fused
    multiply-adds (no atomics); ``kept`` is the gathered ``(T, K, d)``.  ``w_sorted (T·K,)``: the
    weight of each sorted slot.
    """
    T, K = weights.shape
    w_sorted = weights.reshape(-1).index_select(0, order).to(ys.dtype)
    if _scatter_adds(ys.device):
        return _scatter_rows(ys * w_sorted.unsqueeze(-1), tokens, T), ys, w_sorted
    slots = ys.index_select(0, inverse).view(T, K, ys.shape[-1])
    w = weights.to(ys.dtype)
    out = slots[:, 0] * w[:, :1]
    for k in range(1, K):
        if torch.compiler.is_compiling():  # see _CombineSlots' docstring
            out = out.addcmul(slots[:, k], w[:, k : k + 1])
        else:
            out.addcmul_(slots[:, k], w[:, k : k + 1])
    return out, slots, w_sorted


class _CombineSlots(torch.autograd.Function):
    """``Σ_k w_{t,k} · y_{t,k}`` from the expert outputs ``ys (S, d)`` in sorted-slot order, in one
    autograd node (:func:`_combine_slots`).

    Backward: the gradient of ``ys`` is the output gradient gathered by token (reading the small
    ``(T, d)`` gradient) and scaled by each slot's weight; ``∂/∂w_{t,k} = <g_t, y_{t,k}>`` as row
    dot products (:func:`_row_dots`, a batched matrix product: no broadcast ``(T, K, d)``
    temporary), on the CPU in sorted order and put back to ``(t, k)`` order by ``order``.  No
    scatter-add on the GPU: deterministic everywhere.

    While torch.compile traces, the accumulations are out of place: torch 2.11's dynamo sends the
    gradient of an ``autograd.Function`` output that forward modified in place to the wrong slot
    (silently wrong gradients, pytorch/pytorch#180642); compiled graphs are functional anyway.
    """

    @staticmethod
    def forward(ctx, ys: Tensor, weights: Tensor, inverse: Tensor, order: Tensor, tokens: Tensor) -> Tensor:
        out, kept, w_sorted = _combine_slots(ys, weights, inverse, order, tokens)
        ctx.save_for_backward(kept, w_sorted, order, tokens)
        ctx.weights_shape, ctx.weights_dtype = weights.shape, weights.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        kept, w_sorted, order, tokens = ctx.saved_tensors
        gathered = grad.index_select(0, tokens)  # (S, d): each sorted slot's output gradient
        g_ys = g_w = None
        if ctx.needs_input_grad[1]:
            if kept.dim() == 2:  # CPU: kept = ys in sorted order
                g_w = torch.empty_like(w_sorted).index_copy_(0, order, _row_dots(gathered, kept))
            else:  # kept = the (T, K, d) outputs in token order
                g_w = torch.bmm(kept, grad.unsqueeze(-1))
            g_w = g_w.view(ctx.weights_shape).to(ctx.weights_dtype)
        if ctx.needs_input_grad[0]:
            g_ys = gathered.mul_(w_sorted.unsqueeze(-1))
        return g_ys, g_w, None, None, None


def _activation_backward(name: str, act, h: Tensor, grad: Tensor) -> Tensor:
    """``∂act(h)/∂h`` applied to ``grad`` for ``relu`` / ``gelu`` / ``silu`` (ATen's own backward
    kernels) and any other activation (autograd on a recomputation)."""
    if name == "relu":
        return torch.ops.aten.threshold_backward(grad, h, 0)
    if name == "gelu":
        return torch.ops.aten.gelu_backward(grad, h)
    if name == "silu":
        return torch.ops.aten.silu_backward(grad, h)
    with torch.enable_grad():
        h = h.detach().requires_grad_()
        (g_h,) = torch.autograd.grad(act(h), h, grad)
    return g_h


def _loop_forward(xs, w_in, w_out, b_in, b_out, counts, act_name, act, keep: bool):
    """Every expert on its contiguous rows of ``xs``, the activation right after the first matmul
    while the rows are in cache: ``(y, h, aux)``.

    ``keep``: write the pre-activations into one ``(S, h_in)`` tensor ``h`` and collect ``aux``
    (:func:`_activation_forward`) for a backward; without it (inference) every expert's hidden
    activations are temporaries that the allocator reuses, so nothing of size ``S·h_in`` is
    allocated (``h`` and ``aux`` are then ``None``).
    """
    h = xs.new_empty(xs.shape[0], w_in.shape[1]) if keep else None
    y = xs.new_empty(xs.shape[0], w_out.shape[1])
    aux = [] if keep else None  # per expert: silu(gate) for swiglu, act(h) otherwise
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        stop = start + c
        x_e, w_e = xs[start:stop], w_in[e].t()
        if keep:
            h_e = (
                torch.mm(x_e, w_e, out=h[start:stop])
                if b_in is None
                else torch.addmm(b_in[e], x_e, w_e, out=h[start:stop])
            )
        else:
            h_e = torch.mm(x_e, w_e) if b_in is None else torch.addmm(b_in[e], x_e, w_e)
        a_e, aux_e = _activation_forward(h_e, act_name, act)
        if keep:
            aux.append(aux_e)
        if b_out is None:
            torch.mm(a_e, w_out[e].t(), out=y[start:stop])
        else:
            torch.addmm(b_out[e], a_e, w_out[e].t(), out=y[start:stop])
        start = stop
    return y, h, aux


class _ExpertMLP(torch.autograd.Function):
    """All N experts on their contiguous row slices, one autograd node (the ``"loop"`` impl).

    Per expert ``e`` with ``c_e > 0`` rows: ``y = act(x W_in[e]ᵀ + b_in[e]) W_out[e]ᵀ + b_out[e]``,
    the activation applied right after the first matmul while its rows are in cache.  Saved for
    backward: the pre-activation and, per expert, ``silu(gate)`` (``swiglu``) or the activation
    output (others), so no transcendental is recomputed.  The backward writes every expert's
    weight (and bias) gradient straight into row ``e`` of one ``(N, ·, ·)`` buffer: the stacked
    weights are never unbound, stacked or indexed by autograd, and experts with no rows get zero
    gradients.  First-order only (``once_differentiable``).
    """

    @staticmethod
    def forward(ctx, xs, w_in, w_out, b_in, b_out, counts: list[int], act_name: str, act):
        y, h, aux = _loop_forward(xs, w_in, w_out, b_in, b_out, counts, act_name, act, keep=True)
        ctx.save_for_backward(xs, w_in, w_out, h, *aux)
        ctx.counts, ctx.act_name, ctx.act = counts, act_name, act
        ctx.has_bias = (b_in is not None, b_out is not None)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        xs, w_in, w_out, h, *aux = ctx.saved_tensors
        grads = _mlp_backward(
            grad,
            xs,
            h,
            aux,
            w_in,
            w_out,
            ctx.counts,
            ctx.act_name,
            ctx.act,
            ctx.needs_input_grad[:5],
            ctx.has_bias,
        )
        return (*grads, None, None, None)


def _activation_forward(h: Tensor, act_name: str, act) -> tuple[Tensor, Tensor]:
    """``(a, aux)``: the activation ``a`` of the pre-activations ``h`` and what its backward needs
    besides ``h``: ``silu(gate)`` for ``swiglu`` (so no transcendental is recomputed), else ``a``
    (the weight gradient of the second matmul reads it)."""
    if act_name == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        s = F.silu(gate)
        return s * up, s
    a = act(h)
    return a, a


def _activation_grad(g_a: Tensor, h: Tensor, aux: Tensor, act_name: str, act) -> Tensor:
    """``∂L/∂h`` from ``∂L/∂a`` (``g_a`` is overwritten).  ``swiglu`` writes the gate and up
    halves straight into one ``(·, 2h)`` buffer: no ``cat`` as autograd's ``chunk`` backward does."""
    if act_name == "swiglu":  # a = silu(gate) * up
        gate, up = h.chunk(2, dim=-1)
        g_h = torch.empty_like(h, memory_format=torch.contiguous_format)
        g_gate, g_up = g_h.chunk(2, dim=-1)
        torch.mul(g_a, aux, out=g_up)
        torch.ops.aten.silu_backward.grad_input(g_a.mul_(up), gate, grad_input=g_gate)
        return g_h
    return _activation_backward(act_name, act, h, g_a)


def _mlp_backward(grad, xs, h, aux, w_in, w_out, counts, act_name, act, needs, has_bias):
    """The backward of the experts' MLPs on expert-sorted rows: ``(∂xs, ∂w_in, ∂w_out, ∂b_in, ∂b_out)``.

    ``h`` holds the pre-activations; ``aux`` per non-empty expert ``silu(gate)`` (``swiglu``) or
    ``act(h)`` (others), or ``None`` to recompute them from ``h`` (one elementwise op per expert).
    Every expert's weight gradient is written into row ``e`` of one ``(N, ·, ·)`` buffer; experts
    with no rows get zeros.
    """
    need_x, need_w_in, need_w_out, need_b_in, need_b_out = needs
    swiglu = act_name == "swiglu"
    grad = grad.contiguous()
    g_x = torch.empty_like(xs, memory_format=torch.contiguous_format) if need_x else None
    g_w_in = torch.empty_like(w_in, memory_format=torch.contiguous_format) if need_w_in else None
    g_w_out = torch.empty_like(w_out, memory_format=torch.contiguous_format) if need_w_out else None
    g_b_in = grad.new_empty(w_in.shape[:2]) if need_b_in and has_bias[0] else None
    g_b_out = grad.new_empty(w_out.shape[:2]) if need_b_out and has_bias[1] else None
    start, i = 0, 0
    for e, c in enumerate(counts):
        if c == 0:
            for g in (g_w_in, g_w_out, g_b_in, g_b_out):
                if g is not None:
                    g[e].zero_()
            continue
        stop = start + c
        g_y, h_e = grad[start:stop], h[start:stop]
        if aux is not None:
            aux_e = aux[i]
            a_e = aux_e * h_e.chunk(2, dim=-1)[1] if swiglu else aux_e
        else:
            a_e, aux_e = _activation_forward(h_e, act_name, act)
        i += 1
        if g_w_out is not None:
            torch.mm(g_y.t(), a_e, out=g_w_out[e])
        if g_b_out is not None:
            torch.sum(g_y, 0, out=g_b_out[e])
        g_h = _activation_grad(g_y @ w_out[e], h_e, aux_e, act_name, act)
        if g_w_in is not None:
            torch.mm(g_h.t(), xs[start:stop], out=g_w_in[e])
        if g_b_in is not None:
            torch.sum(g_h, 0, out=g_b_in[e])
        if g_x is not None:
            torch.mm(g_h, w_in[e], out=g_x[start:stop])
        start = stop
    return g_x, g_w_in, g_w_out, g_b_in, g_b_out


def _grouped_forward(xs, w_in, w_out, b_in, b_out, offs, experts, act_name, act):
    """``(y, h, aux)``: the experts on their expert-sorted rows by two ``grouped_mm`` (the forward
    of :class:`_GroupedMLP`, and the whole of it without autograd)."""
    h = _GROUPED_MM(xs, w_in.transpose(-2, -1), offs=offs)  # (S, h_in)
    if b_in is not None:
        h += b_in.index_select(0, experts)
    a, aux = _activation_forward(h, act_name, act)
    y = _GROUPED_MM(a, w_out.transpose(-2, -1), offs=offs)  # (S, d)
    if b_out is not None:
        y += b_out.index_select(0, experts)
    return y, h, aux


class _GroupedMLP(torch.autograd.Function):
    """All N experts on their expert-sorted rows with ``grouped_mm``, one autograd node (the
    ``"grouped"`` impl in eager mode).

    Forward: two grouped GEMMs (offsets ``offs``: cumulative row ends, int32; no host sync) and
    the activation on all rows at once.  Saved: the rows, the pre-activations and ``aux``
    (:func:`_activation_forward`).  Backward: four grouped GEMMs — ``∂w`` as ``grouped_mm`` of
    two 2-D operands, one ``(N, ·, ·)`` result with zeros for empty experts — and the fused
    activation gradient (:func:`_activation_grad`); the bias gradients are per-expert row sums,
    a grouped GEMV against a column of ones (deterministic, no scatter).  Compared with autograd
    through the same ops it saves the activation's copies (``chunk``'s ``cat``) and the
    ``.contiguous()`` of the output gradient.  First-order only.
    """

    @staticmethod
    def forward(ctx, xs, w_in, w_out, b_in, b_out, offs, experts, act_name: str, act):
        y, h, aux = _grouped_forward(xs, w_in, w_out, b_in, b_out, offs, experts, act_name, act)
        ctx.save_for_backward(xs, w_in, w_out, h, aux, offs)
        ctx.act_name, ctx.act = act_name, act
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        xs, w_in, w_out, h, aux, offs = ctx.saved_tensors
        need_x, need_w_in, need_w_out, need_b_in, need_b_out = ctx.needs_input_grad[:5]
        grad = grad.contiguous()
        a = aux * h.chunk(2, dim=-1)[1] if ctx.act_name == "swiglu" else aux
        g_w_out = _GROUPED_MM(grad.t(), a, offs=offs) if need_w_out else None  # (N, d, h)
        g_b_out = _row_sums(grad, offs) if need_b_out else None
        g_h = _activation_grad(_GROUPED_MM(grad, w_out, offs=offs), h, aux, ctx.act_name, ctx.act)
        g_w_in = _GROUPED_MM(g_h.t(), xs, offs=offs) if need_w_in else None  # (N, h_in, d)
        g_b_in = _row_sums(g_h, offs) if need_b_in else None
        g_xs = _GROUPED_MM(g_h, w_in, offs=offs) if need_x else None
        return g_xs, g_w_in, g_w_out, g_b_in, g_b_out, None, None, None, None


def _row_sums(rows: Tensor, offs: Tensor) -> Tensor:
    """``(N, n)``: the sum of each group's rows of ``rows (S, n)`` (zeros for an empty group)."""
    ones = rows.new_ones(rows.shape[0], 16 // rows.element_size())  # grouped_mm: 16-byte rows
    return _GROUPED_MM(rows.t(), ones, offs=offs)[..., 0]


class _WinnerMLP(torch.autograd.Function):
    """The winners' outputs of a competition with autograd, without running any expert again.

    Forward receives the outputs ``y_w (T, K, d)`` and pre-activations ``h_w (T, K, h_in)`` that
    :meth:`ExpertBank.forward_winners` kept from its single pass over all N experts and returns
    ``y_w``; backward sorts the ``(token, winner)`` slots by expert once and back-propagates
    through the winners' MLPs only (:func:`_mlp_backward`): N + 2K expert passes per token in all.
    """

    @staticmethod
    def forward(ctx, x, w_in, w_out, b_in, b_out, winners, h_w, y_w, act_name: str, act):
        ctx.save_for_backward(x, w_in, w_out, winners, h_w)
        ctx.act_name, ctx.act = act_name, act
        ctx.has_bias = (b_in is not None, b_out is not None)
        return y_w.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        x, w_in, w_out, winners, h_w = ctx.saved_tensors
        T, K = winners.shape
        order, counts, tokens, _ = sort_slots(winners, w_in.shape[0])
        g = grad.reshape(T * K, grad.shape[-1]).index_select(0, order)  # expert-sorted slots
        h = h_w.reshape(T * K, h_w.shape[-1]).index_select(0, order)
        xs = x.index_select(0, tokens)
        g_xs, g_w_in, g_w_out, g_b_in, g_b_out = _mlp_backward(
            g,
            xs,
            h,
            None,
            w_in,
            w_out,
            counts.tolist(),
            ctx.act_name,
            ctx.act,
            ctx.needs_input_grad[:5],
            ctx.has_bias,
        )
        g_x = None if g_xs is None else torch.zeros_like(x).index_add_(0, tokens, g_xs)
        return g_x, g_w_in, g_w_out, g_b_in, g_b_out, None, None, None, None, None


# ------------------------------------------------------------------ grouped_mm for torch.compile
# torch's fake-tensor (meta) kernel of ``_grouped_mm`` accepts bfloat16 only, although the CPU kernel
# runs float32: tracing ``impl="grouped"`` in float32 fails inside torch.compile.  Under compile the
# two grouped GEMMs therefore go through these opaque custom ops (shape functions below); eager code
# calls ``_GROUPED_MM`` directly.  The stacked weight enters in its stored layout and is transposed
# inside the op (a transposed view as an op input is materialised by inductor: a 16 MB copy per
# GEMM at the bench's sizes).  Backward: ``∂a = g bᵀ`` (a grouped GEMM) and, per group,
# ``∂b_e = a_eᵀ g_e`` (``grouped_mm`` of two 2-D operands, one ``(N, ·, ·)`` result).


@torch.library.custom_op("moelab::grouped_mm", mutates_args=())
def _grouped_mm_op(a: Tensor, b: Tensor, offs: Tensor, trans_b: bool) -> Tensor:
    """Rows of ``a (S, k)`` grouped by ``offs`` (cumulative ends, int32) times ``b[e]`` (``(N, k, n)``)
    or, with ``trans_b``, ``b[e]ᵀ`` (``b (N, n, k)``, the ``nn.Linear`` layout) → ``(S, n)``."""
    return _GROUPED_MM(a, b.transpose(-2, -1) if trans_b else b, offs=offs)


@_grouped_mm_op.register_fake
def _(a: Tensor, b: Tensor, offs: Tensor, trans_b: bool) -> Tensor:
    return a.new_empty(a.shape[0], b.shape[-2] if trans_b else b.shape[-1])


@torch.library.custom_op("moelab::grouped_mm_weight_grad", mutates_args=())
def _grouped_mm_weight_grad(p: Tensor, q: Tensor, offs: Tensor) -> Tensor:
    """``(N, m, n)``: ``p_eᵀ q_e`` for each group's rows of ``p (S, m)`` and ``q (S, n)`` (zeros for
    an empty group)."""
    return _GROUPED_MM(p.t(), q, offs=offs)


@_grouped_mm_weight_grad.register_fake
def _(p: Tensor, q: Tensor, offs: Tensor) -> Tensor:
    return p.new_empty(offs.shape[0], p.shape[1], q.shape[1])


def _grouped_mm_setup(ctx, inputs, output) -> None:
    a, b, offs, trans_b = inputs
    ctx.save_for_backward(a, b, offs)
    ctx.trans_b = trans_b


def _grouped_mm_backward(ctx, grad: Tensor):
    a, b, offs = ctx.saved_tensors
    grad = grad.contiguous()
    g_a = g_b = None
    if ctx.needs_input_grad[0]:
        g_a = _grouped_mm_op(grad, b, offs, not ctx.trans_b)
    if ctx.needs_input_grad[1]:
        g_b = (
            _grouped_mm_weight_grad(grad, a, offs) if ctx.trans_b else _grouped_mm_weight_grad(a, grad, offs)
        )
    return g_a, g_b, None, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def _grouped_mm_nt(a: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """``a_e w[e]ᵀ`` per group (``w`` in the ``nn.Linear`` layout): ``grouped_mm`` eagerly, the
    traceable custom op while torch.compile traces."""
    if torch.compiler.is_compiling():
        return _grouped_mm_op(a, w, offs, True)
    return _GROUPED_MM(a, w.transpose(-2, -1), offs=offs)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped_mm's backward on
    CPU rejects the expanded gradients that ``.sum()`` produces)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


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
        impl: dispatch implementation, ``"auto"`` (grouped_mm where supported, else loop),
            ``"loop"`` or ``"grouped"``.
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
        self.impl = _validate.one_of("impl", impl, IMPLS)
        self.chunk_elements = _validate.positive_int("chunk_elements", chunk_elements)
        self.activation = activation
        self.act = get_activation(activation)
        h_in = 2 * d_hidden if activation == "swiglu" else d_hidden
        self.w_in = nn.Parameter(torch.empty(num_experts, h_in, d_model))
        self.w_out = nn.Parameter(torch.empty(num_experts, d_model, d_hidden))
        self.b_in = nn.Parameter(torch.zeros(num_experts, h_in)) if bias else None
        self.b_out = nn.Parameter(torch.zeros(num_experts, d_model)) if bias else None
        self.reset_parameters()

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
        return F.linear(self.act(F.linear(x, self.w_in[e], b_in)), self.w_out[e], b_out)

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

        The competition's pass (000 §3.1; 001 §2.2): all N experts run without autograd in token
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

    # ------------------------------------------------------------------ dispatch
    def grouped_aligned(self, dtype: torch.dtype) -> bool:
        """Whether ``d_model`` and ``d_hidden`` give ``grouped_mm`` the 16-byte aligned row strides
        it requires (multiples of 4 in float32, of 8 in bfloat16 / float16)."""
        per = 16 // torch.empty((), dtype=dtype).element_size()
        return self.d_model % per == 0 and self.d_hidden % per == 0

    def grouped_ok(self, x: Tensor) -> bool:
        """Whether the ``"grouped"`` implementation runs for ``x`` (device, dtype, alignment)."""
        return grouped_mm_available(x.device, x.dtype) and self.grouped_aligned(x.dtype)

    #: on the CPU, ``"auto"`` trains with ``"loop"`` from this many token slots per expert on
    #: (``T·K/N``): there the loop's activation on each expert's rows while they are in cache beats
    #: ``grouped_mm``'s one activation pass over all ``T·K`` rows; below it ``grouped_mm``'s C++
    #: loop over the experts beats the Python one (``moelab bench suite``, docs/performance.md)
    LOOP_ROWS_PER_EXPERT = 512
    #: on the CPU, ``"auto"`` infers with ``"stream"`` at ``T·K ≤ N`` (decoding) and, with one
    #: torch thread, from this many slots per expert on (no ``(T·K, d)`` buffers; below it
    #: ``grouped_mm`` wins).  With more threads its many small per-expert ops each pay a parallel
    #: region (2 threads, T=2048: 2.3x dense against 1.5x for grouped_mm), so ``grouped``/``loop`` serve
    STREAM_ROWS_PER_EXPERT = 256

    def resolved_impl(self, x: Tensor, top_k: int = 1, grad: bool = True) -> str:
        """The implementation ``forward`` uses for ``x (T, d)`` routed to ``top_k`` experts per token,
        with (``grad``) or without autograd.

        ``"auto"``, on the CPU: inference (``grad=False``) takes ``"stream"`` (:meth:`_stream`) at
        ``T·K ≤ N`` and, with one thread, from :attr:`STREAM_ROWS_PER_EXPERT` slots per expert on;
        training (and inference with more threads) takes
        ``"loop"`` from :attr:`LOOP_ROWS_PER_EXPERT` slots per expert on; otherwise, and on other
        devices, ``"grouped"`` wherever :meth:`grouped_ok` (no host sync), else ``"loop"``
        (float64, unaligned sizes, older torch).  ``"loop"`` streams in CPU inference.  While
        torch.compile traces, never ``"stream"`` (its host sync would break the graph).
        """
        if self.impl == "grouped":
            return "grouped"
        cpu = x.device.type == "cpu" and not torch.compiler.is_compiling()
        slots, n = x.shape[0] * top_k, self.num_experts
        grouped = self.impl == "auto" and self.grouped_ok(x)
        if not grad and cpu:
            decoding = slots <= n
            large = slots >= self.STREAM_ROWS_PER_EXPERT * n and torch.get_num_threads() == 1
            if not grouped or decoding or large:
                return "stream"
        if not grouped or (cpu and slots >= self.LOOP_ROWS_PER_EXPERT * n):
            return "loop"
        return "grouped"

    def forward(self, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        """``Σ_k w_k · expert_{i_k}(x)`` for every token.

        Args:
            x: ``(T, d)`` tokens.
            indices: ``(T, K)`` int64 chosen experts.
            weights: ``(T, K)`` their weights.

        Returns:
            ``(T, d)``.
        """
        K = indices.shape[1]
        track = self._tracks_grad(x, weights)
        impl = self.resolved_impl(x, K, track)
        if impl == "stream":
            return self._stream(x, indices, weights)
        order, counts, tokens, inverse = sort_slots(indices, self.num_experts)
        # without autograd: the same ops, no autograd nodes
        xs = _GatherTokens.apply(x, tokens, inverse, K) if track else x.index_select(0, tokens)
        if impl == "grouped":
            if not grouped_mm_available(x.device, x.dtype):
                raise ValueError(
                    f"impl='grouped' is not available for device={x.device.type}, dtype={x.dtype} with "
                    f"torch {torch.__version__}; use impl='loop' or 'auto'"
                )
            if not self.grouped_aligned(x.dtype):
                raise ValueError(
                    f"impl='grouped' needs d_model and d_hidden to be multiples of "
                    f"{16 // x.element_size()} for dtype={x.dtype} (16-byte aligned strides); got "
                    f"d_model={self.d_model}, d_hidden={self.d_hidden}; use impl='loop' or 'auto'"
                )
            ys = self._grouped(xs, counts, order, indices)
        else:
            ys = self._loop(xs, counts.tolist())  # the one host sync
        # back to (token, slot) order, weighted and summed over K: combine() in one node
        if not track:
            return _combine_slots(ys, weights, inverse, order, tokens)[0]
        return _CombineSlots.apply(ys, weights, inverse, order, tokens)

    def _tracks_grad(self, x: Tensor, *others: Tensor) -> bool:
        """Whether this call records autograd: grad mode on and an input or weight requiring it."""
        return torch.is_grad_enabled() and any(t.requires_grad for t in (x, *others, *self.parameters()))

    def _stream(self, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        """CPU inference: each expert gathers its tokens, runs, and adds its weighted output to them.

        No ``(T·K, d)`` tensor exists: every expert's rows, hidden activations and outputs are
        temporaries of its own size that the allocator reuses (a fresh buffer of tens of MB costs
        more in page faults than the copy into it).  The slots are sorted once — on the host when
        there are at most N of them (decoding: a few numbers sort faster in Python than by tensor
        ops), else by :func:`sort_slots` — and the outputs are summed into the tokens by
        ``index_add_`` expert after expert, in slot order: deterministic.  At a few tokens each
        touched expert reads its weights once: the bound (``moelab bench suite``).
        """
        T, K = indices.shape
        if indices.numel() <= self.num_experts:
            flat = indices.reshape(-1).tolist()  # the one host sync
            order_list = sorted(range(len(flat)), key=flat.__getitem__)  # stable
            counts = [0] * self.num_experts
            for e in flat:
                counts[e] += 1
            order = torch.tensor(order_list, device=x.device)
        else:
            order, counts_t, _, _ = sort_slots(indices, self.num_experts, inverse=False)
            counts = counts_t.tolist()  # the one host sync
        tokens = order // K
        w_sorted = weights.reshape(-1).index_select(0, order).to(x.dtype).unsqueeze(-1)
        out = x.new_zeros(T, self.d_model)
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            stop = start + c
            rows = tokens[start:stop]
            y = self.expert_forward(x.index_select(0, rows), e)
            out.index_add_(0, rows, y.mul_(w_sorted[start:stop]))
            start = stop
        return out

    def _loop(self, xs: Tensor, counts: Sequence[int]) -> Tensor:
        args = (self.b_in, self.b_out, list(counts), self.activation, self.act)
        if self._tracks_grad(xs):
            return _ExpertMLP.apply(xs, self.w_in, self.w_out, *args)  # (S, d)
        return _loop_forward(xs, self.w_in, self.w_out, *args, keep=False)[0]

    def _grouped(self, xs: Tensor, counts: Tensor, order: Tensor, indices: Tensor) -> Tensor:
        offs = counts.cumsum(0).to(torch.int32)
        experts = None
        if self.b_in is not None or self.b_out is not None:
            experts = indices.reshape(-1).index_select(0, order)  # expert of each sorted slot
        if not torch.compiler.is_compiling():
            args = (self.b_in, self.b_out, offs, experts, self.activation, self.act)
            if not self._tracks_grad(xs):
                return _grouped_forward(xs, self.w_in, self.w_out, *args)[0]
            return _GroupedMLP.apply(xs, self.w_in, self.w_out, *args)
        # traced: composed of the custom ops, which inductor fuses with the activation
        h = _grouped_mm_nt(xs, self.w_in, offs)  # (S, h_in)
        if self.b_in is not None:
            h = h + self.b_in.index_select(0, experts)
        y = _grouped_mm_nt(self.act(h), self.w_out, offs)  # (S, d)
        if self.b_out is not None:
            y = y + self.b_out.index_select(0, experts)
        return _ContiguousGrad.apply(y)


class ModuleExperts(nn.Module):
    """The :class:`ExpertBank` interface over a list of arbitrary modules (e.g. CNN experts).

    Each module maps ``(T, *in_shape)`` to ``(T, d_out)``.  Dispatch sorts the slots once and runs
    each module on its contiguous slice; a module with no tokens is skipped.
    """

    def __init__(self, experts: Sequence[nn.Module]) -> None:
        super().__init__()
        experts = list(experts)
        if len(experts) < 1 or not all(isinstance(m, nn.Module) for m in experts):
            raise ValueError(f"experts={experts!r} is not allowed; expected a non-empty list of nn.Module")
        self.experts = nn.ModuleList(experts)
        self.num_experts = len(experts)

    def expert_forward(self, x: Tensor, e: int) -> Tensor:
        return self.experts[e](x)

    def forward_all(self, x: Tensor) -> Tensor:
        """``(T, ...)`` → ``(T, N, d_out)``."""
        return torch.stack([m(x) for m in self.experts], dim=1)

    def forward(self, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        T, K = indices.shape
        _, counts, tokens, inverse = sort_slots(indices, self.num_experts)
        xs = x.index_select(0, tokens)
        counts_list = counts.tolist()
        outs = [m(xe) for m, xe, c in zip(self.experts, xs.split(counts_list), counts_list) if c > 0]
        outs = outs or [self.experts[0](xs)]  # no tokens at all: an empty output of the right shape
        ys = torch.cat(outs)
        slots = ys.index_select(0, inverse).view(T, K, *ys.shape[1:])
        return combine(slots.flatten(2), weights).view(T, *ys.shape[1:])
