"""The kernels by name: ``impl="auto"``'s rule, an explicit ``impl`` runs exactly that kernel, and
every kernel gives the outputs and gradients of ``loop``."""

from __future__ import annotations

import sys
import time

import pytest
import torch

import moelab
from experts_helpers import ACTS, GROUPED, IMPLS, random_routing, reference
from moelab.experts import KERNELS, ExpertBank, autotune, forget_tuned, kernels
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
    # with spinning workers the ranking differs between hosts (there autotune may measure)
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    bank = ExpertBank(4, 8, 16)
    torch.set_num_threads(2)  # the autouse fixture of conftest.py gives one thread back
    for tokens in (3, 64, 4096):
        assert bank.resolved_impl(torch.randn(tokens, 8), top_k=2) == want
        # inference with spinning workers streams (each expert's rows in turn)
        infer = "loop" if want == "loop" else "stream"
        assert bank.resolved_impl(torch.randn(tokens, 8), top_k=2, grad=False) == infer
    assert bank.resolved_impl(torch.randn(2, 8), top_k=2, grad=False) == "stream"  # T·K ≤ N
    torch.set_num_threads(1)  # one thread: no barrier to wait at, the policy does not matter
    rows = LOOP_ROWS_PER_EXPERT
    assert bank.resolved_impl(torch.randn(rows * 4 // 2, 8), top_k=2) == "loop"


def _fake_kernels(monkeypatch, cost, now, calls, off=(), off_grad=()):
    """Kernels that record their name, advance the fake clock ``now`` by ``cost[name]`` and return
    ``x`` (those in ``off``: ``x`` a little changed; in ``off_grad``: ``x`` with a gradient a
    little changed)."""

    def fake(name):
        def kernel(x, indices, weights, experts):
            calls.append(name)
            now[0] += cost[name]
            if name in off:
                return x * (1.0 + 1e-6)
            if name in off_grad:  # the same values, another gradient
                return x * 1.0 + (x - x.detach()) * 1e-6
            return x * 1.0

        return kernel

    for name in cost:
        monkeypatch.setitem(KERNELS, name, fake(name))


def _timed_kernels(monkeypatch, cost, now, calls):
    """The real kernels, each recording its name and advancing the fake clock ``now`` by ``cost[name]``."""
    for name, fn in list(KERNELS.items()):

        def kernel(*args, name=name, fn=fn):
            calls.append(name)
            now[0] += cost.get(name, 0.0)
            return fn(*args)

        monkeypatch.setitem(KERNELS, name, kernel)


_CLOCKS = ("perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns",
           "process_time", "process_time_ns", "thread_time", "thread_time_ns")  # fmt: skip


def _forwards(banks, layer, inputs, grad, g, calls, ran):
    """The plain forwards (and backwards) of the clock test; ``ran``: (the rule's kernel, the one run)."""
    for tokens, idx, w in inputs:
        for bank in banks:
            x = torch.randn(tokens, bank.d_model, generator=g)
            with torch.set_grad_enabled(grad):
                y = bank.mix(x, idx, w)
                if grad:
                    y.square().sum().backward()
            ran.append((bank.resolved_impl(x, 2, grad), calls.pop()))
        x = torch.randn(1, tokens, 8, generator=g)
        if grad:
            layer(x).square().sum().backward()
        else:
            with torch.inference_mode():
                layer(x)
        ran.append((layer.experts.resolved_impl(x[0], 2, grad), calls.pop()))


@pytest.mark.parametrize("grad", [True, False])
def test_no_plain_forward_reads_a_clock_or_measures(monkeypatch, grad):
    """Several torch threads and OMP_WAIT_POLICY unset: the case where auto used to measure inside
    the first forward of each shape class.  Every clock of ``time`` raises, and so does a
    measurement: an ExpertBank(impl="auto") and a moelab.MoE, in training (forward and backward)
    and in inference, follow the rule.  MOELAB_AUTOTUNE, removed, changes nothing."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("MOELAB_AUTOTUNE", "always")
    torch.set_num_threads(2)  # the autouse fixture of conftest.py gives one thread back
    g = torch.Generator().manual_seed(0)
    banks = [ExpertBank(4, 8, 16, activation="swiglu"), ExpertBank(4, 6, 10)]  # the second: the threaded loop
    layer = moelab.MoE(d_model=8, num_experts=4, top_k=2, d_hidden=16)
    inputs = []
    for tokens in (2, 64, 600):  # decoding, a few tokens, many slots per expert
        idx, w = random_routing(tokens, 4, 2, g)
        inputs.append((tokens, idx, w))
    calls = _spy(monkeypatch)

    def clock(*args):
        raise AssertionError("a plain forward read a clock")

    def measured(*args, **kwargs):
        raise AssertionError("a plain forward measured the kernels")

    # a clock bound before the patch (``from time import perf_counter``), on this thread; the lock
    # timeouts of the standard library's threading (the expert threads' pool) time nothing
    read = []

    def profile(frame, event, arg):
        if event == "c_call" and getattr(arg, "__module__", None) == "time" and arg.__name__ in _CLOCKS:
            if frame.f_globals.get("__name__") != "threading":
                read.append((arg.__name__, frame.f_code.co_filename, frame.f_lineno))

    ran = []
    with monkeypatch.context() as m:
        for name in _CLOCKS:
            if hasattr(time, name):
                m.setattr(time, name, clock)
        m.setattr(kernels, "measure", measured)
        sys.setprofile(profile)
        try:
            _forwards(banks, layer, inputs, grad, g, calls, ran)
        finally:
            sys.setprofile(None)
    assert read == []
    assert [want for want, _ in ran] == [got for _, got in ran]  # each ran the rule's kernel
    for want, _ in ran:
        assert want in (("grouped", "loop") if grad else ("stream", "loop"))
    assert all(b.tuned == {} for b in (*banks, layer.experts))


def test_autotune_measures_each_shape_class_and_the_forward_runs_its_pick(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    now, calls = [0.0], []
    _timed_kernels(monkeypatch, {"loop": 1.0, "grouped": 5.0, "stream": 3.0}, now, calls)
    layer = moelab.MoE(d_model=8, num_experts=4, top_k=2, d_hidden=16)
    x = torch.randn(4, 128, 8)  # 512 tokens: 256 slots per expert, from where inference streams
    flat = x.reshape(-1, 8)
    train_rule = layer.experts.resolved_impl(flat, 2, grad=True)
    assert layer.experts.resolved_impl(flat, 2, grad=False) == "stream"
    report = autotune(layer, x, training=False, clock=lambda: now[0], repeats=3)
    (tuned,) = report.classes
    # the loop rounds as the stream (one thread, inference): the clock may choose it
    assert tuned.pick == "loop" and tuned.rule == "stream" and tuned.calls == 1
    assert not tuned.shape_class.grad and tuned.shape_class.tokens == 512 and tuned.shape_class.top_k == 2
    assert tuned.other_rounding == (("grouped",) if GROUPED else ())
    assert tuned.medians_ms["loop"] == 1e3 and set(tuned.medians_ms) == {
        "loop",
        "stream",
        *tuned.other_rounding,
    }
    assert layer.experts.tuned == report.picks == {tuned.shape_class: "loop"}
    other = moelab.MoE(d_model=8, num_experts=4, top_k=2, d_hidden=16)  # another model keeps its rule
    assert other.experts.tuned == {} and other.experts.resolved_impl(flat, 2, grad=False) == "stream"
    assert "loop" in str(report) and report.summary().startswith("autotune measured 1 shape class: infer")
    calls.clear()
    with torch.no_grad():  # the class measured: its pick
        layer(x)
        layer(torch.randn(500, 8))  # 500 tokens: the same class (512)
    assert calls == ["loop", "loop"]
    calls.clear()
    layer(x).sum().backward()  # training: another class, not measured: the rule
    with torch.no_grad():
        layer(torch.randn(64, 8))  # 64 tokens: another class
    assert calls == [train_rule, layer.experts.resolved_impl(torch.randn(64, 8), 2, grad=False)]
    # training: the loop and grouped_mm round otherwise: whichever the clock favours, the rule's is kept
    report = autotune(layer, x, training=True, clock=lambda: now[0], repeats=3)
    assert report.classes[0].pick == train_rule and report.classes[0].shape_class.grad
    assert set(report.classes[0].other_rounding) == ({"loop", "grouped"} - {train_rule} if GROUPED else set())
    assert len(layer.experts.tuned) == 2
    forget_tuned(layer)
    calls.clear()
    with torch.no_grad():
        layer(x)
    assert calls == ["stream"]


def test_autotune_leaves_the_global_rng_and_the_model_as_they_were():
    torch.manual_seed(3)
    layer = moelab.MoE(d_model=8, num_experts=4, top_k=2, d_hidden=16, method="xmoe")
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(32, 8)
    before = torch.get_rng_state()
    autotune(layer, lambda m: m(x + torch.randn(32, 8)), repeats=1)  # the example draws from the RNG
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in state.items())
    assert all(p.grad is None for p in layer.parameters())


class _Unused(torch.nn.Module):
    """A model holding an expert bank that its forward does not call."""

    def __init__(self):
        super().__init__()
        self.bank, self.proj = ExpertBank(4, 8, 16), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x)


def test_autotune_refuses_while_compiling_off_the_cpu_and_without_an_auto_bank(monkeypatch):
    bank = ExpertBank(4, 8, 16)
    idx, w = random_routing(64, 4, 2, torch.Generator().manual_seed(0))
    example = (torch.randn(64, 8), idx, w)
    with pytest.raises(
        ValueError, match=r"an ExpertBank on device=meta is not allowed; autotune measures on the CPU only"
    ):
        autotune(ExpertBank(4, 8, 16).to("meta"), example)
    with pytest.raises(ValueError, match=r"holds no ExpertBank with impl='auto'"):
        autotune(ExpertBank(4, 8, 16, impl="loop"), example)
    with pytest.raises(ValueError, match=r"model of type Linear is not allowed: it holds no ExpertBank"):
        autotune(torch.nn.Linear(8, 8), torch.randn(2, 8))
    with pytest.raises(ValueError, match=r"model of type str is not allowed; expected a torch.nn.Module"):
        autotune("model", example)
    with pytest.raises(ValueError, match=r"model is a torch.compile'd module, which is not allowed"):
        autotune(torch.compile(moelab.MoE(d_model=8, num_experts=4, top_k=2, d_hidden=16)), torch.randn(4, 8))
    from moelab.experts.parallel import parallel_class

    spread = ExpertBank(4, 8, 16)
    spread.__class__ = parallel_class(ExpertBank)  # as the ExpertParallel style makes it
    with pytest.raises(
        ValueError, match=r"an expert-parallel ExpertBank is not allowed: autotune measures in one"
    ):
        autotune(spread, example)
    with pytest.raises(ValueError, match=r"repeats=0 is not allowed; expected a positive integer"):
        autotune(bank, example, repeats=0)
    with pytest.raises(
        ValueError, match=r"example_input is not allowed: running _Unused on it called no ExpertBank"
    ):
        autotune(_Unused(), torch.randn(2, 8))
    assert bank.tuned == {}
    # a pick is looked up, never while torch.compile traces: then the rule (never the threaded loop)
    bank.tuned[kernels.shape_class(example[0], 2, bank.expert_weights, True)] = "stream"
    assert bank.resolved_impl(example[0], top_k=2) == "stream"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert bank.resolved_impl(example[0], top_k=2) == ("grouped" if GROUPED else "loop")
    with pytest.raises(ValueError, match=r"autotune is not allowed while torch.compile traces"):
        autotune(bank, example)


def test_off_the_cpu_the_forward_follows_the_rule():
    x = torch.empty(64, 8, device="meta")
    bank = ExpertBank(4, 8, 16).to("meta")
    assert bank.resolved_impl(x, top_k=2) == kernels.rule_kernel(x, 2, bank.expert_weights, True)


def test_check_picks_refuses_what_is_not_a_shape_class_or_a_kernel():
    bank = ExpertBank(4, 8, 16)
    key = kernels.shape_class(torch.randn(4, 8), 2, bank.expert_weights, True)
    with pytest.raises(ValueError, match=r"kernel 'fast' is not allowed; expected one of"):
        kernels.check_picks({key: "fast"})
    with pytest.raises(ValueError, match=r"shape class \('cpu',\) is not allowed; expected a ShapeClass"):
        kernels.check_picks({("cpu",): "loop"})
    assert kernels.check_picks({key: "loop"}) == {key: "loop"}


def test_the_wait_policy_is_read_from_the_environment(monkeypatch):
    from moelab.experts.kernels import omp_wait_policy

    for value, want in [("PASSIVE", "passive"), (" active ", "active"), ("", "default"), ("spin", "default")]:
        monkeypatch.setenv("OMP_WAIT_POLICY", value)
        assert omp_wait_policy() == want
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert omp_wait_policy() == "default"


def test_the_shape_class_differs_under_autocast():
    bank, x = ExpertBank(4, 8, 16), torch.randn(16, 8)
    plain = kernels.shape_class(x, 2, bank.expert_weights, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = kernels.shape_class(x, 2, bank.expert_weights, True)
    assert plain != under and under.autocast == torch.bfloat16 and plain.autocast is None
    assert "autocast bfloat16" in under.describe() and "autocast" not in plain.describe()


@pytest.mark.skipif(not GROUPED, reason="grouped_mm cannot run on this torch")
def test_autotune_never_picks_a_kernel_whose_numbers_differ_from_the_rules_on_a_probe(monkeypatch):
    now, calls = [0.0], []
    cost = {"loop": 1.0, "grouped": 0.5, "stream": 5.0}
    _fake_kernels(monkeypatch, cost, now, calls, off=("loop",))
    bank = ExpertBank(4, 8, 16)
    idx, w = random_routing(2, 4, 2, torch.Generator().manual_seed(0))
    x = torch.randn(2, 8)  # decoding-sized inference: the rule streams
    report = autotune(bank, (x, moelab.Routing(idx, w)), training=False, clock=lambda: now[0], repeats=3)
    (tuned,) = report.classes
    # the loop rounds as the stream by construction, yet differs on a probe here: excluded; grouped_mm
    # rounds otherwise: timed for the report, never picked, although the fastest
    assert tuned.rule == "stream" and tuned.pick == "stream" and tuned.excluded == ("loop",)
    assert tuned.other_rounding == (("grouped",) if GROUPED else ())
    assert set(tuned.medians_ms) == {"stream", *tuned.other_rounding}
    assert calls.count("loop") == 1  # checked once, then never timed
    assert "excluded (numbers differ from stream's): loop" in str(report)
    if GROUPED:
        assert "not picked, they round otherwise than stream (fix one with impl=): grouped" in str(report)
    assert bank.resolved_impl(x, top_k=2, grad=False) == "stream"
    probe = kernels.random_probe(x, 2, bank.expert_weights)
    with pytest.raises(
        ValueError, match=r"reference='triton' is not allowed; expected one of the candidates \["
    ):
        kernels.measure([probe], False, reference="triton")


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


@pytest.mark.parametrize("grad", [True, False])
def test_autotune_with_the_real_kernels_picks_one_that_gives_the_loops_numbers(grad):
    bank = ExpertBank(4, 8, 16, activation="swiglu")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g)
    idx, w = random_routing(32, 4, 2, g)
    (tuned,) = autotune(bank, (x, moelab.Routing(idx, w)), training=grad, repeats=1).classes
    assert tuned.pick in kernels.candidates(x, bank.expert_weights, grad)
    assert tuned.pick == bank.resolved_impl(x, top_k=2, grad=grad)
    with torch.set_grad_enabled(grad):
        picked = KERNELS[tuned.pick](x, idx, w, bank.expert_weights)
        looped = KERNELS["loop"](x, idx, w, bank.expert_weights)
    assert torch.equal(picked, looped)


def test_autotune_never_reaches_an_enclosing_saved_tensor_hook():
    def pack(t):
        raise AssertionError("autotune's autograd graph reached an enclosing saved-tensor hook")

    layer = moelab.MoE(d_model=8, num_experts=4, top_k=2, d_hidden=16, activation="swiglu")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        report = autotune(layer, lambda m: m(torch.randn(32, 8)), training=True, repeats=1)
    assert report.classes[0].shape_class.grad


@pytest.mark.skipif(not GROUPED, reason="grouped_mm cannot run on this torch")
def test_a_compiled_forward_neither_reads_nor_guards_on_autotunes_picks():
    import torch._dynamo.testing

    torch._dynamo.reset()
    try:
        layer = moelab.MoE(32, 8, 2, 64, activation="swiglu")
        x = torch.randn(64, 32)
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(layer, backend=counter, fullgraph=True)
        compiled(x).sum().backward()
        autotune(layer, x, repeats=1)
        key = kernels.shape_class(x, 2, layer.experts.expert_weights, True)
        layer.experts.tuned[key] = "loop"  # read in the graph, it would guard on the picks
        assert layer.experts.resolved_impl(x, 2) == "loop"  # eagerly, the pick
        compiled(x).sum().backward()  # compiled: the rule's grouped, the same graph
        assert counter.frame_count == 1
    finally:
        torch._dynamo.reset()


# ------------------------------------------------------------------ autocast
#: the modes a layer runs in: training, evaluation with autograd (a Trainer's eval under grad), and inference
MODES = ["train", "eval with grad", "no_grad"]


def _runs_here(impl: str, dtype: torch.dtype) -> str | None:
    """Why ``impl`` cannot run on the CPU in ``dtype`` here, or ``None``."""
    if impl == "grouped" and not GROUPED:
        return "grouped_mm not available in this torch"
    if impl == "triton":
        from moelab.experts import triton_kernels

        return triton_kernels.unavailable_reason(torch.device("cpu"), dtype)
    return None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", kernels.IMPLS)
@pytest.mark.parametrize("tokens", [2, 64, 640])  # decoding (T·K ≤ N), a batch, ≥ 256 slots per expert
def test_every_kernel_runs_under_cpu_autocast_in_every_mode_to_the_dtypes_rounding(tokens, impl, mode, dtype):
    """bf16 / fp16 inference once crashed in ``loop`` and ``stream`` (an ``out=`` float32 buffer for
    an autocast bf16 matmul; ``index_add_`` of bf16 rows into float32).  Every kernel, in training,
    in evaluation with and without autograd: the output in the input's dtype, equal to the experts
    one token at a time by ``nn.functional.linear`` under the same autocast to the dtype's rounding
    (``eps`` of the largest output), and bit for bit the kernel on the tokens and experts cast to the
    autocast dtype (forward and, with autograd, every gradient)."""
    reason = _runs_here(impl, dtype)
    if reason:
        pytest.skip(reason)
    torch.manual_seed(0)
    layer = moelab.MoE(32, 4, 2, 64, activation="swiglu", impl=impl)
    layer.train(mode == "train")
    x = torch.randn(tokens, 32, requires_grad=mode != "no_grad")
    with moelab.recording_routing(layer), torch.autocast("cpu", dtype=dtype):
        with torch.set_grad_enabled(mode != "no_grad"):
            y = layer(x)
            kernel = layer.experts.resolved_impl(x, 2, mode != "no_grad")
        with torch.no_grad():
            want = reference(
                layer.experts, x.detach(), layer.last_routing.indices, layer.last_routing.weights
            )
    assert y.dtype == torch.float32
    assert (y.detach() - want).abs().max() <= torch.finfo(dtype).eps * want.abs().max()
    # the same kernel on the tokens and the experts cast to the autocast dtype, outside autocast
    idx, w = layer.last_routing.indices, layer.last_routing.weights
    bank = layer.experts
    xa = x.detach().clone().requires_grad_(mode != "no_grad")
    xb = x.detach().clone().requires_grad_(mode != "no_grad")
    g = torch.randn(tokens, 32)
    results = []
    for inp, autocast in ((xa, True), (xb, False)):
        bank.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=autocast), torch.set_grad_enabled(mode != "no_grad"):
            out = (
                bank.mix(inp, idx, w)
                if autocast
                else KERNELS[kernel](inp.to(dtype), idx, w, bank.expert_weights.to(dtype)).float()
            )
        if mode != "no_grad":
            out.backward(g)
            results.append([out.detach(), inp.grad] + [p.grad for p in bank.parameters()])
        else:
            results.append([out])
    for a, b in zip(*results, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_under_cpu_autocast_the_experts_compute_in_its_dtype_like_every_linear():
    """CPU autocast once left the experts in float32 (the output bit-identical to float32's) while
    every other ``nn.Linear`` ran in bf16: now every kernel runs them in bf16, as on the GPU, so the
    output differs from float32's and equals the bank cast to bf16, rounded back."""
    torch.manual_seed(0)
    for impl in IMPLS:
        layer = moelab.MoE(32, 4, 2, 64, impl=impl).eval()
        x = torch.randn(64, 32)
        with torch.no_grad(), moelab.recording_routing(layer):
            fp32 = layer(x)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                mixed = layer(x)
                kernel = layer.experts.resolved_impl(x, 2, False)
            idx, w = layer.last_routing.indices, layer.last_routing.weights
            cast = KERNELS[kernel](x.bfloat16(), idx, w, layer.experts.expert_weights.to(torch.bfloat16))
        assert not torch.equal(mixed, fp32), impl
        assert torch.equal(mixed, cast.float()), impl


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("impl", IMPLS)
def test_a_bf16_input_to_float32_experts_under_autocast_runs_as_a_float32_one(impl, grad):
    """An autocast ``nn.Linear``'s bf16 output fed to float32 experts under autocast once crashed
    (``mm`` of a bf16 row and a float32 weight): it computes as the float32 input rounded to bf16,
    and returns bf16."""
    torch.manual_seed(0)
    bank, x = ExpertBank(4, 32, 64, impl=impl), torch.randn(64, 32).bfloat16()
    idx, w = random_routing(64, 4, 2, torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(grad):
        got = bank.mix(x, idx, w)
        want = bank.mix(x.float(), idx, w)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())


def _bank_numbers(bank, x, idx, w, grad):
    """The outputs and, with ``grad``, the gradients of the tokens, weights and experts of one call."""
    xi, wi = x.clone().requires_grad_(grad), w.clone().requires_grad_(grad)
    for p in bank.parameters():
        p.grad = None
    with torch.set_grad_enabled(grad):
        y = bank.mix(xi, idx, wi)
        if grad:
            (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    return [y.detach()] + ([xi.grad, wi.grad] + [p.grad for p in bank.parameters()] if grad else [])


@pytest.mark.skipif(not GROUPED, reason="grouped_mm not available in this torch")
def test_autotune_picks_only_a_kernel_that_rounds_as_the_rule_on_every_routing(monkeypatch):
    # two threads, training: the threaded loop (one GEMM thread per expert) and grouped_mm agree on
    # the example and the random probe here but round differently on most other routings; a pick
    # decided by the clock would make two runs of the same command end with different weights
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    bank = ExpertBank(8, 64, 128)
    x = torch.randn(64, 64, generator=g)
    probe = kernels.random_probe(x, 2, bank.expert_weights)
    now, calls = [0.0], []
    _timed_kernels(monkeypatch, {"loop": 1.0, "grouped": 5.0}, now, calls)  # the clock favours the loop
    example = (probe.x, moelab.Routing(probe.indices, probe.weights))
    report = autotune(bank, example, training=True, clock=lambda: now[0])
    (tuned,) = report.classes
    assert tuned.rule == "grouped" and tuned.pick == "grouped"
    assert "loop" in tuned.other_rounding and "loop" in str(report)
    untuned = ExpertBank(8, 64, 128)
    untuned.load_state_dict(bank.state_dict())
    for _ in range(10):  # the autotuned bank computes the rule's numbers on fresh routings
        idx, w = random_routing(64, 8, 2, g)
        y = torch.randn(64, 64, generator=g)
        for a, b in zip(_bank_numbers(bank, y, idx, w, True), _bank_numbers(untuned, y, idx, w, True)):
            assert torch.equal(a, b)


def test_autotune_picks_by_the_clock_among_kernels_that_round_alike(monkeypatch):
    # one thread, inference: the loop and the stream run the same GEMMs on each expert's rows and sum
    # each token's weighted outputs in expert order, so either may be picked; grouped_mm is its own
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    g = torch.Generator().manual_seed(1)
    bank = ExpertBank(8, 64, 128)
    x = torch.randn(4, 64, generator=g)  # decoding-sized: the rule streams
    idx, w = random_routing(4, 8, 2, g)
    now, calls = [0.0], []
    rule = kernels.rule_kernel(x, 2, bank.expert_weights, False)
    other = "loop"
    _timed_kernels(monkeypatch, {other: 1.0, rule: 5.0, "grouped": 0.5}, now, calls)
    report = autotune(bank, (x, moelab.Routing(idx, w)), training=False, clock=lambda: now[0])
    (tuned,) = report.classes
    assert rule == "stream" and tuned.pick == other  # faster, and the same numbers
    assert tuned.other_rounding == (("grouped",) if GROUPED else ())
    calls.clear()
    with torch.no_grad():
        y = bank.mix(x, idx, w)
    assert calls == [other] and torch.equal(y, KERNELS[rule](x, idx, w, bank.expert_weights))
