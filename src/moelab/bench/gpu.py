"""``moelab bench suite --device cuda``: the GPU grid — production MoE shapes at training batch sizes.

The shapes of four released models (:data:`MODELS`) × tokens × dtype × routing
(:func:`build_gpu_cases`; ``d_model`` halved where a case would not fit, :func:`fit_d_model`),
each timed in both phases for a dense SwiGLU FFN of the same active FLOPs (the limit every ratio
is taken to), moelab's ``grouped`` and ``triton`` kernels, transformers' Mixtral block holding
moelab's parameters and the installed GPU peers, by the one harness
(:func:`moelab.bench.harness.interleaved`, CUDA events, medians, ratios per round).  A candidate
that fails is dropped from its case with a note and the run goes on; ``--out FILE`` writes the
JSON after every case and the markdown table (:func:`markdown_table`) beside it.
docs/performance-gpu.md ("The GPU grid") describes the cases, candidates, timing, FLOP accounting and
record keys.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from .. import _validate
from ..experts import MLP
from ..layer import MoE, recording_routing
from .harness import (
    Candidate,
    device_peak_tflops,
    fmt,
    free_grads,
    infer_step,
    interleaved,
    machine_info,
    measure_peak_memory,
    package_version,
    summarize,
    train_step,
    write_document,
)
from .peers import GPU_PEER_ADAPTERS, Batched, mixtral_block
from .workload import ROUTINGS, favourite_experts, int_list, load_stats, name_list, routed_inputs

__all__ = [
    "GPU_PEERS",
    "GPU_TOKENS",
    "MODELS",
    "GpuCase",
    "build_gpu_cases",
    "fit_d_model",
    "markdown_table",
    "memory_estimate",
    "parse_gpu_grid",
    "run_case",
    "run_gpu",
]


@dataclass(frozen=True)
class ModelShape:
    title: str
    d_model: int
    d_hidden: int
    num_experts: int
    top_k: int
    shared: int = 0  # shared experts of width d_hidden


#: the shapes of the GPU grid
MODELS: dict[str, ModelShape] = {
    "mixtral": ModelShape("Mixtral-8x7B-like", 4096, 14336, 8, 2),
    "olmoe": ModelShape("OLMoE-1B-7B-like", 2048, 1024, 64, 8),
    "qwen3": ModelShape("Qwen3-30B-A3B-like", 2048, 768, 128, 8),
    "deepseek-v3": ModelShape("DeepSeek-V3-like", 7168, 2048, 256, 8, shared=1),
}
GPU_TOKENS = (4096, 8192, 16384, 32768)
GPU_DTYPES = ("bfloat16", "float32")
GPU_PEERS = ("transformers", "megablocks", "torchtitan", "sonic-moe")
#: share of the device memory the estimate may fill before d_model is halved
MEMORY_FRACTION = 0.8


# ---------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class GpuCase:
    model: str
    tokens: int
    dtype: str
    routing: str
    d_model: int
    d_hidden: int
    num_experts: int
    top_k: int
    shared: int
    d_model_preset: int

    @property
    def key(self) -> str:
        scaled = f" (scaled from {self.d_model_preset})" if self.d_model != self.d_model_preset else ""
        return (
            f"{self.model} T={self.tokens} {self.dtype} {self.routing}: d={self.d_model}{scaled} "
            f"h={self.d_hidden} N={self.num_experts} K={self.top_k}"
            + (f" +{self.shared} shared" if self.shared else "")
        )


def memory_estimate(shape: ModelShape, d_model: int, tokens: int, dtype: str) -> int:
    """Bytes one case needs at most, roughly: the experts' (and the dense FFN's) weights and
    their gradients, and per token slot the gathered input, the pre-activations, activations and
    outputs kept for backward and the backward's temporaries (``4d + 5h`` elements)."""
    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    d, h, k = d_model, shape.d_hidden, shape.top_k
    weights = (
        (shape.num_experts + shape.shared) * 3 * d * h
        + shape.num_experts * d
        + (k + shape.shared) * 3 * d * h
    )
    slots = tokens * k
    return size * (2 * weights + slots * (4 * d + 5 * h) + tokens * (3 * shape.shared * h + 8 * d))


def fit_d_model(shape: ModelShape, tokens: int, dtype: str, memory: int | None) -> int:
    """``d_model`` of ``shape``, halved (to multiples of 128) until :func:`memory_estimate` at
    ``tokens`` fits in :data:`MEMORY_FRACTION` of ``memory`` bytes (``None``: unscaled)."""
    d = shape.d_model
    if memory is None:
        return d
    while d > 256 and memory_estimate(shape, d, tokens, dtype) > MEMORY_FRACTION * memory:
        d = max(256, (d // 2) // 128 * 128)
    return d


def build_gpu_cases(
    models: list[str],
    tokens: list[int],
    dtypes: list[str],
    routings: list[str],
    fp32_max_tokens: int,
    memory: int | None = None,
) -> list[GpuCase]:
    """The cases in run order (model, dtype, T, routing): float32 only up to ``fp32_max_tokens``;
    one ``d_model`` per model and dtype (:func:`fit_d_model` at the largest T of that dtype)."""
    cases = []
    for name in models:
        shape = MODELS[name]
        for dtype in dtypes:
            ts = [t for t in tokens if dtype != "float32" or t <= fp32_max_tokens]
            if not ts:
                continue
            d = fit_d_model(shape, max(ts), dtype, memory)
            for t in ts:
                for r in routings:
                    cases.append(
                        GpuCase(
                            name,
                            t,
                            dtype,
                            r,
                            d,
                            shape.d_hidden,
                            shape.num_experts,
                            shape.top_k,
                            shape.shared,
                            shape.d_model,
                        )
                    )
    return cases


def parse_gpu_grid(args: argparse.Namespace, memory: int | None = None) -> list[GpuCase]:
    """Validate the GPU options (before any CUDA check, so that a CPU machine can test them) and
    return the cases; ``memory``: the device's bytes (``None``: no d_model scaling)."""

    models = name_list("--models", args.models or ",".join(MODELS), tuple(MODELS))
    tokens = int_list("--tokens", args.tokens or ",".join(map(str, GPU_TOKENS)))
    dtypes = name_list("--dtype", args.dtype or ",".join(GPU_DTYPES), GPU_DTYPES)
    routings = name_list("--routing", args.routing, ROUTINGS)
    peers = name_list("--gpu-peers", args.gpu_peers or ",".join(GPU_PEERS), GPU_PEERS, empty_ok=True)
    fp32_max = _validate.positive_int("--fp32-max-tokens", args.fp32_max_tokens)
    if "float32" in dtypes and "bfloat16" not in dtypes and all(t > fp32_max for t in tokens):
        raise ValueError(
            f"--fp32-max-tokens={fp32_max} leaves no case: every --tokens value is larger; raise it or add bfloat16"
        )
    args.repeats = 7 if args.repeats is None else _validate.positive_int("--repeats", args.repeats)
    args.budget = 15.0 if args.budget is None else _validate.positive("--budget", args.budget)
    _validate.int_in_range("--warmup", args.warmup, 0, 1 << 20)
    args.gpu_grid = {
        "models": models,
        "tokens": tokens,
        "dtypes": dtypes,
        "routing": routings,
        "peers": peers,
        "fp32_max_tokens": fp32_max,
    }
    return build_gpu_cases(models, tokens, dtypes, routings, fp32_max, memory)


# ---------------------------------------------------------------------------------- candidates
# ---------------------------------------------------------------------------------- candidates
def _swiglu_flops(d: int, h: int) -> int:
    return 2 * 3 * d * h


class _WithImpl(nn.Module):
    """``layer`` run by the experts kernel ``impl``: both moelab rows share one layer."""

    def __init__(self, layer: MoE, impl: str) -> None:
        super().__init__()
        self.layer, self.impl = layer, impl

    def forward(self, x: Tensor) -> Tensor:
        self.layer.experts.impl = self.impl
        return self.layer(x)


class _Group:
    """The modules of one (model, dtype, d_model): built once, reused for every T and routing."""

    def __init__(self, case: GpuCase, peers: list[str], device: torch.device, seed: int) -> None:
        from ..experts.triton_kernels import unavailable_reason

        dtype = getattr(torch, case.dtype)
        self.notes: list[str] = []
        self.versions: dict[str, str | None] = {}
        torch.manual_seed(seed)
        d, h, n, k, s = case.d_model, case.d_hidden, case.num_experts, case.top_k, case.shared
        saved = torch.get_default_dtype()
        try:
            torch.set_default_dtype(dtype)  # build in place: no float32 copy of 10+ GB of weights
            with torch.device(device):
                self.layer = MoE(
                    d, n, k, d_hidden=h, method="smoe", activation="swiglu", check_finite=False, num_shared=s
                )
                self.dense = MLP(d, (k + s) * h, activation="swiglu")
        finally:
            torch.set_default_dtype(saved)
        moe_flops = (k + s) * _swiglu_flops(d, h)
        #: name → (module, forward FLOPs per token, note)
        self.modules: dict[str, tuple[nn.Module, int, str]] = {
            "dense": (self.dense, moe_flops, ""),
            "moelab grouped": (_WithImpl(self.layer, "grouped"), moe_flops, ""),
        }
        reason = unavailable_reason(device, dtype)
        if reason is None:
            self.modules["moelab triton"] = (_WithImpl(self.layer, "triton"), moe_flops, "")
        else:
            self.notes.append(f"moelab triton skipped: {reason}")
        self.versions["triton"] = package_version("triton")
        no_shared = "no shared expert: FLOPs differ from dense" if s else ""
        if "transformers" in peers:
            self.versions["transformers"] = package_version("transformers")
            try:
                block = Batched(mixtral_block(self.layer, "grouped_mm", share=True))
                self.modules["transformers grouped_mm"] = (block, k * _swiglu_flops(d, h), no_shared)
            except Exception as exc:  # an API change, a missing kernel: noted, not fatal
                self.notes.append(f"transformers grouped_mm skipped: {type(exc).__name__}: {exc}"[:300])
        for name in peers:
            if name not in GPU_PEER_ADAPTERS:
                continue
            dist, adapter, peer_note = GPU_PEER_ADAPTERS[name]
            self.versions[name] = package_version(dist)
            if self.versions[name] is None:
                self.notes.append(f"{name} skipped: not installed")
                continue
            with_shared = name == "torchtitan"  # the one peer with shared experts
            flops = (k + (s if with_shared else 0)) * _swiglu_flops(d, h)
            note = "; ".join(x for x in (peer_note, "" if with_shared else no_shared) if x)
            try:
                self.modules[name] = (adapter(self.layer, dtype), flops, note)
            except Exception as exc:
                self.notes.append(f"{name} skipped: {type(exc).__name__}: {exc}"[:300])

    def close(self) -> None:
        self.modules.clear()
        del self.layer, self.dense
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _case_candidates(group: _Group, x: Tensor, grad: Tensor) -> tuple[list[Candidate], list[str]]:
    """Both phases of every module of ``group``, after a parity check against moelab grouped."""
    notes = []
    tol = 1e-3 if x.dtype == torch.float32 else 3e-2
    dense_flops = group.modules["dense"][1]
    ran = []
    with torch.inference_mode():
        ref = None
        for name, (module, flops, _) in group.modules.items():
            try:
                module.eval()
                y = module(x)
            except Exception as exc:
                notes.append(f"{name} dropped: {type(exc).__name__}: {exc}"[:300])
                continue
            ran.append(name)
            if name == "moelab grouped":
                ref = y
            elif ref is None or name == "dense":
                continue
            elif flops != dense_flops:
                notes.append(f"{name}: output not compared (other FLOPs: no shared expert)")
            else:
                diff = float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))
                if diff > tol:
                    notes.append(f"{name}: output differs from moelab grouped by {diff:.1e} (relative)")
    cands = []
    for phase in ("fwd", "fwd+bwd"):
        for name in ran:
            module, flops, note = group.modules[name]
            xin = x.detach().clone().requires_grad_(phase == "fwd+bwd")
            fn = infer_step(module, xin) if phase == "fwd" else train_step(module, xin, grad)
            cands.append(Candidate(name, phase, fn, flops, note, reset=free_grads(module, xin)))
    return cands, notes


def _rows(cands: list[Candidate], tokens: int, peak: float | None) -> list[dict]:
    """The rows of one case: timing (:func:`moelab.bench.harness.summarize`) and throughput; the
    backward counts twice the forward's FLOPs."""
    rows = []
    for c, r in zip(cands, summarize(cands)):
        flops = c.flops * tokens * (3 if c.phase == "fwd+bwd" else 1)
        tflops = flops / (r["median_ms"] / 1e3) / 1e12
        rows.append(
            {
                **{k: r[k] for k in ("name", "phase", "median_ms", "min_ms", "max_ms", "rounds")},
                "ratio_to_dense": r["ratio_to_dense"],
                "flops_per_token": c.flops,
                "tflops": tflops,
                "peak_fraction": tflops / peak if peak else None,
                "peak_mib": c.peak_mib,
                "note": c.note,
            }
        )
    return rows


def run_case(
    case: GpuCase, group: _Group, args: argparse.Namespace, peak: float | None, device: torch.device
) -> dict:
    """Inputs, candidates, parity notes, timing and peak memory of one case: its JSON record.
    CUDA events time the calls on a CUDA device, the wall clock elsewhere (tests)."""
    dtype = getattr(torch, case.dtype)
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(args.seed + 1)
    favourites = favourite_experts(case.tokens, case.num_experts, case.routing, gen)
    x = routed_inputs(group.layer.router.weight, favourites, gen).to(device, dtype)
    grad = torch.randn(case.tokens, case.d_model, generator=gen).to(device, dtype)
    with recording_routing(group.layer):
        cands, notes = _case_candidates(group, x, grad)
    load = load_stats(group.layer.last_routing.indices, case.num_experts, favourites)
    clock = "cuda" if device.type == "cuda" else "wall"
    rounds = interleaved(
        cands,
        args.repeats,
        args.warmup,
        clock,
        device=device,
        budget=args.budget,
        progress=False,
        notes=notes,
    )
    if args.memory:
        measure_peak_memory(cands, device, notes)
    return {
        **asdict(case),
        "key": case.key,
        "load": load,
        "rounds": rounds,
        "seconds": time.perf_counter() - start,
        "notes": notes,
        "rows": _rows(cands, case.tokens, peak),
    }


# ---------------------------------------------------------------------------------- output
def markdown_table(doc: dict) -> str:
    """The GPU suite document as markdown: the machine, then one row per case × candidate × phase."""
    m, cfg = doc["machine"], doc["config"]
    lines = [
        f"Device: {m.get('gpu')} ({m.get('peak_name') or 'peak unknown'}: bf16 {fmt(m.get('peak_bf16_tflops'), '.0f')} "
        f"TFLOP/s dense), torch {m['torch']}, CUDA {m.get('cuda')}; versions {m.get('versions')}; "
        f"{cfg['repeats']} rounds at most after {cfg['warmup']} warm-up, {cfg['budget']:g} s budget per case, CUDA events, medians.",
        "",
        "| model | T | dtype | routing | d | candidate | phase | median ms | × dense | TFLOP/s | % peak | peak MiB | note |",
        "|---|---:|---|---|---:|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for case in doc["cases"]:
        for r in case["rows"]:
            frac = None if r["peak_fraction"] is None else 100 * r["peak_fraction"]
            lines.append(
                f"| {case['model']} | {case['tokens']} | {case['dtype']} | {case['routing']} | {case['d_model']} "
                f"| {r['name']} | {r['phase']} | {r['median_ms']:.2f} | {fmt(r['ratio_to_dense'])} "
                f"| {r['tflops']:.0f} | {fmt(frac, '.0f')} | {fmt(r['peak_mib'], '.0f')} | {r['note']} |"
            )
        for note in case["notes"]:
            lines.append(f"|  |  |  |  |  | note: {note} |  |  |  |  |  |  |  |")
    return "\n".join(lines)


def run_gpu(args: argparse.Namespace) -> int:
    """``moelab bench suite --device cuda`` (module docstring)."""
    parse_gpu_grid(args)  # validate everything before looking for a device
    if args.out is not None and args.out.exists() and not args.force:
        raise ValueError(f"--out={str(args.out)!r} exists; pass --force to overwrite it")
    if not torch.cuda.is_available():
        raise ValueError("--device='cuda' is not allowed here: torch sees no CUDA device; use --device cpu")
    device = torch.device("cuda")
    machine = {**machine_info(device), "versions": {}}
    cases = parse_gpu_grid(args, memory=torch.cuda.get_device_properties(device).total_memory)
    doc = {
        "bench": "suite-gpu",
        "schema": 1,
        "config": {
            **args.gpu_grid,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "budget": args.budget,
            "seed": args.seed,
            "memory": args.memory,
            "memory_fraction": MEMORY_FRACTION,
        },
        "machine": machine,
        "cases": [],
    }
    print(
        f"moelab bench suite --device cuda: {len(cases)} cases on {machine['gpu']} "
        f"({machine['gpu_memory_gib']:.0f} GiB), torch {torch.__version__}, "
        f"peak bf16 {fmt(machine['peak_bf16_tflops'], '.0f')} TFLOP/s",
        flush=True,
    )
    group, group_key = None, None
    t0 = time.perf_counter()
    for i, case in enumerate(cases):
        key = (case.model, case.dtype, case.d_model)
        group_notes = []
        if key != group_key:
            if group is not None:
                group.close()
                group = None
            group = _Group(case, args.gpu_grid["peers"], device, args.seed)
            machine["versions"].update(group.versions)
            group_key = key
            group_notes = list(group.notes)
        peak = device_peak_tflops(machine["gpu"], case.dtype, machine["allow_tf32"])[1]
        record = run_case(case, group, args, peak, device)
        record["notes"] = group_notes + record["notes"]
        doc["cases"].append(record)
        if args.out is not None:
            write_document(args.out, doc, markdown_table(doc))
        best = {r["name"]: r for r in record["rows"] if r["phase"] == "fwd+bwd"}
        summary = ", ".join(f"{n} {fmt(r['ratio_to_dense'])}x" for n, r in best.items())
        print(
            f"[{i + 1}/{len(cases)} {time.perf_counter() - t0:.0f} s] {case.key}: fwd+bwd vs dense: {summary}",
            flush=True,
        )
    if group is not None:
        group.close()
    if args.json:
        print(json.dumps(doc))
    else:
        print(markdown_table(doc))
    sys.stdout.flush()
    return 0
