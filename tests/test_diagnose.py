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
            "--test-tokens", "64", "--ckpt-every", "1", "--keep-ckpts", "all", "--no-progress",
            "--out", str(out)]  # fmt: skip
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
    weight_entropies = [[] for _ in layers]

    def record(i):
        def hook(module, args, output):  # returns None: the output is unchanged
            r = module.last_routing
            entropies[i].append(-(r.probs * r.probs.log()).sum(-1))
            loads[i].add_(torch.bincount(r.indices.flatten(), minlength=4).float())
            w = r.weights / r.weights.sum(-1, keepdim=True)
            weight_entropies[i].append(-(w * w.log()).sum(-1))

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
    # Jain's index, the selection-frequency and top-K-weight entropies, the router entropy's spread
    assert d["jain"] == pytest.approx([float(s.sum() ** 2 / (4 * (s * s).sum())) for s in shares], rel=1e-5)
    assert d["selection_entropy"] == pytest.approx(
        [float(-(s[s > 0] * s[s > 0].log()).sum()) for s in shares], rel=1e-5
    )
    assert d["topk_weight_entropy"] == pytest.approx(
        [float(torch.cat(e).mean()) for e in weight_entropies], rel=1e-5
    )
    assert d["router_entropy_sd"] == pytest.approx(
        [float(torch.cat(e).std(unbiased=False)) for e in entropies], rel=1e-4
    )
    assert d["jain_mean"] == pytest.approx(sum(d["jain"]) / len(layers))
    assert d["tokens_used"] == 256 and d["bpc"] == pytest.approx(task.evaluate(model, "test", 256)["bpc"])
    # the swap tests: the same evaluation with the swapped routing
    with torch.no_grad(), metrics.swap_top1(model, 1):
        swapped = task.evaluate(model, "test", len(batches) * 16 * 16)["bpc"]
    assert d["swap_topk_bpc"] == pytest.approx(swapped) and d["swap_topk_delta"] == pytest.approx(
        swapped - d["bpc"]
    )
    assert 0 <= d["competition_overlap_mean"] <= 2
    assert d["expert_change_between"] == ["step-00000003", "step-00000004"]
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
    assert "routing diagnostics (moelab diagnose, on the first 128 test tokens)" in text
    assert "router_entropy_mean" in text and "  jain_mean\n" in text and "  saturation_area\n" in text
    assert (tmp_path / "rep" / "diagnostics_curves.png").is_file()
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


def test_diagnose_curves_come_from_every_kept_checkpoint_and_match_the_metrics(run_dir, corpus, capsys):
    assert main(["diagnose", str(run_dir), "--tokens", "200"]) == 0
    text = capsys.readouterr().out
    d = json.loads((run_dir / "diagnostics.json").read_text())
    task = LMTask(load_text(str(corpus)), 16)
    batches = _batches(task, 200)
    ckpts = [moelab.load(run_dir / "ckpt" / f"step-{s:08d}") for s in (1, 2, 3, 4)]
    assert d["curve_steps"] == [1, 2, 3, 4] and d["tokens_used"] == 192
    for i, model in enumerate(ckpts):
        assert d["saturation"][i] == pytest.approx(metrics.router_saturation(model, ckpts[-1], batches))
        assert d["jain_curve"][i] == pytest.approx(
            [row["jain"] for row in metrics.routing_balance(model, batches)]
        )
    assert d["saturation"][-1] == [1.0, 1.0] and d["change_rate"][0] is None
    for i in (1, 2, 3):
        assert d["change_rate_mean"][i] == pytest.approx(
            metrics.expert_change_rate(ckpts[i - 1], ckpts[i], batches)
        )
        assert d["change_rate_mean"][i] == pytest.approx(sum(d["change_rate"][i]) / 2)
    assert d["expert_change_rate"] == d["change_rate_mean"][-1]
    assert d["saturation_area"] == pytest.approx(sum(d["saturation_mean"][:3]) / 3)
    # the figures, and how many test tokens each one used
    assert d["figures"] == {"diagnostics_curves.png": 192, "router_distributions.png": 16}
    for name in d["figures"]:
        assert (run_dir / name).read_bytes().startswith(b"\x89PNG")
    assert "everything on the first 192 test tokens" in text
    assert "diagnostics_curves.png: first 192 test tokens" in text
    assert "router_distributions.png: first 16 test tokens" in text
    probs = metrics.router_distributions(moelab.load(run_dir), batches[0][:1])
    assert [p.shape for p in probs] == [(16, 4), (16, 4)]


def test_diagnose_without_two_checkpoints_says_it_draws_no_curves(run_dir, tmp_path, capsys, monkeypatch):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    for step in (1, 2, 3):
        shutil.rmtree(run / "ckpt" / f"step-{step:08d}")
    (run / "diagnostics_curves.png").write_bytes(
        b"\x89PNG"
    )  # as an earlier diagnose with every checkpoint left it
    assert main(["diagnose", str(run), "--tokens", "64"]) == 0
    assert (
        "no curves over training (fewer than two checkpoints: train with --ckpt-every N --keep-ckpts all)"
        in (capsys.readouterr().out)
    )
    d = json.loads((run / "diagnostics.json").read_text())
    assert d["expert_change_rate"] is None and d["saturation_area"] is None and "saturation" not in d
    assert d["figures"] == {"router_distributions.png": 16} and not (run / "diagnostics_curves.png").exists()
    assert main(["report", str(run), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert (
        "expert_change_rate (fewer than two kept checkpoints: train with --ckpt-every N --keep-ckpts all)"
        in out
    )
    assert (
        "\n  expert_change_rate\n" not in out and not (tmp_path / "rep" / "diagnostics_curves.png").exists()
    )
    # a router without a distribution (pure competition): no heatmap, and the output says so
    monkeypatch.setattr(metrics, "router_distributions", lambda model, batch: [None, None])
    assert main(["diagnose", str(run), "--tokens", "64"]) == 0
    assert (
        "router_distributions.png: not drawn (no MoE layer has a router distribution)"
        in capsys.readouterr().out
    )
    assert json.loads((run / "diagnostics.json").read_text())["figures"] == {}
    assert not (run / "router_distributions.png").exists()


def test_curves_of_a_router_whose_k_grows_compare_with_the_final_choices(corpus, tmp_path):
    out = tmp_path / "dropout"
    argv = ["train", "--data", str(corpus), "--size", "cpu", "--block-size", "16", "--batch-size", "4",
            "--num-experts", "4", "--steps", "4", "--eval-every", "2", "--eval-tokens", "64", "--test-tokens",
            "64", "--ckpt-every", "1", "--keep-ckpts", "all", "--no-progress", "--method", "smoe-dropout",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert main(["diagnose", str(out), "--tokens", "64"]) == 0
    d = json.loads((out / "diagnostics.json").read_text())
    batches = _batches(LMTask(load_text(str(corpus)), 16), 64)
    first, final = (moelab.load(out / "ckpt" / f"step-{s:08d}") for s in (1, 4))
    a = [torch.cat(x) for x in zip(*[metrics.active_choices(first, b) for b in batches])]
    b = [torch.cat(x) for x in zip(*[metrics.active_choices(final, b) for b in batches])]
    assert a[0].shape[1] < b[0].shape[1]  # K grew between the two checkpoints
    for layer, (x, y) in enumerate(zip(a, b)):  # |A ∩ B| / (T · K_final), every choice active
        hits = (x.unsqueeze(-1) == y.unsqueeze(-2)).any(-1).sum()
        assert d["saturation"][0][layer] == pytest.approx(float(hits) / y.numel())
    assert d["saturation"][-1] == [1.0, 1.0]


def test_report_refuses_diagnostics_of_weights_the_run_no_longer_holds_and_benchmark_diagnoses_again(
    corpus, tmp_path, capsys
):
    from moelab.bench.routers import _diagnosed

    run = tmp_path / "run"
    argv = ["train", "--data", str(corpus), "--size", "cpu", "--block-size", "16", "--batch-size", "4",
            "--num-experts", "4", "--steps", "2", "--eval-every", "2", "--eval-tokens", "64",
            "--test-tokens", "64", "--ckpt-every", "1", "--keep-ckpts", "all", "--no-progress",
            "--out", str(run)]  # fmt: skip
    assert main(argv) == 0
    assert main(["diagnose", str(run), "--tokens", "64"]) == 0
    assert main(["report", str(run), "--out", str(tmp_path / "r1")]) == 0
    assert _diagnosed(run, 64)
    # trained on with other settings: the diagnostics describe the old model
    assert main([*argv[:-2], "--steps", "4", "--eval-every", "4", "--out", str(run), "--resume",
                 "--allow-changes"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["report", str(run), "--out", str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"moelab report: error: {run / 'diagnostics.json'} describes other weights than the run holds now "
        f"(it was trained on after moelab diagnose); run moelab diagnose {run} again\n"
    )
    assert not _diagnosed(run, 64)  # benchmark's phase 2 diagnoses it again
    assert main(["diagnose", str(run), "--tokens", "64"]) == 0
    assert main(["report", str(run), "--out", str(tmp_path / "r3")]) == 0


def test_an_edited_metrics_or_diagnostics_json_is_refused_in_one_line(run_dir, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    assert main(["diagnose", str(run), "--tokens", "64"]) == 0
    for name, key in (("diagnostics.json", "jain_mean"), ("metrics.json", "test_bpc")):
        path = run / name
        original = path.read_bytes()
        d = json.loads(original)
        path.write_text(json.dumps({**d, key: 0.123}, indent=2) + "\n")
        capsys.readouterr()
        assert main(["report", str(run), "--out", str(tmp_path / f"r-{name}")]) == 2
        err = capsys.readouterr().err
        assert (
            f"{str(path)!r} was changed after moelab wrote it (its sha256 is not the one recorded in " in err
        )
        assert len(err.strip().splitlines()) == 1
        path.write_bytes(original)
    assert main(["report", str(run), "--out", str(tmp_path / "r-ok")]) == 0


def test_force_removes_what_diagnose_and_report_wrote_into_a_run(run_dir, corpus, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    assert main(["diagnose", str(run), "--tokens", "64"]) == 0
    assert main(["report", str(run)]) == 0  # into run/report
    assert (run / "diagnostics.json").is_file() and (run / "report" / "results.csv").is_file()
    argv = ["train", "--data", str(corpus), "--size", "cpu", "--block-size", "16", "--batch-size", "4",
            "--num-experts", "4", "--steps", "2", "--eval-every", "2", "--eval-tokens", "64",
            "--test-tokens", "64", "--no-progress", "--out", str(run), "--force"]  # fmt: skip
    assert main(argv) == 0
    assert not (run / "diagnostics.json").exists() and not (run / "report").exists()


@pytest.mark.slow  # ~15 s: trains a run; test_metrics_routing.py has the fast counterpart
def test_diagnose_counts_deepseek_v4_hash_layers_as_routers_with_no_learnable_routing(corpus, tmp_path):
    """A hash layer's choice is its token id table: it is a router (every per-layer diagnostic has its
    row) whose choice no parameter learns (``routing_parameters`` 0; its gate still learns the weights);
    the swap tests shift the scored layers' ranks and leave the table's choice as it is."""
    out = tmp_path / "v4"
    argv = ["train", "--data", str(corpus), "--size", "cpu", "--block-size", "16", "--batch-size", "4",
            "--num-experts", "4", "--steps", "2", "--eval-every", "2", "--eval-tokens", "64", "--test-tokens",
            "64", "--no-progress", "--method", "deepseek-v4", "--opt", "hash_layers=1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert main(["diagnose", str(out), "--tokens", "64"]) == 0
    d = json.loads((out / "diagnostics.json").read_text())
    model = moelab.load(out)
    layers = model.moe_layers
    assert [layer.router.hashed for layer in layers] == [True, False]
    d_model = layers[1].d_model
    assert d["routing_parameters"] == [0, 4 * d_model] == metrics.routing_parameters(model)
    assert len(d["router_entropy"]) == len(d["load_cv"]) == len(d["jain"]) == 2
    assert d["swap_top1_delta"] is not None and d["swap_topk_delta"] is not None
    # within the swap, the hash layer routes by its table, the scored layer by its K+1 ranks less the top-1
    ids = _batches(LMTask(load_text(str(corpus)), 16), 64)[0]
    with torch.no_grad():
        own = metrics.active_choices(model, ids)
        with metrics.swap_top1(model, 0):
            swapped = metrics.active_choices(model, ids)
    assert torch.equal(swapped[0], own[0]) and torch.equal(
        swapped[0], layers[0].router.tid2eid[ids.reshape(-1)]
    )
    assert torch.equal(swapped[1][:, 0], own[1][:, 1])  # the former 2nd is now first
