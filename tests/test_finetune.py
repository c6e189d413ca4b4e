"""Fine-tuning (000 §6.3): LM head replaced by two FC layers, routers frozen, accuracy reported."""

from __future__ import annotations

import json
import urllib.error

import pytest
import torch

from moelab.cli import main
from moelab.data.classification import load_classification, read_table
from moelab.data.download import DataError
from moelab.data.text import ByteTokenizer, CharTokenizer
from moelab.experiments.finetune import encode_texts, read_lm_run
from moelab.models.classifier import LMClassifier, freeze_routers
from moelab.models.lm import LMConfig, TransformerLM


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft")
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"good movie {i}. bad film {i}.\n" for i in range(400)))
    out = root / "lm"
    args = ["train", "--data", str(corpus), "--size", "cpu", "--block-size", "16", "--batch-size", "4",
            "--num-experts", "4", "--steps", "4", "--eval-every", "4", "--eval-tokens", "64",
            "--test-tokens", "64", "--no-progress", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    return out


@pytest.fixture
def reviews(tmp_path):
    path = tmp_path / "reviews.csv"
    rows = ["text,label"] + [
        f"{'great fun' if i % 2 else 'dull and slow'} {i},{'pos' if i % 2 else 'neg'}" for i in range(80)
    ]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_local_csv_is_split_80_10_10_with_sorted_label_ids(reviews):
    data = read_table(reviews)
    assert [len(data.labels[s]) for s in ("train", "valid", "test")] == [64, 8, 8]
    assert data.label_names == ["neg", "pos"]
    text, label = data.texts["train"][0], data.labels["train"][0]
    assert (label == 1) == text.startswith("great")
    assert read_table(reviews).texts == data.texts  # deterministic


def test_tsv_without_header_and_with_a_split_column(tmp_path):
    tsv = tmp_path / "d.tsv"
    tsv.write_text("".join(f"text {i}\t{i % 3}\n" for i in range(30)))
    data = read_table(tsv)
    assert data.label_names == ["0", "1", "2"] and sum(len(v) for v in data.labels.values()) == 30
    csv = tmp_path / "s.csv"
    csv.write_text(
        "sentence,label,split\n"
        + "".join(f"s{i},{i % 2},{['train', 'dev', 'test'][i % 3]}\n" for i in range(30))
    )
    data = read_table(csv)
    assert [len(data.labels[s]) for s in ("train", "valid", "test")] == [10, 10, 10]


def test_bad_tables_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a task"):
        load_classification(str(tmp_path / "missing.csv"))
    one = tmp_path / "one.csv"
    one.write_text("text,label\n" + "".join(f"t{i},same\n" for i in range(20)))
    with pytest.raises(ValueError, match="1 distinct label"):
        read_table(one)
    short = tmp_path / "short.csv"
    short.write_text("just-one-column\n")
    with pytest.raises(ValueError, match="row 1 has 1 column"):
        read_table(short)


def test_named_tasks_offline_say_what_to_fetch(monkeypatch, tmp_path):
    def refuse(*a, **k):
        raise urllib.error.URLError("offline")

    monkeypatch.setattr("urllib.request.urlopen", refuse)
    monkeypatch.setenv("MOELAB_DATA", str(tmp_path))
    for task, name in [("sst2", "SST-2.zip"), ("sst5", "train.jsonl"), ("imdb", "aclImdb_v1.tar.gz"),
                       ("banking77", "train.csv")]:  # fmt: skip
        with pytest.raises(DataError, match=f"cannot download {name}.*place it at"):
            load_classification(task)


def test_encoding_pads_right_truncates_and_masks():
    ids, mask = encode_texts(ByteTokenizer(), ["ab", "abcdefgh"], 4)
    assert ids.tolist() == [[97, 98, 0, 0], [97, 98, 99, 100]]
    assert mask.tolist() == [[True, True, False, False], [True] * 4]
    ids, _ = encode_texts(CharTokenizer(" abc"), ["A-b"], 3)
    assert ids.tolist() == [[1, 0, 2]]  # lower-cased, '-' becomes a space


def test_classifier_replaces_the_head_and_freezes_only_routers():
    lm = TransformerLM(LMConfig(vocab_size=30, block_size=8, n_layer=2, d_model=16, n_head=2, num_experts=4))
    model = LMClassifier(lm, num_classes=3)
    frozen = freeze_routers(model)
    assert frozen == 2 * 4 * 16  # two routers of (N, d)
    assert isinstance(model.lm.head, torch.nn.Identity)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any(".router." in n for n in trainable)
    assert any(".experts." in n for n in trainable) and {"fc1.weight", "fc2.weight"} <= trainable
    ids = torch.randint(30, (5, 8))
    mask = torch.ones(5, 8, dtype=torch.bool)
    mask[:, 6:] = False
    out = model.eval()(ids, mask)
    assert out.shape == (5, 3)
    ids2 = ids.clone()
    ids2[:, 6:] = 0  # padding content does not matter (causal attention, masked pooling)
    assert torch.allclose(out, model(ids2, mask))


def test_finetune_cli_reports_accuracy(pretrained, reviews, tmp_path, capsys):
    out = tmp_path / "ft"
    assert main(["finetune", "--task", str(reviews), "--from", str(pretrained), "--out", str(out),
                 "--steps", "6", "--batch-size", "8", "--lr", "1e-3", "--no-progress"]) == 0  # fmt: skip
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0 <= metrics["test_acc"] <= 100 and "val_acc" in metrics and metrics["num_classes"] == 2
    assert "test accuracy" in capsys.readouterr().out
    config, tok = read_lm_run(pretrained)
    assert config.task == "lm" and tok.vocab_size == 256


def test_finetune_records_its_optimizer_and_refuses_adam_with_a_decay(pretrained, reviews, tmp_path, capsys):
    import yaml

    out = tmp_path / "ft"
    base = ["finetune", "--task", str(reviews), "--from", str(pretrained), "--steps", "2", "--no-progress"]
    assert main([*base, "--out", str(out), "--weight-decay", "0.01"]) == 0
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["command"] == "finetune"
    assert (config["optimizer"], config["weight_decay"]) == ("adamw", 0.01)
    assert config["batch_size"] == 16 and config["epochs"] == 5.0  # the task's values, recorded
    assert config["recorded"]["steps"] == 2 and config["recorded"]["num_classes"] == 2
    capsys.readouterr()
    assert main([*base, "--out", str(tmp_path / "o"), "--optimizer", "adam", "--weight-decay", "0.01"]) == 2
    err = capsys.readouterr().err
    assert (
        "optimizer='adam' with weight_decay=0.01 is not allowed" in err and len(err.strip().splitlines()) == 1
    )


def test_finetune_cli_errors_exit_2(pretrained, reviews, tmp_path, capsys):
    assert (
        main(
            [
                "finetune",
                "--task",
                str(reviews),
                "--from",
                str(tmp_path / "none"),
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    assert "holds no moelab run" in capsys.readouterr().err
    assert (
        main(["finetune", "--task", "nope.csv", "--from", str(pretrained), "--out", str(tmp_path / "o")]) == 2
    )
    assert "neither a task" in capsys.readouterr().err
    assert main(["finetune", "--task", str(reviews), "--from", str(pretrained), "--out", str(tmp_path / "o"),
                 "--epochs", "0"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "--epochs=0.0 is not allowed" in err and len(err.strip().splitlines()) == 1
    for bad in ("inf", "nan"):
        assert main(["finetune", "--task", str(reviews), "--from", str(pretrained), "--out",
                     str(tmp_path / "o"), "--epochs", bad]) == 2  # fmt: skip
        err = capsys.readouterr().err
        assert f"--epochs={bad} is not allowed; expected a number in (0, 1000000000]" in err
        assert len(err.strip().splitlines()) == 1


def test_finetune_resumed_with_a_changed_flag_is_refused_in_the_lifecycles_sentence(
    pretrained, reviews, tmp_path, capsys
):
    from moelab.experiments import runner

    out = tmp_path / "ft"
    base = ["finetune", "--task", str(reviews), "--from", str(pretrained), "--steps", "2", "--no-progress"]
    assert main([*base, "--out", str(out)]) == 0
    capsys.readouterr()
    assert main([*base, "--out", str(out), "--resume", "--lr", "0.001"]) == 2
    sentence = runner.refuse_change("--lr", 0.001, 1e-4, out / "config.yaml").args[0]
    assert capsys.readouterr().err == f"moelab finetune: error: {sentence}\n"


def test_a_damaged_tokenizer_file_is_named_in_one_line(pretrained, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(pretrained, run)
    (run / "tokenizer.json").write_text('{"kind": "byte", ')
    with pytest.raises(ValueError, match=r"tokenizer.json' is not valid JSON \(Expecting"):
        read_lm_run(run)


def test_finetune_resume_refuses_a_changed_data_file_or_lm_and_keeps_its_config(
    pretrained, reviews, tmp_path, capsys
):
    import shutil

    source = tmp_path / "lm"
    shutil.copytree(pretrained, source)
    out = tmp_path / "ft"
    base = ["finetune", "--task", str(reviews), "--from", str(source), "--steps", "2", "--no-progress"]
    assert main([*base, "--out", str(out)]) == 0
    recorded = (out / "config.yaml").read_bytes()
    original = reviews.read_text()
    reviews.write_text(original.replace("great fun", "great joy"))  # same path, other data
    capsys.readouterr()
    assert main([*base, "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert (
        f"--resume: --task {str(reviews)!r} has sha256 " in err
        and "the run cannot continue on other data" in err
    )
    assert len(err.strip().splitlines()) == 1 and (out / "config.yaml").read_bytes() == recorded
    reviews.write_text(original)
    shutil.rmtree(source / "best")  # the LM's weights are now its newest checkpoint's
    assert main([*base, "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert (
        f"--resume: --from {str(source)!r} has sha256 " in err
        and (out / "config.yaml").read_bytes() == recorded
    )
    assert main([*base, "--out", str(out), "--resume", "--allow-changes"]) == 0


def test_finetune_routes_with_the_lms_routing_context_and_keeps_it(reviews, tmp_path, monkeypatch):
    """SMoE-Dropout's K and StableMoE's stage during fine-tuning are the LM's at the end of its
    training (the frozen routers route as the LM they came from), not a fresh context's."""
    import warnings

    from moelab.io.model import load
    from moelab.routers.stable import StableRouter
    from moelab.routers.topk import TopKRouter

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"good movie {i}. bad film {i}.\n" for i in range(200)))
    seen: dict[str, list[int]] = {"k": [], "stage": []}
    real_k, real_stage = TopKRouter.current_k, StableRouter.stage

    def current_k(self, ctx):
        k = real_k(self, ctx)
        if self.training:
            seen["k"].append(k)
        return k

    def stage(self, ctx):
        s = real_stage(self, ctx)
        if self.training:
            seen["stage"].append(s)
        return s

    for method, opt, key, lm_value in (
        ("smoe-dropout", [], "k", 4),  # K grew from top_k=2 to k_max=N=4 over the LM's training
        ("stablemoe", ["--opt", "switch_fraction=0.5"], "stage", 2),  # the LM switched at step 2 of 4
    ):
        lm = tmp_path / method
        assert main(["train", "--data", str(corpus), "--size", "cpu", "--block-size", "16", "--batch-size", "4",
                     "--num-experts", "4", "--steps", "4", "--eval-every", "4", "--eval-tokens", "64",
                     "--test-tokens", "64", "--no-progress", "--method", method, *opt, "--out", str(lm)]) == 0  # fmt: skip
        monkeypatch.setattr(TopKRouter, "current_k", current_k)
        monkeypatch.setattr(StableRouter, "stage", stage)
        seen[key].clear()
        out = tmp_path / f"ft-{method}"
        warnings.simplefilter("error", UserWarning)  # frozen by design: no "does not advance" warning
        assert main(["finetune", "--task", str(reviews), "--from", str(lm), "--steps", "8", "--eval-every", "8",
                     "--no-progress", "--out", str(out)]) == 0  # fmt: skip
        monkeypatch.undo()
        warnings.resetwarnings()
        assert seen[key] and set(seen[key]) == {lm_value}, (method, seen[key])
        # the fine-tuned model keeps that routing when loaded
        ctx = next(m.ctx for m in load(out).modules() if getattr(m, "ctx", None) is not None)
        assert (ctx.step, ctx.total_steps) == (4, 4)


@pytest.mark.parametrize("adapter", ["lora", "replora"])
def test_finetune_with_an_adapter_trains_only_the_adapter_and_the_head(
    pretrained, reviews, tmp_path, adapter
):
    import yaml

    out = tmp_path / adapter
    args = ["finetune", "--task", str(reviews), "--from", str(pretrained), "--out", str(out), "--steps", "3",
            "--batch-size", "8", "--no-progress", "--adapter", adapter, "--rank", "2", "--fraction", "0.25"]  # fmt: skip
    assert main(args) == 0
    recorded = yaml.safe_load((out / "config.yaml").read_text())["recorded"]
    d = 64  # the cpu preset's width; the head is Linear(d, d) + Linear(d, 2)
    head = d * d + d + d * 2 + 2
    assert recorded["train_rows"] == 16  # 25 % of the 64 training rows
    assert head < recorded["trainable_params"] < head + 20_000
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0 <= metrics["test_acc"] <= 100
    import moelab
    from moelab.adapters import adapter_config

    back = moelab.load(out)  # the best weights rebuild with their adapter
    assert adapter_config(back.lm)["kind"] == adapter and adapter_config(back.lm)["rank"] == 2


@pytest.mark.parametrize("adapter,share", [("lora", False), ("replora", True)])
def test_finetune_adapts_the_experts_and_routers_with_targets_and_rebuilds_the_best_weights(
    pretrained, reviews, tmp_path, adapter, share
):
    import moelab
    from moelab.adapters import adapter_config, adapter_parameters

    out = tmp_path / adapter
    args = ["finetune", "--task", str(reviews), "--from", str(pretrained), "--out", str(out), "--steps", "2",
            "--batch-size", "8", "--no-progress", "--adapter", adapter, "--rank", "2", "--fraction", "0.25",
            "--targets", "experts,router", *(["--share-experts"] if share else [])]  # fmt: skip
    assert main(args) == 0
    back = moelab.load(out)  # the best weights rebuild with their adapter
    cfg = adapter_config(back.lm)
    assert cfg["kind"] == adapter and cfg.get("share_experts", False) == share
    assert cfg["targets"][:3] == [
        "blocks.0.ffn.router",
        "blocks.0.ffn.experts.up",
        "blocks.0.ffn.experts.down",
    ]
    trained = [
        n
        for n, p in adapter_parameters(back.lm).items()
        if p.abs().sum() > 0 and n.endswith(("B", "phi2.2.weight"))
    ]
    assert trained  # the expert / router updates moved from zero
    assert not any(".attn." in t for t in cfg["targets"])


def test_finetune_targets_flags_are_checked(pretrained, reviews, tmp_path, capsys):
    base = ["finetune", "--task", str(reviews), "--from", str(pretrained), "--out", str(tmp_path / "o")]
    capsys.readouterr()
    assert main([*base, "--adapter", "lora", "--targets", "experts,mlp"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.endswith(
            "--targets='experts,mlp' is not allowed; expected distinct names of attention, experts, router, comma-separated"
        )
        and len(err.splitlines()) == 1
    )
    assert main([*base, "--targets", "experts"]) == 2
    assert "--targets='experts' is not allowed with --adapter none; it says what an adapter adapts" in (
        capsys.readouterr().err
    )
    assert main([*base, "--adapter", "lora", "--share-experts"]) == 2
    assert "--share-experts is not allowed with --targets='attention'; it shares the experts' update" in (
        capsys.readouterr().err
    )
    assert main([*base, "--adapter", "lora", "--targets", "router", "--rank", "5"]) == 2
    assert capsys.readouterr().err.endswith("4x64 router weights has rank at most 4; expected --rank <= 4\n")
    assert not (tmp_path / "o").exists()


def test_finetune_adapter_flags_are_checked(pretrained, reviews, tmp_path, capsys):
    base = ["finetune", "--task", str(reviews), "--from", str(pretrained), "--out", str(tmp_path / "o")]
    assert main([*base, "--rank", "4"]) == 2
    assert "--rank=4 is not allowed with --adapter none" in capsys.readouterr().err
    assert main([*base, "--adapter", "dora"]) == 2
    assert "dora" in capsys.readouterr().err
    assert main([*base, "--fraction", "0"]) == 2
    assert "fraction" in capsys.readouterr().err


def test_subsample_train_keeps_a_seeded_fraction_of_the_training_rows(reviews):
    from moelab.data.classification import subsample_train

    data = read_table(reviews)
    part = subsample_train(data, 0.3, seed=1)
    assert len(part.labels["train"]) == round(0.3 * 64) and part.texts["test"] == data.texts["test"]
    assert set(part.texts["train"]) <= set(data.texts["train"])
    assert subsample_train(data, 0.3, seed=1).texts == part.texts != subsample_train(data, 0.3, seed=2).texts
    with pytest.raises(ValueError, match=r"fraction=1.5 is not allowed; expected a number in \(0, 1\]"):
        subsample_train(data, 1.5)


def test_finetune_trains_only_the_experts_and_the_new_head_by_default(pretrained, reviews, tmp_path, capsys):
    # CompeteSMoE (2024) §6.3: "we freeze the router and only optimize the experts' parameters"
    import yaml

    from moelab.io.model import load

    base = ["finetune", "--task", str(reviews), "--from", str(pretrained), "--steps", "2", "--no-progress"]
    assert main([*base, "--out", str(tmp_path / "experts")]) == 0
    assert main([*base, "--trainable", "trunk", "--out", str(tmp_path / "trunk")]) == 0
    lm = load(pretrained)
    tuned = {name: load(tmp_path / name) for name in ("experts", "trunk")}
    changed = {
        name: {n for n, p in model.lm.named_parameters() if not torch.equal(p, lm.state_dict()[n])}
        for name, model in tuned.items()
    }
    assert changed["experts"] and all(".ffn.experts." in n for n in changed["experts"])
    assert any(".attn." in n for n in changed["trunk"]) and not any(".router." in n for n in changed["trunk"])
    recorded = {
        name: yaml.safe_load((tmp_path / name / "config.yaml").read_text())["recorded"] for name in tuned
    }
    experts = sum(p.numel() for n, p in lm.named_parameters() if ".ffn.experts." in n)
    head = sum(p.numel() for n, p in tuned["experts"].named_parameters() if n.startswith("fc"))
    assert recorded["experts"]["trainable_params"] == experts + head
    assert recorded["trunk"]["trainable_params"] > experts + head
    capsys.readouterr()
    assert main([*base, "--adapter", "lora", "--trainable", "trunk", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert (
        "--trainable='trunk' is not allowed with --adapter lora" in err and len(err.strip().splitlines()) == 1
    )


def test_finetune_refuses_a_batch_beyond_the_machines_memory(pretrained, reviews, tmp_path, capsys):
    out = tmp_path / "ft"
    assert main(["finetune", "--task", str(reviews), "--from", str(pretrained), "--batch-size", "4096000000",
                 "--out", str(out)]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert (
        "--batch-size=4096000000 is not allowed here: the model, its training state and a batch would need"
        in err
    )
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_finetune_repeats_bit_for_bit_under_its_seed_and_is_silent_about_the_frozen_routing(
    pretrained, reviews, tmp_path
):
    import warnings

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"good movie {i}. bad film {i}.\n" for i in range(200)))
    lm = tmp_path / "lm"  # a method whose routing depends on the step (the competition schedule)
    assert main(["train", "--data", str(corpus), "--size", "cpu", "--block-size", "16", "--batch-size", "4",
                 "--num-experts", "4", "--steps", "2", "--eval-every", "2", "--eval-tokens", "64",
                 "--test-tokens", "64", "--no-progress", "--method", "competesmoe", "--out", str(lm)]) == 0  # fmt: skip
    logs = []
    for i in range(2):
        out = tmp_path / f"ft{i}"
        args = ["finetune", "--task", str(reviews), "--from", str(lm), "--steps", "2", "--no-progress",
                "--out", str(out)]  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "trains without a RoutingContext" warning
            assert main(args) == 0
        logs.append([line.split(",")[:3] for line in (out / "log.csv").read_text().splitlines()])
    assert logs[0] == logs[1]


def test_finetune_refuses_an_out_that_is_its_lm_or_holds_its_task_file_and_deletes_nothing(
    pretrained, reviews, tmp_path, capsys
):
    import shutil

    lm = tmp_path / "lm"
    shutil.copytree(pretrained, lm)
    before = sorted(p.relative_to(lm).as_posix() for p in lm.rglob("*"))
    capsys.readouterr()
    args = ["finetune", "--task", str(reviews), "--from", str(lm), "--steps", "2", "--no-progress"]
    assert main([*args, "--out", str(lm), "--force"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"moelab finetune: error: --out {str(lm)!r} is the input --from of the command: the run would write "
        "over what it reads (and --force remove it); choose another --out\n"
    )
    assert sorted(p.relative_to(lm).as_posix() for p in lm.rglob("*")) == before
    task = lm / "task.csv"  # the --task file next to the run's files
    shutil.copy(reviews, task)
    assert (
        main(["finetune", "--task", str(task), "--from", str(pretrained), "--out", str(lm), "--force"]) == 2
    )
    assert (
        f"--task {str(task)!r} lies in --out {str(lm)!r}: the run would write over" in capsys.readouterr().err
    )
    assert task.exists()


def test_finetune_refuses_an_adapter_rank_above_the_projections_and_epochs_that_cannot_finish(
    pretrained, reviews, tmp_path, capsys
):
    out = tmp_path / "o"
    base = ["finetune", "--task", str(reviews), "--from", str(pretrained), "--out", str(out), "--no-progress"]
    capsys.readouterr()
    assert main([*base, "--adapter", "replora", "--rank", "100000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "moelab finetune: error: --rank=100000 is not allowed with --from "
    ) and err.endswith("Q and V projections has rank at most 64; expected --rank <= 64\n")
    assert not out.exists()
    assert main([*base, "--epochs", "1e9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "moelab finetune: error: --epochs=1000000000.0 is not allowed here: "
    ) and err.endswith("steps, more than 1,000,000,000, which cannot finish; expected a smaller --epochs\n")
    assert main([*base, "--epochs", "1e20"]) == 2
    assert "--epochs=1e+20 is not allowed; expected a number in (0, 1000000000]" in capsys.readouterr().err
