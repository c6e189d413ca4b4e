"""What every ``moelab bench`` kind shares: the machine record, interleaved timing with medians and
ratios, peak memory, FLOP accounting and the table.

Method: every candidate lives in one process; repetitions are interleaved, each round every
candidate once in a fresh seeded random order, so slow phases of a shared machine hit every
candidate alike and no candidate always follows the same one (what ran just before a call moves its
time by a few per cent: caches, OpenMP workers still spinning); a table gives
medians, the interquartile range, and each candidate's ratio to the baseline as the median over
rounds of ``t_candidate / t_baseline`` within the same round.  A call is timed by a host clock
(``wall``: ``perf_counter``; ``cpu``: the process's CPU time), which waits for a CUDA device to
finish, or by CUDA events recorded around it (``cuda``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from .._version import __version__
from ..experts import MLP, ExpertBank
from ..io.atomic import atomic_write_text
from ..layer import MoE

__all__ = [
    "CLOCKS",
    "PEAKS",
    "Candidate",
    "FixedSchedule",
    "device_peak_tflops",
    "expert_flops_per_token",
    "flag_flops",
    "fmt",
    "format_table",
    "free_grads",
    "infer_step",
    "interleaved",
    "machine_info",
    "measure_peak_memory",
    "package_version",
    "peak_memory_bytes",
    "ratio_stats",
    "summarize",
    "train_step",
    "write_document",
]


# ---------------------------------------------------------------------------------- machine
#: dense (no sparsity) tensor-core peaks in TFLOP/s from the vendor datasheets, by a substring of
#: ``torch.cuda.get_device_name()`` (first match): ``(name, bf16, tf32, fp32)``.  "H100 80GB HBM3"
#: is the H100 SXM.
PEAKS: list[tuple[str, str, float, float, float]] = [
    ("H100 PCIe", "H100 PCIe", 756.0, 378.0, 51.2),
    ("H100 NVL", "H100 NVL", 835.0, 417.5, 60.0),
    ("H100", "H100 SXM", 989.4, 494.7, 66.9),
    ("GH200", "GH200", 989.4, 494.7, 66.9),
    ("H200", "H200 SXM", 989.4, 494.7, 66.9),
    ("A100", "A100", 312.0, 156.0, 19.5),
    ("L40S", "L40S", 362.1, 183.0, 91.6),
    ("L4", "L4", 121.0, 60.0, 30.3),
]


def device_peak_tflops(name: str, dtype: str, tf32: bool) -> tuple[str | None, float | None]:
    """``(datasheet name, peak TFLOP/s)`` of the device called ``name`` for ``dtype``, or ``(None, None)``."""
    for key, label, bf16, tf32_peak, fp32 in PEAKS:
        if key in name:
            if dtype in ("bfloat16", "float16"):
                return label, bf16
            return label, tf32_peak if tf32 else fp32
    return None, None


def machine_info(device: torch.device | str = "cpu") -> dict:
    """Cores, threads, versions and load: printed with every table.  ``cpu_id`` (vendor, family,
    model, stepping) and ``cpu_capability`` (the vector instructions ATen dispatches to) tell
    apart machines whose ``cpu`` name is the same: a VM's "AMD EPYC" may be one generation one day
    and another the next, with other GEMM speeds and other floating-point bits.  On a CUDA
    ``device`` also the GPU, its memory, the CUDA version and its datasheet peaks."""
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
    if torch.device(device).type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
        peak_name, bf16_peak = device_peak_tflops(gpu, "bfloat16", tf32)
        info.update(
            gpu=gpu,
            gpu_memory_gib=torch.cuda.get_device_properties(device).total_memory / 2**30,
            cuda=torch.version.cuda,
            peak_name=peak_name,
            peak_bf16_tflops=bf16_peak,
            peak_fp32_tflops=device_peak_tflops(gpu, "float32", tf32)[1],
            allow_tf32=tf32,
        )
    return info


def package_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (a peer's package), ``None`` if not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


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
    """One timed callable.  ``flops``: the expert (or dense FFN) multiply-add FLOPs per token;
    ``reset``: frees what the previous call left (gradients), run untimed before every call."""

    name: str
    phase: str  # e.g. "train" (forward + backward) or "infer" (inference-mode forward)
    fn: Callable[[], None]
    flops: int | None = None
    note: str = ""
    times: list[float] = field(default_factory=list)
    reset: Callable[[], None] | None = None
    peak_mib: float | None = None


#: the host clocks a user picks from; ``interleaved`` also takes ``"cuda"`` (CUDA events)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class _Timer:
    """Seconds of one call: CUDA events around it, or a host clock that waits for the device."""

    def __init__(self, clock: str, device: torch.device) -> None:
        if clock not in (*CLOCKS, "cuda"):
            raise ValueError(f"clock={clock!r} is not allowed; expected one of {[*CLOCKS, 'cuda']}")
        self.events = clock == "cuda"
        self.cuda = device.type == "cuda"
        if self.events:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
        else:
            self.now = CLOCKS[clock]

    def __call__(self, fn: Callable[[], None]) -> float:
        if self.events:
            self.start.record()
            fn()
            self.end.record()
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        t0 = self.now()
        fn()
        self.sync()
        return self.now() - t0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def interleaved(
    candidates: list[Candidate],
    repeats: int,
    warmup: int,
    clock: str = "wall",
    *,
    device: torch.device | str = "cpu",
    budget: float | None = None,
    min_repeats: int = 3,
    progress: bool | None = None,
    notes: list[str] | None = None,
) -> int:
    """Time every candidate ``repeats`` times, each round every candidate once in a random order
    (seeded: the same orders every run), after ``warmup`` untimed rounds in the given order; each
    call follows its candidate's ``reset``.

    ``clock``: ``"wall"``, ``"cpu"`` (the process's CPU time, all threads: on a shared,
    oversubscribed machine with one torch thread it counts the work done rather than the time
    spent waiting for a core; with several threads it also counts OpenMP spin-waiting) or
    ``"cuda"`` (CUDA events around each call).

    ``budget`` (seconds): stop after the first complete round at which the timed rounds have
    taken longer, but never before ``min(min_repeats, repeats)`` rounds.  ``progress``: print the
    round on stderr (default: when stderr is a terminal).  ``notes``: where a call raises (out of
    memory above all), its candidate is removed from ``candidates`` with a note in this list and
    the others go on; without it the error propagates.  Returns the rounds timed.
    """
    timer = _Timer(clock, torch.device(device))

    def call(c: Candidate, timed: bool) -> bool:
        if c.reset is not None:
            c.reset()
        try:
            if timed:
                c.times.append(timer(c.fn))
            else:
                c.fn()
        except Exception as exc:
            if notes is None:
                raise
            notes.append(f"{c.name} {c.phase} dropped: {type(exc).__name__}: {exc}"[:300])
            if c.reset is not None:
                c.reset()
            if timer.cuda:
                torch.cuda.empty_cache()
            return False
        return True

    for _ in range(warmup):
        candidates[:] = [c for c in list(candidates) if call(c, timed=False)]
    timer.sync()
    progress = sys.stderr.isatty() if progress is None else progress
    shuffle = random.Random(0)
    start = time.perf_counter()
    rounds = 0
    for r in range(repeats):
        if progress:
            print(f"\rround {r + 1}/{repeats}", end="", file=sys.stderr, flush=True)
        order = list(candidates)
        shuffle.shuffle(order)
        kept = {id(c) for c in order if call(c, timed=True)}
        candidates[:] = [c for c in candidates if id(c) in kept]
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


def ratio_stats(times: list[float], baseline: list[float]) -> tuple[float | None, float | None, float | None]:
    """Median, 25th and 75th percentiles over rounds of ``t / t_baseline`` within the same round
    (``None`` without a baseline)."""
    ratios = [t / tb for t, tb in zip(times, baseline)]
    if not ratios:
        return None, None, None
    return statistics.median(ratios), _quantile(ratios, 0.25), _quantile(ratios, 0.75)


def summarize(candidates: list[Candidate]) -> list[dict]:
    """Medians, quartiles and per-round ratios to the ``dense`` candidate of the same phase."""
    base = {c.phase: c for c in candidates if c.name == "dense"}
    rows = []
    for c in candidates:
        b = base.get(c.phase)
        ratio, ratio_p25, ratio_p75 = ratio_stats(c.times, b.times if b is not None else [])
        rows.append(
            {
                "name": c.name,
                "phase": c.phase,
                "median_ms": 1e3 * statistics.median(c.times),
                "p25_ms": 1e3 * _quantile(c.times, 0.25),
                "p75_ms": 1e3 * _quantile(c.times, 0.75),
                "min_ms": 1e3 * min(c.times),
                "max_ms": 1e3 * max(c.times),
                "rounds": len(c.times),
                "ratio_to_dense": ratio,
                "ratio_p25": ratio_p25,
                "ratio_p75": ratio_p75,
                "flops_per_token": c.flops,
                "peak_mib": c.peak_mib,
                "note": c.note,
            }
        )
    return rows


# ---------------------------------------------------------------------------------- memory
@contextlib.contextmanager
def _quiet_fd2() -> Iterator[None]:
    """Silence file descriptor 2 (the profiler's C++ start/stop lines), Python's stderr untouched."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_memory_bytes(fn: Callable[[], object], device: torch.device | str = "cpu") -> int | None:
    """Peak growth of allocated memory while ``fn()`` runs, over what was allocated before, in bytes.

    CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.  CPU:
    ``torch.profiler`` with ``profile_memory=True``; the allocation and free records are summed in
    time order and the running maximum is the peak (``None`` where they cannot be read).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with _quiet_fd2(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    try:
        events = prof.profiler.kineto_results.events()
    except AttributeError:
        return None
    cpu = (DeviceType.CPU, DeviceType.MKLDNN, DeviceType.IDEEP)
    records = sorted(
        (e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type() in cpu
    )
    running = peak = 0
    for _, nbytes in records:
        running += nbytes
        peak = max(peak, running)
    return peak


def measure_peak_memory(
    candidates: list[Candidate], device: torch.device | str, notes: list[str] | None = None
) -> None:
    """Set each candidate's ``peak_mib`` from one untimed call between two ``reset``s, so that
    the weights and inputs are not counted and a training step's gradients are.  ``notes``: where
    a call raises, a note instead of the error (``peak_mib`` stays ``None``)."""
    for c in candidates:
        if c.reset is not None:
            c.reset()
        try:
            peak = peak_memory_bytes(c.fn, device)
        except Exception as exc:
            if notes is None:
                raise
            notes.append(f"{c.name} {c.phase} peak memory not measured: {type(exc).__name__}"[:300])
            peak = None
        c.peak_mib = None if peak is None else peak / 2**20
        if c.reset is not None:
            c.reset()


# ---------------------------------------------------------------------------------- FLOPs
def expert_flops_per_token(module: nn.Module, top_k: int) -> int:
    """Multiply-add FLOPs (2 per MAC) of the expert / FFN matmuls per token, from the weights.

    moelab ``ExpertBank`` and transformers' ``MixtralExperts``: ``K · 2·(d·h_in + h·d)``;
    :class:`MLP`: ``2·(d·h_in + h·d)`` of its own width.  Router FLOPs are not counted.
    """
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
def fmt(value: float | None, spec: str = ".2f") -> str:
    """``value`` formatted by ``spec``, ``-`` for ``None``."""
    return "-" if value is None else format(value, spec)


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


def write_document(path: Path, doc: dict, markdown: str | None = None) -> None:
    """Write a bench's JSON document atomically (and its ``markdown`` beside it, ``path`` with ``.md``)."""
    atomic_write_text(path, json.dumps(doc, indent=1) + "\n")
    if markdown is not None:
        atomic_write_text(path.with_suffix(".md"), markdown + "\n")


# ---------------------------------------------------------------------------------- steps
class FixedSchedule:
    """A competition schedule with a fixed set of competing layers at every step: the kind of
    training step a benchmark times (none, some or all layers competing)."""

    def __init__(self, num_layers: int, active: set[int]) -> None:
        self.num_layers = num_layers
        self.active_layers = set(active)

    def active(self, layer: int, step: int) -> bool:
        return layer in self.active_layers


def train_step(module: nn.Module, x: Tensor, grad: Tensor) -> Callable[[], None]:
    """Forward and backward of ``grad`` in training mode, the gradients of the last step freed first."""
    params = list(module.parameters())

    def step() -> None:
        module.train()
        x.grad = None
        for p in params:
            p.grad = None
        module(x).backward(grad)

    return step


def infer_step(module: nn.Module, x: Tensor) -> Callable[[], None]:
    """Forward under ``torch.inference_mode`` in evaluation mode."""

    def step() -> None:
        module.eval()
        with torch.inference_mode():
            module(x)

    return step


def free_grads(module: nn.Module, x: Tensor) -> Callable[[], None]:
    """A candidate's ``reset``: the gradients of ``module`` and of its input ``x`` freed."""

    def reset() -> None:
        module.zero_grad(set_to_none=True)
        x.grad = None

    return reset
