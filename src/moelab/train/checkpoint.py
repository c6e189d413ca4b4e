"""Training checkpoints: a :func:`moelab.save` folder (so :func:`moelab.load` opens one like any saved
model) plus ``state.pt`` with the optimizer, scheduler, routing-context, RNG and counter state,
written atomically by the one atomic writer, the newest ``keep`` kept; :func:`latest_checkpoint`
verifies the digests and falls back to the newest good one.  docs/errors-files.md ("Training
checkpoints") gives the layout, what a kill or a failed write leaves and the refusals.

A sharded run (FSDP2 / expert parallelism) writes the same folder with its model and optimizer
tensors as ``torch.distributed.checkpoint`` shards instead of ``model.safetensors``
(:func:`save_sharded_checkpoint`: every rank writes its own, nothing is gathered), listed with their
sha256 in ``config.json``; :func:`load_sharded_checkpoint` reads them re-sharded to any layout and
number of ranks, :func:`load_checkpoint` and :func:`moelab.load` gather them on one process
(:mod:`moelab.io.sharded`: nothing in them is unpickled unrestricted).  docs/scaling-checkpoints.md.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from ..io import sharded as dcp_io
from ..io.atomic import atomic_directory, fsync_dir, record_write, sha256_file, write_event
from ..io.model import CONFIG_NAME, list_checkpoints, load_weights, read_config, save
from ..io.model import latest_checkpoint as _latest_verified

__all__ = [
    "CheckpointError",
    "is_sharded",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_sharded_checkpoint",
    "save_checkpoint",
    "save_sharded_checkpoint",
    "verify_checkpoint",
]

STATE = "state.pt"


def save_checkpoint(
    root: str | os.PathLike, step: int, model: nn.Module, state: dict[str, Any], keep: int = 2
) -> Path:
    """Write checkpoint ``root/step-{step:08d}`` atomically and keep the newest ``keep``.

    ``state`` (tensors, numbers, strings, containers) goes to ``state.pt``; its ``"ctx"`` entry,
    when given, is the routing context recorded in ``config.json`` (else the model's own).
    """
    root = Path(root)
    final = root / f"step-{step:08d}"
    buffer = io.BytesIO()
    torch.save(state, buffer)
    ctx = _context(state, model)
    try:
        with atomic_directory(final) as tmp:
            save(model, tmp, ctx=ctx, metadata={"step": step}, extra_files={STATE: buffer.getvalue()})
    except OSError as exc:  # a full disk, a quota, a read-only folder: keep what is there
        kept = [p.name for p in list_checkpoints(root)]
        raise CheckpointError(
            f"cannot write checkpoint {final}: {exc.strerror or exc}; the previous checkpoints are kept "
            f"({', '.join(kept) or 'none'}); free disk space and run again with --resume"
        ) from exc
    _keep_newest(root, keep)
    return final


def _context(state: dict[str, Any], model: nn.Module) -> Any:
    from ..routing import RoutingContext

    if not isinstance(state.get("ctx"), dict):
        return None
    ctx = RoutingContext(step=int(state["ctx"]["step"]), total_steps=state["ctx"].get("total_steps"))
    ctx.schedule = _schedule_of(model)
    return ctx


def _keep_newest(root: Path, keep: int) -> None:
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def save_sharded_checkpoint(
    root: str | os.PathLike,
    step: int,
    structure: nn.Module,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write checkpoint ``root/step-{step:08d}`` of a sharded run; a collective (every rank calls it).

    Every rank writes its own shards of ``model``'s and ``optimizer``'s tensors with
    ``torch.distributed.checkpoint`` (``.metadata`` + ``__{rank}_0.distcp``) into a temporary
    folder; rank 0 then adds ``state.pt`` (``state`` and the optimizer's param groups, by
    parameter name) and ``config.json`` (``structure``: the unsharded model, for its kind, config and
    dtype; the sha256 of every file) and renames the folder into place.  A failure on any rank is
    one :class:`CheckpointError` on every rank.  The newest ``keep`` checkpoints are kept.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = Path(root)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-{final.name}"

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):  # left by a killed write
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()

    _on_rank0(prepare, final)  # every rank waits for a clean folder
    model_state, optim_state = get_state_dict(model, optimizer)
    tensors = {"model": model_state, "optimizer": optim_state["state"]}
    try:
        with warnings.catch_warnings():  # one process: DCP's "assuming a single process" is meant
            if _rank_count() == 1:
                warnings.simplefilter("ignore", UserWarning)
            dcp.save(
                tensors,
                storage_writer=dcp.FileSystemWriter(os.fspath(tmp), thread_count=1),
                no_dist=_rank_count() == 1,
            )
    except (Exception, CheckpointException) as exc:  # DCP reports one rank's failure on every rank
        cause = dcp_io.reason(exc)
        why = cause.strerror if isinstance(cause, OSError) and cause.strerror else dcp_io.describe(cause)
        raise CheckpointError(f"cannot write checkpoint {final}: {why}{_kept(root)}") from None
    groups = optim_state["param_groups"]

    def finish() -> None:
        buffer = io.BytesIO()
        torch.save({**state, "optimizer_groups": groups}, buffer)
        shards = {f.name: sha256_file(f) for f in sorted(tmp.iterdir()) if f.is_file()}
        save(structure, tmp, ctx=_context(state, structure), metadata={"step": step},
             extra_files={STATE: buffer.getvalue()}, sharded_files=shards)  # fmt: skip
        fsync_dir(tmp)
        write_event()
        record_write(final, folder=True)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
        _keep_newest(root, keep)

    _on_rank0(finish, final)
    return final


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _rank_count() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _kept(root: Path) -> str:
    kept = [p.name for p in list_checkpoints(root)]
    return (
        f"; the previous checkpoints are kept ({', '.join(kept) or 'none'}); free disk space and run "
        "again with --resume"
    )


def _on_rank0(fn: Any, final: Path) -> None:
    """Run ``fn`` on rank 0 and tell every rank how it went (an error on rank 0 is raised
    everywhere, not left for the others to hang on)."""
    dist = torch.distributed
    error = None
    if _rank() == 0:
        try:
            fn()
        except Exception as exc:  # a full disk, a quota, a read-only folder: every rank is told
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else dcp_io.describe(exc)
            error = f"cannot write checkpoint {final}: {why}{_kept(final.parent)}"
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise CheckpointError(error)


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether checkpoint ``path`` (verified by the caller: :func:`latest_checkpoint`) holds its
    weights as DCP shards; reads the one field, without hashing the files again."""
    try:
        config = json.loads((Path(path) / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("weights") == dcp_io.SHARDED


def load_sharded_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]
) -> None:
    """Read the shards of the sharded checkpoint ``path`` into the (parallelized) ``model`` and
    ``optimizer``, re-sharded to their layout whatever layout and number of ranks wrote them, and
    give the optimizer the saved param ``groups`` (``state.pt``'s ``"optimizer_groups"``); a
    collective.  The folder is verified first (its digests)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    config = read_config(path)
    model_state, optim_state = get_state_dict(model, optimizer)  # the layout's tensors, filled below
    names = [list(g["params"]) for g in optim_state["param_groups"]]
    if [list(g.get("params", [])) for g in groups] != names:
        raise CheckpointError(
            f"checkpoint {path} has optimizer groups of other parameters (saved: groups of "
            f"{[len(g.get('params', [])) for g in groups]} parameters, here: {[len(n) for n in names]}); it "
            "was written for another model or another trainable set"
        )
    dist = torch.distributed
    dcp_io.load(
        {"model": model_state, "optimizer": optim_state["state"]},
        path,
        config["files"],
        no_dist=not (dist.is_available() and dist.is_initialized()),
    )
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict={"state": optim_state["state"], "param_groups": groups},
    )


def _full_optimizer(path: Path, files: dict[str, str], groups: list[dict[str, Any]]) -> dict[str, Any]:
    """The optimizer state of a sharded checkpoint as an unsharded optimizer holds it
    (``optimizer.state_dict()``: parameters by index), gathered on this process."""
    full = dcp_io.read_tensors(path, files, "optimizer.")
    fqns = [fqn for g in groups for fqn in g["params"]]
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, fqn in enumerate(fqns):  # "{fqn}.{name}": a name has no dot, a parameter's FQN may
        prefix = f"{fqn}."
        values = {
            k[len(prefix) :]: v
            for k, v in full.items()
            if k.startswith(prefix) and "." not in k[len(prefix) :]
        }
        if values:
            state[i] = values
    index = {fqn: i for i, fqn in enumerate(fqns)}
    return {
        "state": state,
        "param_groups": [{**g, "params": [index[f] for f in g["params"]]} for g in groups],
    }


def _schedule_of(model: nn.Module) -> Any:
    from ..layer import moe_layers

    return next((layer.ctx.schedule for layer in moe_layers(model) if layer.ctx is not None), None)


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Raise :class:`CheckpointError` naming the file when ``path`` is incomplete or corrupted."""
    path = Path(path)
    if not (path / CONFIG_NAME).is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: {path / CONFIG_NAME} is missing")
    config = read_config(path)
    if STATE not in config.get("files", {}):
        raise CheckpointError(
            f"checkpoint {path} has no {STATE}; it is a saved model, not a training checkpoint"
        )


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest training checkpoint under ``root`` that verifies (model files and ``state.pt``);
    a bad one is skipped with a warning naming its file.  ``None`` when there is none."""
    return _latest_verified(root, verify_checkpoint)


def load_checkpoint(path: str | os.PathLike, model: nn.Module) -> dict[str, Any]:
    """Verify checkpoint ``path``, load its weights into ``model`` and return its training state
    (``torch.load(..., weights_only=True)``); a sharded checkpoint's weights and optimizer state
    are gathered on this process (``"optimizer"`` then holds the full state, as an unsharded
    run's)."""
    path = Path(path)
    verify_checkpoint(path)
    config = load_weights(path, model)
    state = torch.load(path / STATE, weights_only=True)
    if config.get("weights") == dcp_io.SHARDED:
        state["optimizer"] = _full_optimizer(path, config["files"], state.pop("optimizer_groups"))
    return state
