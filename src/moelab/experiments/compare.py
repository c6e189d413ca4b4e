"""``moelab compare``: several MoE methods × seeds on one language-modelling task, the CPU-scale
version of CompeteSMoE (2024) Table 2 with the seeds and Welch t-tests of its Table 9: every method
is trained with each seed by :func:`moelab.experiments.lm.train_lm` into ``OUT/<method>/seed<k>/``,
then :mod:`moelab.experiments.report` prints the table and writes its files, beside the n-gram
count models of the same corpus (:mod:`moelab.data.ngram`).  docs/results.md ("Notes") lists what
it writes and its defaults.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from .. import config as vocab
from ..config import MAX_COUNT, Interval, Options, parse_sweep, setting
from ..data.text import load_text
from ..io.atomic import MANIFEST, atomic_write_text, read_json, record_write
from ..io.rundir import RUN_ENTRIES, RunDir
from ..methods import methods
from . import lm, runner
from .lm import TrainRun, set_threads, train_lm
from .papers import PAPERS, SAME_LOSSES, paper_table
from .report import COUNT_MODELS, collect_runs, write_count_models, write_report
from .summary import mean_sd

__all__ = [
    "DEFAULT_METHODS",
    "add_arguments",
    "compare_runs",
    "die_with_parent",
    "jobs_of",
    "parse_sweep",
    "plan_runs",
    "run",
    "train_all",
]

#: the baselines of CompeteSMoE (2024) Table 2 and the method itself
DEFAULT_METHODS = ("smoe", "smoe-fixed", "xmoe", "stablemoe", "competesmoe")


@dataclass
class CompareConfig:
    """The settings of ``moelab compare``: which methods and seeds, how their losses are set, and
    the settings of every run (``run``: a :class:`moelab.experiments.lm.TrainRun` whose method and
    seed the comparison sets)."""

    methods: str = setting(
        ",".join(DEFAULT_METHODS),
        help="comma-separated methods (unavailable ones are skipped and named)",
    )
    seeds: int = setting(
        3, help="seeds per method, from --seed-offset on", allowed=Interval(int, 1, MAX_COUNT)
    )
    seed_offset: int = setting(0, help="first seed", allowed=Interval(int, 0, 2**63 - 1))
    jobs: int | None = setting(
        None,
        help="trainings at once, in worker processes of one thread each (default: the cores; 1: in this "
        "process, with progress bars)",
        allowed=(Interval(int, 1), None),
    )
    reference: str = setting("competesmoe", help="method the p-values compare against")
    paper: str | None = setting(
        None,
        help="run the methods, loss settings and layouts of CompeteSMoE (2024) or (2025) Table 2 or Ho (2025) "
        "(ho2025: SMoE, DeepSeek-V2, DeepSeek-V3, SMoE-SG) and print the "
        "paper's numbers beside ours",
        allowed=(Options(tuple(sorted(PAPERS))), None),
    )
    losses: str = setting(
        "same",
        help="same: every method gets balance 0.01 and z 0.001 (the paper's with --paper); "
        "preset: each method's own preset coefficients",
        allowed=Options(("same", "preset")),
    )
    sweep: str | None = setting(
        None,
        metavar="KEY=V1,V2,...",
        help="also vary one method option (CompeteSMoE (2024) Tables 4-5), e.g. omega=0.01,0.03,0.05; "
        "report prints the sensitivity table",
    )
    run: TrainRun = field(default_factory=TrainRun)


#: the run settings a comparison decides itself
_SET_BY_COMPARE = ("run.method", "run.seed", "run.expert_parallel")
#: the settings of each run by field name: ``--sweep KEY=...`` sets the field ``KEY`` when it is one
#: (``top_k``: the flag's field, the one way the value reaches a run), else the method option ``KEY``
_RUN_FIELDS = frozenset(f.name for f in fields(TrainRun))


def add_arguments(p: argparse.ArgumentParser) -> None:
    vocab.add_arguments(p, CompareConfig, exclude=_SET_BY_COMPARE, out_default="runs/compare")


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError

    given = runner.given_by_args(CompareConfig, args)
    config = vocab.validate(vocab.build(CompareConfig, given))
    paper = PAPERS[config.paper] if config.paper else None
    if paper is not None:  # the paper's methods and reference unless chosen
        config = replace(
            config,
            methods=config.methods if "methods" in given else ",".join(paper.methods),
            reference=config.reference if "reference" in given else paper.reference,
        )
    requested = [m.strip() for m in config.methods.split(",") if m.strip()]
    if not requested:
        raise UsageError(f"--methods {config.methods!r} names no method")
    known = set(methods()) | {
        name for name, layout in (paper.layouts if paper else {}).items() if "method" in layout
    }
    unknown_default = [m for m in requested if m not in known and m in DEFAULT_METHODS]
    unknown = [m for m in requested if m not in known and m not in DEFAULT_METHODS]
    if unknown:
        raise ValueError(f"--methods: {unknown} are not moelab methods; allowed: {methods()}")
    chosen = [m for m in requested if m in known]
    if not chosen:
        raise UsageError(f"none of --methods {requested} is available in this moelab")
    runner.check_run_flags(resume=args.resume, force=args.force, allow_changes=args.allow_changes)
    out = Path(args.out)
    if (out / "results.csv").exists() and not (args.resume or args.force):
        raise FileExistsError(f"--out {out} already holds a comparison; pass --resume to reuse it or --force")
    if (out / "config.yaml").exists() and not args.force:  # a run of train, finetune, upcycle, ...
        raise FileExistsError(
            f"--out {out} holds a moelab run of another command (config.yaml), not a comparison; choose "
            "another --out or pass --force to start afresh"
        )
    # a run's settings and results take a few KiB: refuse a count the machine cannot even list
    runner.check_memory(
        config, lambda c: 4096 * len(chosen) * c.seeds, {"seeds": 1}, f"{len(chosen)} methods × --seeds runs"
    )
    # the comparison's folder, locked while it runs; --force removes what moelab wrote in it (its
    # manifest), never a file of the user's
    plan = plan_runs(config, paper, chosen, given)
    runner.check_out_is_no_input(
        CompareConfig, config, out, {"--config": args.config} if args.config else None
    )
    top = RunDir(out, resume=args.resume, force=args.force)
    try:
        return compare_runs(args, config, paper, chosen, unknown_default, out, plan)
    finally:
        top.close()


def plan_runs(config: CompareConfig, paper, chosen: list[str], given: dict) -> tuple[list[int], str, list]:
    """The seeds, the loss-settings line and every run's validated config ``(folder, seed, TrainRun)``:
    all of it checked before the comparison's folder is touched."""
    seeds = list(range(config.seed_offset, config.seed_offset + config.seeds))
    shared = {} if config.losses == "preset" else dict(paper.losses if paper else SAME_LOSSES)
    losses_line = (
        "aux losses: each method's preset coefficients"
        if not shared
        else "aux losses: "
        + ", ".join(f"{k[:-5]} {v:g}" for k, v in shared.items())
        + " for every method (plus each method's own losses: distillation, diversity, ...)"
        + (f", as {paper.citation}" if paper else "")
    )
    sweep = parse_sweep(config.sweep)
    if sweep is not None and f"run.{sweep.key}" in _SET_BY_COMPARE:
        raise ValueError(
            f"--sweep {config.sweep!r} is not allowed; a comparison sets {sweep.key} itself "
            "(expected a setting of the run, e.g. top_k=1,2, or a method option, e.g. omega=0.03,0.05)"
        )
    if sweep is not None and (f"run.{sweep.key}" in given or sweep.key in config.run.opts):
        flag = vocab.flag_of(TrainRun, sweep.key) if sweep.key in _RUN_FIELDS else f"--opt {sweep.key}="
        raise ValueError(f"--sweep {config.sweep!r} is not allowed with {flag}; give one of them")
    configs = []
    points = list(zip(sweep.values, sweep.labels)) if sweep else [(None, None)]
    for method in chosen:
        for value, label in points:
            # the folder of a swept value: ``<method>-<key><value as written>`` (parse_sweep keeps it in
            # --out)
            name = method if sweep is None else f"{method}-{sweep.key}{label}"
            for seed in seeds:
                opts = dict(config.run.opts)
                if shared:  # like with like: the same auxiliary losses (a flag's --opt wins)
                    opts = {**shared, **opts}
                swept = {}  # a swept setting of the run (--sweep top_k=1,2) or a method option (omega)
                if sweep is not None and sweep.key in _RUN_FIELDS:
                    swept = {sweep.key: value}
                elif sweep is not None:
                    opts[sweep.key] = value
                layout = {
                    k: v
                    for k, v in (paper.layouts.get(method, {}) if paper else {}).items()
                    if f"run.{k}" not in given and k not in swept
                }
                opts = {**layout.pop("opts", {}), **opts}
                # a paper's row may name its method apart from the row (an ablation: a method + options)
                one = replace(
                    config.run, method=layout.pop("method", method), seed=seed, opts=opts, **layout, **swept
                )
                configs.append((name, seed, vocab.validate(lm.resolve(vocab.validate(one)))))
    return seeds, losses_line, configs


def compare_runs(args, config, paper, chosen, unknown_default, out: Path, plan: tuple) -> int:
    set_threads(config.run)
    if unknown_default:
        print(f"not available in this moelab (skipped): {', '.join(unknown_default)}")
    reference = config.reference if config.reference in chosen else chosen[0]
    if reference != config.reference:
        print(
            f"reference {config.reference!r} is not among the methods run; p-values are against {reference!r}"
        )

    seeds, losses_line, configs = plan
    print(losses_line)
    data = load_text(configs[0][2].data, level=configs[0][2].level)
    print(
        f"compare: {len(chosen)} methods × {len(seeds)} seeds on {data.name} "
        f"({data.train.numel():,} training tokens), size {config.run.size}, {configs[0][2].steps} steps"
    )
    start = time.perf_counter()
    # seed-major: a busy phase of the machine falls on every method alike
    order = sorted(configs, key=lambda c: c[1])  # stable: the methods keep their order within a seed
    tasks = []
    for method, seed, one in order:
        run_dir = out / method / f"seed{seed}"  # method: the method, with the swept value if any
        if args.resume and (run_dir / "metrics.json").exists():
            # reused only if it was made with these settings on this data: else refused in one line
            lm.check_finished(one, run_dir, data, allow_changes=args.allow_changes)
            print(f"{method} seed {seed}: finished, reused")
            continue
        # any run entry, not only config.yaml: a kill between tokenizer.json and config.yaml leaves a
        # folder that only --resume may continue
        resume = args.resume and any((run_dir / name).exists() for name in RUN_ENTRIES)
        record_write(run_dir / MANIFEST)  # a worker process writes it: --force clears what it lists
        tasks.append((method, seed, one, run_dir, resume))
    jobs = min(jobs_of(config), max(1, len(tasks)))
    key = f"test_{data.metric}"
    count_line = None
    for i, (method, seed, m) in enumerate(train_all(tasks, jobs, args, data), 1):
        print(
            f"[{i}/{len(tasks)}] {method} seed {seed}: {key} {m[key]:.4f} "
            f"({time.perf_counter() - start:.0f}s elapsed{f', {jobs} jobs' if jobs > 1 else ''})"
        )
        if jobs > 1 and count_line is None and len(tasks) - i < jobs:  # a worker's core is idle now
            count_line = _count_model_line(data, out)
    runs = collect_runs(list(dict.fromkeys(out / name / f"seed{seed}" for name, seed, _ in configs)))
    print()
    table = write_report(runs, out, reference, header=losses_line)
    print(table)
    print(count_line or _count_model_line(data, out))
    if paper is not None:
        ours = {}
        for name, _, _ in configs:
            values = [
                read_json(out / name / f"seed{s}" / "metrics.json")[f"test_{data.metric}"] for s in seeds
            ]
            ours[name] = (*mean_sd(values), len(values))
        side = paper_table(paper, ours, data.metric.upper())
        print("\n" + side)
        atomic_write_text(out / "paper.txt", side + "\n")
    print(
        f"\nwrote {out / 'results.csv'}, {out / 'runs.csv'}, {out / COUNT_MODELS}, "
        f"{out / 'val_curves.png'} ({time.perf_counter() - start:.0f}s)"
    )
    return 0


def _count_model_line(data, out: Path) -> str:
    """Fit the order 1-3 count models of ``data``, write ``count_models.csv``, return the summary line."""
    from ..data.ngram import count_models

    return write_count_models(out, count_models(data), data.metric)


def jobs_of(config: CompareConfig) -> int:
    return config.jobs or os.cpu_count() or 1


def train_all(tasks: list, jobs: int, args: argparse.Namespace, data):
    """Train ``tasks`` (method, seed, config, run dir, resume) and yield ``(method, seed, metrics)``
    as they finish: in this process, or in ``jobs`` worker processes of one thread each."""

    def options(resume: bool) -> dict:  # --allow-changes concerns a run that resumes; a new one starts
        return {"force": args.force, "allow_changes": args.allow_changes and resume}

    if jobs == 1:
        for method, seed, config, run_dir, resume in tasks:
            m = train_lm(config, run_dir, resume=resume, data=data, **options(resume))
            yield method, seed, m
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # spawn: a fresh interpreter per worker (forking a process that has started OpenMP threads can hang)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        jobs, mp_context=context, initializer=die_with_parent, initargs=(os.getpid(),)
    ) as pool:
        futures = {
            pool.submit(_train_in_worker, config, run_dir, resume, options(resume)): (method, seed)
            for method, seed, config, run_dir, resume in tasks
        }
        try:
            for future in as_completed(futures):
                method, seed = futures[future]
                yield method, seed, future.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def die_with_parent(parent: int) -> None:
    """Make this worker process end when ``parent`` (the ``compare`` process) ends, however it ends
    (a SIGKILL included): an orphaned worker would go on training into ``--out`` and hold its runs'
    locks.  On Linux the kernel sends SIGKILL on the parent's death (``PR_SET_PDEATHSIG``); a
    watchdog thread that checks the parent's PID every second covers the other systems and the
    case of a parent that died before the request was made."""
    import ctypes
    import signal
    import sys
    import threading

    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)  # the parent is gone: nothing of this worker's may go on

    threading.Thread(target=watch, name="moelab-parent-watchdog", daemon=True).start()


def _train_in_worker(config, run_dir: Path, resume: bool, options: dict) -> dict:
    import torch

    torch.set_num_threads(1)  # the jobs share the cores: one thread each
    return train_lm(replace(config, progress=False), run_dir, resume=resume, **options)
