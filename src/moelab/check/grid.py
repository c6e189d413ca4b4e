"""Gradient parity of an MoE block: the same batch through one eager process (the reference) and
through each layout, kernel, capacity, ``torch.compile`` and activation checkpointing asked for, on
gloo processes; per quantity — the output, the loss, the gradient into the block's input and every
parameter's gradient (the router's, the experts', every other's), full tensors gathered from the
shards — the largest relative error and pass/fail at the dtype's tolerance (docs/check.md).

The reference runs each process's shard of the batch as its own forward in one process and
averages their losses, which is what data parallelism computes: a capacity or an auxiliary loss
that depends on the micro-batch is the same function in both.  Everything runs with
``torch.use_deterministic_algorithms`` on, so memory that a kernel leaves uninitialised is NaN
(``torch.utils.deterministic.fill_uninitialized_memory``) and shows up instead of passing by luck.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .targets import LAYOUTS, Parallelize, Target, callable_target, generic_parallelize, layouts_of

__all__ = ["TOLERANCES", "ParityTable", "Row", "Variant", "parity"]

#: the largest relative error (max |a − b| / max |reference|) that passes, by the dtype compared in:
#: a few hundred ulps of float32, where summation orders differ between layouts and kernels;
#: float64's leaves the same margin over its rounding
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 1e-5,
    torch.bfloat16: 3e-2,
    torch.float16: 5e-3,
}


@dataclass(frozen=True)
class Variant:
    """One column of the grid: how the block is run."""

    layout: str
    procs: int
    kernel: str | None
    capacity: float | None
    compile: bool
    checkpoint: bool


@dataclass(frozen=True)
class Row:
    """One line of the table: a quantity of a variant, its largest relative error against the
    reference, the tolerance, and ``status`` "pass", "fail" or "n/a" (with the reason in ``note``)."""

    layout: str
    procs: int
    kernel: str | None
    capacity: float | None
    compile: bool
    checkpoint: bool
    quantity: str
    kind: str
    error: float | None
    tolerance: float | None
    dtype: str
    status: str
    note: str = ""


class ParityTable:
    """The rows of a check; ``ok`` when no row failed ("n/a" rows say why they were not run)."""

    def __init__(self, target: str, rows: list[Row]) -> None:
        self.target = target
        self.rows = rows

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if r.status == "fail"]

    @property
    def ok(self) -> bool:
        return not self.failures

    def find(self, **match: Any) -> list[Row]:
        """The rows whose fields equal ``match`` (e.g. ``find(layout="ep", kind="router")``)."""
        return [r for r in self.rows if all(getattr(r, k) == v for k, v in match.items())]

    def to_dict(self) -> dict[str, Any]:
        rows = [
            {**asdict(r), "error": None if r.error is None or math.isnan(r.error) else r.error}
            for r in self.rows
        ]
        return {"module": self.target, "ok": self.ok, "failures": len(self.failures), "rows": rows}

    def save_json(self, path: str | os.PathLike) -> None:
        from ..io.atomic import atomic_write_json

        atomic_write_json(path, self.to_dict())

    def format(self) -> str:
        head = (
            "layout",
            "procs",
            "kernel",
            "capacity",
            "compile",
            "ckpt",
            "quantity",
            "max rel err",
            "tol",
            "dtype",
            "status",
        )
        lines = [
            (
                r.layout,
                str(r.procs),
                r.kernel or "-",
                "off" if r.capacity is None else f"{r.capacity:g}",
                "on" if r.compile else "off",
                "on" if r.checkpoint else "off",
                r.quantity,
                "-" if r.error is None else f"{r.error:.2e}",
                "-" if r.tolerance is None else f"{r.tolerance:.0e}",
                r.dtype,
                r.status.upper() if r.status == "fail" else r.status,
            )
            for r in self.rows
        ]
        widths = [max(len(x) for x in col) for col in zip(head, *lines)] if lines else [len(h) for h in head]
        fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
        out = [f"moelab check: {self.target}", fmt(head)]
        for r, cells in zip(self.rows, lines):
            out.append(fmt(cells) + (f"  ({r.note})" if r.note else ""))
        n = {s: sum(r.status == s for r in self.rows) for s in ("pass", "fail", "n/a")}
        out.append(f"{n['pass']} passed, {n['fail']} failed, {n['n/a']} not applicable")
        return "\n".join(out)


# ---------------------------------------------------------------------------- running one variant
class _Block(nn.Module):
    """The block under check, called as the layouts see it; ``checkpoint``: its forward under
    non-reentrant activation checkpointing (inside the layout's wrappers, as torchtitan applies it)."""

    def __init__(self, inner: nn.Module, checkpoint: bool) -> None:
        super().__init__()
        self.inner = inner
        self.checkpoint = checkpoint

    def forward(self, x: Tensor) -> Tensor:
        if self.checkpoint:
            out = torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)
        else:
            out = self.inner(x)
        out = out[0] if isinstance(out, (tuple, list)) else out  # transformers blocks may add router logits
        return out.clone() if out._base is not None else out  # FSDP2 warns of a view as a unit's output


def _name(key: str) -> str:
    """A parameter's name in the user's module (without the check's and compile's prefixes)."""
    return key.removeprefix("inner.").replace("_orig_mod.", "")


def kind_of(name: str) -> str:
    """ "expert" for a parameter of routed experts (a part named ``experts`` or ``*_experts`` other
    than shared ones), "router" for one of a part named ``router`` or ``gate``, else "other"."""
    parts = name.split(".")
    if any(p == "experts" or (p.endswith("_experts") and not p.startswith("shared")) for p in parts):
        return "expert"
    if any(p in ("router", "gate") for p in parts):
        return "router"
    return "other"


def _full(t: Tensor | None) -> Tensor | None:
    if t is None:
        return None
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _run(
    target: Target,
    v: Variant,
    dtype: torch.dtype,
    shards: list[Tensor],
    probes: list[Tensor],
    *,
    seed: int,
    world: int = 1,
    scale: float = 1.0,
    parallelize: Parallelize | None = None,
    backend: str = "aot_eager",
) -> dict[str, Any]:
    """One forward and backward of ``v``: on this process's ``shards`` (several: the reference's
    micro-batches in one process), the loss the mean over them of ``Σ out · probe / tokens``.
    Returns the outputs, the input gradients (as the reference's: ``/ world``), the loss (mean over
    the processes) and every parameter's full gradient; ``{"na": reason}`` where the layout cannot
    apply."""
    torch.manual_seed(seed)
    module = target.build(v.kernel, v.capacity).to(dtype)
    module.train()
    block = _Block(module, v.checkpoint)
    if scale != 1.0:
        from ..layer import moe_layers, set_aux_scale

        if moe_layers(block):
            set_aux_scale(block, scale)
    forward: nn.Module = block
    if v.layout != "single":
        fn = parallelize or target.parallelize
        try:
            forward = (fn or generic_parallelize)(block, v.layout, world) or block  # None: sharded in place
        except NotImplementedError as exc:
            reason = str(exc) if fn is not None and str(exc) else target.ep_reason
            return {"na": reason}
        except ValueError as exc:  # the layout's refusal (the same on every process, before any collective)
            return {"na": str(exc)}
    if v.compile:
        torch._dynamo.reset()
        block.inner = torch.compile(block.inner, backend=backend)
    xs = [s.to(dtype).clone().requires_grad_(True) for s in shards]
    loss = 0.0
    outs = []
    for x, p in zip(xs, probes):
        out = forward(x)
        outs.append(out.detach().clone())
        loss = loss + (out * p.to(out.dtype)).sum() / out[..., 0].numel() / len(xs)
    loss.backward()
    value = loss.detach().clone().double()
    if world > 1:
        dist.all_reduce(value)
        value /= world
    grads = {_name(k): _full(p.grad) for k, p in block.named_parameters()}
    return {
        "out": outs,
        "xgrad": [None if x.grad is None else x.grad.detach() / world for x in xs],
        "loss": value.item(),
        "grads": grads,
    }


@contextlib.contextmanager
def _uninitialised_memory_is_nan() -> Iterator[None]:
    """Deterministic algorithms on (warnings only): ``torch.empty`` memory is filled with NaN."""
    import torch.utils.deterministic as det

    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        det.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*deterministic.*")
            yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        det.fill_uninitialized_memory = before[2]


def _failure(exc: Exception) -> dict[str, str]:
    return {"error": f"{type(exc).__name__}: {(str(exc) or '-').splitlines()[0]}"}


def _worker(rank: int, world: int, folder: str, job: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{folder}/init",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=job["timeout"]),
    )
    results = {}
    try:
        with _uninitialised_memory_is_nan():
            batch, probe = job["batch"], job["probe"]
            n = batch.shape[0] // world
            part = slice(rank * n, (rank + 1) * n)
            for v, dtype in job["variants"]:
                try:
                    results[v] = _run(
                        job["target"],
                        v,
                        dtype,
                        [batch[part]],
                        [probe[part]],
                        seed=job["seed"],
                        world=world,
                        parallelize=job["parallelize"],
                        backend=job["backend"],
                    )
                except Exception as exc:  # the module fails under this variant: a failing row, not a crash
                    results[v] = _failure(exc)
                    # the other processes may wait in a collective of this variant (until the timeout):
                    # the later variants would meet them out of step
                    for later, _ in job["variants"]:
                        results.setdefault(
                            later, {"error": "not run: an earlier variant failed on this process"}
                        )
                    break
        torch.save(results, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, job: dict[str, Any]) -> list[dict]:
    import torch.multiprocessing as mp

    if "fork" not in mp.get_all_start_methods():
        raise RuntimeError("moelab check starts its processes by fork, which this platform does not have")
    with tempfile.TemporaryDirectory(prefix="moelab-check-") as folder:
        mp.start_processes(_worker, args=(world, folder, job), nprocs=world, join=True, start_method="fork")
        return [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(world)]


# ---------------------------------------------------------------------------- comparing
def _error(got: Tensor | None, ref: Tensor | None, size: float | None = None) -> tuple[float, str]:
    """max |got − ref| / size, ``size`` by default max |ref| (a shard's outputs are measured against
    the whole reference's largest entry); a missing gradient counts as zeros; NaN, with the reason,
    where either is not finite or the shapes differ."""
    if got is None and ref is None:
        return 0.0, ""
    ref = torch.zeros_like(got) if ref is None else ref
    got = torch.zeros_like(ref) if got is None else got
    if got.shape != ref.shape:
        return math.nan, f"shape {tuple(got.shape)}, reference {tuple(ref.shape)}"
    if not torch.isfinite(ref).all():
        return math.nan, "the reference is not finite"
    if not torch.isfinite(got).all():
        return math.nan, "non-finite values"
    diff = (got.double() - ref.double()).abs().max().item() if got.numel() else 0.0
    size = _largest([ref]) if size is None else size
    return (0.0 if diff == 0 else diff / size if size else math.inf), ""


def _largest(tensors: list[Tensor | None]) -> float:
    return max((t.double().abs().max().item() for t in tensors if t is not None and t.numel()), default=0.0)


def _compare(
    v: Variant, dtype: torch.dtype, ranks: list[dict], ref: dict, rounds_in: torch.dtype | None = None
) -> list[Row]:
    """The rows of variant ``v``: each quantity of every process (``ranks``) against the reference."""
    # a module that rounds inside to a narrower dtype (torchtitan's bfloat16 experts) is held to its tolerance
    tol = TOLERANCES.get(rounds_in or dtype, 1e-5)
    name = str(dtype).removeprefix("torch.")
    if rounds_in is not None and rounds_in != dtype:
        name += "/" + str(rounds_in).removeprefix("torch.")
    base = dict(
        layout=v.layout,
        procs=v.procs,
        kernel=v.kernel,
        capacity=v.capacity,
        compile=v.compile,
        checkpoint=v.checkpoint,
    )
    whole = dict(base, quantity="-", kind="-", error=None, tolerance=None, dtype=name)
    if "na" in ranks[0]:
        return [Row(**whole, status="n/a", note=ranks[0]["na"])]
    failed = [f"rank {r}: {res['error']}" for r, res in enumerate(ranks) if "error" in res]
    if failed:
        return [Row(**whole, status="fail", note="; ".join(failed) if len(ranks) > 1 else ranks[0]["error"])]
    # (label, kind, [(got, reference)] per process, the size errors are relative to)
    quantities: list[tuple[str, str, list[tuple[Tensor | None, Tensor | None]], float | None]] = []
    for key, label, kind in (("out", "output", "output"), ("xgrad", "grad input", "input")):
        # process r's shard against the reference's micro-batch r, relative to the whole tensor
        pairs = [(res[key][0], ref[key][r]) for r, res in enumerate(ranks)]
        quantities.append((label, kind, pairs, _largest(ref[key])))
    losses = [(torch.tensor(res["loss"]), torch.tensor(ref["loss"])) for res in ranks]
    quantities.append(("loss", "loss", losses, None))
    names = list(ref["grads"])
    for res in ranks:
        names += [k for k in res["grads"] if k not in names]
    for k in names:
        pairs = [(res["grads"].get(k), ref["grads"].get(k)) for res in ranks]
        quantities.append((f"grad {k}", kind_of(k), pairs, None))
    rows = []
    for label, kind, pairs, size in quantities:
        worst, note, at = 0.0, "", 0
        for i, (got, want) in enumerate(pairs):
            e, n = _error(got, want, size)
            if math.isnan(e) or e > worst:
                worst, note, at = e, n, i
                if math.isnan(e):
                    break
        ok = not math.isnan(worst) and worst <= tol
        where = f"rank {at}" if len(pairs) > 1 and not ok else ""
        rows.append(
            Row(
                **base,
                quantity=label,
                kind=kind,
                error=worst,
                tolerance=tol,
                dtype=name,
                status="pass" if ok else "fail",
                note="; ".join(x for x in (note, where) if x),
            )
        )
    return rows


# ---------------------------------------------------------------------------- the check
def _pick(name: str, asked: Sequence[Any] | None, allowed: tuple[Any, ...], what: str) -> tuple[Any, ...]:
    if asked is None:
        return allowed
    asked = tuple(asked)
    bad = [a for a in asked if a not in allowed]
    if bad or not asked:
        raise ValueError(
            f"{name}={list(asked)!r} is not allowed for {what}; expected some of {list(allowed)}"
        )
    return asked


def _dtype_of(
    target: Target, kernel: str | None, capacity: float | None, x: Tensor, seed: int
) -> torch.dtype | str:
    """float64 where the module computes in it (a forward and backward on ``x``), else the dtype it
    is built in; a string: why it does not run (in neither, or not built with ``kernel`` and ``capacity``)."""
    torch.manual_seed(seed)
    try:
        module = target.build(kernel, capacity)
    except ValueError as exc:  # the module refuses this kernel with this capacity (padded without one)
        return f"the module refuses this kernel and capacity: {exc}"
    native = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    reasons = []
    for dtype in dict.fromkeys((torch.float64, native)):
        try:
            m = module.to(dtype)
            out = _Block(m, False)(x.to(dtype).requires_grad_(True))
            out.sum().backward()
            return dtype
        except Exception as exc:  # the module refuses the dtype (or the kernel cannot run here)
            reasons.append(
                f"{str(dtype).removeprefix('torch.')}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            )
    return f"the module does not run here ({'; '.join(reasons)})"


def parity(
    module_factory: Target | Callable[..., nn.Module],
    batch: Tensor,
    layouts: Sequence[str] | str = LAYOUTS,
    procs: Sequence[int] = (2,),
    *,
    kernels: Sequence[str | None] | None = None,
    capacities: Sequence[float | None] | None = None,
    compile: bool = False,
    checkpoint: bool = False,
    parallelize: Parallelize | None = None,
    seed: int = 0,
    compile_backend: str = "aot_eager",
    timeout: float = 300.0,
) -> ParityTable:
    """Check that ``module_factory``'s block computes under every asked layout what one eager
    process computes on the same batch (module docstring; docs/check.md).

    Args:
        module_factory: a :class:`moelab.check.Target` (:func:`moelab.check.resolve`), or a
            callable returning a fresh module (the same weights under the same seed; it may declare
            ``kernels``, ``parallelize`` and ``d_model``, see :func:`moelab.check.callable_target`).
        batch: the input, ``(B, ..., d_model)``; split over the processes along the first dimension.
        layouts: some of ``"single"`` (one process: kernels, compile, checkpointing), ``"ddp"``,
            ``"fsdp2"``, ``"ep"``, ``"ep-fsdp2"``.
        procs: the numbers of gloo processes for the parallel layouts (each must divide ``B``).
        kernels: the expert kernels to run (default: every one the module exposes).
        capacities: capacity factors (``None``: off) for modules that take one (a moelab layer).
        compile: also run every variant under ``torch.compile`` (backend ``compile_backend``).
        checkpoint: also run every variant under activation checkpointing.
        parallelize: ``fn(model, layout, world) -> module`` applying a layout (the block is
            ``model.inner``); ``NotImplementedError(reason)`` marks the layout not applicable.
        seed: the seed the module is built under (every process builds the same weights).
        timeout: seconds a collective may wait (a rank that fails leaves the others waiting).

    Returns:
        the :class:`ParityTable`.

    Raises:
        ValueError: an argument that is not allowed (one line naming it).
    """
    if not isinstance(batch, Tensor) or not batch.is_floating_point() or batch.dim() < 2:
        got = f"a {batch.dim()}-D {batch.dtype} tensor" if isinstance(batch, Tensor) else type(batch).__name__
        raise ValueError(f"batch={got} is not allowed; expected a floating-point tensor (B, ..., d_model)")
    target = (
        module_factory
        if isinstance(module_factory, Target)
        else callable_target(module_factory, batch.shape[-1])
    )
    if batch.shape[-1] != target.d_model:
        raise ValueError(
            f"batch of width {batch.shape[-1]} is not allowed for {target.name}; expected d_model={target.d_model}"
        )
    layouts = layouts_of(layouts)
    procs = tuple(procs)
    if any(isinstance(w, bool) or not isinstance(w, int) or w < 2 or batch.shape[0] % w for w in procs):
        raise ValueError(
            f"procs={list(procs)!r} is not allowed with a batch of {batch.shape[0]} rows; expected process counts >= 2 "
            "that divide the batch's first dimension"
        )
    kernels = _pick("kernels", kernels, target.kernels, target.name)
    capacities = _pick("capacities", capacities, target.capacities, target.name)
    flags = [
        (c, k)
        for c in ((False, True) if compile else (False,))
        for k in ((False, True) if checkpoint else (False,))
    ]
    g = torch.Generator().manual_seed(seed + 1)
    probe = torch.randn((*batch.shape[:-1], target.d_model), generator=g, dtype=torch.float64)
    batch = batch.detach()
    rows: list[Row] = []
    with _uninitialised_memory_is_nan():
        dtypes = {
            (k, c): _dtype_of(target, k, c, batch[:1], seed)
            for k in (target.kernels[0], *kernels)
            for c in capacities
        }
        refs: dict[tuple, dict] = {}

        def reference(dtype: torch.dtype, capacity: float | None, world: int) -> dict:
            key = (dtype, capacity, world)
            if key not in refs:
                v = Variant("single", 1, target.kernels[0], capacity, False, False)
                n = batch.shape[0] // world
                parts = [slice(r * n, (r + 1) * n) for r in range(world)]
                refs[key] = _run(
                    target,
                    v,
                    dtype,
                    [batch[s] for s in parts],
                    [probe[s] for s in parts],
                    seed=seed,
                    scale=1 / world,
                )
            return refs[key]

        grid = [(k, c, comp, ckpt) for k in kernels for c in capacities for comp, ckpt in flags]
        for layout in layouts:
            for world in (1,) if layout == "single" else procs:
                variants = [Variant(layout, world, *cell) for cell in grid]
                ready = []
                for v in variants:
                    dtype = dtypes[(v.kernel, v.capacity)]
                    if isinstance(dtype, str):
                        rows += _compare(v, torch.float64, [{"na": dtype}], {})
                    else:
                        ready.append((v, dtype))
                if layout == "single":
                    for v, dtype in ready:
                        try:
                            res = _run(target, v, dtype, [batch], [probe], seed=seed, backend=compile_backend)
                        except Exception as exc:  # the module fails under this variant: a failing row
                            res = _failure(exc)
                        rows += _compare(v, dtype, [res], reference(dtype, v.capacity, 1), target.rounds_in)
                    continue
                if not ready:
                    continue
                job = {
                    "target": target,
                    "variants": ready,
                    "batch": batch,
                    "probe": probe,
                    "seed": seed,
                    "parallelize": parallelize,
                    "backend": compile_backend,
                    "timeout": timeout,
                }
                results = _spawn(world, job)
                for v, dtype in ready:
                    rows += _compare(
                        v,
                        dtype,
                        [r[v] for r in results],
                        reference(dtype, v.capacity, world),
                        target.rounds_in,
                    )
    return ParityTable(target.name, rows)
