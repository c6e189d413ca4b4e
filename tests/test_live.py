"""The live view of a training run: TensorBoard event files read back with TensorBoard's own reader."""

from __future__ import annotations

import csv

import pytest
import torch

from moelab.data.text import load_text
from moelab.io.rundir import RunDir
from moelab.metrics import jain_index, max_violation
from moelab.models.lm import LMConfig, TransformerLM
from moelab.train import TrainConfig, Trainer, live
from moelab.train.tasks import LMTask

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TINY = dict(block_size=16, n_layer=2, d_model=32, n_head=2, num_experts=4, top_k=2, dropout=0.1)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "t.txt"
    path.write_text("".join(f"sentence number {i} is about {i % 13} cats.\n" for i in range(500)))
    return load_text(str(path))


def train(data, out, *, steps=12, resume=False, stop_at=None, **kwargs):
    """The tiny LM; ``stop_at``: a KeyboardInterrupt while sampling that call (a killed run)."""
    torch.manual_seed(123)
    model = TransformerLM(LMConfig(vocab_size=256, method="smoe", **TINY))
    task = LMTask(data, 16)
    if stop_at is not None:
        sample, calls = task.sample, {"n": 0}

        def interrupted(generator, batch_size, step):
            calls["n"] += 1
            if calls["n"] == stop_at:
                raise KeyboardInterrupt
            return sample(generator, batch_size, step)

        task.sample = interrupted
    cfg = TrainConfig(steps=steps, batch_size=4, eval_every=3, ckpt_every=4, eval_tokens=128, seed=5)
    run = RunDir(out, resume=resume)
    if not resume:
        run.write_config({"test": True})
    return Trainer(model, task, cfg, run, progress=False, **kwargs).fit(resume=resume)


def events(out) -> EventAccumulator:
    reader = EventAccumulator(
        str(out / live.TENSORBOARD_DIR), size_guidance={"scalars": 0, "histograms": 0, "images": 0}
    )
    reader.Reload()
    return reader


def log_rows(out):
    with open(out / "log.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_a_run_writes_its_scalars_load_histograms_and_load_image_for_tensorboard(data, tmp_path):
    train(data, tmp_path / "a", log="tensorboard", log_every=4)
    reader, rows = events(tmp_path / "a"), log_rows(tmp_path / "a")
    tags = reader.Tags()
    for column in ("loss", "aux_loss", "aux_balance", "aux_z", "grad_norm", "lr"):
        assert [e.step for e in reader.Scalars(f"train/{column}")] == list(range(1, 13))
        assert [e.value for e in reader.Scalars(f"train/{column}")] == pytest.approx(
            [float(r[column]) for r in rows], rel=1e-6
        )  # TensorBoard stores float32
    assert [e.value for e in reader.Scalars("routing/max_vio")] == pytest.approx(
        [float(r["max_vio"]) for r in rows], rel=1e-6
    )
    assert [e.step for e in reader.Scalars("valid/bpc")] == [3, 6, 9, 12]
    assert {"load/layer0", "load/layer1"} <= set(tags["histograms"]) and tags["images"] == ["load/layers"]
    for layer in (0, 1):
        hists = reader.Histograms(f"load/layer{layer}")
        assert [h.step for h in hists] == [4, 8, 12]
        for h in hists:  # one bucket per expert; every token slot of the step (4 x 16 tokens, K = 2)
            counts = torch.tensor(h.histogram_value.bucket, dtype=torch.float64)
            assert len(counts) == 4 and counts.sum() == 4 * 16 * 2
        vio = {e.step: e.value for e in reader.Scalars(f"layer{layer}/max_vio")}
        jain = {e.step: e.value for e in reader.Scalars(f"layer{layer}/jain")}
        for h in hists:  # the per-layer diagnostics are those of the histogram's load
            counts = torch.tensor(h.histogram_value.bucket, dtype=torch.float64)
            assert vio[h.step] == pytest.approx(max_violation(counts), rel=1e-6)
            assert jain[h.step] == pytest.approx(jain_index(counts), rel=1e-6)
        assert [e.step for e in reader.Scalars(f"layer{layer}/router_entropy")] == [4, 8, 12]
    layer_mean = [
        sum(reader.Scalars(f"layer{i}/router_entropy")[j].value for i in (0, 1)) / 2 for j in range(3)
    ]  # the per-layer entropies average to the log's layer mean (the training step's, not validation's)
    assert layer_mean == pytest.approx([float(rows[s - 1]["router_entropy"]) for s in (4, 8, 12)], rel=1e-6)
    image = reader.Images("load/layers")[-1]
    assert (image.height, image.width) == (2 * 12, 4 * 12)  # two layers x four experts, 12 px a cell


def test_a_resumed_run_shows_one_curve_equal_to_the_uninterrupted_runs(data, tmp_path):
    train(data, tmp_path / "full", log="tensorboard")
    with pytest.raises(KeyboardInterrupt):
        train(data, tmp_path / "cut", log="tensorboard", stop_at=11)  # killed at step 11, checkpoint at 8
    train(data, tmp_path / "cut", log="tensorboard", resume=True)
    full, cut = events(tmp_path / "full"), events(tmp_path / "cut")
    for tag in ("train/loss", "train/grad_norm", "valid/bpc"):
        assert [(e.step, e.value) for e in cut.Scalars(tag)] == [(e.step, e.value) for e in full.Scalars(tag)]
    assert [h.step for h in cut.Histograms("load/layer0")] == [10, 12]  # step 10 again after the purge


def test_log_csv_writes_no_event_files(data, tmp_path):
    train(data, tmp_path / "a", steps=3, log="csv")
    assert not (tmp_path / "a" / live.TENSORBOARD_DIR).exists() and len(log_rows(tmp_path / "a")) == 3


def test_the_live_view_refuses_what_it_cannot_write(monkeypatch):
    with pytest.raises(
        ValueError, match=r"^log='html' is not allowed; expected one of auto, tensorboard, csv$"
    ):
        live.resolve_log("html")
    with pytest.raises(ValueError, match=r"^log_every=0 is not allowed; expected an integer >= 1$"):
        live.check_every(0)
    monkeypatch.setattr(live, "tensorboard_available", lambda: False)
    assert live.resolve_log("auto") == "csv"
    with pytest.raises(ValueError, match=r"^log='tensorboard' needs the tensorboard package; install it"):
        live.resolve_log("tensorboard")


def test_the_load_image_is_white_at_the_even_share_blue_below_and_red_above():
    image = live.load_image([torch.tensor([1.0, 1.0, 0.0, 2.0]), torch.tensor([0.0, 0.0])])
    cell = image[:, ::12, ::12]  # one pixel per cell
    assert cell.shape == (3, 2, 4)
    assert cell[:, 0, 0].tolist() == [1.0, 1.0, 1.0]  # the even share: white
    assert cell[:, 0, 2].tolist() == [0.0, 0.0, 1.0]  # no slot: blue
    assert cell[:, 0, 3].tolist() == [1.0, 0.0, 0.0]  # twice the even share: red
    assert cell[:, 1, 0].tolist() == [1.0, 1.0, 1.0]  # a layer without tokens: nothing uneven
    assert cell[:, 1, 2].tolist() == [0.5, 0.5, 0.5]  # a narrower layer's missing experts: grey


def test_force_removes_the_event_files_of_the_run_it_replaces(tmp_path):
    from moelab.cli import main

    corpus = tmp_path / "text.txt"
    corpus.write_text("".join(f"line {i} of a small corpus.\n" for i in range(400)))
    argv = [
        "train",
        "--size",
        "cpu",
        "--steps",
        "2",
        "--data",
        str(corpus),
        "--no-progress",
        "--log",
        "tensorboard",
    ]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 0
    first = sorted((tmp_path / "run" / live.TENSORBOARD_DIR).iterdir())
    assert main([*argv, "--out", str(tmp_path / "run"), "--force"]) == 0
    second = sorted((tmp_path / "run" / live.TENSORBOARD_DIR).iterdir())
    assert len(first) == len(second) == 1 and first != second  # the old run's events are gone
