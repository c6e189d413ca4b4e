"""``moelab bench``: benchmarks that print medians and ratios (never timed tests).

``moelab bench layer`` times one :class:`moelab.MoE` layer (training step: forward + backward;
inference: forward under ``torch.inference_mode``) against the limit, a dense FFN of the same
active width ``K·d_hidden`` (:class:`moelab.experts.MLP`, the same arithmetic with no routing), and
against transformers' ``MixtralSparseMoeBlock`` in its ``eager`` and ``grouped_mm`` experts
implementations when transformers is installed — the same widths, SwiGLU (``silu``) experts and
the very same weights, so routing and FLOPs are identical (checked before timing).

Method (issue 3, "Performance"): every candidate lives in one process; repetitions are
interleaved round-robin (the order rotates each round), so slow phases of a shared machine hit
every candidate alike; the table gives medians, the interquartile range, and each candidate's
ratio to dense as the median over rounds of ``t_candidate / t_dense`` within the same round.

Bench kinds are registered in :data:`BENCHES` (``layer`` here, ``compete`` in
``moelab.bench_compete``); a new kind adds one entry.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from . import __version__, _validate
from .experts import IMPLS, MLP, ExpertBank
from .layer import MoE

__all__ = [
    "BENCHES",
    "Candidate",
    "add_arguments",
    "expert_flops_per_token",
    "flag_flops",
    "interleaved",
    "run",
    "run_layer",
    "summarize",
]


# ---------------------------------------------------------------------------------- machine
def machine_info() -> dict:
    """Cores, threads, versions and load: printed with every table."""
    info = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "moelab": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        # OpenMP's spin-waiting decides multi-threaded timings on a busy machine (docs/performance.md)
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ---------------------------------------------------------------------------------- timing
@dataclass
class Candidate:
    """One timed callable.  ``flops`` is the expert (or dense FFN) multiply-add FLOPs per token."""

    name: str
    phase: str  # "train" (forward + backward) or "infer" (inference-mode forward)
    fn: Callable[[], None]
    flops: int | None = None
    note: str = ""
    times: list[float] = field(default_factory=list)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def interleaved(
    candidates: list[Candidate],
    repeats: int,
    warmup: int,
    clock: str = "wall",
    *,
    budget: float | None = None,
    min_repeats: int = 3,
    progress: bool | None = None,
) -> int:
    """Time every candidate ``repeats`` times, round-robin, rotating the order each round.

    ``clock="cpu"`` measures the process's CPU time (all threads) instead of wall time: on a
    shared, oversubscribed machine with one torch thread it counts the work done rather than the
    time spent waiting for a core (with several threads it also counts OpenMP spin-waiting).

    ``budget`` (seconds): stop after the first complete round at which the timed rounds have
    taken longer, but never before ``min(min_repeats, repeats)`` rounds.  ``progress``: print the
    round on stderr (default: when stderr is a terminal).  Returns the rounds timed.
    """
    now = CLOCKS[clock]
    for _ in range(warmup):
        for c in candidates:
            c.fn()
    n = len(candidates)
    progress = sys.stderr.isatty() if progress is None else progress
    start = time.perf_counter()
    rounds = 0
    for r in range(repeats):
        if progress:
            print(f"\rround {r + 1}/{repeats}", end="", file=sys.stderr, flush=True)
        for i in range(n):
            c = candidates[(r + i) % n]
            t0 = now()
            c.fn()
            c.times.append(now() - t0)
        rounds += 1
        if (
            budget is not None
            and rounds >= min(min_repeats, repeats)
            and time.perf_counter() - start > budget
        ):
            break
    if progress:
        print("\r", end="", file=sys.stderr, flush=True)
    return rounds


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(candidates: list[Candidate], baseline: str = "dense") -> list[dict]:
    """Medians, quartiles and per-round ratios to the ``baseline`` of the same phase."""
    base = {c.phase: c for c in candidates if c.name == baseline}
    rows = []
    for c in candidates:
        b = base.get(c.phase)
        ratios = [t / tb for t, tb in zip(c.times, b.times)] if b is not None else []
        rows.append(
            {
                "name": c.name,
                "phase": c.phase,
                "median_ms": 1e3 * statistics.median(c.times),
                "p25_ms": 1e3 * _quantile(c.times, 0.25),
                "p75_ms": 1e3 * _quantile(c.times, 0.75),
                "min_ms": 1e3 * min(c.times),
                "ratio_to_dense": statistics.median(ratios) if ratios else None,
                "ratio_p25": _quantile(ratios, 0.25) if ratios else None,
                "ratio_p75": _quantile(ratios, 0.75) if ratios else None,
                "flops_per_token": c.flops,
                "note": c.note,
            }
        )
    return rows


# ---------------------------------------------------------------------------------- FLOPs
def expert_flops_per_token(module: nn.Module, top_k: int) -> int:
    """Multiply-add FLOPs (2 per MAC) of the expert / FFN matmuls per token, from the weights.

    moelab ``ExpertBank`` and transformers' ``MixtralExperts``: ``K · 2·(d·h_in + h·d)``;
    :class:`MLP`: ``2·(d·h_in + h·d)`` of its own width.  Router FLOPs are not counted.
    """
    module = getattr(module, "_orig_mod", module)  # a torch.compile'd module: its original
    if isinstance(module, MoE):
        module = module.experts
    if isinstance(module, ExpertBank):
        (_, h_in, d), h = module.w_in.shape, module.w_out.shape[-1]
        return top_k * 2 * (d * h_in + h * d)
    if isinstance(module, MLP):
        return 2 * (
            module.fc_in.in_features * module.fc_in.out_features
            + module.fc_out.in_features * module.fc_out.out_features
        )
    experts = getattr(module, "experts", None)
    if experts is not None and hasattr(experts, "gate_up_proj"):
        (_, h_in, d), h = experts.gate_up_proj.shape, experts.down_proj.shape[-1]
        return top_k * 2 * (d * h_in + h * d)
    raise ValueError(f"module of type {type(module).__name__} is not a known expert layer")


def flag_flops(candidates: list[Candidate], reference: int | None, label: str = "dense") -> None:
    """Append a note to every candidate whose FLOPs/token differ from ``reference`` (dense's)."""
    for c in candidates:
        if c.flops != reference:
            note = f"FLOPs/token {c.flops} != {label} {reference}"
            c.note = f"{c.note}; {note}" if c.note else note


# ---------------------------------------------------------------------------------- candidates
def _mixtral_blocks(layer: MoE, impls: list[str]) -> tuple[dict[str, nn.Module], str]:
    """transformers' Mixtral sparse block per experts implementation, holding ``layer``'s weights."""
    try:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    except ImportError:
        return {}, "transformers is not installed: Mixtral rows skipped"
    bank = layer.experts
    blocks = {}
    for impl in impls:
        config = MixtralConfig(
            hidden_size=bank.d_model,
            intermediate_size=bank.d_hidden,
            num_local_experts=bank.num_experts,
            num_experts_per_tok=layer.top_k,
            hidden_act="silu",
            router_jitter_noise=0.0,
        )
        config._experts_implementation = impl  # read by MixtralExperts.forward at every call
        block = MixtralSparseMoeBlock(config)
        with torch.no_grad():
            block.gate.weight.copy_(layer.router.weight)
            block.experts.gate_up_proj.copy_(bank.w_in)  # [gate | up], nn.Linear layout: same as moelab
            block.experts.down_proj.copy_(bank.w_out)
        blocks[impl] = block
    return blocks, ""


def _train_step(module: nn.Module, x: Tensor, grad: Tensor) -> Callable[[], None]:
    params = list(module.parameters())

    def step() -> None:
        module.train()
        x.grad = None
        for p in params:
            p.grad = None
        module(x).backward(grad)
        if x.is_cuda:
            torch.cuda.synchronize()

    return step


def _infer_step(module: nn.Module, x: Tensor) -> Callable[[], None]:
    def step() -> None:
        module.eval()
        with torch.inference_mode():
            module(x)
        if x.is_cuda:
            torch.cuda.synchronize()

    return step


def build_layer_candidates(args: argparse.Namespace) -> tuple[list[Candidate], list[str]]:
    """The candidates of ``bench layer`` (both phases) and notes for skipped ones."""
    torch.manual_seed(args.seed)
    T, d, h, N, K = args.tokens, args.d_model, args.d_hidden, args.num_experts, args.top_k
    notes: list[str] = []
    probe = torch.empty(1, d, device=args.device, dtype=getattr(torch, args.dtype))
    modules: dict[str, nn.Module] = {"dense": MLP(d, K * h, activation=args.activation)}
    ref = None
    for impl in args.impl:
        layer = MoE(d, N, K, d_hidden=h, method=args.method, activation=args.activation, impl=impl)
        if ref is None:
            ref = layer
        else:
            layer.load_state_dict(ref.state_dict())
        if impl == "grouped" and not layer.experts.grouped_ok(probe):
            notes.append(
                f"moelab grouped skipped: grouped_mm cannot run here (torch {torch.__version__}, "
                f"d_model={d}, d_hidden={h}: float32 rows must be 16-byte aligned)"
            )
            continue
        resolved = layer.experts.resolved_impl(probe.expand(T, d), K)
        label = f"moelab {impl}" + (f" (={resolved})" if impl == "auto" else "")
        modules[label] = layer
    if args.hf and ref is not None:
        if args.activation != "swiglu" or args.method not in ("smoe",):
            notes.append("Mixtral rows skipped: they need --activation swiglu and --method smoe")
        else:
            blocks, note = _mixtral_blocks(ref, ["eager", "grouped_mm"])
            if note:
                notes.append(note)
            for impl, block in blocks.items():
                modules[f"mixtral {impl}"] = block

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    for m in modules.values():
        m.to(device, dtype)
    if getattr(args, "compile", None):
        # compiled twins of dense and of each moelab implementation, sharing their weights; the
        # warm-up rounds pay the compilation (train and infer are compiled separately)
        for name in [n for n in modules if n == "dense" or n.startswith("moelab")]:
            modules[f"compiled {name}"] = torch.compile(modules[name], mode=args.compile, dynamic=False)
    x2 = torch.randn(T, d).to(device, dtype)
    x3 = x2.view(1, T, d)  # Mixtral's block wants (batch, seq, d)
    grad = torch.randn(T, d).to(device, dtype)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    if ref is not None:  # same weights, same routing: outputs must agree (a parity check, not timing)
        with torch.no_grad():
            y_ref = ref(x2)
            for name, m in modules.items():
                if name.startswith("mixtral"):
                    y = m(x3).view(T, d)
                    if not torch.allclose(y, y_ref, atol=tol, rtol=tol):
                        notes.append(f"{name}: output differs from moelab by {(y - y_ref).abs().max():.2e}")
    candidates = []
    for phase in ("train", "infer"):
        for name, m in modules.items():
            xin = (x3 if name.startswith("mixtral") else x2).detach().clone().requires_grad_(phase == "train")
            g = grad.view_as(xin)
            fn = _train_step(m, xin, g) if phase == "train" else _infer_step(m, xin)
            flops = expert_flops_per_token(m, K)
            candidates.append(Candidate(name, phase, fn, flops))
    flag_flops(candidates, candidates[0].flops)
    return candidates, notes


# ---------------------------------------------------------------------------------- output
def format_table(rows: list[dict]) -> str:
    head = f"{'candidate':<24} {'phase':<6} {'median ms':>10} {'IQR ms':>17} {'min ms':>9} {'x dense':>8} {'ratio IQR':>13}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = f"{r['ratio_to_dense']:.3f}" if r["ratio_to_dense"] is not None else "-"
        riqr = f"{r['ratio_p25']:.2f}-{r['ratio_p75']:.2f}" if r["ratio_p25"] is not None else "-"
        lines.append(
            f"{r['name']:<24} {r['phase']:<6} {r['median_ms']:>10.2f} "
            f"{r['p25_ms']:>8.2f}-{r['p75_ms']:<8.2f} {r['min_ms']:>9.2f} {ratio:>8} {riqr:>13}"
            + (f"  {r['note']}" if r["note"] else "")
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- layer
def add_layer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", "-T", type=int, default=2048, help="tokens T per step (default 2048)")
    p.add_argument("--d-model", type=int, default=256, help="token width d (default 256)")
    p.add_argument("--d-hidden", type=int, default=512, help="hidden width of each expert (default 512)")
    p.add_argument("--num-experts", "-N", type=int, default=16, help="experts N (default 16)")
    p.add_argument("--top-k", "-K", type=int, default=2, help="experts per token K (default 2)")
    p.add_argument("--activation", default="swiglu", help="expert activation (default swiglu)")
    p.add_argument("--method", default="smoe", help="moelab method (default smoe)")
    p.add_argument(
        "--impl",
        default="auto,loop,grouped",
        help=f"comma-separated moelab dispatch implementations from {list(IMPLS)} (default all)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall time (default) or process CPU time (robust to a busy machine with --threads 1)",
    )
    p.add_argument("--repeats", type=int, default=20, help="timed rounds (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and inputs (default 0)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda; CUDA steps end with a synchronize")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="parameter and input dtype (float32)",
    )
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers' Mixtral block")
    p.add_argument(
        "--compile",
        nargs="?",
        const="default",
        default=None,
        choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
        help="add torch.compile'd dense and moelab candidates (inductor; optional mode, default 'default'); "
        "compilation happens in the warm-up rounds",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _check_layer_args(args: argparse.Namespace) -> None:
    for name in ("tokens", "d_model", "d_hidden", "num_experts", "top_k", "repeats"):
        _validate.positive_int(name, getattr(args, name))
    _validate.int_in_range("top_k", args.top_k, 1, args.num_experts)
    _validate.int_in_range("warmup", args.warmup, 0, 1 << 20)
    if args.threads is not None:
        _validate.positive_int("threads", args.threads)
    if getattr(args, "compile", None) and args.warmup < 1:
        raise ValueError(
            f"warmup={args.warmup!r} is not allowed with --compile; expected >= 1 (the first round compiles)"
        )
    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        raise ValueError(
            f"device={args.device!r} is not allowed; expected 'cpu' or 'cuda' (with a CUDA device)"
        )
    impls = [s.strip() for s in str(args.impl).split(",") if s.strip()]
    if not impls:
        raise ValueError(
            f"impl={args.impl!r} is not allowed; expected a comma-separated list from {list(IMPLS)}"
        )
    for impl in impls:
        _validate.one_of("impl", impl, IMPLS)
    args.impl = list(dict.fromkeys(impls))


def run_layer(args: argparse.Namespace) -> int:
    _check_layer_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    candidates, notes = build_layer_candidates(args)
    before = machine_info()
    interleaved(candidates, args.repeats, args.warmup, args.clock)
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rows = summarize(candidates)
    config = {
        k: getattr(args, k)
        for k in (
            "tokens",
            "d_model",
            "d_hidden",
            "num_experts",
            "top_k",
            "activation",
            "method",
            "impl",
            "device",
            "dtype",
            "compile",
        )
    }
    config.update(
        clock=args.clock,
        threads=torch.get_num_threads(),
        repeats=args.repeats,
        warmup=args.warmup,
        seed=args.seed,
        dense_width=args.top_k * args.d_hidden,
    )
    machine = dict(before, loadavg_1min_after=load_after)
    if args.json:
        print(
            json.dumps(
                {"bench": "layer", "config": config, "machine": machine, "results": rows, "notes": notes}
            )
        )
        return 0
    print(
        f"moelab bench layer: T={args.tokens} d={args.d_model} d_hidden={args.d_hidden} N={args.num_experts} "
        f"K={args.top_k} {args.activation}, method={args.method}; dense width K*d_hidden={args.top_k * args.d_hidden}"
    )
    print(
        f"machine: {machine['cpu']}, {machine['cores']} cores, torch threads {machine['torch_threads']}, "
        f"torch {machine['torch']}, transformers {machine['transformers']}, "
        f"load {machine['loadavg_1min']:.1f} -> {load_after:.1f}, "
        f"OMP_WAIT_POLICY={machine['OMP_WAIT_POLICY'] or 'unset'}"
    )
    print(
        f"{args.repeats} interleaved rounds after {args.warmup} warm-up, {args.clock} clock; train = forward + backward, "
        "infer = inference-mode forward; x dense = median over rounds of t / t_dense"
    )
    print(f"expert FLOPs/token: {candidates[0].flops} (every row; a mismatch is flagged)")
    print(format_table(rows))
    for note in notes:
        print(f"note: {note}")
    return 0


# ---------------------------------------------------------------------------------- registry
#: bench kind -> module providing ``add_arguments(parser)`` and ``run(args) -> int``, and a one-line
#: help.  A new kind adds one line here; a module that is not installed (a kind whose branch is
#: not merged yet) is left out of the CLI instead of breaking it.
BENCHES: dict[str, tuple[str, str]] = {
    "layer": ("moelab.bench", "MoE layer vs dense FFN of equal active width and transformers' Mixtral"),
    "compete": ("moelab.bench_compete", "CompeteSMoE's competition cost over plain smoe"),
    "suite": (
        "moelab.bench_suite",
        "the grid of issue 8: moelab, dense and peers over T, shapes, routing, threads",
    ),
}


def _kind_functions(module: str):
    if module == __name__:
        return add_layer_arguments, run_layer
    mod = importlib.import_module(module)
    return mod.add_arguments, mod.run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="KIND", required=True)
    for name, (module, help_text) in BENCHES.items():
        if module != __name__ and importlib.util.find_spec(module) is None:
            continue
        add, run_fn = _kind_functions(module)
        p = sub.add_parser(name, help=help_text, description=help_text)
        add(p)
        p.set_defaults(_bench_run=run_fn)


def run(args: argparse.Namespace) -> int:
    return int(args._bench_run(args) or 0)
