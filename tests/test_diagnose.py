"""``moelab diagnose``: each diagnostic of a trained run against a direct computation."""

from __future__ import annotations

import json

import pytest
import torch

import moelab
from moelab import metrics
from moelab.cli import main
from moelab.data.text import load_text
from moelab.experiments.diagnose import _batches
from moelab.train.tasks import LMTask


@pytest.fixture(scope="module")
def run_dir(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("diag") / "run"
    argv = ["train", "--data", str(corpus), "--size", "cpu", "--block-size", "16", "--batch-size", "4",
            "--num-experts", "4", "--steps", "4", "--eval-every", "2", "--eval-tokens", "64",
            "--test-tokens", "64", "--ckpt-every", "2", "--no-progress", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    return out


def test_diagnose_writes_every_diagnostic_and_each_matches_a_direct_computation(run_dir, corpus, capsys):
    assert main(["diagnose", str(run_dir), "--tokens", "256"]) == 0
    assert "wrote diagnostics.json in 1 run(s)" in capsys.readouterr().out
    d = json.loads((run_dir / "diagnostics.json").read_text())
    model = moelab.load(run_dir)
    task = LMTask(load_text(str(corpus)), model.cfg.block_size)
    batches = _batches(task, 256)
    layers = [m for m in model.modules() if isinstance(m, moelab.MoE)]
    # router entropy and load, by hand from each layer's routing
    entropies, loads = [[] for _ in layers], [torch.zeros(4) for _ in layers]

    def record(i):
        def hook(module, args, output):  # returns None: the output is unchanged
            r = module.last_routing
            entropies[i].append(-(r.probs * r.probs.log()).sum(-1))
            loads[i].add_(torch.bincount(r.indices.flatten(), minlength=4).float())

        return hook

    hooks = [layer.register_forward_hook(record(i)) for i, layer in enumerate(layers)]
    with torch.no_grad(), moelab.recording_routing(model):  # an inference forward keeps none unless asked
        model.eval()
        for b in batches:
            model(b)
    for h in hooks:
        h.remove()
    assert d["router_entropy"] == pytest.approx([float(torch.cat(e).mean()) for e in entropies], rel=1e-5)
    shares = [load / load.sum() for load in loads]
    assert d["load_cv"] == pytest.approx([float(s.std(unbiased=False) / s.mean()) for s in shares], rel=1e-5)
    assert d["load_cv_mean"] == pytest.approx(sum(d["load_cv"]) / len(layers))
    assert d["max_vio"] == pytest.approx([float(s.max() / s.mean() - 1) for s in shares], rel=1e-5)
    assert d["max_vio_mean"] == pytest.approx(sum(d["max_vio"]) / len(layers))
    # the swap tests: the same evaluation with the swapped routing
    with torch.no_grad(), metrics.swap_top1(model, 1):
        swapped = task.evaluate(model, "test", len(batches) * 16 * 16)["bpc"]
    assert d["swap_topk_bpc"] == pytest.approx(swapped) and d["swap_topk_delta"] == pytest.approx(
        swapped - d["bpc"]
    )
    assert 0 <= d["competition_overlap_mean"] <= 2
    assert d["expert_change_between"] == ["step-00000002", "step-00000004"]
    assert 0 <= d["expert_change_rate"] <= 1
    assert len(d["expert_output_norms"]) == len(layers) and len(d["expert_output_norms"][0]) == 4


def test_swap_of_the_kth_expert_keeps_the_top_ones_and_takes_the_next():
    torch.manual_seed(0)
    layer = moelab.MoE(8, 6, 3, method="smoe").eval()
    x = torch.randn(10, 8)
    ranked = layer.router.logits(x).topk(4, dim=-1).indices
    with torch.no_grad(), metrics.swap_top1(layer, rank=2), moelab.recording_routing(layer):
        layer(x)
    assert torch.equal(layer.last_routing.indices, ranked[:, [0, 1, 3]])
    assert not isinstance(layer.router, metrics.SwappedRouter) and layer.router.top_k == 3
    with pytest.raises(ValueError, match=r"rank=3 is not allowed; expected an integer in \[0, 2\]"):
        with metrics.swap_top1(layer, rank=3):
            pass


def test_diagnose_refuses_what_is_not_a_run(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is not a moelab train run (no config.yaml)" in err and len(err.strip().splitlines()) == 1


def test_report_tabulates_the_diagnostics_over_runs(run_dir, tmp_path, capsys):
    assert main(["diagnose", str(run_dir), "--tokens", "128"]) == 0
    capsys.readouterr()
    assert main(["report", str(run_dir), "--out", str(tmp_path / "rep")]) == 0
    text = capsys.readouterr().out
    assert "routing diagnostics (moelab diagnose)" in text and "router_entropy_mean" in text
    assert (tmp_path / "rep" / "diagnostics.csv").read_text().startswith("diagnostic,group,mean,sd,n,p")


def test_diagnose_refuses_changed_data_another_commands_run_and_a_folder_in_its_place(
    run_dir, corpus, tmp_path, capsys
):
    import shutil

    import yaml

    data, run = tmp_path / "data.txt", tmp_path / "run"
    shutil.copy(corpus, data)
    shutil.copytree(run_dir, run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**config, "data": str(data)}, sort_keys=False))
    assert main(["diagnose", str(run), "--tokens", "64"]) == 0
    before = (run / "diagnostics.json").read_bytes()
    data.write_text(data.read_text().replace("cat", "cow"))
    capsys.readouterr()
    assert main(["diagnose", str(run), "--tokens", "64"]) == 2
    err = capsys.readouterr().err
    assert (
        f"--data {str(data)!r} now has sha256" in err and "its diagnostics would describe other data" in err
    )
    assert len(err.strip().splitlines()) == 1 and (run / "diagnostics.json").read_bytes() == before
    shutil.copy(corpus, data)
    (run / "diagnostics.json").unlink()
    (run / "diagnostics.json").mkdir()
    assert main(["diagnose", str(run), "--tokens", "64"]) == 2
    assert "diagnostics.json' exists and is not a file" in capsys.readouterr().err
    (run / "config.yaml").write_text(yaml.safe_dump({**config, "command": "finetune"}, sort_keys=False))
    assert main(["diagnose", str(run), "--tokens", "64"]) == 2
    err = capsys.readouterr().err
    assert f"{run} is a moelab finetune run; diagnose takes language-model runs" in err
