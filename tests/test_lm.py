"""The decoder LM: shapes, parameter counts per preset, learning, and the `moelab train` CLI."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

import moelab
from moelab.cli import main
from moelab.data.text import TextData, load_text
from moelab.layer import moe_layers
from moelab.models.lm import PRESETS, LMConfig, TransformerLM, lm_config
from moelab.train import TrainConfig, Trainer, count_parameters
from moelab.train.tasks import LMTask

TINY = dict(block_size=16, n_layer=2, d_model=32, n_head=2, num_experts=4, top_k=2, dropout=0.0)


def expected_counts(size: str, arch: str, vocab: int = 256) -> tuple[int, int]:
    """Parameter counts written out by hand (independent of count_parameters)."""
    p = PRESETS[size]
    d, L, blk, N, K = p["d_model"], p["n_layer"], p["block_size"], p.get("num_experts", 16), p.get("top_k", 2)
    h = p.get("d_hidden", d)
    w = p["n_head"] * p["d_head"] if "d_head" in p else d  # the attention's width
    emb = vocab * d + blk * d  # tied head
    attn = 3 * d * w + 3 * w + w * d + d
    norms = 2 * 2 * d
    experts = N * (d * h + h * d)
    router = N * d
    moe_block = attn + norms + router + experts
    dense_block = attn + norms + (d * h + h * d)
    if arch == "switch":
        total = emb + L * moe_block + 2 * d
        return total, total - L * (N - K) * 2 * d * h
    n_moe = L // 2
    total = emb + n_moe * moe_block + (L - n_moe) * dense_block + 2 * d
    return total, total - n_moe * (N - K) * 2 * d * h


@pytest.mark.parametrize("size", list(PRESETS))
@pytest.mark.parametrize("arch", ["switch", "glam"])
def test_parameter_counts_per_preset(size, arch):
    with torch.device("meta"):
        model = TransformerLM(lm_config(size, 256, arch=arch))
    assert count_parameters(model) == expected_counts(size, arch)


def test_paper_sizes_match_000():
    # 000 §6.1: tiny ~7M (3 SMoE blocks), small ~15M (6), medium ~36M (8)
    for size, millions, blocks in [("tiny", 7, 3), ("small", 15, 6), ("medium", 36, 8)]:
        total, _ = expected_counts(size, "switch")
        assert abs(total / 1e6 - millions) < 0.5 and PRESETS[size]["n_layer"] == blocks


def test_dense_arch_has_the_active_width_of_the_moe_model():
    with torch.device("meta"):
        moe = TransformerLM(lm_config("cpu", 256, arch="switch"))
        dense = TransformerLM(lm_config("cpu", 256, arch="dense"))
    _, active = count_parameters(moe)
    total_dense, _ = count_parameters(dense)
    assert total_dense == active - 2 * 16 * 64  # the same except the routers
    assert not moelab.layer.moe_layers(dense)


@pytest.mark.parametrize("arch,n_moe", [("switch", 4), ("glam", 2), ("dense", 0)])
def test_forward_shapes_and_moe_layout(arch, n_moe):
    model = TransformerLM(LMConfig(vocab_size=50, arch=arch, **{**TINY, "n_layer": 4}))
    x = torch.randint(50, (3, 16))
    assert model(x).shape == (3, 16, 50)
    assert model.features(x).shape == (3, 16, 32)
    assert len(model.moe_layers) == n_moe
    if arch == "glam":
        assert [b.ffn.__class__.__name__ for b in model.blocks] == ["MLP", "MoE", "MLP", "MoE"]


def test_bad_model_configs_are_refused():
    with pytest.raises(ValueError, match="n_head=3 is not allowed for d_model=32"):
        LMConfig(vocab_size=10, **{**TINY, "n_head": 3})
    with pytest.raises(ValueError, match="arch='moe' is not allowed"):
        LMConfig(vocab_size=10, arch="moe")
    with pytest.raises(ValueError, match="size='huge' is not allowed"):
        lm_config("huge", 10)
    with pytest.raises(ValueError, match="method='nope' is not a moelab method"):
        TransformerLM(LMConfig(vocab_size=10, method="nope", **TINY))
    model = TransformerLM(LMConfig(vocab_size=10, **TINY))
    with pytest.raises(ValueError, match="sequence length 17 is not allowed"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("method", ["smoe", "xmoe"])
def test_twenty_steps_on_a_tiny_text_lower_the_loss(corpus, method):
    data = load_text(str(corpus))
    torch.manual_seed(0)
    model = TransformerLM(LMConfig(vocab_size=256, method=method, **TINY))
    task = LMTask(data, 16)
    before = task.evaluate(model.eval(), "valid", None)["loss"]
    cfg = TrainConfig(steps=20, batch_size=8, lr=3e-3, schedule="constant", warmup=0, eval_every=20)
    metrics = Trainer(model, task, cfg, None, progress=False).fit()
    assert metrics["val_bpc"] * 0.6931 < before - 0.5  # well below the initial loss
    assert metrics["test_bpc"] > 0 and metrics["world_size"] == 1 and metrics["method"] == method


def test_evaluation_covers_every_predicted_token_and_reports_bpc_and_ppl():
    data = TextData(
        "t",
        torch.zeros(40, dtype=torch.long),
        torch.arange(23) % 5,
        torch.arange(23) % 5,
        load_text.__globals__["ByteTokenizer"](),
        "bpc",
    )

    class Uniform(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, x):
            return torch.zeros(*x.shape, 256) + self.w

    task = LMTask(data, block_size=5)
    out = task.evaluate(Uniform(), "valid", None)  # 22 predicted tokens: 4 blocks + a remainder of 2
    assert out["loss"] == pytest.approx(torch.log(torch.tensor(256.0)).item())
    assert out["bpc"] == pytest.approx(8.0)
    task.metric = "ppl"
    assert task.evaluate(Uniform(), "valid", 7)["ppl"] == pytest.approx(256.0, rel=1e-5)


# ------------------------------------------------------------------------------ the CLI
def tiny_args(corpus, out, *extra):
    return [
        "train", "--data", str(corpus), "--size", "cpu", "--block-size", "16", "--batch-size", "4",
        "--num-experts", "4", "--steps", "4", "--eval-every", "2", "--eval-tokens", "64",
        "--test-tokens", "64", "--no-progress", "--out", str(out), *extra,
    ]  # fmt: skip


def test_train_cli_writes_the_run(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(tiny_args(corpus, out, "--method", "xmoe", "--opt", "balance_coef=0")) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("train_loss", "val_bpc", "test_bpc", "tokens_per_s", "params", "active_params",
                "world_size", "seed", "method"):  # fmt: skip
        assert key in metrics
    assert metrics["method"] == "xmoe" and metrics["world_size"] == 1
    config = (out / "config.yaml").read_text()
    assert "balance_coef: 0" in config and "method: xmoe" in config
    rows = (out / "log.csv").read_text().splitlines()
    assert len(rows) == 5 and rows[0].startswith("step,lr,loss")
    assert (out / "best" / "config.json").exists() and (out / "ckpt").is_dir()
    assert "test_bpc" in capsys.readouterr().out


def test_flags_set_the_layer_arguments_the_lm_passes_to_every_layer(corpus, tmp_path):
    out = tmp_path / "run"
    assert main(tiny_args(corpus, out, "--top-k", "3", "--opt", "activation=gelu")) == 0
    model = moelab.load(out / "best")
    layers = list(moelab.layer.moe_layers(model))
    assert layers and all(layer.top_k == 3 for layer in layers)
    assert model.cfg.top_k == 3 and model.cfg.activation == "gelu"


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--opt", "d_model=8"], "--opt d_model=8 is not allowed; the layer's d_model is set by --d-model"),
        (["--opt", "method='xmoe'"], "the layer's method is set by --method"),
        (["--opt", "top_k=3"], "--opt top_k=3 is not allowed; the layer's top_k is set by --top-k"),
        (["--top-k", "3", "--opt", "top_k=3"], "the layer's top_k is set by --top-k"),
        (["--opt", "num_experts=4"], "the layer's num_experts is set by --num-experts"),
        (
            ["--opt", "d_hidden=8"],
            "--opt d_hidden=8 is not allowed; the layer's d_hidden is set by --d-hidden",
        ),
    ],
)
def test_opt_refuses_a_layer_argument_that_has_a_flag_in_one_line(corpus, tmp_path, capsys, extra, message):
    assert main(tiny_args(corpus, tmp_path / "run", *extra)) == 2
    assert message in _one_line_error(capsys)


def test_train_cli_reads_a_config_file(corpus, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("method: xmoe\nseed: 3\nsteps: 2\n")
    out = tmp_path / "run"
    assert main([*tiny_args(corpus, out), "--config", str(cfg)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["method"], metrics["seed"]) == ("xmoe", 3)
    assert metrics["steps"] == 4  # a flag given on the command line wins over the file


def test_a_runs_own_config_yaml_is_accepted_back_by_config(corpus, tmp_path):
    import yaml

    first = tmp_path / "first"
    assert (
        main(
            [*tiny_args(corpus, first), "--method", "xmoe", "--opt", "balance_coef=0.02", "--opt", "z_coef=0"]
        )
        == 0
    )
    again = tmp_path / "again"
    assert main(["train", "--config", str(first / "config.yaml"), "--out", str(again), "--no-progress"]) == 0
    a, b = (yaml.safe_load((d / "config.yaml").read_text()) for d in (first, again))
    assert a == b and a["method"] == "xmoe" and a["opts"] == {"balance_coef": 0.02, "z_coef": 0}
    m1, m2 = (json.loads((d / "metrics.json").read_text()) for d in (first, again))
    assert m1["test_bpc"] == m2["test_bpc"]  # the same run again
    # a flag on the command line still wins over the file
    third = tmp_path / "third"
    assert (
        main(
            [
                "train",
                "--config",
                str(first / "config.yaml"),
                "--out",
                str(third),
                "--seed",
                "5",
                "--no-progress",
            ]
        )
        == 0
    )
    assert yaml.safe_load((third / "config.yaml").read_text())["seed"] == 5


def test_the_optimizer_flags_reach_config_yaml_and_come_back_from_it(corpus, tmp_path):
    import yaml

    first, again = tmp_path / "first", tmp_path / "again"
    assert main([*tiny_args(corpus, first), "--weight-decay", "0.05"]) == 0
    train = yaml.safe_load((first / "config.yaml").read_text())
    assert (train["optimizer"], train["weight_decay"]) == ("adamw", 0.05)
    assert main(["train", "--config", str(first / "config.yaml"), "--out", str(again), "--no-progress"]) == 0
    again_config = yaml.safe_load((again / "config.yaml").read_text())
    assert {k: again_config[k] for k in ("optimizer", "weight_decay", "steps", "lr")} == {
        k: train[k] for k in ("optimizer", "weight_decay", "steps", "lr")
    }
    assert _config_of("--optimizer", "adam").optimizer == "adam"


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("moelab train: error:"), err
    return err


def test_force_leaves_nothing_of_the_old_run_for_resume_to_continue(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(tiny_args(corpus, out, "--steps", "6", "--ckpt-every", "2")) == 0
    assert main(tiny_args(corpus, out, "--steps", "2", "--ckpt-every", "1", "--force")) == 0
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["step-00000001", "step-00000002"]
    capsys.readouterr()
    assert main(tiny_args(corpus, out, "--steps", "2", "--ckpt-every", "1", "--resume")) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 2 and metrics["best_step"] <= 2


@pytest.mark.parametrize(
    "change,flag",
    [(["--steps", "6"], "--steps=6"), (["--lr", "0.01"], "--lr=0.01"), (["--seed", "3"], "--seed=3"),
     (["--method", "xmoe"], "--method='xmoe'"), (["--layers", "1"], "--layers=1"),
     (["--d-hidden", "8"], "--d-hidden=8"), (["--weight-decay", "0.1"], "--weight-decay=0.1"),
     (["--optimizer", "adam"], "--optimizer='adam'")],
)  # fmt: skip
def test_resume_refuses_changed_flags_in_one_line(corpus, tmp_path, capsys, change, flag):
    out = tmp_path / "run"
    assert main(tiny_args(corpus, out)) == 0
    (out / "metrics.json").unlink()  # an unfinished run
    capsys.readouterr()
    assert main([*tiny_args(corpus, out, "--resume"), *change]) == 2
    err = _one_line_error(capsys)
    assert f"--resume: {flag} differs from" in err and "config.yaml" in err and "--allow-changes" in err


def test_resume_without_flags_continues_with_the_runs_own_settings(corpus, tmp_path):
    out = tmp_path / "run"
    assert main([*tiny_args(corpus, out), "--method", "xmoe", "--seed", "2"]) == 0
    (out / "metrics.json").unlink()
    assert main(["train", "--out", str(out), "--resume", "--no-progress"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["method"], metrics["seed"], metrics["steps"]) == ("xmoe", 2, 4)


def test_resume_with_allow_changes_continues_with_the_new_steps(corpus, tmp_path):
    import yaml

    out = tmp_path / "run"
    assert main(tiny_args(corpus, out)) == 0
    assert main([*tiny_args(corpus, out, "--resume"), "--steps", "6", "--allow-changes"]) == 0
    assert json.loads((out / "metrics.json").read_text())["steps"] == 6
    assert yaml.safe_load((out / "config.yaml").read_text())["steps"] == 6


def test_resume_refuses_a_changed_data_file(corpus, tmp_path, capsys):
    data = tmp_path / "corpus.txt"
    data.write_bytes(Path(corpus).read_bytes())
    out = tmp_path / "run"
    assert main(tiny_args(data, out)) == 0
    (out / "metrics.json").unlink()
    data.write_bytes(Path(corpus).read_bytes()[::-1])  # same name, other text
    capsys.readouterr()
    assert main(tiny_args(data, out, "--resume")) == 2
    err = _one_line_error(capsys)
    assert "has sha256" in err and "the run cannot continue on other data" in err


def test_resume_refuses_checkpoints_without_their_config(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(tiny_args(corpus, out, "--ckpt-every", "2")) == 0
    (out / "config.yaml").unlink()
    capsys.readouterr()
    assert main(tiny_args(corpus, out, "--resume")) == 2
    assert "holds checkpoints but no config.yaml: the run cannot continue exactly" in _one_line_error(capsys)


@pytest.mark.parametrize("flag", ["--lr", "--grad-clip", "--dropout"])
def test_infinite_numbers_are_refused_in_one_line(corpus, tmp_path, capsys, flag):
    assert main(tiny_args(corpus, tmp_path / "run", flag, "inf")) == 2
    err = _one_line_error(capsys)
    assert "=inf is not allowed; expected a" in err


def test_a_second_process_on_the_same_run_is_refused_naming_the_holder(tmp_path):
    import subprocess
    import sys

    from moelab.io.rundir import RunDir

    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from moelab.io.rundir import RunDir; RunDir({str(out)!r}); print('held', flush=True); input()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            FileExistsError, match=rf"is in use by another moelab process \(PID {holder.pid}\)"
        ):
            RunDir(out)
    finally:
        holder.communicate("\n", timeout=30)
    RunDir(out).close()  # free again once the holder has exited


def test_a_kill_while_a_run_is_created_leaves_a_run_that_resume_completes(corpus, tmp_path, monkeypatch):
    from moelab.io.rundir import RunDir

    out = tmp_path / "run"
    real = RunDir.write_config

    def killed(self, config):
        raise KeyboardInterrupt  # SIGKILL-like: nothing after it runs

    monkeypatch.setattr(RunDir, "write_config", killed)
    assert main(tiny_args(corpus, out)) == 130  # "interrupted"
    assert (out / "tokenizer.json").exists() and not (out / "config.yaml").exists()
    monkeypatch.setattr(RunDir, "write_config", real)
    assert main(tiny_args(corpus, out, "--resume")) == 0
    assert (out / "config.yaml").exists() and (out / "tokenizer.json").exists()
    assert json.loads((out / "metrics.json").read_text())["steps"] == 4


def test_a_damaged_run_config_is_refused_in_one_line(corpus, tmp_path, capsys):
    import yaml

    first = tmp_path / "first"
    assert main(tiny_args(corpus, first)) == 0
    config = yaml.safe_load((first / "config.yaml").read_text())
    config["bogus"] = 1
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    capsys.readouterr()
    assert main(["train", "--config", str(bad), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "unknown keys ['bogus']" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--method", "nope"], "method='nope' is not a moelab method"),
        (["--size", "huge"], "--size='huge' is not allowed"),
        (["--arch", "moe"], "--arch='moe' is not allowed"),
        (["--steps", "0"], "--steps=0 is not allowed"),
        (
            ["--opt", "nonsense"],
            "--opt 'nonsense' is not allowed; expected KEY=VALUE, e.g. --opt balance_coef=0",
        ),
        (["--opt", "wrong_option=1"], "option 'wrong_option' is not accepted by method='smoe'"),
        (["--block-size", "4096"], "too short"),
        (["--config", "/nonexistent.yaml"], "does not exist"),
    ],
)
def test_train_cli_errors_are_one_line_exit_2(corpus, tmp_path, capsys, extra, message):
    assert main([*tiny_args(corpus, tmp_path / "run"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and err.startswith("moelab train: error:")


def test_train_cli_missing_data_and_existing_run(corpus, tmp_path, capsys):
    assert main(tiny_args(tmp_path / "missing.txt", tmp_path / "a")) == 2
    assert "neither a corpus" in capsys.readouterr().err
    out = tmp_path / "run"
    assert main(tiny_args(corpus, out)) == 0
    capsys.readouterr()
    assert main(tiny_args(corpus, out)) == 2
    err = capsys.readouterr().err
    assert "already holds a run; pass --resume" in err and len(err.strip().splitlines()) == 1


def test_train_task_image_is_refused_with_a_pointer_to_specialize(tmp_path, capsys):
    assert main(["train", "--task", "image", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err == (
        "moelab train: error: --task image is not a train task; run the expert-specialization lab "
        "with `moelab specialize` (see `moelab specialize --help`)\n"
    )
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "path", sorted(Path(__file__).parents[1].glob("configs/lm/*.yaml")), ids=lambda p: p.name
)
def test_shipped_configs_are_valid(path):
    config = _config_of("--config", str(path))
    assert config.data in ("default", "enwik8", "text8", "wikitext103")


@pytest.mark.parametrize("size,millions,blocks", [("small", 15, 6), ("medium", 36, 8)])
def test_wikitext103_configs_build_the_papers_small_and_medium_models(size, millions, blocks):
    # CompeteSMoE (2024) §6.1 / Table 7: WikiText-103 is run with the small (6 layers, 15M) and medium
    # (8 layers, 36M) models; the 15M / 36M count the byte-level model, so the non-embedding part is
    # the same at word level and the embedding grows by vocab x d
    vocab = 267_735
    for arch in ("switch", "glam"):
        config = _config_of("--config", f"configs/lm/wikitext103-{size}-{arch}.yaml")
        assert (config.data, config.size, config.n_layer, config.block_size) == (
            "wikitext103",
            size,
            blocks,
            512,
        )
        with torch.device("meta"):
            word, byte = (TransformerLM(lm_config(config.size, v, arch=arch)) for v in (vocab, 256))
        d = config.d_model
        assert count_parameters(word)[0] - count_parameters(byte)[0] == (vocab - 256) * d
        if arch == "switch":
            assert abs(count_parameters(byte)[0] / 1e6 - millions) < 0.5


def _config_of(*flags):
    import argparse

    from moelab.experiments import runner
    from moelab.experiments.lm import TRAIN, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--out", "x", *flags])
    return runner.resolve_config(TRAIN, runner.given_by_args(TRAIN, args), out=None)[0]


def test_each_size_brings_its_own_training_schedule():
    demo = _config_of("--size", "demo")
    assert demo.block_size == 32
    t = demo.train_config()
    assert (t.steps, t.batch_size, t.lr, t.schedule, t.warmup) == (400, 32, 2e-3, "constant", 80)
    assert _config_of("--size", "cpu").schedule == "inverse_sqrt"
    assert _config_of("--size", "tiny").schedule == "inverse_sqrt"  # CompeteSMoE (2024)'s 1/√t


def test_a_schedule_flag_overrides_the_size_default():
    t = _config_of("--size", "demo", "--schedule", "inverse_sqrt", "--warmup", "10")
    assert (t.schedule, t.warmup) == ("inverse_sqrt", 10)


def test_evaluation_batches_grow_for_short_blocks_but_never_their_logits():
    from moelab.data.text import ByteTokenizer

    tokens = torch.zeros(20_000, dtype=torch.int64)
    byte = TextData("b", tokens, tokens, tokens, ByteTokenizer(), "bpc")
    assert LMTask(byte, 32).eval_batch == 128  # 4,096 tokens a forward
    assert LMTask(byte, 512).eval_batch == 16
    words = TextData("w", tokens, tokens, tokens, types.SimpleNamespace(vocab_size=267_735), "ppl")
    assert LMTask(words, 16).eval_batch == 16  # 4,096 × 267k logits would be 4.4 GB


@pytest.mark.parametrize("block", [8, 32, 100])
def test_evaluation_does_not_depend_on_its_batch(block):
    from moelab.data.text import ByteTokenizer

    g = torch.Generator().manual_seed(block)
    tokens = torch.randint(0, 50, (3000,), generator=g)
    data = TextData("b", tokens, tokens, tokens, ByteTokenizer(), "bpc")
    torch.manual_seed(0)
    model = TransformerLM(LMConfig(vocab_size=256, **{**TINY, "block_size": block})).eval()
    one, many = (LMTask(data, block, eval_batch=b).evaluate(model, "valid", None) for b in (1, 64))
    assert one.keys() == many.keys()
    for key in one:
        assert one[key] == pytest.approx(many[key], rel=1e-6)


def test_a_run_depends_on_its_seed_only(corpus, tmp_path):
    from dataclasses import replace

    from moelab.experiments.lm import train_lm

    results = []
    base = _config_of(*tiny_args(corpus, tmp_path / "unused")[1:], "--no-progress")
    for i, seed in enumerate([0, 0, 1]):
        torch.rand(i + 1)  # whatever ran before in this process must not matter
        results.append(train_lm(replace(base, seed=seed), tmp_path / f"r{i}")["test_bpc"])
    assert results[0] == results[1] != results[2]


def test_resume_without_a_run_starts_one(corpus, tmp_path, capsys):
    out = tmp_path / "fresh"
    assert main([*tiny_args(corpus, out), "--resume"]) == 0
    assert "holds no run yet; starting one" in capsys.readouterr().out
    assert (out / "metrics.json").exists()


def test_token_ids_out_of_the_vocabulary_or_of_a_float_dtype_are_refused():
    model = TransformerLM(LMConfig(vocab_size=10, **TINY))
    with pytest.raises(
        ValueError, match=r"token id 10 is not allowed; expected ids in \[0, 9\] \(vocab_size=10\)"
    ):
        model(torch.tensor([[1, 10]]))
    with pytest.raises(ValueError, match=r"token id -1 is not allowed"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match=r"idx of shape \(1, 2\) and dtype torch.float32 is not allowed"):
        model(torch.tensor([[1.0, 2.0]]))


@pytest.mark.parametrize(
    "flags,message",
    [(["--layers", "0"], "--layers=0 is not allowed; expected a positive integer"),
     (["--d-model", "-4"], "--d-model=-4 is not allowed; expected a positive integer"),
     (["--heads", "0"], "--heads=0 is not allowed; expected a positive integer"),
     (["--d-hidden", "0"], "--d-hidden=0 is not allowed; expected a positive integer"),
     (["--d-model", "30", "--heads", "4"], "n_head=4 is not allowed for d_model=30")],
)  # fmt: skip
def test_model_size_flags_are_validated_in_one_line(corpus, tmp_path, capsys, flags, message):
    assert main([*tiny_args(corpus, tmp_path / "run"), *flags]) == 2
    assert message in _one_line_error(capsys)
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_model_size_flags_build_the_model_they_name(corpus, tmp_path):
    out = tmp_path / "run"
    flags = ["--d-model", "24", "--layers", "1", "--heads", "3", "--d-hidden", "40", "--steps", "2"]
    assert main([*tiny_args(corpus, out), *flags]) == 0
    model = moelab.load(out)
    cfg = model.cfg
    assert (cfg.d_model, cfg.n_layer, cfg.n_head, cfg.d_hidden) == (24, 1, 3, 40)
    assert moe_layers(model)[0].experts.d_hidden == 40


@pytest.fixture(scope="module")
def finished_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("base") / "run"
    assert main(tiny_args(corpus, out)) == 0
    return out


_DAMAGED_CONFIGS = {
    # torn in the middle of a line (a cut between two whole lines is a valid, shorter YAML mapping:
    # the missing settings read as their defaults, as an older run's do)
    "truncated": (lambda good: good[: good.index("opts: {") + 7], "config.yaml'"),
    "a list": (lambda good: "- 1\n- 2\n", "must hold a mapping"),
    "a scalar": (lambda good: "42\n", "must hold a mapping"),
    "bad syntax": (lambda good: "task: lm\n  bad: [\n", "is not valid YAML"),
    "steps text": (lambda good: good.replace("steps: 4", "steps: abc"), "steps='abc' is not allowed"),
    "lr a list": (lambda good: good.replace("lr: 0.002", "lr: [1]"), "lr=[1] is not allowed"),
    "unknown key": (lambda good: good + "zzz: 1\n", "unknown keys ['zzz']"),
    "empty": (lambda good: "", "must hold a mapping of run settings"),
    "binary": (None, "is not UTF-8 text"),
}


@pytest.mark.parametrize("case", list(_DAMAGED_CONFIGS))
def test_resume_of_a_damaged_config_yaml_is_one_line_naming_the_file(
    finished_run, corpus, tmp_path, capsys, case
):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    (out / "metrics.json").unlink()  # an unfinished run
    damage, message = _DAMAGED_CONFIGS[case]
    config = out / "config.yaml"
    if damage is None:
        config.write_bytes(b"\x00\x01\x02\xff\xfe")
    else:
        text = damage(config.read_text())
        assert text != config.read_text()
        config.write_text(text)
    capsys.readouterr()
    assert main(tiny_args(corpus, out, "--resume")) == 2
    err = _one_line_error(capsys)
    assert message in err and str(config) in err


# ---------------------------------------------------------------- Active-Attention (Ho (2025))


def _literal_attention(attn, x: torch.Tensor, sigma) -> torch.Tensor:
    """softmax(QKᵀ/√d_h + causal mask) σ(V) per head, written out (no fused kernel)."""
    B, L, d = x.shape
    H = attn.n_head
    q, k, v = attn.qkv(x).split(d, dim=2)
    v = sigma(v) if sigma is not None else v
    q, k, v = (t.view(B, L, H, d // H).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / (d // H) ** 0.5
    scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, L, d)
    return attn.proj(y)


@pytest.mark.parametrize("act", ["gelu", "tanh", "relu", "sigmoid", "silu"])
def test_active_attention_is_softmax_of_qk_times_sigma_of_v(act):
    sigmas = {"gelu": torch.nn.functional.gelu, "tanh": torch.tanh, "relu": torch.relu,
              "sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu}  # fmt: skip
    torch.manual_seed(0)
    model = TransformerLM(
        LMConfig(vocab_size=11, attention="active", attention_activation=act, **TINY)
    ).eval()
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.qkv.bias.normal_()  # σ acts on V = X W_V + b_V
    x = torch.randn(2, 7, TINY["d_model"], dtype=torch.float64)
    attn.double()
    with torch.no_grad():
        got = attn(x)
        torch.testing.assert_close(got, _literal_attention(attn, x, sigmas[act]))
        assert (got - _literal_attention(attn, x, None)).abs().max() > 1e-3  # not the standard one


def test_standard_attention_is_the_default_and_unchanged():
    cfg = LMConfig(vocab_size=11, **TINY)
    assert cfg.attention == "standard" and cfg.attention_activation is None
    torch.manual_seed(0)
    model = TransformerLM(cfg).eval().double()
    attn = model.blocks[0].attn
    x = torch.randn(2, 7, TINY["d_model"], dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(attn(x), _literal_attention(attn, x, None))
    # the same weights as before the option existed: same seed, same draws, same logits
    torch.manual_seed(0)
    active = TransformerLM(LMConfig(vocab_size=11, attention="active", **TINY)).eval().double()
    assert active.cfg.attention_activation == "gelu"
    for a, b in zip(model.state_dict().values(), active.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # a checkpoint's config written before the option existed loads as standard attention
    old = {k: v for k, v in cfg.to_dict().items() if not k.startswith("attention")}
    assert LMConfig.from_dict(old).attention == "standard"


def test_active_attention_options_are_refused_in_one_line():
    with pytest.raises(
        ValueError, match=r"attention='linear' is not allowed; expected one of \['standard', 'active'\]"
    ):
        LMConfig(vocab_size=10, attention="linear")
    with pytest.raises(ValueError, match=r"attention_activation='softplus' is not allowed; expected one of"):
        LMConfig(vocab_size=10, attention="active", attention_activation="softplus")
    with pytest.raises(
        ValueError, match=r"attention_activation='tanh' is not allowed with attention='standard'"
    ):
        LMConfig(vocab_size=10, attention_activation="tanh")


def test_active_attention_compiles_runs_under_bf16_autocast_and_saves(tmp_path):
    torch.manual_seed(0)
    model = TransformerLM(LMConfig(vocab_size=11, attention="active", attention_activation="tanh", **TINY))
    model.eval()
    idx = torch.randint(0, 11, (2, 9))
    with torch.no_grad():
        eager = model(idx)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(idx)
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(idx)
    assert low.dtype == torch.bfloat16 and torch.isfinite(low).all()
    assert (low.float() - eager).abs().max() < 0.1
    moelab.save(model, tmp_path / "m")
    back = moelab.load(tmp_path / "m")
    assert back.cfg.attention == "active" and back.cfg.attention_activation == "tanh"
    with torch.no_grad():
        assert torch.equal(back.eval()(idx), eager)


def test_train_cli_attention_flags_reach_the_model(corpus, tmp_path):
    out = tmp_path / "run"
    flags = ["--attention", "active", "--attention-activation", "silu", "--steps", "2"]
    assert main([*tiny_args(corpus, out), *flags]) == 0
    assert "attention: active" in (out / "config.yaml").read_text()
    model = moelab.load(out)
    assert model.cfg.attention == "active" and model.cfg.attention_activation == "silu"


def test_a_resumed_run_keeps_only_keep_ckpts_checkpoints(corpus, tmp_path):
    """A kill between the final checkpoint's rename and the removal of the oldest leaves one
    checkpoint too many; the next start removes it."""
    import shutil

    out = tmp_path / "run"
    argv = tiny_args(corpus, out, "--steps", "4", "--eval-every", "2", "--ckpt-every", "2")
    assert main(argv) == 0
    ckpts = sorted(p.name for p in (out / "ckpt").iterdir())
    assert ckpts == ["step-00000002", "step-00000004"]
    shutil.copytree(out / "ckpt" / "step-00000002", out / "ckpt" / "step-00000001")  # keep_ckpts + 1
    (out / "metrics.json").unlink()  # killed before the end
    assert main([*argv, "--resume"]) == 0
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ckpts


def test_resume_follows_the_data_by_its_sha256_not_its_path(corpus, tmp_path, capsys):
    import shutil

    first, moved = tmp_path / "a" / "c.txt", tmp_path / "b" / "c.txt"
    first.parent.mkdir()
    shutil.copy(corpus, first)
    out = tmp_path / "run"
    assert main(tiny_args(first, out, "--steps", "2", "--eval-every", "2")) == 0
    moved.parent.mkdir()
    shutil.move(first, moved)
    assert main(tiny_args(moved, out, "--steps", "2", "--eval-every", "2", "--resume")) == 0  # the same data
    moved.write_text(moved.read_text().replace("cat", "cow"))
    capsys.readouterr()
    assert main(tiny_args(moved, out, "--steps", "2", "--eval-every", "2", "--resume")) == 2
    err = capsys.readouterr().err
    assert f"--resume: --data {str(moved)!r} has sha256" in err and "cannot continue on other data" in err


def test_a_truncated_config_yaml_is_refused_rather_than_read_with_defaults(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    argv = tiny_args(corpus, out, "--steps", "2", "--eval-every", "2")
    assert main(argv) == 0
    text = (out / "config.yaml").read_text()
    (out / "config.yaml").write_text(text[: text.index("steps:")])  # cut before --steps
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "config.yaml' lacks the recorded settings --steps" in err and "truncated or damaged" in err
    assert len(err.strip().splitlines()) == 1


def test_a_nan_first_seen_in_validation_stops_with_the_one_line_message(corpus, tmp_path, capsys):
    """The update of step 1 (lr 1e20) leaves weights whose router logits overflow: the training loss
    of step 1 was finite, the validation after it is not (also when the run is resumed)."""
    out = tmp_path / "run"
    argv = tiny_args(corpus, out, "--steps", "3", "--eval-every", "1", "--lr", "1e20", "--schedule", "constant",
                     "--warmup", "0")  # fmt: skip
    for extra in ([], ["--resume"]):
        assert main([*argv, *extra]) == 1
        text = capsys.readouterr().out
        assert text.startswith("moelab train: validation bpc is not finite at step 1 (MoE layer 0")
        assert text.rstrip().endswith(
            "although the training loss was; stopped before saving this step; no checkpoint was written "
            "yet. Lower --lr or check the data"
        )
        assert len(text.strip().splitlines()) == 1 and not (out / "best").exists()


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--d-model", "4096000000"], "--d-model"),
        (["--d-hidden", "4096000000"], "--d-hidden"),
        (["--num-experts", "4096000000"], "--num-experts"),
        (["--block-size", "4096000000"], "--block-size"),
        (["--batch-size", "4096000000"], "--batch-size"),
        (["--layers", "100000000"], "--layers"),
    ],
)
@pytest.mark.parametrize("command", ["train", "compare"])
def test_a_size_beyond_the_machines_memory_is_refused_naming_its_flag_before_allocating(
    corpus, tmp_path, capsys, command, extra, flag
):
    from moelab.experiments.runner import machine_memory

    out = tmp_path / "run"
    argv = [command, "--data", str(corpus), "--size", "cpu", "--no-progress", "--out", str(out), *extra]
    if command == "compare":  # compare's --methods in place of train's --method
        argv = [{"--method": "--methods"}.get(a, a) for a in [*argv, "--seeds", "1"]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    value = extra[-1]
    assert err.startswith(
        f"moelab {command}: error: {flag}={value} is not allowed here: the model, its training"
    )
    assert f"of memory; expected a smaller {flag}" in err and len(err.strip().splitlines()) == 1
    assert machine_memory() > 0 and not (out / "config.yaml").exists()


@pytest.mark.parametrize(("keep", "kept"), [("all", [1, 2, 3, 4]), ("3", [2, 3, 4])])
def test_keep_ckpts_keeps_every_or_the_newest_n_checkpoints(corpus, tmp_path, keep, kept):
    out = tmp_path / "run"
    assert main(tiny_args(corpus, out, "--ckpt-every", "1", "--keep-ckpts", keep)) == 0
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == [f"step-{s:08d}" for s in kept]
    assert f"keep_ckpts: {keep}" in (out / "config.yaml").read_text()


@pytest.mark.parametrize("keep", ["0", "some", "-1"])
def test_keep_ckpts_refuses_what_is_not_a_count_or_all(corpus, tmp_path, capsys, keep):
    assert main(tiny_args(corpus, tmp_path / "run", "--keep-ckpts", keep)) == 2
    shown = repr(int(keep)) if keep.lstrip("-").isdigit() else repr(keep)
    assert f"--keep-ckpts={shown} is not allowed; expected a positive integer or one of ['all']" in (
        _one_line_error(capsys)
    )


def test_a_crafted_state_pt_with_re_signed_digests_is_refused_in_one_line_and_runs_nothing(
    corpus, tmp_path, capsys
):
    import hashlib
    import pickle

    from moelab.io.model import _canonical

    out = tmp_path / "run"
    argv = tiny_args(corpus, out, "--steps", "4", "--eval-every", "2", "--ckpt-every", "2")
    assert main(argv) == 0
    (out / "metrics.json").unlink()
    witness = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(witness), "w"))

    for step in sorted((out / "ckpt").iterdir()):
        data = pickle.dumps({"step": Payload()})
        (step / "state.pt").write_bytes(data)
        config = json.loads((step / "config.json").read_text())
        config["files"]["state.pt"] = hashlib.sha256(data).hexdigest()
        config["sha256"] = hashlib.sha256(_canonical(config)).hexdigest()
        (step / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    newest = sorted((out / "ckpt").iterdir())[-1]
    assert err.startswith(
        f"moelab train: error: checkpoint {newest}: state.pt cannot be read as a training state ("
    )
    assert "nothing of it was run. Remove" in err and len(err.strip().splitlines()) == 1
    assert not witness.exists()


@pytest.mark.parametrize("value", ["1e20", "1000000000000", "100000000000000000000"])
@pytest.mark.parametrize("command", ["train", "compare"])
def test_a_step_count_that_cannot_finish_is_refused_naming_the_flag(corpus, tmp_path, capsys, command, value):
    out = tmp_path / "run"
    argv = [
        command,
        "--data",
        str(corpus),
        "--size",
        "cpu",
        "--steps",
        value,
        "--no-progress",
        "--out",
        str(out),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    shown = str(int(float(value))) if "e" in value else value
    assert (
        err
        == f"moelab {command}: error: --steps={shown} is not allowed; expected an integer in [1, 1000000000]\n"
    )
    assert not out.exists()


@pytest.mark.parametrize(
    "opt, message",
    [
        ("warmup=0.1", "--opt warmup=0.1 is not allowed; it names two things: the learning-rate warm-up is "
                       "--warmup STEPS, the competition schedule's warm-up fraction --opt competition_warmup=F"),
        ("lr=0.1", "--opt lr=0.1 is not allowed; lr is a setting of the run, set by --lr"),
        ("steps=3", "--opt steps=3 is not allowed; steps is a setting of the run, set by --steps"),
    ],
)  # fmt: skip
def test_an_opt_named_like_a_setting_of_the_run_is_refused_naming_the_flag(
    corpus, tmp_path, capsys, opt, message
):
    out = tmp_path / "run"
    argv = ["train", "--data", str(corpus), "--method", "competesmoe", "--opt", opt, "--out", str(out)]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"moelab train: error: {message}\n" and not out.exists()


def test_a_padding_mask_keeps_padding_out_of_the_experts_capacity_and_balance():
    torch.manual_seed(0)
    model = TransformerLM(LMConfig(vocab_size=40, method_options={"capacity_factor": 1.0}, **TINY))
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 40, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.bool)
    mask[1, 6:] = False
    mask[2, 3:] = False
    model.train()
    logits = model(idx, mask)
    aux = moelab.aux_loss(model).detach()
    other = model(idx.masked_fill(~mask, 7), mask)  # other ids at the padded positions: nothing changes
    assert torch.equal(other[mask], logits[mask]) and torch.equal(moelab.aux_loss(model).detach(), aux)
    model.eval()
    with torch.no_grad():  # evaluation: the padding takes no capacity either
        want = model(idx, mask)
        assert torch.equal(model(idx.masked_fill(~mask, 7), mask)[mask], want[mask])
        # the padded batch = its real tokens in one row, as the layers route them (capacity of 19 tokens)
        moe = moe_layers(model)[0]
        x = torch.randn(3, 10, 32)
        torch.testing.assert_close(moe(x, mask)[mask], moe(x[mask].unsqueeze(0))[0], rtol=0, atol=0)


def test_a_padding_mask_of_another_shape_is_refused_in_one_line():
    model = TransformerLM(LMConfig(vocab_size=40, **TINY))
    with pytest.raises(
        ValueError, match=r"mask of shape \(2, 3\) is not allowed; expected the shape of idx, \(2, 4\)"
    ):
        model(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool))


def test_a_competesmoe_run_too_short_to_compete_says_so_in_the_report_table(corpus, tmp_path, capsys):
    """At --steps 4 the coin-flip schedule's first competing step (13 at seed 0) lies beyond the run: metrics.json
    records first_competition_step null and `moelab report` marks the row, where the numbers would
    otherwise look like a plain top-K run's with nothing to say why."""
    from moelab.experiments.report import collect_runs, group_runs, render

    short, plain = tmp_path / "competesmoe-v1", tmp_path / "smoe"
    assert main(tiny_args(corpus, short, "--method", "competesmoe-v1")) == 0
    assert main(tiny_args(corpus, plain, "--method", "smoe")) == 0
    assert json.loads((short / "metrics.json").read_text())["first_competition_step"] is None
    assert "first_competition_step" not in json.loads((plain / "metrics.json").read_text())
    text, rows = render(group_runs(collect_runs([tmp_path])), None)
    assert [r["competed"] for r in rows] == [False, True]
    assert "competesmoe-v1 †" in text and "no competition step happened in competesmoe-v1:" in text
    assert text.count("†") == 2  # the row and the footnote: smoe's row has no mark


def test_the_compete_1b_preset_is_competesmoe_2025_table_18_at_about_a_billion_parameters():
    from moelab.models.lm import TRAINING, lm_config

    cfg = lm_config("compete-1b", 8000)  # MoEUT's SentencePiece vocabulary
    assert (cfg.n_layer, cfg.d_model, cfg.hidden, cfg.n_head, cfg.d_head, cfg.num_experts, cfg.top_k) == (
        24, 1024, 512, 32, 128, 24, 8,
    )  # fmt: skip
    assert all(cfg.is_moe(i) for i in range(24))  # an MoE in every block's MLP
    assert cfg.init == "moeut" and cfg.activation == "relu" and cfg.attention_width == 4096
    with torch.device("meta"):  # the shapes only: no memory
        model = TransformerLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert 0.95e9 < total < 1.1e9, total
    assert model.blocks[0].ffn.experts.w_in.shape == (24, 512, 1024)
    assert model.blocks[0].attn.qkv.weight.shape == (3 * 4096, 1024)
    t = TRAINING["compete-1b"]
    assert (t["lr"], t["schedule"], t["warmup"], t["batch_size"], t["steps"]) == (
        2.5e-4,
        "cosine",
        4000,
        64,
        200_000,
    )


def test_every_value_of_a_training_preset_reaches_the_run(monkeypatch):
    """A preset key the run's resolver does not fill (a flag with a default of its own) would be
    silently unused."""
    from dataclasses import fields

    from moelab.experiments import runner
    from moelab.experiments.lm import TrainRun, resolve
    from moelab.models.lm import TRAINING

    monkeypatch.setattr(runner, "check_memory", lambda *a, **k: None)  # compete-1b: over 100 GiB
    defaults = {f.name: f.default for f in fields(TrainRun)}
    for size, preset in TRAINING.items():
        resolved = resolve(TrainRun(size=size))
        for key, value in preset.items():
            assert defaults[key] is None and getattr(resolved, key) == value, (size, key)


def test_heads_of_their_own_width_attend_as_the_formula_says():
    """d_head decouples the heads' width from d_model: q, k, v of n_head · d_head, each head's
    softmax(q kᵀ/√d_head) v, concatenated and projected back to d_model."""
    cfg = LMConfig(vocab_size=11, **{**TINY, "d_model": 12, "n_head": 2}, d_head=5)  # 2·5 ≠ 12
    attn = TransformerLM(cfg).blocks[0].attn.double().eval()
    x = torch.randn(3, 7, 12, dtype=torch.float64)
    q, k, v = (x @ w.T + b for w, b in zip(attn.qkv.weight.split(10), attn.qkv.bias.split(10)))
    heads = []
    for h in range(2):
        qh, kh, vh = (t[..., 5 * h : 5 * h + 5] for t in (q, k, v))
        scores = qh @ kh.transpose(1, 2) / 5**0.5
        scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(scores.softmax(-1) @ vh)
    literal = torch.cat(heads, -1) @ attn.proj.weight.T + attn.proj.bias
    torch.testing.assert_close(attn(x), literal, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"d_head=0 is not allowed"):
        LMConfig(vocab_size=11, **TINY, d_head=0)


def test_moeut_init_draws_each_tensor_at_its_stated_scale():
    """MoEUT's init with s = √(2/L): attention in and expert in N(0, s²/d), attention out
    N(0, s²/(H·d_head)), expert out N(0, s²/(N·h)), router rows of one norm, embedding N(0, 1/d)."""
    torch.manual_seed(0)
    L, d, H, dh, N, h = 4, 64, 4, 32, 8, 48
    cfg = LMConfig(vocab_size=500, block_size=16, n_layer=L, d_model=d, n_head=H, d_head=dh, num_experts=N,
                   top_k=2, d_hidden=h, dropout=0.0, init="moeut")  # fmt: skip
    model = TransformerLM(cfg)
    s = (2 / L) ** 0.5

    def close(t, std, within=0.05):  # thousands of draws: the sample std within 5 % of the stated one
        assert abs(t.std().item() / std - 1) < within, (t.std().item(), std)

    close(model.tok_emb.weight, 1 / d**0.5)
    for block in model.blocks:
        close(block.attn.qkv.weight, s / d**0.5)
        close(block.attn.proj.weight, s / (H * dh) ** 0.5)
        assert not block.attn.qkv.bias.any() and not block.attn.proj.bias.any()
        close(block.ffn.experts.w_in, s / d**0.5)
        close(block.ffn.experts.w_out, s / (N * h) ** 0.5)
        norms = block.ffn.router.weight.norm(dim=1)
        torch.testing.assert_close(norms, norms[:1].expand(N))  # renormalised rows
        close(block.ffn.router.weight, s / d**0.5, within=0.15)  # 512 draws (the default init: 1/√d, +41 %)
    gpt2 = TransformerLM(LMConfig(**{**cfg.to_dict(), "init": "gpt2"}))
    close(gpt2.tok_emb.weight, 0.02)
    with pytest.raises(ValueError, match=r"init='xavier' is not allowed"):
        LMConfig(vocab_size=5, init="xavier")
