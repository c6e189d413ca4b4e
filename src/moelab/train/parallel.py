"""How the trainer spreads a model over processes: a strategy chosen once and handed to the
:class:`moelab.train.Trainer` (:class:`Parallel` for one process, :class:`DataParallel` for DDP,
:class:`ExpertParallel` for experts spread over the ranks, :class:`Parallelized` for any layout of
:func:`moelab.train.parallelize.parallelize`, FSDP2 included), the way torchtitan applies its parallel
plans from outside; the trainer calls the same hooks whatever the strategy; checkpoints hold the
full model and optimizer state (sharded layouts: each rank's shards, re-sharded on resume), so a
run resumes on any layout.  docs/scaling-train.md ("`moelab train`
under torchrun") lists the hooks and what each strategy does.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from ..balance import step_balance_loss
from ..layer import aux_loss
from .parallelize import (
    clip_grad_norm_,
    full_optimizer_state,
    full_state_dict,
    load_full_optimizer_state,
    load_full_state_dict,
    parallelize,
)

__all__ = ["DataParallel", "ExpertParallel", "Parallel", "Parallelized", "choose", "process_group"]


def process_group() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class TrainForward(nn.Module):
    """The training forward of one rank as a module: ``batch -> (task loss, aux loss, tokens)``,
    the aux loss being that of this rank's tokens (:func:`moelab.aux_loss` after the forward).

    DDP finds the parameters a step leaves unused by walking the graph back from the forward's
    outputs; the outputs therefore hold the task loss *and* the aux loss, or a parameter reached
    only through an aux loss (CompeteSMoE's router on a competition step: only the distillation
    loss trains it) would be taken for unused and reduced twice."""

    def __init__(self, model: nn.Module, task: Any) -> None:
        super().__init__()
        self.model = model
        self.task = task

    def forward(self, batch: Any) -> tuple[Tensor, Tensor, int]:
        task_loss, tokens = self.task.loss(self.model, batch)
        # the global-scope losses from the step's statistics (one all-reduce, between the model's
        # forward and the loss; moelab.balance), then the layers' own aux losses
        balance = step_balance_loss(self.model)
        aux = aux_loss(self.model)
        return task_loss, aux if balance is None else aux + balance.to(aux.device), tokens


class Parallel:
    """One process: the model trains as it is."""

    name = "none"
    #: checkpoints as torch.distributed.checkpoint shards, each rank its own (else full, from rank 0)
    sharded_checkpoints = False

    def __init__(self) -> None:
        self.rank, self.world_size = process_group()

    def apply(self, model: nn.Module) -> None:
        """Change ``model`` for this strategy (after a resume loaded the full weights into it)."""

    def wrap(self, model: nn.Module, task: Any) -> nn.Module:
        """The training forward ``batch -> (task loss, aux loss, tokens)``."""
        return TrainForward(model, task)

    def clip(self, params: list[nn.Parameter], max_norm: float, model: nn.Module) -> Tensor:
        """Clip the gradients to a global norm; return the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def mean(self, values: Tensor) -> Tensor:
        """``values`` averaged over the ranks (the same on every rank)."""
        return values

    def weights(self, model: nn.Module) -> nn.Module:
        """The module a checkpoint stores (a collective under expert parallelism)."""
        return model

    def load_weights(self, model: nn.Module, load: Any) -> None:
        """Load saved full weights with ``load(module)`` into the training ``model``."""
        load(model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Adjust the freshly built ``optimizer`` to the layout (nothing here)."""

    def optimizer_state(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
        """The optimizer state a checkpoint stores (the full model's)."""
        return optimizer.state_dict()

    def load_optimizer_state(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, full: dict[str, Any]
    ) -> None:
        optimizer.load_state_dict(full)

    def full_model(self, model: nn.Module) -> nn.Module:
        """The whole model (for parameter counts), without a collective."""
        return model


class DataParallel(Parallel):
    """``torchrun`` data parallelism: DDP over the training forward."""

    name = "ddp"

    def wrap(self, model: nn.Module, task: Any) -> nn.Module:
        forward = TrainForward(model, task)
        if self.world_size == 1 or not any(p.requires_grad for p in model.parameters()):
            return forward
        from torch.nn.parallel import DistributedDataParallel

        self._ignore(forward)
        device = next(model.parameters()).device
        # find_unused_parameters: which parameters a step uses depends on the routing (an expert
        # of a ModuleExperts bank that no token chose)
        return DistributedDataParallel(
            forward, device_ids=[device] if device.type == "cuda" else None, find_unused_parameters=True
        )

    def _ignore(self, forward: nn.Module) -> None:
        """Parameters DDP must not all-reduce (none here)."""

    def mean(self, values: Tensor) -> Tensor:
        if self.world_size == 1:
            return values
        values = values.clone()
        torch.distributed.all_reduce(values)
        return values / self.world_size


class Parallelized(DataParallel):
    """Expert parallelism and / or FSDP2 applied by :func:`moelab.train.parallelize.parallelize`:
    the experts of every MoE layer split over ``ep`` ranks (``DTensor`` ``Shard(0)``), the rest
    data parallel — replicated under DDP, or every parameter sharded by FSDP2 (``fsdp=True``).
    Checkpoints are ``torch.distributed.checkpoint`` shards, each rank writing its own
    (:func:`moelab.train.checkpoint.save_sharded_checkpoint`), re-sharded on resume, so a run
    resumes on any layout and any number of ranks; ``best/`` holds the gathered full model."""

    name = "parallelize"
    sharded_checkpoints = True

    def __init__(self, ep: int | None = None, fsdp: bool = False) -> None:
        super().__init__()
        self.ep = ep  # None: every rank (the world size)
        self.fsdp = fsdp
        self._full: nn.Module | None = None  # the full model, for checkpoints

    def apply(self, model: nn.Module) -> None:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            what = "expert parallelism" if self.ep != 1 else "FSDP2"
            raise ValueError(
                f"{what} needs torch.distributed initialised (launch with torchrun and call "
                "torch.distributed.init_process_group first)"
            )
        self._full = copy.deepcopy(model)  # same weights on every rank: same seed / checkpoint
        ep = self.world_size if self.ep is None else self.ep
        parallelize(model, dp="fsdp" if self.fsdp else "none", ep=ep)

    def wrap(self, model: nn.Module, task: Any) -> nn.Module:
        if self.fsdp:  # FSDP2 reduces the gradients itself
            return TrainForward(model, task)
        return super().wrap(model, task)

    def _ignore(self, forward: nn.Module) -> None:
        from torch.distributed.tensor import DTensor
        from torch.nn.parallel import DistributedDataParallel

        # each rank's expert block is its own: DDP must neither broadcast nor average it
        sharded = [n for n, p in forward.named_parameters() if isinstance(p, DTensor)]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(forward, sharded)

    def clip(self, params: list[nn.Parameter], max_norm: float, model: nn.Module) -> Tensor:
        return clip_grad_norm_(params, max_norm)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.tensor import DTensor

        # torch's foreach kernels refuse a list mixing plain tensors and DTensors, or DTensors of
        # several meshes (the experts' and the rest's): such a group steps tensor by tensor
        for group in optimizer.param_groups:
            meshes = {p.device_mesh if isinstance(p, DTensor) else None for p in group["params"]}
            if len(meshes) > 1 and "foreach" in group:
                group["foreach"] = False

    def weights(self, model: nn.Module) -> nn.Module:
        self._full.load_state_dict(full_state_dict(model))
        return self._full

    def load_weights(self, model: nn.Module, load: Any) -> None:
        load(self._full)  # the full weights, then each rank's shards of them
        load_full_state_dict(model, self._full.state_dict())

    def optimizer_state(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
        return full_optimizer_state(optimizer, model)

    def load_optimizer_state(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, full: dict[str, Any]
    ) -> None:
        load_full_optimizer_state(optimizer, model, full)

    def full_model(self, model: nn.Module) -> nn.Module:
        return model if self._full is None else self._full


class ExpertParallel(Parallelized):
    """Data parallelism with the experts of every MoE layer spread over all ranks (DDP for the rest)."""

    name = "expert-parallel"

    def __init__(self) -> None:
        super().__init__(ep=None, fsdp=False)


def choose(expert_parallel: bool = False, fsdp: bool = False) -> Parallel:
    """The strategy for this process group: expert parallel and / or FSDP2 when asked, data
    parallel under ``torchrun``, else one process."""
    if fsdp:
        return Parallelized(ep=None if expert_parallel else 1, fsdp=True)
    if expert_parallel:
        return ExpertParallel()
    return DataParallel() if process_group()[1] > 1 else Parallel()
