"""Expert banks: dispatch equals the literal per-token sum, for every implementation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moelab.experts import MLP, ExpertBank, ModuleExperts, grouped_mm_available, sort_slots

ACTS = ["relu", "gelu", "silu", "swiglu"]
GROUPED = grouped_mm_available(torch.device("cpu"), torch.float32)
IMPLS = ["loop", "auto"] + (["grouped"] if GROUPED else [])


def reference(bank, x, indices, weights):
    """``Σ_k w_k · expert_forward(x_t, i_k)``, one token at a time."""
    rows = []
    for t in range(x.shape[0]):
        terms = [
            weights[t, k] * bank.expert_forward(x[t : t + 1], int(indices[t, k]))[0]
            for k in range(indices.shape[1])
        ]
        rows.append(torch.stack(terms).sum(0))
    return torch.stack(rows)


def random_routing(t, n, k, generator, experts=None):
    """``(T, K)`` distinct experts per token drawn from ``experts`` (default all N)."""
    pool = torch.arange(n) if experts is None else torch.as_tensor(experts)
    idx = torch.stack([pool[torch.randperm(len(pool), generator=generator)[:k]] for _ in range(t)])
    w = torch.rand(t, k, generator=generator)
    return idx, w


# sizes are multiples of 4 so that the grouped implementation runs on them too
CASES = [
    # T, N, K, d, h
    (1, 4, 2, 8, 4),  # a single token
    (1, 3, 3, 4, 8),  # T=1, K=N
    (9, 5, 5, 8, 8),  # K=N
    (13, 6, 2, 12, 8),
    (32, 8, 1, 4, 12),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_dispatch_equals_weighted_sum_of_expert_forward(impl, act, bias, case):
    t, n, k, d, h = case
    g = torch.Generator().manual_seed(t * 100 + n * 10 + k)
    bank = ExpertBank(n, d, h, activation=act, bias=bias, impl=impl)
    if bias:  # zero-initialised biases would not test anything
        with torch.no_grad():
            bank.b_in.normal_()
            bank.b_out.normal_()
    x = torch.randn(t, d, generator=g)
    idx, w = random_routing(t, n, k, g)
    torch.testing.assert_close(bank(x, idx, w), reference(bank, x, idx, w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["loop", "auto"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("seed", range(4))
def test_dispatch_equals_weighted_sum_on_random_odd_shapes(impl, act, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    t, n, d, h = (int(v) for v in torch.randint(1, 12, (4,), generator=g))
    k = int(torch.randint(1, n + 1, (1,), generator=g))
    bank = ExpertBank(n, d, h, activation=act, bias=seed % 2 == 1, impl=impl)
    x = torch.randn(t, d, generator=g)
    idx, w = random_routing(t, n, k, g)
    torch.testing.assert_close(bank(x, idx, w), reference(bank, x, idx, w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_dispatch_skips_experts_with_no_tokens(impl):
    g = torch.Generator().manual_seed(1)
    bank = ExpertBank(8, 8, 8, activation="swiglu", bias=True, impl=impl)
    with torch.no_grad():
        bank.b_in.normal_()
        bank.b_out.normal_()
    x = torch.randn(10, 8, generator=g, requires_grad=True)
    idx, w = random_routing(10, 8, 2, g, experts=[1, 4, 6])  # experts 0, 2, 3, 5, 7 idle
    y = bank(x, idx, w)
    torch.testing.assert_close(y, reference(bank, x, idx, w), rtol=1e-5, atol=1e-6)
    y.sum().backward()
    idle = [0, 2, 3, 5, 7]
    assert bank.w_in.grad[idle].abs().sum() == 0
    assert bank.w_out.grad[idle].abs().sum() == 0
    assert bank.w_in.grad[[1, 4, 6]].abs().sum() > 0


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
        (bank(xi, idx, wi) * torch.linspace(-1, 1, 8)).sum().backward()
        grads.append([xi.grad, wi.grad] + [p.grad for p in bank.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_auto_falls_back_to_loop_where_grouped_cannot_run():
    bank = ExpertBank(3, 6, 10, impl="auto")  # 6 and 10 are not multiples of 4
    x = torch.randn(5, 6)
    assert bank.resolved_impl(x) == "loop"
    assert bank.resolved_impl(x.double()) == "loop"
    idx, w = random_routing(5, 3, 2, torch.Generator().manual_seed(0))
    torch.testing.assert_close(bank(x, idx, w), reference(bank, x, idx, w), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not GROUPED, reason="grouped_mm not available in this torch")
def test_auto_uses_grouped_for_aligned_float32():
    assert ExpertBank(3, 8, 16).resolved_impl(torch.randn(2, 8)) == "grouped"


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [False, True])
def test_forward_all_stacks_expert_forward(act, bias):
    bank = ExpertBank(5, 6, 7, activation=act, bias=bias, chunk_elements=40)  # forces several chunks
    if bias:
        with torch.no_grad():
            bank.b_in.normal_()
            bank.b_out.normal_()
    x = torch.randn(9, 6)
    expected = torch.stack([bank.expert_forward(x, e) for e in range(5)], dim=1)
    out = bank.forward_all(x)
    assert out.shape == (9, 5, 6)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_expert_forward_is_the_mlp_formula():
    bank = ExpertBank(3, 4, 5, activation="swiglu", bias=True)
    with torch.no_grad():
        bank.b_in.normal_()
        bank.b_out.normal_()
    x = torch.randn(2, 4)
    h = x @ bank.w_in[1].T + bank.b_in[1]
    gate, up = h[:, :5], h[:, 5:]
    expected = (torch.nn.functional.silu(gate) * up) @ bank.w_out[1].T + bank.b_out[1]
    torch.testing.assert_close(bank.expert_forward(x, 1), expected)


def test_expert_bank_weight_layout_and_init_bounds():
    bank = ExpertBank(4, 16, 32, activation="swiglu", bias=True)
    assert bank.w_in.shape == (4, 64, 16)
    assert bank.w_out.shape == (4, 16, 32)
    assert bank.w_in.abs().max() <= 16**-0.5
    assert bank.w_out.abs().max() <= 32**-0.5
    assert bank.b_in.abs().sum() == 0 and bank.b_out.abs().sum() == 0
    plain = ExpertBank(4, 16, 32, activation="relu")
    assert plain.w_in.shape == (4, 32, 16) and plain.b_in is None


def _module_experts(n, d_in, d_out):
    return ModuleExperts(
        [nn.Sequential(nn.Linear(d_in, 5), nn.Tanh(), nn.Linear(5, d_out)) for _ in range(n)]
    )


@pytest.mark.parametrize(("t", "n", "k"), [(1, 3, 3), (7, 4, 2), (12, 5, 1)])
def test_module_experts_dispatch_equals_weighted_sum(t, n, k):
    g = torch.Generator().manual_seed(3)
    bank = _module_experts(n, 6, 3)
    x = torch.randn(t, 6, generator=g)
    idx, w = random_routing(t, n, k, g, experts=list(range(n - 1)) if k < n else None)
    out = bank(x, idx, w)
    assert out.shape == (t, 3)
    torch.testing.assert_close(out, reference(bank, x, idx, w), rtol=1e-5, atol=1e-6)


def test_module_experts_forward_all_stacks_expert_forward():
    bank = _module_experts(4, 6, 3)
    x = torch.randn(5, 6)
    expected = torch.stack([bank.expert_forward(x, e) for e in range(4)], dim=1)
    torch.testing.assert_close(bank.forward_all(x), expected)


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
        return torch.func.functional_call(bank, dict(zip(names, ps)), (x, idx, w))

    assert torch.autograd.gradcheck(f, (x, w, *params))


def test_sort_slots_groups_slots_by_expert():
    idx = torch.tensor([[2, 0], [1, 2], [0, 1], [2, 1]])
    order, counts, tokens, inverse = sort_slots(idx, 4)
    flat = idx.reshape(-1)
    assert flat[order].tolist() == sorted(flat.tolist())
    assert counts.tolist() == [2, 3, 3, 0]
    assert tokens.tolist() == (order // 2).tolist()
    assert flat[order][inverse].tolist() == flat.tolist()


def test_mlp_is_dense_two_layer_ffn():
    mlp = MLP(4, 6, activation="gelu", bias=True)
    x = torch.randn(3, 4)
    expected = torch.nn.functional.gelu(x @ mlp.fc_in.weight.T + mlp.fc_in.bias) @ mlp.fc_out.weight.T
    torch.testing.assert_close(mlp(x), expected + mlp.fc_out.bias)


# ---------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_experts": 0}, r"num_experts=0 is not allowed; expected a positive integer"),
        ({"d_model": -2}, r"d_model=-2 is not allowed; expected a positive integer"),
        ({"d_hidden": 0}, r"d_hidden=0 is not allowed; expected a positive integer"),
        (
            {"activation": "tanh"},
            r"activation='tanh' is not allowed; expected one of \[.*'gelu', .*'swiglu'\]",
        ),
        ({"impl": "fast"}, r"impl='fast' is not allowed; expected one of \['auto', 'loop', 'grouped'\]"),
        ({"chunk_elements": 0}, r"chunk_elements=0 is not allowed"),
    ],
)
def test_expert_bank_rejects_bad_arguments(kwargs, match):
    args = {"num_experts": 4, "d_model": 8, "d_hidden": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        ExpertBank(**args)


def test_grouped_impl_rejects_float64_with_a_clear_message():
    bank = ExpertBank(2, 4, 4, impl="grouped").double()
    idx, w = random_routing(3, 2, 1, torch.Generator().manual_seed(0))
    with pytest.raises(
        ValueError, match=r"impl='grouped' is not available for device=cpu, dtype=torch.float64"
    ):
        bank(torch.randn(3, 4, dtype=torch.float64), idx, w.double())


@pytest.mark.skipif(not GROUPED, reason="grouped_mm not available in this torch")
def test_grouped_impl_rejects_unaligned_sizes_naming_them():
    bank = ExpertBank(2, 6, 10, impl="grouped")
    idx, w = random_routing(3, 2, 1, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"multiples of 4 .*d_model=6, d_hidden=10"):
        bank(torch.randn(3, 6), idx, w)


def test_module_experts_rejects_an_empty_list():
    with pytest.raises(
        ValueError, match=r"experts=\[\] is not allowed; expected a non-empty list of nn.Module"
    ):
        ModuleExperts([])


@pytest.mark.parametrize("impl", IMPLS)
def test_dispatch_of_zero_tokens_is_empty(impl):
    bank = ExpertBank(4, 8, 8, activation="swiglu", impl=impl)
    out = bank(torch.randn(0, 8), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, 8)
    modules = _module_experts(3, 6, 2)
    assert modules(torch.randn(0, 6), torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1)).shape == (0, 2)


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu", "swiglu"])
def test_forward_winners_matches_autograd_through_forward_all_without_rerunning_experts(activation):
    torch.manual_seed(0)
    bank = ExpertBank(5, 6, 8, activation=activation, bias=True).double()
    for b in (bank.b_in, bank.b_out):
        torch.nn.init.normal_(b)
    x = torch.randn(11, 6, dtype=torch.float64, requires_grad=True)

    def choose(y):
        s = y.norm(dim=-1)
        return s.topk(2, dim=-1).indices, s

    winners, out, scores = bank.forward_winners(x, choose)
    params = [x, bank.w_in, bank.w_out, bank.b_in, bank.b_out]
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, params, g)
    all_out = bank.forward_all(x)  # the literal: gather the winners from a differentiable pass
    ref_winners = all_out.detach().norm(dim=-1).topk(2, dim=-1).indices
    ref = all_out.gather(1, ref_winners.unsqueeze(-1).expand(-1, -1, 6))
    want = torch.autograd.grad(ref, params, g)
    assert torch.equal(winners, ref_winners)
    torch.testing.assert_close(out.detach(), ref.detach())
    torch.testing.assert_close(scores, all_out.detach().norm(dim=-1))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------ CPU inference: the stream path
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

    monkeypatch.setattr("moelab.experts.sort_slots", no_sort)
    with torch.inference_mode():
        y = bank(x, idx, w)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_stream_path_serves_cpu_inference_only(monkeypatch):
    bank = ExpertBank(8, 8, 8, activation="swiglu", impl="loop")
    g = torch.Generator().manual_seed(0)
    idx, w = random_routing(5, 8, 2, g)  # T·K = 10 > N = 8: sorted by sort_slots
    x = torch.randn(5, 8)
    assert bank.resolved_impl(x, 2, grad=True) == "loop"
    assert bank.resolved_impl(x, 2, grad=False) == "stream"
    assert ExpertBank(8, 8, 8, impl="grouped").resolved_impl(x, 2, grad=False) == "grouped"
    with torch.no_grad():
        expected = reference(bank, x, idx, w)
        torch.testing.assert_close(bank(x, idx, w), expected, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(ExpertBank, "_stream", lambda *a: pytest.fail("stream path taken with autograd"))
    y = bank(x, idx, w)  # parameters require grad: the autograd path
    assert y.grad_fn is not None


def test_few_token_path_repeats_bitwise():
    bank = ExpertBank(16, 8, 8, activation="swiglu")
    idx, w = random_routing(4, 16, 3, torch.Generator().manual_seed(3))
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert torch.equal(bank(x, idx, w), bank(x, idx, w))


@pytest.mark.skipif(not GROUPED, reason="grouped_mm cannot run on this torch")
def test_auto_takes_loop_on_cpu_from_enough_slots_per_expert():
    bank = ExpertBank(4, 8, 16)
    rows = ExpertBank.LOOP_ROWS_PER_EXPERT
    assert bank.resolved_impl(torch.randn(rows * 4 // 2 - 1, 8), top_k=2) == "grouped"
    assert bank.resolved_impl(torch.randn(rows * 4 // 2, 8), top_k=2) == "loop"
    assert ExpertBank(4, 8, 16, impl="grouped").resolved_impl(torch.randn(rows * 4, 8)) == "grouped"


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
    tracked = bank(x, idx, w)
    assert tracked.grad_fn is not None
    with torch.inference_mode():
        plain = bank(x, idx, w)
    assert plain.grad_fn is None
    torch.testing.assert_close(plain, tracked.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_gather_combine_of_the_gpu_equals_the_cpu_scatter_add_in_values_and_gradients(monkeypatch, impl):
    """The CPU sums slots into tokens by scatter-add, other devices by gathers: same numbers."""
    g = torch.Generator().manual_seed(11)
    bank = ExpertBank(6, 8, 8, activation="swiglu", impl=impl)
    x = torch.randn(13, 8, generator=g)
    idx, w = random_routing(13, 6, 3, g)
    w.requires_grad_()
    runs = []
    for scatter in (True, False):
        monkeypatch.setattr("moelab.experts._scatter_adds", lambda device, s=scatter: s)
        xi = x.clone().requires_grad_()
        y = bank(xi, idx, w)
        grads = torch.autograd.grad((y * y).sum(), [xi, w, *bank.parameters()])
        with torch.inference_mode():
            plain = bank(x, idx, w.detach())
        runs.append([y.detach(), plain, *grads])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(runs[0][0], reference(bank, x, idx, w.detach()).detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not GROUPED, reason="grouped_mm cannot run on this torch")
def test_auto_inference_streams_when_decoding_and_from_enough_slots_per_expert():
    bank = ExpertBank(4, 8, 16)
    rows = ExpertBank.STREAM_ROWS_PER_EXPERT
    assert bank.resolved_impl(torch.randn(2, 8), top_k=2, grad=False) == "stream"  # T·K ≤ N
    assert bank.resolved_impl(torch.randn(3, 8), top_k=2, grad=False) == "grouped"
    assert bank.resolved_impl(torch.randn(rows * 2 - 1, 8), top_k=2, grad=False) == "grouped"
    assert bank.resolved_impl(torch.randn(rows * 2, 8), top_k=2, grad=False) == "stream"
    assert bank.resolved_impl(torch.randn(3, 8).double(), top_k=2, grad=False) == "stream"
    threads = torch.get_num_threads()
    try:  # with several threads, only decoding streams
        torch.set_num_threads(2)
        assert bank.resolved_impl(torch.randn(rows * 2, 8), top_k=2, grad=False) == "grouped"
        assert bank.resolved_impl(torch.randn(2, 8), top_k=2, grad=False) == "stream"
    finally:
        torch.set_num_threads(threads)
