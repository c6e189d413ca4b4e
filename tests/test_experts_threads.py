"""The loop's experts spread over torch's threads: the same bits as one thread, the thread setting
given back (after an error too), the caller's grad and inference modes kept."""

from __future__ import annotations

import threading

import pytest
import torch

from experts_helpers import ACTS, random_routing, reference
from moelab.experts import ExpertBank
from moelab.experts.threads import over_experts, split_rows

CPU = torch.device("cpu")


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "rows,parts",
    [([5, 5, 5, 5], 2), ([100, 1, 1, 1, 1], 2), ([1, 1, 1, 100], 2), ([3, 9, 4, 4, 7, 1, 2], 3), ([4], 3),
     ([2, 2], 5), ([7, 1, 1, 1, 1, 1, 1, 7], 4)],
)  # fmt: skip
def test_split_rows_cuts_contiguous_nonempty_groups_of_about_equal_rows(rows, parts):
    groups = split_rows(rows, parts)
    assert [i for g in groups for i in g] == list(range(len(rows)))  # contiguous, in order, all
    assert all(len(g) for g in groups) and len(groups) == min(parts, len(rows))
    cuts = [g[0] for g in groups[1:]]
    total = sum(rows)
    for k, cut in enumerate(cuts, 1):  # no cut one item earlier or later comes closer to k/parts
        before = sum(rows[:cut])
        for other in (cut - 1, cut + 1):
            if 0 < other < len(rows) and other not in cuts:
                assert abs(before - total * k / parts) <= abs(sum(rows[:other]) - total * k / parts)


def test_split_rows_balances_a_heavy_expert():
    assert [list(g) for g in split_rows([10, 10, 10, 40, 10, 10, 10], 2)] == [[0, 1, 2], [3, 4, 5, 6]]
    assert split_rows([], 2) == []


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [False, True])
def test_the_threaded_loop_gives_the_bits_of_one_thread(act, bias):
    g = torch.Generator().manual_seed(5)
    bank = ExpertBank(6, 16, 24, activation=act, bias=bias, impl="loop")
    if bias:
        with torch.no_grad():
            bank.b_in.normal_(generator=g)
            bank.b_out.normal_(generator=g)
    x = torch.randn(300, 16, generator=g)
    idx, w = random_routing(300, 6, 2, g, experts=[0, 1, 3, 4, 5])  # expert 2 gets no token
    results = {}
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            bank.zero_grad()
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = bank.mix(xi, idx, wi)
            (y * torch.linspace(-1, 1, 16)).sum().backward()
            assert torch.get_num_threads() == threads
            results[threads] = [y, xi.grad, wi.grad] + [p.grad for p in bank.parameters()]
    finally:
        torch.set_num_threads(before)
    for a, b in zip(results[1], results[2]):
        assert torch.equal(a, b)
    torch.testing.assert_close(results[2][0], reference(bank, x, idx, w), rtol=1e-5, atol=1e-6)
    assert not bank.w_in.grad[2].any()  # the expert with no rows gets zeros


def test_the_threaded_loop_keeps_inference_mode(two_threads):
    bank = ExpertBank(4, 8, 16, impl="loop")
    x = torch.randn(64, 8)
    idx, w = random_routing(64, 4, 2, torch.Generator().manual_seed(0))
    with torch.inference_mode():
        y = bank.mix(x, idx, w)
    torch.testing.assert_close(y, reference(bank, x, idx, w).detach(), rtol=1e-5, atol=1e-6)


def test_over_experts_gives_the_thread_setting_back_after_an_error(two_threads):
    seen = []

    def fn(i):
        seen.append(torch.get_num_threads())
        if i == 3:
            raise RuntimeError("expert 3 failed")
        return i

    names = over_experts(list(range(4)), [1] * 4, lambda i: (i, threading.current_thread().name), CPU)
    assert [i for i, _ in names] == [0, 1, 2, 3]  # in order, whichever thread ran each
    assert {n for _, n in names[:2]} == {threading.current_thread().name}  # the caller ran the first half
    assert all(n.startswith("moelab-experts") for _, n in names[2:])  # a pool thread the second
    with pytest.raises(RuntimeError, match="expert 3 failed"):
        over_experts(list(range(4)), [1, 1, 1, 1], fn, CPU)
    assert set(seen) == {1}  # every item ran on one torch thread
    assert torch.get_num_threads() == 2
    later = []
    t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert later == [2]  # a thread started afterwards gets the caller's setting


def test_over_experts_runs_in_order_on_one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        names = over_experts([1, 2, 3], [1, 1, 1], lambda i: (i, threading.current_thread().name), CPU)
    finally:
        torch.set_num_threads(before)
    assert [i for i, _ in names] == [1, 2, 3] and {n for _, n in names} == {threading.current_thread().name}


def test_over_experts_keeps_gpu_work_on_the_calling_thread(two_threads):
    # a CUDA stream is per thread: the experts' kernels must be issued where the caller issues its own
    names = over_experts(
        [1, 2, 3, 4], [1] * 4, lambda i: threading.current_thread().name, torch.device("meta")
    )
    assert set(names) == {threading.current_thread().name}


def _threaded_sum_in_child(queue):
    torch.set_num_threads(2)
    queue.put(sum(over_experts(list(range(6)), [1] * 6, lambda i: i, CPU)))


def test_a_forked_child_runs_the_threaded_loop_afresh(two_threads):
    import multiprocessing

    over_experts(list(range(4)), [1] * 4, lambda i: i, CPU)  # the parent's pool threads exist
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_threaded_sum_in_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung on the parent's pool")
    assert child.exitcode == 0 and queue.get(timeout=5) == 15
