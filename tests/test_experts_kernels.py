"""The kernels by name: ``impl="auto"``'s rule, an explicit ``impl`` runs exactly that kernel, and
every kernel gives the outputs and gradients of ``loop``."""

from __future__ import annotations

import pytest
import torch

import moelab
from experts_helpers import ACTS, GROUPED, IMPLS, random_routing, reference
from moelab.experts import KERNELS, ExpertBank
from moelab.experts.kernels import LOOP_ROWS_PER_EXPERT, STREAM_ROWS_PER_EXPERT


@pytest.mark.skipif(not GROUPED, reason="grouped_mm not available in this torch")
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_gradients_equal_loop_gradients(act, bias):
    g = torch.Generator().manual_seed(2)
    loop = ExpertBank(6, 8, 12, activation=act, bias=bias, impl="loop")
    grouped = ExpertBank(6, 8, 12, activation=act, bias=bias, impl="grouped")
    if bias:
        with torch.no_grad():
            loop.b_in.normal_()
            loop.b_out.normal_()
    grouped.load_state_dict(loop.state_dict())
    x = torch.randn(11, 8, generator=g)
    idx, w = random_routing(11, 6, 2, g, experts=[0, 2, 3, 5])
    grads = []
    for bank in (loop, grouped):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        (bank.mix(xi, idx, wi) * torch.linspace(-1, 1, 8)).sum().backward()
        grads.append([xi.grad, wi.grad] + [p.grad for p in bank.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [False, True])
def test_loop_dispatch_passes_gradcheck_in_float64(act, bias):
    bank = ExpertBank(3, 3, 2, activation=act, bias=bias, impl="loop").double()
    names = [name for name, _ in bank.named_parameters()]
    params = [p.detach().clone().normal_().requires_grad_() for p in bank.parameters()]
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[0, 2], [2, 0], [0, 2], [2, 0]])  # expert 1 idle
    w = torch.rand(4, 2, dtype=torch.float64, requires_grad=True)

    def f(x, w, *ps):
        return torch.func.functional_call(bank, dict(zip(names, ps)), (x, moelab.Routing(idx, w)))

    assert torch.autograd.gradcheck(f, (x, w, *params))


def test_grouped_impl_rejects_float64_with_a_clear_message():
    bank = ExpertBank(2, 4, 4, impl="grouped").double()
    idx, w = random_routing(3, 2, 1, torch.Generator().manual_seed(0))
    with pytest.raises(
        ValueError, match=r"impl='grouped' is not available for device=cpu, dtype=torch.float64"
    ):
        bank.mix(torch.randn(3, 4, dtype=torch.float64), idx, w.double())


@pytest.mark.skipif(not GROUPED, reason="grouped_mm not available in this torch")
def test_grouped_impl_rejects_unaligned_sizes_naming_them():
    bank = ExpertBank(2, 6, 10, impl="grouped")
    idx, w = random_routing(3, 2, 1, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"multiples of 4 .*d_model=6, d_hidden=10"):
        bank.mix(torch.randn(3, 6), idx, w)


def test_auto_falls_back_to_loop_where_grouped_cannot_run():
    bank = ExpertBank(3, 6, 10, impl="auto")  # 6 and 10 are not multiples of 4
    x = torch.randn(5, 6)
    assert bank.resolved_impl(x) == "loop"
    assert bank.resolved_impl(x.double()) == "loop"
    idx, w = random_routing(5, 3, 2, torch.Generator().manual_seed(0))
    torch.testing.assert_close(bank.mix(x, idx, w), reference(bank, x, idx, w), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not GROUPED, reason="grouped_mm not available in this torch")
def test_auto_uses_grouped_for_aligned_float32():
    assert ExpertBank(3, 8, 16).resolved_impl(torch.randn(2, 8)) == "grouped"


@pytest.mark.skipif(not GROUPED, reason="grouped_mm cannot run on this torch")
def test_auto_takes_loop_on_cpu_from_enough_slots_per_expert_with_one_thread():
    bank = ExpertBank(4, 8, 16)
    rows = LOOP_ROWS_PER_EXPERT
    assert bank.resolved_impl(torch.randn(rows * 4 // 2 - 1, 8), top_k=2) == "grouped"
    assert bank.resolved_impl(torch.randn(rows * 4 // 2, 8), top_k=2) == "loop"
    assert ExpertBank(4, 8, 16, impl="grouped").resolved_impl(torch.randn(rows * 4, 8)) == "grouped"


@pytest.mark.skipif(not GROUPED, reason="grouped_mm cannot run on this torch")
@pytest.mark.parametrize("policy,want", [("PASSIVE", "loop"), (None, "grouped"), ("active", "grouped")])
def test_auto_rule_takes_the_threaded_loop_only_where_idle_openmp_workers_sleep(monkeypatch, policy, want):
    # docs/performance.md: with 2 threads the threaded loop is ahead under OMP_WAIT_POLICY=PASSIVE;
    # with spinning workers the ranking differs between hosts (there auto measures by default)
    from moelab.experts import kernels

    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    bank = ExpertBank(4, 8, 16)
    threads = torch.get_num_threads()
    kernels.set_autotune("never")
    try:
        torch.set_num_threads(2)
        for tokens in (3, 64, 4096):
            assert bank.resolved_impl(torch.randn(tokens, 8), top_k=2) == want
            # inference with spinning workers streams (each expert's rows in turn)
            infer = "loop" if want == "loop" else "stream"
            assert bank.resolved_impl(torch.randn(tokens, 8), top_k=2, grad=False) == infer
        assert bank.resolved_impl(torch.randn(2, 8), top_k=2, grad=False) == "stream"  # T·K ≤ N
        torch.set_num_threads(1)  # one thread: no barrier to wait at, the policy does not matter
        rows = LOOP_ROWS_PER_EXPERT
        assert bank.resolved_impl(torch.randn(rows * 4 // 2, 8), top_k=2) == "loop"
    finally:
        torch.set_num_threads(threads)
        kernels.set_autotune("unsure")


def _fake_kernels(monkeypatch, cost, now, calls, off=()):
    """Kernels that advance the fake clock ``now`` by ``cost[name]`` and return ``x`` (those in
    ``off``: ``x`` a little changed)."""
    from moelab.experts import kernels

    def fake(name):
        def kernel(x, indices, weights, experts):
            calls.append(name)
            now[0] += cost[name]
            return x * (1.0 + 1e-6) if name in off else x * 1.0

        return kernel

    monkeypatch.setattr(kernels, "KERNELS", {name: fake(name) for name in cost})


@pytest.mark.skipif(not GROUPED, reason="grouped_mm cannot run on this torch")
@pytest.mark.parametrize("policy,threads,measures", [
    (None, 2, True), ("active", 4, True), ("PASSIVE", 2, False), (None, 1, False), ("active", 1, False),
])  # fmt: skip
def test_auto_measures_by_default_only_with_several_threads_whose_idle_workers_spin(
    monkeypatch, policy, threads, measures
):
    from moelab.experts import kernels

    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    now, calls = [0.0], []
    _fake_kernels(monkeypatch, {"loop": 1.0, "grouped": 5.0, "stream": 3.0}, now, calls)
    kernels.set_autotune("unsure", clock=lambda: now[0])
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        bank = ExpertBank(4, 8, 16)
        pick = bank.resolved_impl(torch.randn(64, 8), top_k=2)
        if measures:  # the loop is fastest on this clock; the rule would say grouped
            assert pick == "loop" and calls.count("loop") == calls.count("grouped") == 1 + 5
        else:
            assert calls == [] and pick == kernels._rule(
                torch.randn(64, 8), 2, bank.expert_weights, True, False
            )
    finally:
        torch.set_num_threads(saved)
        kernels.set_autotune("unsure")


def test_auto_never_measures_off_the_cpu_by_default_nor_while_compiling(monkeypatch):
    from moelab.experts import kernels

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(kernels, "_measure", lambda *a: pytest.fail("measured"))
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        x = torch.empty(64, 8, device="meta")  # another device: the rule
        bank = ExpertBank(4, 8, 16).to("meta")
        assert bank.resolved_impl(x, top_k=2) == kernels._rule(x, 2, bank.expert_weights, True, False)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        cpu = ExpertBank(4, 8, 16)
        want = "grouped" if GROUPED else "loop"  # never the threaded loop, never a measurement
        assert cpu.resolved_impl(torch.randn(64, 8), top_k=2) == want
    finally:
        torch.set_num_threads(saved)


def test_the_autotune_setting_is_read_from_the_environment_and_refuses_other_words(monkeypatch):
    from moelab.experts import kernels

    for value, want in [("", "unsure"), ("never", "never"), (" Always ", "always"), ("unsure", "unsure")]:
        monkeypatch.setenv("MOELAB_AUTOTUNE", value)
        assert kernels._autotune_from_env() == want
    monkeypatch.setenv("MOELAB_AUTOTUNE", "1")
    with pytest.raises(
        ValueError, match=r"MOELAB_AUTOTUNE='1' is not allowed; expected one of never, unsure, always"
    ):
        kernels._autotune_from_env()
    with pytest.raises(ValueError, match=r"when=True is not allowed; expected one of never, unsure, always"):
        kernels.set_autotune(True)


def test_the_wait_policy_is_read_from_the_environment(monkeypatch):
    from moelab.experts.kernels import omp_wait_policy

    for value, want in [("PASSIVE", "passive"), (" active ", "active"), ("", "default"), ("spin", "default")]:
        monkeypatch.setenv("OMP_WAIT_POLICY", value)
        assert omp_wait_policy() == want
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert omp_wait_policy() == "default"


@pytest.mark.skipif(not GROUPED, reason="grouped_mm cannot run on this torch")
def test_autotune_measures_each_shape_class_once_and_keeps_the_fastest(monkeypatch):
    from moelab.experts import kernels

    now, calls = [0.0], []
    cost = {"loop": 5.0, "grouped": 2.0, "stream": 3.0}
    _fake_kernels(monkeypatch, cost, now, calls)
    kernels.set_autotune("always", clock=lambda: now[0], repeats=3)
    try:
        bank = ExpertBank(4, 8, 16)
        x = torch.randn(64, 8)
        assert bank.resolved_impl(x, top_k=2) == "grouped"
        assert calls.count("loop") == calls.count("grouped") == 4 and "stream" not in calls  # training
        calls.clear()
        assert bank.resolved_impl(torch.randn(60, 8), top_k=2) == "grouped"  # the same class: 64 tokens
        assert calls == []
        cost["grouped"] = 9.0
        assert bank.resolved_impl(x, top_k=2, grad=False) == "stream"  # inference: another class
        assert calls.count("stream") == 4
        assert bank.resolved_impl(torch.randn(300, 8), top_k=2) == "loop"  # 512 tokens: measured anew
    finally:
        kernels.set_autotune("unsure")
    assert kernels._TUNED == {}
    with pytest.raises(ValueError, match="repeats=0 is not allowed; expected a positive integer"):
        kernels.set_autotune("always", repeats=0)


def test_autotune_measures_anew_under_autocast():
    from moelab.experts import kernels

    bank, x = ExpertBank(4, 8, 16), torch.randn(16, 8)
    plain = kernels.shape_class(x, 2, bank.expert_weights, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = kernels.shape_class(x, 2, bank.expert_weights, True)
    assert plain != under and torch.bfloat16 in under and None in plain


@pytest.mark.skipif(not GROUPED, reason="grouped_mm cannot run on this torch")
def test_autotune_never_picks_a_kernel_whose_numbers_differ_from_the_loop(monkeypatch):
    from moelab.experts import kernels

    now, calls = [0.0], []
    _fake_kernels(monkeypatch, {"loop": 5.0, "grouped": 2.0, "stream": 1.0}, now, calls, off=("stream",))
    kernels.set_autotune("always", clock=lambda: now[0], repeats=3)
    try:
        bank = ExpertBank(4, 8, 16)
        # inference: stream is fastest but its output differs in the last bits; grouped is next
        assert bank.resolved_impl(torch.randn(64, 8), top_k=2, grad=False) == "grouped"
        assert calls.count("stream") == 1  # checked once, then never timed
    finally:
        kernels.set_autotune("unsure")


@pytest.mark.skipif(not GROUPED, reason="grouped_mm cannot run on this torch")
def test_auto_inference_streams_when_decoding_and_from_enough_slots_per_expert():
    bank = ExpertBank(4, 8, 16)
    rows = STREAM_ROWS_PER_EXPERT
    assert bank.resolved_impl(torch.randn(2, 8), top_k=2, grad=False) == "stream"  # T·K ≤ N
    assert bank.resolved_impl(torch.randn(3, 8), top_k=2, grad=False) == "grouped"
    assert bank.resolved_impl(torch.randn(rows * 2 - 1, 8), top_k=2, grad=False) == "grouped"
    assert bank.resolved_impl(torch.randn(rows * 2, 8), top_k=2, grad=False) == "stream"
    assert bank.resolved_impl(torch.randn(3, 8).double(), top_k=2, grad=False) == "stream"
    threads = torch.get_num_threads()
    try:  # with several threads, only decoding streams
        torch.set_num_threads(2)
        assert bank.resolved_impl(torch.randn(rows * 2, 8), top_k=2, grad=False) in ("loop", "stream")
        assert bank.resolved_impl(torch.randn(2, 8), top_k=2, grad=False) == "stream"
    finally:
        torch.set_num_threads(threads)


FEW = [(1, 4, 2, 8, 4), (1, 3, 3, 4, 8), (3, 8, 2, 8, 8), (8, 8, 1, 4, 12)]  # T·K ≤ N


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", FEW)
def test_few_token_inference_equals_weighted_sum_without_sorting(monkeypatch, act, bias, case):
    t, n, k, d, h = case
    g = torch.Generator().manual_seed(t + n + k)
    bank = ExpertBank(n, d, h, activation=act, bias=bias)
    with torch.no_grad():
        for p in bank.parameters():
            p.normal_(generator=g)
    x = torch.randn(t, d, generator=g)
    idx, w = random_routing(t, n, k, g)
    with torch.no_grad():
        expected = reference(bank, x, idx, w)

    def no_sort(*args):
        raise AssertionError("the few-token path must not sort the slots")

    monkeypatch.setattr("moelab.experts.kernels.sort_slots", no_sort)
    monkeypatch.setattr("moelab.experts.dispatch.sort_slots", no_sort)
    with torch.inference_mode():
        y = bank.mix(x, idx, w)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_auto_streams_in_cpu_inference_only(monkeypatch):
    bank = ExpertBank(8, 8, 8, activation="swiglu").double()  # float64: grouped_mm cannot run
    g = torch.Generator().manual_seed(0)
    idx, w = random_routing(5, 8, 2, g)  # T·K = 10 > N = 8: sorted by sort_slots
    x = torch.randn(5, 8, dtype=torch.float64)
    w = w.double()
    assert bank.resolved_impl(x, 2, grad=True) == "loop"
    assert bank.resolved_impl(x, 2, grad=False) == "stream"
    with torch.no_grad():
        expected = reference(bank, x, idx, w)
        torch.testing.assert_close(bank.mix(x, idx, w), expected)
    monkeypatch.setitem(KERNELS, "stream", lambda *a: pytest.fail("stream kernel taken with autograd"))
    y = bank.mix(x, idx, w)  # parameters require grad: the autograd path
    assert y.grad_fn is not None


def _spy(monkeypatch):
    """Replace every kernel of the registry by one that records its name and runs the original."""
    calls = []
    for name, fn in list(KERNELS.items()):
        monkeypatch.setitem(KERNELS, name, lambda *a, name=name, fn=fn: calls.append(name) or fn(*a))
    return calls


def test_explicit_loop_runs_the_loop_kernel_where_auto_would_stream(monkeypatch):
    x = torch.randn(2, 8)
    idx, w = random_routing(2, 8, 2, torch.Generator().manual_seed(1))  # T·K ≤ N: decoding
    auto = ExpertBank(8, 8, 8, activation="swiglu")
    assert auto.resolved_impl(x, 2, grad=False) == "stream"
    bank = ExpertBank(8, 8, 8, activation="swiglu", impl="loop")
    bank.load_state_dict(auto.state_dict())
    assert bank.resolved_impl(x, 2, grad=False) == bank.resolved_impl(x, 2, grad=True) == "loop"
    calls = _spy(monkeypatch)
    with torch.inference_mode():
        y = bank.mix(x, idx, w)
    assert calls == ["loop"]
    torch.testing.assert_close(y, reference(bank, x, idx, w).detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "auto"])
@pytest.mark.parametrize("grad", [False, True])
def test_an_explicit_impl_runs_exactly_its_kernel(monkeypatch, impl, grad):
    bank = ExpertBank(4, 8, 8, impl=impl)
    calls = _spy(monkeypatch)
    for t in (1, 3, 600):  # decoding, a few tokens, many slots per expert
        idx, w = random_routing(t, 4, 2, torch.Generator().manual_seed(t))
        with torch.set_grad_enabled(grad):
            bank.mix(torch.randn(t, 8), idx, w)
    assert calls == [impl] * 3


@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "auto"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [False, True])
def test_every_kernel_gives_the_outputs_and_gradients_of_loop(impl, act, bias):
    g = torch.Generator().manual_seed(7)
    loop = ExpertBank(6, 8, 12, activation=act, bias=bias, impl="loop")
    with torch.no_grad():
        for p in loop.parameters():
            p.normal_(generator=g)
    bank = ExpertBank(6, 8, 12, activation=act, bias=bias, impl=impl)
    bank.load_state_dict(loop.state_dict())
    for t, k in ((2, 3), (13, 2)):  # T·K ≤ N (host-sorted stream) and T·K > N
        x = torch.randn(t, 8, generator=g)
        idx, w = random_routing(t, 6, k, g, experts=[0, 2, 3, 5])  # experts 1 and 4 idle
        runs = []
        for b in (loop, bank):
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = b.mix(xi, idx, wi)
            grads = torch.autograd.grad((y * torch.linspace(-1, 1, 8)).sum(), [xi, wi, *b.parameters()])
            with torch.inference_mode():
                plain = b.mix(x, idx, w)
            runs.append([y.detach(), plain, *grads])
        for a, c in zip(*runs):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


def test_stream_rejects_devices_other_than_the_cpu_naming_impl():
    bank = ExpertBank(4, 8, 8, impl="stream")
    x = torch.randn(3, 8, device="meta")
    idx = torch.zeros(3, 1, dtype=torch.long, device="meta")
    with pytest.raises(
        ValueError, match=r"impl='stream' is not available for device=meta: it runs on the CPU only"
    ):
        bank.mix(x, idx, torch.ones(3, 1, device="meta"))


def test_few_token_path_repeats_bitwise():
    bank = ExpertBank(16, 8, 8, activation="swiglu")
    idx, w = random_routing(4, 16, 3, torch.Generator().manual_seed(3))
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert torch.equal(bank.mix(x, idx, w), bank.mix(x, idx, w))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bias", [False, True])
def test_inference_dispatch_without_autograd_equals_the_autograd_path(impl, bias):
    g = torch.Generator().manual_seed(5)
    bank = ExpertBank(4, 8, 8, activation="swiglu", bias=bias, impl=impl)
    with torch.no_grad():
        for p in bank.parameters():
            p.normal_(generator=g)
    x = torch.randn(9, 8, generator=g)  # T·K = 18 > N: the sorted dispatch, not the few-token path
    idx, w = random_routing(9, 4, 2, g)
    tracked = bank.mix(x, idx, w)
    assert tracked.grad_fn is not None
    with torch.inference_mode():
        plain = bank.mix(x, idx, w)
    assert plain.grad_fn is None
    torch.testing.assert_close(plain, tracked.detach(), rtol=0, atol=0)


def test_choose_kernel_needs_only_the_weight_tensors():
    """``impl="auto"``'s rule reads the tokens and the experts' weight tensors, no bank."""
    from moelab.experts import ExpertWeights, choose_kernel

    bank = ExpertBank(4, 8, 16, activation="swiglu")
    weights = ExpertWeights(torch.zeros(4, 32, 8), torch.zeros(4, 8, 16), None, None, "swiglu")
    for tokens, grad in ((2, False), (3, True), (600, True), (600, False)):
        x = torch.randn(tokens, 8)
        assert choose_kernel(x, 2, weights, grad) == bank.resolved_impl(x, 2, grad)
    unaligned = ExpertWeights(torch.zeros(4, 10, 6), torch.zeros(4, 6, 10), None, None, "relu")
    assert choose_kernel(torch.randn(3, 6), 2, unaligned, True) == "loop"


def test_a_kernel_registered_as_one_entry_runs_by_its_name(monkeypatch):
    calls = []

    def mine(x, indices, weights, experts):
        calls.append(experts)
        return KERNELS["loop"](x, indices, weights, experts)

    monkeypatch.setitem(KERNELS, "mine", mine)
    bank = ExpertBank(4, 8, 8, impl="mine")
    idx, w = random_routing(5, 4, 2, torch.Generator().manual_seed(0))
    x = torch.randn(5, 8)
    y = bank.mix(x, idx, w)
    (experts,) = calls
    assert experts.w_in is bank.w_in and experts.w_out is bank.w_out and experts.activation == "relu"
    torch.testing.assert_close(y, reference(bank, x, idx, w), rtol=1e-5, atol=1e-6)


def test_autotune_with_the_real_kernels_picks_one_that_gives_the_loops_numbers():
    from moelab.experts import kernels

    kernels.set_autotune("always", repeats=1)
    try:
        bank = ExpertBank(4, 8, 16, activation="swiglu")
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 8, generator=g)
        idx, w = random_routing(32, 4, 2, g)
        for grad in (True, False):
            pick = bank.resolved_impl(x, top_k=2, grad=grad)
            assert pick in kernels.candidates(x, bank.expert_weights, grad)
            with torch.set_grad_enabled(grad):
                picked = KERNELS[pick](x, idx, w, bank.expert_weights)
                looped = KERNELS["loop"](x, idx, w, bank.expert_weights)
            assert torch.equal(picked, looped)
    finally:
        kernels.set_autotune("unsure")


@pytest.mark.skipif(not GROUPED, reason="grouped_mm cannot run on this torch")
def test_a_measurement_inside_an_activation_checkpoint_leaves_its_recomputation_intact():
    from torch.utils.checkpoint import checkpoint

    from moelab.experts import kernels

    kernels.set_autotune("always", repeats=1)
    try:
        bank = ExpertBank(4, 8, 16, activation="swiglu")
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 8, generator=g, requires_grad=True)
        idx, w = random_routing(32, 4, 2, g)
        y = checkpoint(bank.mix, x, idx, w, use_reentrant=False)  # measures inside the checkpoint
        y.square().sum().backward()
        kernels.set_autotune("never")
        x2 = x.detach().requires_grad_()
        bank.mix(x2, idx, w).square().sum().backward()
        assert torch.equal(x.grad, x2.grad)
    finally:
        kernels.set_autotune("unsure")
