"""Routing replay in a toy policy-gradient loop: generation in bfloat16, training in float32.

Reinforcement learning on MoE models samples with one engine and trains with another; the two route
some tokens to other experts, so the policy gradient is taken through a model that did not produce
the samples.  Rollout Routing Replay (Ma et al. 2025, arXiv 2510.11370) trains with the generator's
routes.  This script reproduces the setting at toy scale, on CPU:

* the policy: a tiny :class:`moelab.models.lm.TransformerLM` (2 MoE blocks, 8 experts, top-2);
* the task: given a prompt token ``p``, emit ``p+1, p+2, ...`` (mod the vocabulary); the reward of a
  sequence is its share of correct tokens;
* generation: sampling under ``torch.autocast("cpu", torch.bfloat16)`` (the "inference engine");
  its routes are recorded with :func:`moelab.routes.record` by one bf16 forward over the sampled
  sequences (prompt and completion);
* training: float32, a GRPO-style REINFORCE step (the advantage of a sequence is its reward minus
  the mean reward of its prompt's group, over the group's std; one gradient step per batch, no
  ratio clipping), either with the model's own float32 routing or inside
  :func:`moelab.routes.replaying` the generation trace (the weights from the live float32 logits at
  the recorded experts).

Measured per step: the reward of the sampled batch; the routing mismatch between the generation
pass and the float32 pass over the same tokens (:func:`moelab.routes.diff`: per layer the share of
tokens whose expert set differs, the share differing in at least one layer); the mean absolute gap
between the generation pass's and the training pass's log-probabilities of the sampled tokens, and
its largest value in the batch.
Writes ``results.json`` and ``routing_replay_rl.png`` to ``--out``.  Usage::

    python examples/routing_replay_rl.py --out runs/replay-rl --seeds 5 --steps 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import moelab
from moelab import routes
from moelab.models.lm import LMConfig, TransformerLM

CONDITIONS = ("own routing", "replay")


def build(args: argparse.Namespace, seed: int) -> TransformerLM:
    torch.manual_seed(seed)
    cfg = LMConfig(
        vocab_size=args.vocab,
        block_size=args.length + 1,
        n_layer=2,
        d_model=args.d_model,
        n_head=2,
        method=args.method,
        num_experts=8,
        top_k=2,
        dropout=0.0,
    )
    return TransformerLM(cfg)


def rewards(seq: torch.Tensor, vocab: int) -> torch.Tensor:
    """``(B,)`` the share of completion tokens equal to ``prompt + position`` (mod ``vocab``)."""
    steps = torch.arange(1, seq.shape[1], device=seq.device)
    target = (seq[:, :1] + steps) % vocab
    return (seq[:, 1:] == target).float().mean(dim=1)


@torch.no_grad()
def generate(model: TransformerLM, prompts: torch.Tensor, length: int, gen: torch.Generator) -> torch.Tensor:
    """Sample ``length`` tokens after each prompt token, in bfloat16 (a full forward per token)."""
    seq = prompts
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(length):
            logits = model(seq)[:, -1].float()
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=gen)
            seq = torch.cat([seq, nxt], dim=1)
    return seq


def token_logprobs(logits: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """``(B, L-1)`` log-probability of each next token of ``seq`` under ``logits (B, L-1, V)``."""
    return logits.float().log_softmax(-1).gather(2, seq[:, 1:, None]).squeeze(2)


def run(args: argparse.Namespace, seed: int, replay: bool) -> dict[str, list[Any]]:
    """One training run; per step its reward, routing mismatch and log-prob gap."""
    model = build(args, seed)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(10_000 + seed)
    log: dict[str, list[Any]] = {
        "reward": [],
        "per_layer": [],
        "any_layer": [],
        "logprob_gap": [],
        "logprob_gap_max": [],
    }
    for _ in range(args.steps):
        model.eval()
        prompts = torch.randint(0, args.vocab, (args.prompts, 1), generator=gen).repeat_interleave(
            args.group, 0
        )
        seq = generate(model, prompts, args.length, gen)
        inputs = seq[:, :-1]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # the engine's routes
            trace, gen_logits = routes.record(model, lambda inputs=inputs: model(inputs))
        model.train()
        with torch.no_grad():  # the float32 pass's own routes of the same tokens, for the mismatch
            own = routes.record(model, lambda inputs=inputs: model(inputs))[0]
        mismatch = routes.diff(trace, own)
        r = rewards(seq, args.vocab)
        grouped = r.view(args.prompts, args.group)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
        if replay:
            with routes.replaying(model, trace):
                logits = model(inputs)
        else:
            logits = model(inputs)
        logp = token_logprobs(logits, seq)
        loss = -(adv[:, None] * logp).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        gap = (logp.detach() - token_logprobs(gen_logits, seq)).abs()
        log["reward"].append(float(r.mean()))
        log["per_layer"].append(mismatch.per_layer)
        log["any_layer"].append(mismatch.any_layer)
        log["logprob_gap"].append(float(gap.mean()))
        log["logprob_gap_max"].append(float(gap.max()))
    return log


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(runs: dict[str, list[dict[str, list[Any]]]], tail: int) -> dict[str, Any]:
    """Per condition, mean ± sd over seeds of: the reward of the first and last ``tail`` steps, the
    mismatch (per layer, any layer) and the log-prob gap, each averaged over the run's steps."""
    out: dict[str, Any] = {}
    for cond, logs in runs.items():
        layers = len(logs[0]["per_layer"][0])
        out[cond] = {
            "reward_first": mean_sd([statistics.fmean(g["reward"][:tail]) for g in logs]),
            "reward_last": mean_sd([statistics.fmean(g["reward"][-tail:]) for g in logs]),
            "per_layer": [
                mean_sd([statistics.fmean(s[i] for s in g["per_layer"]) for g in logs]) for i in range(layers)
            ],
            "any_layer": mean_sd([statistics.fmean(g["any_layer"]) for g in logs]),
            "logprob_gap": mean_sd([statistics.fmean(g["logprob_gap"]) for g in logs]),
            "logprob_gap_max": mean_sd([statistics.fmean(g["logprob_gap_max"]) for g in logs]),
        }
    return out


def plot(runs: dict[str, list[dict[str, list[Any]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    for cond, logs in runs.items():
        for ax, key in zip(axes, ("reward", "any_layer", "logprob_gap", "logprob_gap_max")):
            series = torch.tensor([g[key] for g in logs], dtype=torch.float64)  # (seeds, steps)
            mean = series.mean(0)
            sd = series.std(0) if len(logs) > 1 else torch.zeros_like(mean)
            steps = range(1, mean.numel() + 1)
            ax.plot(steps, mean, label=cond)
            ax.fill_between(steps, (mean - sd).clamp(min=0), mean + sd, alpha=0.25)
    titles = (
        "reward of the sampled batch",
        "tokens routed differently in ≥1 layer\n(bf16 generation vs fp32 training pass)",
        "mean |log p_gen − log p_train| of the sampled tokens",
        "largest |log p_gen − log p_train| of a batch's tokens",
    )
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
    axes[0].legend()
    fig.suptitle(f"mean ± sd over {len(next(iter(runs.values())))} seeds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="folder for results.json and the PNG")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (the GRPO group)")
    p.add_argument("--length", type=int, default=6, help="tokens generated per sample")
    p.add_argument("--vocab", type=int, default=8)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--method", default="smoe", choices=routes.replay_methods())
    p.add_argument("--tail", type=int, default=20, help="steps averaged for the first/last reward")
    p.add_argument("--threads", type=int, default=1)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    runs = {
        cond: [run(args, seed, replay=cond == "replay") for seed in range(args.seeds)] for cond in CONDITIONS
    }
    summary = summarize(runs, min(args.tail, args.steps))
    result = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "torch": torch.__version__,
        "moelab": moelab.__version__,
        "seconds": round(time.perf_counter() - start, 1),
        "summary": summary,
        "runs": runs,
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    plot(runs, args.out / "routing_replay_rl.png")
    for cond, s in summary.items():
        layers = ", ".join(f"{m:.3f} ± {sd:.3f}" for m, sd in s["per_layer"])
        print(
            f"{cond}: reward first {s['reward_first'][0]:.3f} ± {s['reward_first'][1]:.3f}, last "
            f"{s['reward_last'][0]:.3f} ± {s['reward_last'][1]:.3f}; mismatch per layer [{layers}], any layer "
            f"{s['any_layer'][0]:.3f} ± {s['any_layer'][1]:.3f}; |Δ log p| mean {s['logprob_gap'][0]:.4f} ± "
            f"{s['logprob_gap'][1]:.4f}, batch max {s['logprob_gap_max'][0]:.4f} ± {s['logprob_gap_max'][1]:.4f}"
        )
    print(
        f"{result['seconds']} s; wrote {args.out / 'results.json'} and {args.out / 'routing_replay_rl.png'}"
    )
    return result


if __name__ == "__main__":
    main()
