"""``moelab bench lm``: the training-throughput table on the smallest run (no timing is asserted)
and its flags refused in one line."""

from __future__ import annotations

import re

import pytest
import torch

import moelab
from moelab.bench.lm import format_throughput
from moelab.cli import main


def test_bench_lm_prints_tokens_per_second_and_the_ratio_to_dense(capsys):
    assert main(["bench", "lm", "--methods", "smoe", "--rounds", "1", "--steps", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("cpu preset, batch 16 x block 128, 1 thread(s), torch ")
    assert [line.split()[0] for line in lines[1:]] == ["smoe", "dense"]
    assert lines[2].endswith("tokens/s   ratio to dense 1.00")
    assert float(lines[1].split()[1]) > 0


def test_throughput_table_divides_by_dense():
    table = format_throughput("cpu", [("smoe", 800.0), ("competesmoe", 600.0), ("dense", 1000.0)])
    assert table.splitlines()[1:] == [
        "smoe                  800 tokens/s   ratio to dense 0.80",
        "competesmoe           600 tokens/s   ratio to dense 0.60",
        "dense                1000 tokens/s   ratio to dense 1.00",
    ]


@pytest.mark.parametrize(
    ("flag", "value", "match"),
    [
        ("--size", "huge", r"--size='huge' is not allowed; expected one of \['tiny', "),
        ("--methods", "smoe,nosuch", r"--methods='nosuch' is not allowed; expected one of \['smoe', "),
        ("--rounds", "0", r"--rounds=0 is not allowed; expected a positive integer"),
        ("--steps", "-1", r"--steps=-1 is not allowed; expected a positive integer"),
        ("--threads", "0", r"--threads=0 is not allowed; expected a positive integer"),
    ],
)
def test_bench_lm_rejects_bad_flags_in_one_line(capsys, flag, value, match):
    assert main(["bench", "lm", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moelab bench: error: ") and err.count("\n") == 1
    assert re.search(match, err), err


def test_mixtral_native_and_converted_compute_the_same_model_and_are_timed():
    pytest.importorskip("transformers")
    from moelab.bench.lm import benchmark_throughput, mixtral_models

    models = mixtral_models("cpu")
    x = torch.randint(256, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        native, converted = (m.eval()(input_ids=x).logits for m in models.values())
    torch.testing.assert_close(converted, native, rtol=1e-4, atol=1e-5)
    assert moelab.layer.moe_layers(models["mixtral converted"])  # moelab's layers inside
    names = [name for name, tps in benchmark_throughput("cpu", ("smoe",), rounds=1, steps=1, mixtral=True)]
    assert names == ["smoe", "dense", "mixtral native", "mixtral converted"]
