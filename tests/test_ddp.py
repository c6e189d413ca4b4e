"""`moelab train` as a data-parallel group (what torchrun launches): 2 gloo processes on CPU.

Each process gets the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1,
MASTER_PORT) and runs ``moelab.cli.main`` exactly as the console script does.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import moelab
from moelab.cli import main
from moelab.data.text import load_text
from moelab.experiments import runner
from moelab.experiments.lm import TrainRun, build_model
from moelab.train.tasks import LMTask


def tiny_args(corpus, out, *extra):
    return [
        "train", "--data", str(corpus), "--size", "cpu", "--block-size", "16", "--batch-size", "8",
        "--num-experts", "4", "--steps", "6", "--eval-every", "3", "--ckpt-every", "3",
        "--eval-tokens", "64", "--test-tokens", "64", "--no-progress", "--out", str(out), *extra,
    ]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, argv: list[str], report: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    torch.cuda.is_available = lambda: False  # gloo even on a machine with a GPU
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    Path(report, f"rank{rank}.json").write_text(json.dumps({"code": code, "stderr": err.getvalue()}))


def launch(argv: list[str], tmp_path: Path, world: int = 2) -> list[dict]:
    """``torchrun --nproc_per_node=world moelab <argv>``, one process per rank (fork: the children
    inherit the imported torch/moelab, as in tests/test_distributed.py)."""
    report = tmp_path / f"report-{_free_port()}"
    report.mkdir()
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _rank_main,
        args=(world, _free_port(), argv, str(report)),
        nprocs=world,
        join=True,
        start_method=method,
    )
    return [json.loads((report / f"rank{r}.json").read_text()) for r in range(world)]


def read_log(out: Path) -> list[dict[str, str]]:
    with (out / "log.csv").open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize(
    "method",
    [
        ("--method", "smoe"),
        # competition on about half of the steps: a rank with another schedule would change the curve
        ("--method", "competesmoe", "--opt", "omega=0.5", "--opt", "competition_warmup=0"),
    ],
    ids=["smoe", "competesmoe"],
)
def test_two_ranks_with_half_batches_reproduce_one_rank_with_the_full_batch(corpus, tmp_path, method):
    # balance and z losses off: with them each rank balances its own tokens, a (deliberately)
    # different loss; the other losses are token means, the same over equal shards
    extra = (*method, "--opt", "balance_coef=0", "--opt", "z_coef=0")
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(tiny_args(corpus, one, *extra)) == 0
    assert [r["code"] for r in launch(tiny_args(corpus, two, *extra), tmp_path)] == [0, 0]

    log1, log2 = read_log(one), read_log(two)
    assert [r["step"] for r in log2] == [str(s) for s in range(1, 7)]  # one writer: no duplicate rows
    losses1 = [float(r["loss"]) for r in log1]
    losses2 = [float(r["loss"]) for r in log2]
    for step, (a, b) in enumerate(zip(losses1, losses2), 1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: 1 rank {a}, 2 ranks {b}"
    for step, (a, b) in enumerate(zip(log1, log2), 1):  # the gradients agree too (clipping sees them)
        assert float(a["grad_norm"]) == pytest.approx(float(b["grad_norm"]), rel=1e-4), step
        assert a["tokens"] == b["tokens"]
    assert losses1[-1] < losses1[0]  # it trains

    m1 = json.loads((one / "metrics.json").read_text())
    m2 = json.loads((two / "metrics.json").read_text())
    assert (m1["world_size"], m2["world_size"]) == (1, 2)
    assert m2["test_bpc"] == pytest.approx(m1["test_bpc"], rel=1e-4)
    assert [p.name for p in sorted((two / "ckpt").iterdir())] == ["step-00000003", "step-00000006"]


@pytest.mark.parametrize(
    "layout",
    [(), pytest.param(("--expert-parallel",), marks=pytest.mark.slow)],
    ids=["ddp", "expert-parallel"],
)
def test_two_ranks_with_global_balance_reproduce_one_rank_with_the_full_batch(corpus, tmp_path, layout):
    # balance_scope=global: the balance (and importance) of the step's tokens on every rank, so the
    # aux losses stay on and the curves are still those of one process on the whole batch
    extra = ("--opt", "balance_scope=global", "--opt", "importance_coef=0.1", "--opt", "z_coef=0")
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(tiny_args(corpus, one, *extra)) == 0
    assert [r["code"] for r in launch(tiny_args(corpus, two, *extra, *layout), tmp_path)] == [0, 0]
    for step, (a, b) in enumerate(zip(read_log(one), read_log(two)), 1):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-4), (step, key)
    assert float(read_log(one)[0]["aux_loss"]) > 0


def test_each_rank_adds_the_aux_loss_of_its_own_tokens(corpus, tmp_path):
    out = tmp_path / "run"
    argv = tiny_args(corpus, out, "--steps", "1", "--ckpt-every", "0")
    assert [r["code"] for r in launch(argv, tmp_path)] == [0, 0]
    row = read_log(out)[0]

    # the first step by hand: same seed → same initial weights and the same global batch
    config, _ = runner.read_run_config(TrainRun, out, "train")
    data = load_text(str(corpus))
    torch.manual_seed(0)
    model = build_model(config, data.vocab_size)
    task = LMTask(data, 16)
    batch = task.sample(torch.Generator().manual_seed(1), 8)
    task_losses, aux_losses = [], []
    for rank in range(2):
        loss, _ = task.loss(model, task.shard(batch, rank, 2))
        task_losses.append(loss.item())
        aux_losses.append(moelab.aux_loss(model).item())
    full_task, _ = task.loss(model, batch)
    full_aux = moelab.aux_loss(model).item()
    assert float(row["loss"]) == pytest.approx(sum(task_losses) / 2, rel=1e-6)
    assert float(row["loss"]) == pytest.approx(full_task.item(), rel=1e-6)  # the mean of equal shards
    assert float(row["aux_loss"]) == pytest.approx(sum(aux_losses) / 2, rel=1e-6)
    assert abs(full_aux - sum(aux_losses) / 2) > 1e-6  # per-rank balancing is not the global one


def test_a_resumed_two_rank_run_continues_the_same_curve(corpus, tmp_path):
    out = tmp_path / "run"
    assert [r["code"] for r in launch(tiny_args(corpus, out), tmp_path)] == [0, 0]
    full = read_log(out)
    # as if killed after the step-3 checkpoint: the last checkpoint and the end are gone
    shutil.rmtree(out / "ckpt" / "step-00000006")
    (out / "metrics.json").unlink()
    assert [r["code"] for r in launch([*tiny_args(corpus, out), "--resume"], tmp_path)] == [0, 0]
    resumed = read_log(out)
    assert [r["step"] for r in resumed] == [str(s) for s in range(1, 7)]
    for a, b in zip(full, resumed):
        assert {k: v for k, v in a.items() if k != "time_s"} == {k: v for k, v in b.items() if k != "time_s"}
    assert json.loads((out / "metrics.json").read_text())["world_size"] == 2


def test_a_world_size_that_does_not_divide_the_batch_exits_2(corpus, tmp_path):
    reports = launch(tiny_args(corpus, tmp_path / "run", "--batch-size", "5"), tmp_path)
    for r in reports:
        assert r["code"] == 2
        assert "--batch-size=5 is not allowed with 2 processes" in r["stderr"]
        assert "use a multiple of 2" in r["stderr"]
    assert not (tmp_path / "run").exists()  # nothing was written


def test_world_size_without_the_other_torchrun_variables_is_refused(monkeypatch):
    from moelab.train.distributed import init_from_env

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="WORLD_SIZE is set but RANK is not; launch with torchrun"):
        init_from_env()
    monkeypatch.delenv("WORLD_SIZE")
    assert init_from_env() == (0, 1)  # a plain process: nothing to initialise


@pytest.mark.parametrize(
    "method",
    [
        ("--method", "smoe"),
        # competition runs every expert on every token: forward_all across the ranks
        ("--method", "competesmoe", "--opt", "omega=0.5", "--opt", "competition_warmup=0"),
    ],
    ids=["smoe", "competesmoe"],
)
def test_expert_parallel_training_follows_the_data_parallel_curve(corpus, tmp_path, method):
    dp, ep = tmp_path / "dp", tmp_path / "ep"
    assert [r["code"] for r in launch(tiny_args(corpus, dp, *method), tmp_path)] == [0, 0]
    assert [r["code"] for r in launch(tiny_args(corpus, ep, *method, "--expert-parallel"), tmp_path)] == [
        0,
        0,
    ]
    log_dp, log_ep = read_log(dp), read_log(ep)
    assert len(log_ep) == 6
    for step, (a, b) in enumerate(zip(log_dp, log_ep), 1):  # same losses, same (global) gradient norm
        for key in ("loss", "aux_loss", "grad_norm"):
            assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-4), (step, key)
    m_dp = json.loads((dp / "metrics.json").read_text())
    m_ep = json.loads((ep / "metrics.json").read_text())
    assert m_ep["params"] == m_dp["params"]  # the whole model, not one rank's block
    assert m_ep["test_bpc"] == pytest.approx(m_dp["test_bpc"], rel=1e-4)
    # the checkpoints are each rank's shards (torch.distributed.checkpoint): gathered, they load into a plain model
    config, _ = runner.read_run_config(TrainRun, ep, "train")
    model = build_model(config, load_text(str(corpus)).vocab_size)
    from moelab.train.checkpoint import load_checkpoint

    saved = load_checkpoint(ep / "ckpt" / "step-00000006", model)
    ref = build_model(config, load_text(str(corpus)).vocab_size)
    load_checkpoint(dp / "ckpt" / "step-00000006", ref)
    w_ep, w_dp = model.state_dict(), ref.state_dict()
    assert max((w_ep[k] - w_dp[k]).abs().max().item() for k in w_dp) < 1e-4
    expert_w = [k for k in w_ep if k.endswith("experts.w_in")]
    assert expert_w and all(w_ep[k].shape[0] == 4 for k in expert_w)
    moments = [v["exp_avg"] for v in saved["optimizer"]["state"].values()]
    assert sorted(m.shape for m in moments) == sorted(p.shape for p in model.parameters() if p.requires_grad)


def test_a_resumed_expert_parallel_run_continues_the_same_curve(corpus, tmp_path):
    out = tmp_path / "run"
    argv = tiny_args(corpus, out, "--expert-parallel")
    assert [r["code"] for r in launch(argv, tmp_path)] == [0, 0]
    full = read_log(out)
    shutil.rmtree(out / "ckpt" / "step-00000006")
    (out / "metrics.json").unlink()
    assert [r["code"] for r in launch([*argv, "--resume"], tmp_path)] == [0, 0]
    for a, b in zip(full, read_log(out)):
        assert {k: v for k, v in a.items() if k != "time_s"} == {k: v for k, v in b.items() if k != "time_s"}


def _rank_trainer(rank: int, world: int, port: int, corpus: str, report: str) -> None:
    """A Trainer with parallel=ExpertParallel() on one rank; reports what the plan made of the model."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    from moelab.layer import moe_layers
    from moelab.models.lm import LMConfig, TransformerLM
    from moelab.train import TrainConfig, Trainer
    from moelab.train.parallel import ExpertParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        data = load_text(corpus)
        torch.manual_seed(0)
        cfg = LMConfig(
            vocab_size=data.vocab_size, block_size=16, n_layer=2, d_model=32, n_head=2, num_experts=4
        )
        model = TransformerLM(cfg)
        trainer = Trainer(
            model, LMTask(data, 16), TrainConfig(steps=2, batch_size=4, eval_every=2, eval_tokens=32),
            progress=False, parallel=ExpertParallel(),
        )  # fmt: skip
        metrics = trainer.fit()
        banks = [layer.experts for layer in moe_layers(model)]
        sharded = [b.w_in for b in banks if isinstance(b.w_in, DTensor)]
        from moelab.train.parallelize import full_state_dict

        full = full_state_dict(model)  # a collective: the plain model's names, full tensors
        names = [n for n, p in model.named_parameters() if isinstance(p, DTensor) and n.endswith("w_in")]
        result = {
            "banks": [type(b).__name__ for b in banks],
            "placements": [list(w.placements) == [Shard(0)] for w in sharded],
            "local": [list(w.to_local().shape) for w in sharded],
            # this rank's block is experts [2r, 2r + 2) of the full model's
            "blocks": [
                torch.equal(w.to_local(), full[n][2 * rank : 2 * rank + 2]) and full[n].shape[0] == 4
                for w, n in zip(sharded, names)
            ],
            "params": metrics["params"],
            "full_params": sum(p.numel() for p in TransformerLM(cfg).parameters()),
        }
        Path(report, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_the_trainer_spreads_the_experts_over_the_ranks(corpus, tmp_path):
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _rank_trainer,
        args=(2, _free_port(), str(corpus), str(tmp_path)),
        nprocs=2,
        join=True,
        start_method=method,
    )
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["banks"] == ["ExpertParallelExpertBank"] * 2
        assert r["placements"] == [True, True]  # DTensor Shard(0) over the experts
        assert [shape[0] for shape in r["local"]] == [2, 2]  # 2 of the 4 experts on each rank
        assert r["blocks"] == [True, True]  # experts [2r, 2r + 2) of 4
        assert r["params"] == r["full_params"]  # metrics count the whole model


def test_expert_parallel_with_a_world_size_that_does_not_divide_the_experts_exits_2(corpus, tmp_path):
    argv = tiny_args(corpus, tmp_path / "run", "--expert-parallel", "--num-experts", "3")
    for r in launch(argv, tmp_path):
        assert r["code"] == 2
        assert "world size 2 does not divide num_experts=3; allowed world sizes: [1, 3]" in r["stderr"]
    assert not (tmp_path / "run").exists()  # nothing was written


def test_expert_parallel_needs_torchrun_and_the_refusal_names_the_flag_to_drop(corpus, tmp_path, capsys):
    """Once "expert parallelism needs torch.distributed initialised (... init_process_group first)",
    which a CLI user does not call, after config.yaml was written (the retry without the flag was
    refused: --out holds a run): now the flag to drop, before any file, and the retry runs."""
    out = tmp_path / "run"
    assert main(tiny_args(corpus, out, "--expert-parallel")) == 2
    assert capsys.readouterr().err == (
        "moelab train: error: --expert-parallel is not allowed on one process (no torchrun): it splits the "
        "model over the ranks torchrun launches; launch with torchrun --nproc_per_node=N (docs/scaling.md), or "
        "drop --expert-parallel to train on one process\n"
    )
    assert not (out / "config.yaml").exists()
    assert main([*tiny_args(corpus, out), "--steps", "1"]) == 0


# balance and z losses off: each rank balances its own tokens, so another number of ranks trains
# another objective with them; without them every layout computes the one-process gradient
_TOKEN_MEANS = ("--opt", "balance_coef=0", "--opt", "z_coef=0")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("--fsdp",), ("--fsdp", "--expert-parallel")], ids=["fsdp", "ep-fsdp"])
def test_fsdp2_training_follows_the_data_parallel_curve(corpus, tmp_path, layout):
    dp, sharded = tmp_path / "dp", tmp_path / "sharded"
    assert [r["code"] for r in launch(tiny_args(corpus, dp, *_TOKEN_MEANS), tmp_path)] == [0, 0]
    assert [r["code"] for r in launch(tiny_args(corpus, sharded, *_TOKEN_MEANS, *layout), tmp_path)] == [0, 0]
    for step, (a, b) in enumerate(zip(read_log(dp), read_log(sharded)), 1):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-4), (step, key)
    m_dp = json.loads((dp / "metrics.json").read_text())
    m_sh = json.loads((sharded / "metrics.json").read_text())
    assert m_sh["params"] == m_dp["params"] and m_sh["test_bpc"] == pytest.approx(m_dp["test_bpc"], rel=1e-4)


@pytest.mark.slow
def test_a_checkpoint_of_two_ranks_resumes_on_four_with_the_same_numbers(corpus, tmp_path):
    # written by 2 ranks (experts split in 2, FSDP2), resumed by 4 (experts split in 4): the
    # checkpoint holds each rank's shards of the model and Adam state (torch.distributed.checkpoint),
    # re-sharded on load
    out = tmp_path / "run"
    argv = tiny_args(corpus, out, *_TOKEN_MEANS, "--fsdp", "--expert-parallel")
    assert [r["code"] for r in launch(argv, tmp_path, world=2)] == [0, 0]
    two = read_log(out)
    shutil.rmtree(out / "ckpt" / "step-00000006")
    (out / "metrics.json").unlink()
    assert [r["code"] for r in launch([*argv, "--resume"], tmp_path, world=4)] == [0] * 4
    four = read_log(out)
    assert [r["step"] for r in four] == [str(s) for s in range(1, 7)]
    for a, b in zip(two[:3], four[:3]):  # the log up to the checkpoint, as written
        assert a == b
    for a, b in zip(two[3:], four[3:]):  # steps 4-6 again, on 4 ranks: the same to rounding
        for key in ("loss", "aux_loss", "grad_norm"):
            assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-5), (a["step"], key)
    assert json.loads((out / "metrics.json").read_text())["world_size"] == 4


def test_a_sharded_run_resumed_without_torchrun_continues_on_one_process(capsys):
    """``moelab train --resume`` of a ``--fsdp --expert-parallel`` run on one process once refused with
    "expert parallelism needs torch.distributed initialised" (the flags come back from config.yaml):
    now it continues as one process (the checkpoint's shards gathered, as the Python API does) and
    says so once; a new run with the flags is refused naming them."""
    from moelab.errors import UsageError
    from moelab.experiments.lm import _layout
    from moelab.train.parallel import Parallel

    config = TrainRun(fsdp=True, expert_parallel=True)
    layout = _layout(config, resume=True)
    assert type(layout) is Parallel
    assert capsys.readouterr().err == (
        "moelab train: --resume of a --fsdp --expert-parallel run on one process (no torchrun): its sharded "
        "checkpoint is gathered here and the run continues on one process (the batch is no longer split over "
        "ranks: per-rank terms such as the balance loss are taken over the whole batch)\n"
    )
    with pytest.raises(UsageError, match=r"^--fsdp --expert-parallel are not allowed on one process"):
        _layout(config, resume=False)  # a new run: the flags to drop (test_fsdp_needs_torchrun)
    assert type(_layout(TrainRun(), resume=True)) is Parallel and capsys.readouterr().err == ""


@pytest.mark.slow
def test_a_run_of_two_expert_parallel_fsdp2_ranks_resumes_on_one_process_from_the_cli(
    corpus, tmp_path, capsys
):
    # written by 2 ranks (experts split in 2, FSDP2), resumed by `moelab train --resume` without torchrun:
    # the same steps to rounding (token means: the one process computes what the ranks' mean computes)
    out = tmp_path / "run"
    argv = tiny_args(corpus, out, *_TOKEN_MEANS, "--fsdp", "--expert-parallel")
    assert [r["code"] for r in launch(argv, tmp_path, world=2)] == [0, 0]
    two = read_log(out)
    shutil.rmtree(out / "ckpt" / "step-00000006")
    (out / "metrics.json").unlink()
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert "continues on one process" in capsys.readouterr().err
    one = read_log(out)
    assert [r["step"] for r in one] == [str(s) for s in range(1, 7)] and one[:3] == two[:3]
    for a, b in zip(two[3:], one[3:]):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-4), (a["step"], key)
    assert json.loads((out / "metrics.json").read_text())["world_size"] == 1


def test_the_trainers_sharded_layouts_need_a_process_group():
    from moelab.train.parallel import ExpertParallel, Parallelized

    for layout, what in ((ExpertParallel(), "expert parallelism"), (Parallelized(ep=1, fsdp=True), "FSDP2")):
        with pytest.raises(ValueError) as err:
            layout.apply(moelab.MoE(8, 4, 2))
        assert str(err.value) == (
            f"{what} needs torch.distributed initialised (launch with torchrun and call "
            "torch.distributed.init_process_group first)"
        )


def test_fsdp_needs_torchrun(corpus, tmp_path, capsys):
    assert main(tiny_args(corpus, tmp_path / "run", "--fsdp", "--expert-parallel")) == 2
    assert capsys.readouterr().err == (
        "moelab train: error: --fsdp --expert-parallel are not allowed on one process (no torchrun): they split "
        "the model over the ranks torchrun launches; launch with torchrun --nproc_per_node=N (docs/scaling.md), "
        "or drop --fsdp --expert-parallel to train on one process\n"
    )
