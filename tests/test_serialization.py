import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import moelab
from moelab.serialization import STATE_NAME, WEIGHTS_NAME, load_checkpoint, load_state_dict, save_checkpoint

SRC = str(Path(moelab.__file__).resolve().parents[1])


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 8),
        moelab.MoE(8, 4, 2, d_hidden=12, method="sharede-v3"),
        moelab.MoE(8, 4, 1, method="smoe", activation="swiglu", bias=True),
    )


def test_checkpoint_round_trip_is_bit_exact_and_restores_the_routing_context(tmp_path):
    model = _model(0).double()
    ctx = moelab.RoutingContext(step=17, total_steps=100)
    moelab.attach(model, ctx)
    model[1].router.selection_bias.add_(torch.arange(4.0, dtype=torch.float64) / 3)  # a buffer
    save_checkpoint(tmp_path / "ck", model, state={"step": 17, "lr": 1e-3})
    assert {p.name for p in (tmp_path / "ck").iterdir()} == {WEIGHTS_NAME, STATE_NAME}

    fresh = _model(1).double()
    moelab.attach(fresh, moelab.RoutingContext())
    state = load_checkpoint(tmp_path / "ck", fresh)
    assert state == {"step": 17, "lr": 1e-3}
    assert fresh[1].ctx.step == 17 and fresh[1].ctx.total_steps == 100
    for (k, a), (k2, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert k == k2 and a.dtype == b.dtype and torch.equal(a, b), k


def test_tied_weights_are_saved_and_stay_tied(tmp_path):
    emb = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    save_checkpoint(tmp_path, model)
    tensors, payload = load_state_dict(tmp_path)
    assert torch.equal(tensors["emb.weight"], tensors["head.weight"])
    assert payload["format"] == "moelab-checkpoint"
    fresh = nn.ModuleDict({"emb": nn.Embedding(5, 3), "head": nn.Linear(3, 5, bias=False)})
    fresh["head"].weight = fresh["emb"].weight
    load_checkpoint(tmp_path, fresh)
    assert fresh["head"].weight is fresh["emb"].weight
    assert torch.equal(fresh["emb"].weight, emb.weight)


def test_checkpoint_loads_bit_exactly_in_a_fresh_process(tmp_path):
    model = _model(0)
    x = torch.randn(7, 6)
    model.eval()
    with torch.no_grad():
        y = model(x)
    save_checkpoint(tmp_path / "ck", model, state={"note": "fresh"})
    torch.save({"x": x, "y": y}, tmp_path / "io.pt")
    script = textwrap.dedent(
        f"""
        import torch
        from torch import nn
        import moelab
        from moelab.serialization import load_checkpoint
        torch.manual_seed(123)  # different init: everything must come from the checkpoint
        model = nn.Sequential(
            nn.Linear(6, 8),
            moelab.MoE(8, 4, 2, d_hidden=12, method="sharede-v3"),
            moelab.MoE(8, 4, 1, method="smoe", activation="swiglu", bias=True),
        )
        assert load_checkpoint({str(tmp_path / "ck")!r}, model) == {{"note": "fresh"}}
        model.eval()
        io = torch.load({str(tmp_path / "io.pt")!r})
        with torch.no_grad():
            y = model(io["x"])
        assert torch.equal(y, io["y"]), (y - io["y"]).abs().max()
        print("OK")
        """
    )
    env = {**os.environ, "PYTHONPATH": SRC}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "OK"


def test_non_json_state_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match=r"state=.*JSON-serialisable"):
        save_checkpoint(tmp_path, nn.Linear(2, 2), state={"bad": object()})
    with pytest.raises(ValueError, match="JSON-serialisable"):
        save_checkpoint(tmp_path, nn.Linear(2, 2), state={"nan": float("nan")})


def test_missing_or_foreign_checkpoints_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope", nn.Linear(2, 2))
    save_checkpoint(tmp_path, nn.Linear(2, 2))
    (tmp_path / STATE_NAME).write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="format='other'"):
        load_state_dict(tmp_path)
    (tmp_path / WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match="not a moelab checkpoint"):
        load_state_dict(tmp_path)
