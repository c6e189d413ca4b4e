"""Expert parallelism (DTensor experts, moelab.train.parallelize) on 2 and 4 gloo processes (CPU)
against the single-process layer, float64, with uneven shards and a rank holding no tokens."""

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import moelab
from moelab.experts import ExpertParallelBank, combine
from moelab.functional import competition_affinity
from moelab.train.parallelize import full_state_dict, parallelize

D = 8


def _shards(world: int) -> list[int]:
    return [0, 7, 3, 9][:world]  # uneven, and rank 0 has no tokens at all


def _data(seed: int, world: int) -> tuple[torch.Tensor, torch.Tensor, slice]:
    g = torch.Generator().manual_seed(seed)
    sizes = _shards(world)
    x = torch.randn(sum(sizes), D, generator=g, dtype=torch.float64)
    c = torch.randn(sum(sizes), D, generator=g, dtype=torch.float64)
    return x, c, sizes


def _mine(t: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
    start = sum(sizes[:rank])
    return t[start : start + sizes[rank]]


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return 0.0 if a.numel() == 0 else (a - b).abs().max().item()


def _block(bank: nn.Module) -> slice:
    _, E, r = bank._ep
    L = bank.num_experts // E
    return slice(r * L, (r + 1) * L)


def _local_grad(p: nn.Parameter, world: int) -> torch.Tensor:
    """This rank's block of a sharded expert gradient, times the world size: the bank scales it by
    1/W (the gradient of the mean of the ranks' losses); these checks sum the losses instead."""
    return p.grad.to_local() * world


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t


def _check_layer(rank: int, world: int, method: str) -> dict[str, float]:
    """Forward, input/router/expert gradients and the sharede-v3 bias update of one layer."""
    torch.manual_seed(0)
    # no aux loss: a training forward attaches it to the output, and a rank's balance is its shard's
    ref = moelab.MoE(D, 8, 2, d_hidden=6, method=method, impl="loop", balance_coef=0.0, z_coef=0.0).double()
    ep = copy.deepcopy(ref)
    x, c, sizes = _data(1, world)
    xr = x.clone().requires_grad_()
    y_ref = ref(xr)
    (y_ref * c).sum().backward()

    parallelize(ep, dp="none", ep=world)
    bank = ep.experts
    assert isinstance(bank, ExpertParallelBank)
    block = _block(bank)
    xs = _mine(x, sizes, rank).clone().requires_grad_()
    y = ep(xs)
    (y * _mine(c, sizes, rank)).sum().backward()
    out = {
        "y": _err(y, _mine(y_ref, sizes, rank)),
        "grad_x": _err(xs.grad, _mine(xr.grad, sizes, rank)),
        "grad_router": _err(_sum_over_ranks(ep.router.weight.grad), ref.router.weight.grad),
        "grad_w_in": _err(_local_grad(bank.w_in, world), ref.experts.w_in.grad[block]),
        "grad_w_out": _err(_local_grad(bank.w_out, world), ref.experts.w_out.grad[block]),
    }
    if ep.shared is not None:
        out["grad_shared"] = _err(_sum_over_ranks(ep.shared.fc_in.weight.grad), ref.shared.fc_in.weight.grad)
    if method == "sharede-v3":  # the aux-loss-free bias update (the step hook) sees the global loads
        ref.router.on_step()  # one process: the whole batch's load
        ep.router.on_step()  # this rank's load, summed over the ranks
        assert ref.router.selection_bias.abs().sum() > 0
        out["selection_bias"] = _err(ep.router.selection_bias, ref.router.selection_bias)
    return {f"{method}/{k}": v for k, v in out.items()}


def _check_forward_all(rank: int, world: int) -> dict[str, float]:
    """Competition's every-expert forward across ranks, with gradients."""
    torch.manual_seed(2)
    ref = moelab.ExpertBank(8, D, 5, activation="swiglu", bias=True, impl="loop").double()
    holder = moelab.MoE(D, 8, 2, experts=copy.deepcopy(ref))
    parallelize(holder, dp="none", ep=world)
    bank = holder.experts
    x, _, sizes = _data(3, world)
    c = torch.randn(x.shape[0], 8, D, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    xr = x.clone().requires_grad_()
    y_ref = ref.forward_all(xr)
    (y_ref * c).sum().backward()
    xs = _mine(x, sizes, rank).clone().requires_grad_()
    y = bank.forward_all(xs)
    (y * _mine(c, sizes, rank)).sum().backward()
    block = _block(bank)
    e = 5  # expert_forward is a collective too
    y_e = bank.expert_forward(_mine(x, sizes, rank), e)
    return {
        "forward_all/y": _err(y, _mine(y_ref, sizes, rank)),
        "forward_all/grad_x": _err(xs.grad, _mine(xr.grad, sizes, rank)),
        "forward_all/grad_w_in": _err(_local_grad(bank.w_in, world), ref.w_in.grad[block]),
        "forward_all/grad_b_out": _err(_local_grad(bank.b_out, world), ref.b_out.grad[block]),
        "expert_forward/y": _err(y_e, ref.expert_forward(_mine(x, sizes, rank), e).detach()),
    }


def _compete(bank: nn.Module, x: torch.Tensor, k: int) -> torch.Tensor:
    """The competition pattern of 001 eq. 4-5 as the ``compete`` routers run it: scores of every
    expert without autograd, then the winners' outputs with autograd through the bank."""
    with torch.no_grad():
        scores = competition_affinity(bank.forward_all(x))  # (T, N)
    winners = scores.topk(k, dim=-1).indices
    outs = bank.mix(x.repeat_interleave(k, dim=0), winners.reshape(-1, 1), x.new_ones(x.shape[0] * k, 1))
    outs = outs.view(x.shape[0], k, D)
    s = competition_affinity(outs)  # (T, K) the winners' affinities, with autograd
    return combine(outs, s / s.sum(-1, keepdim=True))


def _check_competition(rank: int, world: int) -> dict[str, float]:
    torch.manual_seed(7)
    ref = moelab.ExpertBank(8, D, 6, impl="loop").double()
    holder = moelab.MoE(D, 8, 2, experts=copy.deepcopy(ref))
    parallelize(holder, dp="none", ep=world)
    bank = holder.experts
    x, c, sizes = _data(8, world)
    (_compete(ref, x, 2) * c).sum().backward()
    y_ref = _compete(ref, x, 2).detach()
    xs = _mine(x, sizes, rank)
    y = _compete(bank, xs, 2)
    (y * _mine(c, sizes, rank)).sum().backward()
    block = _block(bank)
    return {
        "competition/y": _err(y, _mine(y_ref, sizes, rank)),
        "competition/grad_w_out": _err(_local_grad(bank.w_out, world), ref.w_out.grad[block]),
    }


def _check_ddp(rank: int, world: int) -> dict[str, float]:
    """DDP over the replicated parameters + expert parallelism = the gradient of the mean loss."""
    torch.manual_seed(5)
    # no aux loss: a training forward attaches it to the output, where its per-rank balance differs from
    # the whole batch's (the global balance scope is tested in test_balance.py)
    moe = moelab.MoE(D, 8, 2, method="smoe", impl="loop", balance_coef=0.0, z_coef=0.0)
    ref = nn.Sequential(nn.Linear(D, D), moe).double()
    model = copy.deepcopy(ref)
    x, c, sizes = _data(6, world)
    ((ref(x) * c).sum() / world).backward()

    ddp = parallelize(model, dp="ddp", ep=world)  # experts split over all ranks, DDP for the rest
    full = full_state_dict(model)
    state_err = max(_err(full[k], v) for k, v in ref.state_dict().items())
    assert set(full) == set(ref.state_dict())
    ignored = ddp.parameters_to_ignore
    assert sorted(ignored) == ["1.experts.w_in", "1.experts.w_out"]
    (ddp(_mine(x, sizes, rank)) * _mine(c, sizes, rank)).sum().backward()
    bank = model[1].experts
    block = _block(bank)
    return {
        "ddp/full_state_dict": state_err,
        "ddp/grad_linear": _err(model[0].weight.grad, ref[0].weight.grad),
        "ddp/grad_router": _err(model[1].router.weight.grad, ref[1].router.weight.grad),
        "ddp/grad_w_in": _err(bank.w_in.grad.to_local(), ref[1].experts.w_in.grad[block]),
    }


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results: dict = {}
        for method in ("smoe", "sharede-v3"):
            results.update(_check_layer(rank, world, method))
        results.update(_check_forward_all(rank, world))
        results.update(_check_competition(rank, world))
        results.update(_check_ddp(rank, world))
        try:
            parallelize(moelab.MoE(D, 7, 2), dp="none", ep=world)
            results["error"] = None
        except ValueError as exc:
            results["error"] = str(exc)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_the_single_process_layer(world, tmp_path):
    # fork: the children inherit the imported torch/moelab (spawn re-imports them: ~3x slower here);
    # each child sets one intra-op thread before any work, so the parent's thread pool is not reused
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _worker,
        args=(world, str(tmp_path / "init"), str(tmp_path)),
        nprocs=world,
        join=True,
        start_method=method,
    )
    for rank in range(world):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        error = results.pop("error")
        assert error == f"ep={world} does not divide num_experts=7 of MoE layer 0; allowed: [1]"
        assert len(results) == 23
        for name, err in results.items():
            assert err <= 1e-6, f"rank {rank}/{world}: {name} differs by {err}"


def test_expert_parallel_needs_an_initialised_process_group():
    with pytest.raises(ValueError, match=r"^parallelize needs torch\.distributed initialised"):
        parallelize(moelab.MoE(D, 4, 2), dp="none", ep=2)


@pytest.mark.slow
def test_the_scaling_doc_script_runs_under_torchrun(tmp_path):
    doc = (Path(__file__).resolve().parents[1] / "docs" / "scaling-parallelize.md").read_text()
    script = re.search(r"```python\n(# train_ep.py.*?)```", doc, re.S).group(1)
    (tmp_path / "train_ep.py").write_text(script)
    src = str(Path(moelab.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1", "OUT": str(tmp_path / "ckpt")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_ep.py"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "world 2: final loss" in out.stdout
    model = nn.Sequential(nn.Linear(32, 64), moelab.MoE(64, num_experts=8, top_k=2), nn.Linear(64, 10))
    assert moelab.io.load_weights(tmp_path / "ckpt", model)["metadata"] == {"step": 20, "world_size": 2}
