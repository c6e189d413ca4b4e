"""The ``"triton"`` kernel of :mod:`moelab.experts.kernels`: expert MLPs whose gather and weighted
scatter are fused into grouped GEMMs (after ScatterMoE, Tan et al. 2024, written from scratch
here), forward and backward, reading the tokens by index so that no ``(T·K, d)`` copy of the
inputs exists, deterministic for every ``K``; on CUDA, and on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is imported).  docs/kernels.md ("The fused Triton
kernels") describes every kernel, what is saved for backward, the dtypes and the activations.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .dispatch import sort_slots

try:  # triton is optional: the rest of moelab runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

__all__ = [
    "ACT_CODES",
    "DTYPES",
    "INTERPRET",
    "available",
    "expert_outputs",
    "triton_experts",
    "unavailable_reason",
]

#: activation name → the code the kernels branch on
ACT_CODES = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "quick_gelu": 3, "silu": 4, "swiglu": 5}
#: the dtypes the kernels take
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: whether the kernels were defined under Triton's interpreter (``TRITON_INTERPRET=1`` at import)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``impl="triton"`` cannot run for ``device`` and ``dtype`` here, or ``None`` if it can."""
    if triton is None:
        return "triton is not installed (pip install triton)"
    if dtype not in DTYPES:
        return f"it takes dtypes {[str(d) for d in DTYPES]}"
    if device.type == "cuda":
        return None
    if INTERPRET and device.type == "cpu":
        if dtype == torch.bfloat16:  # Triton 3.9's interpreter computes bf16 tiles wrongly (~1e10 off)
            return (
                "Triton's interpreter on the CPU mishandles bfloat16 (its outputs are off by orders of "
                "magnitude); under TRITON_INTERPRET=1 it takes torch.float32 and torch.float16"
            )
        return None
    return (
        "it runs on CUDA devices, or on the CPU under Triton's interpreter "
        "(TRITON_INTERPRET=1 set before moelab.experts.triton_kernels is imported)"
    )


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``impl="triton"`` runs for ``device`` and ``dtype`` here."""
    return unavailable_reason(device, dtype) is None


# ---------------------------------------------------------------------------------- kernels
if triton is not None:
    # Only builtins of triton.language and this module's own jit functions are called in the
    # kernels (tl.full, not tl.zeros; tl.reduce with _add, not tl.sum): the jit functions of
    # triton.language.standard are interpretable only when triton itself was imported with
    # TRITON_INTERPRET=1, which a test process that imported torch's or transformers' triton
    # integration first cannot guarantee.

    @triton.jit
    def _add(a, b):
        return a + b

    @triton.jit
    def _sigmoid(v):
        return 1.0 / (1.0 + tl.exp(-v))

    @triton.jit
    def _act(h, ACT: tl.constexpr):
        """The activation of float32 ``h`` (``ACT`` of :data:`ACT_CODES`, not ``swiglu``)."""
        if ACT == 0:
            out = tl.maximum(h, 0.0)
        elif ACT == 1:
            out = 0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))
        elif ACT == 2:
            u = 0.7978845608028654 * (h + 0.044715 * h * h * h)
            out = 0.5 * h * (1.0 + (2.0 * _sigmoid(2.0 * u) - 1.0))
        elif ACT == 3:
            out = h * _sigmoid(1.702 * h)
        else:
            out = h * _sigmoid(h)
        return out

    @triton.jit
    def _act_grad(h, ACT: tl.constexpr):
        """``act'(h)`` for float32 ``h``."""
        if ACT == 0:
            out = tl.where(h > 0.0, 1.0, 0.0)
        elif ACT == 1:
            cdf = 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476))
            out = cdf + h * 0.3989422804014327 * tl.exp(-0.5 * h * h)
        elif ACT == 2:
            u = 0.7978845608028654 * (h + 0.044715 * h * h * h)
            t = 2.0 * _sigmoid(2.0 * u) - 1.0
            out = 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * 0.7978845608028654 * (
                1.0 + 3.0 * 0.044715 * h * h
            )
        elif ACT == 3:
            s = _sigmoid(1.702 * h)
            out = s + 1.702 * h * s * (1.0 - s)
        else:
            s = _sigmoid(h)
            out = s * (1.0 + h * (1.0 - s))
        return out

    @triton.jit
    def _block(BLK, nblk, pid):
        """``(expert, first row, end row)`` of row block ``pid`` from the block table (expert -1: idle)."""
        e = tl.load(BLK + pid)
        row0 = tl.load(BLK + nblk + pid)
        row_end = tl.load(BLK + 2 * nblk + pid)
        return e, row0, row_end

    @triton.jit
    def _in_kernel(
        X, TOK, W, BIAS, H, A, BLK, nblk, n_cols, k_dim,
        stride_xm, stride_we, stride_wn, stride_be, stride_hm, stride_am,
        ACT: tl.constexpr, GATED: tl.constexpr, STORE_H: tl.constexpr, HAS_B: tl.constexpr, PREC: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        """``h = x[tok] W[e]ᵀ (+ bias[e])`` on one block of sorted slots, ``a = act(h)`` (``GATED``: the up
        half at column offset ``n_cols`` of ``W``, ``a = silu(gate) · up``).  ``W``: ``(N, ·, k_dim)``
        with unit stride along ``k_dim``; ``X`` unit stride along its columns."""
        e, row0, row_end = _block(BLK, nblk, tl.program_id(0))
        if e < 0:
            return
        e = e.to(tl.int64)
        rows = row0 + tl.arange(0, BM)
        rmask = rows < row_end
        rows64 = rows.to(tl.int64)
        tok = tl.load(TOK + rows, mask=rmask, other=0).to(tl.int64)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        cmask = cols < n_cols
        cols64 = cols.to(tl.int64)
        acc = tl.full((BM, BN), 0.0, tl.float32)
        acc_up = tl.full((BM, BN), 0.0, tl.float32)
        w_base = W + e * stride_we
        for k0 in range(0, k_dim, BK):
            ks = k0 + tl.arange(0, BK)
            kmask = ks < k_dim
            x = tl.load(
                X + tok[:, None] * stride_xm + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0
            )
            wmask = kmask[:, None] & cmask[None, :]
            w = tl.load(w_base + cols64[None, :] * stride_wn + ks[:, None], mask=wmask, other=0.0)
            acc += tl.dot(x, w, input_precision=PREC)
            if GATED:
                w_up = tl.load(
                    w_base + (cols64[None, :] + n_cols) * stride_wn + ks[:, None], mask=wmask, other=0.0
                )
                acc_up += tl.dot(x, w_up, input_precision=PREC)
        if HAS_B:
            b_ptr = BIAS + e * stride_be + cols64
            acc += tl.load(b_ptr, mask=cmask, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_up += tl.load(b_ptr + n_cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        omask = rmask[:, None] & cmask[None, :]
        if STORE_H:
            h_ptr = H + rows64[:, None] * stride_hm + cols64[None, :]
            tl.store(h_ptr, acc.to(H.dtype.element_ty), mask=omask)
            if GATED:
                tl.store(h_ptr + n_cols, acc_up.to(H.dtype.element_ty), mask=omask)
        if GATED:
            a = acc * _sigmoid(acc) * acc_up
        else:
            a = _act(acc, ACT)
        tl.store(A + rows64[:, None] * stride_am + cols64[None, :], a.to(A.dtype.element_ty), mask=omask)

    @triton.jit
    def _out_kernel(
        A, W, BIAS, TOK, DEST, WS, OUT, BLK, nblk, n_cols, k_dim,
        stride_am, stride_we, stride_wk, stride_wn, stride_be, stride_om,
        MODE: tl.constexpr, SCALE: tl.constexpr, HAS_B: tl.constexpr, PREC: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        """``y = a W[e] (+ bias[e])`` (``W[e][k, n]`` at ``k·stride_wk + n·stride_wn``) on one block of sorted
        slots, times the slot weight (``SCALE``), into ``OUT``: ``MODE`` 0 stored at the token row,
        1 atomically added to it (float32), 2 stored at the slot row ``DEST``."""
        e, row0, row_end = _block(BLK, nblk, tl.program_id(0))
        if e < 0:
            return
        e = e.to(tl.int64)
        rows = row0 + tl.arange(0, BM)
        rmask = rows < row_end
        rows64 = rows.to(tl.int64)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        cmask = cols < n_cols
        cols64 = cols.to(tl.int64)
        acc = tl.full((BM, BN), 0.0, tl.float32)
        w_base = W + e * stride_we
        for k0 in range(0, k_dim, BK):
            ks = k0 + tl.arange(0, BK)
            kmask = ks < k_dim
            a = tl.load(
                A + rows64[:, None] * stride_am + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0
            )
            w = tl.load(
                w_base + ks.to(tl.int64)[:, None] * stride_wk + cols64[None, :] * stride_wn,
                mask=kmask[:, None] & cmask[None, :],
                other=0.0,
            )
            acc += tl.dot(a, w, input_precision=PREC)
        if HAS_B:
            acc += tl.load(BIAS + e * stride_be + cols64, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if SCALE:
            acc = acc * tl.load(WS + rows, mask=rmask, other=0.0)[:, None]
        if MODE == 2:
            dest = tl.load(DEST + rows, mask=rmask, other=0).to(tl.int64)
        else:
            dest = tl.load(TOK + rows, mask=rmask, other=0).to(tl.int64)
        ptr = OUT + dest[:, None] * stride_om + cols64[None, :]
        omask = rmask[:, None] & cmask[None, :]
        if MODE == 1:
            tl.atomic_add(ptr, acc, mask=omask)
        else:
            tl.store(ptr, acc.to(OUT.dtype.element_ty), mask=omask)

    @triton.jit
    def _grad_h_kernel(
        G, TOK, WS, W, BIAS, H, GH, GWP, BLK, nblk, n_cols, k_dim,
        stride_gm, stride_we, stride_wk, stride_be, stride_hm, stride_ghm, stride_gwp,
        ACT: tl.constexpr, GATED: tl.constexpr, HAS_B: tl.constexpr, PREC: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        """``c = g[tok] W[e]`` (``W (N, k_dim, n_cols)``, unit stride along ``n_cols``) on one block
        of sorted slots; from it and the pre-activations ``h``: ``∂h = act'(h) · w_s c`` into ``GH``
        (``GATED``: both halves) and ``Σ_cols c · act(h)`` (this column block's share of the
        routing-weight gradient) into ``GWP[:, pid_n]``."""
        e, row0, row_end = _block(BLK, nblk, tl.program_id(0))
        if e < 0:
            return
        e = e.to(tl.int64)
        pid_n = tl.program_id(1)
        rows = row0 + tl.arange(0, BM)
        rmask = rows < row_end
        rows64 = rows.to(tl.int64)
        tok = tl.load(TOK + rows, mask=rmask, other=0).to(tl.int64)
        cols = pid_n * BN + tl.arange(0, BN)
        cmask = cols < n_cols
        cols64 = cols.to(tl.int64)
        acc = tl.full((BM, BN), 0.0, tl.float32)
        gb = tl.full((BM,), 0.0, tl.float32)
        w_base = W + e * stride_we
        for k0 in range(0, k_dim, BK):
            ks = k0 + tl.arange(0, BK)
            kmask = ks < k_dim
            g = tl.load(
                G + tok[:, None] * stride_gm + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0
            )
            if HAS_B:  # <g_t, b_out[e]>: the bias's share of ∂L/∂w_s, in column block 0 only
                # a block-shaped mask (a scalar bool in a mask fails in Triton 3.9's interpreter)
                bo = tl.load(BIAS + e * stride_be + ks, mask=kmask & (ks * 0 + pid_n == 0), other=0.0)
                gb += tl.reduce(g.to(tl.float32) * bo.to(tl.float32)[None, :], 1, _add)
            w = tl.load(
                w_base + ks.to(tl.int64)[:, None] * stride_wk + cols64[None, :],
                mask=kmask[:, None] & cmask[None, :],
                other=0.0,
            )
            acc += tl.dot(g, w, input_precision=PREC)
        omask = rmask[:, None] & cmask[None, :]
        ws = tl.load(WS + rows, mask=rmask, other=0.0)[:, None]
        h_ptr = H + rows64[:, None] * stride_hm + cols64[None, :]
        gh_ptr = GH + rows64[:, None] * stride_ghm + cols64[None, :]
        h = tl.load(h_ptr, mask=omask, other=0.0).to(tl.float32)
        if GATED:
            up = tl.load(h_ptr + n_cols, mask=omask, other=0.0).to(tl.float32)
            sg = _sigmoid(h)
            s = h * sg
            gw = tl.reduce(acc * s * up, 1, _add)
            ga = acc * ws
            tl.store(gh_ptr, (ga * up * sg * (1.0 + h * (1.0 - sg))).to(GH.dtype.element_ty), mask=omask)
            tl.store(gh_ptr + n_cols, (ga * s).to(GH.dtype.element_ty), mask=omask)
        else:
            gw = tl.reduce(acc * _act(h, ACT), 1, _add)
            tl.store(gh_ptr, (acc * ws * _act_grad(h, ACT)).to(GH.dtype.element_ty), mask=omask)
        if HAS_B:
            gw += gb
        tl.store(GWP + rows64 * stride_gwp + pid_n, gw, mask=rmask)

    @triton.jit
    def _wgrad_kernel(
        P, PTOK, WS, Q, QTOK, DW, STARTS, ENDS, m_dim, n_dim,
        stride_pm, stride_qm, stride_de, stride_dm,
        GATHER_P: tl.constexpr, SCALE_P: tl.constexpr, GATHER_Q: tl.constexpr,
        Q_ACT: tl.constexpr, PREC: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        """``DW[e] = Σ_s p_sᵀ q_s`` over the sorted slots ``s`` of expert ``e = pid_0``: ``p_s``
        row ``PTOK[s]`` (``GATHER_P``) or ``s`` of ``P``, times the slot weight (``SCALE_P``);
        ``q_s`` likewise, or ``act`` of the pre-activations (``Q_ACT`` ≥ 0; 5: ``swiglu`` of the
        halves at column offset ``n_dim``).  Zeros for an expert with no slots."""
        e = tl.program_id(0)
        start = tl.load(STARTS + e)
        end = tl.load(ENDS + e)
        ms = tl.program_id(1) * BM + tl.arange(0, BM)
        ns = tl.program_id(2) * BN + tl.arange(0, BN)
        mmask = ms < m_dim
        nmask = ns < n_dim
        ms64 = ms.to(tl.int64)
        ns64 = ns.to(tl.int64)
        acc = tl.full((BM, BN), 0.0, tl.float32)
        for r0 in range(start, end, BK):
            rs = r0 + tl.arange(0, BK)
            rmask = rs < end
            if GATHER_P:
                prow = tl.load(PTOK + rs, mask=rmask, other=0).to(tl.int64)
            else:
                prow = rs.to(tl.int64)
            p = tl.load(
                P + prow[None, :] * stride_pm + ms64[:, None], mask=mmask[:, None] & rmask[None, :], other=0.0
            )
            if SCALE_P:
                ws = tl.load(WS + rs, mask=rmask, other=0.0)
                p = (p.to(tl.float32) * ws[None, :]).to(P.dtype.element_ty)
            if GATHER_Q:
                qrow = tl.load(QTOK + rs, mask=rmask, other=0).to(tl.int64)
            else:
                qrow = rs.to(tl.int64)
            qmask = rmask[:, None] & nmask[None, :]
            q_ptr = Q + qrow[:, None] * stride_qm + ns64[None, :]
            q = tl.load(q_ptr, mask=qmask, other=0.0)
            if Q_ACT == 5:
                hq = q.to(tl.float32)
                up = tl.load(q_ptr + n_dim, mask=qmask, other=0.0).to(tl.float32)
                q = (hq * _sigmoid(hq) * up).to(P.dtype.element_ty)
            elif Q_ACT >= 0:
                q = _act(q.to(tl.float32), Q_ACT).to(P.dtype.element_ty)
            acc += tl.dot(p, q, input_precision=PREC)
        ptr = DW + e.to(tl.int64) * stride_de + ms64[:, None] * stride_dm + ns64[None, :]
        tl.store(ptr, acc.to(DW.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def _rowsum_kernel(
        P, PTOK, WS, OUT, STARTS, ENDS, m_dim, stride_pm, stride_oe,
        GATHER_P: tl.constexpr, SCALE_P: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        """``OUT[e] = Σ_s p_s`` over the sorted slots of expert ``e = pid_0`` (rows gathered and
        weighted as in :func:`_wgrad_kernel`): the bias gradients.  Zeros for an idle expert."""
        e = tl.program_id(0)
        start = tl.load(STARTS + e)
        end = tl.load(ENDS + e)
        ms = tl.program_id(1) * BM + tl.arange(0, BM)
        mmask = ms < m_dim
        acc = tl.full((BM,), 0.0, tl.float32)
        for r0 in range(start, end, BK):
            rs = r0 + tl.arange(0, BK)
            rmask = rs < end
            if GATHER_P:
                prow = tl.load(PTOK + rs, mask=rmask, other=0).to(tl.int64)
            else:
                prow = rs.to(tl.int64)
            p = tl.load(
                P + prow[:, None] * stride_pm + ms[None, :], mask=rmask[:, None] & mmask[None, :], other=0.0
            )
            p = p.to(tl.float32)
            if SCALE_P:
                p = p * tl.load(WS + rs, mask=rmask, other=0.0)[:, None]
            acc += tl.reduce(p, 0, _add)
        tl.store(OUT + e.to(tl.int64) * stride_oe + ms, acc.to(OUT.dtype.element_ty), mask=mmask)


# ---------------------------------------------------------------------------------- launchers
def _tiles(dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(BM, BN, BK, num_warps)``: small tiles under the interpreter (tests), else sizes for
    tensor cores (float32 tiles are half as deep: twice the bytes)."""
    if INTERPRET:
        return 16, 16, 16, 1
    return (64, 128, 32, 4) if dtype == torch.float32 else (64, 128, 64, 4)


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision``: float32 as torch would (IEEE unless TF32 is allowed);
    16-bit inputs take Triton's default, which does not apply to them."""
    if dtype != torch.float32:
        return "tf32"
    return "tf32" if torch.get_float32_matmul_precision() != "highest" and not INTERPRET else "ieee"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_table(counts: Tensor, slots: int, bm: int) -> Tensor:
    """``(3, B)`` int32: per row block of ``bm`` sorted slots its expert (-1: an idle program),
    first row and end row, for ``B = ⌈S/bm⌉ + N`` programs (an upper bound: no host sync)."""
    n = counts.numel()
    ends = counts.cumsum(0)
    starts = ends - counts
    nblk = (counts + bm - 1) // bm
    cum = nblk.cumsum(0)
    pid = torch.arange(_cdiv(slots, bm) + n, device=counts.device)
    e = torch.searchsorted(cum, pid, right=True)
    ec = e.clamp(max=n - 1)
    first = cum[ec] - nblk[ec]
    row0 = starts[ec] + (pid - first) * bm
    expert = torch.where(e < n, ec, torch.full_like(ec, -1))
    return torch.stack([expert, row0, ends[ec]]).to(torch.int32).contiguous()


class _Plan:
    """The slot sort and block table of one call."""

    def __init__(self, indices: Tensor, num_experts: int, dtype: torch.dtype) -> None:
        T, K = indices.shape
        self.T, self.K, self.S, self.N = T, K, T * K, num_experts
        order, counts, tokens, _ = sort_slots(indices, num_experts, inverse=False)
        self.order = order
        self.tokens = tokens.to(torch.int32)
        self.counts = counts
        self.bm, self.bn, self.bk, self.warps = _tiles(dtype)
        self.prec = _precision(dtype)
        self.blocks = _block_table(counts, self.S, self.bm)
        self.nblk = self.blocks.shape[1]
        ends = counts.cumsum(0)
        self.ends = ends.to(torch.int32)
        self.starts = (ends - counts).to(torch.int32)


def _first_gemm(
    p: _Plan, x: Tensor, w_in: Tensor, b_in: Tensor | None, act: str, keep_h: bool
) -> tuple[Tensor | None, Tensor]:
    """``(h, a)``: pre-activations ``(S, h_in)`` (``None`` unless ``keep_h``) and activations ``(S, h)``."""
    gated = act == "swiglu"
    h_in, d = w_in.shape[1], w_in.shape[2]
    n_cols = h_in // 2 if gated else h_in
    a = x.new_empty(p.S, n_cols)
    h = x.new_empty(p.S, h_in) if keep_h else a
    grid = (p.nblk, _cdiv(n_cols, p.bn))
    _in_kernel[grid](
        x, p.tokens, w_in, b_in if b_in is not None else w_in, h, a, p.blocks, p.nblk, n_cols, d,
        x.stride(0), w_in.stride(0), w_in.stride(1), b_in.stride(0) if b_in is not None else 0, h.stride(0), a.stride(0),
        ACT=ACT_CODES[act], GATED=gated, STORE_H=keep_h, HAS_B=b_in is not None, PREC=p.prec,
        BM=p.bm, BN=p.bn, BK=p.bk, num_warps=p.warps,
    )  # fmt: skip
    return (h if keep_h else None), a


def _scatter_gemm(
    p: _Plan,
    a: Tensor,
    w: Tensor,
    trans: bool,
    scale: Tensor | None,
    out_rows: int,
    per_slot: bool = False,
    bias: Tensor | None = None,
) -> Tensor:
    """``Σ_k (scale ·) a_s W[e]`` (``W[e]ᵀ`` with ``trans``) added into ``out_rows`` token rows,
    float32 ``(out_rows, n)``; ``per_slot``: the unsummed ``(T·K, n)`` rows in slot order, in
    ``a``'s dtype (as the ``K > 2`` rows before their float32 sum)."""
    if trans:  # W (N, n, k): W[e]ᵀ[k, n] = W[e, n, k]
        n_cols, k_dim, s_k, s_n = w.shape[1], w.shape[2], w.stride(2), w.stride(1)
    else:  # W (N, k, n)
        n_cols, k_dim, s_k, s_n = w.shape[2], w.shape[1], w.stride(1), w.stride(2)
    if per_slot or p.K > 2:
        mode, out = 2, a.new_empty(p.S, n_cols)
    elif p.K == 2:
        mode, out = 1, a.new_zeros(out_rows, n_cols, dtype=torch.float32)
    else:
        mode = 0
        out = a.new_zeros(out_rows, n_cols, dtype=torch.float32)
    grid = (p.nblk, _cdiv(n_cols, p.bn))
    _out_kernel[grid](
        a, w, bias if bias is not None else w, p.tokens, p.order, scale if scale is not None else out, out,
        p.blocks, p.nblk, n_cols, k_dim,
        a.stride(0), w.stride(0), s_k, s_n, bias.stride(0) if bias is not None else 0, out.stride(0),
        MODE=mode, SCALE=scale is not None, HAS_B=bias is not None, PREC=p.prec,
        BM=p.bm, BN=p.bn, BK=p.bk, num_warps=p.warps,
    )  # fmt: skip
    if mode == 2 and not per_slot:
        out = out.view(p.T, p.K, n_cols).sum(1, dtype=torch.float32)
    return out


def _wgrad(
    p: _Plan,
    pm: Tensor,
    q: Tensor,
    out: Tensor,
    gather_p: bool,
    scale: Tensor | None,
    gather_q: bool,
    q_act: int,
) -> Tensor:
    """Every expert's ``Σ_s p_sᵀ q_s`` into ``out (N, m, n)`` (see :func:`_wgrad_kernel`)."""
    m_dim, n_dim = out.shape[1], out.shape[2]
    grid = (p.N, _cdiv(m_dim, p.bm), _cdiv(n_dim, p.bn))
    _wgrad_kernel[grid](
        pm, p.tokens, scale if scale is not None else pm, q, p.tokens, out, p.starts, p.ends, m_dim, n_dim,
        pm.stride(0), q.stride(0), out.stride(0), out.stride(1),
        GATHER_P=gather_p, SCALE_P=scale is not None, GATHER_Q=gather_q, Q_ACT=q_act, PREC=p.prec,
        BM=p.bm, BN=p.bn, BK=p.bk, num_warps=p.warps,
    )  # fmt: skip
    return out


def _rowsums(p: _Plan, pm: Tensor, out: Tensor, gather_p: bool, scale: Tensor | None) -> Tensor:
    """Every expert's ``Σ_s p_s`` into ``out (N, m)`` (:func:`_rowsum_kernel`)."""
    m_dim = out.shape[1]
    _rowsum_kernel[(p.N, _cdiv(m_dim, p.bn))](
        pm, p.tokens, scale if scale is not None else pm, out, p.starts, p.ends, m_dim, pm.stride(0), out.stride(0),
        GATHER_P=gather_p, SCALE_P=scale is not None, BM=p.bn, BK=p.bk, num_warps=p.warps,
    )  # fmt: skip
    return out


class _TritonMLP(torch.autograd.Function):
    """``Σ_k w_k · expert_{i_k}(x)`` by the fused kernels, one autograd node (module docstring).
    First-order only."""

    @staticmethod
    def forward(ctx, x, w_in, w_out, b_in, b_out, weights, indices, act: str, keep: bool):
        x = x.contiguous()
        p = _Plan(indices, w_in.shape[0], x.dtype)
        w_sorted = weights.reshape(-1).index_select(0, p.order).to(torch.float32).contiguous()
        h, a = _first_gemm(p, x, w_in, b_in, act, keep)
        out = _scatter_gemm(p, a, w_out, True, w_sorted, p.T, bias=b_out).to(x.dtype)
        if keep:
            ctx.save_for_backward(x, w_in, w_out, b_out, w_sorted, h)
            ctx.plan, ctx.act, ctx.weights_dtype = p, act, weights.dtype
            ctx.has_b_in = b_in is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        x, w_in, w_out, b_out, w_sorted, h = ctx.saved_tensors
        p, act = ctx.plan, ctx.act
        need_x, need_w_in, need_w_out, need_b_in, need_b_out, need_weights = ctx.needs_input_grad[:6]
        grad = grad.contiguous().to(x.dtype)
        gated = act == "swiglu"
        n_cols = w_out.shape[2]  # h
        d = w_out.shape[1]
        g_h = torch.empty_like(h)
        n_blocks = _cdiv(n_cols, p.bn)
        gwp = torch.empty(p.S, n_blocks, device=x.device, dtype=torch.float32)
        _grad_h_kernel[(p.nblk, n_blocks)](
            grad, p.tokens, w_sorted, w_out, b_out if b_out is not None else w_out, h, g_h, gwp, p.blocks, p.nblk,
            n_cols, d,
            grad.stride(0), w_out.stride(0), w_out.stride(1), b_out.stride(0) if b_out is not None else 0,
            h.stride(0), g_h.stride(0), gwp.stride(0),
            ACT=ACT_CODES[act], GATED=gated, HAS_B=b_out is not None, PREC=p.prec,
            BM=p.bm, BN=p.bn, BK=p.bk, num_warps=p.warps,
        )  # fmt: skip
        g_weights = g_x = g_w_in = g_w_out = g_b_in = g_b_out = None
        if need_weights:
            g_sorted = gwp.sum(1)
            g_weights = torch.empty_like(g_sorted).index_copy_(0, p.order, g_sorted)
            g_weights = g_weights.view(p.T, p.K).to(ctx.weights_dtype)
        if need_w_out:  # Σ_s (w_s g_t)ᵀ act(h_s): (N, d, h)
            out = torch.empty_like(w_out, memory_format=torch.contiguous_format)
            g_w_out = _wgrad(p, grad, h, out, True, w_sorted, False, ACT_CODES[act])
        if need_w_in:  # Σ_s ∂h_sᵀ x_t: (N, h_in, d)
            out = torch.empty_like(w_in, memory_format=torch.contiguous_format)
            g_w_in = _wgrad(p, g_h, x, out, False, None, True, -1)
        if need_x:  # Σ_k ∂h_s W_in[e]
            g_x = _scatter_gemm(p, g_h, w_in, False, None, p.T).to(x.dtype)
        if need_b_out and b_out is not None:  # Σ_s w_s g_t
            g_b_out = _rowsums(p, grad, torch.empty_like(b_out), True, w_sorted)
        if need_b_in and ctx.has_b_in:  # Σ_s ∂h_s
            g_b_in = _rowsums(p, g_h, g_h.new_empty(p.N, g_h.shape[1]), False, None)
        return g_x, g_w_in, g_w_out, g_b_in, g_b_out, g_weights, None, None, None


# ---------------------------------------------------------------------------------- entry points
def _check(x: Tensor, activation: str, bias: bool) -> None:
    reason = unavailable_reason(x.device, x.dtype)
    if reason is None and activation not in ACT_CODES:
        reason = f"it supports the activations {sorted(ACT_CODES)}"
    if reason is not None:
        raise ValueError(
            f"impl='triton' is not available for device={x.device.type}, dtype={x.dtype}, "
            f"activation={activation!r}, bias={bias}: {reason}; use impl='loop', 'grouped' or 'auto'"
        )


def triton_experts(
    x: Tensor,
    indices: Tensor,
    weights: Tensor,
    w_in: Tensor,
    w_out: Tensor,
    b_in: Tensor | None,
    b_out: Tensor | None,
    activation: str,
) -> Tensor:
    """``Σ_k w_k · expert_{i_k}(x)`` for ``x (T, d)``, ``indices (T, K)``, ``weights (T, K)`` by
    the fused Triton kernels (module docstring), the experts' weights ``w_in (N, h_in, d)``,
    ``w_out (N, d, h)`` and biases ``(N, ·)`` as :class:`moelab.experts.kernels.ExpertWeights`
    holds them; the ``"triton"`` entry of :data:`moelab.experts.KERNELS`.

    Raises:
        ValueError: triton is missing, the device or dtype is not supported, or the activation
            is one the kernels lack.
    """
    _check(x, activation, b_in is not None)
    params = (w_in, w_out, b_in, b_out)
    keep = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weights, *params))
    return _TritonMLP.apply(x, *params, weights, indices, activation, keep)


@torch.no_grad()
def expert_outputs(
    x: Tensor,
    indices: Tensor,
    w_in: Tensor,
    w_out: Tensor,
    b_in: Tensor | None,
    b_out: Tensor | None,
    activation: str,
    keep_h: bool = False,
) -> tuple[Tensor | None, Tensor]:
    """Each chosen expert's own output, without autograd: ``(h, y)`` with ``y (T, K, d)`` the
    unweighted ``expert_{i_k}(x_t)`` and ``h`` (``keep_h``) the pre-activations ``(T, K, h_in)``.

    With ``indices = arange(N)`` for every token this is the competition's pass (every expert on
    every token, CompeteSMoE (2024) §3.1) as one grouped pass over the ``T·N`` slots: the tokens
    are read by index, not copied ``N`` times.
    """
    _check(x, activation, b_in is not None)
    x = x.contiguous()
    T, K = indices.shape
    p = _Plan(indices, w_in.shape[0], x.dtype)
    h, a = _first_gemm(p, x, w_in, b_in, activation, keep_h)
    y = _scatter_gemm(p, a, w_out, True, None, T, per_slot=True, bias=b_out).to(x.dtype).view(T, K, -1)
    if h is not None:  # sorted-slot order back to (token, k) order
        h = torch.empty_like(h).index_copy_(0, p.order, h).view(T, K, -1)
    return h, y
