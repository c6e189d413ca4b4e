"""examples/routing_replay_rl.py: the policy-gradient loop with and without routing replay runs a few
steps and writes its numbers and its figure."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "routing_replay_rl.py"


def load_example():
    spec = importlib.util.spec_from_file_location("routing_replay_rl", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_replay_rl_example_writes_rewards_mismatch_and_curves_per_seed_and_condition(tmp_path, capsys):
    example = load_example()
    argv = ["--out", str(tmp_path), "--seeds", "2", "--steps", "3", "--prompts", "2", "--group", "3"]
    result = example.main(argv)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["summary"] == json.loads(json.dumps(result["summary"]))
    assert set(saved["runs"]) == {"own routing", "replay"}
    for logs in saved["runs"].values():
        assert len(logs) == 2  # seeds
        for log in logs:
            assert len(log["reward"]) == len(log["any_layer"]) == len(log["logprob_gap"]) == 3
            assert all(0 <= r <= 1 for r in log["reward"])
            assert all(len(layers) == 2 and all(0 <= s <= 1 for s in layers) for layers in log["per_layer"])
            assert all(
                max(layers) <= a <= min(1.0, sum(layers))
                for layers, a in zip(log["per_layer"], log["any_layer"])
            )
            assert all(0 <= g <= top for g, top in zip(log["logprob_gap"], log["logprob_gap_max"]))
    summary = saved["summary"]["replay"]
    assert len(summary["per_layer"]) == 2 and len(summary["reward_last"]) == 2  # (mean, sd)
    assert (tmp_path / "routing_replay_rl.png").read_bytes().startswith(b"\x89PNG")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("own routing: reward first ") and out[1].startswith("replay: reward first ")
