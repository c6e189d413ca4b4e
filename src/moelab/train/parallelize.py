"""Parallelism applied from outside, on torch's own machinery, in torchtitan's shape.

:func:`parallelize` spreads a model holding :class:`moelab.MoE` layers over the ranks of a
``torch.distributed`` process group:

* **expert parallelism** (``ep``): :class:`ExpertParallel`, a ``ParallelStyle`` like torchtitan's,
  turns every layer's :class:`moelab.ExpertBank` weights into ``DTensor`` sharded over the experts
  (``Shard(0)``) on the ``"ep"`` dimension of a 2-D device mesh ``("efsdp", "ep")``; the tokens go
  to the ranks holding their experts and back by ``all_to_all`` around the unchanged bank, which
  runs on its local block (``to_local`` at its boundary, the parallel bank's
  :attr:`moelab.ExpertBank.expert_weights`);
* **data parallelism**: ``dp="fsdp"`` applies FSDP2's ``fully_shard`` — the experts on the
  ``"efsdp"`` dimension (the ranks holding the same experts; dim-1 sharding when that degree
  exceeds the local experts), every MoE layer, every block of a ``ModuleList`` (a transformer's
  layers) and the root over all ranks — ``dp="ddp"`` wraps the
  model in ``DistributedDataParallel`` (expert weights left out: each rank's block is its own),
  ``dp="none"`` leaves the replicated parameters to the caller (the trainer wraps its own
  training forward in DDP).

Every rank gets the gradient of the mean of the ranks' losses, as under DDP: a local expert's
gradient sums the tokens of the ``ep`` ranks that sent them and is scaled by ``1/ep`` at the
bank's boundary; FSDP averages it over the ``efsdp`` ranks.  :func:`clip_grad_norm_` measures the
whole model's norm over the shards; :func:`full_state_dict` / :func:`load_full_state_dict` and
:func:`full_optimizer_state` / :func:`load_full_optimizer_state` go between the sharded model and
the full (layout-independent) state through ``torch.distributed.checkpoint.state_dict``, so a run
saved on ``W`` ranks resumes on any other number; :func:`save_sharded` / :func:`load_sharded` write
and read each rank's shards with ``torch.distributed.checkpoint`` itself, re-sharded on load.
docs/scaling-parallelize.md has the rules.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..experts import ExpertBank
from ..experts.parallel import ExpertParallelBank, parallel_class
from ..layer import moe_layers
from ..routing import RoutingContext

__all__ = [
    "ExpertParallel",
    "clip_grad_norm_",
    "full_optimizer_state",
    "full_state_dict",
    "load_full_optimizer_state",
    "load_full_state_dict",
    "load_sharded",
    "parallelize",
    "save_sharded",
]

DP_MODES = ("ddp", "fsdp", "none")


# ---------------------------------------------------------------------------- expert parallelism
def _style_base() -> type:
    from torch.distributed.tensor.parallel import ParallelStyle

    return ParallelStyle


class ExpertParallel(_style_base()):
    """torchtitan's ``ExpertParallel`` for a :class:`moelab.ExpertBank`: apply it with
    ``torch.distributed.tensor.parallel.parallelize_module(bank, ep_mesh, ExpertParallel())``
    (a 1-D mesh of the ranks that split the experts).

    The bank's weights become ``DTensor`` ``Shard(0)`` on the mesh (rank ``r`` of ``E`` holds
    experts ``[r·N/E, (r+1)·N/E)``; parameter names unchanged), and its methods become
    collectives over the mesh: ``forward`` sends the expert-sorted token rows to the ranks holding
    their experts and the outputs back (``all_to_all``, gradients through the reverse
    ``all_to_all``); ``forward_all`` (competition) sends every token to every rank;
    ``expert_forward`` and ``forward_winners`` go through these two.  The bank itself computes as
    before on its local block.  Every rank of the mesh calls each method the same number of times.
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

        if not isinstance(module, ExpertBank) or isinstance(module, ExpertParallelBank):
            raise ValueError(
                f"experts of type {type(module).__name__} are not allowed with expert parallelism; it shards "
                "a moelab.ExpertBank (once)"
            )
        if module.gate_rank is not None:  # its local block would drop the factorised gates
            raise ValueError(
                f"an ExpertBank with gate_rank={module.gate_rank} (method='aoe' or 'routing-free') is not allowed with expert "
                "parallelism; expected full-rank gate projections (sharding factorised gates is not implemented)"
            )
        if device_mesh.ndim != 1:
            raise ValueError(
                f"an expert mesh of {device_mesh.ndim} dimensions is not allowed; expected a 1-D mesh"
            )
        size = device_mesh.size()
        if module.num_experts % size:
            raise ValueError(
                f"ep={size} does not divide num_experts={module.num_experts}; allowed: "
                f"{[e for e in range(1, module.num_experts + 1) if module.num_experts % e == 0]}"
            )

        def shard(name: str, mod: nn.Module, mesh) -> None:
            for key, p in list(mod.named_parameters(recurse=False)):
                sharded = nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]), p.requires_grad)
                mod.register_parameter(key, sharded)

        distribute_module(module, device_mesh, shard)
        module.__class__ = parallel_class(type(module))
        module._ep = (device_mesh, size, device_mesh.get_local_rank())
        return module


# ---------------------------------------------------------------------------- parallelize
def parallelize(
    model: nn.Module, mesh=None, *, dp: str = "ddp", ep: int = 1, mp_policy: Any = None
) -> nn.Module:
    """Spread ``model`` (identical on every rank: same seed or same checkpoint) over the ranks.

    Args:
        model: a module holding :class:`moelab.MoE` layers (or none: plain data parallelism).
        mesh: a 2-D ``DeviceMesh`` named ``("efsdp", "ep")`` over all ranks (default: built from
            the world size and ``ep`` on the device of the model).
        dp: ``"fsdp"`` (FSDP2 ``fully_shard``), ``"ddp"`` (``DistributedDataParallel``), or
            ``"none"`` (the replicated parameters' gradients are the caller's to reduce).
        ep: the expert-parallel degree: the experts of every layer are split over ``ep`` ranks
            (``1``: every rank holds all of them).
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` for every unit ``fully_shard`` makes
            (``dp="fsdp"`` only; ``None``: the parameters' dtype).  A router with
            ``router_dtype="float32"`` is its own unit with a float32 policy (parameters gathered,
            computed on and reduced in float32), as torchtitan and Megatron-Core keep the gate.

    Returns:
        the module to train: ``model`` itself (sharded in place) for ``"fsdp"`` and ``"none"``, a
        ``DistributedDataParallel`` around it for ``"ddp"``.

    Raises:
        ValueError: for every combination that cannot be right (one line each; docs/errors.md).
    """
    if dp not in DP_MODES:
        raise ValueError(f"dp={dp!r} is not allowed; expected one of {list(DP_MODES)}")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "parallelize needs torch.distributed initialised (launch with torchrun and call "
            "torch.distributed.init_process_group first)"
        )
    world = dist.get_world_size()
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or world % ep:
        raise ValueError(
            f"ep={ep!r} is not allowed with {world} processes; expected a divisor of the world size: "
            f"{[e for e in range(1, world + 1) if world % e == 0]}"
        )
    if mp_policy is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if dp != "fsdp" or not isinstance(mp_policy, MixedPrecisionPolicy):
            raise ValueError(
                f"mp_policy={mp_policy!r} is not allowed with dp={dp!r}; expected a "
                "torch.distributed.fsdp.MixedPrecisionPolicy with dp='fsdp' (otherwise run under torch.autocast)"
            )
        if ep > 1 and ep == world:
            raise ValueError(
                f"mp_policy is not allowed with ep={ep} on {world} processes: each rank holds its experts "
                "whole, outside FSDP2, which would not cast them; run under torch.autocast, or with ep < world size"
            )
    _refuse_parallel(model)
    layers = moe_layers(model)
    if ep > 1:
        for layer in layers:
            if not isinstance(layer.experts, ExpertBank):
                raise ValueError(
                    f"MoE layer {layer.layer_index} has experts of type {type(layer.experts).__name__}; expert "
                    "parallelism (ep > 1) shards a moelab.ExpertBank"
                )
            n = layer.experts.num_experts
            if n % ep:
                raise ValueError(
                    f"ep={ep} does not divide num_experts={n} of MoE layer {layer.layer_index}; allowed: "
                    f"{[e for e in range(1, n + 1) if n % e == 0 and world % e == 0]}"
                )
        if dp == "ddp" and ep < world:
            raise ValueError(
                f"dp='ddp' with ep={ep} < {world} processes is not allowed: DDP reduces over one process group, "
                f"the experts would need another (the {world // ep} ranks holding the same experts); use "
                f"dp='fsdp' or ep={world}"
            )
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    elif tuple(mesh.mesh_dim_names or ()) != ("efsdp", "ep") or tuple(mesh.shape) != (world // ep, ep):
        raise ValueError(
            f"mesh of shape {tuple(mesh.shape)} named {mesh.mesh_dim_names} is not allowed; expected shape "
            f"({world // ep}, {ep}) named ('efsdp', 'ep')"
        )
    if ep > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        for layer in layers:
            parallelize_module(layer.experts, mesh["ep"], ExpertParallel())
    if dp == "fsdp":
        return _fully_shard(model, mesh, layers, ep, mp_policy)
    if dp == "ddp" and world > 1:
        from torch.nn.parallel import DistributedDataParallel

        sharded = [n for n, p in model.named_parameters() if _is_dtensor(p)]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sharded)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        # find_unused_parameters: which parameters a step uses depends on the routing
        return DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None, find_unused_parameters=True
        )
    return model


def _fully_shard(
    model: nn.Module, mesh, layers: list[nn.Module], ep: int, mp_policy: Any = None
) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    from torch.distributed.tensor import Shard

    mp = {} if mp_policy is None else {"mp_policy": mp_policy}
    dp_mesh = mesh._flatten("dp") if ep > 1 else mesh["efsdp"]  # every rank (ep=1: efsdp is the world)
    efsdp = mesh["efsdp"].size()
    # the blocks of a ModuleList (a transformer's layers) each their own unit, as torchtitan wraps
    # every transformer block: one block's full weights exist at a time, not the whole model's
    inside = {id(m) for layer in layers for m in layer.modules()}
    blocks = [
        child
        for lst in model.modules()
        if isinstance(lst, nn.ModuleList) and id(lst) not in inside
        for child in lst
        if id(child) not in inside
    ]
    in_blocks = {id(m) for block in blocks for m in block.modules()}
    # the experts of an expert mesh that has them whole (ep = world): no FSDP on them (nothing to
    # shard or average over efsdp), left out of the units around them
    whole = [p for layer in layers for p in layer.experts.parameters()] if ep > 1 and efsdp == 1 else []
    for layer in layers:
        if ep > 1 and efsdp > 1:
            local = layer.experts.num_experts // ep
            # torchtitan's rule: more FSDP ranks than local experts shard the second dimension
            dim = 1 if efsdp > local else 0
            fully_shard(layer.experts, mesh=mesh["efsdp"], shard_placement_fn=lambda p, d=dim: Shard(d), **mp)
            # before FSDP2's own hooks (prepended too): said while torch.compile traces into the bank
            layer.experts.register_forward_pre_hook(_say_the_experts_unit_breaks_the_graph, prepend=True)
            # the competition routers call these directly, not through __call__: without the
            # registration FSDP would not gather the weights and the bank would run on its shard
            for method in ("forward_all", "expert_forward"):
                register_fsdp_forward_method(layer.experts, method)
        router = layer.router.base_router  # the router router_dtype applies to (competesmoe's base)
        dtype = router.compute_dtype
        if mp and dtype is not None and any(True for _ in router.parameters()):
            # its own unit: gathered, run and reduced in its dtype whatever the policy of the rest
            # (the layer's unit would gather it in the policy's param_dtype, which router_dtype refuses)
            own = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, cast_forward_inputs=False)
            fully_shard(router, mesh=dp_mesh, mp_policy=own)
        # a layer inside a block is the block's (torchtitan's unit): no FSDP hooks inside a block,
        # so that a block compiled with torch.compile(fullgraph=True) traces
        if id(layer) not in in_blocks:
            fully_shard(layer, mesh=dp_mesh, ignored_params=_owned(layer, whole), **mp)
    for block in reversed(blocks):  # inner lists before the lists holding them
        fully_shard(block, mesh=dp_mesh, ignored_params=_owned(block, whole), **mp)
    fully_shard(model, mesh=dp_mesh, ignored_params=set(whole) or None, **mp)
    return model


def _say_the_experts_unit_breaks_the_graph(module: nn.Module, args: Any) -> None:
    """EP x FSDP2 with ``ep`` below the world size: the experts are an FSDP2 unit of their own, whose
    hooks torch.compile cannot trace; said once, at trace time (``comptime``), before it gives up."""
    if torch.compiler.is_compiling():
        from torch._dynamo.comptime import comptime

        comptime(_warn_experts_unit)


def _warn_experts_unit(_: Any = None) -> None:
    warnings.warn(
        "torch.compile meets the experts of a MoE layer under expert parallelism x FSDP2 with ep below the "
        "world size: they are an FSDP2 unit of their own, whose hooks it cannot trace, so they run eagerly "
        "between two graphs (a graph break; the training is right) and fullgraph=True fails there; "
        "compile without fullgraph, or use ep equal to the world size",
        stacklevel=2,
    )


def _owned(module: nn.Module, params: list[nn.Parameter]) -> set[nn.Parameter] | None:
    """Those of ``params`` that ``module`` holds (``fully_shard``'s ``ignored_params``)."""
    mine = {id(p) for p in module.parameters()}
    return {p for p in params if id(p) in mine} or None


def _is_dtensor(t: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _refuse_parallel(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for name, m in model.named_modules():
        if isinstance(m, (FSDPModule, ExpertParallelBank)) or any(
            _is_dtensor(p) for p in m.parameters(recurse=False)
        ):
            raise ValueError(
                f"module {name or 'model'!r} ({type(m).__name__}) is already parallel; parallelize applies "
                "expert parallelism and FSDP2 once, to a model that has neither"
            )


# ---------------------------------------------------------------------------- training helpers
def clip_grad_norm_(params: list[nn.Parameter], max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over a parallelized model: the norm of the whole model's
    gradient, each shard counted once (a collective per sharded gradient), the same factor on
    every rank.  Returns the norm before clipping (float32, on the CPU)."""
    total = torch.zeros((), dtype=torch.float64)
    grads = [p.grad for p in params if p.grad is not None]
    for g in grads:
        n = torch.linalg.vector_norm(g.detach(), dtype=torch.float64)
        if _is_dtensor(n):
            n = n.full_tensor()
        total = total + n.cpu() ** 2
    total = total.sqrt()
    coef = min(max_norm / (float(total) + 1e-6), 1.0)
    if coef < 1.0 and math.isfinite(coef):
        for g in grads:
            g.detach().mul_(coef)
    return total.float()


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The state dict of ``model`` with every sharded (``DTensor``) entry gathered to its full
    tensor, on every rank (a collective: every rank calls it); plain tensors as they are.  Save
    it from rank 0 with ``moelab.save(state, directory)``; it loads into the unsharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def load_full_state_dict(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Load the full (unsharded) ``state`` into the parallelized ``model``, each rank keeping its
    shards (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def full_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """``optimizer.state_dict()`` as the unsharded model's optimizer holds it (parameters by
    index, full tensors), whatever the layout (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    index = {}  # FQN -> position in the optimizer's param groups (torch's own numbering)
    groups = []
    for group in full["param_groups"]:
        ids = []
        for fqn in group["params"]:
            index.setdefault(fqn, len(index))
            ids.append(index[fqn])
        groups.append({**group, "params": ids})
    return {"state": {index[k]: v for k, v in full["state"].items()}, "param_groups": groups}


def load_full_optimizer_state(
    optimizer: torch.optim.Optimizer, model: nn.Module, full: dict[str, Any]
) -> None:
    """The inverse of :func:`full_optimizer_state`: load an unsharded optimizer state (a
    single-process checkpoint's, or one gathered by :func:`full_optimizer_state`) into the
    parallelized ``optimizer``, each rank keeping its shards (a collective)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    names = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    fqns = [fqn for group in names["param_groups"] for fqn in group["params"]]
    groups = [{**saved, "params": [fqns[i] for i in saved["params"]]} for saved in full["param_groups"]]
    state = {"state": {fqns[i]: v for i, v in full["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def save_sharded(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    ctx: RoutingContext | None = None,
) -> None:
    """Write the model (and optimizer) state to the folder ``path`` with
    ``torch.distributed.checkpoint.save``: every rank writes its own shards, nothing is gathered
    (a collective); the optimizer's param groups go to ``param_groups.pt`` (rank 0,
    ``torch.save``), so the shards hold tensors only, and the routing context — ``ctx``, default
    the one attached to the model's MoE layers: its step, planned steps and schedule, as
    :func:`moelab.save` records it — to ``routing.json`` (rank 0).  The routing state that lives in
    the model (a selection bias) is in its shards.  :func:`load_sharded` reads it on any layout and
    number of ranks."""
    import torch.distributed.checkpoint as dcp

    from ..io.atomic import atomic_write_json, atomic_write_torch

    ctx = _attached_context(model) if ctx is None else ctx
    state = _dcp_state(model, optimizer)
    groups = state.pop("param_groups", None)
    dcp.save(state, checkpoint_id=os.fspath(path))
    if not dist.is_initialized() or dist.get_rank() == 0:
        if groups is not None:
            atomic_write_torch(os.path.join(path, PARAM_GROUPS), groups)
        atomic_write_json(
            os.path.join(path, ROUTING), {"routing_context": None if ctx is None else ctx.state_dict()}
        )
    if dist.is_initialized():
        dist.barrier()  # the param groups are there before any rank reads the folder


def load_sharded(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    ctx: RoutingContext | None = None,
) -> None:
    """Read a :func:`save_sharded` folder into the parallelized ``model`` (and ``optimizer``),
    re-sharded to the layout at hand, whatever layout and number of ranks wrote it (a collective),
    and its routing context into ``ctx`` (default the one attached to the model): the run continues
    at the saved step of the same schedule.  Nothing is unpickled unrestricted
    (:mod:`moelab.io.sharded`): the index ``.metadata`` builds only DCP's metadata classes, a
    non-tensor entry is refused, the param groups are read with ``weights_only=True``.

    Raises:
        CheckpointError: the folder holds a routing context and the model has none attached (nor
            ``ctx``), the context's schedule is another (the run would compete at other steps), or
            the folder has no ``routing.json`` while the model has a context (a folder of an
            earlier moelab: the step it stopped at is unknown).
    """
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from ..errors import CheckpointError
    from ..io import sharded as dcp_io
    from ..io.atomic import read_json

    ctx = _attached_context(model) if ctx is None else ctx
    routing = os.path.join(path, ROUTING)
    saved = read_json(routing)["routing_context"] if os.path.isfile(routing) else None
    if ctx is not None and not os.path.isfile(routing):
        raise CheckpointError(
            f"checkpoint {os.fspath(path)} has no {ROUTING} and the model has a routing context (step "
            f"{ctx.step}); expected a folder of save_sharded, which records the step to continue from"
        )
    if saved is not None and ctx is None:
        raise CheckpointError(
            f"checkpoint {os.fspath(path)} holds the routing context of step {saved['step']} and the model has "
            "none; expected the run's context attached first (moelab.routing_context(model, total_steps, seed, "
            "...)) or passed as ctx="
        )
    if saved is not None:
        current = None if ctx.schedule is None else ctx.schedule.state_dict()
        if saved.get("schedule") != current:
            show = lambda d: d if d is None else dict(sorted(d.items()))  # JSON sorts the saved keys
            raise CheckpointError(
                f"checkpoint {os.fspath(path)} has routing schedule {show(saved.get('schedule'))}, this context "
                f"{show(current)}; expected the same schedule (same model, steps, seed and schedule options)"
            )
    state = _dcp_state(model, optimizer)
    groups = state.pop("param_groups", None)
    files = {f.name: "" for f in os.scandir(path) if f.is_file()}
    dcp_io.load(state, path, files, no_dist=not dist.is_initialized())
    if groups is not None:
        groups = torch.load(os.path.join(path, PARAM_GROUPS), weights_only=True)
    set_state_dict(
        model,
        [] if optimizer is None else optimizer,
        model_state_dict=state["model"],
        optim_state_dict={} if optimizer is None else {"state": state["optimizer"], "param_groups": groups},
    )
    if saved is not None:
        ctx.load_state_dict(saved)


#: the optimizer's param groups of a :func:`save_sharded` folder (the shards hold tensors only)
PARAM_GROUPS = "param_groups.pt"
#: the routing context of a :func:`save_sharded` folder (``RoutingContext.state_dict()``, JSON)
ROUTING = "routing.json"


def _attached_context(model: nn.Module) -> RoutingContext | None:
    return next((layer.ctx for layer in moe_layers(model) if layer.ctx is not None), None)


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {
        "model": model_state,
        "optimizer": optimizer_state["state"],
        "param_groups": optimizer_state["param_groups"],
    }
