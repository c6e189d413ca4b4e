"""What every ``moelab bench`` kind shares: machine information, interleaved timing with medians
and ratios, FLOP accounting, and the table.

Method: every candidate lives in one process; repetitions are interleaved round-robin (the order
rotates each round), so slow phases of a shared machine hit every candidate alike; a table gives
medians, the interquartile range, and each candidate's ratio to the baseline as the median over
rounds of ``t_candidate / t_baseline`` within the same round.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .._version import __version__
from ..experts import MLP, ExpertBank
from ..layer import MoE

__all__ = [
    "CLOCKS",
    "Candidate",
    "expert_flops_per_token",
    "flag_flops",
    "format_table",
    "infer_step",
    "interleaved",
    "machine_info",
    "summarize",
    "train_step",
]


# ---------------------------------------------------------------------------------- machine
def machine_info() -> dict:
    """Cores, threads, versions and load: printed with every table.  ``cpu_id`` (vendor, family,
    model, stepping) and ``cpu_capability`` (the vector instructions ATen dispatches to) tell
    apart machines whose ``cpu`` name is the same: a VM's "AMD EPYC" may be one generation one day
    and another the next, with other GEMM speeds and other floating-point bits."""
    info = {
        "cpu": _cpu_model(),
        "cpu_id": _cpu_id(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
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


def _cpu_id() -> str | None:
    """``"vendor family/model/stepping"`` from ``/proc/cpuinfo`` (Linux), else ``None``."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return None
    if "cpu family" not in fields:
        return None
    return (
        f"{fields.get('vendor_id', '?')} {fields['cpu family']}/{fields.get('model', '?')}/"
        f"{fields.get('stepping', '?')}"
    )


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


# ---------------------------------------------------------------------------------- steps
def train_step(module: nn.Module, x: Tensor, grad: Tensor) -> Callable[[], None]:
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


def infer_step(module: nn.Module, x: Tensor) -> Callable[[], None]:
    def step() -> None:
        module.eval()
        with torch.inference_mode():
            module(x)
        if x.is_cuda:
            torch.cuda.synchronize()

    return step
