"""``moelab check``: gradient parity of an MoE block (:func:`moelab.check.parity`, in :mod:`moelab.check.grid`): the table of
every layout, kernel, capacity, compile and checkpointing variant against one eager process; exit
1 when a row fails (docs/check.md)."""

from __future__ import annotations

import argparse

import torch

from ..check import LAYOUTS, parity, resolve
from ..check.targets import import_object
from ..config import parse_key_values

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--module",
        required=True,
        metavar="SPEC",
        help="moelab:<method>, hf:<family> (mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3), titan, or "
        "package.module:factory (a callable returning a fresh nn.Module)",
    )
    parser.add_argument(
        "--layouts",
        default=",".join(LAYOUTS),
        help=f"comma-separated, some of {','.join(LAYOUTS)} (default: all)",
    )
    parser.add_argument("--procs", default="2", help="comma-separated numbers of gloo processes (default: 2)")
    parser.add_argument(
        "--kernels", default=None, help="comma-separated expert kernels (default: every one exposed)"
    )
    parser.add_argument(
        "--capacity",
        default="off",
        help="comma-separated capacity factors, 'off' for none (moelab layers; default: off), e.g. off,1.25",
    )
    parser.add_argument("--compile", action="store_true", help="also run every variant under torch.compile")
    parser.add_argument(
        "--compile-backend", default="aot_eager", help="torch.compile's backend (default: aot_eager)"
    )
    parser.add_argument(
        "--checkpoint", action="store_true", help="also run every variant under activation checkpointing"
    )
    parser.add_argument(
        "--parallelize",
        metavar="PKG.MOD:FN",
        help="fn(model, layout, world) -> module applying a layout (the block is model.inner); "
        "NotImplementedError(reason) marks a layout not applicable",
    )
    parser.add_argument(
        "--option",
        action="append",
        metavar="KEY=VALUE",
        help="an option of a moelab:<method> layer (repeatable)",
    )
    parser.add_argument(
        "--d-model", type=int, default=None, help="the input width (a factory that does not say)"
    )
    parser.add_argument(
        "--batch", type=int, default=4, help="rows of the batch, split over the processes (default: 4)"
    )
    parser.add_argument("--seq", type=int, default=4, help="tokens per row (default: 4)")
    parser.add_argument(
        "--seed", type=int, default=0, help="the seed of the weights and the batch (default: 0)"
    )
    parser.add_argument("--json", metavar="OUT", help="also write the table as JSON")


def _ints(flag: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(","))
    except ValueError:
        raise ValueError(
            f"{flag} {text!r} is not allowed; expected comma-separated integers, e.g. {flag} 2,4"
        ) from None


def _capacities(text: str) -> tuple[float | None, ...]:
    out: list[float | None] = []
    for item in text.split(","):
        item = item.strip()
        if item == "off":
            out.append(None)
            continue
        try:
            value = float(item)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ValueError(
                f"--capacity {text!r} is not allowed; expected 'off' or capacity factors > 0, e.g. --capacity off,1.25"
            )
        out.append(value)
    return tuple(out)


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--batch", args.batch), ("--seq", args.seq), ("--d-model", args.d_model)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value} is not allowed; expected a positive integer")
    target = resolve(args.module, parse_key_values(args.option, "--option"), args.d_model)
    fn = import_object(args.parallelize, "--parallelize") if args.parallelize else None
    g = torch.Generator().manual_seed(args.seed)
    batch = torch.randn(args.batch, args.seq, target.d_model, generator=g, dtype=torch.float64)
    table = parity(
        target,
        batch,
        layouts=args.layouts,
        procs=_ints("--procs", args.procs),
        kernels=None if args.kernels is None else [k.strip() for k in args.kernels.split(",")],
        capacities=_capacities(args.capacity),
        compile=args.compile,
        checkpoint=args.checkpoint,
        parallelize=fn,
        seed=args.seed,
        compile_backend=args.compile_backend,
    )
    print(table.format())
    if args.json:
        table.save_json(args.json)
        print(f"wrote {args.json}")
    return 0 if table.ok else 1
