"""The SIGKILL crash harness: ``moelab train``, ``moelab compare``, ``moelab specialize``, ``moelab
finetune`` and ``moelab benchmark`` killed at every file-system write event (the benchmark: at every
seventh), resumed with ``--resume``, and compared bit for bit
with an uninterrupted run; ``moelab compare --jobs 2`` killed while its workers train leaves no process
behind and resumes bit for bit.

Each command is first run once uninterrupted (the reference); then, for ``N = 1, 2, ...``, it is run
with a write hook (:func:`moelab.io.atomic.set_write_hook`, installed by this harness in the child
process) that SIGKILLs the process at its Nth write event — an atomic write after its temporary file
is complete and before the rename, a folder's rename, a ``log.csv`` append, then once more with ``--resume`` and no hook, until a run
with the hook finishes without being killed (the command has ``N - 1`` write events).  A resumed run
is *identical* when every ``metrics.json`` (timing keys aside), every ``*.safetensors`` tensor and
every CSV row (timing columns aside) equals the reference's bit for bit, and the two runs hold the
same such files.

Runs are forks of one server process that has imported moelab once (``fork=True``, Linux): the
same code path as ``python -m moelab`` without ~6 s of imports per run on a busy 2-core VM;
``fork=False`` starts every run as a fresh ``python -m moelab`` process.

By hand (prints one line per command: kill points tried / bit-identical)::

    PYTHONPATH=src python tests/test_crash_harness.py [WORKDIR]
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

#: metrics / CSV columns that measure time or memory (the only numbers a resumed run may change: a
#: measurement repeated, and the profiler's memory peaks are not bit-stable between repeats) or name the
#: run's own folder
TIMING = {"seconds", "tokens_per_s", "train_time_s", "time_s", "train_tokens_per_s", "path", "layer_ratio",
          "peak_mib", "dense_peak_mib"}  # fmt: skip

_LM = ["--block-size", "16", "--batch-size", "4", "--num-experts", "4", "--steps", "4", "--eval-every", "2",
       "--eval-tokens", "64", "--test-tokens", "64", "--ckpt-every", "2", "--no-progress"]  # fmt: skip


def commands(corpus: Path) -> dict[str, list[str]]:
    """The four short runs of the harness (``--out`` appended per run); ``finetune`` fine-tunes the
    LM and reads the table that :func:`prepare_finetune` writes beside ``corpus``."""
    return {
        "train": ["train", "--data", str(corpus), "--size", "cpu", *_LM],
        "compare": ["compare", "--data", str(corpus), *_LM, "--methods", "smoe,competesmoe", "--seeds", "1",
                    "--jobs", "1"],
        "specialize": ["specialize", "--gate", "attentive", "--reg", "ls", "--distill", "--epochs", "2",
                       "--train-samples", "96", "--test-samples", "48"],
        "benchmark": ["benchmark", "--data", str(corpus), "--size", "cpu", *_LM, "--methods", "smoe,competesmoe",
                      "--seeds", "2", "--jobs", "1", "--diagnose-tokens", "64", "--repeat-steps", "2",
                      "--timing-rounds", "3", "--no-ranks"],
        "finetune": ["finetune", "--task", str(corpus.parent / "reviews.csv"), "--from",
                     str(corpus.parent / "finetune-lm"), "--steps", "4", "--eval-every", "2", "--batch-size", "8",
                     "--no-progress"],
    }  # fmt: skip


def prepare_finetune(corpus: Path, runner: Runner) -> None:
    """The LM (a StableMoE run, so that its routing context matters) and the table ``finetune`` reads."""
    lm = corpus.parent / "finetune-lm"
    if not (lm / "metrics.json").exists():
        argv = [
            "train",
            "--data",
            str(corpus),
            "--size",
            "cpu",
            *_LM,
            "--method",
            "stablemoe",
            "--out",
            str(lm),
        ]
        assert runner(argv, corpus.parent / "finetune-lm.log") == 0, (
            corpus.parent / "finetune-lm.log"
        ).read_text()
    rows = ["text,label"] + [f"{'the cat sat' if i % 2 else 'a dog ran far'} {i},{i % 2}" for i in range(80)]
    (corpus.parent / "reviews.csv").write_text("\n".join(rows) + "\n")


def write_corpus(path: Path) -> Path:
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"]
    lines = [" ".join(words[(7 * i + 3 * j) % 10] for j in range(8)) for i in range(600)]
    path.write_text("\n".join(lines) + "\n")
    return path


#: a child process: the write hook that SIGKILLs at the ``kill_at``-th write event, then ``moelab argv``
_CHILD = r"""
def run_moelab(argv, kill_at):
    import os, signal
    import moelab.cli
    from moelab.io import atomic

    if kill_at is not None:
        events = [0]

        def kill_at_nth():
            events[0] += 1
            if events[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

        atomic.set_write_hook(kill_at_nth)
    return moelab.cli.main(argv)
"""

_SERVER = (
    _CHILD
    + r"""
import json, os, sys, traceback
import moelab.cli
moelab.cli.build_parser()  # imports every subcommand once; each run is a fork of this process
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            code = run_moelab(job["argv"], job["kill_at"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    print(json.dumps({"rc": rc}), flush=True)
"""
)

_FRESH = (
    _CHILD
    + r"""
import json, sys
sys.exit(run_moelab(json.loads(sys.argv[1]), json.loads(sys.argv[2])))
"""
)


class Runner:
    """Runs ``moelab ARGV`` in a child process (a fork of a pre-imported server, or a fresh Python)."""

    def __init__(self, fork: bool = True) -> None:
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [_SRC, os.environ.get("PYTHONPATH")])),
        }
        self.server = None
        if fork:
            self.server = subprocess.Popen(
                [sys.executable, "-c", _SERVER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=self.env,
            )

    def __call__(self, argv: list[str], log: Path, kill_at: int | None = None) -> int:
        if self.server is not None:
            self.server.stdin.write(json.dumps({"argv": argv, "kill_at": kill_at, "log": str(log)}) + "\n")
            self.server.stdin.flush()
            return json.loads(self.server.stdout.readline())["rc"]
        with open(log, "w") as f:
            return subprocess.run(
                [sys.executable, "-c", _FRESH, json.dumps(argv), json.dumps(kill_at)],
                env=self.env,
                stdout=f,
                stderr=f,
            ).returncode

    def close(self) -> None:
        if self.server is not None:
            self.server.stdin.close()
            self.server.wait(timeout=60)


_SRC = str(Path(__file__).resolve().parents[1] / "src")


def _csv_rows(path: Path) -> list[dict[str, str]]:
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def differences(ref: Path, run: Path) -> list[str]:
    """What differs between two finished runs' metrics.json, weights and CSVs (``[]``: bit-identical)."""
    from safetensors.torch import load_file

    found = []
    for pattern in ("metrics.json", "*.safetensors", "*.csv"):
        a = sorted(p.relative_to(ref) for p in ref.rglob(pattern))
        b = sorted(p.relative_to(run) for p in run.rglob(pattern))
        if a != b:
            found.append(f"{pattern}: files {sorted(set(map(str, a)) ^ set(map(str, b)))} in one run only")
        for rel in set(a) & set(b):
            x, y = ref / rel, run / rel
            if pattern == "metrics.json":
                mx, my = (
                    {k: v for k, v in json.loads(p.read_text()).items() if k not in TIMING} for p in (x, y)
                )
                same = mx == my
            elif pattern == "*.csv":
                same = _csv_rows(x) == _csv_rows(y)
            else:
                tx, ty = load_file(x), load_file(y)
                same = tx.keys() == ty.keys() and all(
                    tx[k].dtype == ty[k].dtype and tx[k].shape == ty[k].shape
                    and tx[k].numpy().tobytes() == ty[k].numpy().tobytes()
                    for k in tx
                )  # fmt: skip
            if not same:
                found.append(str(rel))
    return found


def harness(
    name: str, argv: list[str], work: Path, runner: Runner, limit: int | None = None, stride: int = 1
) -> dict:
    """Kill ``moelab ARGV`` at each of its write events in turn (``stride``: every ``stride``-th,
    from the first), resume it, compare with the reference.

    Returns ``{"command", "kill_points", "identical", "failures", "seconds"}``; ``failures`` lists
    ``(N, what differs or why the resume failed)``."""
    t0 = time.perf_counter()
    root = work / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    ref = root / "reference"
    assert runner([*argv, "--out", str(ref)], root / "reference.log") == 0, (
        root / "reference.log"
    ).read_text()
    tried, identical, failures = 0, 0, []
    n = 1
    while limit is None or n <= limit:
        out, log = root / f"kill{n}", root / f"kill{n}.log"
        rc = runner([*argv, "--out", str(out)], log, kill_at=n)
        if rc == 0:  # no Nth write event: every kill point has been tried
            break
        tried += 1
        if rc != -signal.SIGKILL:
            failures.append((n, f"the killed run exited {rc}: {log.read_text()[-300:]}"))
        else:
            rc = runner([*argv, "--out", str(out), "--resume"], log)
            diff = differences(ref, out) if rc == 0 else [f"the resume exited {rc}: {log.read_text()[-300:]}"]
            if diff:
                failures.append((n, "; ".join(diff)))
            else:
                identical += 1
        shutil.rmtree(out, ignore_errors=True)
        n += stride
    return {
        "command": name,
        "kill_points": tried,
        "identical": identical,
        "failures": failures,
        "seconds": round(time.perf_counter() - t0, 1),
    }


#: kill every n-th write event only: the benchmark writes over a hundred files (its runs, their
#: diagnostics, the short runs of its cost checks), and each kill point is a run and a resume
STRIDE = {"benchmark": 7}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["train", "compare", "specialize", "finetune", "benchmark"])
def test_a_run_killed_at_any_write_resumes_bit_identically(name, tmp_path):
    runner = Runner(fork=sys.platform == "linux")
    try:
        corpus = write_corpus(tmp_path / "corpus.txt")
        if name == "finetune":
            prepare_finetune(corpus, runner)
        argv = commands(corpus)[name]
        result = harness(name, argv, tmp_path, runner, stride=STRIDE.get(name, 1))
    finally:
        runner.close()
    assert result["kill_points"] >= 5  # the hook fired: each command writes several files
    assert result["failures"] == [] and result["identical"] == result["kill_points"]


def _descendants(pid: int) -> list[int]:
    """The PIDs of every process below ``pid`` (Linux: ``/proc/PID/task/*/children``)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its parent has not reaped it


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc (Linux)")
def test_a_killed_compare_with_two_jobs_leaves_no_worker_and_resumes_bit_identically(tmp_path):
    """SIGKILL of ``moelab compare --jobs 2`` while both workers train: no process outlives it (none
    goes on writing into --out or holds a run's lock), and ``--resume`` finishes the comparison
    exactly as an uninterrupted one."""
    corpus = write_corpus(tmp_path / "corpus.txt")
    argv = ["compare", "--data", str(corpus), *_LM, "--methods", "smoe", "--seeds", "2", "--jobs", "2"]
    argv = [*argv[: argv.index("--steps") + 1], "400", *argv[argv.index("--steps") + 2 :]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_SRC, os.environ.get("PYTHONPATH")]))}
    moelab = [sys.executable, "-m", "moelab"]
    ref, out = tmp_path / "reference", tmp_path / "killed"
    subprocess.run([*moelab, *argv, "--out", str(ref)], env=env, check=True, capture_output=True)
    with open(tmp_path / "killed.log", "w") as log:
        parent = subprocess.Popen([*moelab, *argv, "--out", str(out)], env=env, stdout=log, stderr=log)
    logs = [out / "smoe" / f"seed{s}" / "log.csv" for s in (0, 1)]
    deadline = time.monotonic() + 300
    while not all(p.exists() and p.stat().st_size > 200 for p in logs) and parent.poll() is None:
        assert time.monotonic() < deadline, (tmp_path / "killed.log").read_text()
        time.sleep(0.05)
    workers = _descendants(parent.pid)
    assert parent.poll() is None and len(workers) >= 2  # both training, in their own processes
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [w for w in workers if _alive(w)] == []
    resumed = subprocess.run(
        [*moelab, *argv, "--out", str(out), "--resume"], env=env, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr
    assert differences(ref, out) == []


def test_compare_resumes_a_run_killed_between_its_tokenizer_and_its_config(tmp_path, monkeypatch, capsys):
    """A ``moelab compare`` run killed after its ``tokenizer.json`` and before its ``config.yaml``
    holds no run yet, so ``--resume`` continues it rather than refusing the folder as an existing
    run: the crash harness can stop a run at any write."""
    from moelab import cli
    from moelab.io.rundir import RunDir

    argv = [*commands(write_corpus(tmp_path / "corpus.txt"))["compare"], "--out", str(tmp_path / "cmp")]
    real, calls = RunDir.write_config, []

    def killed_at_the_second_run(self, config):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # a kill: nothing after it runs
        real(self, config)

    monkeypatch.setattr(RunDir, "write_config", killed_at_the_second_run)
    assert cli.main(argv) == 130
    second = tmp_path / "cmp" / "competesmoe" / "seed0"
    assert (second / "tokenizer.json").exists() and not (second / "config.yaml").exists()
    monkeypatch.undo()
    assert cli.main([*argv, "--resume"]) == 0, capsys.readouterr().err
    assert (second / "metrics.json").exists()


def main(argv: list[str]) -> int:
    work = Path(argv[0]) if argv else Path(tempfile.mkdtemp(prefix="moelab-crash-"))
    work.mkdir(parents=True, exist_ok=True)
    runner = Runner(fork=sys.platform == "linux")
    results = []
    try:
        corpus = write_corpus(work / "corpus.txt")
        prepare_finetune(corpus, runner)
        for name, command in commands(corpus).items():
            r = harness(name, command, work, runner, stride=STRIDE.get(name, 1))
            results.append(r)
            print(
                f"moelab {name}: {r['kill_points']} kill points tried, {r['identical']} bit-identical after "
                f"--resume ({r['seconds']:.0f} s)",
                flush=True,
            )
            for n, what in r["failures"]:
                print(f"  kill at write {n}: {what}", flush=True)
    finally:
        runner.close()
    return 0 if all(not r["failures"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
