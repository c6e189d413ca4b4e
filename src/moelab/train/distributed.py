"""Expert parallelism with ``torch.distributed``, applied to a model from outside as a plan:
:func:`apply_expert_parallel` (torchtitan's ``ExpertParallel`` style) gives rank ``r`` of ``W`` the
contiguous block of experts ``[r·N/W, (r+1)·N/W)`` of every MoE layer (an
:class:`ExpertParallelBank` exchanging tokens by ``all_to_all``), keeps everything else replicated,
and provides what a training loop needs around it: expert parameters left out of the data-parallel
all-reduce, the full weights and optimizer state gathered for checkpoints, and torchrun set-up.
docs/scaling.md ("Expert parallelism") gives the forward, the gradients and the rules every rank
must keep.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..experts import ExpertBank
from ..experts.parallel import ExpertParallelBank, _all_to_all, _AllToAll, _require_distributed  # noqa: F401
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
