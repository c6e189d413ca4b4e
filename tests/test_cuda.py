"""The CUDA path: every method runs on the GPU and the dispatch implementations agree there.

Skipped where no CUDA device is present (CI has none); run on a GPU machine with
``pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch

import moelab
from moelab.experts import ExpertBank, grouped_mm_available

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("method", moelab.methods())
def test_every_method_trains_on_cuda_and_matches_the_cpu_layer(method):
    torch.manual_seed(0)
    cpu = moelab.MoE(64, 8, 2, d_hidden=128, method=method, activation="swiglu").eval()
    gpu = moelab.MoE(64, 8, 2, d_hidden=128, method=method, activation="swiglu")
    gpu.load_state_dict(cpu.state_dict())
    gpu = gpu.to(CUDA).eval()
    x = torch.randn(4, 32, 64)
    docs = {"doc_ids": (torch.arange(32) // 10).expand(4, 32)} if cpu.router.takes_doc_ids else {}
    docs_gpu = {k: v.to(CUDA) for k, v in docs.items()}
    with torch.no_grad():
        y_cpu, y_gpu = cpu(x, **docs), gpu(x.to(CUDA), **docs_gpu)
    torch.testing.assert_close(y_gpu.cpu(), y_cpu, atol=2e-4, rtol=2e-4)
    gpu.train()
    xg = x.to(CUDA).requires_grad_()
    y = gpu(xg, **docs_gpu)
    (y.square().mean() + gpu.aux_loss).backward()
    assert torch.isfinite(xg.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in gpu.parameters() if p.grad is not None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_and_loop_dispatch_agree_on_cuda(dtype):
    if not grouped_mm_available(CUDA, dtype):
        pytest.skip("grouped_mm is not available on this GPU / torch")
    torch.manual_seed(0)
    bank = ExpertBank(16, 256, 512, activation="swiglu").to(CUDA, dtype)
    x = torch.randn(2048, 256, device=CUDA, dtype=dtype, requires_grad=True)
    weights, indices = moelab.functional.topk_softmax(torch.randn(2048, 16, device=CUDA), 2)
    weights = weights.to(dtype)
    results = []
    for impl in ("loop", "grouped"):
        bank.impl = impl
        y = bank.mix(x, indices, weights)
        grads = torch.autograd.grad(y.float().square().sum(), [x, bank.w_in, bank.w_out])
        results.append((y.detach().float(), [g.float() for g in grads]))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(results[0][0], results[1][0], atol=tol, rtol=tol)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=tol * 10, rtol=tol * 10)
