"""``moelab bench suite``: the full benchmark grid, a script never run as a timed test.  For
every case of the grid (tokens × shapes ``(N, K, h)`` × width × routing × threads) one process
builds moelab, a dense FFN of the same activation and width (the limit every ratio is to), the
peers of :mod:`moelab.bench.peers`, moelab's experts alone and, for decoding-sized steps, the
weights-read bound; checks that they compute the same function; times them in interleaved rounds
(:func:`moelab.bench.harness.interleaved`); measures each one's peak memory in a separate, untimed
call; and writes one JSON document after every case, resumable through the run lifecycle of
:mod:`moelab.experiments.runner`.  docs/performance-suite.md gives the groups,
the routing, the bound, the columns and the JSON keys.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _validate
from .. import config as vocab
from ..config import MAX_COUNT, Interval, Options, setting
from ..experiments import runner
from ..experts import MLP, ExpertBank, sort_slots
from ..experts.kernels import grouped_rows, loop_rows
from ..layer import MoE, recording_routing
from .gpu import GPU_DTYPES, GPU_PEERS, GPU_TOKENS, MODELS, run_gpu
from .harness import (
    CLOCKS,
    Candidate,
    expert_flops_per_token,
    flag_flops,
    fmt,
    free_grads,
    infer_step,
    interleaved,
    machine_info,
    measure_peak_memory,
    ratio_stats,
    summarize,
    train_step,
    write_document,
)
from .peers import (
    PEERS,
    Peer,
    capacity_stats,
    computed_flops_per_token,
    default_policy_skip,
    lucidrains_peer,
    mixtral_peers,
    stmoe_peer,
)
from .workload import (
    ROUTINGS,
    ZIPF_EXPONENT,
    ZIPF_MARGIN,
    check_fits,
    favourite_experts,
    int_list,
    load_stats,
    name_list,
    routed_inputs,
)

__all__ = [
    "SUITE",
    "Case",
    "SuiteConfig",
    "add_arguments",
    "experts_only",
    "markdown_summary",
    "namespace",
    "parse_grid",
    "resolve",
    "run",
    "weights_read_bound",
]

BOUND_MAX_TOKENS = 16
DEFAULTS = {
    "tokens": "1,16,128,2048,8192",
    "shapes": "16x2x512,64x8x128,8x1x1024",
    "d_model": "256,512",
    "routing": "balanced,zipf",
    "threads": "1,2",
    "peers": ",".join(PEERS),
}
#: the groups: activation and expert biases of their moelab layer and dense FFN
GROUPS = {"swiglu": ("swiglu", False), "swiglu+bias": ("swiglu", True), "relu": ("relu", False)}
PEER_GROUP = {"mixtral": "swiglu", "stmoe": "swiglu+bias", "lucidrains": "relu"}


# ---------------------------------------------------------------------------------- the grid
def _shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for item in [s.strip() for s in str(text).split(",") if s.strip()] or [""]:
        parts = item.lower().split("x")
        try:
            n, k, h = (int(p) for p in parts)
        except ValueError:
            n = k = h = 0
        if min(n, k, h) < 1 or k > n:
            raise ValueError(
                f"--shapes={item!r} is not allowed; expected NxKxH (experts x top-k x expert width) "
                "with positive integers and K <= N, e.g. 16x2x512"
            )
        shapes.append((n, k, h))
    return list(dict.fromkeys(shapes))


@dataclass(frozen=True)
class Case:
    tokens: int
    num_experts: int
    top_k: int
    d_hidden: int
    d_model: int
    routing: str
    threads: int

    @property
    def key(self) -> str:
        return (
            f"T={self.tokens} N={self.num_experts} K={self.top_k} h={self.d_hidden} d={self.d_model} "
            f"{self.routing} threads={self.threads}"
        )


def parse_grid(args: argparse.Namespace) -> list[Case]:
    """Validate the grid of the CPU suite's settings (:func:`namespace`) and return the cases, in run order (threads, d, shape, T, routing)."""
    for flag, value in (("--models", args.models), ("--gpu-peers", args.gpu_peers)):
        if value is not None:
            raise ValueError(
                f"{flag}={value!r} is not allowed with --device {args.device}; it is an option of --device cuda"
            )
    _validate.one_of("--dtype", args.dtype, ("float32", "bfloat16"))
    tokens = int_list("--tokens", args.tokens)
    shapes = _shapes(args.shapes)
    widths = int_list("--d-model", args.d_model)
    routings = name_list("--routing", args.routing, ROUTINGS)
    threads = int_list("--threads", args.threads)
    args.peer_list = name_list("--peers", args.peers, PEERS, empty_ok=True)
    args.grid = {
        "tokens": tokens,
        "shapes": [f"{n}x{k}x{h}" for n, k, h in shapes],
        "d_model": widths,
        "routing": routings,
        "threads": threads,
        "peers": args.peer_list,
    }
    for n, k, h in shapes:
        for d in widths:
            check_fits(
                {"--tokens": max(tokens), "--d-model": d, "--shapes": max(n, h)}, max(tokens), d, h, n, k
            )
    return [
        Case(t, n, k, h, d, r, th)
        for th in threads
        for d in widths
        for n, k, h in shapes
        for t in tokens
        for r in routings
    ]


# ---------------------------------------------------------------------------------- bound
def weights_read_bound(bank: ExpertBank, x: Tensor, indices: Tensor) -> tuple[Callable[[], None], int, int]:
    """The weights-read bound of ``bank`` for tokens ``x (T, d)`` routed to ``indices (T, K)``.

    Returns ``(step, experts touched, bytes of their weights)``; ``step`` runs each touched
    expert on exactly its tokens, with everything sliced beforehand (module docstring).
    """
    work = []
    nbytes = 0
    with torch.no_grad():
        for e in indices.unique().tolist():
            rows = (indices == e).any(dim=-1).nonzero().squeeze(-1)
            w_in, w_out = bank.w_in[e].contiguous(), bank.w_out[e].contiguous()
            b_in = None if bank.b_in is None else bank.b_in[e].contiguous()
            b_out = None if bank.b_out is None else bank.b_out[e].contiguous()
            work.append((x.index_select(0, rows).contiguous(), w_in, b_in, w_out, b_out))
            nbytes += sum(t.numel() * t.element_size() for t in (w_in, w_out, b_in, b_out) if t is not None)
    act = bank.act

    def step() -> None:
        with torch.inference_mode():
            for xs, w_in, b_in, w_out, b_out in work:
                F.linear(act(F.linear(xs, w_in, b_in)), w_out, b_out)

    return step, len(work), nbytes


# ---------------------------------------------------------------------------------- one case
@dataclass
class SuiteCandidate(Candidate):
    group: str = "swiglu"
    computed_flops: int | None = None  # FLOPs/token a capacity peer actually computes in this phase
    drops_tokens: bool = False
    dropped_fraction: float | None = None


def experts_only(
    bank: ExpertBank, x: Tensor, indices: Tensor, grad: Tensor
) -> list[tuple[str, Callable[[], None], Callable[[], None]]]:
    """``[(phase, step, reset)]`` for the bank's experts alone on the expert-sorted token slots.

    The same implementation (``bank.resolved_impl``), GEMMs and activation as the layer, on rows
    gathered and sorted beforehand: no router, sort, gather or combine.  ``moelab / experts`` is
    the cost of routing and dispatch; ``experts / dense`` that of running N smaller expert GEMMs
    over N/K times the weights instead of one FFN.  Train: backward of the slot-order gradient.
    """
    K = indices.shape[1]
    with torch.no_grad():
        order, counts, tokens, _ = sort_slots(indices, bank.num_experts)
        xs = x.detach().index_select(0, tokens).contiguous()
        g = grad.index_select(0, tokens).contiguous()
    impl, counts_list = bank.resolved_impl(x, K), counts.tolist()

    def run(rows: Tensor) -> Tensor:
        return (
            grouped_rows(rows, counts, order, indices, bank.expert_weights)
            if impl == "grouped"
            else loop_rows(rows, counts_list, bank.expert_weights)
        )

    xs_train = xs.clone().requires_grad_()

    def train() -> None:
        bank.train()
        xs_train.grad = None
        for p in bank.parameters():
            p.grad = None
        run(xs_train).backward(g)

    def infer() -> None:
        with torch.inference_mode():
            run(xs)

    return [("train", train, free_grads(bank, xs_train)), ("infer", infer, None)]


def _capacity_estimate_gib(peer_name: str, case: Case) -> float:
    """Rough size of a capacity peer's one-hot dispatch temporaries: ``3·K·T·N·C·4`` bytes with
    the eval capacity ``C = max(4, min(T, ⌊2T/N⌋))`` (``K`` = 2 for lucidrains)."""
    T, N = case.tokens, case.num_experts
    k = case.top_k if peer_name == "stmoe" else 2
    capacity = max(4, min(T, int(T * 2.0 / N)))
    return 3 * k * T * N * capacity * 4 / 2**30


def _max_rel_diff(y: Tensor, ref: Tensor) -> float:
    if y.numel() == 0:
        return 0.0
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1.0))


@torch.no_grad()
def _literal(peer: Peer, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
    """``Σ_k w_k · expert_{i_k}(x)`` over the st-moe peer's own expert modules."""
    experts = peer.module.peer.experts.experts
    out = torch.zeros_like(x)
    for e in indices.unique().tolist():
        hit = indices == e  # (T, K)
        rows = hit.any(-1).nonzero().squeeze(-1)
        w = (weights * hit).sum(-1).index_select(0, rows)
        out.index_add_(0, rows, w[:, None].to(x.dtype) * experts[e](x.index_select(0, rows)))
    return out


def build_case(case: Case, args: argparse.Namespace) -> tuple[list[SuiteCandidate], dict, list[str]]:
    """Every candidate of ``case`` (both phases), the realised load, and notes."""
    T, N, K, h, d = case.tokens, case.num_experts, case.top_k, case.d_hidden, case.d_model
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    notes: list[str] = []
    moelab: dict[str, MoE] = {}
    dense: dict[str, MLP] = {}
    peers: dict[str, list[Peer]] = {g: [] for g in GROUPS}

    def group(name: str) -> MoE:
        if name not in moelab:
            act, bias = GROUPS[name]
            layer = MoE(d, N, K, d_hidden=h, method="smoe", activation=act, bias=bias)
            if moelab:
                with torch.no_grad():
                    layer.router.weight.copy_(moelab["swiglu"].router.weight)
            moelab[name] = layer
            dense[name] = MLP(d, K * h, activation=act, bias=bias)
        return moelab[name]

    main = group("swiglu")
    W = main.router.weight.detach().clone()
    for peer in args.peer_list:
        if peer in ("stmoe", "lucidrains") and _capacity_estimate_gib(peer, case) > args.peer_max_gib:
            notes.append(
                f"{peer} skipped: its one-hot dispatch would need about "
                f"{_capacity_estimate_gib(peer, case):.1f} GiB (> --peer-max-gib {args.peer_max_gib:g})"
            )
            continue
        if peer == "mixtral":
            built, note = mixtral_peers(main)
        else:
            one, note = (
                stmoe_peer(W, K, h) if peer == "stmoe" else lucidrains_peer(group("relu") if K == 2 else main)
            )
            built = [one] if one is not None else []
        if note:
            notes.append(note)
        if built:
            peers[PEER_GROUP[peer]].extend(built)
            group(PEER_GROUP[peer])
    for name in [g for g in moelab if g != "swiglu" and not peers[g]]:  # a group whose peer was skipped
        del moelab[name], dense[name]

    modules: list[nn.Module] = [*moelab.values(), *dense.values()]
    modules += [p.module for ps in peers.values() for p in ps]
    for m in modules:
        m.to(device, dtype)
    gen = torch.Generator().manual_seed(args.seed + 1)
    favourites = favourite_experts(T, N, case.routing, gen)
    x = routed_inputs(W, favourites, gen).to(device, dtype)
    grad = torch.randn(T, d, generator=gen).to(device, dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2

    # routing, load, parity checks (eval mode, no autograd)
    for m in modules:
        m.eval()
    with torch.no_grad(), recording_routing(main):
        y_ref = {name: layer(x) for name, layer in moelab.items()}
    routing = main.last_routing
    indices, weights = routing.indices, routing.weights
    load = load_stats(indices, N, favourites)
    dropped: dict[str, dict[str, float]] = {}
    computed: dict[str, dict[str, int]] = {}
    for gname, plist in peers.items():
        for p in plist:
            if not p.capacity:
                with torch.no_grad():
                    diff = _max_rel_diff(p.module(x), y_ref[gname])
                if diff > tol:
                    notes.append(f"{p.name}: output differs from moelab by {diff:.1e} (relative)")
                continue
            dropped[p.name], computed[p.name] = {}, {}
            for phase in ("train", "infer"):
                p.module.train(phase == "train")
                stats = capacity_stats(p, x)
                dropped[p.name][phase] = 1.0 - float(stats["kept"].sum()) / (T * K)
                computed[p.name][phase] = computed_flops_per_token(p, stats["capacity"], T)
            p.module.eval()
            # stats: the eval forward (the last phase); compare the tokens that kept all K slots
            full = stats["kept"].gather(1, indices).all(-1)
            ref = y_ref[gname] if p.name == "lucidrains" else _literal(p, x, indices, weights)
            diff = _max_rel_diff(stats["output"][full], ref[full])
            if diff > tol:
                notes.append(
                    f"{p.name}: output on fully kept tokens differs from moelab by {diff:.1e} (relative)"
                )
            notes.append(
                f"{p.name}: its default stochastic 2nd-expert policy (threshold 0.2) would skip "
                f"{default_policy_skip(weights):.0%} of the 2nd..K-th slots here; set to always route"
            )

    bank = main.experts
    infer_impl = bank.resolved_impl(x, K, grad=False)
    if infer_impl == "stream" and indices.numel() <= N:
        infer_impl += " (slots sorted on the host: T·K <= N)"
    notes.append(f"moelab dispatch: train {bank.resolved_impl(x, K)}, infer {infer_impl}")

    # candidates
    candidates: list[SuiteCandidate] = []
    for gname in moelab:
        members: list[tuple[str, nn.Module, int, Peer | None]] = [
            ("dense", dense[gname], expert_flops_per_token(dense[gname], K), None),
            ("moelab", moelab[gname], expert_flops_per_token(moelab[gname], K), None),
        ]
        members += [(p.name, p.module, p.flops, p) for p in peers[gname]]
        group_cands = []
        for phase in ("train", "infer"):
            for name, m, flops, p in members:
                xin = x.detach().clone().requires_grad_(phase == "train")
                fn = train_step(m, xin, grad) if phase == "train" else infer_step(m, xin)
                c = SuiteCandidate(
                    name,
                    phase,
                    fn,
                    flops,
                    note=p.note if p is not None else "",
                    group=gname,
                    reset=free_grads(m, xin),
                )
                if p is not None and p.capacity:
                    c.drops_tokens = True
                    c.dropped_fraction = dropped[p.name][phase]
                    c.computed_flops = computed[p.name][phase]
                    c.note = f"drops tokens (capacity); {c.note}"
                group_cands.append(c)
        flag_flops(group_cands, group_cands[0].flops)
        candidates += group_cands
    for phase, fn, reset in experts_only(main.experts, x, indices, grad):
        c = SuiteCandidate("experts", phase, fn, expert_flops_per_token(main, K), group="swiglu", reset=reset)
        flag_flops([c], candidates[0].flops)
        candidates.append(c)
    if T <= BOUND_MAX_TOKENS:
        fn, _, nbytes = weights_read_bound(main.experts, x, indices)
        load["touched_weights_mib"] = nbytes / 2**20
        bound = SuiteCandidate("bound", "infer", fn, expert_flops_per_token(main, K), group="swiglu")
        flag_flops([bound], candidates[0].flops)
        candidates.append(bound)
    else:
        load["touched_weights_mib"] = None
    return candidates, load, notes


def _rows(candidates: list[SuiteCandidate]) -> list[dict]:
    """One row per candidate: :func:`moelab.bench.harness.summarize` per group, plus the suite's
    columns (the ratios to the group's ``bound`` and ``experts`` of the same phase)."""
    rows = []
    for gname in dict.fromkeys(c.group for c in candidates):
        members = [c for c in candidates if c.group == gname]
        units = {(c.name, c.phase): c for c in members if c.name in ("bound", "experts")}
        for c, r in zip(members, summarize(members)):
            bound, experts = units.get(("bound", c.phase)), units.get(("experts", c.phase))
            rows.append(
                {
                    "name": r["name"],
                    "group": gname,
                    "phase": r["phase"],
                    **{k: r[k] for k in ("median_ms", "p25_ms", "p75_ms", "min_ms")},
                    **{k: r[k] for k in ("ratio_to_dense", "ratio_p25", "ratio_p75")},
                    "ratio_to_bound": ratio_stats(c.times, bound.times)[0] if bound else None,
                    "ratio_to_experts": ratio_stats(c.times, experts.times)[0] if experts else None,
                    "flops_per_token": c.flops,
                    "computed_flops_per_token": c.computed_flops if c.computed_flops is not None else c.flops,
                    "drops_tokens": c.drops_tokens,
                    "dropped_fraction": c.dropped_fraction,
                    "peak_mib": c.peak_mib,
                    "note": c.note,
                }
            )
    return rows


def run_case(case: Case, args: argparse.Namespace) -> dict:
    """Build, check, time and measure one case; its JSON record."""
    torch.set_num_threads(case.threads)
    start = time.perf_counter()
    candidates, load, notes = build_case(case, args)
    rounds = interleaved(
        candidates, args.repeats, args.warmup, args.clock, budget=args.budget, progress=False
    )
    if args.memory:
        measure_peak_memory(candidates, args.device)
    return {
        "key": case.key,
        "tokens": case.tokens,
        "num_experts": case.num_experts,
        "top_k": case.top_k,
        "d_hidden": case.d_hidden,
        "d_model": case.d_model,
        "routing": case.routing,
        "threads": torch.get_num_threads(),
        "load": load,
        "rounds": rounds,
        "seconds": time.perf_counter() - start,
        "loadavg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "notes": notes,
        "rows": _rows(candidates),
    }


# ---------------------------------------------------------------------------------- output
def summary_row(case: dict) -> dict:
    """The compact line of a case: moelab/dense, the best peer/dense per phase, moelab/bound."""
    rows = case["rows"]

    def pick(name: str, phase: str, key: str = "ratio_to_dense"):
        for r in rows:
            if r["name"] == name and r["group"] == "swiglu" and r["phase"] == phase:
                return r[key]
        return None

    out = {"key": case["key"], "top_share": case["load"]["top_share"]}
    for phase in ("train", "infer"):
        out[f"moelab_dense_{phase}"] = pick("moelab", phase)
        peers = [
            r
            for r in rows
            if r["phase"] == phase and r["name"] not in ("dense", "moelab", "bound", "experts")
        ]
        best = min(peers, key=lambda r: r["ratio_to_dense"]) if peers else None
        out[f"best_peer_{phase}"] = best["name"] if best else None
        out[f"best_peer_dense_{phase}"] = best["ratio_to_dense"] if best else None
        out[f"best_peer_drops_{phase}"] = best["drops_tokens"] if best else None
    out["moelab_bound"] = pick("moelab", "infer", "ratio_to_bound")
    for phase in ("train", "infer"):
        out[f"moelab_experts_{phase}"] = pick("moelab", phase, "ratio_to_experts")
        out[f"experts_dense_{phase}"] = pick("experts", phase)
    return out


def format_case(case: dict) -> str:
    load = case["load"]
    lines = [
        f"{case['key']}: top expert {load['top_share']:.1%} of slots (max/mean {load['max_over_mean']:.2f}), "
        f"{case['rounds']} rounds, {case['seconds']:.0f} s",
        f"{'candidate':<20} {'group':<11} {'phase':<5} {'median ms':>10} {'IQR ms':>17} {'x dense':>7} "
        f"{'ratio IQR':>11} {'x bound':>7} {'x experts':>9} {'MFLOP/tok':>9} {'computed':>9} {'dropped':>7} {'peak MiB':>8}",
    ]
    lines.append("-" * len(lines[-1]))
    for r in case["rows"]:
        riqr = f"{fmt(r['ratio_p25'])}-{fmt(r['ratio_p75'])}" if r["ratio_p25"] is not None else "-"
        lines.append(
            f"{r['name']:<20} {r['group']:<11} {r['phase']:<5} {r['median_ms']:>10.3f} "
            f"{r['p25_ms']:>8.3f}-{r['p75_ms']:<8.3f} {fmt(r['ratio_to_dense']):>7} {riqr:>11} "
            f"{fmt(r['ratio_to_bound']):>7} {fmt(r.get('ratio_to_experts')):>9} {r['flops_per_token'] / 1e6:>9.3f} "
            f"{r['computed_flops_per_token'] / 1e6:>9.3f} {fmt(r['dropped_fraction'], '.1%'):>7} "
            f"{fmt(r['peak_mib'], '.1f'):>8}" + (f"  {r['note']}" if r["note"] else "")
        )
    lines += [f"note: {n}" for n in case["notes"]]
    return "\n".join(lines)


def format_summary(summary: list[dict]) -> str:
    head = (
        f"{'case':<52} {'top':>5} {'moelab/dense':>13} {'best peer/dense train':>30} "
        f"{'best peer/dense infer':>30} {'moelab/bound':>12} {'moelab/experts':>14} {'experts/dense':>14}"
    )
    lines = [
        head,
        f"{'':<52} {'share':>5} {'train':>6} {'infer':>6} {'':>30} {'':>30} {'':>12} {'train':>6} {'infer':>7}"
        f" {'train':>6} {'infer':>7}",
        "-" * len(head),
    ]
    for s in summary:
        lines.append(
            f"{s['key']:<52} {s['top_share']:>5.2f} {fmt(s['moelab_dense_train']):>6} "
            f"{fmt(s['moelab_dense_infer']):>6} {_best_peer(s, 'train'):>30} {_best_peer(s, 'infer'):>30} "
            f"{fmt(s['moelab_bound']):>12} {fmt(s.get('moelab_experts_train')):>6} "
            f"{fmt(s.get('moelab_experts_infer')):>7} {fmt(s.get('experts_dense_train')):>6} "
            f"{fmt(s.get('experts_dense_infer')):>7}"
        )
    return "\n".join(lines)


def _best_peer(s: dict, phase: str) -> str:
    name = s[f"best_peer_{phase}"]
    if name is None:
        return "-"
    drops = ", drops" if s[f"best_peer_drops_{phase}"] else ""
    return f"{s[f'best_peer_dense_{phase}']:.2f} ({name}{drops})"


# ---------------------------------------------------------------------------------- the settings
@dataclass
class SuiteConfig:
    """The settings of ``moelab bench suite``, as its JSON document records them (``settings``).

    Only the settings that change what a case's timings mean (``clock``, ``seed``, ``device``,
    ``dtype``) are inputs that ``--resume`` compares: every case records its own grid point, so a
    resumed document may gain the cases of a larger grid or of other round counts."""

    tokens: str | None = setting(
        None,
        aliases=("-T",),
        input=False,
        help=f"token counts T (default {DEFAULTS['tokens']}; with --device cuda {','.join(map(str, GPU_TOKENS))})",
    )
    shapes: str = setting(DEFAULTS["shapes"], input=False, help="NxKxH: experts x top-k x expert width")
    d_model: str = setting(DEFAULTS["d_model"], input=False, help="token widths d")
    routing: str = setting(DEFAULTS["routing"], input=False, help=f"from {list(ROUTINGS)}")
    threads: str = setting(DEFAULTS["threads"], input=False, help="torch thread counts")
    peers: str = setting(DEFAULTS["peers"], input=False, help=f"from {list(PEERS)}, or 'none'")
    repeats: int | None = setting(
        None,
        input=False,
        allowed=(Interval(int, 1, MAX_COUNT), None),
        help="timed rounds per case at most (default 30; --device cuda: 7)",
    )
    warmup: int = setting(1, input=False, allowed=Interval(int, 0, 1 << 20), help="untimed rounds first")
    budget: float | None = setting(
        None,
        input=False,
        allowed=(Interval(float, 0, closed="neither"), None),
        help="seconds of timed rounds per case after which no new round starts (at least 3 rounds; "
        "default 30, --device cuda: 15)",
    )
    clock: str = setting("wall", allowed=Options(tuple(sorted(CLOCKS))), help="wall or process CPU time")
    seed: int = setting(0, allowed=Interval(int, 0, 2**63 - 1), help="seed of weights and inputs")
    device: str = setting(
        "cpu",
        allowed=Options(("cpu", "cuda")),
        help="cpu or cuda: the GPU grid of production shapes (moelab.bench.gpu)",
    )
    dtype: str | None = setting(
        None, help="float32 (default) or bfloat16; with --device cuda a list (default bfloat16,float32)"
    )
    models: str | None = setting(
        None, input=False, help=f"--device cuda: shapes from {list(MODELS)} (default all)"
    )
    gpu_peers: str | None = setting(
        None,
        input=False,
        help=f"--device cuda: from {list(GPU_PEERS)} or 'none' (default all; each only if installed)",
    )
    fp32_max_tokens: int = setting(
        4096, input=False, allowed=Interval(int, 1), help="--device cuda: float32 cases only up to this T"
    )
    peer_max_gib: float = setting(
        4.0,
        input=False,
        allowed=Interval(float, 0, closed="neither"),
        help="skip a capacity peer whose one-hot dispatch would need more GiB",
    )
    memory: bool = setting(True, input=False, flag="--no-memory", help="skip the peak-memory calls")
    json: bool = setting(False, input=False, help="print one JSON document instead of the tables")


def resolve(config: SuiteConfig) -> SuiteConfig:
    """``config`` with its device's defaults where it left ``None`` (recorded resolved)."""
    cuda = config.device == "cuda"
    defaults = {
        "tokens": ",".join(map(str, GPU_TOKENS)) if cuda else DEFAULTS["tokens"],
        "dtype": ",".join(GPU_DTYPES) if cuda else "float32",
        "repeats": 7 if cuda else 30,
        "budget": 15.0 if cuda else 30.0,
    }
    return replace(config, **{k: v for k, v in defaults.items() if getattr(config, k) is None})


#: ``moelab bench suite`` as the run lifecycle sees it: its ``--out`` is one JSON document (the
#: file ``make bench`` resumes), so the suite records its settings in that document
#: (``settings``) rather than in a run directory's ``config.yaml``
SUITE = runner.Command(
    "bench suite", SuiteConfig, lambda config, run: {}, resolve=resolve, out_required=False
)

#: the settings of the CPU grid that ``--device cuda`` does not take
CPU_ONLY = ("shapes", "d_model", "threads", "peers", "clock", "peer_max_gib")


def namespace(config: SuiteConfig, out: Path | None = None, *, force: bool = False) -> argparse.Namespace:
    """``config`` as the attributes the grid functions read (:func:`parse_grid`,
    :func:`moelab.bench.gpu.run_gpu`), with ``out`` and ``force``."""
    return argparse.Namespace(**vocab.plain(config), out=out, force=force)


def add_arguments(p: argparse.ArgumentParser) -> None:
    vocab.add_arguments(p, SuiteConfig, out_help="also write the JSON document here, after every case")


def _refuse_cpu_only(config: SuiteConfig, resume: bool) -> None:
    defaults = SuiteConfig()
    flags = [vocab.flag_of(SuiteConfig, k) for k in CPU_ONLY if getattr(config, k) != getattr(defaults, k)]
    for flag in flags + (["--resume"] if resume else []):
        raise ValueError(
            f"{flag} is not allowed with --device cuda; it is an option of the CPU grid "
            "(the GPU grid: --models, --tokens, --dtype, --routing, --gpu-peers, --fp32-max-tokens)"
        )


#: what of the machine must match for ``--resume`` to add timings to a file: its cases' ratios
#: are only comparable on the same processor, core count and software
_RESUME_MACHINE_KEYS = (
    "cpu",
    "cpu_id",
    "cpu_capability",
    "cores",
    "torch",
    "transformers",
    "OMP_WAIT_POLICY",
)


def _read_document(out: Path) -> dict:
    try:
        old = json.loads(out.read_text())
        if not isinstance(old["cases"], list) or not isinstance(old["settings"], dict):
            raise TypeError("cases or settings of the wrong type")
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"--out={str(out)!r} is not a suite JSON document with its settings ({exc}); "
            "use --force to overwrite it"
        ) from None
    return old


def _start(given: dict, out: Path | None, *, resume: bool, force: bool, allow_changes: bool):
    """``(config, document)``: a new document, or with ``resume`` the one in ``out`` (its cases
    kept; a changed input refused in the lifecycle's sentence, :func:`moelab.experiments.runner.resume_config`)."""
    runner.check_run_flags(resume=resume, force=force, allow_changes=allow_changes)
    if resume and out is None:
        raise ValueError("--resume needs --out FILE (the file whose cases to keep)")
    old = None
    if out is not None and out.exists() and not force:
        if not resume:
            raise ValueError(
                f"--out={str(out)!r} exists; pass --resume to keep its cases and run the rest, or --force to overwrite it"
            )
        old = _read_document(out)
        config = runner.resume_config(SUITE, given, old["settings"], out, allow_changes=allow_changes)
    else:
        config = runner.new_config(SUITE, given)
    return config, old


def _document(config: SuiteConfig, grid: dict, old: dict | None, out: Path | None) -> dict:
    doc = {
        "bench": "suite",
        "schema": 2,
        "settings": {"command": SUITE.name, **vocab.plain(config)},
        "config": {
            **grid,
            "repeats": config.repeats,
            "warmup": config.warmup,
            "budget": config.budget,
            "clock": config.clock,
            "seed": config.seed,
            "device": config.device,
            "dtype": config.dtype,
            "zipf_exponent": ZIPF_EXPONENT,
            "zipf_margin": ZIPF_MARGIN,
            "bound_max_tokens": BOUND_MAX_TOKENS,
            "peer_max_gib": config.peer_max_gib,
            "memory": config.memory,
        },
        "machine": machine_info(),
        "cases": [],
        "summary": [],
    }
    if old is None:
        return doc
    old_machine = old.get("machine") if isinstance(old.get("machine"), dict) else {}
    for key in _RESUME_MACHINE_KEYS:
        if old_machine.get(key) != doc["machine"][key]:
            raise ValueError(
                f"--resume: this machine's {key} {doc['machine'][key]!r} differs from "
                f"{old_machine.get(key)!r} in {str(out)!r} (timings of two machines would mix); "
                "run on that machine, or use --force to start again"
            )
    doc["cases"] = list(old["cases"])
    return doc


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    given = runner.given_by_args(SUITE, args)
    out = None if args.out is None else Path(args.out)
    resume, force = bool(args.resume), bool(args.force)
    fresh = runner.new_config(SUITE, given)
    if fresh.device == "cuda":  # the GPU grid writes a new document each time
        _refuse_cpu_only(fresh, resume)
        return run_gpu(namespace(fresh, out, force=force))
    config, old = _start(given, out, resume=resume, force=force, allow_changes=bool(args.allow_changes))
    settings = namespace(config, out, force=force)
    cases = parse_grid(settings)
    doc = _document(config, settings.grid, old, out)
    done = {c["key"] for c in doc["cases"]}
    threads = torch.get_num_threads()
    show = (lambda text: None) if config.json else (lambda text: tqdm.write(text, file=sys.stdout))
    machine = doc["machine"]
    show(
        f"moelab bench suite: {len(cases)} cases ({len(done & {c.key for c in cases})} already in --out), "
        f"{config.repeats} rounds at most ({config.budget:g} s budget) after {config.warmup} warm-up, "
        f"{config.clock} clock, {config.device} {config.dtype}\nmachine: {_cpu_text(machine)}, "
        f"{machine['cores']} cores, torch {machine['torch']}, transformers {machine['transformers']}, "
        f"load {machine['loadavg_1min']:.1f}, OMP_WAIT_POLICY={machine['OMP_WAIT_POLICY'] or 'unset'}"
    )
    try:
        bar = tqdm(cases, desc="bench suite", unit="case", file=sys.stderr, dynamic_ncols=True)
        for case in bar:
            if case.key in done:
                continue
            bar.set_postfix_str(case.key)
            record = run_case(case, settings)
            doc["cases"].append(record)
            doc["summary"] = [summary_row(c) for c in doc["cases"]]
            if out is not None:
                write_document(out, doc)
            show(format_case(record) + "\n")
    finally:
        torch.set_num_threads(threads)
    doc["summary"] = [summary_row(c) for c in doc["cases"]]
    if out is not None:  # the settings of a resumed run, even when every case was already there
        write_document(out, doc)
    if config.json:
        print(json.dumps(doc))
    else:
        show(
            "summary (ratios: median over rounds; train = forward + backward, infer = inference-mode forward)\n"
            + format_summary(doc["summary"])
        )
    return 0


def _cpu_text(machine: dict) -> str:
    """``AMD EPYC (AuthenticAMD 25/1/1, AVX2)``: the processor's name, identity and vector level
    (documents written before these were recorded give the name alone)."""
    known = [machine[k] for k in ("cpu_id", "cpu_capability") if machine.get(k)]
    return f"{machine['cpu']} ({', '.join(known)})" if known else machine["cpu"]


# ---------------------------------------------------------------------------------- markdown
def markdown_summary(doc: dict) -> str:
    """The summary of a suite document as a markdown table (docs/performance.md), with its machine."""
    m = doc["machine"]
    lines = [
        f"Machine: {_cpu_text(m)}, {m['cores']} cores, torch {m['torch']}, transformers {m['transformers']}, "
        f"moelab {m['moelab']}, OMP_WAIT_POLICY={m['OMP_WAIT_POLICY'] or 'unset'}; "
        f"clock {doc['config']['clock']}, {doc['config']['repeats']} rounds at most, budget {doc['config']['budget']:g} s.",
        "",
        "| T | N×K×h | d | routing | thr | top share | moelab/dense train | infer | moelab/experts train | infer "
        "| experts/dense train | infer | moelab/bound | best peer/dense train | best peer/dense infer |",
        "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for case, s in zip(doc["cases"], doc["summary"]):
        lines.append(
            f"| {case['tokens']} | {case['num_experts']}×{case['top_k']}×{case['d_hidden']} | {case['d_model']} "
            f"| {case['routing']} | {case['threads']} | {s['top_share']:.2f} | {fmt(s['moelab_dense_train'])} "
            f"| {fmt(s['moelab_dense_infer'])} | {fmt(s.get('moelab_experts_train'))} "
            f"| {fmt(s.get('moelab_experts_infer'))} | {fmt(s.get('experts_dense_train'))} "
            f"| {fmt(s.get('experts_dense_infer'))} | {fmt(s['moelab_bound'])} | {_best_peer(s, 'train')} "
            f"| {_best_peer(s, 'infer')} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # python -m moelab.bench.suite runs/bench/suite.json: the markdown summary
    for path in sys.argv[1:]:
        print(markdown_summary(json.loads(Path(path).read_text())))
