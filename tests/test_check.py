"""``moelab check``: a correct block passes every layout; each bug class that MoE users lost runs to
(a router gradient not all-reduced, a gradient doubled on one rank, uninitialised padding rows, a
missing contribution of a non-expert parameter, a shard on the wrong process group) is injected and
the check fails on exactly the row it concerns."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

import moelab
from moelab import cli
from moelab.check import moelab_target, parity, resolve
from moelab.check.grid import kind_of
from moelab.check.targets import callable_target, import_object, moelab_parallelize

D = 8
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
needs_titan = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="needs torchtitan")


def _batch(rows: int = 4, seed: int = 3) -> torch.Tensor:
    return torch.randn(rows, 4, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _failing(table) -> set[tuple[str, str]]:
    return {(r.layout, r.quantity) for r in table.failures}


# ---------------------------------------------------------------------------- correct blocks pass
def test_a_correct_moelab_layer_passes_every_layout_kernel_and_capacity_on_two_processes():
    table = parity(moelab_target("smoe"), _batch(), procs=(2,), capacities=(None, 1.25))
    assert table.ok, table.format()
    layouts = {r.layout for r in table.rows}
    assert layouts == {"single", "ddp", "fsdp2", "ep", "ep-fsdp2"}
    assert {r.kernel for r in table.rows} == {"loop", "grouped", "stream", "padded"}
    assert {r.capacity for r in table.rows} == {None, 1.25}
    # per parameter, the router's and the experts' gradients among them, float64 where it runs
    quantities = {(r.quantity, r.kind) for r in table.rows}
    assert {
        ("grad router.weight", "router"),
        ("grad experts.w_in", "expert"),
        ("grad input", "input"),
    } <= quantities
    assert {r.dtype for r in table.find(kernel="loop")} == {"float64"}
    # pad_to_capacity (every expert on exactly C rows) runs with a capacity only: said, not skipped
    na = [r for r in table.rows if r.status == "n/a"]
    assert {(r.kernel, r.capacity) for r in na} == {("padded", None)}
    assert na[0].note.startswith(
        "the module refuses this kernel and capacity: pad_to_capacity=True is not allowed"
    )
    assert all(r.status == "pass" and r.error <= r.tolerance for r in table.rows if r.status != "n/a")
    assert (
        table.find(kernel="padded", capacity=1.25, layout="ep", quantity="grad experts.w_in")[0].status
        == "pass"
    )


@pytest.mark.parametrize(
    "family",
    [
        pytest.param("mixtral", marks=needs_hf),
        pytest.param("qwen2_moe", marks=needs_hf),
        pytest.param("olmoe", marks=needs_hf),
        pytest.param("qwen3_moe", marks=[needs_hf, pytest.mark.slow]),
        pytest.param("deepseek_v3", marks=[needs_hf, pytest.mark.slow]),
    ],
)
def test_transformers_moe_blocks_pass_ddp_and_fsdp2_and_say_why_ep_is_not_applicable(family):
    table = parity(resolve(f"hf:{family}"), _batch(), layouts=("single", "ddp", "fsdp2", "ep"), procs=(2,))
    assert table.ok, table.format()
    assert {r.kernel for r in table.rows} == {"eager", "batched_mm", "grouped_mm"}
    assert any(r.kind == "router" for r in table.rows) and any(r.kind == "expert" for r in table.rows)
    na = table.find(layout="ep")
    assert na and all(r.status == "n/a" for r in na)
    assert "pass parallelize=fn (--parallelize package.module:fn)" in na[0].note
    assert not table.find(layout="ddp", status="n/a")


# ---------------------------------------------------------------------------- (a) router not all-reduced
def _router_not_reduced(model: nn.Module, layout: str, world: int) -> nn.Module:
    """Expert parallelism with nothing reducing the replicated router's gradient."""
    from moelab.train.parallelize import parallelize

    if layout != "ep":
        raise NotImplementedError(f"this example applies ep only, not {layout}")
    return parallelize(model, dp="none", ep=world)


def test_a_router_gradient_not_all_reduced_fails_the_router_row():
    table = parity(
        moelab_target("smoe"),
        _batch(),
        layouts=("ep", "ddp"),
        procs=(2,),
        kernels=["loop"],
        parallelize=_router_not_reduced,
    )
    assert _failing(table) == {("ep", "grad router.weight")}, table.format()
    assert table.find(layout="ddp")[0].status == "n/a"
    assert table.find(layout="ddp")[0].note == "this example applies ep only, not ddp"


# ---------------------------------------------------------------------------- (b) doubled on one rank
def _doubled_on_rank_1(model: nn.Module, layout: str, world: int) -> nn.Module:
    """moelab's layout, and rank 1 doubles its experts' gradients (as an EP gradient counted twice)."""
    out = moelab_parallelize(model, layout, world)
    if dist.get_rank() == 1:
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.register_hook(lambda g: 2 * g)
    return out


def test_a_gradient_doubled_on_one_rank_fails_the_expert_rows():
    table = parity(
        moelab_target("smoe"),
        _batch(),
        layouts=("ep",),
        procs=(2,),
        kernels=["loop"],
        parallelize=_doubled_on_rank_1,
    )
    assert _failing(table) == {("ep", "grad experts.w_in"), ("ep", "grad experts.w_out")}, table.format()


# ---------------------------------------------------------------------------- (c) uninitialised padding
class PaddedExperts(nn.Module):
    """A top-1 MoE whose "padded" kernel runs every expert on a (N, C, d) buffer from ``torch.empty``:
    the token rows are written in, the padding rows are left as they were.  The output reads the
    token rows only, but the experts' weight gradient multiplies the padding rows by their zero
    gradient — uninitialised memory, NaN (or worse) on an unlucky step."""

    kernels = ("loop", "padded")
    d_model = D
    fill = staticmethod(torch.empty)

    def __init__(self, kernel: str = "loop", n: int = 4) -> None:
        super().__init__()
        self.kernel = kernel
        self.gate = nn.Linear(D, n, bias=False)
        self.experts = nn.Parameter(torch.randn(n, D, D) / D**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, D)
        probs = self.gate(h).softmax(-1)
        w, e = probs.max(-1)
        if self.kernel == "loop":
            y = torch.stack([h[t] @ self.experts[e[t]] for t in range(h.shape[0])])
        else:
            counts = torch.bincount(e, minlength=self.experts.shape[0])
            order = torch.argsort(e, stable=True)
            slot = torch.arange(h.shape[0]) - (torch.cumsum(counts, 0) - counts)[e[order]]
            buf = self.fill(self.experts.shape[0], int(counts.max()) + 1, D, dtype=h.dtype)  # the bug
            buf = buf.index_put((e[order], slot), h[order])
            out = torch.bmm(buf, self.experts)
            y = torch.empty_like(h).index_put((order,), out[e[order], slot])
        return (y * w[:, None]).reshape(x.shape)


def test_uninitialised_padding_rows_fail_the_expert_gradient_of_that_kernel():
    table = parity(PaddedExperts, _batch(), layouts=("single",))
    assert _failing(table) == {("single", "grad experts")}, table.format()
    (row,) = table.find(kernel="padded", quantity="grad experts")
    assert row.note == "non-finite values" and row.kind == "expert"
    assert table.find(kernel="padded", quantity="output")[0].status == "pass"


class ZeroPaddedExperts(PaddedExperts):
    fill = staticmethod(torch.zeros)


def test_padding_rows_that_are_zeros_pass():
    assert parity(ZeroPaddedExperts, _batch(), layouts=("single",)).ok


# ---------------------------------------------------------------------------- (d) non-expert parameter under EP
def _shared_left_out(model: nn.Module, layout: str, world: int) -> nn.Module:
    """Expert parallelism with DDP that leaves out, with the experts, the shared expert's parameters
    (a missing gradient contribution from the other ranks' tokens)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from moelab.train.parallelize import parallelize

    parallelize(model, dp="none", ep=world)
    local = [n for n, p in model.named_parameters() if ".experts." in n or ".shared." in n]
    DDP._set_params_and_buffers_to_ignore_for_model(model, local)
    return DDP(model, find_unused_parameters=True)


def test_a_missing_contribution_of_a_non_expert_parameter_under_ep_fails_its_row():
    target = moelab_target("smoe", num_shared=1)
    table = parity(
        target, _batch(), layouts=("ep",), procs=(2,), kernels=["loop"], parallelize=_shared_left_out
    )
    failing = _failing(table)
    assert failing and all(q.startswith("grad shared.") for _, q in failing), table.format()
    assert {r.kind for r in table.failures} == {"other"}
    assert table.find(quantity="grad router.weight")[0].status == "pass"


# ---------------------------------------------------------------------------- (e) shard on the wrong group
def _experts_on_the_wrong_group(model: nn.Module, layout: str, world: int) -> nn.Module:
    """The experts sharded over the mesh's expert-data-parallel dimension instead of its expert
    dimension: each rank keeps every expert, whose gradient then sees its own tokens only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    from moelab.train.parallelize import ExpertParallel

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("efsdp", "ep"))
    for layer in moelab.layer.moe_layers(model):
        parallelize_module(layer.experts, mesh["efsdp"], ExpertParallel())  # should be mesh["ep"]
    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    DDP._set_params_and_buffers_to_ignore_for_model(model, sharded)
    return DDP(model, find_unused_parameters=True)


def test_a_shard_on_the_wrong_process_group_fails_the_expert_rows():
    table = parity(
        moelab_target("smoe"),
        _batch(),
        layouts=("ep",),
        procs=(2,),
        kernels=["loop"],
        parallelize=_experts_on_the_wrong_group,
    )
    assert _failing(table) == {("ep", "grad experts.w_in"), ("ep", "grad experts.w_out")}, table.format()
    assert table.find(quantity="output")[0].status == "pass"


# ---------------------------------------------------------------------------- a variant that crashes
class _Broken(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the layout broke the block")


def _breaks(model: nn.Module, layout: str, world: int) -> nn.Module:
    return _Broken()


def test_a_variant_that_raises_is_a_failing_row_and_the_later_ones_are_not_run():
    table = parity(
        moelab_target("smoe"),
        _batch(),
        layouts=("single", "ddp"),
        kernels=["loop", "grouped"],
        capacities=[None],
        parallelize=_breaks,
    )
    assert [(r.layout, r.kernel, r.quantity) for r in table.failures] == [
        ("ddp", "loop", "-"),
        ("ddp", "grouped", "-"),
    ]
    first, later = table.failures
    assert (
        first.note
        == "rank 0: RuntimeError: the layout broke the block; rank 1: RuntimeError: the layout broke the block"
    )
    assert later.note.startswith("rank 0: not run: an earlier variant failed on this process")
    assert all(r.status == "pass" for r in table.find(layout="single"))


# ---------------------------------------------------------------------------- larger grids
@pytest.mark.slow
def test_compile_and_checkpointing_pass_in_one_process_under_ddp_and_under_ep_with_fsdp2():
    layouts = ("single", "ddp", "ep-fsdp2")
    table = parity(
        moelab_target("smoe"), _batch(), layouts, (2,), kernels=["loop"], compile=True, checkpoint=True
    )
    assert table.ok, table.format()
    assert {(r.compile, r.checkpoint) for r in table.rows} == {
        (a, b) for a in (False, True) for b in (False, True)
    }


@pytest.mark.slow
def test_every_layout_passes_on_four_processes():
    table = parity(moelab_target("sharede-v3", num_shared=1), _batch(), procs=(4,), capacities=(None, 1.25))
    assert table.ok, table.format()
    assert {r.procs for r in table.rows if r.layout != "single"} == {4}


@pytest.mark.slow
@needs_titan
def test_torchtitans_moe_passes_ddp_and_fsdp2():
    table = parity(resolve("titan"), _batch(), layouts=("single", "ddp", "fsdp2"), procs=(2,))
    assert table.ok, table.format()
    assert {r.kind for r in table.rows} >= {"router", "expert"}


# ---------------------------------------------------------------------------- the table and the command
def test_parameters_are_classed_as_router_expert_or_other():
    assert (
        kind_of("router.weight")
        == kind_of("gate.weight")
        == kind_of("mlp.gate.e_score_correction_bias")
        == "router"
    )
    assert kind_of("experts.w_in") == kind_of("routed_experts.inner_experts.w1_EFD") == "expert"
    assert kind_of("shared_experts.w1.weight") == kind_of("shared_expert.gate_proj.weight") == "other"
    assert kind_of("shared_expert_gate.weight") == "other"


def test_the_command_prints_the_table_writes_json_and_exits_0(tmp_path, capsys):
    out = tmp_path / "table.json"
    code = cli.main(
        [
            "check",
            "--module",
            "moelab:smoe",
            "--layouts",
            "single,ddp",
            "--kernels",
            "loop",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert printed.splitlines()[0] == "moelab check: moelab:smoe"
    assert "grad router.weight" in printed and "12 passed, 0 failed, 0 not applicable" in printed
    saved = json.loads(out.read_text())
    assert saved["ok"] is True and len(saved["rows"]) == 12


def test_the_command_exits_1_on_a_failing_row(capsys):
    code = cli.main(
        ["check", "--module", "moelab:smoe", "--layouts", "ep", "--kernels", "loop",
         "--parallelize", "test_check:_router_not_reduced"]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 1
    assert "grad router.weight" in printed and "FAIL" in printed and "1 failed" in printed


def test_a_user_factory_is_named_package_module_factory(capsys):
    code = cli.main(
        ["check", "--module", "test_check:PaddedExperts", "--layouts", "single", "--kernels", "loop"]
    )
    assert code == 0, capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--module", "foo"], "module='foo' is not allowed; expected moelab:<method>, hf:<family> (mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v3), titan or package.module:factory"),
        (["--module", "moelab:nope"], "module='moelab:nope' is not allowed; expected moelab:<method>, a method of ["),
        (["--module", "hf:llama"], "family='llama' is not allowed; expected one of ['deepseek_v3', 'mixtral', 'olmoe', 'qwen2_moe', 'qwen3_moe']"),
        (["--module", "moelab:smoe", "--layouts", "ddp,tp"], "layouts=['ddp', 'tp'] is not allowed; expected some of ['single', 'ddp', 'fsdp2', 'ep', 'ep-fsdp2']"),
        (["--module", "moelab:smoe", "--procs", "3"], "procs=[3] is not allowed with a batch of 4 rows; expected process counts >= 2 that divide the batch's first dimension"),
        (["--module", "moelab:smoe", "--procs", "two"], "--procs 'two' is not allowed; expected comma-separated integers, e.g. --procs 2,4"),
        (["--module", "moelab:smoe", "--kernels", "fast"], "kernels=['fast'] is not allowed for moelab:smoe; expected some of ['loop', 'grouped', 'stream', 'padded']"),
        pytest.param(["--module", "hf:mixtral", "--capacity", "off,1.25"], "capacities=[None, 1.25] is not allowed for hf:mixtral; expected some of [None]", marks=needs_hf),
        (["--module", "moelab:smoe", "--capacity", "half"], "--capacity 'half' is not allowed; expected 'off' or capacity factors > 0, e.g. --capacity off,1.25"),
        (["--module", "moelab:smoe", "--option", "impl=grouped"], "option impl='grouped' is not allowed; the check runs every kernel (kernels=) and capacity (capacities=) itself"),
        pytest.param(["--module", "hf:mixtral", "--option", "top_k=1"], "--option ['top_k'] is not allowed with module='hf:mixtral'; only moelab:<method> takes options", marks=needs_hf),
        (["--module", "moelab:smoe", "--option", "top_k=9"], "top_k=9 is not allowed"),
        (["--module", "no_such_module_x:f"], "module='no_such_module_x:f' cannot be imported: No module named 'no_such_module_x'"),
        (["--module", "test_check:nothing"], "module='test_check:nothing': module 'test_check' has no attribute 'nothing'"),
        (["--module", "test_check:D"], "module='test_check:D' is not allowed; expected a callable, got int"),
        (["--module", "moelab:smoe", "--parallelize", "nofn"], "--parallelize='nofn' is not allowed; expected package.module:name"),
        (["--module", "test_check:_no_width"], "factory 'test_check:_no_width': the input width is unknown; pass d_model= (--d-model) or give the factory (or its module) a d_model attribute"),
        (["--module", "test_check:_not_a_module", "--d-model", "8"], "factory 'test_check:_not_a_module' returned int; expected an nn.Module"),
        (["--module", "test_check:_kernels_without_argument"], "factory 'test_check:_kernels_without_argument' declares kernels=['a', 'b'] but takes no kernel= argument"),
        (["--module", "moelab:smoe", "--batch", "0"], "--batch 0 is not allowed; expected a positive integer"),
    ],
)  # fmt: skip
def test_the_command_refuses_bad_input_in_one_line_with_exit_2(argv, message, capsys):
    assert cli.main(["check", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moelab check: error: {message}"), err
    assert err.count("\n") == 1


def _no_width() -> nn.Module:
    return nn.Linear(8, 8)


def _not_a_module() -> int:
    return 3


def _kernels_without_argument() -> nn.Module:
    return nn.Linear(8, 8)


_kernels_without_argument.kernels = ("a", "b")


def test_the_api_refuses_a_batch_it_cannot_check():
    with pytest.raises(
        ValueError, match=r"^batch of width 6 is not allowed for moelab:smoe; expected d_model=8$"
    ):
        parity(moelab_target("smoe"), torch.randn(4, 6))
    with pytest.raises(
        ValueError,
        match=r"^batch=a 1-D torch.float32 tensor is not allowed; expected a floating-point tensor \(B, \.\.\., d_model\)$",
    ):
        parity(moelab_target("smoe"), torch.randn(8))
    with pytest.raises(ValueError, match=r"^--parallelize='a:b' cannot be imported"):
        import_object("a:b", "--parallelize")
    assert callable_target(PaddedExperts).kernels == ("loop", "padded")
