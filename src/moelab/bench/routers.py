"""``moelab benchmark``: every router under one protocol, with the statistics to choose between them.

Each method is trained with each seed on one corpus and budget (the runs of ``moelab compare``,
the same auxiliary losses for every method), diagnosed (``moelab diagnose``), then measured for
cost in this process: the MoE layer's training step against a dense FFN of the same active width,
its peak memory, whether a short run repeats bit for bit, and how far two data-parallel ranks
(gloo) drift from one.  One row per method: held-out BPC with its 95 % interval, the paired
difference to the reference with a t-test and an equivalence test (TOST) at a stated margin, both
Holm-adjusted over the methods, the rank with its bootstrap interval, balance (MaxVio, Jain's
index), stability (change rate, router saturation) and the cost columns.  Every phase keeps its
results in files, so ``--resume`` after any interruption continues where it stopped and changes
no number already written.  docs/benchmark.md gives the protocol, the columns and the results.
"""

from __future__ import annotations

import argparse
import copy
import csv
import io
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .. import _validate
from .. import config as vocab
from ..config import MAX_COUNT, Interval, Options, setting
from ..experiments import compare, runner
from ..experiments.lm import TrainRun, set_threads
from ..experiments.report import collect_runs, write_report
from ..experiments.summary import bootstrap_ranks, holm, mean, paired, plan_paired, t_interval
from ..io.atomic import atomic_write_checked, atomic_write_png, atomic_write_text, read_json
from ..io.model import weights_digest
from ..io.rundir import RunDir
from ..methods import methods

__all__ = ["PROTOCOLS", "BenchmarkConfig", "add_arguments", "benchmark_config", "run"]

#: the seed papers' routers and the strongest rivals of the quick protocol's table: the methods of
#: the decisive protocol
DECISIVE_METHODS = (
    "smoe,xmoe,smoe-fixed,stablemoe,pcosine,sigma-moe,competesmoe,competesmoe-v1,sharede-v2,sharede-v3,"
    "smoe-sg,top-p,smoe-dropout,densemixer,remoe,expert-choice"
)

#: each protocol's settings (flags given on the command line win).  ``quick``: the ``mini`` model of
#: docs/results.md's decisive experiment at a budget where every method and five seeds fit a CPU hour,
#: a screen (docs/benchmark.md).  ``decisive``: a smaller model trained three times as many steps with
#: the step size annealed, more seeds, the routers of the seed papers and their strongest rivals,
#: planned from a pilot (docs/benchmark-decisive.md, with what its run decided)
PROTOCOLS: dict[str, dict[str, Any]] = {
    "quick": {
        "run.size": "mini",
        "run.data": "stdlib",
        "run.steps": 500,
        "run.eval_every": 100,
        "run.ckpt_every": 100,
        "run.keep_ckpts": "all",
        "run.test_tokens": 262_144,
    },
    "decisive": {
        "methods": DECISIVE_METHODS,
        "seeds": 11,
        "margin": 0.03,
        "run.size": "cpu",
        "run.data": "stdlib",
        "run.steps": 1500,
        "run.schedule": "cosine",
        "run.lr": 3e-3,
        "run.warmup": 400,
        "run.eval_every": 250,
        "run.ckpt_every": 250,
        "run.keep_ckpts": "all",
        "run.test_tokens": 262_144,
    },
}

#: the files the benchmark writes into ``--out`` (beside every run's folder and compare's report)
OUTPUTS = ("benchmark.csv", "benchmark.md", "benchmark_bpc.png", "benchmark_cost.png")
#: the file of a method's cost measurements, in ``OUT/<method>/``
COST_FILE = "cost.json"


@dataclass
class BenchmarkConfig:
    """The settings of ``moelab benchmark``: which methods and seeds, the equivalence margin, the
    cost measurements and the run settings of every training (``run``); :data:`PROTOCOLS` fills what
    the command line does not give."""

    protocol: str = setting(
        "quick",
        help="the protocol whose settings fill those not given: quick (the mini model, 500 steps, 5 seeds, "
        "every method) or decisive (docs/benchmark-decisive.md)",
        allowed=Options(tuple(PROTOCOLS)),
    )

    methods: str = setting("all", help="comma-separated methods, or all (every moelab method)")
    seeds: int = setting(
        5, help="seeds per method, from --seed-offset on", allowed=Interval(int, 2, MAX_COUNT)
    )
    seed_offset: int = setting(0, help="first seed", allowed=Interval(int, 0, 2**63 - 1))
    jobs: int | None = setting(
        None,
        help="trainings and diagnoses at once, in worker processes of one thread each (default: the cores)",
        allowed=(Interval(int, 1), None),
    )
    reference: str = setting("smoe", help="the method every other is compared with")
    margin: float = setting(
        0.02,
        help="equivalence margin of the TOST, in the test metric's unit (BPC)",
        allowed=Interval(float, 0, None, closed="right"),
    )
    repeat_steps: int = setting(
        30,
        help="steps of the short runs that check bit-for-bit repetition and the 1-vs-2-rank gap",
        allowed=Interval(int, 2, MAX_COUNT),
    )
    timing_rounds: int = setting(
        20, help="timed rounds of the layer's training step", allowed=Interval(int, 3, MAX_COUNT)
    )
    two_ranks: bool = setting(True, flag="--no-ranks", help="skip the 2-rank (gloo, torchrun) gap")
    diagnose_tokens: int = setting(
        16384, help="test tokens each run is diagnosed on", allowed=Interval(int, 1)
    )
    plan: bool = setting(
        False,
        help="train nothing: from the runs already in --out (a pilot), print each comparison's minimum "
        "detectable difference and the seeds its verdict needs at --margin",
    )
    power: float = setting(
        0.8,
        help="the power --plan and the table's MDD column plan for",
        allowed=Interval(float, 0, 1, closed="neither"),
    )
    run: TrainRun = field(default_factory=TrainRun)


#: the run settings the benchmark decides itself
_SET_BY_BENCHMARK = ("run.method", "run.seed", "run.expert_parallel", "run.fsdp")


def add_arguments(p: argparse.ArgumentParser) -> None:
    vocab.add_arguments(p, BenchmarkConfig, exclude=_SET_BY_BENCHMARK, out_default="runs/benchmark")
    p.epilog = "; ".join(
        f"--protocol {name}: "
        + ", ".join(f"--{k.removeprefix('run.').replace('_', '-')} {v}" for k, v in values.items())
        for name, values in PROTOCOLS.items()
    )


def benchmark_config(args: argparse.Namespace) -> BenchmarkConfig:
    """The benchmark's settings: the flags given, then ``--config``'s, then the protocol's."""
    given = runner.given_by_args(BenchmarkConfig, args)
    protocol = given.get("protocol", BenchmarkConfig.protocol)
    _validate.one_of("--protocol", protocol, list(PROTOCOLS))
    for key, value in PROTOCOLS[protocol].items():
        given.setdefault(key, value)
    return vocab.validate(vocab.build(BenchmarkConfig, given))


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError

    config = benchmark_config(args)
    names = methods() if config.methods.strip() == "all" else [m.strip() for m in config.methods.split(",")]
    names = [m for m in names if m]
    unknown = [m for m in names if m not in methods()]
    if unknown:
        raise ValueError(f"--methods: {unknown} are not moelab methods; allowed: all or {methods()}")
    if len(set(names)) != len(names):
        raise UsageError(f"--methods {config.methods!r} names a method twice")
    if config.reference not in names:
        raise UsageError(f"--reference {config.reference!r} is not among --methods {names}")
    if len(names) < 2:
        raise UsageError(f"--methods {config.methods!r}: a benchmark compares at least two methods")
    out = Path(args.out)
    if config.plan:
        print(plan_table(out, names, config))
        return 0
    runner.check_run_flags(resume=args.resume, force=args.force, allow_changes=args.allow_changes)
    if (out / "config.yaml").exists() and not args.force:
        raise FileExistsError(
            f"--out {out} holds a moelab run of another command (config.yaml), not a benchmark; choose "
            "another --out or pass --force to start afresh"
        )
    if any((out / name).exists() for name in ("results.csv", OUTPUTS[0])) and not (args.resume or args.force):
        raise FileExistsError(
            f"--out {out} already holds a benchmark or a comparison; pass --resume to reuse it or --force"
        )
    runner.check_memory(
        config, lambda c: 4096 * len(names) * c.seeds, {"seeds": 2}, f"{len(names)} methods × --seeds runs"
    )
    cmp = compare.CompareConfig(
        methods=",".join(names),
        seeds=config.seeds,
        seed_offset=config.seed_offset,
        jobs=config.jobs,
        reference=config.reference,
        losses="same",
        run=config.run,
    )
    plan = compare.plan_runs(cmp, None, names, {})
    runner.check_out_is_no_input(
        BenchmarkConfig, config, out, {"--config": args.config} if args.config else None
    )
    top = RunDir(out, resume=args.resume, force=args.force)
    try:
        return _benchmark(args, config, names, cmp, plan, out)
    finally:
        top.close()


def _benchmark(args, config: BenchmarkConfig, names: list[str], cmp, plan, out: Path) -> int:
    start = time.perf_counter()
    seeds, _, configs = plan
    # phase 1: the trainings (compare's runs and report; a finished run is reused only if it was made
    # with these settings on this data)
    compare.compare_runs(args, cmp, None, names, [], out, plan)
    runs = {(name, seed): out / name / f"seed{seed}" for name, seed, _ in configs}
    # phase 2: the diagnostics of every run (skipped where diagnostics.json holds this benchmark's keys)
    todo = [d for d in runs.values() if not _diagnosed(d, config.diagnose_tokens)]
    print(f"\ndiagnosing {len(todo)} of {len(runs)} runs on {config.diagnose_tokens} test tokens each")
    _diagnose_all(todo, config.diagnose_tokens, min(compare.jobs_of(cmp), max(1, len(todo))))
    # compare's report again, now with the diagnostics' tables and curves (whatever phase a resumed
    # benchmark started in, the folder ends the same)
    write_report(collect_runs(list(runs.values())), out, config.reference, header=plan[1])
    # phase 3: the cost of each method, measured in this process, one thread
    set_threads(replace(config.run, threads=1))
    first = {name: one for name, seed, one in configs if seed == seeds[0]}
    for name in names:
        target = out / name / COST_FILE
        settings = _cost_settings(config, first[name])
        digest = weights_digest(runs[(name, seeds[0])])  # the trained layer the cost is measured on
        if target.is_file():
            stored = read_json(target)  # an edited file is refused in one line
            old = stored.get("settings") or {}
            changed = next((k for k in settings if old.get(k) != settings[k]), None)
            if changed is None and stored.get("weights_sha256") == digest:
                continue
            if changed is not None and not args.allow_changes:
                raise runner.refuse_change(_COST_FLAGS[changed], settings[changed], old.get(changed), target)
        t0 = time.perf_counter()
        cost = measure_cost(runs[(name, seeds[0])], first[name], config)
        text = json.dumps({"settings": settings, "weights_sha256": digest, **cost}, indent=2) + "\n"
        atomic_write_checked(target, text.encode("utf-8"))
        print(f"{name}: cost measured ({time.perf_counter() - t0:.0f}s): " + _cost_line(cost))
    # phase 4: the table, from the files alone
    rows = benchmark_rows(out, names, seeds, config.reference, config.margin, config.power)
    table = render_table(rows, config, seeds, plan[1])
    atomic_write_text(out / OUTPUTS[0], _csv_text(rows))
    atomic_write_text(out / OUTPUTS[1], table + "\n")
    plot_quality(rows, config, out / OUTPUTS[2])
    plot_cost(rows, config, out / OUTPUTS[3])
    print("\n" + table)
    print(f"\nwrote {', '.join(str(out / n) for n in OUTPUTS)} ({time.perf_counter() - start:.0f}s)")
    return 0


# ---------------------------------------------------------------------------------- diagnostics
#: the diagnostics.json keys the table reads
_DIAGNOSTIC_KEYS = (
    "max_vio_mean",
    "jain_mean",
    "expert_change_rate",
    "saturation_mean",
    "active_experts_mean",
)


def _diagnosed(run_dir: Path, tokens: int) -> bool:
    path = run_dir / "diagnostics.json"
    if not path.is_file():
        return False
    d = read_json(path)  # an edited file is refused in one line
    return (
        d.get("tokens") == tokens
        and all(k in d for k in _DIAGNOSTIC_KEYS)
        and d.get("weights_sha256") == weights_digest(run_dir)  # of the run's weights now
    )


def _diagnose_all(run_dirs: list[Path], tokens: int, jobs: int) -> None:
    from ..experiments.diagnose import diagnose_run

    if jobs <= 1:
        for d in run_dirs:
            diagnose_run(d, tokens)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        jobs, mp_context=context, initializer=compare.die_with_parent, initargs=(os.getpid(),)
    ) as pool:
        for future in [pool.submit(_diagnose_in_worker, d, tokens) for d in run_dirs]:
            future.result()


def _diagnose_in_worker(run_dir: Path, tokens: int) -> None:
    import torch

    from ..experiments.diagnose import diagnose_run

    torch.set_num_threads(1)
    diagnose_run(run_dir, tokens)


# ---------------------------------------------------------------------------------- cost
#: the flag of each cost setting (``run``: the training settings, checked with the runs first)
_COST_FLAGS = {
    "repeat_steps": "--repeat-steps",
    "timing_rounds": "--timing-rounds",
    "two_ranks": "--no-ranks (two_ranks)",
    "run": "the run settings",
}


def _cost_settings(config: BenchmarkConfig, one: TrainRun) -> dict[str, Any]:
    return {
        "repeat_steps": config.repeat_steps,
        "timing_rounds": config.timing_rounds,
        "two_ranks": config.two_ranks,
        "run": vocab.plain(replace(one, progress=False)),
    }


def _cost_line(cost: dict[str, Any]) -> str:
    gap = cost.get("rank_gap")
    return (
        f"layer {cost['layer_ratio']:.2f}× dense, peak {cost['peak_mib']:.1f} MiB, "
        f"repeats bit for bit: {'yes' if cost['bit_repeat'] else 'NO'}"
        + ("" if gap is None else f", 1 vs 2 ranks max |Δloss| {gap:.2e}")
    )


def _scheduled_fraction(schedule: Any, num_layers: int, steps: int) -> float:
    """The fraction of (layer, step) pairs of the run on which ``schedule`` competes."""
    hits = sum(bool(schedule.active(layer, s)) for layer in range(num_layers) for s in range(steps))
    return hits / (num_layers * steps)


def layer_cost(run_dir: Path, one: TrainRun, rounds: int) -> dict[str, Any]:
    """The first MoE layer of the trained run (its weights and routing), training step (forward +
    backward) on ``batch × block`` tokens against a dense FFN of width ``K · d_hidden``: median
    ratio of CPU times over interleaved rounds, and both peak memories.  A method with a
    competition schedule is timed on a plain and on a competing step and weighted by the fraction
    of the run's (layer, step) pairs that compete."""
    import torch

    from ..experts import MLP
    from ..io.model import load
    from ..layer import moe_layers
    from ..routing import RoutingContext
    from .harness import (
        Candidate,
        FixedSchedule,
        free_grads,
        interleaved,
        measure_peak_memory,
        ratio_stats,
        train_step,
    )

    model = load(run_dir)
    layers = moe_layers(model)
    layer = copy.deepcopy(layers[0])
    ctx = layers[0].ctx
    total = ctx.total_steps or one.steps
    cfg = layer.config
    d, k, h = cfg.d_model, cfg.top_k, cfg.d_hidden
    tokens = model.cfg.block_size * one.batch_size
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, d, generator=gen)
    grad = torch.randn(tokens, d, generator=gen)
    dense = MLP(d, k * h, activation=cfg.activation)
    kinds = {"plain": False}
    schedule = ctx.schedule
    fraction = 0.0
    if schedule is not None:
        fraction = _scheduled_fraction(schedule, len(layers), total)
        kinds["competing"] = True
    candidates = []
    modules = {"dense": dense}
    for kind, on in kinds.items():
        twin = layer if kind == "plain" else copy.deepcopy(layer)
        twin.ctx = RoutingContext(
            step=max(total - 1, 0),
            total_steps=total,
            schedule=None
            if schedule is None
            else FixedSchedule(len(layers), set(range(len(layers))) if on else set()),
        )
        modules[kind] = _with_documents(twin, model.cfg.block_size) if twin.router.takes_doc_ids else twin
    for name, module in modules.items():
        module.train()
        xin = x.detach().clone().requires_grad_(True)
        candidates.append(
            Candidate(name, "train", train_step(module, xin, grad), reset=free_grads(module, xin))
        )
    interleaved(candidates, rounds, warmup=3, clock="cpu", progress=False)
    measure_peak_memory(candidates, "cpu")
    by = {c.name: c for c in candidates}
    ratios = {name: ratio_stats(by[name].times, by["dense"].times)[0] for name in kinds}
    ratio = (
        ratios["plain"]
        if schedule is None
        else (1 - fraction) * ratios["plain"] + fraction * ratios["competing"]
    )
    peak = by["plain"].peak_mib if schedule is None else max(by["plain"].peak_mib, by["competing"].peak_mib)
    return {
        "tokens": tokens,
        "dense_width": k * h,
        "dense_ms": 1e3 * sorted(by["dense"].times)[len(by["dense"].times) // 2],
        "layer_ratio": ratio,
        "layer_ratio_plain": ratios["plain"],
        "layer_ratio_competing": ratios.get("competing"),
        "competing_fraction": fraction if schedule is not None else None,
        "peak_mib": peak,
        "dense_peak_mib": by["dense"].peak_mib,
        "timing_rounds": rounds,
        "clock": "process CPU time, 1 thread",
    }


def _with_documents(layer: Any, block: int) -> Any:
    """``layer`` taking ``(T, d)`` tokens, each ``block`` of them one document (as the LM passes its
    sequences), for a router that routes by document (EMO)."""
    import torch

    class WithDocuments(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            docs = torch.arange(x.shape[0], device=x.device) // block
            return self.layer(x, doc_ids=docs)

    return WithDocuments()


def _losses(run_dir: Path) -> list[str]:
    with open(run_dir / "log.csv", newline="") as f:
        return [row["loss"] for row in csv.DictReader(f)]


def _same_weights(a: Path, b: Path) -> bool:
    import torch

    from ..io.model import list_checkpoints, load

    ma, mb = load(list_checkpoints(a / "ckpt")[-1]), load(list_checkpoints(b / "ckpt")[-1])
    sa, sb = ma.state_dict(), mb.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[key], sb[key]) for key in sa)


def repeat_checks(one: TrainRun, steps: int, two_ranks: bool) -> dict[str, Any]:
    """Train the method's seed twice for ``steps`` steps in this process (the protocol's settings,
    one thread) and once on two gloo ranks under ``torchrun`` (data parallel: each rank half of
    every batch): whether the two single-process runs agree bit for bit (every logged loss and the
    final weights), and the largest difference of a logged loss between one and two ranks.  The
    short runs live in a temporary folder, removed afterwards: they are measurements, and a
    ``moelab report`` of the benchmark's folder must not find them."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="moelab-benchmark-") as tmp:
        return _repeat_checks(one, Path(tmp), steps, two_ranks)


def _repeat_checks(one: TrainRun, folder: Path, steps: int, two_ranks: bool) -> dict[str, Any]:
    from ..experiments.lm import train_lm

    short = replace(
        one,
        steps=steps,
        eval_every=steps,
        ckpt_every=steps,
        keep_ckpts=1,
        eval_tokens=4096,
        test_tokens=4096,
        progress=False,
        threads=1,
    )
    a, b = folder / "repeat-a", folder / "repeat-b"
    train_lm(short, a, force=True)
    train_lm(short, b, force=True)
    la, lb = _losses(a), _losses(b)
    out: dict[str, Any] = {"repeat_steps": steps, "bit_repeat": la == lb and _same_weights(a, b)}
    out["rank_gap"] = None
    if two_ranks:
        ranks = folder / "ranks-2"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "moelab.cli", "train", "--config", str(a / "config.yaml"), "--out", str(ranks),
            "--force", "--no-progress",
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:  # a method that cannot train on two ranks: said in its row
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            out["rank_note"] = f"the 2-rank run failed (exit {done.returncode}): {tail[0]}"[:300]
        else:
            l2 = _losses(ranks)
            out["rank_gap"] = max(abs(float(x) - float(y)) for x, y in zip(la, l2))
    return out


def measure_cost(run_dir: Path, one: TrainRun, config: BenchmarkConfig) -> dict[str, Any]:
    """Every cost column of one method: :func:`layer_cost` on its first seed's trained run and
    :func:`repeat_checks`."""
    return {
        **layer_cost(run_dir, one, config.timing_rounds),
        **repeat_checks(one, config.repeat_steps, config.two_ranks),
    }


# ---------------------------------------------------------------------------------- the table
def _saturation_mid(d: dict[str, Any]) -> tuple[float | None, int | None]:
    """Router saturation (against the final checkpoint) of the kept checkpoint nearest half the run."""
    steps, values = d.get("curve_steps"), d.get("saturation_mean")
    if not steps or not values or len(steps) < 2:
        return None, None
    half = steps[-1] / 2
    i = min(range(len(steps) - 1), key=lambda j: (abs(steps[j] - half), steps[j]))
    return values[i], steps[i]


def benchmark_rows(
    out: Path, names: list[str], seeds: list[int], reference: str, margin: float, power: float = 0.8
) -> list[dict]:
    """One row per method from the files in ``out``: the runs' ``metrics.json`` and
    ``diagnostics.json`` and the method's ``cost.json``."""
    tests: dict[str, list[float]] = {}
    rows = []
    for name in names:
        metric = None
        values, diags = [], []
        for seed in seeds:
            m = read_json(out / name / f"seed{seed}" / "metrics.json")
            metric = metric or next(k for k in m if k.startswith("test_") and k != "test_loss")
            values.append(float(m[metric]))
            diags.append(read_json(out / name / f"seed{seed}" / "diagnostics.json"))
        tests[name] = values
        low, high = t_interval(values)
        saturation = [_saturation_mid(d) for d in diags]
        cost = read_json(out / name / COST_FILE)
        row = {
            "method": name,
            "metric": metric,
            "seeds": len(values),
            "mean": mean(values),
            "ci_low": low,
            "ci_high": high,
            "per_seed": values,
            "max_vio": mean([d["max_vio_mean"] for d in diags]),
            "jain": mean([d["jain_mean"] for d in diags]),
            "change_rate": _mean_or_none([d["expert_change_rate"] for d in diags]),
            "saturation_mid": _mean_or_none([s for s, _ in saturation]),
            "saturation_step": saturation[0][1],
            # shared experts run for every token: a routed expert's width each (moelab.MoE num_shared)
            "shared_experts": _shared_experts(out / name / f"seed{seeds[0]}"),
            "active_experts": mean([d["active_experts_mean"] for d in diags]),
            **{
                k: cost.get(k)
                for k in ("layer_ratio", "peak_mib", "dense_peak_mib", "bit_repeat", "rank_gap")
            },
            "competing_fraction": cost.get("competing_fraction"),
            "rank_note": cost.get("rank_note"),
        }
        rows.append(row)
    compared = [r for r in rows if r["method"] != reference]
    tests_of = [paired(tests[r["method"]], tests[reference], margin) for r in compared]
    p_diff = holm([t.p for t in tests_of])
    p_eq = holm([t.p_equivalent for t in tests_of])
    for r, t, pd, pe in zip(compared, tests_of, p_diff, p_eq):
        d = [a - b for a, b in zip(tests[r["method"]], tests[reference])]
        r["mdd"] = plan_paired(d, margin, alpha=0.05 / len(compared), power=power).mdd
        r.update(delta=t.diff, delta_low=t.low, delta_high=t.high, p=t.p, p_holm=pd)
        r.update(p_equivalent=t.p_equivalent, p_equivalent_holm=pe, verdict=_verdict(t.diff, pd, pe))
    for r in rows:
        if r["method"] == reference:
            r.update(mdd=None, delta=None, delta_low=None, delta_high=None, p=None, p_holm=None)
            r.update(p_equivalent=None, p_equivalent_holm=None, verdict="reference")
    ranks = bootstrap_ranks(tests)
    for r in rows:
        r["rank"], r["rank_low"], r["rank_high"] = ranks[r["method"]]
    return sorted(rows, key=lambda r: (r["mean"], r["method"]))


def plan_table(out: Path, names: list[str], config: BenchmarkConfig) -> str:
    """``moelab benchmark --plan``: per comparison with ``config.reference``, from the finished runs
    in ``out`` (the seeds both methods have, paired by seed), the difference, its spread, the
    minimum detectable difference at these seeds and the seeds the verdict the pilot points to would
    need (:func:`moelab.experiments.summary.plan_paired`, at 0.05 over the comparisons and
    ``config.power``)."""
    found: dict[str, dict[int, float]] = {}
    for name in names:
        found[name] = {}
        for metrics in sorted((out / name).glob("seed*/metrics.json")):
            seed = metrics.parent.name.removeprefix("seed")
            if seed.isdigit():
                m = read_json(metrics)
                key = next((k for k in m if k.startswith("test_") and k != "test_loss"), None)
                if key is not None:
                    found[name][int(seed)] = float(m[key])
    ref = found[config.reference]
    compared = [n for n in names if n != config.reference]
    if len(ref) < 2 or not any(len(set(found[n]) & set(ref)) >= 2 for n in compared):
        raise ValueError(
            f"--plan needs a pilot: finished runs of {config.reference!r} and another method with at least 2 "
            f"common seeds under {out}/<method>/seed<k>/ (found {sum(map(len, found.values()))} runs); run "
            "moelab benchmark with a few seeds first"
        )
    alpha = 0.05 / len(compared)
    lines = [
        f"| method | seeds | Δ vs {config.reference} | sd of Δ | MDD at these seeds | pilot points to | "
        f"seeds needed (±{config.margin:g}) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in compared:
        common = sorted(set(found[name]) & set(ref))
        if len(common) < 2:
            lines.append(f"| {name} | {len(common)} | — | — | — | — | — (fewer than 2 paired seeds) |")
            continue
        plan = plan_paired(
            [found[name][s] - ref[s] for s in common], config.margin, alpha=alpha, power=config.power
        )
        needed = "—" if plan.seeds_needed is None else f"{plan.seeds_needed:,}"
        lines.append(
            f"| {name} | {plan.n} | {plan.diff:+.4f} | {_f(plan.sd, '.4f')} | {_f(plan.mdd, '.4f')} | "
            f"{plan.target} | {needed} |"
        )
    return "\n".join(lines) + (
        f"\n\nMDD: the smallest true difference the paired t-test detects with {config.power:.0%} power; seeds "
        f"needed: for the verdict the pilot's difference points to (better / worse when |Δ| ≥ {config.margin:g}; "
        f"inside the margin equivalence or the difference, whichever needs fewer seeds), if the true difference "
        f"were the pilot's; each test at "
        f"0.05 / {len(compared)} (Bonferroni over the comparisons); — where the pilot has no spread or the "
        "answer exceeds 100,000 seeds."
    )


def _shared_experts(run_dir: Path) -> int:
    from ..io.model import load
    from ..layer import moe_layers

    return moe_layers(load(run_dir))[0].num_shared


def _mean_or_none(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return mean(kept) if kept else None


def _verdict(diff: float, p_diff: float | None, p_eq: float | None, alpha: float = 0.05) -> str:
    """``equivalent`` (TOST), ``better`` / ``worse`` (paired t-test), both (a difference inside the
    margin), or ``inconclusive``; Holm-adjusted p-values at ``alpha``."""
    equivalent = p_eq is not None and p_eq < alpha
    different = p_diff is not None and p_diff < alpha
    if equivalent and different:
        return "equivalent (" + ("lower" if diff < 0 else "higher") + " within the margin)"
    if equivalent:
        return "equivalent"
    if different:
        return "better" if diff < 0 else "worse"
    return "inconclusive"


def _f(x: float | None, spec: str) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def render_table(rows: list[dict], config: BenchmarkConfig, seeds: list[int], losses: str) -> str:
    """The markdown table of :func:`benchmark_rows` with the lines that say how to read it."""
    metric = rows[0]["metric"].removeprefix("test_").upper()
    step = next((r["saturation_step"] for r in rows if r["saturation_step"] is not None), None)
    head = [
        "method", f"test {metric} (mean [95 % CI])", f"Δ vs {config.reference} [95 % CI]", "p (raw / Holm)",
        f"TOST p (raw / Holm), ±{config.margin:g}", "verdict", f"MDD ({config.power:.0%} power)",
        "rank [95 % bootstrap]", "MaxVio", "Jain",
        "change rate (last interval)", f"saturation at step {step}", "expert FFNs / token",
        "layer time ÷ dense", "peak MiB (dense)", "repeats bit for bit", "1 vs 2 ranks max |Δloss|",
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        delta = (
            "—"
            if r["delta"] is None
            else f"{r['delta']:+.4f} [{_f(r['delta_low'], '+.4f')}, {_f(r['delta_high'], '+.4f')}]"
        )
        cells = [
            r["method"],
            f"{r['mean']:.4f} [{_f(r['ci_low'], '.4f')}, {_f(r['ci_high'], '.4f')}]",
            delta,
            "—" if r["p"] is None else f"{_f(r['p'], '.2g')} / {_f(r['p_holm'], '.2g')}",
            "—"
            if r["p_equivalent"] is None
            else f"{_f(r['p_equivalent'], '.2g')} / {_f(r['p_equivalent_holm'], '.2g')}",
            r["verdict"],
            _f(r["mdd"], ".4f"),
            f"{r['rank']} [{r['rank_low']}, {r['rank_high']}]",
            _f(r["max_vio"], ".3f"),
            _f(r["jain"], ".3f"),
            _f(r["change_rate"], ".3f"),
            _f(r["saturation_mid"], ".3f"),
            _f(r["active_experts"], ".2f")
            + (f" + {r['shared_experts']} shared" if r["shared_experts"] else ""),
            _f(r["layer_ratio"], ".2f") + (" (sched.)" if r["competing_fraction"] is not None else ""),
            f"{_f(r['peak_mib'], '.1f')} ({_f(r['dense_peak_mib'], '.1f')})",
            "—" if r["bit_repeat"] is None else ("yes" if r["bit_repeat"] else "no"),
            "failed" if r["rank_note"] else _f(r["rank_gap"], ".1e"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    run = config.run
    notes = [
        f"{len(rows)} methods × {len(seeds)} seeds ({seeds[0]}–{seeds[-1]}; a seed fixes the initial weights "
        f"and the batches, so the differences are paired by seed); size {run.size}, {run.steps} steps, "
        f"data {run.data}; test {metric} on the first {run.test_tokens or 'all'} test tokens of the best-"
        f"validation checkpoint; {losses}.",
        f"p: paired t-test of the difference to {config.reference}; TOST: equivalence within ±{config.margin:g}; "
        f"both Holm-adjusted over the {len(rows) - 1} comparisons; verdicts at 0.05.",
        f"MDD: the smallest true difference the paired t-test detects with {config.power:.0%} power at these "
        f"seeds, at 0.05 / {len(rows) - 1} (Bonferroni, which bounds Holm's first step); `moelab benchmark "
        "--plan` gives the seeds each verdict needs.",
        "rank: by mean test metric (1 = lowest), interval from 2,000 bootstrap resamples of the seeds.",
        f"MaxVio, Jain, change rate, saturation, expert FFNs / token: diagnostics on the first "
        f"{config.diagnose_tokens} test tokens, mean over seeds; change rate between the last two kept "
        "checkpoints; saturation = share of the final checkpoint's top-K choices the named checkpoint "
        "already makes; expert FFNs / token: routed experts a token runs at inference (null experts and empty slots not "
        "counted), plus the shared experts every token runs.",
        f"layer time ÷ dense: the first MoE layer of seed {seeds[0]}'s model, training step (forward + "
        "backward) on one batch of tokens against a dense FFN of width K·d_hidden, median over "
        f"{config.timing_rounds} interleaved rounds of process CPU time, 1 thread; (sched.): the plain and "
        "the competing step weighted by the share of (layer, step) pairs that compete; peak MiB: the "
        "tensors that step allocates beyond its weights and input.",
        f"repeats bit for bit: two {config.repeat_steps}-step runs of seed {seeds[0]} in one process agree in "
        "every logged loss and every final weight; 1 vs 2 ranks: the same run on two gloo ranks "
        "(torchrun, each rank half of every batch), largest difference of a logged training loss.",
    ]
    notes += [f"{r['method']}: {r['rank_note']}" for r in rows if r["rank_note"]]
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes)


def _csv_text(rows: list[dict]) -> str:
    keys = [k for k in rows[0] if k != "per_seed"] + ["per_seed"]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=keys, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({**r, "per_seed": ";".join(repr(v) for v in r["per_seed"])})
    return buf.getvalue()


def _figure(width: float, height: float):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height))


def plot_quality(rows: list[dict], config: BenchmarkConfig, path: Path) -> None:
    """Each method's mean test metric with its 95 % interval, best first, the reference's mean ±
    the margin shaded."""
    fig, ax = _figure(7, 0.3 * len(rows) + 1.5)
    ref = next(r for r in rows if r["method"] == config.reference)
    ax.axvspan(
        ref["mean"] - config.margin,
        ref["mean"] + config.margin,
        color="0.9",
        label=f"{config.reference} ± margin",
    )
    for i, r in enumerate(rows):
        lo, hi = r["ci_low"], r["ci_high"]
        ax.errorbar(r["mean"], i, xerr=[[r["mean"] - lo], [hi - r["mean"]]], fmt="o", color="C0", capsize=3)
    ax.set_yticks(range(len(rows)), [r["method"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel(f"test {rows[0]['metric'].removeprefix('test_').upper()} (mean, 95 % CI over seeds)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    atomic_write_png(path, fig, dpi=120)


def plot_cost(rows: list[dict], config: BenchmarkConfig, path: Path) -> None:
    """Quality against cost: the difference to the reference (95 % interval) against the layer's
    training-step time over a dense FFN of the same active width."""
    fig, ax = _figure(7, 5)
    for r in rows:
        if r["layer_ratio"] is None:
            continue
        delta = 0.0 if r["delta"] is None else r["delta"]
        err = None
        if r["delta_low"] is not None:
            err = [[delta - r["delta_low"]], [r["delta_high"] - delta]]
        ax.errorbar(r["layer_ratio"], delta, yerr=err, fmt="o", capsize=3)
        ax.annotate(
            r["method"], (r["layer_ratio"], delta), fontsize=7, xytext=(3, 3), textcoords="offset points"
        )
    ax.axhspan(-config.margin, config.margin, color="0.9")
    ax.axhline(0, color="0.5", lw=0.8)
    ax.set_xscale("log")  # a router that runs every expert and one that runs K sit on one axis
    ax.set_xlabel("layer training step time ÷ dense FFN of equal active width (log scale)")
    ax.set_ylabel(f"Δ test {rows[0]['metric'].removeprefix('test_').upper()} vs {config.reference}")
    fig.tight_layout()
    atomic_write_png(path, fig, dpi=120)
