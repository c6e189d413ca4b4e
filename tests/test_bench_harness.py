"""The benchmark harness every ``moelab bench`` kind times with: interleaved rounds (order,
resets, budget, dropped candidates), medians and per-round ratios on fake timings, the peak
tables, the CPU peak-memory probe and the machine record."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from moelab.bench import harness
from moelab.bench.harness import Candidate, interleaved, summarize


def _logged(log: list[str], name: str, phase: str = "train") -> Candidate:
    return Candidate(
        name,
        phase,
        lambda: log.append(name),
        reset=lambda: log.append(f"reset {name}"),
    )


def test_interleaved_runs_each_round_in_a_fresh_seeded_order_and_resets_before_every_call():
    log: ClassVar[list[str]] = []
    cands = [_logged(log, n) for n in ("a", "b", "c")]
    rounds = interleaved(cands, repeats=12, warmup=1, progress=False)
    assert rounds == 12
    calls = [e for e in log if not e.startswith("reset")]
    assert calls[:3] == ["a", "b", "c"]  # warm-up in the given order
    timed = [calls[3 + 3 * r : 6 + 3 * r] for r in range(12)]
    assert all(sorted(r) == ["a", "b", "c"] for r in timed)  # every candidate once a round
    before_b = {r[r.index("b") - 1] if r.index("b") else "start" for r in timed}
    assert len(before_b) > 1  # not always after the same candidate (as a rotation would be)
    assert all(log[i] == f"reset {log[i + 1]}" for i in range(0, len(log), 2))
    assert [len(c.times) for c in cands] == [12, 12, 12]
    log.clear()
    interleaved([_logged(log, n) for n in ("a", "b", "c")], repeats=12, warmup=1, progress=False)
    assert [e for e in log if not e.startswith("reset")] == calls  # the same orders every run


def test_interleaved_stops_at_the_budget_but_not_before_the_minimum_rounds():
    cands = [Candidate("a", "train", lambda: None), Candidate("b", "train", lambda: None)]
    assert interleaved(cands, repeats=10, warmup=0, budget=1e-12, min_repeats=3, progress=False) == 3
    assert [len(c.times) for c in cands] == [3, 3]
    cands = [Candidate("a", "train", lambda: None)]
    assert interleaved(cands, repeats=2, warmup=0, budget=1e-12, min_repeats=3, progress=False) == 2


def _failing(after: int):
    calls = []

    def fn() -> None:
        calls.append(1)
        if len(calls) > after:
            raise MemoryError("out of memory")

    return fn


def test_interleaved_drops_a_failing_candidate_with_a_note_and_times_the_others():
    ok = Candidate("dense", "train", lambda: None)
    bad = Candidate("peer", "train", _failing(after=2))  # warm-up and round 1 pass, round 2 fails
    cands = [ok, bad]
    notes: list[str] = []
    assert interleaved(cands, repeats=4, warmup=1, notes=notes, progress=False) == 4
    assert cands == [ok] and len(ok.times) == 4
    assert notes == ["peer train dropped: MemoryError: out of memory"]


def test_interleaved_without_notes_lets_a_failure_end_the_run():
    with pytest.raises(MemoryError, match="out of memory"):
        interleaved([Candidate("peer", "train", _failing(after=0))], repeats=2, warmup=0, progress=False)


def test_interleaved_refuses_an_unknown_clock():
    with pytest.raises(
        ValueError, match=r"clock='gpu' is not allowed; expected one of \['wall', 'cpu', 'cuda'\]"
    ):
        interleaved([Candidate("a", "train", lambda: None)], repeats=1, warmup=0, clock="gpu")


def test_summarize_ratio_is_the_median_of_per_round_ratios():
    dense = Candidate("dense", "train", lambda: None, times=[1.0, 2.0, 4.0])
    moe = Candidate("moe", "train", lambda: None, times=[1.5, 2.0, 20.0], flops=12, note="n")
    other_phase = Candidate("moe", "infer", lambda: None, times=[1.0, 1.0, 1.0])
    rows = summarize([dense, moe, other_phase])
    assert rows[1]["ratio_to_dense"] == pytest.approx(1.5)  # median of 1.5, 1.0, 5.0
    assert (rows[1]["ratio_p25"], rows[1]["ratio_p75"]) == pytest.approx((1.25, 3.25))
    assert rows[1]["median_ms"] == pytest.approx(2000.0)
    assert (rows[1]["min_ms"], rows[1]["max_ms"], rows[1]["rounds"]) == (1500.0, 20000.0, 3)
    assert (rows[1]["flops_per_token"], rows[1]["note"]) == (12, "n")
    assert rows[0]["ratio_to_dense"] == 1.0
    assert rows[2]["ratio_to_dense"] is None  # no dense in its phase


@pytest.mark.parametrize(
    ("name", "dtype", "tf32", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", False, ("H100 SXM", 989.4)),
        ("NVIDIA H100 80GB HBM3", "float32", False, ("H100 SXM", 66.9)),
        ("NVIDIA H100 80GB HBM3", "float32", True, ("H100 SXM", 494.7)),
        ("NVIDIA H100 PCIe", "bfloat16", False, ("H100 PCIe", 756.0)),
        ("NVIDIA H200", "bfloat16", False, ("H200 SXM", 989.4)),
        ("NVIDIA A100-SXM4-80GB", "bfloat16", False, ("A100", 312.0)),
        ("Some Future GPU", "bfloat16", False, (None, None)),
    ],
)
def test_peak_table_by_device_name(name, dtype, tf32, expected):
    assert harness.device_peak_tflops(name, dtype, tf32) == expected


def test_cpu_peak_memory_probe_sees_a_known_allocation():
    def allocate() -> None:
        a = torch.empty(1 << 20)  # 4 MiB
        b = torch.empty(1 << 19)  # 2 MiB, while a lives: peak 6 MiB
        del a
        c = torch.empty(1 << 18)  # 1 MiB after a is freed
        del b, c

    peak = harness.peak_memory_bytes(allocate, "cpu")
    assert 6 * 2**20 <= peak < 6 * 2**20 + 2**16
    assert harness.peak_memory_bytes(lambda: None, "cpu") < 2**16


def test_measure_peak_memory_resets_around_the_call_and_notes_a_failure():
    log: ClassVar[list[str]] = []
    good = _logged(log, "dense")
    bad = Candidate("peer", "infer", _failing(after=0))
    notes: list[str] = []
    harness.measure_peak_memory([good, bad], "cpu", notes)
    assert log == ["reset dense", "dense", "reset dense"]
    assert good.peak_mib is not None and good.peak_mib >= 0
    assert bad.peak_mib is None and notes == ["peer infer peak memory not measured: MemoryError"]
    with pytest.raises(MemoryError):
        harness.measure_peak_memory([bad], "cpu")


def test_machine_record_on_the_cpu_names_the_processor_and_versions_but_no_gpu():
    info = harness.machine_info("cpu")
    assert info["torch"] == torch.__version__ and info["cores"] >= 1
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert "gpu" not in info and "peak_bf16_tflops" not in info


class _FakeEvent:
    """Stands for ``torch.cuda.Event``: its clock is the count of records so far, in milliseconds."""

    log: ClassVar[list[str]] = []
    ticks = 0

    def __init__(self, enable_timing: bool) -> None:
        assert enable_timing
        self.at = None

    def record(self) -> None:
        _FakeEvent.ticks += 1
        self.at = _FakeEvent.ticks * 250.0
        _FakeEvent.log.append("record")

    def synchronize(self) -> None:
        _FakeEvent.log.append("synchronize")

    def elapsed_time(self, end: _FakeEvent) -> float:
        return end.at - self.at


def test_cuda_clock_times_a_call_between_two_events(monkeypatch):
    monkeypatch.setattr(harness.torch.cuda, "Event", _FakeEvent)
    _FakeEvent.log.clear()
    cand = Candidate("a", "train", lambda: _FakeEvent.log.append("call"))
    assert interleaved([cand], repeats=2, warmup=0, clock="cuda", progress=False) == 2
    assert _FakeEvent.log == ["record", "call", "record", "synchronize"] * 2
    assert cand.times == [0.25, 0.25]  # 250 ms between the events, in seconds


def test_machine_record_on_a_cuda_device_adds_the_gpu_and_its_datasheet_peaks(monkeypatch):
    class Props:
        total_memory = 80 * 2**30

    monkeypatch.setattr(harness.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(harness.torch.cuda, "get_device_properties", lambda device=None: Props())
    info = harness.machine_info("cuda")
    tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
    assert info["gpu"] == "NVIDIA H100 80GB HBM3" and info["gpu_memory_gib"] == 80.0
    fp32 = 494.7 if tf32 else 66.9
    assert (info["peak_name"], info["peak_bf16_tflops"], info["peak_fp32_tflops"]) == (
        "H100 SXM",
        989.4,
        fp32,
    )
    assert info["allow_tf32"] is tf32 and info["cuda"] == torch.version.cuda
