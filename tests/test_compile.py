"""torch.compile: the MoE layer traces without graph breaks and compiled steps equal eager ones.

Fast checks use dynamo's ``eager`` / ``aot_eager`` backends (no C++ compilation); the inductor
checks are marked ``slow``.
"""

from __future__ import annotations

import copy
import json
import re
import warnings

import pytest
import torch
import torch._dynamo.testing

import moelab
from moelab import MoE
from moelab.balance import StepBalance
from moelab.cli import main
from moelab.experts import ExpertBank
from moelab.layer import attach
from moelab.methods import get_method, methods
from moelab.routing import RoutingContext
from moelab.schedules import CompetitionSchedule
from router_grid import doc_inputs

# routers whose steady-state forward (training, no competition) compiles as one graph
FULLGRAPH_METHODS = ["smoe", "competesmoe", "xmoe", "pcosine", "sigma-moe", "sharede-v3"]


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _layer(method: str, **kw) -> MoE:
    torch.manual_seed(0)
    return MoE(32, 8, 2, 64, method=method, activation="swiglu", **kw)


def _step(module, owner: MoE, x: torch.Tensor, g: torch.Tensor):
    """One training step (task loss ``<y, g>`` + aux loss, as a trainer does); returns output,
    input grad, parameter grads and aux loss."""
    x = x.clone().requires_grad_()
    owner.zero_grad(set_to_none=True)
    y = module(x)
    ((y * g).sum() + owner.aux_loss).backward()
    grads = {n: p.grad for n, p in owner.named_parameters()}
    return y.detach(), x.grad, grads, owner.aux_loss.detach()


def _assert_steps_equal(got, want) -> None:
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    torch.testing.assert_close(got[3], want[3])
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], msg=name)


def _compare_with_eager(method: str, backend: str, steps: int = 2, **kw) -> None:
    """Two training steps of a compiled copy (fullgraph) against two eager steps of another copy
    (copies, because sharede-v3 updates its selection bias every training step)."""
    eager = _layer(method, **kw)
    compiled_owner = copy.deepcopy(eager)
    compiled = torch.compile(compiled_owner, backend=backend, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # competesmoe without a schedule warns (eagerly) once
        for _ in range(steps):
            x, g = torch.randn(64, 32, generator=gen), torch.randn(64, 32, generator=gen)
            torch.manual_seed(3)  # the same dropout draws (sigma-moe's expert dropout) in both
            got = _step(compiled, compiled_owner, x, g)
            torch.manual_seed(3)
            _assert_steps_equal(got, _step(eager, eager, x, g))


@pytest.mark.parametrize("method", FULLGRAPH_METHODS)
@pytest.mark.parametrize("training", [True, False])
def test_layer_traces_as_one_graph(method, training):
    layer = _layer(method).train(training)
    x = torch.randn(64, 32, requires_grad=True)
    explanation = torch._dynamo.explain(layer)(x)
    assert explanation.graph_break_count == 0, [str(b.reason)[:300] for b in explanation.break_reasons]
    assert explanation.graph_count == 1


def test_finite_check_is_traced_not_a_graph_break():
    layer = _layer("smoe", check_finite=True)
    assert torch._dynamo.explain(layer)(torch.randn(16, 32)).graph_break_count == 0
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    compiled(torch.randn(16, 32))  # finite: runs
    bad = torch.randn(16, 32)
    bad[3, 0] = float("nan")
    with pytest.raises(RuntimeError, match="not finite"):
        compiled(bad)


@pytest.mark.slow
def test_a_biased_router_with_sequence_balance_compiles_as_one_graph_and_counts_its_load():
    eager = _layer("xmoe", selection_bias=True, balance_scope="sequence").train()
    owner = copy.deepcopy(eager)
    x = torch.randn(4, 16, 32)
    explanation = torch._dynamo.explain(owner)(x)
    assert explanation.graph_break_count == 0, [str(b.reason)[:300] for b in explanation.break_reasons]
    owner.router.pending_load.zero_()  # explain ran the forward
    compiled = torch.compile(owner, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), eager(x))
    torch.testing.assert_close(owner.aux_loss, eager.aux_loss)  # the per-sequence balance
    assert torch.equal(owner.router.pending_load, eager.router.pending_load)  # the bias's load, counted once
    assert eager.router.pending_load.sum().item() == 4 * 16 * 2


@pytest.mark.parametrize("method", ["smoe", "competesmoe"])
def test_compiled_training_step_equals_eager_aot(method):
    _compare_with_eager(method, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["xmoe", "pcosine", "sigma-moe", "sharede-v3"])
def test_compiled_training_step_equals_eager_aot_other_routers(method):
    _compare_with_eager(method, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["smoe", "competesmoe"])
def test_compiled_training_step_equals_eager_inductor(method):
    _compare_with_eager(method, "inductor")


@pytest.mark.parametrize("impl", ["loop", "grouped"])
def test_compiled_expert_bank_gradients_equal_eager(impl):
    """The bank alone (biases, K=3) compiled with ``aot_eager`` gives eager's output and every
    gradient: pins the out-of-place combine under compile (torch 2.11 silently misrouted the
    gradient of an in-place-modified ``autograd.Function`` output, pytorch/pytorch#180642)."""
    torch.manual_seed(0)
    bank = ExpertBank(8, 32, 64, "swiglu", bias=True, impl=impl)
    gen = torch.Generator().manual_seed(4)
    x, g = torch.randn(48, 32, generator=gen), torch.randn(48, 32, generator=gen)
    indices = torch.rand(48, 8, generator=gen).argsort(-1)[:, :3]  # 3 distinct experts per token
    weights = torch.rand(48, 3, generator=gen)
    compiled = torch.compile(bank, backend="aot_eager")
    results = []
    for module in (bank, compiled):
        bank.zero_grad(set_to_none=True)
        xx, ww = x.clone().requires_grad_(), weights.clone().requires_grad_()
        y = module(xx, moelab.Routing(indices, ww))
        (y * g).sum().backward()
        results.append([y.detach(), xx.grad, ww.grad, *(p.grad for p in bank.parameters())])
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want)


def test_competesmoe_schedule_compiles_once_per_branch():
    """With a schedule the lookup runs outside the graph (one break); after one compilation per
    branch (competes / does not) later steps reuse the compiled code, and every step equals eager."""
    eager = _layer("competesmoe")
    owner = copy.deepcopy(eager)
    schedule = CompetitionSchedule(1, 20, omega=0.5, warmup=0.0, seed=0)
    flags = [schedule.active(0, t) for t in range(6)]
    assert True in flags and False in flags  # both branches are exercised
    ctx_e, ctx_c = (
        RoutingContext(total_steps=20, schedule=schedule),
        RoutingContext(total_steps=20, schedule=schedule),
    )
    attach(eager, ctx_e)
    attach(owner, ctx_c)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(owner, backend=counter)
    gen = torch.Generator().manual_seed(2)
    frames = []
    for t in range(6):
        ctx_e.step = ctx_c.step = t
        x, g = torch.randn(64, 32, generator=gen), torch.randn(64, 32, generator=gen)
        _assert_steps_equal(_step(compiled, owner, x, g), _step(eager, eager, x, g))
        frames.append(counter.frame_count)
    first_of_both = max(flags.index(True), flags.index(False))
    assert frames[first_of_both:] == [frames[first_of_both]] * (6 - first_of_both)  # no recompiles


def test_explicit_loop_impl_breaks_the_graph_at_its_host_sync():
    """``impl="loop"`` reads the expert counts on the host (``counts.tolist()``): a documented
    graph break; ``auto`` picks ``grouped`` here and has none (test above)."""
    layer = _layer("smoe", impl="loop")
    explanation = torch._dynamo.explain(layer)(torch.randn(16, 32))
    assert explanation.graph_break_count >= 1


# ------------------------------------------------------------------ moelab bench layer --compile
BENCH_TINY = ["bench", "layer", "-T", "16", "--d-model", "8", "--d-hidden", "8", "-N", "4", "-K", "2"]


def test_bench_compile_needs_a_warmup_round(capsys):
    assert main([*BENCH_TINY, "--repeats", "1", "--warmup", "0", "--no-hf", "--compile"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"warmup=0 is not allowed with --compile; expected >= 1", err)


@pytest.mark.slow
def test_bench_compile_adds_compiled_candidates_in_both_phases(capsys):
    args = [
        *BENCH_TINY,
        "--repeats",
        "1",
        "--warmup",
        "1",
        "--no-hf",
        "--impl",
        "auto",
        "--json",
        "--compile",
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    names = {(r["name"], r["phase"]) for r in out["results"]}
    for phase in ("train", "infer"):
        assert ("compiled dense", phase) in names
        assert ("compiled moelab auto", phase) in names
    assert out["config"]["compile"] == "default"
    assert all(r["note"] == "" for r in out["results"])  # same FLOPs as dense


# ------------------------------------------------------------------ per-block compile (torchtitan's way)
# methods whose routing does not change with the step: their 12 blocks share one graph
STEP_FREE_METHODS = [
    "smoe", "smoe-fixed", "xmoe", "pcosine", "sigma-moe", "sharede-v2", "sharede-v3", "hyperrouter", "densemoe",
]  # fmt: skip


class _Block(torch.nn.Module):
    def __init__(self, method: str, checkpointed: bool, **options) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.moe = MoE(16, 4, 2, 16, method=method, **options)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        docs = doc_inputs(self.moe, h)  # a router that routes by document (EMO): two a sequence
        if self.checkpointed:
            return x + torch.utils.checkpoint.checkpoint(
                lambda v: self.moe(v, **docs), h, use_reentrant=False
            )
        return x + self.moe(h, **docs)


def _per_block_steps(method: str, checkpointed: bool, compiled: bool, steps: int = 2, total_steps: int = 10):
    """``steps`` training steps of 12 blocks, each compiled alone with ``fullgraph=True`` (or eager):
    losses, the gradients and the frames compiled after each step."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([_Block(method, checkpointed) for _ in range(12)])
    ctx = RoutingContext(total_steps=total_steps)
    attach(blocks, ctx)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    run = [torch.compile(b, backend=counter, fullgraph=True) for b in blocks] if compiled else list(blocks)
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        blocks.zero_grad(set_to_none=True)
        x = torch.randn(2, 8, 16, generator=gen, requires_grad=True)  # as an embedding's output
        h = x
        for block in run:
            h = block(h)
        loss = h.square().mean() + moelab.aux_loss(blocks)
        loss.backward()
        ctx.advance()
        out.append(
            (
                loss.detach(),
                {n: p.grad.clone() for n, p in blocks.named_parameters() if p.grad is not None},
                counter.frame_count,
            )
        )
    return out


def _assert_same_training(got, want) -> None:
    for (loss, grads, _), (loss_want, grads_want, _) in zip(got, want, strict=True):
        torch.testing.assert_close(loss, loss_want)
        assert grads.keys() == grads_want.keys()  # the same parameters trained (stablemoe's stage 2: fewer)
        for name in grads_want:
            torch.testing.assert_close(grads[name], grads_want[name], msg=name)


def _check_per_block(method: str, checkpointed: bool) -> None:
    got = _per_block_steps(method, checkpointed, compiled=True)
    assert [frames for *_, frames in got] == [1, 1]  # 12 blocks, one graph, no recompile at step 2
    _assert_same_training(got, _per_block_steps(method, checkpointed, compiled=False))


def test_twelve_blocks_compile_per_block_fullgraph_once():
    _check_per_block("sharede-v3", checkpointed=False)


def test_twelve_blocks_compile_per_block_with_activation_checkpointing():
    _check_per_block("xmoe", checkpointed=True)


@pytest.mark.slow
@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("method", STEP_FREE_METHODS)
def test_twelve_blocks_compile_per_block_every_method(method, checkpointed):
    _check_per_block(method, checkpointed)


@pytest.mark.slow
def test_competesmoe_blocks_compile_once_per_branch_not_per_layer():
    """The schedule lookup (and the layer index it needs) runs outside the traced code: the
    competesmoe blocks compile their frames once per branch (a per-layer guard would compile each
    of the 4 layers' frames apart, past the limit of 2 set here), and later steps compile nothing."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([_Block("competesmoe", False) for _ in range(4)])
    ctx = moelab.routing_context(blocks, 10)
    attach(blocks, ctx)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    run = [torch.compile(b, backend=counter) for b in blocks]
    frames = []
    # a per-layer guard would exceed a limit of 2 (a branch each) and raise
    with torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        for _ in range(3):
            h = torch.randn(2, 8, 16, requires_grad=True)
            for block in run:
                h = block(h)
            (h.square().mean() + moelab.aux_loss(blocks)).backward()
            ctx.advance()
            frames.append(counter.frame_count)
    assert frames[1:] == [frames[0]] * 2


# the methods whose routing needs no schedule (the competition methods compete on the steps of a
# schedule looked up outside the traced code, one graph break: test_competesmoe_* above)
# (``competition``, every expert on every step, cannot: test_competition_cannot_compile_as_one_graph)
ROUTER_ONLY_METHODS = [m for m in methods() if get_method(m).schedule is None and m != "competition"]


def _check_compiles_once(method: str, checkpointed: bool, steps: int = 3) -> None:
    # 40 planned steps: smoe-dropout's K (2 of 4 → 4) and stablemoe's stage (switch at step 4) stay
    # put over the first 3 steps; their changes are tested below
    got = _per_block_steps(method, checkpointed, compiled=True, steps=steps, total_steps=40)
    assert [frames for *_, frames in got] == [1] * steps  # 12 blocks, one graph, no recompile
    _assert_same_training(
        got, _per_block_steps(method, checkpointed, compiled=False, steps=steps, total_steps=40)
    )


@pytest.mark.parametrize(
    ("method", "checkpointed"),
    [
        ("stablemoe", True),
        ("remoe", True),
        ("quantile-balancing", True),
        ("deepseek-v4", False),
        ("routing-free", True),
        ("latent-prototype", True),
    ],
)
def test_step_dependent_and_stateful_routers_compile_per_block_once(method, checkpointed):
    """stablemoe reads its stage from a step watcher, not from ``ctx.step`` (a guard on the step
    recompiled every step); remoe, quantile-balancing and routing-free add their step's statistics
    in place (a ``+=`` on the buffer was an attribute store, refused under activation
    checkpointing); deepseek-v4 reads whether it is a hash layer as a bool set with its layer index,
    not the index (a guard per layer recompiled every layer); latent-prototype draws its latent
    sample in the forward (checkpointing's recomputation redraws the same)."""
    _check_compiles_once(method, checkpointed)


@pytest.mark.slow
@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("method", ROUTER_ONLY_METHODS)
def test_twelve_blocks_compile_per_block_every_router_only_method(method, checkpointed):
    _check_compiles_once(method, checkpointed)


def test_competition_cannot_compile_as_one_graph():
    """The one router-only method that does not trace as one graph: the competition runs the winners'
    experts with the expert-sorted kernel, whose backward loops over the experts on the host
    (``if c == 0`` per expert count, moelab.experts.kernels), a data-dependent branch dynamo cannot
    trace with ``fullgraph=True``."""
    block = torch.compile(_Block("competition", False), backend="aot_eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.UserError, match="data-dependent expression"):
        block(torch.randn(2, 8, 16, requires_grad=True))


def test_smoe_dropout_compiles_once_per_distinct_k_not_per_step():
    """K grows 2 → 4 over 4 planned steps (2, 2, 3, 4 at steps 0-3): a new K is a new shape, one
    compilation each (at most k_max − top_k + 1 in a run); a step that keeps K compiles nothing."""
    got = _per_block_steps("smoe-dropout", False, compiled=True, steps=5, total_steps=4)
    assert [frames for *_, frames in got] == [1, 1, 2, 3, 3]
    _assert_same_training(
        got, _per_block_steps("smoe-dropout", False, compiled=False, steps=5, total_steps=4)
    )


@pytest.mark.slow
def test_stablemoe_compiles_once_per_stage_with_checkpointing():
    """Stage 2 starts at step round(0.1 · 10) = 1: two compilations in the run, none after."""
    got = _per_block_steps("stablemoe", True, compiled=True, steps=4, total_steps=10)
    assert [frames for *_, frames in got] == [1, 2, 2, 2]
    _assert_same_training(got, _per_block_steps("stablemoe", True, compiled=False, steps=4, total_steps=10))


def test_step_watchers_follow_every_change_of_the_step():
    """The values a compiled forward reads follow ``ctx.step`` however it changes: advance (also by
    several steps), an assignment, load_state_dict, a new total_steps; a context the router does not
    watch is read directly."""
    dropout, stable = MoE(16, 8, 2, 16, method="smoe-dropout"), MoE(16, 8, 2, 16, method="stablemoe")
    ctx = RoutingContext(total_steps=6)
    attach(torch.nn.ModuleList([dropout, stable]), ctx)
    k, stage = dropout.router, stable.router

    def expected(c):  # the formulas, from the context itself
        return 2 + round(6 * min(c.step / c.total_steps, 1.0)), 2 if c.step >= round(
            0.1 * c.total_steps
        ) else 1

    seen = []
    for change in (
        lambda: None,
        ctx.advance,
        lambda: ctx.advance(3),
        lambda: setattr(ctx, "step", 0),
        lambda: ctx.load_state_dict({"step": 5, "total_steps": 6, "schedule": None}),
        lambda: setattr(ctx, "total_steps", 100),
    ):
        change()
        got = (k.current_k(ctx), stable.router.stage(ctx))
        assert got == expected(ctx), ctx
        assert k._step_values[0] is ctx and stage._step_values[0] is ctx  # read from the watcher
        seen.append(got)
    assert len(set(seen)) > 2  # K and the stage did change
    other = RoutingContext(step=6, total_steps=6)  # not attached: computed from the context
    assert (k.current_k(other), stage.stage(other)) == (8, 2)


# ------------------------------------------------------------------ the global balance scope, compiled per block
def _global_balance_steps(checkpointed: bool, compiled: bool, backend: str = "aot_eager", steps: int = 2):
    """12 blocks of ``balance_scope="global"`` under a StepBalance, two micro-batches a step and one
    backward (the step's exact loss): the global losses, the gradients and the frames compiled."""
    torch.manual_seed(0)
    options = {"balance_scope": "global", "importance_coef": 0.1}
    blocks = torch.nn.ModuleList([_Block("smoe", checkpointed, **options) for _ in range(12)])
    ctx = RoutingContext(total_steps=10)
    attach(blocks, ctx)
    balance = StepBalance(blocks, ctx)
    counter = torch._dynamo.testing.CompileCounterWithBackend(backend)
    run = [torch.compile(b, backend=counter, fullgraph=True) for b in blocks] if compiled else list(blocks)
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        blocks.zero_grad(set_to_none=True)
        task = 0.0
        for _ in range(2):
            h = torch.randn(2, 8, 16, generator=gen, requires_grad=True)
            for block in run:
                h = block(h)
            task = task + h.square().mean() / 2
            balance.record()
        loss = balance.loss()
        (task + loss + moelab.aux_loss(blocks)).backward()
        ctx.advance()
        grads = {n: p.grad.clone() for n, p in blocks.named_parameters()}
        out.append((loss.detach(), grads, counter.frame_count))
    return out


@pytest.mark.parametrize("checkpointed", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_global_balance_compiles_per_block_and_trains_as_eager(checkpointed):
    """The global scope keeps no routing on the layer (its statistics go into a buffer in place, its
    gradient comes back through the output): 12 blocks compile with fullgraph, with activation
    checkpointing too, one graph for the 12 and no recompile at step 2, and the loss and every
    gradient equal eager's."""
    got = _global_balance_steps(checkpointed, compiled=True)
    assert [frames for *_, frames in got] == [1, 1]
    want = _global_balance_steps(checkpointed, compiled=False)
    _assert_same_training(got, want)
    assert want[0][0] > 0
    if checkpointed:  # the recomputation writes no statistics again: eager checkpointed = plain eager
        _assert_same_training(want, _global_balance_steps(False, compiled=False))


@pytest.mark.slow
@pytest.mark.parametrize("checkpointed", [False, True])
def test_global_balance_compiled_with_inductor_trains_as_eager(checkpointed):
    """Inductor's partition may move work of the backward into the forward: the gradient the
    StepBalance writes after the forward is still read in the backward (an opaque op tied to it)."""
    _assert_same_training(
        _global_balance_steps(checkpointed, compiled=True, backend="inductor"),
        _global_balance_steps(checkpointed, compiled=False),
    )


# ------------------------------------------------------------------ graph breaks inside the layer
@pytest.mark.parametrize("global_balance", [False, True])
def test_a_graph_break_inside_the_experts_keeps_the_aux_gradient(global_balance):
    """``impl="loop"`` breaks the graph at its host sync (as expert parallelism's all-to-all does):
    the code after the break takes the experts' output as an input, and an identity view of it
    returned by the layer was replayed by torch.compile outside the graph, without the aux-loss
    gradient riding on it.  The layer's output is a new tensor: the router gets eager's gradient."""
    options = {"balance_scope": "global", "importance_coef": 0.1} if global_balance else {}
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        layer = _layer("smoe", impl="loop", **options)
        ctx = RoutingContext(total_steps=10)
        attach(layer, ctx)
        balance = StepBalance(layer, ctx) if global_balance else None
        run = torch.compile(layer, backend="aot_eager") if compiled else layer
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
        y = run(x)
        loss = y.square().mean() + moelab.aux_loss(layer)
        if balance is not None:
            balance.record()
            loss = loss + balance.loss()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in layer.named_parameters()}))
    (loss, grads), (loss_want, grads_want) = results[1], results[0]
    torch.testing.assert_close(loss, loss_want)
    assert grads.keys() == grads_want.keys()
    for name in grads_want:
        torch.testing.assert_close(grads[name], grads_want[name], msg=name)


def _competesmoe_blocks(checkpointed: bool):
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([_Block("competesmoe", checkpointed) for _ in range(4)])
    ctx = moelab.routing_context(blocks, 10, omega=0.5, competition_warmup=0)
    attach(blocks, ctx)
    return blocks, ctx


def _competesmoe_steps(checkpointed: bool, compiled: bool, steps: list[int], fullgraph: bool = False):
    """Training steps at the given steps of the schedule: losses, gradients, frames compiled."""
    blocks, ctx = _competesmoe_blocks(checkpointed)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    run = (
        [torch.compile(b, backend=counter, fullgraph=fullgraph) for b in blocks] if compiled else list(blocks)
    )
    gen = torch.Generator().manual_seed(1)
    out = []
    for step in steps:
        ctx.step = step
        blocks.zero_grad(set_to_none=True)
        h = torch.randn(2, 8, 16, generator=gen, requires_grad=True)
        for block in run:
            h = block(h)
        loss = h.square().mean() + moelab.aux_loss(blocks)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in blocks.named_parameters() if p.grad is not None}
        out.append((loss.detach(), grads, counter.frame_count))
    return out


def test_competesmoe_under_compile_and_activation_checkpointing_says_once_that_it_runs_eagerly():
    """The schedule lookup is a graph break and a competition step does not compile as one graph
    (the winners' backward loops over the experts on the host): inside activation checkpointing
    torch.compile gives up the checkpointed block's trace and runs it eagerly.  Its tracer says so
    (once: Python's default filter); the training equals eager's."""
    _, ctx = _competesmoe_blocks(True)
    assert {ctx.schedule.active(i, s) for i in range(4) for s in range(3)} == {True, False}
    with pytest.warns(
        UserWarning, match=r"^CompeteSMoE under torch\.compile: whether a layer competes is looked up"
    ):
        got = _competesmoe_steps(True, compiled=True, steps=[0, 1, 2])
    _assert_same_training(got, _competesmoe_steps(True, compiled=False, steps=[0, 1, 2]))
