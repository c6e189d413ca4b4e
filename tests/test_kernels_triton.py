"""``impl="triton"``: the fused Triton kernels give the outputs and gradients of ``loop``.

On the CPU they run under Triton's interpreter: ``TRITON_INTERPRET=1`` is set here, when this
file is collected, before anything imports :mod:`moelab.experts.triton_kernels` (the kernels are
defined in interpreter mode at that import).  Skipped when triton is not installed.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install triton)"
)

from experts_helpers import random_routing  # noqa: E402
from moelab.experts import KERNELS, ExpertBank  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tk():
    from moelab.experts import triton_kernels

    if not triton_kernels.available(torch.device(DEVICE), torch.float32):
        pytest.skip(
            f"impl='triton' cannot run here: {triton_kernels.unavailable_reason(torch.device(DEVICE), torch.float32)}"
        )
    return triton_kernels


def _pair(act: str, n: int, d: int, h: int, bias: bool = False) -> tuple[ExpertBank, ExpertBank]:
    torch.manual_seed(0)
    loop = ExpertBank(n, d, h, activation=act, bias=bias, impl="loop").to(DEVICE)
    if bias:
        with torch.no_grad():
            loop.b_in.normal_()
            loop.b_out.normal_()
    fused = ExpertBank(n, d, h, activation=act, bias=bias, impl="triton").to(DEVICE)
    fused.load_state_dict(loop.state_dict())
    return loop, fused


def _outputs_and_grads(bank: ExpertBank, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> list:
    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = bank.mix(xi, idx, wi)
    (y * torch.linspace(-1, 1, x.shape[1], device=x.device)).sum().backward()
    return [y.detach(), xi.grad, wi.grad] + [p.grad for p in bank.parameters()]


# T ≤ 64, d ≤ 32, N ≤ 4; K = 1 (plain stores), 2 (atomic adds), 3 (per-slot buffer summed over K);
# widths that are not multiples of the tiles; one idle expert in the first and the last case;
# expert biases in three
CASES = [
    ("swiglu", 2, 4, 32, 24, 61, [0, 1, 3], False),
    ("swiglu", 1, 3, 16, 8, 17, None, True),
    ("relu", 2, 4, 24, 20, 33, None, False),
    ("gelu", 3, 4, 16, 12, 29, None, True),
    ("silu", 1, 2, 8, 12, 9, None, False),
    ("gelu_tanh", 2, 3, 16, 16, 20, None, False),
    ("quick_gelu", 2, 4, 12, 16, 15, [0, 1, 3], True),
]
NAMES = ["output", "x.grad", "weights.grad", "w_in.grad", "w_out.grad", "b_in.grad", "b_out.grad"]


@pytest.mark.parametrize(("act", "k", "n", "d", "h", "t", "experts", "bias"), CASES)
def test_triton_outputs_and_gradients_equal_loop(tk, act, k, n, d, h, t, experts, bias):
    loop, fused = _pair(act, n, d, h, bias)
    g = torch.Generator().manual_seed(1)
    idx, w = random_routing(t, n, k, g, experts=experts)
    x = torch.randn(t, d, generator=g)
    x, idx, w = x.to(DEVICE), idx.to(DEVICE), w.to(DEVICE)
    ref = _outputs_and_grads(loop, x, idx, w)
    got = _outputs_and_grads(fused, x, idx, w)
    assert len(got) == (7 if bias else 5)
    for name, a, b in zip(NAMES, ref, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    if experts is not None:  # the idle expert's gradients are exactly zero
        assert all(p.grad[2].abs().max() == 0 for p in fused.parameters())


def test_triton_without_autograd_equals_loop_and_keeps_nothing(tk):
    loop, fused = _pair("swiglu", 4, 16, 8)
    g = torch.Generator().manual_seed(3)
    idx, w = random_routing(20, 4, 2, g)
    x = torch.randn(20, 16, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(fused.mix(x, idx, w), loop.mix(x, idx, w), rtol=1e-5, atol=1e-6)
    with torch.inference_mode():
        torch.testing.assert_close(fused.mix(x, idx, w), loop.mix(x, idx, w), rtol=1e-5, atol=1e-6)


def test_triton_is_deterministic_with_two_experts_per_token(tk):
    _, fused = _pair("relu", 4, 16, 16)
    g = torch.Generator().manual_seed(4)
    idx, w = random_routing(40, 4, 2, g)
    x = torch.randn(40, 16, generator=g)
    first = _outputs_and_grads(fused, x, idx, w)
    fused.zero_grad(set_to_none=True)
    second = _outputs_and_grads(fused, x, idx, w)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_expert_outputs_is_every_expert_on_every_token(tk):
    """The competition's pass as one grouped pass: ``indices = arange(N)`` for every token gives
    ``forward_all``'s ``(T, N, d)`` and the pre-activations of ``_all_experts``."""
    loop, fused = _pair("swiglu", 4, 16, 12, bias=True)
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(5))
    idx = torch.arange(4).expand(10, 4)
    h, y = tk.expert_outputs(x, idx, *fused.expert_weights, keep_h=True)
    h_ref, y_ref = loop._all_experts(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-6)
    from moelab.experts.kernels import all_experts

    h2, y2 = all_experts(x, fused.expert_weights, "triton")  # bench compete --all-pass triton
    assert torch.equal(h2, h) and torch.equal(y2, y)


def test_triton_is_registered_as_a_kernel():
    from moelab.experts.kernels import IMPLS, fused

    assert KERNELS["triton"] is fused and "triton" in IMPLS


def test_triton_refuses_float64_naming_what_runs(tk):
    bank = ExpertBank(2, 8, 8, impl="triton").double()
    idx, w = random_routing(3, 2, 1, torch.Generator().manual_seed(0))
    with pytest.raises(
        ValueError,
        match=r"impl='triton' is not available for device=cpu, dtype=torch.float64, activation='relu', "
        r"bias=False: it takes dtypes \['torch.float32', 'torch.bfloat16', 'torch.float16'\]; "
        r"use impl='loop', 'grouped' or 'auto'",
    ):
        bank.mix(torch.randn(3, 8, dtype=torch.float64), idx, w.double())


@pytest.mark.skipif(DEVICE != "cpu", reason="Triton's interpreter runs on the CPU")
def test_triton_under_the_interpreter_refuses_bfloat16_which_it_computes_wrongly(tk):
    # Triton 3.9's interpreter returned outputs ~1e10 off the loop kernel's for bf16 tiles
    bank = ExpertBank(2, 8, 8, impl="triton").to(torch.bfloat16)
    idx, w = random_routing(3, 2, 1, torch.Generator().manual_seed(0))
    with pytest.raises(
        ValueError,
        match=r"^impl='triton' is not available for device=cpu, dtype=torch.bfloat16, activation='relu', "
        r"bias=False: Triton's interpreter on the CPU mishandles bfloat16 \(its outputs are off by orders of "
        r"magnitude\); under TRITON_INTERPRET=1 it takes torch.float32 and torch.float16; "
        r"use impl='loop', 'grouped' or 'auto'$",
    ):
        bank.mix(torch.randn(3, 8, dtype=torch.bfloat16), idx, w.to(torch.bfloat16))
    assert not tk.available(torch.device("cpu"), torch.bfloat16)
    assert tk.available(torch.device("cpu"), torch.float16)  # float16 computes right there


def test_unavailable_reason_names_the_interpreter_on_the_cpu(tk, monkeypatch):
    monkeypatch.setattr(tk, "INTERPRET", False)
    reason = tk.unavailable_reason(torch.device("cpu"), torch.float32)
    assert "CUDA" in reason and "TRITON_INTERPRET=1" in reason
    monkeypatch.setattr(tk, "triton", None)
    assert (
        tk.unavailable_reason(torch.device("cuda"), torch.float32)
        == "triton is not installed (pip install triton)"
    )
