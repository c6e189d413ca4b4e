"""Parallelism from outside on gloo processes (CPU): FSDP2, expert parallelism and their
combinations against one process on the whole batch, float64."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moelab
from moelab.train.parallelize import full_state_dict
from router_grid import doc_inputs

D = 8


def spawn(fn, world: int, tmp_path, *args) -> list[dict]:
    """Run ``fn(rank, world, *args) -> dict`` on ``world`` gloo processes; the dicts, by rank
    (fork: the children inherit the imported torch/moelab, as in tests/test_distributed.py)."""
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(
        _worker, args=(world, str(tmp_path), fn, args), nprocs=world, join=True, start_method=method
    )
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _worker(rank: int, world: int, out: str, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/init", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _refusals(rank: int, world: int, out: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    result = {}
    torch.manual_seed(0)
    ref = moelab.MoE(D, 4, 2, method="xmoe")
    model = copy.deepcopy(ref)
    fully_shard(model)  # the learned temperature is no 0-dim parameter
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(1))
    result["xmoe_fsdp"] = (model(x) - ref(x)).abs().max().item()
    try:
        moelab.save(model, os.path.join(out, f"direct{rank}"))
        result["save"] = None
    except ValueError as exc:
        result["save"] = str(exc)
    state = full_state_dict(model)  # a collective
    if rank == 0:
        moelab.save(state, os.path.join(out, "full"))
    dist.barrier()
    fresh = moelab.MoE(D, 4, 2, method="xmoe")
    moelab.io.load_weights(os.path.join(out, "full"), fresh)
    result["saved_weights"] = max(
        (fresh.state_dict()[k] - v).abs().max().item() for k, v in ref.state_dict().items()
    )
    result["parallelize"] = _parallelize_refusals(world)
    return result


def _message(fn) -> str | None:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def _parallelize_refusals(world: int) -> dict[str, str | None]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from moelab.train.parallelize import ExpertParallel, parallelize

    def layer(n: int = 4, **kw) -> torch.nn.Module:
        return moelab.MoE(D, n, 2, **kw)

    done = layer()
    parallelize(done, dp="none", ep=2)
    modules = moelab.MoE(D, 4, 2, experts=moelab.ModuleExperts([torch.nn.Linear(D, D) for _ in range(4)]))
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    x, idx = torch.randn(3, D), torch.zeros(3, 1, dtype=torch.int64)
    tp = moelab.ExpertBank(4, D, 6)  # a tensor-parallel layout by hand: hidden units split
    tp.w_in = torch.nn.Parameter(
        distribute_tensor(tp.w_in.detach(), init_device_mesh("cpu", (2,)), [Shard(1)])
    )
    replicated = layer()
    parallelize(replicated, dp="none", ep=2)
    bank = replicated.experts
    bank.w_out = torch.nn.Parameter(
        distribute_tensor(bank.w_out.full_tensor().detach(), bank._ep[0], [Replicate()])
    )
    return {
        "tp_bank": _message(lambda: tp.mix(x, idx, torch.ones(3, 1))),
        "ep_layout": _message(lambda: bank.mix(x, idx, torch.ones(3, 1))),
        "dp": _message(lambda: parallelize(layer(), dp="zero")),
        "ep_world": _message(lambda: parallelize(layer(), ep=3)),
        "ep_experts": _message(lambda: parallelize(layer(3), dp="none", ep=2)),
        "module_experts": _message(lambda: parallelize(modules, dp="none", ep=2)),
        "twice": _message(lambda: parallelize(done, dp="none", ep=2)),
        "mesh": _message(lambda: parallelize(layer(), init_device_mesh("cpu", (2,)), ep=2)),
        "style": _message(
            lambda: parallelize_module(torch.nn.Linear(D, D), init_device_mesh("cpu", (2,)), ExpertParallel())
        ),
    }


def test_parallelize_refuses_what_cannot_be_right_in_one_line():
    with pytest.raises(
        ValueError, match=r"^parallelize needs torch\.distributed initialised \(launch with torchrun"
    ):
        from moelab.train.parallelize import parallelize

        parallelize(moelab.MoE(D, 4, 2), ep=2)


DEFAULT_CASES = [("smoe", "fsdp", 2), ("competesmoe", "ddp", 2)]


def _two_ranks(rank: int, world: int, out: str) -> dict:
    # one process group for the default suite's checks (starting one costs seconds)
    return {
        "refusals": _refusals(rank, world, out),
        "parity": _parity(rank, world, DEFAULT_CASES),
        "mixed": _mixed_precision(rank, world),
        "resume": _sharded_resume(rank, world, out),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("two-ranks")
    return spawn(_two_ranks, 2, tmp, str(tmp))


def test_fsdp2_shards_xmoe_and_a_sharded_model_is_saved_gathered_not_as_shards(two_ranks):
    for rank, r in enumerate(r["refusals"] for r in two_ranks):
        assert r["xmoe_fsdp"] <= 1e-6, rank
        assert r["save"] == (
            "state entry 'router.embeddings' is sharded (a DTensor: FSDP2 or expert parallelism); gather the full "
            "weights on every rank with moelab.train.parallelize.full_state_dict(model) and save that dict "
            "from rank 0"
        ), rank
        assert r["saved_weights"] == 0.0, rank
        p = r["parallelize"]
        assert p["tp_bank"] == (
            "ExpertBank weight w_in as a DTensor with placements (Shard(dim=1),) is not allowed; a bank computes on "
            "whole experts: split the experts with moelab.train.parallelize (parallelize(model, ep=...) or its "
            "ExpertParallel style)"
        )
        assert p["ep_layout"] == (
            "expert-parallel weight w_out with placements (Replicate(),) is not allowed; expected Shard(0) on the "
            "expert mesh (FSDP2 / a wrapper applied by hand after parallelize changed it: use "
            "parallelize(model, dp='fsdp', ep=...))"
        )
        assert p["dp"] == "dp='zero' is not allowed; expected one of ['ddp', 'fsdp', 'none']"
        assert (
            p["ep_world"]
            == "ep=3 is not allowed with 2 processes; expected a divisor of the world size: [1, 2]"
        )
        assert p["ep_experts"] == "ep=2 does not divide num_experts=3 of MoE layer 0; allowed: [1]"
        assert p["module_experts"] == (
            "MoE layer 0 has experts of type ModuleExperts; expert parallelism (ep > 1) shards a moelab.ExpertBank"
        )
        assert p["twice"].startswith("module 'experts' (ExpertParallelExpertBank) is already parallel;")
        assert (
            p["mesh"]
            == "mesh of shape (2,) named None is not allowed; expected shape (1, 2) named ('efsdp', 'ep')"
        )
        assert p["style"] == (
            "experts of type Linear are not allowed with expert parallelism; it shards a moelab.ExpertBank (once)"
        )


# ------------------------------------------------------------------------------------ parity
C = 5  # classes of the toy task
#: options that make each rank's loss a token mean, so W ranks on equal shards compute what one
#: process computes on the whole batch (a balance loss over a rank's tokens is another objective)
TOKEN_MEANS = {"balance_coef": 0.0, "z_coef": 0.0}
EXTRA = {"competesmoe": {"competition_balance_coef": 0.0}}


def _model(method: str, num_experts: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    options = {**TOKEN_MEANS, **EXTRA.get(method, {})}
    model = torch.nn.Sequential(
        torch.nn.Linear(D, D),
        moelab.MoE(
            D,
            num_experts,
            2,
            d_hidden=6,
            method=method,
            num_shared=1 if method == "sharede-v3" else 0,
            **options,
        ),
        torch.nn.Linear(D, C),
    ).double()
    if method == "competesmoe":  # competition on every step
        moelab.routing_context(model, 4, 0, omega=1.0, competition_warmup=0)
    return model


def _batch(step: int, world: int = 1, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(8, D, generator=g, dtype=torch.float64)
    y = torch.randint(0, C, (8,), generator=g)
    n = 8 // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


class WithAux(torch.nn.Module):
    """The model and its aux loss as one forward, as the trainer's: DDP must see the aux loss among
    the outputs (CompeteSMoE's router is trained by the distillation loss alone on a competition
    step; computed outside, DDP would take it for unused)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model(x), moelab.aux_loss(self.model)


def _loss(forward, x, y) -> torch.Tensor:
    out, aux = forward(x)
    return torch.nn.functional.cross_entropy(out, y) + aux


def _full_grads(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = None if g is None else (g.full_tensor() if isinstance(g, DTensor) else g).clone()
    return out


def _train(model, forward, steps: int, world: int, rank: int) -> tuple[list[float], list[dict]]:
    """``steps`` AdamW steps; the loss (mean over ranks) and the full gradients of each."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses, grads = [], []
    for step in range(steps):
        x, y = _batch(step, world, rank)
        loss = _loss(forward, x, y)
        opt.zero_grad()
        loss.backward()
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)
        losses.append(value.item() / world)
        grads.append(_full_grads(model))
        opt.step()
    return losses, grads


def _parity(rank: int, world: int, cases: list[tuple[str, str, int]]) -> dict:
    from moelab.train.parallelize import parallelize

    out = {}
    for method, dp, ep, *n in cases:  # n: the number of experts, when not 4
        ref = WithAux(_model(method, *n))
        ref_losses, ref_grads = _train(ref, ref, 2, 1, 0)
        model = WithAux(_model(method, *n))
        forward = parallelize(model, dp=dp, ep=ep)
        if n:  # the experts' placements on the ('efsdp', 'ep') mesh
            out[f"placements/{n[0]}"] = str(model.model[1].experts.w_in.placements)
        losses, grads = _train(model, forward, 2, world, rank)
        err = max(abs(a - b) for a, b in zip(losses, ref_losses))
        for g, r in zip(grads, ref_grads):
            assert g.keys() == r.keys(), (g.keys(), r.keys())
            for k in g:
                if r[k] is None:
                    assert g[k] is None or g[k].abs().max() == 0, k
                    continue
                err = max(err, (g[k] - r[k]).abs().max().item())
        out[f"{method}/{dp}/ep{ep}" + (f"/N{n[0]}" if n else "")] = (err, ref_losses)
    if world == 4:  # DDP has one process group; experts split in 2 would need a second one
        out["ddp_ep2"] = _message(lambda: parallelize(WithAux(_model("smoe")), dp="ddp", ep=2))
    return out


METHODS = ("smoe", "xmoe", "sharede-v3", "competesmoe")
LAYOUTS = {
    2: [("ddp", 1), ("fsdp", 1), ("ddp", 2), ("fsdp", 2)],
    4: [("fsdp", 1), ("fsdp", 2), ("fsdp", 4), ("ddp", 4)],
}
#: two experts split over 2 ranks, each block held by 2 FSDP ranks: more FSDP ranks than local experts
FEWER_EXPERTS = ("smoe", "fsdp", 2, 2)


def _check_parity(results: list[dict], world: int, cases: list[tuple]) -> None:
    for rank, r in enumerate(results):
        if FEWER_EXPERTS in cases:  # torchtitan's rule: FSDP shards the second dimension then
            assert r.pop("placements/2") == "(Shard(dim=1), Shard(dim=0))", rank
        if world == 4:
            assert r.pop("ddp_ep2") == (
                "dp='ddp' with ep=2 < 4 processes is not allowed: DDP reduces over one process group, the "
                "experts would need another (the 2 ranks holding the same experts); use dp='fsdp' or ep=4"
            )
        assert len(r) == len(cases)
        for name, (err, ref_losses) in r.items():
            assert ref_losses[1] != ref_losses[0], name  # the step changed something
            # float64; CompeteSMoE's distillation and diversity losses sum in another order: ~2e-11
            assert err <= 1e-9, f"rank {rank}/{world}: {name} differs by {err}"


def test_expert_parallel_with_fsdp2_and_with_ddp_give_the_losses_and_gradients_of_one_process(two_ranks):
    # EP x FSDP2 (experts Shard(0) on the expert mesh, FSDP over the rest) and EP + DDP with competition
    _check_parity([r["parity"] for r in two_ranks], 2, DEFAULT_CASES)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_layout_gives_the_losses_and_gradients_of_one_process_for_every_method(world, tmp_path):
    cases = [(m, dp, ep) for m in METHODS for dp, ep in LAYOUTS[world]] + (
        [FEWER_EXPERTS] if world == 4 else []
    )
    _check_parity(spawn(_parity, world, tmp_path, cases), world, cases)


# ------------------------------------------------------------------------------------ sharded checkpoints
def _sharded_checkpoint(rank: int, world: int, path: str, save: bool) -> dict:
    """Two AdamW steps of EP x FSDP2 (``ep`` = 2); with ``save`` the state after step 1 goes to
    ``path`` (torch.distributed.checkpoint, each rank its shards), else it is read from there."""
    from moelab.train.parallelize import load_sharded, parallelize, save_sharded

    model = WithAux(_model("smoe"))
    parallelize(model, dp="fsdp", ep=2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses = []
    for step in range(2):
        if step == 1 and not save:
            load_sharded(path, model, opt)
        x, y = _batch(step, world, rank)
        loss = _loss(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)
        if step == 0 and save:
            save_sharded(path, model, opt)
    return {"losses": losses}


@pytest.mark.slow
def test_a_sharded_checkpoint_of_two_ranks_resumes_on_four_with_the_same_numbers(tmp_path):
    # 2 ranks: experts split in 2, FSDP2 over 1 rank each; 4 ranks: experts split in 2, each block
    # sharded by FSDP2 over 2 ranks; the checkpoint is written shard by shard and re-sharded on load
    path = str(tmp_path / "dcp")
    (tmp_path / "two").mkdir()
    (tmp_path / "four").mkdir()
    two = spawn(_sharded_checkpoint, 2, tmp_path / "two", path, True)
    four = spawn(_sharded_checkpoint, 4, tmp_path / "four", path, False)
    assert two[0]["losses"][1] != two[0]["losses"][0]
    assert abs(four[0]["losses"][1] - two[0]["losses"][1]) <= 1e-12


# ------------------------------------------------------------------------------------ mixed precision
MIXED_METHODS = ("smoe", "sharede-v3", "competesmoe")


def _mixed_model(method: str) -> torch.nn.Module:
    torch.manual_seed(0)
    options = {**TOKEN_MEANS, **EXTRA.get(method, {})}
    layer = moelab.MoE(D, 4, 2, d_hidden=6, method=method, router_dtype="float32",
                       num_shared=1 if method == "sharede-v3" else 0, **options)  # fmt: skip
    model = torch.nn.Sequential(torch.nn.Linear(D, D), layer, torch.nn.Linear(D, C))
    if method == "competesmoe":  # competition on every step
        moelab.routing_context(model, 4, 0, omega=1.0, competition_warmup=0)
    return model


def _bf16_batch(step: int, world: int = 1, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _batch(step, world, rank)
    return x.to(
        torch.bfloat16
    ).float(), y  # bf16 numbers: FSDP2 casts the inputs to bf16, autocast's Linear too


def _mixed_train(model, forward, world: int, rank: int, autocast: bool) -> dict:
    """Two SGD steps (AdamW's first step, ``lr·sign(g)``, would turn a rounding of a gradient near 0
    into a step of ``2·lr``): losses, full gradients, the routing of each step and the router's dtype."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    layer = model.model[1]
    out: dict = {"losses": [], "grads": [], "indices": [], "router_dtypes": set()}
    hook = layer.router.base_router.register_forward_pre_hook(
        lambda m, args: out["router_dtypes"].update(p.dtype for p in m.parameters())
    )
    for step in range(2):
        x, y = _bf16_batch(step, world, rank)
        with moelab.recording_routing(model), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits, aux = forward(x)
        loss = torch.nn.functional.cross_entropy(logits.float(), y) + aux
        out["indices"].append(layer.last_routing.indices)
        out["logits_dtype"] = layer.last_routing.logits.dtype
        opt.zero_grad()
        loss.backward()
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)
        out["losses"].append(value.item() / world)
        out["grads"].append(_full_grads(model))
        opt.step()
    hook.remove()
    return out


def _mixed_precision(rank: int, world: int) -> dict:
    """``router_dtype="float32"`` under FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` against one
    process on the whole batch under bf16 autocast (float32 parameters): losses, gradients, routing."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from moelab.train.parallelize import parallelize

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out = {}
    for method in MIXED_METHODS:
        ref = WithAux(_mixed_model(method))
        want = _mixed_train(ref, ref, 1, 0, autocast=True)
        model = WithAux(_mixed_model(method))
        forward = parallelize(model, dp="fsdp", mp_policy=policy)
        got = _mixed_train(model, forward, world, rank, autocast=False)
        n = 8 // world
        errors = {}
        for g, r in zip(got["grads"], want["grads"], strict=True):
            for k in r:
                scale = r[k].abs().max().item() if r[k] is not None else 0.0
                err = 0.0 if r[k] is None and g[k] is None else (g[k] - r[k]).abs().max().item()
                errors[k] = max(errors.get(k, 0.0), err / max(scale, 1e-30))
        out[method] = {
            "losses": (got["losses"], want["losses"]),
            "grad_errors": errors,
            "same_routing": all(
                torch.equal(a, b[rank * n : (rank + 1) * n]) for a, b in zip(got["indices"], want["indices"])
            ),
            "router_dtypes": got["router_dtypes"],
            "logits_dtype": got["logits_dtype"],
            "expert_dtype": {p.dtype for p in model.model[1].experts.parameters()},
        }
    out["ddp_refused"] = _message(
        lambda: parallelize(WithAux(_mixed_model("smoe")), dp="ddp", mp_policy=policy)
    )
    out["ep_world_refused"] = _message(
        lambda: parallelize(WithAux(_mixed_model("smoe")), dp="fsdp", ep=world, mp_policy=policy)
    )
    return out


def test_router_dtype_float32_under_fsdp2_mixed_precision_equals_the_autocast_path(two_ranks):
    """FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` once gathered the router in bf16, which
    ``router_dtype="float32"`` refuses: ``parallelize(mp_policy=...)`` makes such a router its own
    unit with a float32 policy.  Its parameters are float32 in every forward, the logits float32,
    the experts chosen those of one process under bf16 autocast on the whole batch, the losses and
    every gradient equal to that run's to bf16 rounding: the losses to eps = 2^-7, each gradient to
    2 eps of its largest entry (either side rounds its token sums to bf16 once: the ranks their
    halves, the one process the whole batch)."""
    eps = torch.finfo(torch.bfloat16).eps
    for rank, r in enumerate(x["mixed"] for x in two_ranks):
        assert r.pop("ddp_refused") == (
            f"mp_policy={MIXED_POLICY_REPR} is not allowed with dp='ddp'; expected a "
            "torch.distributed.fsdp.MixedPrecisionPolicy with dp='fsdp' (otherwise run under torch.autocast)"
        )
        assert r.pop("ep_world_refused") == (
            "mp_policy is not allowed with ep=2 on 2 processes: each rank holds its experts whole, outside "
            "FSDP2, which would not cast them; run under torch.autocast, or with ep < world size"
        )
        for method, m in r.items():
            assert m["router_dtypes"] == {torch.float32}, (rank, method)
            assert m["logits_dtype"] == torch.float32 and m["same_routing"], (rank, method)
            assert m["expert_dtype"] == {torch.float32}, (rank, method)  # sharded at rest in float32
            got, want = m["losses"]
            assert want[0] != want[1]
            for a, b in zip(got, want):
                assert abs(a - b) <= eps * abs(b), (rank, method, got, want)
            worst = max(m["grad_errors"].items(), key=lambda kv: kv[1])
            assert worst[1] <= 2 * eps, (rank, method, worst)


MIXED_POLICY_REPR = (
    "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=None, "
    "cast_forward_inputs=True)"
)


# ------------------------------------------------------------------------------------ routing context in shards
def _scheduled(warmup: float = 0.5) -> tuple[torch.nn.Module, moelab.RoutingContext]:
    """A ``competesmoe`` block (no competition before step 2 of 4, then every step) and a
    ``sharede-v3`` block (its selection bias moves every step), float64."""
    torch.manual_seed(0)
    layers = [
        moelab.MoE(D, 4, 2, d_hidden=6, method="competesmoe", **TOKEN_MEANS, competition_balance_coef=0.0),
        moelab.MoE(D, 4, 2, d_hidden=6, method="sharede-v3", num_shared=1, **TOKEN_MEANS),
    ]
    model = torch.nn.Sequential(torch.nn.Linear(D, D), *layers, torch.nn.Linear(D, C)).double()
    ctx = moelab.routing_context(model, 4, 0, omega=1.0, competition_warmup=warmup)
    return WithAux(model), ctx


def _steps(model, ctx, opt, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = _batch(step)
        loss = _loss(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.advance()
        losses.append(loss.item())
    return losses


def test_a_sharded_checkpoint_resumes_the_routing_context_as_an_uninterrupted_run(tmp_path):
    """``save_sharded`` once wrote the weights and the optimizer only: a resume restarted the routing
    step at 0 and with it the competition schedule.  Now the folder holds the context (and the
    selection bias, in the shards): two steps, save, a fresh model, context and optimizer, load, two
    more steps = four uninterrupted steps, bit for bit."""
    import warnings

    from moelab.train.parallelize import ROUTING, load_sharded, save_sharded

    model, ctx = _scheduled()
    want = _steps(model, ctx, torch.optim.AdamW(model.parameters(), lr=0.05), range(4))
    model, ctx = _scheduled()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    first = _steps(model, ctx, opt, range(2))
    with warnings.catch_warnings():  # one process: DCP's "assuming a single process" is meant
        warnings.simplefilter("ignore", UserWarning)
        save_sharded(tmp_path / "dcp", model, opt)
        assert (tmp_path / "dcp" / ROUTING).is_file()
        model, ctx = _scheduled()
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        load_sharded(tmp_path / "dcp", model, opt)
    assert ctx.step == 2
    assert first + _steps(model, ctx, opt, range(2, 4)) == want
    assert want[2] != _steps(*_scheduled(), torch.optim.SGD([torch.zeros(1)]), range(2, 3))[0]  # it mattered


def _sharded_resume(rank: int, world: int, out: str) -> dict:
    """The same on the ranks, EP × FSDP2 (``ep`` = world): four steps against two, ``save_sharded``,
    a fresh parallelized model and context, ``load_sharded``, two more."""
    from moelab.train.parallelize import load_sharded, parallelize, save_sharded

    def fresh():
        model, ctx = _scheduled()
        parallelize(model, dp="fsdp", ep=world)
        return model, ctx, torch.optim.AdamW(model.parameters(), lr=0.05, foreach=False)

    def steps(model, ctx, opt, span):
        losses = []
        for step in span:
            x, y = _batch(step, world, rank)
            loss = _loss(model, x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ctx.advance()
            value = loss.detach().clone()
            dist.all_reduce(value)
            losses.append(value.item() / world)
        return losses

    want = steps(*fresh(), range(4))
    model, ctx, opt = fresh()
    got = steps(model, ctx, opt, range(2))
    save_sharded(os.path.join(out, "resume"), model, opt)
    model, ctx, opt = fresh()
    load_sharded(os.path.join(out, "resume"), model, opt)
    return {"step": ctx.step, "got": got + steps(model, ctx, opt, range(2, 4)), "want": want}


def test_a_sharded_checkpoint_of_expert_parallel_fsdp2_ranks_resumes_as_an_uninterrupted_run(two_ranks):
    for r in (x["resume"] for x in two_ranks):
        assert r["step"] == 2 and r["got"] == r["want"]


def test_a_sharded_checkpoint_refuses_a_routing_context_that_does_not_match(tmp_path):
    import warnings

    from moelab.errors import CheckpointError
    from moelab.layer import moe_layers
    from moelab.train.parallelize import ROUTING, load_sharded, save_sharded

    model, ctx = _scheduled()
    ctx.step = 2
    path = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        save_sharded(path, model)
        other, _ = _scheduled(warmup=0.25)
        with pytest.raises(CheckpointError) as err:
            load_sharded(path, other)
        assert str(err.value) == (
            f"checkpoint {path} has routing schedule {{'a_max': 6, 'num_layers': 2, 'omega': 1.0, 'seed': 0, "
            "'total_steps': 4, 'type': 'competition', 'warmup': 0.5}, this context {'a_max': 6, 'num_layers': 2, "
            "'omega': 1.0, 'seed': 0, 'total_steps': 4, 'type': 'competition', 'warmup': 0.25}; expected the same "
            "schedule (same model, steps, seed and schedule options)"
        )
        bare = _scheduled()[0]
        for layer in moe_layers(bare):
            layer.ctx = None
        with pytest.raises(CheckpointError) as err:
            load_sharded(path, bare)
        assert str(err.value) == (
            f"checkpoint {path} holds the routing context of step 2 and the model has none; expected the run's "
            "context attached first (moelab.routing_context(model, total_steps, seed, ...)) or passed as ctx="
        )
        (path / ROUTING).unlink()
        with pytest.raises(CheckpointError) as err:
            load_sharded(path, _scheduled()[0])
        assert str(err.value) == (
            f"checkpoint {path} has no routing.json and the model has a routing context (step 0); expected a "
            "folder of save_sharded, which records the step to continue from"
        )


# ------------------------------------------------------------------------------------ per-block compile
CD = 16  # float32, sizes the grouped kernel takes: the layer traces as one graph
#: the three objectives: a per-forward balance and z loss, DeepSeek-V3's selection bias (its load
#: summed over the ranks at each step), and the global-batch balance formed by a StepBalance
COMPILED_METHODS = {
    "smoe": {"method": "smoe"},
    "sharede-v3": {"method": "sharede-v3", "num_shared": 1, "bias_update_rate": 0.01},
    "global": {"method": "smoe", "balance_scope": "global", "importance_coef": 0.1},
    # Default MoE: its router runs the experts (through the bank's call) and sums their outputs over
    # the ranks at each step
    "default-moe": {"method": "default-moe"},
    # EMO's document pools (a fixed size: the ranks and one process draw alike), balanced per forward
    "emo": {"method": "emo", "min_pool": 3, "max_pool": 3, "balance_scope": "micro"},
}


class _Block(torch.nn.Module):
    def __init__(self, checkpointed: bool, **options) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(CD)
        self.moe = moelab.MoE(CD, 4, 2, d_hidden=CD, **options)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        docs = doc_inputs(self.moe, h)  # a router that routes by document (EMO): two a sequence
        if self.checkpointed:
            return x + torch.utils.checkpoint.checkpoint(
                lambda v: self.moe(v, **docs), h, use_reentrant=False
            )
        return x + self.moe(h, **docs)


class _Blocks(torch.nn.Module):
    """A transformer's shape: an input projection, a ModuleList of blocks, a head."""

    def __init__(self, name: str, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(CD, CD)
        self.blocks = torch.nn.ModuleList([_Block(checkpointed, **COMPILED_METHODS[name]) for _ in range(2)])
        self.head = torch.nn.Linear(CD, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.reshape(-1, CD))  # a Linear's 3-D output is a view (FSDP2 would warn)


def _compiled_batch(step: int, world: int = 1, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    x, y = torch.randn(4, 6, CD, generator=g), torch.randint(0, C, (4, 6), generator=g)
    n = 4 // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def _compiled_training(name: str, world: int, rank: int, layout: tuple | None, steps: int = 2):
    """``steps`` AdamW steps; the loss (mean over ranks) and the full gradients (by the eager
    module's names) of each.  ``layout``: ``(dp, ep, fullgraph, checkpointed)`` on ``world`` ranks,
    the blocks compiled one by one after ``parallelize``; ``None``: one eager process, whose loss
    is the mean of the ranks' (their shards one forward each; the global balance: the whole batch
    in one forward, as the ranks' statistics are summed)."""
    from moelab.balance import StepBalance
    from moelab.train.parallelize import parallelize

    dp, ep, fullgraph, checkpointed = layout or (None, 1, False, False)
    model = _Blocks(name, checkpointed)
    ctx = moelab.routing_context(model, 10)
    balance = StepBalance(model, ctx) if name == "global" else None
    forward = model
    if layout is not None:
        forward = parallelize(model, dp=dp, ep=ep)
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend="aot_eager", fullgraph=fullgraph)
    shards = (
        [(world, rank)] if layout is not None or balance is not None else [(world, r) for r in range(world)]
    )
    if len(shards) > 1:
        moelab.set_aux_scale(model, 1.0 / len(shards))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses, grads = [], []
    for step in range(steps):
        opt.zero_grad()
        loss = 0.0
        for w, r in shards:
            x, y = _compiled_batch(step, 1 if balance is not None and layout is None else w, r)
            out = forward(x)
            part = torch.nn.functional.cross_entropy(out, y.reshape(-1)) + moelab.aux_loss(model)
            if balance is not None:
                balance.record()
                part = part + balance.loss()
            loss = loss + part / len(shards)
        loss.backward()
        value = loss.detach().clone()
        if layout is not None:
            dist.all_reduce(value)
        losses.append(value.item() / (world if layout is not None else 1))
        grads.append({k.replace("_orig_mod.", ""): v for k, v in _full_grads(model).items()})
        opt.step()
        ctx.advance()
    return losses, grads


def _compiled_parity(rank: int, world: int, cases: list[tuple]) -> dict:
    """Per case ``(name, dp, ep, fullgraph, checkpointed)``: the largest difference from one eager
    process over the losses and every gradient, and the reference's losses."""
    import warnings

    refs = {name: _compiled_training(name, world, 0, None) for name in {c[0] for c in cases}}
    out = {}
    for name, *layout in cases:
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses, grads = _compiled_training(name, world, rank, tuple(layout))
        # FSDP2 warns of a module's output that is a view (the layer's output was one)
        views = [str(w.message)[:80] for w in caught if "returned a view" in str(w.message)]
        ref_losses, ref_grads = refs[name]
        err = max(abs(a - b) for a, b in zip(losses, ref_losses))
        for g, r in zip(grads, ref_grads):
            assert g.keys() == r.keys(), (g.keys(), r.keys())
            for k in r:
                if r[k] is None or g[k] is None:  # no gradient in one: a zero one in the other
                    assert (r[k] if g[k] is None else g[k]).abs().max() == 0, k
                    continue
                err = max(err, ((g[k] - r[k]).abs() / (1 + r[k].abs())).max().item())
        out["/".join(map(str, [name, *layout]))] = (err, ref_losses, refs[name][1][0], views)
    return out


def _check_compiled(results: list[dict], world: int, cases: list[tuple]) -> None:
    for rank, r in enumerate(results):
        assert len(r) == len(cases)
        for case, (err, ref_losses, ref_grads, views) in r.items():
            assert ref_losses[1] != ref_losses[0], case  # the step changed something
            assert views == [], (case, views)
            router = [g for k, g in ref_grads.items() if k.endswith("router.weight")]
            assert router and all(g.abs().max() > 0 for g in router), case
            # float32: summation orders of the compiled graph and of the reductions over the ranks
            assert err <= 1e-6, f"rank {rank}/{world}: {case} differs by {err}"


#: a small representative set: the aux gradient after the all-to-all's graph break (it was lost),
#: and EP x FSDP2 traced whole (fullgraph, checkpointed) with the global balance
COMPILED_DEFAULT = [("smoe", "ddp", 2, False, False), ("global", "fsdp", 2, True, True)]


def test_per_block_compile_under_every_layout_trains_as_one_eager_process(tmp_path):
    _check_compiled(spawn(_compiled_parity, 2, tmp_path, COMPILED_DEFAULT), 2, COMPILED_DEFAULT)


COMPILED_LAYOUTS = {
    2: [("ddp", 1), ("fsdp", 1), ("ddp", 2), ("fsdp", 2)],
    4: [("ddp", 1), ("fsdp", 1), ("ddp", 4), ("fsdp", 4), ("fsdp", 2)],
}


def _compiled_cases(world: int) -> list[tuple]:
    return [
        (name, dp, ep, fullgraph, checkpointed)
        for name in COMPILED_METHODS
        for dp, ep in COMPILED_LAYOUTS[world]
        for fullgraph in (False, True)
        for checkpointed in (False, True)
        # EP x FSDP2 with the experts FSDP-sharded over other ranks: the experts' own FSDP unit
        # inside the block is a graph break (docs/scaling-parallelize.md); without fullgraph it is right
        if not (fullgraph and dp == "fsdp" and 1 < ep < world)
        # EMO draws its pool sizes (torch.randint) in the graph: traced whole with activation
        # checkpointing and expert parallelism's all-to-all, AOT autograd fails on the saved RNG
        # state (torch's error, docs/methods.md); eager, or either alone, is right
        and not (name == "emo" and fullgraph and checkpointed and ep > 1)
    ]


def _experts_unit_compile(rank: int, world: int) -> dict:
    """EP x FSDP2 with ep = 2 of 4 ranks, blocks compiled: what each compile says and whether it runs."""
    import warnings

    from moelab.train.parallelize import parallelize

    out = {}
    for fullgraph in (False, True):
        torch._dynamo.reset()
        model = _Blocks("smoe", False)
        moelab.routing_context(model, 10)
        parallelize(model, dp="fsdp", ep=2)
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend="aot_eager", fullgraph=fullgraph)
        x, y = _compiled_batch(0, world, rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                torch.nn.functional.cross_entropy(model(x), y.reshape(-1)).backward()
                error = None
            except Exception as exc:  # fullgraph: torch's own error where the graph breaks
                error = type(exc).__name__
        said = [str(w.message) for w in caught if "an FSDP2 unit of their own" in str(w.message)]
        out[fullgraph] = (said, error)
    return out


def test_compiling_the_experts_own_fsdp2_unit_says_it_breaks_the_graph_before_fullgraph_fails(tmp_path):
    """ep < world size under FSDP2: the experts are an FSDP2 unit whose hooks do not trace; the
    compile says so while tracing, and without fullgraph the block still trains (its parity: the slow
    layout grid)."""
    for r in spawn(_experts_unit_compile, 4, tmp_path):
        (said, error), (said_full, error_full) = r[False], r[True]
        assert error is None and len(said) >= 1 and said[0].startswith("torch.compile meets the experts")
        assert error_full is not None and len(said_full) >= 1


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_per_block_compile_every_layout_method_and_mode_trains_as_one_eager_process(world, tmp_path):
    cases = _compiled_cases(world)
    _check_compiled(spawn(_compiled_parity, world, tmp_path, cases), world, cases)


# ------------------------------------------------------------------ the routers of 2026: 2 ranks = one process
#: each with an option that makes its state move visibly in 2 steps; token rounding on a top-K router
ROUTERS_2026 = {
    "quantile-balancing": ("quantile-balancing", {}),
    "expert-threshold": ("expert-threshold", {"ema": 0.5}),
    "deepseek-v4": ("deepseek-v4", {"bias_update_rate": 0.05}),
    "token-rounding": ("smoe", {**TOKEN_MEANS, "token_rounding": "up", "rounding_tile": 3}),
}
#: the buffers a step hook moves: quantile balancing's β, expert-threshold's τ, the selection bias
STEP_STATE = ("qb_beta", "tau", "tau_updates", "selection_bias")


def _model_2026(name: str) -> tuple[torch.nn.Module, moelab.RoutingContext]:
    torch.manual_seed(0)
    method, options = ROUTERS_2026[name]
    model = torch.nn.Sequential(
        torch.nn.Linear(D, D),
        moelab.MoE(D, 4, 2, d_hidden=6, method=method, **options),
        torch.nn.Linear(D, C),
    ).double()
    return model, moelab.routing_context(model, total_steps=10)


def _step_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in STEP_STATE}


def _one_process_of_ranks(name: str, world: int, steps: int = 2) -> tuple[list, list, list]:
    """One process, each step the ranks' batches as micro-batches (each loss / world, DDP's mean)."""
    model, ctx = _model_2026(name)
    moelab.set_aux_scale(model, 1 / world)  # the aux losses weighed as the task loss
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses, grads, states = [], [], []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for rank in range(world):
            x, y = _batch(step, world, rank)
            loss = _loss(WithAux(model), x, y) / world
            loss.backward()
            total += loss.item()
        losses.append(total)
        grads.append(_full_grads(model))
        opt.step()
        ctx.advance()
        states.append(_step_state(model))
    return losses, grads, states


def _ranks_2026(rank: int, world: int, cases: list[tuple[str, str, int]]) -> dict:
    from moelab.train.parallelize import parallelize

    out = {}
    for name, dp, ep in cases:
        model, ctx = _model_2026(name)
        forward = parallelize(WithAux(model), dp=dp, ep=ep)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        losses, grads, states = [], [], []
        for step in range(2):
            x, y = _batch(step, world, rank)
            loss = _loss(forward, x, y)
            opt.zero_grad()
            loss.backward()
            value = loss.detach().clone()
            dist.all_reduce(value)
            losses.append(value.item() / world)
            grads.append(_full_grads(model))
            opt.step()
            ctx.advance()
            states.append(_step_state(model))
        out[f"{name}/{dp}/ep{ep}"] = (losses, grads, states)
    return out


def _check_2026(results: list[dict], world: int, cases: list[tuple[str, str, int]]) -> None:
    for name, dp, ep in cases:
        ref_losses, ref_grads, ref_states = _one_process_of_ranks(name, world)
        assert ref_losses[1] != ref_losses[0], name  # the step changed something
        moved = [n for n, b in ref_states[1].items() if not torch.equal(b, ref_states[0][n])]
        assert moved or name == "token-rounding", name  # the step state moved (rounding has none)
        for rank, r in enumerate(results):
            losses, grads, states = r[f"{name}/{dp}/ep{ep}"]
            where = f"rank {rank}/{world}: {name} {dp} ep={ep}"
            assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-12, where
            for g, ref in zip(grads, ref_grads):
                assert g.keys() == ref.keys(), where
                for k in g:
                    if ref[k] is None:
                        assert g[k] is None or g[k].abs().max() == 0, (where, k)
                    else:
                        torch.testing.assert_close(g[k], ref[k], rtol=1e-9, atol=1e-12, msg=f"{where} {k}")
            for s, ref in zip(states, ref_states):
                assert s.keys() == ref.keys(), where
                for k in s:  # float64, as the model
                    torch.testing.assert_close(s[k], ref[k], rtol=1e-9, atol=1e-12, msg=f"{where} {k}")


def test_token_rounding_moves_tokens_in_the_parity_case():
    """The token-rounding case of the parity test below rounds: some expert's count changes."""
    model, _ = _model_2026("token-rounding")
    model.train()
    x, _ = _batch(0, 2, 0)
    routing = model[1].router(model[0](x))
    model(x)
    rounded = model[1].last_routing
    own = torch.bincount(routing.indices.flatten(), minlength=4)
    kept = torch.bincount(rounded.indices[rounded.mask], minlength=4)
    assert not torch.equal(own, kept) and ((kept % 3 == 0) | (kept == x.shape[0])).all()  # at most T


CASES_2026 = [(name, dp, ep) for name in ROUTERS_2026 for dp, ep in (("ddp", 1), ("ddp", 2))]
#: the default suite's representative: the two global-batch measurements, under DDP and under EP + DDP
FAST_CASES_2026 = [("quantile-balancing", "ddp", 2), ("expert-threshold", "ddp", 1)]


def test_quantile_balancing_and_expert_threshold_on_two_ranks_step_as_one_process(tmp_path):
    """Quantile balancing and expert-threshold measure each piece (a micro-batch on one rank) and
    average the pieces' quantiles over the ranks in the step hook: 2 ranks equal one process running
    the ranks' batches as micro-batches — the loss, every gradient, and β and τ after each of 2 steps."""
    _check_2026(spawn(_ranks_2026, 2, tmp_path, FAST_CASES_2026), 2, FAST_CASES_2026)


@pytest.mark.slow
def test_the_routers_of_2026_on_two_ranks_give_the_loss_gradients_and_step_state_of_one_process(tmp_path):
    """Quantile balancing, expert-threshold, DeepSeek-V4 (its selection bias sums the ranks' loads) and
    token rounding (each rank rounds its own forward), under DDP and under expert parallelism + DDP:
    2 ranks equal one process running the ranks' batches as micro-batches — the loss, every gradient,
    and β, τ and the bias after each of 2 steps."""
    _check_2026(spawn(_ranks_2026, 2, tmp_path, CASES_2026), 2, CASES_2026)
