"""``moelab compare``: several MoE methods × seeds on one language-modelling task — the main job.

The CPU-scale version of CompeteSMoE (2024) Table 2 (with the seeds and Welch t-test of CompeteSMoE (2024)
Table 9): every method is trained with each seed by :func:`moelab.experiments.lm.train_lm` into
``OUT/<method>/seed<k>/``, then :mod:`moelab.experiments.report` prints the table (mean ± std over seeds, best
marked, p-value of each method against CompeteSMoE) and writes ``results.csv``, ``runs.csv`` and
``val_curves.png`` into ``OUT``.

Beside the table it prints the test figure of n-gram count models of the same corpus (orders 1-3, add-k
smoothing chosen on validation; :mod:`moelab.data.ngram`) and writes them to ``count_models.csv``: a
trained model that does not beat them has not learned much.

Defaults: the embedded corpus, the ``cpu`` preset (300 steps), methods smoe, smoe-fixed, xmoe,
stablemoe, competesmoe (those registered in this moelab; the others are named in the output),
3 seeds.  A finished run is reused with ``--resume`` (an interrupted one continues from its
checkpoint), so a killed comparison loses at most one run's last steps.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from .. import _validate
from ..data.text import load_text
from ..io.atomic import atomic_write_text, read_json
from ..io.rundir import RUN_ENTRIES
from ..methods import methods
from .args import parse_sweep
from .lm import add_lm_arguments, build_config, set_threads, train_lm
from .papers import PAPERS, SAME_LOSSES, paper_table
from .report import COUNT_MODELS, collect_runs, write_count_models, write_report
from .summary import mean_sd

__all__ = ["DEFAULT_METHODS", "add_arguments", "parse_sweep", "run"]

#: the baselines of CompeteSMoE (2024) Table 2 and the method itself
DEFAULT_METHODS = ("smoe", "smoe-fixed", "xmoe", "stablemoe", "competesmoe")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help="comma-separated methods (default: %(default)s; unavailable ones are skipped and named)",
    )
    p.add_argument("--seeds", type=int, default=3, help="seeds per method, 0..N-1 (default 3)")
    p.add_argument("--seed-offset", type=int, default=0, dest="seed_offset", help="first seed")
    p.add_argument(
        "--jobs",
        type=int,
        help="trainings at once, in worker processes of one thread each (default: the cores; 1: in this "
        "process, with progress bars)",
    )
    p.add_argument("--reference", default="competesmoe", help="method the p-values compare against")
    p.add_argument(
        "--paper",
        choices=sorted(PAPERS),
        help="run the methods and loss settings of CompeteSMoE (2024) or (2025) Table 2 and print the "
        "paper's numbers beside ours",
    )
    p.add_argument(
        "--losses",
        choices=["same", "preset"],
        default="same",
        help="same (default): every method gets balance 0.01 and z 0.001 (the paper's with --paper); "
        "preset: each method's own preset coefficients",
    )
    p.add_argument(
        "--sweep",
        metavar="KEY=V1,V2,...",
        help="also vary one method option (CompeteSMoE (2024) Tables 4-5), e.g. omega=0.01,0.03,0.05; report prints the sensitivity table",
    )
    p.add_argument("--out", default="runs/compare", help="output folder (default runs/compare)")
    p.add_argument(
        "--resume", action="store_true", help="reuse finished runs in --out, continue unfinished ones"
    )
    p.add_argument("--force", action="store_true", help="re-run everything in --out")
    p.add_argument(
        "--allow-changes",
        action="store_true",
        dest="allow_changes",
        help="with --resume: continue unfinished runs even though flags or data differ from theirs",
    )
    add_lm_arguments(p)


def run(args: argparse.Namespace) -> int:
    from ..errors import UsageError

    paper = PAPERS[args.paper] if args.paper else None
    if paper is not None:
        if args.methods == ",".join(DEFAULT_METHODS):  # the paper's methods unless chosen
            args.methods = ",".join(paper.methods)
        if args.reference == "competesmoe":
            args.reference = paper.reference
    requested = [m.strip() for m in str(args.methods).split(",") if m.strip()]
    if not requested:
        raise UsageError(f"--methods {args.methods!r} names no method")
    known = set(methods())
    unknown_default = [m for m in requested if m not in known and m in DEFAULT_METHODS]
    unknown = [m for m in requested if m not in known and m not in DEFAULT_METHODS]
    if unknown:
        raise ValueError(f"--methods: {unknown} are not moelab methods; allowed: {methods()}")
    chosen = [m for m in requested if m in known]
    if not chosen:
        raise UsageError(f"none of --methods {requested} is available in this moelab")
    _validate.positive_int("--seeds", args.seeds)
    _jobs(args)  # a bad --jobs fails before anything runs
    out = Path(args.out)
    if (out / "results.csv").exists() and not (args.resume or args.force):
        raise FileExistsError(f"--out {out} already holds a comparison; pass --resume to reuse it or --force")
    set_threads(args)
    if unknown_default:
        print(f"not available in this moelab (skipped): {', '.join(unknown_default)}")
    reference = args.reference if args.reference in chosen else chosen[0]
    if reference != args.reference:
        print(
            f"reference {args.reference!r} is not among the methods run; p-values are against {reference!r}"
        )

    seeds = list(range(args.seed_offset, args.seed_offset + args.seeds))
    shared = {} if args.losses == "preset" else dict(paper.losses if paper else SAME_LOSSES)
    losses_line = (
        "aux losses: each method's preset coefficients"
        if not shared
        else "aux losses: "
        + ", ".join(f"{k[:-5]} {v:g}" for k, v in shared.items())
        + " for every method (plus each method's own losses: distillation, diversity, ...)"
        + (f", as {paper.citation}" if paper else "")
    )
    print(losses_line)
    sweep = parse_sweep(args.sweep)
    configs = []
    points = list(zip(sweep.values, sweep.labels)) if sweep else [(None, None)]
    for method in chosen:
        for value, label in points:
            # the folder of a swept value: ``<method>-<key><value as written>`` (parse_sweep keeps it in
            # --out)
            name = method if sweep is None else f"{method}-{sweep.key}{label}"
            for seed in seeds:
                ns = argparse.Namespace(**vars(args))
                ns.method, ns.seed = method, seed
                config = build_config(ns)  # validates every flag before training
                if shared:  # like with like: the same auxiliary losses (a flag's --opt wins)
                    config.opts = {**shared, **config.opts}
                if sweep is not None:
                    config.opts = {**config.opts, sweep.key: value}
                configs.append((name, seed, config))
    data = load_text(configs[0][2].data, level=configs[0][2].level)
    print(
        f"compare: {len(chosen)} methods × {len(seeds)} seeds on {data.name} "
        f"({data.train.numel():,} training tokens), size {args.size}, {configs[0][2].train.steps} steps"
    )
    start = time.perf_counter()
    # seed-major: a busy phase of the machine falls on every method alike
    order = sorted(configs, key=lambda c: c[1])  # stable: the methods keep their order within a seed
    tasks = []
    for method, seed, config in order:
        run_dir = out / method / f"seed{seed}"  # method: the method, with the swept value if any
        if args.resume and (run_dir / "metrics.json").exists():
            print(f"{method} seed {seed}: finished, reused")
            continue
        # any run entry, not only config.yaml: a kill between tokenizer.json and config.yaml leaves a
        # folder that only --resume may continue
        resume = args.resume and any((run_dir / name).exists() for name in RUN_ENTRIES)
        tasks.append((method, seed, config, run_dir, resume))
    jobs = min(_jobs(args), max(1, len(tasks)))
    key = f"test_{data.metric}"
    count_line = None
    for i, (method, seed, m) in enumerate(_train_all(tasks, jobs, args, data), 1):
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


def _jobs(args: argparse.Namespace) -> int:
    if args.jobs is None:
        return os.cpu_count() or 1
    return _validate.positive_int("--jobs", args.jobs)


def _train_all(tasks: list, jobs: int, args: argparse.Namespace, data):
    """Train ``tasks`` (method, seed, config, run dir, resume) and yield ``(method, seed, metrics)``
    as they finish: in this process, or in ``jobs`` worker processes of one thread each."""
    options = {"force": args.force, "allow_changes": args.allow_changes}
    if jobs == 1:
        for method, seed, config, run_dir, resume in tasks:
            m = train_lm(config, run_dir, resume=resume, progress=not args.no_progress, data=data, **options)
            yield method, seed, m
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # spawn: a fresh interpreter per worker (forking a process that has started OpenMP threads can hang)
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {
            pool.submit(_train_in_worker, config, run_dir, resume, options): (method, seed)
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


def _train_in_worker(config, run_dir: Path, resume: bool, options: dict) -> dict:
    import torch

    torch.set_num_threads(1)  # the jobs share the cores: one thread each
    return train_lm(config, run_dir, resume=resume, progress=False, **options)
