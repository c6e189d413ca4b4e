"""The Triton kernels compile for real GPUs (sm_80, sm_90) without one: Triton's own ptxas builds
them in a fresh process without ``TRITON_INTERPRET`` (the interpreter of tests/test_kernels_triton.py
checks the arithmetic, not that the kernels compile).  With the 16-divisible strides and aligned
pointers that the JIT sees at a launch on production shapes, every GEMM kernel's main loop is
software-pipelined (asynchronous copies into shared memory) and uses the tensor cores."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
]

CHECK = r"""
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moelab.experts import triton_kernels as tk

def build(fn, types, consts, arch):
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    aligned = lambda n: n.isupper() or n.startswith("stride") or n in ("n_cols", "k_dim", "m_dim", "n_dim")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in consts and aligned(n)}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": 4, "num_stages": 3})
    ir = k.asm["ttgir"]
    return {"pipelined": ("async_copy_global_to_local" in ir) or ("async_tma" in ir),
            "tensor_cores": ("warp_group_dot" in ir) or ("mma" in ir), "shared": k.metadata.shared}

out = {}
T = "*bf16"
tiles = dict(BM=64, BN=128, BK=64)
for arch in (80, 90):
    out[f"in swiglu {arch}"] = build(tk._in_kernel, {"X": T, "TOK": "*i32", "W": T, "BIAS": T, "H": T, "A": T, "BLK": "*i32"},
        dict(ACT=5, GATED=True, STORE_H=True, HAS_B=True, PREC="tf32", **tiles), arch)
    out[f"out atomic {arch}"] = build(tk._out_kernel, {"A": T, "W": T, "BIAS": T, "TOK": "*i32", "DEST": "*i64", "WS": "*fp32", "OUT": "*fp32", "BLK": "*i32"},
        dict(MODE=1, SCALE=True, HAS_B=False, PREC="tf32", **tiles), arch)
    out[f"grad_h swiglu {arch}"] = build(tk._grad_h_kernel, {"G": T, "TOK": "*i32", "WS": "*fp32", "W": T, "BIAS": T, "H": T, "GH": T, "GWP": "*fp32", "BLK": "*i32"},
        dict(ACT=5, GATED=True, HAS_B=True, PREC="tf32", **tiles), arch)
    out[f"wgrad gathered {arch}"] = build(tk._wgrad_kernel, {"P": T, "PTOK": "*i32", "WS": "*fp32", "Q": T, "QTOK": "*i32", "DW": T, "STARTS": "*i32", "ENDS": "*i32"},
        dict(GATHER_P=True, SCALE_P=True, GATHER_Q=False, Q_ACT=5, PREC="tf32", **tiles), arch)
    out[f"rowsum {arch}"] = build(tk._rowsum_kernel, {"P": T, "PTOK": "*i32", "WS": "*fp32", "OUT": T, "STARTS": "*i32", "ENDS": "*i32"},
        dict(GATHER_P=True, SCALE_P=True, BM=128, BK=64), arch)
    out[f"in relu fp32 {arch}"] = build(tk._in_kernel, {"X": "*fp32", "TOK": "*i32", "W": "*fp32", "BIAS": "*fp32", "H": "*fp32", "A": "*fp32", "BLK": "*i32"},
        dict(ACT=0, GATED=False, STORE_H=False, HAS_B=False, PREC="ieee", BM=64, BN=128, BK=32), arch)
print(json.dumps(out))
"""


def test_every_kernel_compiles_for_sm80_and_sm90_pipelined_on_tensor_cores(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # a fresh compile, not a cached one
    run = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(result) == 12
    for name, info in result.items():
        assert info["shared"] <= 160 * 1024, (name, info)  # fits an A100's / H100's shared memory
        if not name.startswith("rowsum"):
            assert info["pipelined"], (name, info)
        if not name.startswith(("rowsum", "in relu fp32")):  # IEEE float32 runs on the FMA units
            assert info["tensor_cores"], (name, info)
