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

__all__ = ["add_arguments", "benchmark_throughput", "format_throughput", "mixtral_models", "run"]

#: byte-level vocabulary of the synthetic batch
VOCAB = 256


def mixtral_models(size: str, experts_implementation: str = "grouped_mm") -> dict[str, nn.Module]:
    """transformers' Mixtral of ``size``'s width, depth, heads and context (16 experts, top-2, SwiGLU
    experts of width ``d_model``, vocabulary 256), ``native`` (transformers' own block, its experts
    through ``experts_implementation``) and ``converted`` (the same weights, every block a moelab
    ``MoE`` layer by :func:`moelab.from_hf`): the layer inside the model users train, with
    everything around it the same.  ``ImportError`` without transformers."""
    import copy

    from transformers import MixtralConfig, MixtralForCausalLM

    from ..hf.convert import from_hf

    cfg = lm_config(size, VOCAB)
    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=cfg.d_model, intermediate_size=cfg.hidden,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head,
        max_position_embeddings=cfg.block_size, num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k, router_jitter_noise=0.0, output_router_logits=True,
        router_aux_loss_coef=0.01, attn_implementation="sdpa",
    )  # fmt: skip
    config._experts_implementation = experts_implementation
    torch.manual_seed(0)
    native = MixtralForCausalLM(config)
    converted = from_hf(copy.deepcopy(native))
    converted.config.output_router_logits = False  # moelab's layers carry the balance loss
    return {"mixtral native": native, "mixtral converted": converted}


def _hf_training_steps(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int, native: bool
):
    def run_steps() -> None:
        for _ in range(steps):
            out = model(input_ids=x[:, :-1])
            loss = F.cross_entropy(out.logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
            loss = loss + (model.config.router_aux_loss_coef * out.aux_loss if native else aux_loss(model))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    return run_steps


def benchmark_throughput(
    size: str = "cpu",
    methods: tuple[str, ...] = ("smoe", "competesmoe"),
    rounds: int = 5,
    steps: int = 20,
    mixtral: bool = False,
) -> list[tuple[str, float]]:
    """``[(name, tokens/s)]`` of each method and of ``dense``: training tokens/s of ``size``'s
    preset with its batch size, the median over ``rounds`` timed rounds of ``steps`` steps; with
    ``mixtral``, also transformers' Mixtral of the same size, native and converted
    (:func:`mixtral_models`)."""
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
    if mixtral:
        for name, model in mixtral_models(size).items():
            opt = torch.optim.Adam(model.parameters(), lr=7e-4)
            candidates.append(
                Candidate(name, "train", _hf_training_steps(model, opt, x, steps, name.endswith("native")))
            )
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
    p.add_argument(
        "--mixtral",
        action="store_true",
        help="also transformers' Mixtral of the same size: native and converted by moelab.from_hf",
    )


def run(args: argparse.Namespace) -> int:
    _validate.one_of("--size", args.size, list(PRESETS))
    methods = name_list("--methods", args.methods, tuple(registered_methods()))
    for flag in ("threads", "rounds", "steps"):
        _validate.positive_int(f"--{flag}", getattr(args, flag))
    torch.set_num_threads(args.threads)
    results = benchmark_throughput(args.size, tuple(methods), args.rounds, args.steps, mixtral=args.mixtral)
    print(format_throughput(args.size, results))
    return 0
