"""``moelab bench compete``: what CompeteSMoE's scheduled competition costs over plain smoe.  A stack
of ``--layers`` pre-norm residual MoE blocks is trained with ``smoe`` and with ``competesmoe`` from
the same initial weights, one step of each in turn, and the mean step times, their ratio beside the
theoretical extra cost of each gradient path, and the peak memory of a step in which ``A_max``
layers compete are printed.  docs/performance-compete.md gives the formulas, how memory is
measured on each device, and the results with their commands.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from .harness import Candidate, FixedSchedule, interleaved, peak_memory_bytes

__all__ = ["add_arguments", "run"]


@dataclass
class Config:
    layers: int = 6
    d_model: int = 256
    d_hidden: int = 256
    experts: int = 16
    top_k: int = 2
    tokens: int = 1024
    steps: int = 150
    omega: float = 0.07
    a_max: int = 2
    grad_path: str = "winners"
    seed: int = 0
    device: str = "cpu"
    threads: int = 1
    impl: str = "auto"
    all_pass: str = "einsum"


class _Block(nn.Module):
    def __init__(self, cfg: Config, method: str) -> None:
        super().__init__()
        from ..layer import MoE

        self.norm = nn.LayerNorm(cfg.d_model)
        options = {"grad_path": cfg.grad_path} if method == "competesmoe" else {}
        self.moe = MoE(
            cfg.d_model, cfg.experts, cfg.top_k, cfg.d_hidden, method=method, impl=cfg.impl, **options
        )
        if cfg.all_pass != "einsum":
            grouped_competition_pass(self.moe.experts, cfg.all_pass)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


def grouped_competition_pass(bank, impl: str) -> None:
    """Make ``bank``'s competition pass (every expert on every token without autograd, inside
    :meth:`ExpertBank.forward_winners`) one grouped pass by ``impl``
    (:func:`moelab.experts.kernels.all_experts`) instead of its two einsums.  Under autograd
    (``grad_path="all"``'s differentiable ``forward_all``) the einsums still run."""
    from ..experts.kernels import all_experts

    einsums = bank._all_experts

    def pass_(x: torch.Tensor):
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in bank.parameters())):
            return einsums(x)
        return all_experts(x, bank.expert_weights, impl)

    bank._all_experts = pass_


def _competition_pass_times(cfg: Config, repeats: int = 10) -> dict[str, float]:
    """Median ms of the competition pass on ``--tokens`` tokens (every expert, no autograd) by
    the einsums and by each grouped pass that runs here, interleaved."""
    from ..experts import ExpertBank
    from ..experts.kernels import ALL_PASSES, all_experts

    torch.manual_seed(cfg.seed)
    bank = ExpertBank(cfg.experts, cfg.d_model, cfg.d_hidden).to(cfg.device)
    x = torch.randn(cfg.tokens, cfg.d_model, device=cfg.device)
    fns = {"einsum": bank._all_experts}
    for impl in ALL_PASSES:
        if _pass_unavailable(impl, cfg) is None:
            fns[impl] = lambda x, impl=impl: all_experts(x, bank.expert_weights, impl)
    cands = [Candidate(name, "pass", lambda fn=fn: fn(x)) for name, fn in fns.items()]
    with torch.no_grad():  # the warm-up round compiles Triton
        interleaved(cands, repeats, warmup=1, device=cfg.device, progress=False)
    return {c.name: 1e3 * statistics.median(c.times) for c in cands}


def _pass_unavailable(impl: str, cfg: Config) -> str | None:
    """Why the grouped competition pass ``impl`` cannot run for ``cfg`` (float32), or ``None``."""
    device = torch.device(cfg.device)
    if impl == "triton":
        from ..experts.triton_kernels import unavailable_reason

        return unavailable_reason(device, torch.float32)
    from ..experts import grouped_mm_available

    if not grouped_mm_available(device, torch.float32):
        return f"grouped_mm cannot run for device={device.type}, float32 with torch {torch.__version__}"
    if cfg.d_model % 4 or cfg.d_hidden % 4:
        return "grouped_mm needs --d-model and --d-hidden to be multiples of 4 in float32"
    return None


def _model(cfg: Config, method: str, schedule) -> tuple[nn.Module, object]:
    from ..layer import attach
    from ..routing import RoutingContext

    torch.manual_seed(cfg.seed)
    model = nn.Sequential(*[_Block(cfg, method) for _ in range(cfg.layers)]).to(cfg.device)
    ctx = RoutingContext(schedule=schedule, total_steps=cfg.steps)
    attach(model, ctx)
    return model, ctx


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    from ..layer import aux_loss

    loss = model(x).square().mean() + aux_loss(model)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time_steps(cfg: Config) -> dict:
    from ..schedules import CompetitionSchedule

    schedule = CompetitionSchedule(
        cfg.layers, cfg.steps, omega=cfg.omega, a_max=cfg.a_max, warmup=0.0, seed=cfg.seed
    )
    smoe, ctx_s = _model(cfg, "smoe", None)
    comp, ctx_c = _model(cfg, "competesmoe", schedule)
    opts = {id(m): torch.optim.Adam(m.parameters(), lr=1e-4) for m in (smoe, comp)}
    x = torch.randn(cfg.tokens, cfg.d_model, device=cfg.device)
    warm = FixedSchedule(cfg.layers, set())
    ctx_c.schedule = warm
    for _ in range(3):  # warm-up, no competition
        for m in (smoe, comp):
            _step(m, opts[id(m)], x)
    ctx_c.schedule = schedule
    times = {"smoe": [], "competesmoe": []}
    for step in range(cfg.steps):
        ctx_s.step = ctx_c.step = step
        for name, m in (("smoe", smoe), ("competesmoe", comp)):
            _sync(cfg.device)
            t0 = time.perf_counter()
            _step(m, opts[id(m)], x)
            _sync(cfg.device)
            times[name].append(time.perf_counter() - t0)
    return {"times": times, "rate": schedule.table.float().mean().item(), "table": schedule.table}


def _expert_share(cfg: Config, smoe_step: float, repeats: int = 20) -> float:
    """Fraction of an smoe step spent in the experts: forward + backward of one layer's bank on a
    top-K routing of the same tokens, times the number of layers, over the smoe step time."""
    from ..experts import ExpertBank

    torch.manual_seed(cfg.seed)
    bank = ExpertBank(cfg.experts, cfg.d_model, cfg.d_hidden).to(cfg.device)
    x = torch.randn(cfg.tokens, cfg.d_model, device=cfg.device, requires_grad=True)
    idx = torch.randn(cfg.tokens, cfg.experts, device=cfg.device).topk(cfg.top_k, -1).indices
    w = torch.full((cfg.tokens, cfg.top_k), 1.0 / cfg.top_k, device=cfg.device)
    times = []
    for i in range(repeats + 3):
        _sync(cfg.device)
        t0 = time.perf_counter()
        bank.mix(x, idx, w).sum().backward()
        _sync(cfg.device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return min(1.0, cfg.layers * statistics.median(times) / smoe_step)


def _saved_bytes(cfg: Config, method: str, active: set[int]) -> int:
    """Bytes of the tensors autograd saves for backward in one training forward."""
    model, _ = _model(cfg, method, FixedSchedule(cfg.layers, active))
    x = torch.randn(cfg.tokens, cfg.d_model, device=cfg.device)
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            seen[key] = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    from ..layer import aux_loss

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().mean() + aux_loss(model)
    loss.backward()
    return sum(seen.values())


def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _rss_probe(cfg_json: str) -> None:
    """Run in a fresh process: print the peak RSS growth over one training step.

    Linux: the high-water mark is reset to the current RSS (``/proc/self/clear_refs`` ← 5) just
    before the step and read back after it (``VmHWM − VmRSS``); elsewhere ``ru_maxrss`` growth.
    """
    spec = json.loads(cfg_json)
    cfg = Config(**spec["config"])
    torch.set_num_threads(cfg.threads)
    model, _ = _model(cfg, spec["method"], FixedSchedule(cfg.layers, set(spec["active"])))
    x = torch.randn(cfg.tokens, cfg.d_model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _proc_status_bytes("VmRSS")
        _step(model, opt, x)
        print(_proc_status_bytes("VmHWM") - before)
    except OSError:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        _step(model, opt, x)
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)  # KiB on Linux


def _peak_memory(cfg: Config, method: str, active: set[int]) -> int:
    if cfg.device.startswith("cuda"):
        model, _ = _model(cfg, method, FixedSchedule(cfg.layers, active))
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        x = torch.randn(cfg.tokens, cfg.d_model, device=cfg.device)
        return peak_memory_bytes(lambda: _step(model, opt, x), cfg.device)
    spec = json.dumps({"config": asdict(cfg), "method": method, "active": sorted(active)})
    code = f"from moelab.bench.compete import _rss_probe; _rss_probe({spec!r})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"memory probe failed: {out.stderr.strip()[-500:]}")
    return int(out.stdout.split()[-1])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = Config()
    parser.add_argument("--layers", type=int, default=d.layers, help="MoE layers in the stack (%(default)s)")
    parser.add_argument("--d-model", type=int, default=d.d_model, help="token width (%(default)s)")
    parser.add_argument("--d-hidden", type=int, default=d.d_hidden, help="expert hidden width (%(default)s)")
    parser.add_argument("--experts", type=int, default=d.experts, help="N (%(default)s)")
    parser.add_argument("--top-k", type=int, default=d.top_k, help="K (%(default)s)")
    parser.add_argument("--tokens", type=int, default=d.tokens, help="tokens per step (%(default)s)")
    parser.add_argument("--steps", type=int, default=d.steps, help="timed steps per method (%(default)s)")
    parser.add_argument("--omega", type=float, default=d.omega, help="ω (%(default)s)")
    parser.add_argument("--a-max", type=int, default=d.a_max, help="A_max (%(default)s)")
    parser.add_argument(
        "--grad-path", choices=["winners", "all"], default=d.grad_path, help="competition gradient path"
    )
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--device", default=d.device, help="cpu or cuda (%(default)s)")
    parser.add_argument("--threads", type=int, default=d.threads, help="CPU threads (%(default)s)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument(
        "--impl",
        default=d.impl,
        help="experts kernel of every layer: auto, loop, grouped, stream or triton (%(default)s)",
    )
    parser.add_argument(
        "--all-pass",
        default=d.all_pass,
        help="the competition's pass (every expert on every token, no autograd): einsum (the bank's own), "
        "or one grouped pass by grouped (torch grouped_mm) or triton (fused kernels reading tokens by index) "
        "(%(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    from .. import _validate
    from ..schedules import CompetitionSchedule

    cfg = Config(
        layers=args.layers,
        d_model=args.d_model,
        d_hidden=args.d_hidden,
        experts=args.experts,
        top_k=args.top_k,
        tokens=args.tokens,
        steps=args.steps,
        omega=args.omega,
        a_max=args.a_max,
        grad_path=args.grad_path,
        seed=args.seed,
        device=args.device,
        threads=args.threads,
        impl=args.impl,
        all_pass=args.all_pass,
    )
    for name in ("layers", "d_model", "d_hidden", "experts", "tokens", "steps", "threads"):
        _validate.positive_int(f"--{name.replace('_', '-')}", getattr(cfg, name))
    _validate.int_in_range("--top-k", cfg.top_k, 1, cfg.experts - 1)
    CompetitionSchedule(cfg.layers, cfg.steps, omega=cfg.omega, a_max=cfg.a_max, warmup=0.0)  # validates
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device={cfg.device!r} is not available on this machine; use --device cpu")
    from ..experts import IMPLS
    from ..experts.kernels import ALL_PASSES

    _validate.one_of("--impl", cfg.impl, IMPLS)
    _validate.one_of("--all-pass", cfg.all_pass, ("einsum", *ALL_PASSES))
    if cfg.all_pass != "einsum":
        reason = _pass_unavailable(cfg.all_pass, cfg)
        if reason is not None:
            raise ValueError(f"--all-pass={cfg.all_pass!r} cannot run here: {reason}; use --all-pass einsum")
    torch.set_num_threads(cfg.threads)

    N, K = cfg.experts, cfg.top_k
    print(
        f"moelab bench compete: {cfg.layers} layers, d={cfg.d_model}, h={cfg.d_hidden}, N={N}, K={K}, "
        f"{cfg.tokens} tokens/step, {cfg.steps} steps, ω={cfg.omega}, A_max={cfg.a_max}, "
        f"grad_path={cfg.grad_path}, device={cfg.device}, threads={cfg.threads}, impl={cfg.impl}, "
        f"competition pass {cfg.all_pass}, torch {torch.__version__}"
    )
    if cfg.all_pass != "einsum" and cfg.grad_path == "all":
        print(
            "  note: --grad-path all differentiates through the einsums; --all-pass applies to grad_path=winners"
        )
    passes = _competition_pass_times(cfg)
    print(
        f"  competition pass, every expert on {cfg.tokens} tokens without autograd (median ms): "
        + ", ".join(f"{name} {ms:.2f}" for name, ms in passes.items())
    )
    res = _time_steps(cfg)
    t_s = statistics.fmean(res["times"]["smoe"])
    t_c = statistics.fmean(res["times"]["competesmoe"])
    comp_steps = res["table"].any(dim=0).tolist()
    t_c_on = [t for t, on in zip(res["times"]["competesmoe"], comp_steps) if on]
    t_c_off = [t for t, on in zip(res["times"]["competesmoe"], comp_steps) if not on]
    share = _expert_share(cfg, statistics.median(res["times"]["smoe"]))
    rate = res["rate"]
    theory_all = rate * (N - K) / K * share
    theory_winners = rate * (N - K) / (3 * K) * share
    print(
        f"  smoe        step: mean {t_s * 1e3:8.2f} ms  (median {statistics.median(res['times']['smoe']) * 1e3:.2f})"
    )
    print(
        f"  competesmoe step: mean {t_c * 1e3:8.2f} ms  (median {statistics.median(res['times']['competesmoe']) * 1e3:.2f}; "
        f"{len(t_c_on)} steps with competition, mean {statistics.fmean(t_c_on) * 1e3 if t_c_on else float('nan'):.2f} ms; "
        f"others {statistics.fmean(t_c_off) * 1e3 if t_c_off else float('nan'):.2f} ms)"
    )
    print(f"  ratio competesmoe / smoe (mean step time): {t_c / t_s:.3f}   (target ≤ 1.10)")
    print(
        f"  realised competition rate ω = {rate:.4f} per layer-step; experts' share of an smoe step = {share:.2f}"
    )
    print(
        f"  theoretical extra: ω·(N−K)/K × share = {theory_all:.3f} (grad through all N);  "
        f"ω·(N−K)/(3K) × share = {theory_winners:.3f} (grad_path=winners)"
    )
    theory = 1 + (theory_all if args.grad_path == "all" else theory_winners)
    print(f"  measured / theoretical step ratio: {t_c / t_s:.3f} / {theory:.3f} = {t_c / t_s / theory:.3f}")
    if not args.no_memory:
        active = set(range(min(cfg.a_max, cfg.layers)))
        saved_s = _saved_bytes(cfg, "smoe", set())
        saved_c = _saved_bytes(cfg, "competesmoe", active)
        print(
            f"  autograd-saved bytes, one step: smoe {saved_s / 2**20:.1f} MiB, competition in {len(active)} "
            f"layers {saved_c / 2**20:.1f} MiB, ratio {saved_c / saved_s:.3f}"
        )
        peak_s = _peak_memory(cfg, "smoe", set())
        peak_c = _peak_memory(cfg, "competesmoe", active)
        kind = (
            "max_memory_allocated"
            if cfg.device.startswith("cuda")
            else "peak RSS growth over the step (fresh process)"
        )
        print(
            f"  {kind}, one step: smoe {peak_s / 2**20:.1f} MiB, competition in {len(active)} layers "
            f"{peak_c / 2**20:.1f} MiB, ratio {peak_c / max(peak_s, 1):.3f}   (target ≤ 1.5)"
        )
    sys.stdout.flush()
    return 0
