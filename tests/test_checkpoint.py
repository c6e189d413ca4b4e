"""Atomic checkpoints: bit-exact round trip, last-K retention, corruption detected and skipped."""

from __future__ import annotations

import json

import pytest
import torch

from moelab.models.lm import LMConfig, TransformerLM
from moelab.train import checkpoint as C

TINY = dict(block_size=8, n_layer=2, d_model=16, n_head=2, num_experts=4, top_k=2, dropout=0.0)


def model(seed: int) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(LMConfig(vocab_size=20, **TINY))


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_checkpoint_round_trips_weights_and_state_bit_exactly(tmp_path):
    a, b = model(0), model(1)
    assert not same_weights(a, b)
    state = {"step": 7, "trainer": {"best_val": 1.5}, "rng": torch.get_rng_state()}
    path = C.save_checkpoint(tmp_path, 7, a, state)
    assert path.name == "step-00000007"
    loaded = C.load_checkpoint(path, b)
    assert same_weights(a, b)
    assert b.head.weight is b.tok_emb.weight  # tying survives loading
    assert loaded["step"] == 7 and loaded["trainer"]["best_val"] == 1.5
    assert torch.equal(loaded["rng"], state["rng"])


def test_only_the_newest_k_are_kept_and_stale_temporaries_are_removed(tmp_path):
    m = model(0)
    (tmp_path / ".tmp-step-00000099").mkdir(parents=True)  # a save killed half-way
    for step in (1, 2, 3, 4):
        C.save_checkpoint(tmp_path, step, m, {"step": step}, keep=2)
    assert [p.name for p in C.list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]
    assert not (tmp_path / ".tmp-step-00000099").exists()


@pytest.mark.parametrize("damage", ["truncate", "flip", "remove_meta"])
def test_a_damaged_newest_checkpoint_is_refused_and_an_older_one_used(tmp_path, damage):
    m = model(0)
    C.save_checkpoint(tmp_path, 1, m, {"step": 1})
    newest = C.save_checkpoint(tmp_path, 2, m, {"step": 2})
    target = newest / ("model.safetensors" if damage != "remove_meta" else "config.json")
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[-5] ^= 0xFF
        target.write_bytes(bytes(data))
    else:
        target.unlink()
    with pytest.warns(UserWarning, match=r"step-00000002.*(truncated or corrupted|incomplete)"):
        assert C.latest_checkpoint(tmp_path).name == "step-00000001"
    with pytest.raises(C.CheckpointError, match="step-00000002"):
        C.load_checkpoint(newest, m)


def test_a_checkpoint_is_a_moelab_save_folder_plus_the_training_state(tmp_path):
    import moelab

    a = model(0)
    path = C.save_checkpoint(tmp_path, 5, a, {"step": 5})
    assert {p.name for p in path.iterdir()} == {"config.json", "model.safetensors", "state.pt"}
    config = json.loads((path / "config.json").read_text())
    assert set(config["files"]) == {"model.safetensors", "state.pt"} and config["metadata"] == {"step": 5}
    b = model(1)
    moelab.io.load_weights(path, b)
    assert same_weights(a, b)
