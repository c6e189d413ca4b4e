"""Parallelism from outside on gloo processes (CPU): FSDP2, expert parallelism and their
combinations against one process on the whole batch, float64."""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moelab
from moelab.train.distributed import apply_expert_parallel
from moelab.train.parallelize import full_state_dict

D = 8


def spawn(fn, world: int, tmp_path, *args) -> list[dict]:
    """Run ``fn(rank, world, *args) -> dict`` on ``world`` gloo processes; the dicts, by rank
    (fork: the children inherit the imported torch/moelab, as in tests/test_distributed.py)."""
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _worker, args=(world, str(tmp_path), fn, args), nprocs=world, join=True, start_method=method
    )
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _worker(rank: int, world: int, out: str, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/init", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _refusals(rank: int, world: int, out: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    result = {}
    torch.manual_seed(0)
    layer = moelab.MoE(D, 4, 2, method="smoe")
    apply_expert_parallel(layer)
    fully_shard(layer)  # the hand-written bank's blocks would be sharded as whole parameters
    try:
        layer(torch.randn(5, D))
        result["ep_then_fsdp"] = None
    except ValueError as exc:
        result["ep_then_fsdp"] = str(exc)
    torch.manual_seed(0)
    ref = moelab.MoE(D, 4, 2, method="xmoe")
    model = copy.deepcopy(ref)
    fully_shard(model)  # the learned temperature is no 0-dim parameter
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(1))
    result["xmoe_fsdp"] = (model(x) - ref(x)).abs().max().item()
    try:
        moelab.save(model, os.path.join(out, f"direct{rank}"))
        result["save"] = None
    except ValueError as exc:
        result["save"] = str(exc)
    state = full_state_dict(model)  # a collective
    if rank == 0:
        moelab.save(state, os.path.join(out, "full"))
    dist.barrier()
    fresh = moelab.MoE(D, 4, 2, method="xmoe")
    moelab.io.load_weights(os.path.join(out, "full"), fresh)
    result["saved_weights"] = max(
        (fresh.state_dict()[k] - v).abs().max().item() for k, v in ref.state_dict().items()
    )
    return result


def test_fsdp2_after_hand_written_expert_parallelism_is_refused_and_sharded_models_save_gathered(tmp_path):
    for rank, r in enumerate(spawn(_refusals, 2, tmp_path, str(tmp_path))):
        assert r["ep_then_fsdp"].startswith(
            "the experts of an ExpertParallelBank were replaced by a wrapper applied after expert parallelism"
        ), rank
        assert r["xmoe_fsdp"] <= 1e-6, rank
        assert r["save"] == (
            "state entry 'router.embeddings' is sharded (a DTensor: FSDP2 or expert parallelism); gather the full "
            "weights on every rank with moelab.train.parallelize.full_state_dict(model) and save that dict "
            "from rank 0"
        ), rank
        assert r["saved_weights"] == 0.0, rank
