"""Sort → gather → run → combine: the dispatch of every expert bank, written once.

The ``T·K`` token slots are sorted by expert once (:func:`sort_slots`), the per-expert counts give
contiguous slices, the tokens are gathered into that order (:func:`gather`), each expert runs once
on its slice (the bank's ``run``), and the outputs return to their tokens, weighted and summed over
K (:func:`combine_slots`).  There is no Python loop over tokens.  On the CPU the way back sums
each token's slots in slot order (an ``index_add`` with one torch thread, gathers with several:
the same bits), on other devices a gather (no atomics), so results are deterministic everywhere.

:func:`dispatch` is the whole of it; :func:`winners_by_rerun` is the competition's pass
(:meth:`Experts.forward_winners`) for banks that keep no activations of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from ..functional import expert_counts
from ..routing import Routing
from .protocol import Experts

__all__ = [
    "PaddedSlots",
    "Slots",
    "combine",
    "combine_densemixer",
    "combine_padded",
    "combine_slots",
    "dispatch",
    "dispatch_masked",
    "gather",
    "gather_padded",
    "pad_slots",
    "sort_slots",
    "tracks_grad",
    "winners_by_rerun",
]

#: ``run(xs, slots) -> ys``: every expert on its contiguous rows of the expert-sorted tokens
#: ``xs (S, ...)`` → outputs ``ys (S, ...)`` in the same order
Run = Callable[[Tensor, "Slots"], Tensor]


def dispatch(x: Tensor, indices: Tensor, weights: Tensor, num_experts: int, run: Run, track: bool) -> Tensor:
    """``Σ_k w_k · expert_{i_k}(x)`` for every token: sort once → gather → ``run`` → combine.

    Args:
        x: ``(T, ...)`` tokens (``(T, d)`` for MLP experts, images for CNN experts).
        indices: ``(T, K)`` int64 chosen experts.
        weights: ``(T, K)`` their weights.
        num_experts: N.
        run: every expert on its contiguous slice of the expert-sorted rows (see :data:`Run`).
        track: record autograd (:func:`tracks_grad`); without it the same ops run with no
            autograd nodes.

    Returns:
        ``(T, ...)`` in the shape of one expert output per token.
    """
    slots = sort_slots(indices, num_experts)
    xs = gather(x, slots, indices.shape[1], track)  # (S, ...) grouped by expert
    ys = run(xs, slots)  # (S, ...) in the same order
    return combine_slots(ys, weights, slots, track)


def dispatch_masked(experts: Experts, x: Tensor, indices: Tensor, weights: Tensor, mask: Tensor) -> Tensor:
    """``Σ_k [mask_k] · w_k · expert_{i_k}(x)``: a variable number of experts per token, where only
    the active slots run (``remoe``, ``top-p``; :attr:`moelab.Routing.mask`).

    Eagerly, the ``A ≤ T·K`` active slots are taken in token order, each one row of weight
    ``w_k`` routed to its expert alone (``K = 1``, through the bank's own ``mix``: every kernel
    and every bank), and the rows are summed back into their tokens: on the CPU by an
    ``index_add`` in slot order (deterministic there), elsewhere by putting each row at its own
    slot of a zero ``(T·K, ...)`` buffer and summing over K, and gathering the tokens through the
    same layout, so that no two rows are added by atomics.  Under ``torch.compile`` the number
    of active slots would be a data-dependent shape (a graph break), so every slot runs with the
    inactive weights set to 0 (and inactive indices to expert 0: they may lie beyond the bank): the
    same output and gradients, without the skipped compute.

    Args:
        experts: the bank.
        x: ``(T, ...)`` tokens.
        indices, weights, mask: ``(T, K)`` experts, weights and active slots.
    """
    w = weights * mask.to(weights.dtype)  # an inactive slot has weight 0, and no gradient reaches it
    if torch.compiler.is_compiling():  # inactive slots may name experts beyond the bank (MoE++): expert 0
        return experts.mix(x, indices.masked_fill(~mask, 0), w)
    T, K = indices.shape
    slot = mask.reshape(-1).nonzero().squeeze(1)  # (A,) in token order: the one host sync
    token = slot // K
    cpu = _scatter_adds(x.device)
    if cpu:
        xs = x.index_select(0, token)
    else:  # the gather's backward then adds each row into its own slot: no atomics
        xs = x.unsqueeze(1).expand(T, K, *x.shape[1:]).reshape(T * K, *x.shape[1:]).index_select(0, slot)
    ys = experts.mix(xs, indices.reshape(-1, 1).index_select(0, slot), w.reshape(-1, 1).index_select(0, slot))
    if cpu:
        return ys.new_zeros(T, *ys.shape[1:]).index_add(0, token, ys)
    rows = ys.new_zeros(T * K, *ys.shape[1:]).index_copy(0, slot, ys)
    return rows.view(T, K, *ys.shape[1:]).sum(1)


class Slots(NamedTuple):
    """The ``S = T·K`` token slots sorted by expert (:func:`sort_slots`)."""

    order: Tensor  #: ``(S,)`` slot ids sorted by expert (stable)
    counts: Tensor  #: ``(N,)`` slots per expert
    tokens: Tensor  #: ``(S,)`` the token of each sorted slot
    inverse: Tensor | None  #: ``(S,)`` with ``sorted[inverse]`` in the original slot order


def sort_slots(indices: Tensor, num_experts: int, inverse: bool = True) -> Slots:
    """Sort the ``T·K`` token slots by expert, once.

    Args:
        indices: ``(T, K)`` chosen experts.
        num_experts: N.
        inverse: also compute the inverse permutation (else ``None`` is returned in its place).

    Returns:
        ``Slots(order, counts, tokens, inverse)`` (a tuple): ``order (S,)`` slot ids sorted by
        expert (stable), ``counts (N,)`` slots per expert, ``tokens (S,)`` the token of each sorted
        slot, and ``inverse (S,)`` with ``sorted[inverse] == slots`` in their original order.
    """
    flat = indices.reshape(-1)  # (S,) S = T*K
    order = flat.argsort(stable=True)
    counts = expert_counts(flat, num_experts)  # bincount, traceable by torch.compile
    tokens = order // indices.shape[-1]
    if not inverse:
        return Slots(order, counts, tokens, None)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return Slots(order, counts, tokens, inv)


def gather(x: Tensor, slots: Slots, top_k: int, track: bool) -> Tensor:
    """``(S, ...)``: the token of every sorted slot.  With ``track``, one autograd node whose
    backward sums each token's K slot gradients deterministically (:class:`_GatherTokens`)."""
    if not track:
        return x.index_select(0, slots.tokens)
    rows = _GatherTokens.apply(x.flatten(1), slots.tokens, slots.inverse, top_k)
    return rows.view(rows.shape[0], *x.shape[1:])


def combine_slots(ys: Tensor, weights: Tensor, slots: Slots, track: bool) -> Tensor:
    """``(T, ...)``: the expert outputs ``ys (S, ...)`` of the sorted slots weighted and summed into
    their tokens, in one autograd node with ``track`` (:class:`_CombineSlots`)."""
    rows = ys.flatten(1)
    args = (rows, weights, slots.inverse, slots.order, slots.tokens)
    out = _CombineSlots.apply(*args) if track else _combine_slots(*args)[0]
    # rows of tokens already (MLP experts): no view, which FSDP2 warns of when the bank is its own unit
    return out if ys.dim() == 2 else out.view(weights.shape[0], *ys.shape[1:])


class PaddedSlots(NamedTuple):
    """The kept token slots laid out ``C`` per expert (:func:`pad_slots`): ``N·C`` rows,
    expert-major, each expert's kept slots first (in slot order), then padding."""

    rows: Tensor  #: ``(N·C,)`` the slot of each row; ``S = T·K`` for a padding row
    dest: Tensor  #: ``(S,)`` the row of each slot; ``N·C`` for a dropped slot
    capacity: int  #: C, the rows of every expert


def pad_slots(indices: Tensor, keep: Tensor, num_experts: int, capacity: int) -> PaddedSlots:
    """The padded layout of GShard's capacity (DeepSpeed's / Megatron-Core's
    ``--moe-pad-expert-input-to-capacity``): every expert gets exactly ``capacity`` rows, its
    kept slots first and padding after, so the experts run on a fixed ``(N, C, ...)`` whatever
    the routing (CUDA graphs, ``torch.compile(dynamic=False)``).  One stable sort, no host sync,
    no shape that depends on the data.

    Args:
        indices: ``(T, K)`` chosen experts.
        keep: ``(T, K)`` bool, the slots within their expert's capacity
            (:func:`moelab.experts.capacity.capacity_keep`): at most ``capacity`` per expert.
        num_experts: N.
        capacity: C.
    """
    T, K = indices.shape
    S, N, C = T * K, num_experts, capacity
    key = torch.where(keep.reshape(-1), indices.reshape(-1), N)  # a dropped slot sorts after every expert
    order = key.argsort(stable=True)  # (S,): the kept slots by expert, each expert's in slot order
    counts = expert_counts(key, N + 1)[:N]  # kept slots per expert, at most C
    start = counts.cumsum(0) - counts
    r = torch.arange(C, device=indices.device)
    at = (start.unsqueeze(1) + r).clamp(max=max(S - 1, 0))  # (N, C) positions in ``order``
    rows = torch.where(r < counts.unsqueeze(1), order[at], S).reshape(-1)
    # the inverse map by the sorted positions (a permutation: a scatter without duplicates)
    sorted_key = key[order]
    rank = torch.arange(S, device=indices.device) - torch.cat([start, start.new_full((1,), S)])[sorted_key]
    pos = torch.where(sorted_key < N, sorted_key * C + rank, N * C)
    dest = torch.empty_like(order).scatter_(0, order, pos)
    return PaddedSlots(rows, dest, C)


def gather_padded(x: Tensor, padded: PaddedSlots, top_k: int) -> Tensor:
    """``(N·C, ...)``: the token of every row of the padded layout, zero for a padding row.
    Backward sums each token's K slot gradients by a gather (no atomics): deterministic."""
    rows = _PaddedGather.apply(x.flatten(1), padded.rows // top_k, padded.dest, top_k)
    return rows.view(rows.shape[0], *x.shape[1:])


def combine_padded(ys: Tensor, weights: Tensor, padded: PaddedSlots) -> Tensor:
    """``(T, ...)``: the expert outputs of the padded rows ``ys (N·C, ...)`` weighted and summed
    into their tokens; a dropped slot adds 0 (the padding rows are never read, and get a zero
    gradient)."""
    T, K = weights.shape
    slots = _PaddedGather.apply(ys.flatten(1), padded.dest, padded.rows, 1)  # (T·K, d), row N·C: 0
    return combine(slots.view(T, K, -1), weights).view(T, *ys.shape[1:])


def combine(outputs: Tensor, weights: Tensor) -> Tensor:
    """``Σ_k w_k · out_k``: ``(T, K, d)`` outputs and ``(T, K)`` weights to ``(T, d)``."""
    # an elementwise product and a sum over K, not ``bmm`` with T batches of (1, K) x (K, d), whose
    # backward makes one copy per token on the CPU (docs/performance.md)
    return (outputs * weights.unsqueeze(-1).to(outputs.dtype)).sum(1)


def combine_densemixer(outputs: Tensor, indices: Tensor, weights: Tensor, probs: Tensor) -> Tensor:
    """DenseMixer's straight-through combine (DenseMixer, Yao et al. 2025): the value of the sparse
    output ``Σ_k w_k g_{i_k}(x)``, the router gradient of the dense mixture ``Σ_i w̃_i g_i(x)``.

    ``w̃`` is the router's own weight on the chosen experts and ``p_i · (Σ_k w_k / Σ_k p_{i_k})``
    (the scale detached) on the others — ``p_i / Σ_{TopK} p`` for the renormalised softmax, ``p_i``
    without renormalisation, as the authors' code (its "partscale" form).  An expert's output
    passes gradient only where the expert was chosen, so the experts (and the input, through
    them) get the sparse gradient; the router gets ``<∂L/∂y, g_i(x)>`` from every expert.

    Args:
        outputs: ``(T, N, d)`` every expert on every token (with autograd).
        indices, weights: ``(T, K)`` the router's choice and weights.
        probs: ``(T, N)`` the router's softmax over all N.
    """
    chosen = torch.zeros_like(probs, dtype=torch.bool).scatter(1, indices, True)
    sparse = torch.zeros_like(probs, dtype=weights.dtype).scatter(1, indices, weights)
    scale = (weights.sum(-1, keepdim=True) / probs.gather(1, indices).sum(-1, keepdim=True)).detach()
    dense = torch.where(chosen, sparse, probs.to(weights.dtype) * scale)
    mixed = sparse.detach() + (dense - dense.detach())  # the value of the sparse weights
    outs = torch.where(chosen.unsqueeze(-1), outputs, outputs.detach())
    return (outs * mixed.unsqueeze(-1).to(outs.dtype)).sum(1)


def tracks_grad(module: nn.Module, *inputs: Tensor) -> bool:
    """Whether a call records autograd: grad mode on and an input or a parameter requiring it."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in (*inputs, *module.parameters()))


def winners_by_rerun(
    experts: Experts, x: Tensor, choose: Callable[[Tensor], tuple[Tensor, Any]], budget: int | None
) -> tuple[Tensor, Tensor, Any]:
    """:meth:`Experts.forward_winners` for a bank that keeps no activations: the N experts run
    without autograd and the K winners again with autograd.

    The competition's pass of CompeteSMoE (2024) §3.1 and CompeteSMoE (2025) §2.2: ``forward_all``
    without autograd in token chunks of at most ``budget`` output elements (``None``: one chunk,
    for a bank whose ``forward_all`` is a collective), ``choose(outputs (t, N, d)) -> (indices
    (t, K), extra)`` per chunk and the winners' outputs gathered.  Under autograd the winners run
    again through the bank's sorted dispatch, each ``(token, winner)`` slot one row of weight 1:
    ``N + 3K`` expert passes per token.

    Returns:
        ``(indices (T, K), outputs (T, K, ...), extra)``, ``extra`` concatenated over chunks.
    """
    chunk = x.shape[0] or 1
    if budget is not None:
        width = experts.d_model or (max(1, x[0].numel()) if x.shape[0] else 1)  # ≈ input for others
        chunk = max(1, budget // (experts.num_experts * width))
    winners, outs, extras = [], [], []
    with torch.no_grad():
        for xc in x.split(chunk):
            all_out = experts.forward_all(xc)  # (t, N, ...)
            idx, extra = choose(all_out)
            pick = idx.view(*idx.shape, *([1] * (all_out.dim() - 2)))
            winners.append(idx)
            outs.append(all_out.gather(1, pick.expand(-1, -1, *all_out.shape[2:])))
            extras.append(extra)
    cat = lambda ts: torch.cat(ts) if len(ts) > 1 else ts[0]
    winners_t, outputs, extra = cat(winners), cat(outs), cat(extras)
    if torch.is_grad_enabled():
        T, K = winners_t.shape
        xs = x.repeat_interleave(K, dim=0)  # (T·K, ...)
        # through the bank's call, not ``mix``: a wrapper's forward hooks (FSDP2 gathering a sharded
        # bank's weights) run around it, as around every forward of the bank
        y = experts(xs, Routing(winners_t.reshape(-1, 1), x.new_ones(T * K, 1)))  # (T·K, ...)
        outputs = y.view(T, K, *y.shape[1:])
    return winners_t, outputs, extra


# ------------------------------------------------------------------ the gather and the combine
def _scatter_adds(device: torch.device) -> bool:
    """Whether dispatch sums slots into tokens by scatter-add on ``device`` (the CPU, where
    ``index_add`` is sequential and deterministic) rather than by gathers (elsewhere)."""
    return device.type == "cpu"


def _scatter_rows(rows: Tensor, tokens: Tensor, inverse: Tensor, top_k: int) -> Tensor:
    """``(T, d)``: ``out[tokens[i]] += rows[i]`` into zero rows, in slot order ``i`` (the CPU).

    With one torch thread an ``index_add`` (it adds in index order: deterministic; on the GPU it
    would use atomics, so CUDA gathers instead), out of place while torch.compile traces (see
    :class:`_CombineSlots`).  With several, ATen's row scatter-add first sorts its index in
    parallel regions, each waking the worker threads, so each token's K rows are gathered
    (``inverse``, in slot order) and added instead (timed in docs/performance.md, "Slot sums with
    several threads").  Both add the same numbers in the same order from zero: the same bits at
    every thread count.
    """
    T = inverse.numel() // top_k
    if torch.compiler.is_compiling():  # the thread count is not read while tracing (a graph break)
        return rows.new_zeros(T, rows.shape[-1]).index_add(0, tokens, rows)
    if torch.get_num_threads() == 1:
        return rows.new_zeros(T, rows.shape[-1]).index_add_(0, tokens, rows)
    ascending = inverse.view(T, top_k).sort(dim=1).values  # each token's slots in slot order
    slots = rows.index_select(0, ascending.reshape(-1)).view(T, top_k, rows.shape[-1])
    out = slots[:, 0] + 0.0  # from zero, as index_add: -0.0 becomes 0.0
    for k in range(1, top_k):
        out.add_(slots[:, k])
    return out


def _row_dots(a: Tensor, b: Tensor) -> Tensor:
    """``(S,)``: ``<a_i, b_i>`` per row, as a batched matrix product (no ``a * b`` temporary).
    ``linalg.vecdot`` is faster on the CPU (docs/performance.md) but does not give the same bits:
    every documented training run would move in its last digits."""
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
            return _scatter_rows(grad, tokens, inverse, ctx.top_k), None, None, None
        slots = grad.index_select(0, inverse)  # (T*K, d) in (token, k) order
        return slots.view(-1, ctx.top_k, grad.shape[-1]).sum(1), None, None, None


class _PaddedGather(torch.autograd.Function):
    """``[src; 0].index_select(0, index)``, the gathers between tokens, slots and the padded rows
    (:func:`gather_padded`, :func:`combine_padded`; the index ``len(src)`` reads the zero row).
    Backward is a gather too, by the inverse map ``back`` (the zero row where nothing was read),
    summing ``groups`` consecutive rows (a token's K slots): no scatter-add, deterministic on every
    device, and the many dropped slots that read the one zero row add nothing anywhere."""

    @staticmethod
    def forward(ctx, src: Tensor, index: Tensor, back: Tensor, groups: int) -> Tensor:
        ctx.save_for_backward(back)
        ctx.groups = groups
        return torch.cat([src, src.new_zeros(1, src.shape[1])]).index_select(0, index)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        (back,) = ctx.saved_tensors
        rows = torch.cat([grad, grad.new_zeros(1, grad.shape[1])]).index_select(0, back)
        if ctx.groups > 1:
            rows = rows.view(-1, ctx.groups, grad.shape[1]).sum(1)
        return rows, None, None, None


def _combine_slots(
    ys: Tensor, weights: Tensor, inverse: Tensor, order: Tensor, tokens: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``(out (T, d), kept, w_sorted)``: the expert outputs ``ys`` (sorted-slot order) weighted
    and summed into their tokens (the forward of :class:`_CombineSlots`, and the whole of it
    without autograd).

    CPU: ``ys`` scaled by each sorted slot's weight and summed into the ``(T, d)`` output in slot
    order (:func:`_scatter_rows`; with one thread an ``index_add`` that reads the large
    ``(T·K, d)`` rows in order, where a gather reads them at random and pays a TLB miss per row
    once they outgrow the cache); ``kept`` is ``ys``.  Elsewhere: a gather back to ``(token, k)``
    order and K fused multiply-adds (no atomics); ``kept`` is the gathered ``(T, K, d)``.  ``w_sorted (T·K,)``: the
    weight of each sorted slot.
    """
    T, K = weights.shape
    w_sorted = weights.reshape(-1).index_select(0, order).to(ys.dtype)
    if _scatter_adds(ys.device):
        return _scatter_rows(ys * w_sorted.unsqueeze(-1), tokens, inverse, K), ys, w_sorted
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
