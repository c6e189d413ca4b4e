"""``moelab bench layer``: one :class:`moelab.MoE` layer (training step: forward + backward;
inference: forward under ``torch.inference_mode``) against the limit, a dense FFN of the same
active width ``K·d_hidden`` (:class:`moelab.experts.MLP`, the same arithmetic with no routing), and
against transformers' ``MixtralSparseMoeBlock`` in its ``eager`` and ``grouped_mm`` experts
implementations when transformers is installed — the same widths, SwiGLU (``silu``) experts and
the very same weights (:func:`moelab.bench.peers.mixtral_block`), so routing and FLOPs are
identical (checked before timing).  Timing as :mod:`moelab.bench.harness` describes.

The ``moelab auto`` row runs ``impl="auto"``'s rule (no forward measures anything); with
``--autotune`` the bench also calls :func:`moelab.experts.autotune` on that layer, explicitly and
before the timing, and reports its pick per phase beside the rule's (the pick's own timing is its
kernel's ``moelab <kernel>`` row); the picks are forgotten before the timing, so the auto row stays
the rule.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch import nn

from .. import _validate
from ..experts import IMPLS, MLP, autotune
from ..experts.kernels import grouped_ok, omp_wait_policy
from ..experts.tuning import forget_tuned
from ..layer import MoE
from .harness import (
    CLOCKS,
    Candidate,
    expert_flops_per_token,
    flag_flops,
    format_table,
    infer_step,
    interleaved,
    machine_info,
    summarize,
    train_step,
)
from .peers import mixtral_peers
from .workload import check_fits

__all__ = ["add_arguments", "build_layer_candidates", "run"]


# ---------------------------------------------------------------------------------- candidates
def build_layer_candidates(args: argparse.Namespace) -> tuple[list[Candidate], list[str]]:
    """The candidates of ``bench layer`` (both phases) and notes for skipped ones."""
    torch.manual_seed(args.seed)
    T, d, h, N, K = args.tokens, args.d_model, args.d_hidden, args.num_experts, args.top_k
    notes: list[str] = []
    probe = torch.empty(1, d, device=args.device, dtype=getattr(torch, args.dtype))
    dense = MLP(d, K * h, activation=args.activation)
    #: name → (module taking tokens (T, d), expert FLOPs per token)
    modules: dict[str, tuple[nn.Module, int]] = {"dense": (dense, expert_flops_per_token(dense, K))}
    ref = None
    for impl in args.impl:
        layer = MoE(d, N, K, d_hidden=h, method=args.method, activation=args.activation, impl=impl)
        if ref is None:
            ref = layer
        else:
            layer.load_state_dict(ref.state_dict())
        if impl == "grouped" and not grouped_ok(probe, layer.experts.expert_weights):
            notes.append(
                f"moelab grouped skipped: grouped_mm cannot run here (torch {torch.__version__}, "
                f"d_model={d}, d_hidden={h}: float32 rows must be 16-byte aligned)"
            )
            continue
        if impl == "auto":  # its rule's picks (auto_picks) and --autotune's (autotune_picks)
            args.auto_layer = layer
        modules[f"moelab {impl}"] = (layer, expert_flops_per_token(layer, K))
    if args.hf and ref is not None:
        if args.activation != "swiglu" or args.method not in ("smoe",):
            notes.append("Mixtral rows skipped: they need --activation swiglu and --method smoe")
        else:
            peers, note = mixtral_peers(ref)
            if note:
                notes.append(note)
            for peer in peers:
                modules[peer.name] = (peer.module, peer.flops)

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    for m, _ in modules.values():
        m.to(device, dtype)
    if getattr(args, "compile", None):
        # compiled twins of dense and of each moelab implementation, sharing their weights; the
        # warm-up rounds pay the compilation (train and infer are compiled separately)
        for name in [n for n in modules if n == "dense" or n.startswith("moelab")]:
            m, flops = modules[name]
            modules[f"compiled {name}"] = (torch.compile(m, mode=args.compile, dynamic=False), flops)
    x = torch.randn(T, d).to(device, dtype)
    grad = torch.randn(T, d).to(device, dtype)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    if ref is not None:  # same weights, same routing: outputs must agree (a parity check, not timing)
        with torch.no_grad():
            y_ref = ref(x)
            for name, (m, _) in modules.items():
                if name.startswith("mixtral"):
                    y = m(x)
                    if not torch.allclose(y, y_ref, atol=tol, rtol=tol):
                        notes.append(f"{name}: output differs from moelab by {(y - y_ref).abs().max():.2e}")
    candidates = []
    for phase in ("train", "infer"):
        for name, (m, flops) in modules.items():
            xin = x.detach().clone().requires_grad_(phase == "train")
            fn = train_step(m, xin, grad) if phase == "train" else infer_step(m, xin)
            candidates.append(Candidate(name, phase, fn, flops))
    flag_flops(candidates, candidates[0].flops)
    return candidates, notes


# ---------------------------------------------------------------------------------- layer
def add_arguments(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda; the clock waits for the device")
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
    p.add_argument(
        "--autotune",
        action="store_true",
        help="also call moelab.experts.autotune on the auto layer (before the timing, --repeats rounds) and "
        "report its pick per phase beside auto's rule (the auto row stays the rule)",
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
    check_fits(
        {"--tokens": args.tokens, "--d-model": args.d_model, "--d-hidden": args.d_hidden,
         "--num-experts": args.num_experts},
        args.tokens, args.d_model, args.d_hidden, args.num_experts, args.top_k,
    )  # fmt: skip
    impls = [s.strip() for s in str(args.impl).split(",") if s.strip()]
    if not impls:
        raise ValueError(
            f"impl={args.impl!r} is not allowed; expected a comma-separated list from {list(IMPLS)}"
        )
    for impl in impls:
        _validate.one_of("impl", impl, IMPLS)
    args.impl = list(dict.fromkeys(impls))


def auto_picks(args: argparse.Namespace) -> dict[str, str]:
    """Per phase, the kernel the ``moelab auto`` row ran: ``impl="auto"``'s rule (a forward measures
    nothing; a pick of :func:`moelab.experts.autotune` only where this process called it)."""
    layer = getattr(args, "auto_layer", None)
    if layer is None:
        return {}
    x = torch.zeros(args.tokens, args.d_model, device=args.device, dtype=getattr(torch, args.dtype))
    return {
        phase: layer.experts.resolved_impl(x, args.top_k, grad=phase == "train")
        for phase in ("train", "infer")
    }


def autotune_picks(args: argparse.Namespace, notes: list[str]) -> dict[str, dict]:
    """``--autotune``: per phase, what :func:`moelab.experts.autotune` picks for the ``moelab auto``
    layer on the bench's tokens (``--repeats`` rounds; its routing is the layer's own): the pick,
    auto's rule, the candidates' medians (ms), those excluded for numbers other than the rule's
    kernel's on a probe and those that round otherwise by construction (timed, never picked).
    The picks are forgotten afterwards (:func:`moelab.experts.forget_tuned`), so the
    timed ``moelab auto`` row runs the rule."""
    layer = getattr(args, "auto_layer", None)
    if layer is None or args.device != "cpu":
        notes.append(
            "--autotune skipped: "
            + (
                "it measures on the CPU only"
                if layer is not None
                else "it measures impl=auto: add auto to --impl"
            )
        )
        return {}
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.tokens, args.d_model, generator=gen).to(getattr(torch, args.dtype))
    out = {}
    try:
        for phase in ("train", "infer"):
            (tuned,) = autotune(layer, x, training=phase == "train", repeats=args.repeats).classes
            out[phase] = {
                "pick": tuned.pick,
                "rule": tuned.rule,
                "medians_ms": tuned.medians_ms,
                "excluded": list(tuned.excluded),
                "other_rounding": list(tuned.other_rounding),
            }
    finally:
        forget_tuned(layer)
    return out


def auto_against_fastest(rows: list[dict], picks: dict[str, str]) -> dict[str, dict]:
    """Per phase: the kernel ``impl="auto"`` picked, the fastest moelab kernel measured (by median
    time among the ``moelab <kernel>`` rows, compiled ones aside) and auto's time over it."""
    out = {}
    for phase, pick in picks.items():
        kernels = {r["name"].split()[1]: r for r in rows if r["phase"] == phase and r["name"].startswith("moelab ")
                   and r["name"] != "moelab auto"}  # fmt: skip
        auto = next((r for r in rows if r["phase"] == phase and r["name"] == "moelab auto"), None)
        if not kernels or auto is None:
            continue
        fastest = min(kernels, key=lambda k: kernels[k]["median_ms"])
        out[phase] = {
            "auto": pick,
            "fastest": fastest,
            "auto_over_fastest": auto["median_ms"] / kernels[fastest]["median_ms"],
        }
    return out


def run(args: argparse.Namespace) -> int:
    _check_layer_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    candidates, notes = build_layer_candidates(args)
    tuned = autotune_picks(args, notes) if getattr(args, "autotune", False) else {}
    if torch.get_num_threads() > 1 and omp_wait_policy() != "passive" and args.device == "cpu":
        notes.append(
            f"OMP_WAIT_POLICY is {omp_wait_policy()} with {torch.get_num_threads()} torch threads: idle OpenMP "
            "workers spin, which slows the MoE kernels' small GEMMs more than the dense one; rerun with "
            "OMP_WAIT_POLICY=PASSIVE (set before Python starts) to compare here (docs/performance.md)"
        )
    before = machine_info()
    interleaved(candidates, args.repeats, args.warmup, args.clock, device=args.device)
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
        autotune=bool(getattr(args, "autotune", False)),
    )
    machine = dict(before, loadavg_1min_after=load_after)
    auto = auto_against_fastest(rows, auto_picks(args))
    if args.json:
        print(
            json.dumps(
                {
                    "bench": "layer",
                    "config": config,
                    "machine": machine,
                    "results": rows,
                    "notes": notes,
                    "auto": auto,
                    "autotune": tuned,
                }
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
    for phase, a in auto.items():
        print(
            f"auto ({phase}): picks {a['auto']}; fastest moelab kernel measured: {a['fastest']}; "
            f"auto / fastest = {a['auto_over_fastest']:.3f}"
        )
    for phase, t in tuned.items():
        medians = ", ".join(f"{name} {ms:.2f} ms" for name, ms in t["medians_ms"].items())
        excluded = (
            f"; excluded (numbers differ from {t['rule']}'s): {', '.join(t['excluded'])}"
            if t["excluded"]
            else ""
        )
        if t.get("other_rounding"):
            excluded += f"; not picked, they round otherwise: {', '.join(t['other_rounding'])}"
        print(f"autotune ({phase}): picks {t['pick']} (rule: {t['rule']}); its medians: {medians}{excluded}")
    for note in notes:
        print(f"note: {note}")
    return 0
