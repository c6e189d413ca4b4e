"""Expert parallelism: the experts of one bank spread across a ``torch.distributed`` process group.

Rank ``r`` of a group of ``W`` keeps the contiguous block of experts ``[r·N/W, (r+1)·N/W)``
(:class:`ExpertParallelBank`, applied to a model by :func:`moelab.train.distributed.apply_expert_parallel`).
A forward is the shared dispatch with an exchange as its ``run`` step:

1. sort the ``T·K`` slots by expert once (:func:`moelab.experts.dispatch.sort_slots`) — the slots
   for each rank are then contiguous — and gather the tokens;
2. exchange the per-expert counts (``all_to_all``, no gradient), then the tokens (``all_to_all``
   with autograd: its backward is the reverse ``all_to_all``);
3. each rank runs its local experts on what it received (the ordinary sorted dispatch);
4. send the outputs back (``all_to_all`` again), weight them and sum over K into their tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .bank import ExpertBank
from .dispatch import Slots, dispatch, tracks_grad, winners_by_rerun

__all__ = ["ExpertParallelBank"]


class ExpertParallelBank(nn.Module):
    """The :class:`moelab.experts.Experts` protocol over experts spread across a process group.

    Args:
        bank: the full bank (identical on every rank); this rank copies its block of experts.
        group: the expert-parallel process group (default: the world).

    Attributes:
        num_experts: N, all experts (what routers and the layer see).
        num_local: N / W experts held here, in ``local`` (an :class:`moelab.ExpertBank`).
        first_expert: the global index of ``local``'s expert 0.

    ``forward``, ``forward_all``, ``expert_forward`` and ``forward_winners`` are collectives:
    every rank of the group calls them together (each with its own tokens; ``expert_forward``
    with any ``e``).
    """

    def __init__(self, bank: ExpertBank, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if not isinstance(bank, ExpertBank):
            raise ValueError(
                f"bank of type {type(bank).__name__} is not allowed; expert parallelism supports moelab.ExpertBank"
            )
        world, rank = _require_distributed(group)
        N = bank.num_experts
        if N % world:
            raise ValueError(
                f"world size {world} does not divide num_experts={N}; expert parallelism needs a world size "
                f"that divides the number of experts (allowed: {[w for w in range(1, N + 1) if N % w == 0]})"
            )
        self.group, self.world_size, self.rank = group, world, rank
        self.num_experts, self.num_local = N, N // world
        self.first_expert = rank * self.num_local
        self.d_model = bank.d_model
        self.activation = bank.activation
        bias = bank.b_in is not None
        self.local = ExpertBank(
            self.num_local,
            bank.d_model,
            bank.d_hidden,
            activation=bank.activation,
            bias=bias,
            impl=bank.impl,
            chunk_elements=bank.chunk_elements,
        ).to(device=bank.w_in.device, dtype=bank.w_in.dtype)
        block = slice(self.first_expert, self.first_expert + self.num_local)
        with torch.no_grad():
            for name in ("w_in", "w_out", "b_in", "b_out"):
                src = getattr(bank, name)
                if src is not None:
                    getattr(self.local, name).copy_(src[block])
                    getattr(self.local, name).requires_grad_(src.requires_grad)
        # the parameters this rank's block was copied into: a wrapper that swaps them for others
        # (FSDP2's fully_shard does, in every forward) would treat the block as the whole parameter
        self._held = tuple(self.local.parameters())

    def forward(self, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        """``Σ_k w_k · expert_{i_k}(x)``, experts anywhere in the group: ``(T, d)`` → ``(T, d)``.

        The shared dispatch (:func:`moelab.experts.dispatch.dispatch`) whose ``run`` step sends
        the expert-sorted rows to the ranks holding their experts and their outputs back
        (:meth:`_exchange`).
        """
        self._check_own_parameters()
        return dispatch(x, indices, weights, self.num_experts, self._exchange, tracks_grad(self, x, weights))

    def expert_forward(self, x: Tensor, e: int) -> Tensor:
        """Expert ``e`` (anywhere in the group) on ``x (T, d)`` → ``(T, d)``; a collective."""
        idx = torch.full((x.shape[0], 1), int(e), dtype=torch.int64, device=x.device)
        return self.forward(x, idx, x.new_ones(x.shape[0], 1))

    def forward_all(self, x: Tensor) -> Tensor:
        """Every expert on every token of this rank: ``x (T, d)`` → ``(T, N, d)``.

        Every rank's tokens go to every rank, which runs its local block on all of them and returns
        each rank the outputs of its own tokens.
        """
        self._check_own_parameters()
        W, L = self.world_size, self.num_local
        T = x.shape[0]
        sizes = [torch.zeros(1, dtype=torch.int64, device=x.device) for _ in range(W)]
        dist.all_gather(sizes, torch.tensor([T], dtype=torch.int64, device=x.device), group=self.group)
        sizes = [int(s.item()) for s in sizes]
        xg = _all_to_all(x.repeat(W, 1), sizes, [T] * W, self.group)  # (ΣT, d) every rank's tokens
        if xg.shape[0] == 0:  # no tokens on any rank
            return x.new_zeros(0, self.num_experts, self.d_model)
        yg = self.local.forward_all(xg)  # (ΣT, L, d)
        yb = _all_to_all(yg.reshape(yg.shape[0], -1), [T] * W, sizes, self.group)  # (W·T, L·d)
        return yb.view(W, T, L, self.d_model).permute(1, 0, 2, 3).reshape(T, W * L, self.d_model)

    def forward_winners(
        self, x: Tensor, choose: Callable[[Tensor], tuple[Tensor, Any]]
    ) -> tuple[Tensor, Tensor, Any]:
        """The competition's pass: one ``forward_all`` without autograd, the winners again with it
        (:func:`moelab.experts.dispatch.winners_by_rerun`).  Not chunked: ranks with different
        token counts would make different numbers of collective calls and deadlock."""
        return winners_by_rerun(self, x, choose, None)

    @property
    def out_features(self) -> int:
        return self.d_model

    @property
    def chunk_elements(self) -> int:
        """Unbounded: a collective ``forward_all`` must not be chunked by callers (ranks with
        different token counts would make different numbers of calls and deadlock); the local
        experts still bound their hidden activations with ``local.chunk_elements``."""
        return 1 << 62

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, local=[{self.first_expert}, {self.first_expert + self.num_local}), "
            f"world_size={self.world_size}"
        )

    def _check_own_parameters(self) -> None:
        """Refuse to run when a wrapper replaced this rank's expert parameters: FSDP2's
        ``fully_shard`` applied after this plan shards each rank's block as if it were the full
        parameter and gathers a mixture of blocks, a different model without an error."""
        if any(p is not q for p, q in zip(self.local.parameters(), self._held)):
            raise ValueError(
                "the experts of an ExpertParallelBank were replaced by a wrapper applied after expert "
                "parallelism (FSDP2 fully_shard?): it would shard each rank's expert block as if it were the "
                "whole parameter; apply both with moelab.train.parallelize.parallelize(model, ep=..., fsdp=True)"
            )

    def _exchange(self, xs: Tensor, slots: Slots) -> Tensor:
        """The ``run`` step of :meth:`forward`: the expert-sorted rows ``xs (S, d)`` (grouped by
        expert, hence by destination rank) to their ranks, the local experts on what arrived, and
        the outputs ``(S, d)`` back in the order sent."""
        W, L = self.world_size, self.num_local
        counts = slots.counts
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # (W·L,) from each source, my L experts
        recv_matrix = recv_counts.view(W, L)
        send_splits = counts.view(W, L).sum(1).tolist()
        recv_splits = recv_matrix.sum(1).tolist()
        xr = _all_to_all(xs, recv_splits, send_splits, self.group)  # (R, d) by source, then local expert
        local_ids = torch.arange(L, device=xs.device).repeat(W)  # (W·L,) expert of each received block
        local_ids = local_ids.repeat_interleave(recv_matrix.reshape(-1), output_size=xr.shape[0])  # (R,)
        yr = self._run_local(xr, local_ids)
        return _all_to_all(yr, send_splits, recv_splits, self.group)  # (S, d) in the order sent

    def _run_local(self, xr: Tensor, local_ids: Tensor) -> Tensor:
        if xr.shape[0] == 0:
            # keep the autograd graph the same on every rank: the backward all_to_all is a collective
            anchor = sum(p.reshape(-1)[:1].sum() for p in self.local.parameters()) * 0
            return xr * 0 + anchor
        ones = xr.new_ones(xr.shape[0], 1)
        return self.local(xr, local_ids.unsqueeze(1), ones)  # weight 1: each slot is one expert output


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; the backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _AllToAll.apply(grad.contiguous(), ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


def _require_distributed(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "expert parallelism needs torch.distributed initialised (launch with torchrun and call "
            "torch.distributed.init_process_group first)"
        )
    return dist.get_world_size(group), dist.get_rank(group)
