"""The kernels of :class:`moelab.ExpertBank`'s forward, by name, and the rule that picks one:
:data:`KERNELS` maps each name (``loop``, ``grouped``, ``stream``, ``triton``) to one function of
the tokens, the routing and the experts' weight tensors (:class:`ExpertWeights`), so nothing here
knows the bank; ``impl="auto"`` runs the kernel :func:`choose_kernel` names, a pure rule of the
device, the slots per expert, autograd, the torch threads and the OpenMP wait policy.  No forward
measures anything: timing the candidates (:func:`measure`) is an explicit step the user takes,
:func:`moelab.experts.autotune`, whose picks later forwards look up by :class:`ShapeClass`.
docs/kernels.md describes each kernel and when ``auto`` picks it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..functional import activation as get_activation
from .dispatch import dispatch, sort_slots
from .threads import over_experts

__all__ = [
    "ALL_PASSES",
    "IMPLS",
    "KERNELS",
    "LOOP_ROWS_PER_EXPERT",
    "STREAM_ROWS_PER_EXPERT",
    "ExpertWeights",
    "Kernel",
    "Measurement",
    "Probe",
    "ShapeClass",
    "WinnerMLP",
    "all_experts",
    "autocast_dtype",
    "candidates",
    "check_picks",
    "choose_kernel",
    "fused",
    "grouped",
    "grouped_mm_available",
    "grouped_ok",
    "loop",
    "measure",
    "omp_wait_policy",
    "padded_rows",
    "random_probe",
    "rounds_alike",
    "rule_kernel",
    "run_kernel",
    "shape_class",
    "stream",
]


class ExpertWeights(NamedTuple):
    """The weight tensors of N MLP experts, expert ``e`` computing
    ``W_out[e] · act(W_in[e] x + b_in[e]) + b_out[e]`` (the ``nn.Linear`` layout per expert)."""

    w_in: Tensor  #: ``(N, h_in, d)``; ``h_in = 2h`` laid out ``[gate | up]`` for ``swiglu``, else ``h``
    w_out: Tensor  #: ``(N, d, h)``
    b_in: Tensor | None  #: ``(N, h_in)`` or ``None``
    b_out: Tensor | None  #: ``(N, d)`` or ``None``
    activation: str  #: a name of :data:`moelab.functional.ACTIVATIONS`

    @property
    def num_experts(self) -> int:
        return self.w_in.shape[0]

    @property
    def d_model(self) -> int:
        return self.w_in.shape[2]

    @property
    def d_hidden(self) -> int:
        return self.w_out.shape[2]

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        """The weights and the biases there are."""
        return tuple(t for t in (self.w_in, self.w_out, self.b_in, self.b_out) if t is not None)

    def to(self, dtype: torch.dtype) -> ExpertWeights:
        """The same experts with every tensor cast to ``dtype`` (a differentiable cast)."""
        w = (None if t is None else t.to(dtype) for t in (self.w_in, self.w_out, self.b_in, self.b_out))
        return ExpertWeights(*w, self.activation)


#: ``kernel(x (T, d), indices (T, K), weights (T, K), experts) -> (T, d)``: ``Σ_k w_k · expert_{i_k}(x)``
Kernel = Callable[[Tensor, Tensor, Tensor, ExpertWeights], Tensor]


def autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The dtype ``torch.autocast`` runs the matmuls of ``x`` in: ``None`` outside autocast for
    ``x``'s device and for the float64 tensors autocast leaves alone."""
    device = x.device.type
    if x.dtype == torch.float64 or not x.is_floating_point() or not torch.amp.is_autocast_available(device):
        return None  # float64 autocast leaves alone; a device autocast does not know (meta) has none
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def run_kernel(name: str, x: Tensor, indices: Tensor, weights: Tensor, experts: ExpertWeights) -> Tensor:
    """``KERNELS[name](x, indices, weights, experts)``, under ``torch.autocast`` in its dtype.

    Autocast casts the inputs of the ops on its lists (``mm``, ``addmm``, ``linear``, ``bmm``), not
    of ``grouped_mm``, Triton kernels or ``out=`` variants, so each kernel would compute in another
    dtype, or mix two and fail.  Under autocast the tokens and the experts' weights are therefore
    cast to its dtype here (the casts are differentiable: the weights' gradients return in their
    own dtype, as an ``nn.Linear``'s do), the kernel runs with autocast off, and the output returns
    in ``x``'s dtype, as :func:`padded_rows` does: every kernel, on every device, computes the
    experts as every other ``nn.Linear`` under autocast does (docs/kernels.md, "Autocast").  The
    routing weights are the kernel's to cast (each combines in its rows' dtype)."""
    dtype = autocast_dtype(x)
    if dtype is None:
        return KERNELS[name](x, indices, weights, experts)
    # also where x is already in it (an autocast Linear's output): the float32 weights are cast
    with torch.autocast(x.device.type, enabled=False):
        return KERNELS[name](x.to(dtype), indices, weights, experts.to(dtype)).to(x.dtype)


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the kernels compute ``x`` in: autocast's (:func:`autocast_dtype`), else ``x``'s."""
    return autocast_dtype(x) or x.dtype


def _tracks_grad(*tensors: Tensor) -> bool:
    """Whether a call on ``tensors`` records autograd: grad mode on and one of them requiring it."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def loop(x: Tensor, indices: Tensor, weights: Tensor, experts: ExpertWeights) -> Tensor:
    """``"loop"``: sort once, gather, every expert on its rows in one autograd node
    (:func:`loop_rows`), combine.  Runs everywhere (any device and dtype)."""
    track = _tracks_grad(x, weights, *experts.tensors)
    run = lambda xs, slots: loop_rows(xs, slots.counts.tolist(), experts)  # the one host sync
    return dispatch(x, indices, weights, experts.num_experts, run, track)


def grouped(x: Tensor, indices: Tensor, weights: Tensor, experts: ExpertWeights) -> Tensor:
    """``"grouped"``: sort once, gather, the experts by ``grouped_mm`` (:func:`grouped_rows`, no
    host sync), combine.

    Raises:
        ValueError: ``grouped_mm`` cannot run for ``x``'s device and dtype, or the widths are not
            16-byte aligned (:func:`grouped_ok`).
    """
    _check_grouped(x, experts)
    track = _tracks_grad(x, weights, *experts.tensors)
    run = lambda xs, slots: grouped_rows(xs, slots.counts, slots.order, indices, experts)
    return dispatch(x, indices, weights, experts.num_experts, run, track)


def stream(x: Tensor, indices: Tensor, weights: Tensor, experts: ExpertWeights) -> Tensor:
    """``"stream"`` (CPU): each expert gathers its tokens, runs, and adds its weighted output to them.

    No ``(T·K, d)`` tensor exists: every expert's rows, hidden activations and outputs are
    temporaries of its own size that the allocator reuses (a fresh buffer of tens of MB costs
    more in page faults than the copy into it).  The slots are sorted once — on the host when
    there are at most N of them (decoding: a few numbers sort faster in Python than by tensor
    ops), else by :func:`sort_slots` — and the outputs are summed into the tokens by
    ``index_add_`` expert after expert, in slot order: deterministic on the CPU.  At a few tokens
    each touched expert reads its weights once: the bound (``moelab bench suite``).  Without
    autograd each expert runs on its slices of the stacked weights; with it, on the stacked
    weights unbound once.

    Raises:
        ValueError: ``x`` is not on the CPU (``index_add_`` adds with atomics elsewhere).
    """
    if x.device.type != "cpu":
        raise ValueError(
            f"impl='stream' is not available for device={x.device.type}: it runs on the CPU only "
            "(index_add_ would add with atomics, nondeterministically); use impl='loop', 'grouped' or 'auto'"
        )
    T, K = indices.shape
    N = experts.num_experts
    if indices.numel() <= N:
        flat = indices.reshape(-1).tolist()  # the one host sync
        order_list = sorted(range(len(flat)), key=flat.__getitem__)  # stable
        counts = [0] * N
        for e in flat:
            counts[e] += 1
        order = torch.tensor(order_list, dtype=torch.int64, device=x.device)
    else:
        order, counts_t, _, _ = sort_slots(indices, N, inverse=False)
        counts = counts_t.tolist()  # the one host sync
    tokens = order // K
    w_sorted = weights.reshape(-1).index_select(0, order).to(x.dtype).unsqueeze(-1)
    track = _tracks_grad(x, weights, *experts.tensors)
    act = get_activation(experts.activation)
    params = (experts.w_in, experts.w_out, experts.b_in, experts.b_out)
    if track:  # never index a stacked weight per expert under autograd: unbind once
        params = tuple(p.unbind(0) if p is not None else [None] * N for p in params)
    out = x.new_zeros(T, experts.d_model)
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        stop = start + c
        rows = tokens[start:stop]
        y = expert_mlp(x.index_select(0, rows), *(None if p is None else p[e] for p in params), act)
        y = y * w_sorted[start:stop] if track else y.mul_(w_sorted[start:stop])
        out.index_add_(0, rows, y)
        start = stop
    return out


def fused(x: Tensor, indices: Tensor, weights: Tensor, experts: ExpertWeights) -> Tensor:
    """``"triton"``: the fused gather → grouped GEMM → weighted scatter kernels of
    :mod:`moelab.experts.triton_kernels` (imported here, at the first call).

    Raises:
        ValueError: triton is not installed, or the device, dtype or activation is not
            supported (:func:`moelab.experts.triton_kernels.unavailable_reason`).
    """
    from .triton_kernels import triton_experts

    return triton_experts(x, indices, weights, *experts)


#: the ways :func:`all_experts` runs every expert on every token as one grouped pass
ALL_PASSES = ("grouped", "triton")


@torch.no_grad()
def all_experts(x: Tensor, experts: ExpertWeights, impl: str) -> tuple[Tensor, Tensor]:
    """Every expert on every token ``x (t, d)`` as one grouped pass, without autograd:
    pre-activations ``(t, N, h_in)`` and outputs ``(t, N, d)`` — what
    :meth:`ExpertBank._all_experts` computes by two einsums, for the competition's pass
    (CompeteSMoE (2024) §3.1).

    ``impl="grouped"``: the ``t·N`` slots sorted by expert are the tokens repeated N times (one
    ``(N·t, d)`` copy) through two ``grouped_mm``; ``impl="triton"``: the fused kernels with
    ``indices = arange(N)`` for every token, which read the tokens by index (no copy;
    :func:`moelab.experts.triton_kernels.expert_outputs`).

    Raises:
        ValueError: ``impl`` is not in :data:`ALL_PASSES`, or that kernel cannot run for ``x``.
    """
    t, n = x.shape[0], experts.num_experts
    if impl == "triton":
        from .triton_kernels import expert_outputs

        return expert_outputs(x, torch.arange(n, device=x.device).expand(t, n), *experts, keep_h=True)
    if impl != "grouped":
        raise ValueError(f"impl={impl!r} is not allowed; expected one of {list(ALL_PASSES)}")
    _check_grouped(x, experts)
    xs = x.repeat(n, 1)  # expert-major: expert e's rows are xs[e·t : (e+1)·t]
    offs = torch.arange(1, n + 1, device=x.device, dtype=torch.int32) * t
    ids = None
    if experts.b_in is not None or experts.b_out is not None:
        ids = torch.arange(n, device=x.device).repeat_interleave(t)
    w_in, w_out, b_in, b_out, name = experts
    y, h, _ = _grouped_forward(xs, w_in, w_out, b_in, b_out, offs, ids, name, get_activation(name))
    return h.view(n, t, -1).transpose(0, 1), y.view(n, t, -1).transpose(0, 1)


#: name → implementation of :meth:`ExpertBank.forward`; ``impl=name`` runs exactly ``KERNELS[name]``
KERNELS: dict[str, Kernel] = {"loop": loop, "grouped": grouped, "stream": stream, "triton": fused}

#: the values of ``ExpertBank(impl=...)``: ``"auto"`` (:func:`choose_kernel`) and the kernels
IMPLS = ("auto", *KERNELS)


# ------------------------------------------------------------------ choosing the kernel
#: on the CPU with one torch thread, ``"auto"`` trains with ``"loop"`` from this many token slots
#: per expert on (``T·K/N``): there the loop's activation on each expert's rows while they are in
#: cache beats ``grouped_mm``'s one activation pass over all ``T·K`` rows; below it
#: ``grouped_mm``'s C++ loop over the experts beats the Python one.  With more threads the loop runs
#: whole experts on each thread (:mod:`moelab.experts.threads`) and is ahead at every size
#: measured (``moelab bench layer``, docs/performance.md)
LOOP_ROWS_PER_EXPERT = 256
#: on the CPU with one torch thread, ``"auto"`` infers with ``"stream"`` from this many slots
#: per expert on (no ``(T·K, d)`` buffers; below it ``grouped_mm`` wins)
STREAM_ROWS_PER_EXPERT = 256


def omp_wait_policy() -> str:
    """The OpenMP wait policy of this process's torch threads as its environment sets it:
    ``"passive"`` (idle workers sleep at a barrier), ``"active"`` (they spin) or ``"default"``
    (``OMP_WAIT_POLICY`` unset: libgomp spins for a while, then sleeps).  OpenMP reads the variable
    when it starts, so a change later in the process does not count: set it before starting Python."""
    value = os.environ.get("OMP_WAIT_POLICY", "").strip().lower()
    return value if value in ("passive", "active") else "default"


class ShapeClass(NamedTuple):
    """What :func:`autotune <moelab.experts.autotune>` measures once and :func:`choose_kernel`
    looks its pick up by (:func:`shape_class`)."""

    device: str
    dtype: torch.dtype
    autocast: torch.dtype | None  #: the autocast dtype, ``None`` outside autocast
    grad: bool  #: training (autograd tracked) or not
    threads: int  #: torch threads
    wait_policy: str  #: :func:`omp_wait_policy`
    d_model: int
    d_hidden: int
    num_experts: int
    top_k: int
    tokens: int  #: the number of tokens rounded up to a power of two

    def describe(self) -> str:
        """One line: ``train, cpu float32, 2 threads (wait default), T<=64 d=8 h=16 N=4 K=2``."""
        dtype = str(self.dtype).removeprefix("torch.")
        autocast = "" if self.autocast is None else f" autocast {str(self.autocast).removeprefix('torch.')}"
        return (
            f"{'train' if self.grad else 'infer'}, {self.device} {dtype}{autocast}, {self.threads} "
            f"thread{'s' if self.threads != 1 else ''} (wait {self.wait_policy}), T<={self.tokens} "
            f"d={self.d_model} h={self.d_hidden} N={self.num_experts} K={self.top_k}"
        )


def shape_class(x: Tensor, top_k: int, experts: ExpertWeights, grad: bool) -> ShapeClass:
    """The :class:`ShapeClass` of a call on ``x (T, d)`` routed to ``top_k`` of the ``experts``,
    with (``grad``) or without autograd: device, dtype, the autocast dtype (``None`` outside
    autocast), training or not, torch threads, the wait policy, the widths and N, K, and the number
    of tokens rounded up to a power of two."""
    tokens = 1 << max(0, int(x.shape[0]) - 1).bit_length()
    device = x.device.type
    autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    return ShapeClass(device, x.dtype, autocast, grad, torch.get_num_threads(), omp_wait_policy(),
                      experts.d_model, experts.d_hidden, experts.num_experts, top_k, tokens)  # fmt: skip


def check_picks(picks: Mapping[ShapeClass, str]) -> dict[ShapeClass, str]:
    """``picks`` (shape class → kernel name) checked: each key a :class:`ShapeClass`, each name one
    of :data:`KERNELS`; a copy is returned.

    Raises:
        ValueError: a pick is not a name of :data:`KERNELS`, or a key is not a :class:`ShapeClass`.
    """
    for key, name in picks.items():
        if not isinstance(key, ShapeClass):
            raise ValueError(f"shape class {key!r} is not allowed; expected a ShapeClass (shape_class(...))")
        if name not in KERNELS:
            raise ValueError(f"kernel {name!r} is not allowed; expected one of {sorted(KERNELS)}")
    return dict(picks)


def choose_kernel(
    x: Tensor, top_k: int, experts: ExpertWeights, grad: bool, tuned: Mapping[ShapeClass, str] | None = None
) -> str:
    """The kernel ``impl="auto"`` runs for ``x (T, d)`` routed to ``top_k`` of the ``experts``,
    with (``grad``) or without autograd.

    A pure rule (:func:`rule_kernel`) of the device, dtype, autocast dtype, slots per expert,
    autograd, torch threads and OpenMP wait policy: it reads no clock and measures nothing.  The
    one exception is the user's: ``tuned``, the picks :func:`moelab.experts.autotune` measured for
    the bank (its ``tuned``): for their shape classes the kernel picked — looked up, not measured,
    and never while torch.compile traces (the rule then).
    """
    tracing = torch.compiler.is_compiling()
    if not tracing and tuned:  # first: a traced graph neither reads nor guards on the picks
        pick = tuned.get(shape_class(x, top_k, experts, grad))
        if pick is not None:
            return pick
    return _rule(x, top_k, experts, grad, tracing)


def rule_kernel(x: Tensor, top_k: int, experts: ExpertWeights, grad: bool) -> str:
    """The kernel ``impl="auto"``'s rule names for ``x``, whatever :func:`moelab.experts.autotune`
    picked (docs/kernels.md gives the rule and performance.md the timings behind it).

    On the CPU: ``"stream"`` for decoding-sized inference (``T·K ≤ N``) and wherever
    ``grouped_mm`` cannot run without autograd.  With several torch threads whose idle workers
    sleep (``OMP_WAIT_POLICY=PASSIVE``), ``"loop"`` (whole experts spread over the threads); with
    spinning workers ``"grouped"`` in training and ``"stream"`` in inference.  With one thread,
    inference takes ``"stream"`` from :data:`STREAM_ROWS_PER_EXPERT` slots per expert on and
    training ``"loop"`` from :data:`LOOP_ROWS_PER_EXPERT` on.  Otherwise, and on other devices,
    ``"grouped"`` wherever :func:`grouped_ok` (no host sync), else ``"loop"`` (float64, unaligned
    sizes, older torch).  While torch.compile traces, never ``"stream"`` (its host sync would break
    the graph) and never the threaded loop (``"grouped"`` where it can run).
    """
    return _rule(x, top_k, experts, grad, torch.compiler.is_compiling())


def _rule(x: Tensor, top_k: int, experts: ExpertWeights, grad: bool, tracing: bool) -> str:
    cpu = x.device.type == "cpu" and not tracing
    slots, n = x.shape[0] * top_k, experts.num_experts
    # on the CPU the rule takes grouped_mm in float32 only, where it was timed; while tracing it is the
    # one kernel without a host sync in every dtype
    grouped_runs = grouped_ok(x, experts) and not (cpu and _compute_dtype(x) != torch.float32)
    one = cpu and torch.get_num_threads() == 1  # not read while tracing: a graph break
    if not grad and cpu:
        decoding = slots <= n
        large = slots >= STREAM_ROWS_PER_EXPERT * n and one
        # several threads whose idle workers spin (the default policy): the stream's per-expert work
        # is ahead of one grouped pass and of the threaded loop (docs/performance.md)
        spinning = not one and omp_wait_policy() != "passive"
        if not grouped_runs or decoding or large or spinning:
            return "stream"
    if not grouped_runs:
        return "loop"
    if cpu and not one:  # the threaded loop wins only where idle OpenMP workers sleep
        return "loop" if omp_wait_policy() == "passive" else "grouped"
    if cpu and slots >= LOOP_ROWS_PER_EXPERT * n:
        return "loop"
    return "grouped"


def candidates(x: Tensor, experts: ExpertWeights, grad: bool) -> list[str]:
    """The kernels :func:`moelab.experts.autotune` measures for ``x``: ``"loop"`` always,
    ``"grouped"`` where it runs, ``"stream"`` for inference on the CPU (``"triton"`` is never
    chosen by ``auto``)."""
    names = ["loop"]
    if grouped_ok(x, experts):
        names.append("grouped")
    if not grad and x.device.type == "cpu":
        names.append("stream")
    return names


def rounds_alike(a: str, b: str, x: Tensor, grad: bool) -> bool:
    """Whether kernels ``a`` and ``b`` give the same bits on every routing of ``x``'s shape class,
    by construction (not by a probe): :func:`moelab.experts.autotune` lets the clock choose only
    among kernels that round as the rule's.

    Only ``"loop"`` and ``"stream"`` in inference on the CPU with one torch thread (outside
    autocast) qualify: both run each expert's rows through the same ``addmm`` / ``mm`` on one
    thread and add each token's weighted outputs into zeros in expert order.  With several threads
    the loop runs each expert's GEMMs on one thread of its own and the stream on all of them (a
    GEMM's rounding may depend on its threads); ``grouped_mm`` has kernels of its own (on the CPU
    too: other bits at some widths); in training the loop's hand-written backward and the others'
    differ in how they sum the bias gradients and reduce the weight gradients."""
    if a == b:
        return True
    one_thread = (
        x.device.type == "cpu" and torch.get_num_threads() == 1 and not torch.is_autocast_enabled("cpu")
    )
    return not grad and one_thread and {a, b} == {"loop", "stream"}


class Probe(NamedTuple):
    """One call of the experts to measure on: tokens, routing and the experts' weights."""

    x: Tensor  #: ``(T, d)``
    indices: Tensor  #: ``(T, K)`` int64
    weights: Tensor  #: ``(T, K)``
    experts: ExpertWeights


class Measurement(NamedTuple):
    """What :func:`measure` found for one shape class."""

    pick: str  #: the fastest by median of those that competed (ties: the earlier candidate)
    medians: dict[str, float]  #: seconds of the clock, per candidate timed
    excluded: tuple[str, ...]  #: candidates whose numbers differed from the reference's on a probe
    #: candidates timed but never picked: they do not round as the reference by construction
    #: (:func:`rounds_alike`), so a pick among them would depend on the clock's mood
    other_rounding: tuple[str, ...] = ()


def random_probe(x: Tensor, top_k: int, experts: ExpertWeights) -> Probe:
    """Random tokens of ``x``'s shape (not ``x``: it may hold NaNs) with a random routing: uneven
    rows per expert and weights that round, so that a kernel whose sums or products differ from
    the loop's in any bit shows it; seeded, so the same for every call."""
    t, n = x.shape[0], experts.num_experts
    gen = torch.Generator().manual_seed(0)
    indices = torch.rand(t, n, generator=gen).topk(top_k, dim=1).indices.to(x.device)
    weights = torch.rand(t, top_k, generator=gen).softmax(dim=1).to(x.device, x.dtype)
    tokens = torch.randn(x.shape, generator=gen).to(x.device, x.dtype)
    return Probe(tokens, indices, weights, experts)


def measure(
    probes: Sequence[Probe],
    grad: bool,
    *,
    repeats: int = 5,
    clock: Callable[[], float] | None = None,
    reference: str = "loop",
) -> Measurement:
    """Time the :func:`candidates` on ``probes[0]`` and pick the fastest of those that round as
    ``reference`` (the rule's kernel) by construction (:func:`rounds_alike`) and whose results
    equal its own bit for bit on every probe: the outputs and, with ``grad``, the gradients of the
    tokens, of the routing weights and of the experts' weights (for one fixed random output
    gradient).  So the pick is one of kernels that compute the same numbers on every routing:
    whichever the clock favours, a run computes the same.  The candidates that round otherwise
    are timed too, for the report (a user may fix one with ``impl=``), and never picked.  One call
    of each candidate on each probe first (the warm-up, and the check), then ``repeats``
    interleaved rounds on ``probes[0]`` (forward and backward with ``grad``); the fastest by
    median, ties to the earlier candidate.  ``clock`` (default ``time.perf_counter``, read at the
    call) is read around each timed call only.  Runs under its own saved-tensor hooks, so an
    enclosing activation checkpoint does not see the probes' autograd graphs.  Called by
    :func:`moelab.experts.autotune`, never by a forward; the probes of one call share a
    :class:`ShapeClass`, and run in the caller's autocast state.
    """
    clock = clock or time.perf_counter
    first = probes[0]
    names = candidates(first.x, first.experts, grad)
    if reference not in names:
        raise ValueError(f"reference={reference!r} is not allowed; expected one of the candidates {names}")
    names = [reference] + [name for name in names if name != reference]
    alike = [name for name in names if rounds_alike(reference, name, first.x, grad)]
    other = [name for name in names if name not in alike]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        runs = [_runner(probe, grad, clock) for probe in probes]
        same = list(alike)
        for run in runs:
            reference_results = run(reference)[1]
            same = [reference] + [name for name in same[1:] if _identical(run(name)[1], reference_results)]
            for name in other:  # the warm-up of those timed for the report only
                run(name)
        timed = same + other
        times: dict[str, list[float]] = {name: [] for name in timed}
        for _ in range(repeats):
            for name in timed:
                times[name].append(runs[0](name)[0])
    median = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
    pick = min(same, key=median.__getitem__)
    excluded = tuple(name for name in alike if name not in same)
    return Measurement(pick, median, excluded, tuple(other))


def _runner(probe: Probe, grad: bool, clock: Callable[[], float]):
    """``run(name) -> (elapsed, results)``: one call of ``KERNELS[name]`` on ``probe`` (detached
    copies of its tensors as leaves) with, under ``grad``, one backward."""
    params = [w.detach().requires_grad_(grad) if w is not None else None for w in probe.experts[:4]]
    experts = ExpertWeights(*params, probe.experts.activation)
    leaves = [p for p in params if p is not None]
    tokens, weights = probe.x.detach(), probe.weights.detach()
    out_grad = None
    if grad:
        gen = torch.Generator().manual_seed(1)
        out_grad = torch.randn(tokens.shape, generator=gen).to(tokens.device, tokens.dtype)

    def run(name: str) -> tuple[float, list[Tensor | None]]:
        inp = tokens.clone().requires_grad_(grad)
        w = weights.clone().requires_grad_(grad and weights.is_floating_point())
        for p in leaves:
            p.grad = None
        with torch.set_grad_enabled(grad):
            start = clock()
            y = run_kernel(name, inp, probe.indices, w, experts)
            if grad:
                y.backward(out_grad.to(y.dtype))
            if inp.device.type == "cuda":
                torch.cuda.synchronize(inp.device)
            elapsed = clock() - start
        grads = [inp.grad, w.grad] + [p.grad for p in leaves] if grad else []
        return elapsed, [y.detach(), *grads]

    return run


def _identical(results: list[Tensor | None], reference: list[Tensor | None]) -> bool:
    return all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(results, reference, strict=True)
    )


def grouped_aligned(dtype: torch.dtype, *widths: int) -> bool:
    """Whether the ``widths`` (``d_model``, ``d_hidden``) give ``grouped_mm`` the 16-byte aligned
    row strides it requires (multiples of 4 in float32, of 8 in bfloat16 / float16)."""
    per = 16 // torch.empty((), dtype=dtype).element_size()
    return all(w % per == 0 for w in widths)


def grouped_ok(x: Tensor, experts: ExpertWeights) -> bool:
    """Whether the ``"grouped"`` kernel runs for ``x`` and ``experts`` (device, the dtype it computes
    in — autocast's under autocast, :func:`run_kernel` — and alignment)."""
    dtype = _compute_dtype(x)
    return grouped_mm_available(x.device, dtype) and grouped_aligned(dtype, experts.d_model, experts.d_hidden)


# ------------------------------------------------------------------ the experts on sorted rows
def expert_mlp(
    x: Tensor, w_in: Tensor, w_out: Tensor, b_in: Tensor | None, b_out: Tensor | None, act
) -> Tensor:
    """One expert ``W_out · act(W_in x + b_in) + b_out`` on tokens ``x (T, d)`` → ``(T, d)``."""
    return F.linear(act(F.linear(x, w_in, b_in)), w_out, b_out)


def padded_rows(xs: Tensor, experts: ExpertWeights) -> Tensor:
    """Every expert on its ``C`` rows of the padded layout ``xs (N, C, d)`` → ``(N, C, d)``
    (``MoE(pad_to_capacity=True)``): two batched matmuls of a shape fixed by ``C``, the same
    whatever the routing, with plain autograd (the padding rows get no gradient: they are
    never combined).  In ``xs``' dtype, as every kernel (under autocast the matmuls run in its
    dtype and the outputs return to ``xs``')."""
    w_in, w_out, b_in, b_out, name = experts
    h = torch.bmm(xs, w_in.transpose(1, 2))
    if b_in is not None:
        h = h + b_in.unsqueeze(1)
    y = torch.bmm(get_activation(name)(h), w_out.transpose(1, 2))
    if b_out is not None:
        y = y + b_out.unsqueeze(1)
    return y.to(xs.dtype)


def loop_rows(xs: Tensor, counts: Sequence[int], experts: ExpertWeights) -> Tensor:
    """Every expert on its contiguous rows of the expert-sorted tokens ``xs (S, d)`` → ``(S, d)``
    (:class:`_ExpertMLP`; the plain forward without autograd)."""
    w_in, w_out, b_in, b_out, name = experts
    args = (b_in, b_out, list(counts), name, get_activation(name))
    if _tracks_grad(xs, *experts.tensors):
        return _ExpertMLP.apply(xs, w_in, w_out, *args)  # (S, d)
    return _loop_forward(xs, w_in, w_out, *args, keep=False)[0]


def grouped_rows(
    xs: Tensor, counts: Tensor, order: Tensor, indices: Tensor, experts: ExpertWeights
) -> Tensor:
    """Every expert on its contiguous rows of ``xs (S, d)`` by ``grouped_mm`` → ``(S, d)``:
    :class:`_GroupedMLP` eagerly, the traceable custom ops while torch.compile traces."""
    w_in, w_out, b_in, b_out, name = experts
    act = get_activation(name)
    offs = counts.cumsum(0).to(torch.int32)
    ids = None
    if b_in is not None or b_out is not None:
        ids = indices.reshape(-1).index_select(0, order)  # expert of each sorted slot
    if not torch.compiler.is_compiling():
        args = (b_in, b_out, offs, ids, name, act)
        if not _tracks_grad(xs, *experts.tensors):
            return _grouped_forward(xs, w_in, w_out, *args)[0]
        return _GroupedMLP.apply(xs, w_in, w_out, *args)
    # traced: composed of the custom ops, which inductor fuses with the activation
    h = _grouped_mm_nt(xs, w_in, offs)  # (S, h_in)
    if b_in is not None:
        h = h + b_in.index_select(0, ids)
    y = _grouped_mm_nt(act(h), w_out, offs)  # (S, d)
    if b_out is not None:
        y = y + b_out.index_select(0, ids)
    return _ContiguousGrad.apply(y)


def _check_grouped(x: Tensor, experts: ExpertWeights) -> None:
    if not grouped_mm_available(x.device, x.dtype):
        raise ValueError(
            f"impl='grouped' is not available for device={x.device.type}, dtype={x.dtype} with "
            f"torch {torch.__version__}; use impl='loop' or 'auto'"
        )
    if not grouped_aligned(x.dtype, experts.d_model, experts.d_hidden):
        raise ValueError(
            f"impl='grouped' needs d_model and d_hidden to be multiples of "
            f"{16 // x.element_size()} for dtype={x.dtype} (16-byte aligned strides); got "
            f"d_model={experts.d_model}, d_hidden={experts.d_hidden}; use impl='loop' or 'auto'"
        )


def _grouped_mm_fn():
    fn = getattr(F, "grouped_mm", None)
    return fn if fn is not None else getattr(torch, "_grouped_mm", None)


_GROUPED_MM = _grouped_mm_fn()


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``grouped_mm`` runs for this device and dtype with this torch.

    CPU kernels exist from torch 2.9 (float32, bfloat16 and float16, with 16-byte aligned
    strides; ``impl="auto"``'s rule takes them in float32 only, where they were timed); CUDA needs
    compute capability 8.0 or newer.  float64 is not supported anywhere.
    """
    if _GROUPED_MM is None or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type == "cpu":
        version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
        return version >= (2, 9)
    return False


def _activation_backward(name: str, act, h: Tensor, grad: Tensor) -> Tensor:
    """``∂act(h)/∂h`` applied to ``grad`` for ``relu`` / ``gelu`` / ``silu`` (ATen's own backward
    kernels) and any other activation (autograd on a recomputation)."""
    if name == "relu":
        return torch.ops.aten.threshold_backward(grad, h, 0)
    if name == "gelu":
        return torch.ops.aten.gelu_backward(grad, h)
    if name == "silu":
        return torch.ops.aten.silu_backward(grad, h)
    with torch.enable_grad():
        h = h.detach().requires_grad_()
        (g_h,) = torch.autograd.grad(act(h), h, grad)
    return g_h


def _loop_forward(xs, w_in, w_out, b_in, b_out, counts, act_name, act, keep: bool):
    """Every expert on its contiguous rows of ``xs``, the activation right after the first matmul
    while the rows are in cache: ``(y, h, aux)``; the experts spread over the torch threads
    (:func:`moelab.experts.threads.over_experts`).

    ``keep``: write the pre-activations into one ``(S, h_in)`` tensor ``h`` and collect ``aux``
    (:func:`_activation_forward`) for a backward; without it (inference) every expert's hidden
    activations are temporaries that the allocator reuses, so nothing of size ``S·h_in`` is
    allocated (``h`` and ``aux`` are then ``None``).
    """
    h = xs.new_empty(xs.shape[0], w_in.shape[1]) if keep else None
    y = xs.new_empty(xs.shape[0], w_out.shape[1])

    def expert(item):  # returns silu(gate) for swiglu, act(h) otherwise
        e, start, stop = item
        x_e, w_e = xs[start:stop], w_in[e].t()
        if keep:
            h_e = (
                torch.mm(x_e, w_e, out=h[start:stop])
                if b_in is None
                else torch.addmm(b_in[e], x_e, w_e, out=h[start:stop])
            )
        else:
            h_e = torch.mm(x_e, w_e) if b_in is None else torch.addmm(b_in[e], x_e, w_e)
        a_e, aux_e = _activation_forward(h_e, act_name, act)
        if b_out is None:
            torch.mm(a_e, w_out[e].t(), out=y[start:stop])
        else:
            torch.addmm(b_out[e], a_e, w_out[e].t(), out=y[start:stop])
        return aux_e if keep else None

    items = _expert_rows(counts)
    aux = over_experts(items, [stop - start for _, start, stop in items], expert, xs.device)
    return y, h, (aux if keep else None)


def _expert_rows(counts: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(expert, start, stop)`` of every expert with rows, in expert order."""
    items, start = [], 0
    for e, c in enumerate(counts):
        if c:
            items.append((e, start, start + c))
            start += c
    return items


class _ExpertMLP(torch.autograd.Function):
    """All N experts on their contiguous row slices, one autograd node (the ``"loop"`` impl).

    Per expert ``e`` with ``c_e > 0`` rows: ``y = act(x W_in[e]ᵀ + b_in[e]) W_out[e]ᵀ + b_out[e]``,
    the activation applied right after the first matmul while its rows are in cache.  Saved for
    backward: the pre-activation and, per expert, ``silu(gate)`` (``swiglu``) or the activation
    output (others), so no transcendental is recomputed.  The backward writes every expert's
    weight (and bias) gradient straight into row ``e`` of one ``(N, ·, ·)`` buffer: the stacked
    weights are never unbound, stacked or indexed by autograd, and experts with no rows get zero
    gradients.  First-order only (``once_differentiable``).
    """

    @staticmethod
    def forward(ctx, xs, w_in, w_out, b_in, b_out, counts: list[int], act_name: str, act):
        y, h, aux = _loop_forward(xs, w_in, w_out, b_in, b_out, counts, act_name, act, keep=True)
        ctx.save_for_backward(xs, w_in, w_out, h, *aux)
        ctx.counts, ctx.act_name, ctx.act = counts, act_name, act
        ctx.has_bias = (b_in is not None, b_out is not None)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        xs, w_in, w_out, h, *aux = ctx.saved_tensors
        grads = _mlp_backward(
            grad,
            xs,
            h,
            aux,
            w_in,
            w_out,
            ctx.counts,
            ctx.act_name,
            ctx.act,
            ctx.needs_input_grad[:5],
            ctx.has_bias,
        )
        return (*grads, None, None, None)


def _activation_forward(h: Tensor, act_name: str, act) -> tuple[Tensor, Tensor]:
    """``(a, aux)``: the activation ``a`` of the pre-activations ``h`` and what its backward needs
    besides ``h``: ``silu(gate)`` for ``swiglu`` (so no transcendental is recomputed), else ``a``
    (the weight gradient of the second matmul reads it)."""
    if act_name == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        s = F.silu(gate)
        return s * up, s
    a = act(h)
    return a, a


def _activation_grad(g_a: Tensor, h: Tensor, aux: Tensor, act_name: str, act) -> Tensor:
    """``∂L/∂h`` from ``∂L/∂a`` (``g_a`` is overwritten).  ``swiglu`` writes the gate and up
    halves straight into one ``(·, 2h)`` buffer: no ``cat`` as autograd's ``chunk`` backward does."""
    if act_name == "swiglu":  # a = silu(gate) * up
        gate, up = h.chunk(2, dim=-1)
        g_h = torch.empty_like(h, memory_format=torch.contiguous_format)
        g_gate, g_up = g_h.chunk(2, dim=-1)
        torch.mul(g_a, aux, out=g_up)
        torch.ops.aten.silu_backward.grad_input(g_a.mul_(up), gate, grad_input=g_gate)
        return g_h
    return _activation_backward(act_name, act, h, g_a)


def _mlp_backward(grad, xs, h, aux, w_in, w_out, counts, act_name, act, needs, has_bias):
    """The backward of the experts' MLPs on expert-sorted rows: ``(∂xs, ∂w_in, ∂w_out, ∂b_in, ∂b_out)``.

    ``h`` holds the pre-activations; ``aux`` per non-empty expert ``silu(gate)`` (``swiglu``) or
    ``act(h)`` (others), or ``None`` to recompute them from ``h`` (one elementwise op per expert).
    Every expert's weight gradient is written into row ``e`` of one ``(N, ·, ·)`` buffer; experts
    with no rows get zeros.
    """
    need_x, need_w_in, need_w_out, need_b_in, need_b_out = needs
    swiglu = act_name == "swiglu"
    # under autocast the forward ran in the activations' dtype (bf16) on float32 weights: the
    # backward computes in that dtype too and returns each gradient in its input's dtype
    dtype, x_dtype, w_dtype = h.dtype, xs.dtype, (w_in.dtype, w_out.dtype)
    grad, xs, w_in, w_out = (t.to(dtype) for t in (grad, xs, w_in, w_out))
    grad = grad.contiguous()
    g_x = torch.empty_like(xs, memory_format=torch.contiguous_format) if need_x else None
    g_w_in = torch.empty_like(w_in, memory_format=torch.contiguous_format) if need_w_in else None
    g_w_out = torch.empty_like(w_out, memory_format=torch.contiguous_format) if need_w_out else None
    g_b_in = grad.new_empty(w_in.shape[:2]) if need_b_in and has_bias[0] else None
    g_b_out = grad.new_empty(w_out.shape[:2]) if need_b_out and has_bias[1] else None
    for e, c in enumerate(counts):
        if c == 0:
            for g in (g_w_in, g_w_out, g_b_in, g_b_out):
                if g is not None:
                    g[e].zero_()

    def expert(job):
        (e, start, stop), aux_e = job
        g_y, h_e = grad[start:stop], h[start:stop]
        if aux_e is not None:
            a_e = aux_e * h_e.chunk(2, dim=-1)[1] if swiglu else aux_e
        else:
            a_e, aux_e = _activation_forward(h_e, act_name, act)
        if g_w_out is not None:
            torch.mm(g_y.t(), a_e, out=g_w_out[e])
        if g_b_out is not None:
            torch.sum(g_y, 0, out=g_b_out[e])
        g_h = _activation_grad(g_y @ w_out[e], h_e, aux_e, act_name, act)
        if g_w_in is not None:
            torch.mm(g_h.t(), xs[start:stop], out=g_w_in[e])
        if g_b_in is not None:
            torch.sum(g_h, 0, out=g_b_in[e])
        if g_x is not None:
            torch.mm(g_h, w_in[e], out=g_x[start:stop])

    items = _expert_rows(counts)
    jobs = list(zip(items, aux if aux is not None else [None] * len(items)))
    over_experts(jobs, [stop - start for _, start, stop in items], expert, xs.device)

    def cast(g: Tensor | None, want: torch.dtype) -> Tensor | None:
        return None if g is None else g.to(want)

    return (
        cast(g_x, x_dtype),
        cast(g_w_in, w_dtype[0]),
        cast(g_w_out, w_dtype[1]),
        cast(g_b_in, w_dtype[0]),
        cast(g_b_out, w_dtype[1]),
    )


def _grouped_forward(xs, w_in, w_out, b_in, b_out, offs, experts, act_name, act):
    """``(y, h, aux)``: the experts on their expert-sorted rows by two ``grouped_mm`` (the forward
    of :class:`_GroupedMLP`, and the whole of it without autograd)."""
    h = _GROUPED_MM(xs, w_in.transpose(-2, -1), offs=offs)  # (S, h_in)
    if b_in is not None:
        h += b_in.index_select(0, experts)
    a, aux = _activation_forward(h, act_name, act)
    y = _GROUPED_MM(a, w_out.transpose(-2, -1), offs=offs)  # (S, d)
    if b_out is not None:
        y += b_out.index_select(0, experts)
    return y, h, aux


class _GroupedMLP(torch.autograd.Function):
    """All N experts on their expert-sorted rows with ``grouped_mm``, one autograd node (the
    ``"grouped"`` impl in eager mode).

    Forward: two grouped GEMMs (offsets ``offs``: cumulative row ends, int32; no host sync) and
    the activation on all rows at once.  Saved: the rows, the pre-activations and ``aux``
    (:func:`_activation_forward`).  Backward: four grouped GEMMs — ``∂w`` as ``grouped_mm`` of
    two 2-D operands, one ``(N, ·, ·)`` result with zeros for empty experts — and the fused
    activation gradient (:func:`_activation_grad`); the bias gradients are per-expert row sums,
    a grouped GEMV against a column of ones (deterministic, no scatter).  Compared with autograd
    through the same ops it saves the activation's copies (``chunk``'s ``cat``) and the
    ``.contiguous()`` of the output gradient.  First-order only.
    """

    @staticmethod
    def forward(ctx, xs, w_in, w_out, b_in, b_out, offs, experts, act_name: str, act):
        y, h, aux = _grouped_forward(xs, w_in, w_out, b_in, b_out, offs, experts, act_name, act)
        ctx.save_for_backward(xs, w_in, w_out, h, aux, offs)
        ctx.act_name, ctx.act = act_name, act
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        xs, w_in, w_out, h, aux, offs = ctx.saved_tensors
        need_x, need_w_in, need_w_out, need_b_in, need_b_out = ctx.needs_input_grad[:5]
        grad = grad.contiguous()
        a = aux * h.chunk(2, dim=-1)[1] if ctx.act_name == "swiglu" else aux
        g_w_out = _GROUPED_MM(grad.t(), a, offs=offs) if need_w_out else None  # (N, d, h)
        g_b_out = _row_sums(grad, offs) if need_b_out else None
        g_h = _activation_grad(_GROUPED_MM(grad, w_out, offs=offs), h, aux, ctx.act_name, ctx.act)
        g_w_in = _GROUPED_MM(g_h.t(), xs, offs=offs) if need_w_in else None  # (N, h_in, d)
        g_b_in = _row_sums(g_h, offs) if need_b_in else None
        g_xs = _GROUPED_MM(g_h, w_in, offs=offs) if need_x else None
        return g_xs, g_w_in, g_w_out, g_b_in, g_b_out, None, None, None, None


def _row_sums(rows: Tensor, offs: Tensor) -> Tensor:
    """``(N, n)``: the sum of each group's rows of ``rows (S, n)`` (zeros for an empty group)."""
    ones = rows.new_ones(rows.shape[0], 16 // rows.element_size())  # grouped_mm: 16-byte rows
    return _GROUPED_MM(rows.t(), ones, offs=offs)[..., 0]


class WinnerMLP(torch.autograd.Function):
    """The winners' outputs of a competition with autograd, without running any expert again.

    Forward receives the outputs ``y_w (T, K, d)`` and pre-activations ``h_w (T, K, h_in)`` that
    :meth:`ExpertBank.forward_winners` kept from its single pass over all N experts and returns
    ``y_w``; backward sorts the ``(token, winner)`` slots by expert once and back-propagates
    through the winners' MLPs only (:func:`_mlp_backward`): N + 2K expert passes per token in all.
    """

    @staticmethod
    def forward(ctx, x, w_in, w_out, b_in, b_out, winners, h_w, y_w, act_name: str, act):
        ctx.save_for_backward(x, w_in, w_out, winners, h_w)
        ctx.act_name, ctx.act = act_name, act
        ctx.has_bias = (b_in is not None, b_out is not None)
        return y_w.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        x, w_in, w_out, winners, h_w = ctx.saved_tensors
        T, K = winners.shape
        order, counts, tokens, _ = sort_slots(winners, w_in.shape[0])
        g = grad.reshape(T * K, grad.shape[-1]).index_select(0, order)  # expert-sorted slots
        h = h_w.reshape(T * K, h_w.shape[-1]).index_select(0, order)
        xs = x.index_select(0, tokens)
        g_xs, g_w_in, g_w_out, g_b_in, g_b_out = _mlp_backward(
            g,
            xs,
            h,
            None,
            w_in,
            w_out,
            counts.tolist(),
            ctx.act_name,
            ctx.act,
            ctx.needs_input_grad[:5],
            ctx.has_bias,
        )
        g_x = None if g_xs is None else torch.zeros_like(x).index_add_(0, tokens, g_xs)
        return g_x, g_w_in, g_w_out, g_b_in, g_b_out, None, None, None, None, None


# ------------------------------------------------------------------ grouped_mm for torch.compile
# torch's fake-tensor (meta) kernel of ``_grouped_mm`` accepts bfloat16 only, although the CPU kernel
# runs float32: tracing ``impl="grouped"`` in float32 fails inside torch.compile.  Under compile the
# two grouped GEMMs therefore go through these opaque custom ops (shape functions below); eager code
# calls ``_GROUPED_MM`` directly.  The stacked weight enters in its stored layout and is transposed
# inside the op (a transposed view as an op input is materialised by inductor: a copy of the
# whole stacked weight per GEMM).  Backward: ``∂a = g bᵀ`` (a grouped GEMM) and, per group,
# ``∂b_e = a_eᵀ g_e`` (``grouped_mm`` of two 2-D operands, one ``(N, ·, ·)`` result).


@torch.library.custom_op("moelab::grouped_mm", mutates_args=())
def _grouped_mm_op(a: Tensor, b: Tensor, offs: Tensor, trans_b: bool) -> Tensor:
    """Rows of ``a (S, k)`` grouped by ``offs`` (cumulative ends, int32) times ``b[e]`` (``(N, k, n)``)
    or, with ``trans_b``, ``b[e]ᵀ`` (``b (N, n, k)``, the ``nn.Linear`` layout) → ``(S, n)``."""
    return _GROUPED_MM(a, b.transpose(-2, -1) if trans_b else b, offs=offs)


@_grouped_mm_op.register_fake
def _(a: Tensor, b: Tensor, offs: Tensor, trans_b: bool) -> Tensor:
    return a.new_empty(a.shape[0], b.shape[-2] if trans_b else b.shape[-1])


@torch.library.custom_op("moelab::grouped_mm_weight_grad", mutates_args=())
def _grouped_mm_weight_grad(p: Tensor, q: Tensor, offs: Tensor) -> Tensor:
    """``(N, m, n)``: ``p_eᵀ q_e`` for each group's rows of ``p (S, m)`` and ``q (S, n)`` (zeros for
    an empty group)."""
    return _GROUPED_MM(p.t(), q, offs=offs)


@_grouped_mm_weight_grad.register_fake
def _(p: Tensor, q: Tensor, offs: Tensor) -> Tensor:
    return p.new_empty(offs.shape[0], p.shape[1], q.shape[1])


def _grouped_mm_setup(ctx, inputs, output) -> None:
    a, b, offs, trans_b = inputs
    ctx.save_for_backward(a, b, offs)
    ctx.trans_b = trans_b


def _grouped_mm_backward(ctx, grad: Tensor):
    a, b, offs = ctx.saved_tensors
    grad = grad.contiguous()
    g_a = g_b = None
    if ctx.needs_input_grad[0]:
        g_a = _grouped_mm_op(grad, b, offs, not ctx.trans_b)
    if ctx.needs_input_grad[1]:
        g_b = (
            _grouped_mm_weight_grad(grad, a, offs) if ctx.trans_b else _grouped_mm_weight_grad(a, grad, offs)
        )
    return g_a, g_b, None, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def _grouped_mm_nt(a: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """``a_e w[e]ᵀ`` per group (``w`` in the ``nn.Linear`` layout): ``grouped_mm`` eagerly, the
    traceable custom op while torch.compile traces."""
    if torch.compiler.is_compiling():
        return _grouped_mm_op(a, w, offs, True)
    return _GROUPED_MM(a, w.transpose(-2, -1), offs=offs)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped_mm's backward on
    CPU rejects the expanded gradients that ``.sum()`` produces)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()
