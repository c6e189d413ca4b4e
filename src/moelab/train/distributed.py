"""Expert parallelism with ``torch.distributed``, applied to a model from outside as a plan.

:func:`apply_expert_parallel` (torchtitan's ``ExpertParallel`` style) swaps the
:class:`moelab.ExpertBank` of every MoE layer for an :class:`ExpertParallelBank`: rank ``r`` of
a group of ``W`` keeps the contiguous block of experts ``[r·N/W, (r+1)·N/W)``; routers, shared
experts and everything else stay replicated (data parallel).  A forward:

1. sort the ``T·K`` slots by expert once (:func:`moelab.experts.sort_slots`) — the slots for
   each rank are then contiguous;
2. exchange the per-expert counts (``all_to_all``, no gradient), then the tokens
   (``all_to_all`` with autograd: its backward is the reverse ``all_to_all``);
3. each rank runs its local experts on what it received (the ordinary sorted dispatch);
4. send the outputs back (``all_to_all`` again), undo the sort, weight and sum over K.

``forward_all`` (competition runs every expert on every token) gathers every rank's tokens to
every rank, runs the local block on all of them and returns each rank the ``(T, N, d)``
outputs of its own tokens, so competition routers work unchanged across ranks.

Gradients: a local expert's gradient sums the contributions of every rank's tokens, i.e. it is
already the gradient of ``Σ_r loss_r``; expert parameters must therefore be excluded from the
data-parallel all-reduce (:func:`ddp_ignore_experts`, :func:`non_expert_parameters`).  With
``average_grads=True`` (the default) they are divided by ``W`` so that the whole model gets the
gradient of ``mean_r loss_r`` — what DDP's averaging gives the replicated parameters.

All ranks must call every MoE layer the same number of times (the exchanges are collectives),
and must hold identical full weights when the plan is applied (same seed, or the same
checkpoint loaded first); :func:`full_state_dict` gathers the experts back for saving.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..experts import ExpertBank, combine, sort_slots
from ..layer import moe_layers

__all__ = [
    "ExpertParallelBank",
    "apply_expert_parallel",
    "clip_grad_norm_",
    "ddp_ignore_experts",
    "expert_parameters",
    "full_optimizer_state",
    "full_state_dict",
    "init_from_env",
    "local_optimizer_state",
    "local_state_dict",
    "non_expert_parameters",
]


def init_from_env(backend: str | None = None) -> tuple[int, int]:
    """Initialise the default process group from the variables ``torchrun`` sets (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and return
    ``(rank, world_size)``; ``(0, 1)`` without initialising anything when ``WORLD_SIZE`` is unset
    (a plain ``python``/``moelab`` process) or the group is already initialised.

    ``backend`` defaults to ``nccl`` when CUDA is available (then ``cuda:LOCAL_RANK`` becomes the
    current device) and ``gloo`` otherwise.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ:
        return 0, 1
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ValueError(
                f"WORLD_SIZE is set but {name} is not; launch with torchrun (which sets RANK, WORLD_SIZE, "
                "LOCAL_RANK, MASTER_ADDR and MASTER_PORT) or unset WORLD_SIZE"
            )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, init_method="env://")
    return dist.get_rank(), dist.get_world_size()


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


class ExpertParallelBank(nn.Module):
    """The :class:`moelab.ExpertBank` interface over experts spread across a process group.

    Args:
        bank: the full bank (identical on every rank); this rank copies its block of experts.
        group: the expert-parallel process group (default: the world).

    Attributes:
        num_experts: N, all experts (what routers and the layer see).
        num_local: N / W experts held here, in ``local`` (an :class:`moelab.ExpertBank`).
        first_expert: the global index of ``local``'s expert 0.

    ``forward``, ``forward_all`` and ``expert_forward`` are collectives: every rank of the
    group calls them together (each with its own tokens; ``expert_forward`` with any ``e``).
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

    @property
    def out_features(self) -> int:
        return self.d_model

    @property
    def chunk_elements(self) -> int:
        """Callers that chunk ``forward_all`` by this budget (the competition routers) must not
        chunk a collective: ranks with different token counts would make different numbers of
        calls and deadlock.  So the budget is unbounded here; the local experts still bound their
        hidden activations with ``local.chunk_elements``."""
        return 1 << 62

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, local=[{self.first_expert}, {self.first_expert + self.num_local}), "
            f"world_size={self.world_size}"
        )

    def _run_local(self, xr: Tensor, local_ids: Tensor) -> Tensor:
        if xr.shape[0] == 0:
            # keep the autograd graph the same on every rank: the backward all_to_all is a collective
            anchor = sum(p.reshape(-1)[:1].sum() for p in self.local.parameters()) * 0
            return xr * 0 + anchor
        ones = xr.new_ones(xr.shape[0], 1)
        return self.local(xr, local_ids.unsqueeze(1), ones)  # weight 1: each slot is one expert output

    def forward(self, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        """``Σ_k w_k · expert_{i_k}(x)``, experts anywhere in the group: ``(T, d)`` → ``(T, d)``."""
        T, K = indices.shape
        W, L = self.world_size, self.num_local
        _, counts, tokens, inverse = sort_slots(indices, self.num_experts)
        xs = x.index_select(0, tokens)  # (S, d) grouped by expert, hence by destination rank
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # (W·L,) from each source, my L experts
        recv_matrix = recv_counts.view(W, L)
        send_splits = counts.view(W, L).sum(1).tolist()
        recv_splits = recv_matrix.sum(1).tolist()
        xr = _all_to_all(xs, recv_splits, send_splits, self.group)  # (R, d) by source, then local expert
        local_ids = torch.arange(L, device=x.device).repeat(W)  # (W·L,) expert of each received block
        local_ids = local_ids.repeat_interleave(recv_matrix.reshape(-1), output_size=xr.shape[0])  # (R,)
        yr = self._run_local(xr, local_ids)
        ys = _all_to_all(yr, send_splits, recv_splits, self.group)  # (S, d) in the order sent
        slots = ys.index_select(0, inverse).view(T, K, self.d_model)
        return combine(slots, weights)

    def forward_all(self, x: Tensor) -> Tensor:
        """Every expert on every token of this rank: ``x (T, d)`` → ``(T, N, d)``."""
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

    def expert_forward(self, x: Tensor, e: int) -> Tensor:
        """Expert ``e`` (anywhere in the group) on ``x (T, d)`` → ``(T, d)``; a collective."""
        idx = torch.full((x.shape[0], 1), int(e), dtype=torch.int64, device=x.device)
        return self.forward(x, idx, x.new_ones(x.shape[0], 1))


def apply_expert_parallel(
    model: nn.Module, group: dist.ProcessGroup | None = None, average_grads: bool = True
) -> list[nn.Module]:
    """Spread the experts of every MoE layer of ``model`` over ``group`` (in place).

    Args:
        model: identical on every rank (same seed or same checkpoint).
        group: the expert-parallel process group (default: the world).
        average_grads: divide expert gradients by the world size (see the module docstring);
            use ``False`` if you reduce the replicated parameters with a sum yourself.

    Returns:
        the MoE layers whose experts are now parallel.

    Raises:
        ValueError: torch.distributed is not initialised, the world size does not divide a
            layer's ``num_experts``, or a layer's experts are not an :class:`moelab.ExpertBank`.
    """
    world, _ = _require_distributed(group)
    layers = [m for m in moe_layers(model) if not isinstance(m.experts, ExpertParallelBank)]
    for layer in layers:
        if not isinstance(layer.experts, ExpertBank):
            raise ValueError(
                f"MoE layer {layer.layer_index} has experts of type {type(layer.experts).__name__}; expert "
                "parallelism supports moelab.ExpertBank only"
            )
    for layer in layers:
        layer.experts = ExpertParallelBank(layer.experts, group)
        if average_grads and world > 1:
            for p in layer.experts.parameters():
                if p.requires_grad:
                    p.register_hook(lambda g, w=world: g / w)
    return layers


def expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every expert-parallel parameter of ``model``."""
    ids = {id(p) for m in model.modules() if isinstance(m, ExpertParallelBank) for p in m.parameters()}
    return [(n, p) for n, p in model.named_parameters() if id(p) in ids]


def non_expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The replicated parameters: the ones a data-parallel all-reduce must average."""
    ids = {id(p) for _, p in expert_parameters(model)}
    return [p for p in model.parameters() if id(p) not in ids]


def ddp_ignore_experts(model: nn.Module) -> list[str]:
    """Make ``DistributedDataParallel(model)`` skip the expert-parallel parameters (call it before
    wrapping): DDP neither broadcasts them from rank 0 nor all-reduces their gradients.

    Returns:
        the ignored parameter names.
    """
    from torch.nn.parallel import DistributedDataParallel

    names = [n for n, _ in expert_parameters(model)]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    return names


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The state dict of the model as if it were not expert-parallel (a collective).

    Expert weights are gathered from every rank and stored under the names of the original
    :class:`moelab.ExpertBank` (``...experts.w_in``), so the result loads into a fresh,
    non-parallel model; save it from rank 0.
    """
    state = dict(model.state_dict())
    for name, module in model.named_modules():
        if not isinstance(module, ExpertParallelBank):
            continue
        prefix = f"{name}.local." if name else "local."
        for key in [k for k in state if k.startswith(prefix)]:
            local = state.pop(key).contiguous()
            parts = [torch.empty_like(local) for _ in range(module.world_size)]
            dist.all_gather(parts, local, group=module.group)
            state[(f"{name}." if name else "") + key[len(prefix) :]] = torch.cat(parts)
    return state


def local_state_dict(model: nn.Module, full: dict[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of :func:`full_state_dict`: ``full`` (a state dict of the non-parallel model)
    with each expert-parallel bank's weights cut to this rank's block, under the names of the
    parallel ``model`` (``...experts.local.w_in``); load it with ``model.load_state_dict``."""
    state = dict(full)
    for name, module in model.named_modules():
        if not isinstance(module, ExpertParallelBank):
            continue
        block = slice(module.first_expert, module.first_expert + module.num_local)
        dot = f"{name}." if name else ""
        for key, _ in module.local.named_parameters():
            state[f"{dot}local.{key}"] = state.pop(f"{dot}{key}")[block]
    return state


def _expert_blocks(params: list[nn.Parameter], model: nn.Module) -> list[ExpertParallelBank | None]:
    """For each of ``params``: the expert-parallel bank holding it, or ``None`` (replicated)."""
    owner = {id(p): m for m in model.modules() if isinstance(m, ExpertParallelBank) for p in m.parameters()}
    return [owner.get(id(p)) for p in params]


def full_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """``optimizer.state_dict()`` as the non-parallel model's optimizer would hold it (a
    collective): the per-parameter tensors of the expert parameters (Adam's moments: the same
    shape as the parameter) gathered over the expert blocks; scalars (``step``) are kept."""
    state = optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for index, bank in enumerate(_expert_blocks(params, model)):
        if bank is None or index not in state["state"]:
            continue
        entry = dict(state["state"][index])
        for key, value in entry.items():
            if torch.is_tensor(value) and value.shape == params[index].shape:
                parts = [torch.empty_like(value) for _ in range(bank.world_size)]
                dist.all_gather(parts, value.contiguous(), group=bank.group)
                entry[key] = torch.cat(parts)
        state["state"] = {**state["state"], index: entry}
    return state


def local_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module, full: dict) -> dict:
    """The inverse of :func:`full_optimizer_state`: ``full`` with the expert parameters' tensors
    cut to this rank's block; load it with ``optimizer.load_state_dict``."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {**full, "state": dict(full["state"])}
    for index, bank in enumerate(_expert_blocks(params, model)):
        if bank is None or index not in state["state"]:
            continue
        block = slice(bank.first_expert, bank.first_expert + bank.num_local)
        entry = dict(state["state"][index])
        for key, value in entry.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == bank.num_experts:
                entry[key] = value[block]
        state["state"][index] = entry
    return state


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float, model: nn.Module) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the whole expert-parallel model: the norm counts
    the replicated gradients once and every rank's expert block (summed over the group), so
    every rank computes the same norm and scales by the same factor (a collective)."""
    banks = _expert_blocks(params, model)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    device = grads[0].device
    replicated = torch.zeros((), device=device, dtype=torch.float64)
    local = torch.zeros((), device=device, dtype=torch.float64)
    group = None
    for p, bank in zip(params, banks):
        if p.grad is None:
            continue
        sq = p.grad.detach().double().pow(2).sum()
        if bank is None:
            replicated = replicated + sq
        else:
            local, group = local + sq, bank.group
    if any(b is not None for b in banks):
        dist.all_reduce(local, group=group)
    total = (replicated + local).sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total.float()
