"""Expert parallelism: the experts of a bank split over the ranks of an expert mesh.

:class:`ExpertParallelBank` is mixed into an :class:`moelab.ExpertBank` whose weights are
``DTensor`` sharded over the experts (``Shard(0)``) by the ``ParallelStyle``
:class:`moelab.train.parallelize.ExpertParallel` (torchtitan's shape); the bank's own
computation is unchanged and runs on its local block.  A forward is the shared dispatch with an
exchange as its ``run`` step:

1. sort the ``T·K`` slots by expert once (:func:`moelab.experts.dispatch.sort_slots`) — the slots
   for each rank are then contiguous — and gather the tokens;
2. exchange the per-expert counts (``all_to_all``, no gradient), then the tokens (the op
   ``moelab::all_to_all``, whose backward is the reverse ``all_to_all``; torch.compile takes it
   whole, so a compiled layer traces as one graph, with ``fullgraph=True`` too);
3. each rank runs its local experts on what it received (the ordinary sorted dispatch);
4. send the outputs back (``all_to_all`` again), weight them and sum over K into their tokens.

A local expert's gradient sums the tokens of every rank of the mesh; it is scaled by ``1/E`` at the
bank's boundary so that every parameter gets the gradient of the mean of the ranks' losses, as
DDP / FSDP give the rest.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .bank import ExpertBank
from .base import SparseExperts
from .dispatch import Slots, dispatch, tracks_grad, winners_by_rerun
from .kernels import ExpertWeights

__all__ = ["ExpertParallelBank", "parallel_class"]

_CLASSES: dict[type, type] = {}


def parallel_class(cls: type) -> type:
    """``cls`` with the expert-parallel methods in front (the way FSDP2 swaps a module's class)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallelBank, cls), {})
    return _CLASSES[cls]


class ExpertParallelBank(ExpertBank):
    """The collectives around an :class:`moelab.ExpertBank` whose weights are ``DTensor``
    ``Shard(0)`` on a 1-D expert mesh, mixed in before the bank's class by
    :class:`moelab.train.parallelize.ExpertParallel` (:func:`parallel_class`); ``super()`` is the
    unchanged bank, which runs its local block (:attr:`moelab.ExpertBank.expert_weights`).

    Attributes:
        _ep: ``(mesh, E, r)``: the expert mesh, its size and this rank's place on it; rank ``r``
            holds experts ``[r·N/E, (r+1)·N/E)``.

    ``mix``, ``forward_all``, ``expert_forward`` and ``forward_winners`` are collectives over
    the mesh: every rank calls them together, each with its own tokens (any number, zero
    included).
    """

    _ep: tuple[Any, int, int]

    @property
    def expert_weights(self) -> ExpertWeights:
        from torch.distributed.tensor import DTensor, Shard

        mesh, E, _ = self._ep
        local = []
        for name in ("w_in", "w_out", "b_in", "b_out"):
            t = getattr(self, name)
            if t is None:
                local.append(None)
                continue
            # FSDP2 gives the gathered weight back as Shard(0) on the expert mesh; anything else (a
            # wrapper applied after the plan, a method called outside FSDP's forward) is another layout
            if not isinstance(t, DTensor) or t.device_mesh != mesh or tuple(t.placements) != (Shard(0),):
                layout = tuple(t.placements) if isinstance(t, DTensor) else "a plain tensor"
                raise ValueError(
                    f"expert-parallel weight {name} with placements {layout} is not allowed; expected Shard(0) on "
                    "the expert mesh (FSDP2 / a wrapper applied by hand after parallelize changed it: use "
                    "parallelize(model, dp='fsdp', ep=...))"
                )
            # a local expert's gradient sums the tokens of every rank of the expert mesh: 1/E makes
            # it the gradient of the mean over those ranks, as DDP / FSDP average the rest
            local.append(_ScaleGrad.apply(t.to_local(), 1.0 / E))
        return ExpertWeights(*local, self.activation)

    def mix(self, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        return dispatch(x, indices, weights, self.num_experts, self._exchange, tracks_grad(self, x, weights))

    # the padded layout through the exchange (each row to its expert's rank), not the local bmm
    mix_padded = SparseExperts.mix_padded

    def expert_forward(self, x: Tensor, e: int) -> Tensor:
        idx = torch.full((x.shape[0], 1), int(e), dtype=torch.int64, device=x.device)
        return self.mix(x, idx, x.new_ones(x.shape[0], 1))

    def forward_all(self, x: Tensor) -> Tensor:
        mesh, E, _ = self._ep
        group = mesh.get_group()
        L = self.num_experts // E
        T = x.shape[0]
        mine = torch.full((E,), T, dtype=torch.int64, device=x.device)  # my T to every rank
        sizes = torch.empty_like(mine)
        dist.all_to_all_single(sizes, mine, group=group)  # every rank's T
        xg = _all_to_all(x.repeat(E, 1), sizes, mine, group)  # (ΣT, d): every rank's tokens
        if not torch.compiler.is_compiling() and xg.shape[0] == 0:  # no tokens on any rank
            return x.new_zeros(0, self.num_experts, self.d_model)
        yg = super().forward_all(xg)  # (ΣT, L, d) the local block on every rank's tokens
        yb = _all_to_all(yg.reshape(yg.shape[0], -1), mine, sizes, group, rows=E * T)  # (E·T, L·d)
        return yb.view(E, T, L, self.d_model).permute(1, 0, 2, 3).reshape(T, E * L, self.d_model)

    def forward_winners(self, x: Tensor, choose) -> tuple[Tensor, Tensor, Any]:
        # one collective forward_all (not chunked: ranks with other token counts would make
        # another number of calls), the winners again through the collective forward
        return winners_by_rerun(self, x, choose, None)

    def _exchange(self, xs: Tensor, slots: Slots) -> Tensor:
        """The ``run`` step of :meth:`forward`: the expert-sorted rows to the ranks holding their
        experts, the local block on what arrived, the outputs back in the order sent."""
        mesh, E, _ = self._ep
        group = mesh.get_group()
        L = self.num_experts // E
        counts = slots.counts
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)  # (E·L,) from each source, my L experts
        recv_matrix = recv_counts.view(E, L)
        send_splits = counts.view(E, L).sum(1)  # (E,) rows to each rank
        recv_splits = recv_matrix.sum(1)  # (E,) rows from each rank
        xr = _all_to_all(xs, recv_splits, send_splits, group)  # (R, d) by source, then local expert
        local_ids = torch.arange(L, device=xs.device).repeat(E)
        local_ids = local_ids.repeat_interleave(recv_matrix.reshape(-1), output_size=xr.shape[0])  # (R,)
        if not torch.compiler.is_compiling() and xr.shape[0] == 0:
            # keep the autograd graph the same on every rank: the backward all_to_all is a collective
            # (a compiled backward is one graph that runs every collective: no branch on the data there)
            w = self.expert_weights
            anchor = sum(t.reshape(-1)[:1].sum() for t in w[:4] if t is not None) * 0
            yr = xr * 0 + anchor
        else:
            yr = super().mix(xr, local_ids.unsqueeze(1), xr.new_ones(xr.shape[0], 1))
        return _all_to_all(yr, send_splits, recv_splits, group, rows=xs.shape[0])  # (S, d) in the order sent

    def extra_repr(self) -> str:
        _, E, r = self._ep
        L = self.num_experts // E
        return f"{super().extra_repr()}, ep={E}, local=[{r * L}, {(r + 1) * L})"


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale``."""

    @staticmethod
    def forward(ctx, t: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scale, None


def _all_to_all(x: Tensor, out_counts: Tensor, in_counts: Tensor, group, rows: int | None = None) -> Tensor:
    """``all_to_all_single`` with uneven splits and autograd (the backward sends the gradients
    back): ``in_counts (E,)`` rows of ``x`` to each rank, ``out_counts (E,)`` rows from each, as
    tensors; ``rows``, the number received, where the caller knows it (else data-dependent).

    The splits are read on the host inside the op (:func:`_all_to_all_op`), which torch.compile
    does not trace: a compiled layer has no graph break and no data-dependent guard here
    (``fullgraph=True`` under expert parallelism), and the received rows are a size the graph
    takes as it comes."""
    return _all_to_all_op(x.contiguous(), out_counts, in_counts, rows, group.group_name)


@torch.library.custom_op("moelab::all_to_all", mutates_args=())
def _all_to_all_op(x: Tensor, out_counts: Tensor, in_counts: Tensor, rows: int | None, group: str) -> Tensor:
    """``x``'s rows sent to the ranks of ``group`` (``in_counts`` each), those they send received
    (``out_counts`` each), in rank order: ``dist.all_to_all_single`` with the splits on the host."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    out_splits, in_splits = out_counts.tolist(), in_counts.tolist()
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    dist.all_to_all_single(out, x, out_splits, in_splits, group=_resolve_process_group(group))
    return out


@_all_to_all_op.register_fake
def _(x: Tensor, out_counts: Tensor, in_counts: Tensor, rows: int | None, group: str) -> Tensor:
    if rows is None:  # the rows received: known once the counts are
        rows = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty(rows, *x.shape[1:])


def _all_to_all_setup(ctx, inputs, output) -> None:
    x, out_counts, in_counts, _, group = inputs
    ctx.save_for_backward(out_counts, in_counts)
    ctx.rows, ctx.group = x.shape[0], group


def _all_to_all_backward(ctx, grad: Tensor):
    out_counts, in_counts = ctx.saved_tensors  # the gradients go back the way the rows came
    return (
        _all_to_all_op(grad.contiguous(), in_counts, out_counts, ctx.rows, ctx.group),
        None,
        None,
        None,
        None,
    )


_all_to_all_op.register_autograd(_all_to_all_backward, setup_context=_all_to_all_setup)
