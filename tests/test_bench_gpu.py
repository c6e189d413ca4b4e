"""``moelab bench suite --device cuda`` without a GPU: the case list, the d_model scaling, the
argument validation in one line, and one tiny case end to end on the CPU (the same
code path with ``perf_counter`` in place of CUDA events; no timing is asserted)."""

from __future__ import annotations

import argparse
import importlib.util
import re

import pytest
import torch

from moelab.bench import gpu
from moelab.cli import main

GIB = 2**30


def test_gpu_case_list_covers_models_tokens_dtypes_and_routings():
    cases = gpu.build_gpu_cases(
        list(gpu.MODELS), list(gpu.GPU_TOKENS), ["bfloat16", "float32"], ["balanced", "zipf"], 4096
    )
    # 4 models x (4 bfloat16 T + the one float32 T <= 4096) x 2 routings
    assert len(cases) == 4 * 5 * 2
    assert {c.tokens for c in cases if c.dtype == "bfloat16"} == {4096, 8192, 16384, 32768}
    assert {c.tokens for c in cases if c.dtype == "float32"} == {4096}
    shapes = {(c.model, c.d_model, c.d_hidden, c.num_experts, c.top_k, c.shared) for c in cases}
    assert shapes == {
        ("mixtral", 4096, 14336, 8, 2, 0),
        ("olmoe", 2048, 1024, 64, 8, 0),
        ("qwen3", 2048, 768, 128, 8, 0),
        ("deepseek-v3", 7168, 2048, 256, 8, 1),
    }
    # run order: model, dtype, T, routing (modules are built once per model and dtype)
    assert [c.model for c in cases[:10]] == ["mixtral"] * 10
    assert len({c.key for c in cases}) == len(cases)


def test_d_model_is_halved_only_where_memory_needs_it():
    ds = gpu.MODELS["deepseek-v3"]
    assert gpu.fit_d_model(ds, 32768, "bfloat16", 80 * GIB) == 3584  # H100: 2 x 22 GiB weights + activations
    assert gpu.fit_d_model(ds, 32768, "bfloat16", 141 * GIB) == 7168  # H200
    assert gpu.fit_d_model(ds, 32768, "bfloat16", None) == 7168
    for name in ("mixtral", "olmoe", "qwen3"):
        shape = gpu.MODELS[name]
        assert gpu.fit_d_model(shape, 32768, "bfloat16", 80 * GIB) == shape.d_model
    cases = gpu.build_gpu_cases(["deepseek-v3"], [4096], ["float32"], ["zipf"], 4096, memory=80 * GIB)
    assert cases[0].d_model == 3584 and "scaled from 7168" in cases[0].key
    assert gpu.memory_estimate(ds, 3584, 32768, "bfloat16") < gpu.memory_estimate(ds, 7168, 32768, "bfloat16")


GPU_ARGS = ["bench", "suite", "--device", "cuda"]
#: the documented keys of a GPU case record and of its rows (docs/performance-gpu.md, "The GPU grid")
CASE_KEYS = {
    "model",
    "tokens",
    "dtype",
    "routing",
    "d_model",
    "d_hidden",
    "num_experts",
    "top_k",
    "shared",
    "d_model_preset",
    "key",
    "load",
    "rounds",
    "seconds",
    "notes",
    "rows",
}
ROW_KEYS = {
    "name",
    "phase",
    "median_ms",
    "min_ms",
    "max_ms",
    "rounds",
    "ratio_to_dense",
    "flops_per_token",
    "tflops",
    "peak_fraction",
    "peak_mib",
    "note",
}


@pytest.mark.parametrize(
    ("flag", "value", "match"),
    [
        (
            "--models",
            "gpt4",
            r"--models='gpt4' is not allowed; expected one of \['mixtral', 'olmoe', 'qwen3', 'deepseek-v3'\]",
        ),
        (
            "--dtype",
            "float16",
            r"--dtype='float16' is not allowed; expected one of \['bfloat16', 'float32'\]",
        ),
        ("--tokens", "0", r"--tokens=0 is not allowed; expected a positive integer"),
        ("--routing", "skewed", r"--routing='skewed' is not allowed; expected one of \['balanced', 'zipf'\]"),
        (
            "--gpu-peers",
            "deepspeed",
            r"--gpu-peers='deepspeed' is not allowed; expected one of \['transformers', 'megablocks', 'torchtitan', 'sonic-moe'\]",
        ),
        ("--fp32-max-tokens", "0", r"--fp32-max-tokens=0 is not allowed; expected a positive integer"),
        ("--repeats", "0", r"--repeats=0 is not allowed; expected an integer in \[1, 1000000000\]"),
        ("--budget", "-1", r"--budget=-1.0 is not allowed; expected a number > 0"),
    ],
)
def test_gpu_suite_rejects_bad_values_in_one_line_before_looking_for_a_device(capsys, flag, value, match):
    assert main([*GPU_ARGS, flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moelab bench: error: ") and err.count("\n") == 1
    assert re.search(match, err), err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [(["--shapes", "8x2x64"], "--shapes"), (["--clock", "cpu"], "--clock"), (["--resume"], "--resume")],
)
def test_gpu_suite_refuses_cpu_grid_options_naming_them(capsys, argv, flag):
    assert main([*GPU_ARGS, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"moelab bench: error: {flag} is not allowed with --device cuda; it is an option of the CPU grid"
    )


def test_gpu_suite_refuses_float32_only_with_no_case_left(capsys):
    assert main([*GPU_ARGS, "--dtype", "float32", "--tokens", "8192", "--fp32-max-tokens", "4096"]) == 2
    assert "--fp32-max-tokens=4096 leaves no case" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_gpu_suite_without_a_device_says_so_in_one_line(capsys):
    assert main([*GPU_ARGS, "--models", "olmoe", "--tokens", "4096"]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == "moelab bench: error: --device='cuda' is not allowed here: torch sees no CUDA device; use --device cpu\n"
    )


def test_gpu_suite_refuses_to_overwrite_out_without_force(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    out.write_text("{}")
    assert main([*GPU_ARGS, "--out", str(out)]) == 2
    assert f"--out={str(out)!r} exists; pass --force to overwrite it" in capsys.readouterr().err
    assert out.read_text() == "{}"


@pytest.mark.parametrize(("flag", "value"), [("--models", "olmoe"), ("--gpu-peers", "none")])
def test_cpu_suite_refuses_gpu_only_options(capsys, flag, value):
    assert main(["bench", "suite", "--tokens", "4", flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{flag}={value!r} is not allowed with --device cpu; it is an option of --device cuda" in err


def test_parse_gpu_grid_fills_the_gpu_defaults():
    from moelab.bench.suite import SUITE, namespace
    from moelab.experiments import runner

    args = namespace(runner.new_config(SUITE, {"device": "cuda"}))
    cases = gpu.parse_gpu_grid(args)
    assert args.repeats == 7 and args.budget == 15.0
    assert args.gpu_grid["models"] == list(gpu.MODELS) and args.gpu_grid["tokens"] == list(gpu.GPU_TOKENS)
    assert args.gpu_grid["peers"] == list(gpu.GPU_PEERS)
    assert len(cases) == 40


def test_one_gpu_case_runs_end_to_end_on_the_cpu():
    case = gpu.GpuCase("olmoe", 48, "float32", "zipf", 16, 8, 4, 2, 0, 16)
    args = argparse.Namespace(seed=0, repeats=3, warmup=1, budget=30.0, memory=True)
    group = gpu._Group(case, ["transformers", "megablocks"], torch.device("cpu"), 0)
    record = gpu.run_case(case, group, args, 989.4, torch.device("cpu"))
    assert set(record) == CASE_KEYS
    names = {r["name"] for r in record["rows"]}
    assert {"dense", "moelab grouped"} <= names
    if importlib.util.find_spec("transformers") is not None:
        assert "transformers grouped_mm" in names
        # it holds moelab's parameters: same function, no parity note
        assert not [n for n in record["notes"] if n.startswith("transformers grouped_mm: output differs")]
    if importlib.util.find_spec("megablocks") is None:
        assert "megablocks skipped: not installed" in group.notes
    for r in record["rows"]:
        assert set(r) == ROW_KEYS
        assert r["peak_mib"] is not None and r["peak_mib"] >= 0
        assert r["phase"] in ("fwd", "fwd+bwd") and r["rounds"] == record["rounds"] >= 3
        assert r["flops_per_token"] == 2 * 2 * 3 * 16 * 8  # K=2 SwiGLU experts of d=16, h=8
        factor = 3 if r["phase"] == "fwd+bwd" else 1
        assert r["tflops"] == pytest.approx(
            r["flops_per_token"] * 48 * factor / (r["median_ms"] / 1e3) / 1e12
        )
        assert r["peak_fraction"] == pytest.approx(r["tflops"] / 989.4)
        if r["name"] == "dense":
            assert r["ratio_to_dense"] == 1.0
    doc = {"machine": {"gpu": "cpu", "torch": torch.__version__}, "config": vars(args), "cases": [record]}
    table = gpu.markdown_table(doc)
    assert table.count("| olmoe | 48 | float32 | zipf | 16 |") == len(record["rows"])


def test_the_torchtitan_peer_is_titan_moe_on_tokens():
    pytest.importorskip("torchtitan.models.common.moe")  # torchtitan 0.3 (requirements-titan.txt)
    from moelab import MoE
    from moelab.bench.peers import GPU_PEER_ADAPTERS
    from moelab.train.titan import titan_moe

    torch.manual_seed(0)
    layer = MoE(16, 4, 2, d_hidden=8, activation="swiglu", method="smoe", num_shared=1).eval()
    peer = GPU_PEER_ADAPTERS["torchtitan"][1](layer, torch.float32)  # its aux losses are not the peer's
    assert layer.coefs  # the layer keeps them
    plain = MoE(
        16, 4, 2, d_hidden=8, activation="swiglu", method="smoe", num_shared=1, balance_coef=0.0, z_coef=0.0
    )
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(24, 16)
    with torch.no_grad():  # (T, d) in and out; titan_moe's agreement with the layer: test_titan.py
        assert torch.equal(peer(x), titan_moe(plain.eval())(x.unsqueeze(0)).squeeze(0))
