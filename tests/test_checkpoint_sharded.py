"""Sharded training checkpoints (torch.distributed.checkpoint) of a Trainer under expert parallelism
x FSDP2, on gloo processes (CPU): each rank writes its shards, a resume at the same world size is
bit-identical, a resume at another world size re-shards, and the folder verifies like any saved model."""

from __future__ import annotations

import copy
import csv
import hashlib
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moelab
from moelab.data.text import load_text
from moelab.errors import CheckpointError
from moelab.io.model import CONFIG_NAME, _canonical
from moelab.train.checkpoint import latest_checkpoint, load_checkpoint, verify_checkpoint

STEPS = 4


def _spawn(fn, world: int, out: Path, *args) -> None:
    """``fn(rank, world, *args)`` on ``world`` gloo processes joined by a file store (no TCP port)."""
    out.mkdir(parents=True, exist_ok=True)
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _worker, args=(world, str(out), fn, args), nprocs=world, join=True, start_method=method
    )


def _worker(rank: int, world: int, out: str, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/init", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def _fit(run: str, corpus: str, seed: int, resume: bool) -> None:
    """The Trainer of a 2-layer LM with ``--fsdp --expert-parallel``; ``seed`` only changes the
    initial weights (a resume must take every weight from the checkpoint)."""
    from moelab.io.rundir import RunDir
    from moelab.models.lm import LMConfig, TransformerLM
    from moelab.train import TrainConfig, Trainer
    from moelab.train.parallel import Parallelized
    from moelab.train.tasks import LMTask

    data = load_text(corpus)
    torch.manual_seed(seed)
    # token means and no dropout: every world size trains one objective on the same numbers
    options = {"balance_coef": 0.0, "z_coef": 0.0}
    cfg = LMConfig(vocab_size=data.vocab_size, block_size=16, n_layer=2, d_model=16, n_head=2, num_experts=4, dropout=0.0,
                   method_options=options)  # fmt: skip
    config = TrainConfig(steps=STEPS, batch_size=8, eval_every=STEPS, eval_tokens=32, test_tokens=32,
                         ckpt_every=2, keep_ckpts=0, keep_best=False)  # fmt: skip
    rank = dist.get_rank()  # as moelab's runner: rank 0 holds the run's lock
    rundir = RunDir(Path(run), resume=resume or rank > 0, lock=rank == 0)
    # EP x FSDP2: the experts split over every rank, every parameter sharded
    trainer = Trainer(TransformerLM(cfg), LMTask(data, 16), config, rundir, progress=False,
                      parallel=Parallelized(fsdp=True))  # fmt: skip
    trainer.fit(resume=resume)


def _train_and_resume(rank: int, world: int, run: str, corpus: str) -> None:
    _fit(run, corpus, 0, False)
    if rank == 0:  # as if killed after the step-2 checkpoint (config.yaml: what the CLI writes)
        Path(run, "config.yaml").write_text("steps: 4\n")
        shutil.copytree(Path(run), Path(run + "-full"))
        shutil.rmtree(Path(run, "ckpt", "step-00000004"))
        Path(run, "metrics.json").unlink()
    dist.barrier()
    _fit(run, corpus, 1, True)


def _resume(rank: int, world: int, run: str, corpus: str) -> None:
    _fit(run, corpus, 2, True)


def _log(run: Path) -> list[dict[str, str]]:
    with (run / "log.csv").open(newline="") as f:
        return [{k: v for k, v in row.items() if k != "time_s"} for row in csv.DictReader(f)]


@pytest.fixture(scope="module")
def two_rank_run(corpus, tmp_path_factory) -> Path:
    """A 2-rank run of 4 steps, and the same run resumed from its step-2 checkpoint (``run``)
    beside the uninterrupted one (``run-full``)."""
    tmp = tmp_path_factory.mktemp("sharded")
    _spawn(_train_and_resume, 2, tmp / "procs", str(tmp / "run"), str(corpus))
    return tmp / "run"


def test_each_rank_writes_its_shards_and_the_manifest_lists_them(two_rank_run):
    full = two_rank_run.parent / "run-full"
    for step in ("step-00000002", "step-00000004"):
        folder = full / "ckpt" / step
        names = sorted(p.name for p in folder.iterdir())
        assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", CONFIG_NAME, "state.pt"]
        config = json.loads((folder / CONFIG_NAME).read_text())
        assert config["weights"] == "dcp" and sorted(config["files"]) == [
            n for n in names if n != CONFIG_NAME
        ]
        verify_checkpoint(folder)


def test_a_sharded_checkpoint_resumes_bit_identically_at_the_same_world_size(two_rank_run):
    full, resumed = _log(two_rank_run.parent / "run-full"), _log(two_rank_run)
    assert [r["step"] for r in resumed] == [str(s) for s in range(1, STEPS + 1)]
    assert resumed == full  # losses, aux terms, gradient norms: the same bits
    assert full[2]["loss"] != full[1]["loss"]


def test_moelab_load_gathers_a_sharded_checkpoint_on_one_process(two_rank_run):
    folder = two_rank_run.parent / "run-full" / "ckpt" / "step-00000004"
    model = moelab.load(folder)  # every rank's shards, gathered without a process group
    assert type(model).__name__ == "TransformerLM"
    other = copy.deepcopy(model)  # other weights, then the checkpoint's through load_checkpoint
    with torch.no_grad():
        for p in other.parameters():
            p.normal_()
    state = load_checkpoint(folder, other)
    for k, v in model.state_dict().items():
        assert torch.equal(v, other.state_dict()[k]), k
    experts = [k for k in model.state_dict() if k.endswith("experts.w_in")]
    assert experts and all(model.state_dict()[k].shape[0] == 4 for k in experts)  # all 4 experts
    moments = [v["exp_avg"] for v in state["optimizer"]["state"].values()]
    assert sorted(m.shape for m in moments) == sorted(p.shape for p in other.parameters())
    assert state["step"] == 4 and state["optimizer"]["param_groups"][0]["lr"] > 0


def _copy(two_rank_run: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt" / "step-00000004"
    shutil.copytree(two_rank_run.parent / "run-full" / "ckpt" / "step-00000004", folder)
    return folder


def test_a_tampered_shard_is_refused_in_one_line(two_rank_run, tmp_path):
    folder = _copy(two_rank_run, tmp_path)
    shard = folder / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    message = f"checkpoint file {shard} is truncated or corrupted (sha256 mismatch)"
    with pytest.raises(CheckpointError) as info:
        verify_checkpoint(folder)
    assert str(info.value) == message
    with pytest.raises(CheckpointError) as info:
        moelab.load(folder)
    assert str(info.value) == message
    with pytest.warns(UserWarning, match="sha256 mismatch"):
        assert latest_checkpoint(folder.parent) is None  # skipped: nothing else to fall back to


class _Crafted:
    def __reduce__(self):
        return (eval, ("1 + 1",))


def test_a_crafted_index_with_a_matching_manifest_is_not_unpickled(two_rank_run, tmp_path):
    # the digests vouch for files this machine wrote; a folder crafted with a matching manifest must
    # still not run code: .metadata builds only DCP's metadata classes
    folder = _copy(two_rank_run, tmp_path)
    (folder / ".metadata").write_bytes(pickle.dumps(_Crafted()))
    config = json.loads((folder / CONFIG_NAME).read_text())
    config["files"][".metadata"] = hashlib.sha256((folder / ".metadata").read_bytes()).hexdigest()
    config["sha256"] = hashlib.sha256(_canonical(config)).hexdigest()
    (folder / CONFIG_NAME).write_text(json.dumps(config))
    verify_checkpoint(folder)  # the manifest matches
    with pytest.raises(CheckpointError) as info:
        moelab.load(folder)
    assert str(info.value) == (
        f"{str(folder / '.metadata')!r} names builtins.eval; a sharded checkpoint's index builds only "
        "torch.distributed.checkpoint's metadata classes (refused, nothing was run)"
    )


@pytest.mark.slow
def test_a_sharded_checkpoint_of_two_ranks_resumes_on_four_with_the_same_losses(
    two_rank_run, corpus, tmp_path
):
    run = tmp_path / "run"
    shutil.copytree(two_rank_run, run)
    shutil.rmtree(run / "ckpt" / "step-00000004")
    (run / "metrics.json").unlink()
    _spawn(_resume, 4, tmp_path / "procs", str(run), str(corpus))
    two, four = _log(two_rank_run.parent / "run-full"), _log(run)
    assert four[:2] == two[:2]  # the log up to the checkpoint, as written
    for a, b in zip(two[2:], four[2:]):  # steps 3-4 on 4 ranks (experts split in 4): to rounding
        for key in ("loss", "aux_loss", "grad_norm"):
            assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-5), (a["step"], key)
    assert json.loads((run / "metrics.json").read_text())["world_size"] == 4
    names = sorted(p.name for p in (run / "ckpt" / "step-00000004").iterdir())
    assert [n for n in names if n.endswith(".distcp")] == [f"__{r}_0.distcp" for r in range(4)]


def _reseal(folder: Path) -> None:
    """The manifest of ``folder`` rewritten to vouch for its files as they are now (a crafted folder)."""
    config = json.loads((folder / CONFIG_NAME).read_text())
    config["files"] = {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in config["files"]}
    config["sha256"] = hashlib.sha256(_canonical(config)).hexdigest()
    (folder / CONFIG_NAME).write_text(json.dumps(config))
    verify_checkpoint(folder)


def _load_message(folder: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        moelab.load(folder)
    return str(info.value)


def test_an_index_that_is_no_dcp_metadata_or_points_outside_the_manifest_is_refused(two_rank_run, tmp_path):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from moelab.io.sharded import read_metadata

    folder = _copy(two_rank_run, tmp_path)
    index = folder / ".metadata"
    files = json.loads((folder / CONFIG_NAME).read_text())["files"]
    metadata = read_metadata(folder, files)

    index.write_bytes(pickle.dumps(torch.Size([3])))
    _reseal(folder)
    assert _load_message(folder) == f"{str(index)!r} is not a torch.distributed.checkpoint index"

    index.write_bytes(pickle.dumps(metadata)[:40])
    _reseal(folder)
    assert _load_message(folder).startswith(f"{str(index)!r} cannot be read (UnpicklingError: ")

    # a bytes entry: DCP would torch.load it with weights_only=False
    extra = pickle.loads(pickle.dumps(metadata))
    extra.state_dict_metadata["optimizer.extra"] = BytesStorageMetadata()
    index.write_bytes(pickle.dumps(extra))
    _reseal(folder)
    assert _load_message(folder) == (
        f"{str(index)!r} holds a non-tensor entry 'optimizer.extra'; a sharded checkpoint holds tensors only"
    )

    outside = pickle.loads(pickle.dumps(metadata))
    next(iter(outside.storage_data.values())).relative_path = "../../elsewhere.distcp"
    index.write_bytes(pickle.dumps(outside))
    _reseal(folder)
    assert _load_message(folder) == (
        f"{str(index)!r} points to the file '../../elsewhere.distcp', which the manifest does not list as a shard"
    )


def test_sharded_weights_that_do_not_fit_the_model_are_refused_in_one_line(two_rank_run, tmp_path):
    from moelab.train.checkpoint import load_sharded_checkpoint

    folder = _copy(two_rank_run, tmp_path)
    model = moelab.load(folder)
    bigger = copy.deepcopy(model)
    bigger.lm_head = torch.nn.Linear(16, 99)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder, bigger)
    assert str(info.value).startswith(f"{str(folder / '.metadata')!r} does not fit the model: ")

    groups = torch.load(folder / "state.pt", weights_only=True)["optimizer_groups"]

    def optimizer(m: torch.nn.Module, drop: int = 0) -> torch.optim.Optimizer:  # the saved groups' layout
        named = dict(m.named_parameters())
        return torch.optim.AdamW([{"params": [named[f] for f in g["params"]][drop if i == 0 else 0 :]}
                                  for i, g in enumerate(groups)])  # fmt: skip

    sizes = [len(g["params"]) for g in groups]
    with pytest.raises(CheckpointError) as info:
        load_sharded_checkpoint(folder, model, optimizer(model, drop=1), groups)  # another trainable set
    assert str(info.value) == (
        f"checkpoint {folder} has optimizer groups of other parameters (saved: groups of {sizes} parameters, "
        f"here: {[sizes[0] - 1, *sizes[1:]]}); it was written for another model or another trainable set"
    )
    wider = moelab.load(folder)  # the same names, one shape changed: DCP's own refusal, in one line
    wider.pos_emb.weight = torch.nn.Parameter(torch.zeros(99, wider.pos_emb.weight.shape[1]))
    with pytest.raises(CheckpointError) as info:
        load_sharded_checkpoint(folder, wider, optimizer(wider), groups)
    assert str(info.value).startswith(f"sharded checkpoint {folder} does not fit: ")
    assert "\n" not in str(info.value)


def test_a_sharded_checkpoint_that_cannot_be_written_is_refused_in_one_line(tmp_path):
    from moelab.train.checkpoint import save_sharded_checkpoint

    (tmp_path / "file").write_text("")
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    root = tmp_path / "file" / "ckpt"
    with pytest.raises(CheckpointError) as info:
        save_sharded_checkpoint(root, 1, model, model, optimizer, {"step": 1})
    assert str(info.value) == (
        f"cannot write checkpoint {root / 'step-00000001'}: Not a directory; the previous checkpoints are kept "
        "(none); free disk space and run again with --resume"
    )
    with pytest.raises(ValueError) as info:
        moelab.save(model, tmp_path / "m", sharded_files={"__0_0.distcp": "0" * 64})
    assert str(info.value) == (
        "sharded_files=['__0_0.distcp'] is not allowed; expected the folder's torch.distributed.checkpoint "
        "files, .metadata included"
    )


def test_a_sharded_write_killed_midway_leaves_only_a_temporary_folder_the_next_write_removes(
    two_rank_run, tmp_path
):
    from moelab.train.checkpoint import save_sharded_checkpoint

    folder = _copy(two_rank_run, tmp_path)
    stale = folder.parent / ".tmp-step-00000006"  # a kill while the ranks wrote their shards
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"partial")
    assert latest_checkpoint(folder.parent) == folder
    model = torch.nn.Linear(2, 2)  # one process: DCP writes this rank's (all) shards
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    written = save_sharded_checkpoint(folder.parent, 6, model, model, optimizer, {"step": 6}, keep=0)
    assert not stale.exists() and latest_checkpoint(folder.parent) == written
    fresh = torch.nn.Linear(2, 2)
    state = load_checkpoint(written, fresh)
    assert torch.equal(fresh.weight, model.weight) and state["step"] == 6
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], optimizer.state[model.weight]["exp_avg"])
