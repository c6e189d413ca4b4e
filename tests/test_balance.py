"""The balance scopes of the load-based losses: ``micro``, ``sequence`` (DeepSeek-V3) and ``global``
(Qwen's global-batch balance, formed by :class:`moelab.balance.StepBalance`)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import moelab
from moelab.balance import StepBalance, attached_step_balance, step_balance_loss
from moelab.losses import importance_loss, mean_entropy_loss, sequence_balance_loss, switch_balance_loss

D, N, K = 8, 4, 2
#: the load-based losses on, the others off: what the scopes change
LOAD_COEFS = {"balance_coef": 0.01, "importance_coef": 0.1, "entropy_coef": 0.001, "z_coef": 0.0}


def pair(method="smoe", k=K, **options):
    """Two layers with the same weights: one of ``balance_scope="global"``, one of the default."""
    torch.manual_seed(0)
    scoped = moelab.MoE(D, N, k, method=method, balance_scope="global", **LOAD_COEFS, **options)
    ref = moelab.MoE(D, N, k, method=method, **LOAD_COEFS, **options)
    ref.load_state_dict(scoped.state_dict())
    return scoped.train(), ref.train()


def router_grad(layer):
    return torch.cat([p.grad.flatten() for p in layer.router.parameters() if p.grad is not None])


def test_sequence_balance_is_the_mean_of_the_switch_balance_of_each_sequence():
    probs = torch.rand(3 * 5, N, dtype=torch.float64).softmax(-1)
    indices = torch.stack([torch.randperm(N)[:K] for _ in range(15)])
    expected = (
        sum(switch_balance_loss(probs[5 * b : 5 * b + 5], indices[5 * b : 5 * b + 5], N) for b in range(3))
        / 3
    )
    torch.testing.assert_close(sequence_balance_loss(probs, indices, N, 5), expected)
    imp = sum(importance_loss(probs[5 * b : 5 * b + 5]) for b in range(3)) / 3
    torch.testing.assert_close(importance_loss(probs, seq_len=5), imp)
    ent = sum(mean_entropy_loss(probs[5 * b : 5 * b + 5]) for b in range(3)) / 3
    torch.testing.assert_close(mean_entropy_loss(probs, seq_len=5), ent)


def test_sequence_scope_layer_balances_each_sequence():
    torch.manual_seed(0)
    layer = moelab.MoE(D, N, K, method="smoe", balance_scope="sequence", **LOAD_COEFS)
    x = torch.randn(3, 5, D)
    layer(x)
    r = layer.last_routing
    expected = (
        0.01
        * sum(
            switch_balance_loss(r.probs[5 * b : 5 * b + 5], r.indices[5 * b : 5 * b + 5], N) for b in range(3)
        )
        / 3
        + 0.1 * importance_loss(r.probs, seq_len=5)
        + 0.001 * mean_entropy_loss(r.probs, seq_len=5)
    )
    torch.testing.assert_close(layer.aux_loss, expected)
    micro = moelab.MoE(D, N, K, method="smoe", **LOAD_COEFS)
    micro.load_state_dict(layer.state_dict())
    micro(x)
    assert abs(micro.aux_loss.item() - layer.aux_loss.item()) > 1e-6  # a different loss from the batch's


def test_sequence_scope_refuses_an_input_without_sequences():
    layer = moelab.MoE(D, N, K, method="smoe", balance_scope="sequence")
    with pytest.raises(
        ValueError, match=r"input of shape \(6, 8\) is not allowed with balance_scope='sequence'"
    ):
        layer(torch.randn(6, D))


def test_balance_scope_refuses_an_unknown_scope():
    with pytest.raises(ValueError, match=r"balance_scope='batch' is not allowed; expected one of"):
        moelab.MoE(D, N, K, method="smoe", balance_scope="batch")


def test_global_scope_without_a_step_balance_in_one_process_is_the_micro_batch_loss():
    scoped, ref = pair()
    x = torch.randn(2, 6, D)
    scoped(x), ref(x)
    torch.testing.assert_close(scoped.aux_loss, ref.aux_loss)


@pytest.mark.parametrize("method", ["smoe", "xmoe", "sigma-moe"])
def test_global_scope_two_micro_batches_give_the_loss_and_gradient_of_the_whole_batch(method):
    scoped, ref = pair(method, expert_dropout=0.0) if method == "sigma-moe" else pair(method)
    x = torch.randn(4, 6, D)
    balance = StepBalance(scoped)
    assert attached_step_balance(scoped) is balance
    task = 0.0
    for mb in x.chunk(2):
        task = task + scoped(mb).pow(2).mean() / 2
        balance.record()
        assert scoped.aux_loss.item() == 0.0  # the attached StepBalance forms the load-based losses
    global_loss = balance.loss()
    (task + global_loss).backward()
    y = ref(x)
    expected = ref.aux_loss
    (y.pow(2).mean() + expected).backward()
    torch.testing.assert_close(global_loss, expected)
    torch.testing.assert_close(router_grad(scoped), router_grad(ref))
    balance.close()
    assert scoped.step_statistics.balance is None


def test_global_scope_per_micro_batch_backward_uses_the_running_counts_of_the_step():
    """Gradient accumulation (each micro-batch its own backward): micro-batch m is balanced against the
    counts of micro-batches 1..m, the gradient of Megatron-Core's global_aux_loss; the value is the
    step's loss so far."""
    torch.manual_seed(0)
    scoped = moelab.MoE(D, N, K, method="smoe", balance_scope="global", balance_coef=1.0, z_coef=0.0).train()
    x = torch.randn(4, 6, D)
    ctx = moelab.RoutingContext()
    moelab.attach(scoped, ctx)
    StepBalance(scoped, ctx)
    firsts = []
    counts, probs = torch.zeros(N), []
    w = scoped.router.weight
    for mb in x.chunk(2):
        w.grad = None
        y = scoped(mb)
        routing = scoped.last_routing  # this forward's routing (detached)
        counts += torch.bincount(routing.indices.flatten(), minlength=N)
        probs.append(routing.probs)
        loss = step_balance_loss(scoped)
        f = counts / counts.sum()
        torch.testing.assert_close(loss, N * (f * torch.cat(probs).mean(0)).sum())
        # no task loss: the balance gradient reaches the router through the layer's output
        (0.0 * y.sum() + loss).backward()
        megatron = N * (f * scoped.router(mb.reshape(-1, D)).probs.mean(0)).sum()
        torch.testing.assert_close(w.grad, torch.autograd.grad(megatron, w)[0])
        firsts.append(loss.detach())
    ctx.advance()  # the step hook forgets the step's statistics
    scoped(x[:2])
    torch.testing.assert_close(step_balance_loss(scoped), firsts[0])


def test_a_layer_takes_one_step_balance_at_a_time():
    scoped, _ = pair()
    StepBalance(scoped)
    with pytest.raises(ValueError, match=r"MoE layer 0 is already attached to another StepBalance"):
        StepBalance(scoped)


def test_copies_of_a_layer_are_not_attached():
    import copy

    scoped, _ = pair()
    StepBalance(scoped)
    assert copy.deepcopy(scoped).step_statistics.balance is None


def test_step_balance_refuses_a_loss_before_the_last_ones_backward():
    """The layers read the gradient of the last loss() in their backward: a second loss() before the
    first one's backward would give the first forward the second's gradient."""
    scoped, _ = pair()
    balance = StepBalance(scoped)
    x = torch.randn(2, 6, D)
    y = scoped(x)
    balance.record()
    loss = balance.loss()
    scoped(x)
    balance.record()
    with pytest.raises(
        ValueError, match=r"StepBalance.loss\(\) is not allowed before the backward of the previous loss"
    ):
        balance.loss()
    (y.sum() + loss).backward()  # the first one's backward: the next loss() is allowed
    assert balance.loss().item() > 0


def test_step_balance_refuses_one_loss_over_forwards_that_form_different_losses():
    """One gradient buffer per layer: one loss() over two forwards needs the same losses in both (a
    router that formed a load loss itself on one of them, as densemoe on its dense steps, does not)."""
    scoped, _ = pair()
    balance = StepBalance(scoped)
    x = torch.randn(2, 6, D)
    scoped(x)
    balance.record()
    scoped(x)
    scoped.step_statistics.stats[2 * N + 1] = (
        1.0  # as if the router had formed its balance loss itself this time
    )
    balance.record()
    with pytest.raises(
        ValueError, match=r"StepBalance.loss\(\) over forwards whose global losses differ \(MoE layer 0\)"
    ):
        balance.loss()


def test_closing_a_step_balance_leaves_nothing_on_the_layer():
    scoped, ref = pair()
    balance = StepBalance(scoped)
    scoped(torch.randn(2, 6, D))
    balance.close()
    assert (
        scoped.step_statistics.balance is None
        and not hasattr(scoped, "_step_stats")
        and not hasattr(scoped, "_step_grad")
    )
    x = torch.randn(2, 6, D)
    scoped(x), ref(x)
    torch.testing.assert_close(scoped.aux_loss, ref.aux_loss)  # the layer forms its global-scope losses again


# ---------------------------------------------------------------- a StepBalance left attached or half used
def _step(layer, x, balance=None, ctx=None, record=True, loss=True):
    """One training step of ``layer`` on ``x``: forward, the StepBalance's record() and loss() as asked,
    backward, the step's end."""
    y = layer(x)
    total = y.square().mean()
    if balance is not None and record:
        balance.record()
        if loss:
            total = total + balance.loss()
    total.backward()
    if ctx is not None:
        ctx.advance()


def _attached_pair():
    scoped, ref = pair()
    ctx = moelab.RoutingContext()
    moelab.attach(scoped, ctx)
    return scoped, ref, ctx


def test_record_without_loss_is_refused_at_the_steps_end():
    scoped, _, ctx = _attached_pair()
    balance = StepBalance(scoped, ctx)
    x = torch.randn(2, 6, D)
    _step(scoped, x, balance, ctx)  # a whole step: fine
    message = r"a step with 1 forward\(s\) recorded by StepBalance.record\(\) but no loss\(\) is not allowed"
    with pytest.raises(ValueError, match=message):
        _step(scoped, x, balance, ctx, loss=False)  # the step hook of ctx.advance()
    manual = StepBalance(pair()[0])  # without a context: at the end_step() the loop calls
    other = manual.layers[0]
    other(x)
    manual.record()
    with pytest.raises(ValueError, match=message):
        manual.end_step()
    manual.end_step()  # the step's statistics were cleared with the refusal: the next step starts clean


def test_a_step_balance_left_attached_refuses_the_next_forward_of_a_plain_loop():
    """A context manager left open (or a StepBalance never closed): the layers leave the global-scope
    losses to it, so a plain loop's forwards would drop them; the second forward says so."""
    scoped, ref, ctx = _attached_pair()
    StepBalance(scoped, ctx).__enter__()  # never exited
    x = torch.randn(2, 6, D)
    _step(scoped, x)  # a plain step: no record(), no ctx.advance()
    with pytest.raises(
        ValueError,
        match=r"a second training forward of MoE layer 0 before StepBalance.record\(\) read the first is "
        r"not allowed: .* or close\(\) a StepBalance that no loop drives",
    ):
        scoped(x)
    attached_step_balance(scoped).close()
    scoped(x), ref(x)  # closed: the layer forms its global-scope losses itself again
    torch.testing.assert_close(scoped.aux_loss, ref.aux_loss)
    assert scoped.aux_loss.item() > 0


def test_a_step_balance_left_attached_is_refused_at_the_end_of_the_step_of_its_context():
    scoped, _, ctx = _attached_pair()
    StepBalance(scoped, ctx)
    with pytest.raises(
        ValueError,
        match=r"a step with a training forward of MoE layer 0 that StepBalance.record\(\) never read",
    ):
        _step(scoped, torch.randn(2, 6, D), ctx=ctx)  # a plain step that advances the context


def test_a_step_balance_as_a_context_manager_is_closed_however_the_block_ends():
    scoped, _, ctx = _attached_pair()
    x = torch.randn(2, 6, D)
    with pytest.raises(RuntimeError, match="interrupted"):
        with StepBalance(scoped, ctx) as balance:
            _step(scoped, x, balance, ctx)
            scoped(x)
            raise RuntimeError("interrupted")  # between a forward and its record()
    assert attached_step_balance(scoped) is None and balance.end_step not in ctx.hooks
    _step(scoped, x, ctx=ctx)  # a plain loop after it: nothing is left to refuse or to drop
    assert scoped.aux_loss.item() > 0
    with pytest.raises(ValueError, match=r"StepBalance.record\(\) after close\(\) is not allowed"):
        balance.record()
    with pytest.raises(ValueError, match=r"StepBalance.loss\(\) after close\(\) is not allowed"):
        balance.loss()


def test_a_step_balance_that_drives_a_second_model_is_refused_at_the_steps_end():
    first, _, ctx = _attached_pair()
    balance = StepBalance(first, ctx)
    second, _ = pair()  # another model of global scope, not attached: its layers form their own losses
    with pytest.raises(ValueError, match=r"MoE layer 0 is already attached to another StepBalance"):
        StepBalance(torch.nn.Sequential(first))  # the first model's layers in a second model
    with pytest.raises(
        ValueError,
        match=r"a step whose 1 StepBalance.record\(\) call\(s\) found no training forward of the model it "
        r"was built for is not allowed: it drives another model",
    ):
        _step(second, torch.randn(2, 6, D), balance, ctx)


def test_a_new_routing_context_is_refused_while_a_step_balance_of_another_is_attached():
    """Its step hook runs on the old context, so the new one's steps would never check it (compiled
    forwards check nothing themselves)."""
    scoped, _, ctx = _attached_pair()
    balance = StepBalance(scoped, ctx)
    moelab.attach(scoped, ctx)  # the same context again: fine
    with pytest.raises(
        ValueError,
        match=r"MoE layer 0 is attached to a StepBalance whose step hook runs on another routing context",
    ):
        moelab.attach(scoped, moelab.RoutingContext())
    balance.close()
    moelab.attach(scoped, moelab.RoutingContext())


def test_two_forwards_of_a_compiled_layer_before_record_are_refused_at_the_record():
    scoped, _, ctx = _attached_pair()
    balance = StepBalance(scoped, ctx)
    compiled = torch.compile(scoped, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 6, D)
    compiled(x)
    balance.record()  # one forward, one record: fine
    balance.loss()
    compiled(x)
    compiled(x)  # traced: no Python check in the forward; the in-place count tells record()
    with pytest.raises(
        ValueError, match=r"StepBalance.record\(\) after 2 training forwards of MoE layer 0 is not allowed"
    ):
        balance.record()


# ---------------------------------------------------------------- two gloo processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, report: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        scoped, _ = pair()
        torch.manual_seed(1)
        x = torch.randn(8, 6, D)[rank::world]  # this rank's half of the global batch
        try:  # without the step's statistics a global loss would be this rank's own
            scoped(x[:2])
            scoped.aux_loss  # noqa: B018
            refused = ""
        except ValueError as exc:
            refused = str(exc)
        balance = StepBalance(scoped)
        task = 0.0
        for mb in x.chunk(2):  # two micro-batches, one backward
            task = task + scoped(mb).pow(2).mean() / 2
            balance.record()
        loss = balance.loss()
        (task + loss).backward()
        grad = router_grad(scoped)
        dist.all_reduce(grad)  # DDP's mean over the ranks
        grad /= world
        Path(report, f"rank{rank}.json").write_text(
            json.dumps({"loss": loss.item(), "grad": grad.tolist(), "refused": refused})
        )
    finally:
        dist.destroy_process_group()


def test_global_scope_two_ranks_two_micro_batches_match_one_process_on_the_whole_batch(tmp_path):
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True, start_method=method)
    _, ref = pair()
    torch.manual_seed(1)
    x = torch.randn(8, 6, D)
    y = ref(x)
    (y.pow(2).mean() + ref.aux_loss).backward()
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["loss"] == pytest.approx(ref.aux_loss.item(), rel=1e-6)
        torch.testing.assert_close(torch.tensor(r["grad"]), router_grad(ref))
        assert (
            "balance_scope='global' (MoE layer 0) is not allowed without the step's statistics"
            in r["refused"]
        )
