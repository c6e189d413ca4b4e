"""The ``moelab`` command: each subcommand lives in its own module, which provides
``add_arguments(parser)`` and ``run(args) -> int``, and this file only wires them.  Errors a user
can act on (``UsageError``, ``ValueError``, ``FileNotFoundError``; a full disk or a permission
error) print one line to stderr and exit 2, without a traceback (``--debug`` shows it); docs/errors.md
("How errors surface").
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys

from ._version import __version__
from .errors import UsageError
from .extras import require

#: subcommand → (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    # "name": ("moelab.module", "one-line help"),  -- one line per subcommand
    "train": ("moelab.experiments.lm", "train a model: a Switch/GLaM MoE language model (--task lm)"),
    "compare": (
        "moelab.experiments.compare",
        "compare MoE methods x seeds on language modelling (CompeteSMoE (2024) Table 2)",
    ),
    "benchmark": (
        "moelab.bench.routers",
        "every router under one protocol: quality with CIs and equivalence tests, balance, stability, cost",
    ),
    "finetune": (
        "moelab.experiments.finetune",
        "fine-tune a trained MoE LM on text classification (CompeteSMoE (2024) Table 3)",
    ),
    "eval": (
        "moelab.experiments.evaluate",
        "zero-shot evaluation of a trained LM through lm-evaluation-harness (LAMBADA, PIQA, ... or your own task)",
    ),
    "report": ("moelab.experiments.report", "tables and plots from finished runs"),
    "diagnose": (
        "moelab.experiments.diagnose",
        "routing diagnostics of trained runs: router entropy, swap tests, overlap, load, change rate",
    ),
    "upcycle": (
        "moelab.experiments.upcycle",
        "turn a dense model's MLPs into MoE layers (safetensors checkpoint)",
    ),
    "bench": ("moelab.bench", "benchmarks: medians and ratios to the dense limit and to peers"),
    "simulate": (
        "moelab.experiments.simulate",
        "convergence-rate studies of regression / Gaussian MoE estimators",
    ),
    "routes": (
        "moelab.experiments.routes",
        "route traces: where two traces of one batch send tokens to other experts (moelab.routes)",
    ),
    "specialize": (
        "moelab.experiments.specialization",
        "the expert-specialization lab of Krishnamurthy et al. (2023) on image MoEs",
    ),
    "prune": ("moelab.experiments.prune", "remove experts by REAP saliency, routed frequency or at random"),
    "merge-experts": (
        "moelab.experiments.merge_experts",
        "merge experts into the most used ones (M-SMoE groups; uniform or frequency-weighted averages)",
    ),
    "check": (
        "moelab.experiments.check",
        "gradient parity of an MoE block under DDP, FSDP2, expert parallelism, kernels, compile (moelab.check)",
    ),
}

#: subcommand → the extra it needs beyond the core dependencies (:mod:`moelab.extras`): the commands
#: that draw plots or compute statistics; checked before the command starts, never after a run
COMMAND_EXTRAS: dict[str, str] = {
    name: "lab"
    for name in ("train", "compare", "benchmark", "finetune", "report", "diagnose", "simulate", "specialize")
}


#: OSError numbers reported as one-line user errors (exit 2): no space, quota, read-only, permission,
#: a path too long for the file system
_USER_OS_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENAMETOOLONG}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: one line, exit 2
        self.exit(2, f"moelab: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moelab", description="Sparse mixture-of-experts routing lab.")
    parser.add_argument("--version", action="version", version=f"moelab {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


#: environment variables moelab read once and reads no more: a run that sets one is told, once,
#: rather than silently run without what the variable asked for
RETIRED_ENV = {
    "MOELAB_AUTOTUNE": "impl='auto' follows its rule; measure the kernels with moelab train --autotune "
    "or moelab.experts.autotune(model, example_input) (docs/kernels.md)",
}


def warn_retired_env() -> None:
    """One line on stderr per retired variable that is set."""
    for name, instead in RETIRED_ENV.items():
        if name in os.environ:
            print(f"moelab: {name}={os.environ[name]!r} is no longer read; {instead}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    warn_retired_env()
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        if args.command in COMMAND_EXTRAS:
            require(COMMAND_EXTRAS[args.command], f"moelab {args.command}")
        return int(args._run(args) or 0)
    except (UsageError, ValueError, FileNotFoundError, NotADirectoryError, FileExistsError) as exc:
        if args.debug:
            raise
        print(f"moelab {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk, a quota, no permission: the user's to fix, not a bug
        if args.debug or exc.errno not in _USER_OS_ERRORS:
            raise
        print(f"moelab {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"moelab {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
