"""``moelab bench compete --all-pass``: the competition's pass (every expert on every token) as one
grouped pass gives the einsums' winners, outputs and gradients; its flags are validated."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from moelab.bench import compete
from moelab.bench.harness import FixedSchedule
from moelab.experts import grouped_mm_available
from moelab.layer import aux_loss

GROUPED = grouped_mm_available(torch.device("cpu"), torch.float32)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compete.add_arguments(parser)
    base = ["--layers", "2", "--d-model", "8", "--d-hidden", "8", "--experts", "4", "--tokens", "16"]
    return parser.parse_args([*base, "--steps", "4", "--omega", "0.5", "--a-max", "1", "--no-memory", *argv])


@pytest.mark.skipif(not GROUPED, reason="grouped_mm not available in this torch")
@pytest.mark.parametrize("grad_path", ["winners", "all"])
def test_grouped_competition_pass_trains_exactly_as_the_einsums(grad_path):
    cfg = compete.Config(layers=2, d_model=8, d_hidden=12, experts=4, tokens=24, grad_path=grad_path)
    results = []
    for all_pass in ("einsum", "grouped"):
        model, _ = compete._model(
            dataclasses.replace(cfg, all_pass=all_pass), "competesmoe", FixedSchedule(2, {0, 1})
        )
        x = torch.randn(cfg.tokens, cfg.d_model, generator=torch.Generator().manual_seed(1))
        loss = model(x).square().mean() + aux_loss(model)
        loss.backward()
        winners = [blk.moe.last_routing.indices for blk in model]
        results.append((loss.detach(), winners, [p.grad for p in model.parameters()]))
    (l0, w0, g0), (l1, w1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    for a, b in zip(w0, w1):
        assert torch.equal(a, b)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not GROUPED, reason="grouped_mm not available in this torch")
def test_the_grouped_pass_replaces_the_einsums_only_without_autograd(monkeypatch):
    from moelab.experts import ExpertBank, kernels

    bank = ExpertBank(3, 8, 8, activation="swiglu")
    real, calls = kernels.all_experts, []
    monkeypatch.setattr(
        kernels, "all_experts", lambda *a, **k: calls.append(k["impl"] if k else a[2]) or real(*a, **k)
    )
    compete.grouped_competition_pass(bank, "grouped")
    x = torch.randn(5, 8)
    with torch.no_grad():
        h, y = bank._all_experts(x)
    assert calls == ["grouped"] and h.shape == (5, 3, 16) and y.shape == (5, 3, 8)
    h, y = bank._all_experts(x)  # with autograd (grad_path="all"): the einsums, differentiable
    assert calls == ["grouped"] and y.requires_grad


@pytest.mark.skipif(not GROUPED, reason="grouped_mm not available in this torch")
def test_bench_compete_times_the_competition_pass_both_ways(capsys):
    assert compete.run(_args("--all-pass", "grouped")) == 0
    out = capsys.readouterr().out
    assert "competition pass grouped" in out
    assert "competition pass, every expert on 16 tokens without autograd (median ms): einsum " in out
    assert ", grouped " in out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (
            ["--impl", "fast"],
            r"--impl='fast' is not allowed; expected one of \['auto', 'loop', 'grouped', 'stream', 'triton'\]",
        ),
        (
            ["--all-pass", "loop"],
            r"--all-pass='loop' is not allowed; expected one of \['einsum', 'grouped', 'triton'\]",
        ),
        (
            ["--all-pass", "grouped", "--d-model", "6"],
            r"--all-pass='grouped' cannot run here: grouped_mm needs --d-model and --d-hidden to be multiples of 4 "
            r"in float32; use --all-pass einsum",
        ),
    ],
)
def test_bench_compete_rejects_bad_kernel_flags_naming_them(argv, match):
    if "grouped" in argv and not GROUPED:
        pytest.skip("grouped_mm not available in this torch")
    with pytest.raises(ValueError, match=match):
        compete.run(_args(*argv))
