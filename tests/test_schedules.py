import numpy as np
import pytest
import torch
from torch import nn

import moelab
from moelab.schedules import CoinFlipSchedule, CompetitionSchedule, default_a_max, schedule_from_state


def _uncapped(num_layers, total_steps, omega, warmup, seed):
    """The raw Bernoulli draws, re-drawn independently with the documented generator."""
    rng = np.random.Generator(np.random.PCG64(seed))
    start = int(warmup * total_steps)
    table = np.zeros((num_layers, total_steps), dtype=bool)
    for layer in range(num_layers):
        table[layer, start:] = rng.random(total_steps - start) < omega
    return table


def test_cap_never_exceeded():
    s = CompetitionSchedule(num_layers=12, total_steps=2000, omega=0.12, a_max=2, warmup=0.05, seed=1)
    assert s.active_per_step().max().item() <= 2
    assert s.dropped == 0


def test_nothing_during_warmup():
    s = CompetitionSchedule(num_layers=6, total_steps=1000, omega=0.5, a_max=4, warmup=0.1, seed=0)
    assert s.warmup_steps == 100
    assert not s.table[:, :100].any()
    assert s.table[:, 100:].any()
    assert not any(s.active(layer, t) for layer in range(6) for t in range(100))


def test_empirical_rate_close_to_omega():
    s = CompetitionSchedule(num_layers=8, total_steps=20000, omega=0.07, a_max=6, warmup=0.0, seed=3)
    rate = s.table.float().mean().item()
    # 160000 Bernoulli(0.07) draws: std of the mean ≈ 6.4e-4
    assert abs(rate - 0.07) < 0.004


def test_deterministic_per_seed():
    a = CompetitionSchedule(6, 500, omega=0.2, a_max=2, seed=7)
    b = CompetitionSchedule(6, 500, omega=0.2, a_max=2, seed=7)
    c = CompetitionSchedule(6, 500, omega=0.2, a_max=2, seed=8)
    assert torch.equal(a.table, b.table)
    assert not torch.equal(a.table, c.table)


def test_redistribution_keeps_each_layer_count_and_moves_only_excess():
    L, T, omega, w, seed = 10, 3000, 0.15, 0.05, 5
    s = CompetitionSchedule(L, T, omega=omega, a_max=2, warmup=w, seed=seed)
    raw = _uncapped(L, T, omega, w, seed)
    assert s.dropped == 0
    assert s.table.sum(dim=1).tolist() == raw.sum(axis=1).tolist()
    # the first layer never meets the cap: its row is exactly its draws
    assert s.table[0].numpy().tolist() == raw[0].tolist()
    # the cap binds here, so activations did move
    assert (s.table.numpy() != raw).any()


def test_redistribution_goes_to_nearest_free_step_left_first():
    # Layers 0 and 1 are active everywhere they were drawn; with a_max=1 a clash moves layer 1.
    with pytest.warns(UserWarning, match="50 activations had no free step"):
        s = CompetitionSchedule(2, 50, omega=1.0, a_max=1, warmup=0.0, seed=0)
    # omega=1: both layers want every step; only 50 slots for 100 activations -> 50 dropped.
    assert s.dropped == 50
    assert s.active_per_step().max().item() == 1
    # A hand-checked case through the private search: free steps 3 and 6 around t=5 -> 6 (distance
    # 1) beats 3 (distance 2); with 4 free too, left wins the tie at distance 1.
    row = np.zeros(10, dtype=bool)
    q = np.ones(10, dtype=np.int64)
    q[[3, 6]] = 0
    assert s._nearest_free(row, q, 5, 0) == 6
    q[4] = 0
    assert s._nearest_free(row, q, 5, 0) == 4
    # never inside the warm-up
    q[:] = 1
    q[1] = 0
    assert s._nearest_free(row, q, 5, 2) is None


def test_active_past_total_steps_is_false_and_state_dict_round_trips():
    s = CompetitionSchedule(3, 100, omega=0.2, a_max=1, seed=2)
    assert s.active(0, 100) is False
    t = schedule_from_state(s.state_dict())
    assert torch.equal(t.table, s.table) and t.seed == 2 and t.a_max == 1


def test_default_a_max_rule():
    assert default_a_max(6) == 6
    assert default_a_max(24) == 6
    assert default_a_max(25) == 7
    assert default_a_max(26) == 8
    assert default_a_max(27) == 9
    assert default_a_max(32) == 9
    assert CompetitionSchedule(32, 10).a_max == 9


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"omega": 1.5}, r"omega=1.5 is not allowed; expected a number in \[0, 1\]"),
        ({"omega": -0.1}, r"omega=-0.1 is not allowed"),
        ({"warmup": 2.0}, r"warmup=2.0 is not allowed; expected a number in \[0, 1\]"),
        ({"a_max": 0}, r"a_max=0 is not allowed; expected a positive integer"),
        ({"seed": -1}, r"seed=-1 is not allowed"),
    ],
)
def test_bad_schedule_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CompetitionSchedule(4, 100, **kwargs)


def test_bad_layer_index():
    s = CompetitionSchedule(4, 100)
    with pytest.raises(ValueError, match=r"layer=4 is not allowed; expected an integer in \[0, 3\]"):
        s.active(4, 0)


def test_attach_rejects_schedule_of_other_depth():
    model = nn.Sequential(*[moelab.MoE(8, 4, 2, method="competesmoe") for _ in range(3)])
    ctx = moelab.RoutingContext(schedule=CompetitionSchedule(4, 100))
    with pytest.raises(ValueError, match=r"schedule.num_layers=4 does not match the model, which has 3"):
        moelab.attach(model, ctx)


def test_coin_flip_rate_determinism_and_callable():
    s = CoinFlipSchedule(4, rate=0.05, seed=1)
    flips = s.flips(2000)
    assert abs(flips.float().mean().item() - 0.05) < 0.01
    assert torch.equal(flips, CoinFlipSchedule(4, rate=0.05, seed=1).flips(2000))
    # order independent: one flip equals the table entry
    assert s.active(2, 1234) == bool(flips[2, 1234])
    ramp = CoinFlipSchedule(2, rate=lambda t: 0.0 if t < 100 else 1.0)
    assert not ramp.flips(100).any()
    assert ramp.active(1, 150)
    with pytest.raises(ValueError, match=r"rate\(3\)=2.0 is not allowed"):
        CoinFlipSchedule(2, rate=lambda t: 2.0).active(0, 3)
    with pytest.raises(ValueError, match=r"rate=1.2 is not allowed"):
        CoinFlipSchedule(2, rate=1.2)


def _rank_tables(rank, world, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # a different seed per rank: only the broadcast from rank 0 can make the tables equal
        s = CompetitionSchedule(4, 200, omega=0.2, a_max=2, seed=100 + rank)
        torch.save(s.table, f"{out_dir}/table{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_schedule_is_broadcast_from_rank0(tmp_path):
    import torch.multiprocessing as tmp_mp

    tmp_mp.spawn(_rank_tables, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    t0, t1 = torch.load(tmp_path / "table0.pt"), torch.load(tmp_path / "table1.pt")
    assert torch.equal(t0, t1)
    assert torch.equal(t0, CompetitionSchedule(4, 200, omega=0.2, a_max=2, seed=100).table)


def test_a_model_whose_layers_need_two_schedules_is_refused():
    from torch import nn

    import moelab
    from moelab.schedules import model_schedule

    model = nn.Sequential(
        moelab.MoE(8, 4, 2, method="competesmoe"), moelab.MoE(8, 4, 2, method="competesmoe-v1")
    )
    with pytest.raises(ValueError) as info:
        model_schedule(model, 100)
    assert str(info.value) == (
        "the model's MoE layers use methods ['competesmoe', 'competesmoe-v1'], which need different schedules "
        "['coin-flip', 'competition']; one model trains with one schedule"
    )


def test_a_competition_schedule_too_large_for_the_machine_is_refused_before_allocating():
    from moelab.schedules import _machine_memory

    memory = _machine_memory()
    if memory is None:
        pytest.skip("the OS does not report the machine's memory")
    steps = memory  # bytes of the table alone exceed the memory: refused, not a MemoryError
    with pytest.raises(
        ValueError,
        match=rf"^total_steps={steps} is not allowed: the competition schedule of 2 layers needs about "
        r"[\d.]+ GiB for its table, more than half of this machine's [\d.]+ GiB; expected at most \d+ steps$",
    ):
        CompetitionSchedule(2, steps)
    with pytest.raises(ValueError, match=r"total_steps=1000000000000 is not allowed"):
        moelab.schedules.build_schedule("competesmoe", 2, 10**12)


def test_first_active_step_is_the_first_step_where_some_layer_competes():
    from moelab.schedules import CoinFlipSchedule, CompetitionSchedule

    table = CompetitionSchedule(num_layers=3, total_steps=200, seed=1)
    per_step = table.active_per_step()
    first = int(torch.nonzero(per_step).flatten()[0])
    assert table.first_active_step(200) == first and table.first_active_step(first) is None
    flips = CoinFlipSchedule(num_layers=2, rate=0.05, seed=3)
    drawn = flips.flips(400).any(dim=0)
    assert flips.first_active_step(400) == int(torch.nonzero(drawn).flatten()[0])
    assert CoinFlipSchedule(num_layers=2, rate=0.0).first_active_step(50) is None
