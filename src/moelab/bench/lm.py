"""``moelab bench lm``: training throughput of a language model (tokens per second of forward,
backward and Adam step) with each method and with the dense model of equal active width
(``--arch dense``), on a size preset of :mod:`moelab.models.lm`.  The models are interleaved round
by round (:func:`moelab.bench.harness.interleaved`), one untimed round first; the median over
rounds is reported.  Results and how to read them: docs/performance-lm.md.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch import nn

from .. import _validate
from ..layer import aux_loss
from ..methods import methods as registered_methods
from ..models.lm import PRESETS, TRAINING, TransformerLM, lm_config
from ..routing import RoutingContext
from ..schedules import routing_context
from .harness import Candidate, interleaved
from .workload import name_list

__all__ = ["add_arguments", "benchmark_throughput", "format_throughput", "run"]

#: byte-level vocabulary of the synthetic batch
VOCAB = 256


def benchmark_throughput(
    size: str = "cpu", methods: tuple[str, ...] = ("smoe", "competesmoe"), rounds: int = 5, steps: int = 20
) -> list[tuple[str, float]]:
    """``[(name, tokens/s)]`` of each method and of ``dense``: training tokens/s of ``size``'s
    preset with its batch size, the median over ``rounds`` timed rounds of ``steps`` steps."""
    _validate.one_of("size", size, list(PRESETS))
    for method in methods:
        _validate.one_of("method", method, registered_methods())
    names = [*methods, "dense"]
    cfg = lm_config(size, VOCAB)
    batch = TRAINING[size]["batch_size"]
    x = torch.randint(VOCAB, (batch, cfg.block_size + 1), generator=torch.Generator().manual_seed(0))
    candidates = []
    for name in names:
        torch.manual_seed(0)
        arch, method = ("dense", "smoe") if name == "dense" else ("switch", name)
        model = TransformerLM(lm_config(size, VOCAB, arch=arch, method=method))
        total = (rounds + 1) * steps
        ctx = routing_context(model, total)  # CompeteSMoE's schedule, as in training
        opt = torch.optim.Adam(model.parameters(), lr=7e-4)
        candidates.append(Candidate(name, "train", _training_steps(model, ctx, opt, x, steps)))
    interleaved(candidates, rounds, warmup=1, progress=False)
    tokens = batch * cfg.block_size * steps
    return [(c.name, statistics.median(tokens / t for t in c.times)) for c in candidates]


def _training_steps(
    model: nn.Module, ctx: RoutingContext, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int
):
    def run_steps() -> None:
        for _ in range(steps):
            logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1)) + aux_loss(model)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            ctx.advance()

    return run_steps


def format_throughput(size: str, results: list[tuple[str, float]]) -> str:
    """The table: the preset, then tokens/s and the ratio to dense's tokens/s per model."""
    dense = dict(results)["dense"]
    lines = [
        f"{size} preset, batch {TRAINING[size]['batch_size']} x block {PRESETS[size]['block_size']}, "
        f"{torch.get_num_threads()} thread(s), torch {torch.__version__}"
    ]
    lines += [f"{name:<14} {tps:>10.0f} tokens/s   ratio to dense {tps / dense:.2f}" for name, tps in results]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="cpu", help=f"model size preset from {list(PRESETS)} (default cpu)")
    p.add_argument(
        "--methods", default="smoe,competesmoe", help="comma-separated methods (default smoe,competesmoe)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up round (default 5)")
    p.add_argument("--steps", type=int, default=20, help="training steps per round (default 20)")


def run(args: argparse.Namespace) -> int:
    _validate.one_of("--size", args.size, list(PRESETS))
    methods = name_list("--methods", args.methods, tuple(registered_methods()))
    for flag in ("threads", "rounds", "steps"):
        _validate.positive_int(f"--{flag}", getattr(args, flag))
    torch.set_num_threads(args.threads)
    results = benchmark_throughput(args.size, tuple(methods), args.rounds, args.steps)
    print(format_throughput(args.size, results))
    return 0
