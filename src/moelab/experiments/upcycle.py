"""``moelab upcycle``: turn a local transformers model's MLPs into MoE layers
(:func:`moelab.upcycle`) and write it with :func:`moelab.save`, so ``moelab.load(out)`` rebuilds it
offline."""

from __future__ import annotations

import argparse

import torch

from ..hf.upcycle import find_mlps, load_hf_model, upcycle
from ..io.model import save
from ..io.rundir import RunDir
from .args import parse_key_values

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="a local transformers model directory (save_pretrained: config.json + weights) or a "
        "config.json (random init under --seed); no hub access",
    )
    parser.add_argument("--num-experts", type=int, required=True, help="experts per MoE layer")
    parser.add_argument("--top-k", type=int, required=True, help="experts per token")
    parser.add_argument("--method", default="smoe", help="a moelab method (default smoe)")
    parser.add_argument(
        "--layers", default=None, help="comma-separated MLP indices to upcycle (default: all)"
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a method option, repeatable, e.g. balance_coef=0.02 (VALUE: true/false, none, a number or text)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the router init (default 0)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out")


def run(args: argparse.Namespace) -> int:
    layers = None
    if args.layers:
        try:
            layers = [int(v) for v in args.layers.split(",")]
        except ValueError:
            raise ValueError(
                f"--layers {args.layers!r} is not allowed; expected comma-separated integers"
            ) from None
    options = parse_key_values(args.option, "--option")
    torch.manual_seed(args.seed)
    model = load_hf_model(args.model).eval()
    num_dense = sum(p.numel() for p in model.parameters())
    names = find_mlps(model)
    upcycle(model, args.num_experts, args.top_k, args.method, layers, **options)
    out = RunDir(args.out, force=args.force)  # after the upcycle: a refused model writes nothing
    info = {
        "model": str(args.model),
        "model_class": type(model).__name__,
        "num_experts": args.num_experts,
        "top_k": args.top_k,
        "method": args.method,
        "layers": layers,
        "options": options,
        "seed": args.seed,
    }
    out.write_config(info)
    save(model, out.path, metadata={"upcycle": info})  # moelab.load(out) rebuilds it offline
    metrics = {
        "num_mlps": len(names),
        "num_moe_layers": len(layers) if layers is not None else len(names),
        "num_parameters_dense": num_dense,
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    out.write_metrics(metrics)
    print(
        f"upcycled {metrics['num_moe_layers']} of {len(names)} MLPs of {type(model).__name__} to {args.num_experts} "
        f"experts (top-{args.top_k}, {args.method}): {metrics['num_parameters_dense']:,} → "
        f"{metrics['num_parameters']:,} parameters; wrote {out.path / 'model.safetensors'}"
    )
    return 0
