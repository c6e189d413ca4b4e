"""moelab.save / moelab.load: one format (config.json + model.safetensors) for every writer."""

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import moelab
from moelab.cli import main
from moelab.errors import CheckpointError
from moelab.io import load_weights, read_config
from moelab.models.classifier import LMClassifier
from moelab.models.lm import TransformerLM, lm_config
from moelab.models.vision import ImageMoE, SingleModel, vision_config

SRC = str(Path(moelab.__file__).resolve().parents[1])


def _layers(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return moelab.MoE(8, 4, 2, d_hidden=12, method="sharede-v3", balance_coef=0.02)


def _lm(method: str = "stablemoe") -> TransformerLM:
    return TransformerLM(lm_config("cpu", 40, block_size=16, num_experts=4, method=method))


def train_args(corpus, out, *extra):
    return [
        "train", "--data", str(corpus), "--size", "cpu", "--block-size", "16", "--batch-size", "4",
        "--num-experts", "4", "--steps", "6", "--eval-every", "3", "--eval-tokens", "64",
        "--test-tokens", "64", "--ckpt-every", "3", "--no-progress", "--out", str(out), *extra,
    ]  # fmt: skip


def _state_in_fresh_process(directories: list[Path], tmp_path: Path) -> list[dict]:
    """``moelab.load`` of each folder in a new Python process: its state dict and context."""
    out = tmp_path / "fresh.pt"
    script = textwrap.dedent(
        f"""
        import torch, moelab
        torch.manual_seed(123)  # another init: everything must come from the files
        results = []
        for d in {[str(d) for d in directories]!r}:
            model = moelab.load(d)
            ctx = next((m.ctx for m in model.modules() if isinstance(m, moelab.MoE)), None)
            results.append({{"state": model.state_dict(), "ctx": None if ctx is None else ctx.state_dict(),
                             "training": model.training}})
        torch.save(results, {str(out)!r})
        """
    )
    env = {**os.environ, "PYTHONPATH": SRC}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(out, weights_only=True)


def _same_state(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_every_writer_round_trips_bit_exactly_in_a_fresh_process(corpus, tmp_path):
    transformers = pytest.importorskip("transformers")
    written: dict[str, nn.Module] = {}
    # moelab.save of each model kind
    layer = _layers()
    moelab.attach(layer, moelab.RoutingContext(step=3, total_steps=9))
    moelab.save(layer, tmp_path / "moe")
    written["moe"] = layer
    lm = _lm().double()
    moelab.save(lm, tmp_path / "lm")
    written["lm"] = lm
    clf = LMClassifier(_lm("smoe"), 3)
    clf.save_pretrained(tmp_path / "clf")
    written["clf"] = clf
    for name, model in {"image": ImageMoE(vision_config("digits"), "attentive"),
                        "single": SingleModel(vision_config("digits"))}.items():  # fmt: skip
        model.save_pretrained(tmp_path / name)
        written[name] = model
    # a from_hf-converted transformers model saved with moelab.save
    cfg = transformers.MixtralConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=2, num_local_experts=4)  # fmt: skip
    mixtral = moelab.from_hf(transformers.MixtralForCausalLM(cfg))
    moelab.save(mixtral, tmp_path / "from_hf")
    written["from_hf"] = mixtral
    # moelab upcycle (a transformers config.json, random init)
    llama = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                     num_attention_heads=2)  # fmt: skip
    llama.architectures = ["LlamaForCausalLM"]
    llama.save_pretrained(tmp_path / "llama")
    argv = ["upcycle", "--model", str(tmp_path / "llama" / "config.json"), "--num-experts", "4", "--top-k", "2",
            "--out", str(tmp_path / "upcycled"), "--option", "balance_coef=0.02"]  # fmt: skip
    assert main(argv) == 0
    written["upcycled"] = moelab.load(tmp_path / "upcycled")
    # moelab train: the run (best/) and a checkpoint
    assert main(train_args(corpus, tmp_path / "run")) == 0
    written["run"] = moelab.load(tmp_path / "run")
    written["run/ckpt/step-00000006"] = moelab.load(tmp_path / "run" / "ckpt" / "step-00000006")

    fresh = _state_in_fresh_process([tmp_path / name for name in written], tmp_path)
    for (name, model), got in zip(written.items(), fresh):
        _same_state(model.state_dict(), got["state"])
        assert got["training"] is False, name
    assert fresh[0]["ctx"] == {"step": 3, "total_steps": 9, "schedule": None}
    assert fresh[list(written).index("run")]["ctx"] == {"step": 6, "total_steps": 6, "schedule": None}
    # the upcycled model computes what the rebuilt one does, its options kept
    ids = torch.randint(0, 40, (2, 5))
    again = moelab.load(tmp_path / "upcycled")
    with torch.no_grad():
        assert torch.equal(again(ids).logits, written["upcycled"](ids).logits)
    assert moelab.aux_loss(again) is not None and again.model.layers[0].mlp.coefs["balance"] == 0.02


def test_a_stablemoe_run_loads_into_the_routing_its_test_bpc_was_computed_with(corpus, tmp_path):
    from moelab.data.text import load_text
    from moelab.train.tasks import LMTask

    out = tmp_path / "stable"
    assert main(train_args(corpus, out, "--method", "stablemoe", "--test-tokens", "400")) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    model = moelab.load(out)
    layer = model.moe_layers[0]
    assert layer.router.stage(layer.ctx) == 2  # the frozen light router, as at the end of training
    task = LMTask(load_text(str(corpus)), model.cfg.block_size)
    with torch.no_grad():
        got = task.evaluate(model, "test", 400)
    assert got["bpc"] == pytest.approx(metrics["test_bpc"], rel=1e-6, abs=1e-9)
    # routing with the stage-1 centroids instead gives another number: the context matters
    layer.ctx.step = 0
    for m in model.moe_layers:
        m.ctx = layer.ctx
    with torch.no_grad():
        assert not math.isclose(task.evaluate(model, "test", 400)["bpc"], metrics["test_bpc"], rel_tol=1e-6)


def test_tied_lm_weights_are_stored_once_and_tied_again_on_load(tmp_path):
    from safetensors.torch import load_file

    lm = _lm("smoe")
    lm.save_pretrained(tmp_path / "lm")
    stored = load_file(str(tmp_path / "lm" / "model.safetensors"))
    assert "tok_emb.weight" in stored and "head.weight" not in stored
    assert read_config(tmp_path / "lm")["tied"] == {"head.weight": "tok_emb.weight"}
    again = TransformerLM.from_pretrained(tmp_path / "lm")
    assert again.head.weight is again.tok_emb.weight
    assert torch.equal(again.head.weight, lm.tok_emb.weight)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_tampered_file_is_refused_in_one_line_naming_it(tmp_path, name):
    moelab.save(_layers(), tmp_path / "m")
    path = tmp_path / "m" / name
    if name == "config.json":
        config = json.loads(path.read_text())
        config["config"]["top_k"] = 1
        path.write_text(json.dumps(config))
    else:
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as info:
        moelab.load(tmp_path / "m")
    message = str(info.value)
    assert "\n" not in message and name in message and ("sha256" in message)


def test_an_interrupted_save_refuses_rather_than_loading_mixed_files(tmp_path):
    moelab.save(_layers(0), tmp_path / "m")
    old_config = (tmp_path / "m" / "config.json").read_text()
    moelab.save(_layers(1), tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(old_config)  # killed before config.json was replaced
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*sha256 mismatch"):
        moelab.load(tmp_path / "m")


def test_a_run_config_json_opens_without_the_run(corpus, tmp_path):
    assert main(train_args(corpus, tmp_path / "run", "--method", "xmoe")) == 0
    shutil.copytree(tmp_path / "run" / "best", tmp_path / "elsewhere")
    config = json.loads((tmp_path / "elsewhere" / "config.json").read_text())  # plain JSON, no pickle
    assert config["kind"] == "TransformerLM" and config["config"]["method"] == "xmoe"
    assert set(config["moe_layers"]) == {"blocks.0.ffn", "blocks.1.ffn"}
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert config["routing_context"]["step"] == 6
    assert (
        config["metadata"]["test_bpc"] == metrics["test_bpc"]
        and config["metadata"]["step"] == metrics["best_step"]
    )
    model = moelab.load(tmp_path / "elsewhere")
    _same_state(model.state_dict(), moelab.load(tmp_path / "run").state_dict())


def test_a_module_moelab_cannot_rebuild_loads_into_a_given_model(tmp_path):
    model = nn.Sequential(nn.Linear(6, 8), _layers())
    moelab.save(model, tmp_path / "m", metadata={"note": "x"})
    with pytest.raises(CheckpointError, match=r"kind='module'.*moelab\.io\.load_weights"):
        moelab.load(tmp_path / "m")
    fresh = nn.Sequential(nn.Linear(6, 8), _layers(1))
    assert load_weights(tmp_path / "m", fresh)["metadata"] == {"note": "x"}
    _same_state(model.state_dict(), fresh.state_dict())


def test_bad_input_is_refused_naming_what_is_allowed(tmp_path):
    with pytest.raises(ValueError, match=r"state entry 'w' is a str; expected a tensor"):
        moelab.save({"w": "x"}, tmp_path / "c")
    with pytest.raises(ValueError, match=r"metadata=.*JSON-serialisable"):
        moelab.save(nn.Linear(2, 2), tmp_path / "c", metadata={"nan": float("nan")})
    with pytest.raises(CheckpointError, match="does not exist or is not a folder"):
        moelab.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json' is missing"):
        moelab.load(tmp_path / "empty")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("task: lm\n")
    with pytest.raises(CheckpointError, match=r"holds no saved model \(best/ or ckpt/step-\*/\)"):
        moelab.load(tmp_path / "run")
    moelab.save(_lm("smoe"), tmp_path / "lm")
    with pytest.raises(ValueError, match="holds a TransformerLM; expected a LMClassifier"):
        LMClassifier.from_pretrained(tmp_path / "lm")
    config = json.loads((tmp_path / "lm" / "config.json").read_text())
    config["format_version"] = 99
    (tmp_path / "lm" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="format_version=99; this moelab reads 1"):
        moelab.load(tmp_path / "lm")


def _resign(path, edit):
    """Edit a saved folder's config.json and recompute its own digest, as a crafted file would."""
    from moelab.io.model import _canonical

    config = json.loads(path.read_text())
    edit(config)
    config.pop("sha256", None)
    config["sha256"] = hashlib.sha256(_canonical(config)).hexdigest()
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "case,message",
    [("no files", "lists no model.safetensors in its files"),
     ("outside", "lists the file '../outside.bin'; expected plain file names inside"),
     ("absolute", "lists the file '/dev/zero'; expected plain file names inside"),
     ("link to a device", "is not a regular file (a link or a device); refused"),
     ("bad digest", "has sha256='x' for 'model.safetensors'; expected 64 hex digits")],
)  # fmt: skip
def test_crafted_metadata_is_refused_before_any_file_is_read(tmp_path, case, message):
    moelab.save(_layers(), tmp_path / "m")
    config = tmp_path / "m" / "config.json"
    if case == "no files":
        _resign(config, lambda c: c.__setitem__("files", {}))
    elif case == "outside":
        (tmp_path / "outside.bin").write_bytes(b"x")
        _resign(config, lambda c: c["files"].__setitem__("../outside.bin", "0" * 64))
    elif case == "absolute":
        _resign(config, lambda c: c["files"].__setitem__("/dev/zero", "0" * 64))
    elif case == "link to a device":
        os.symlink("/dev/zero", tmp_path / "m" / "extra.bin")
        _resign(config, lambda c: c["files"].__setitem__("extra.bin", "0" * 64))
    else:
        _resign(config, lambda c: c["files"].__setitem__("model.safetensors", "x"))
    with pytest.raises(CheckpointError) as info:
        moelab.load(tmp_path / "m")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_every_kind_of_the_fixed_table_is_registered_by_its_module():
    from moelab.io import model as io_model

    assert set(io_model._kinds()) == set(io_model._KIND_MODULES)
    assert set(io_model.KINDS) == {*io_model._KIND_MODULES, "MoE"}


def test_a_kind_outside_the_fixed_table_is_refused_naming_the_allowed_kinds():
    from moelab.io.model import Kind, register_kind

    kind = Kind(describe=lambda model: None, build=lambda config, file: nn.Linear(1, 1))
    with pytest.raises(ValueError, match=r"^kind='mine' is not allowed; expected one of \['TransformerLM', "):
        register_kind("mine", kind)


def test_load_imports_the_module_of_a_kind_from_the_fixed_table(tmp_path):
    """A transformers-kind folder loads in a process where the kind was not registered yet: load
    imports the kind's module from io's own table, never a name read from the file."""
    transformers = pytest.importorskip("transformers")
    script = textwrap.dedent(
        f"""
        import sys
        import moelab
        from moelab.io import model as io_model
        io_model._KINDS.pop("transformers")
        del sys.modules["moelab.hf.kind"]
        m = moelab.load({str(tmp_path / "mixtral")!r})
        print(type(m).__name__, "transformers" in io_model._KINDS)
        """
    )
    cfg = transformers.MixtralConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2, num_local_experts=4)  # fmt: skip
    moelab.save(moelab.from_hf(transformers.MixtralForCausalLM(cfg)), tmp_path / "mixtral")
    env = {**os.environ, "PYTHONPATH": SRC}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["MixtralForCausalLM", "True"]


def test_a_saved_competition_schedule_comes_back_in_either_recorded_form(tmp_path):
    """The routing context's ``state_dict`` (the schedule's arguments with its kind) is what
    ``save`` writes; folders written with the earlier ``{"type": class, "args": ...}`` record load
    to the same schedule."""
    from moelab.io.model import _canonical

    model = _lm("competesmoe")
    ctx = moelab.routing_context(model, total_steps=40, seed=3, omega=0.3)
    ctx.advance(5)
    moelab.save(model, tmp_path / "m")
    assert moelab.layer.moe_layers(moelab.load(tmp_path / "m"))[0].ctx.state_dict() == ctx.state_dict()

    file = tmp_path / "m" / "config.json"
    config = json.loads(file.read_text())
    args = {k: v for k, v in config["routing_context"]["schedule"].items() if k != "type"}
    config["routing_context"]["schedule"] = {"type": "CompetitionSchedule", "args": args}
    config["sha256"] = hashlib.sha256(_canonical(config)).hexdigest()
    file.write_text(json.dumps(config))
    loaded = moelab.layer.moe_layers(moelab.load(tmp_path / "m"))[0].ctx
    assert loaded.state_dict() == ctx.state_dict() and torch.equal(loaded.schedule.table, ctx.schedule.table)


def test_a_saved_routing_context_whose_schedule_does_not_rebuild_is_refused_naming_the_file(tmp_path):
    from moelab.errors import CheckpointError
    from moelab.io.model import _canonical

    model = _lm("competesmoe")
    moelab.routing_context(model, total_steps=40, seed=3)
    moelab.save(model, tmp_path / "m")
    file = tmp_path / "m" / "config.json"
    config = json.loads(file.read_text())
    config["routing_context"]["schedule"]["type"] = "lottery"
    config["sha256"] = hashlib.sha256(_canonical(config)).hexdigest()
    file.write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as info:
        moelab.load(tmp_path / "m")
    assert str(info.value) == (
        f"{str(file)!r} has a routing_context that does not rebuild: schedule state of type 'lottery' is not "
        "allowed; expected one of ['competition', 'coin-flip']"
    )


def test_load_weights_restores_the_routing_context_so_a_stablemoe_model_routes_as_saved(tmp_path):
    """StableMoE past its stage switch routes with its frozen light router, a function of the
    context: ``moelab.load_weights`` into a model without a context attaches the saved one (the
    logits match exactly); a context already attached (a trainer's) stays as it is."""
    torch.manual_seed(0)
    saved = _lm("stablemoe")
    moelab.attach(saved, moelab.RoutingContext(step=90, total_steps=100))
    saved.eval()
    ids = torch.randint(0, 40, (2, 16))
    with torch.no_grad():
        want = saved(ids)
    moelab.save(saved, tmp_path / "m")
    torch.manual_seed(1)
    fresh = _lm("stablemoe").eval()
    with torch.no_grad():
        assert not torch.equal(fresh(ids), want)
    moelab.load_weights(tmp_path / "m", fresh)
    with torch.no_grad():
        assert torch.equal(fresh(ids), want)
    ctx = moelab.RoutingContext(step=3, total_steps=100)
    other = _lm("stablemoe").eval()
    moelab.attach(other, ctx)
    moelab.load_weights(tmp_path / "m", other)
    assert ctx.step == 3 and next(m for m in other.modules() if isinstance(m, moelab.MoE)).ctx is ctx


def test_a_run_without_best_config_json_says_it_loads_the_newest_checkpoint(corpus, tmp_path):
    from moelab.cli import main

    out = tmp_path / "run"
    assert main(["train", "--data", str(corpus), "--size", "cpu", "--block-size", "16", "--batch-size", "4",
                 "--num-experts", "4", "--steps", "2", "--eval-every", "2", "--eval-tokens", "64",
                 "--test-tokens", "64", "--no-progress", "--out", str(out)]) == 0  # fmt: skip
    (out / "best" / "config.json").unlink()
    with pytest.warns(
        UserWarning, match=r"best/config.json' is missing; loading the newest checkpoint step-00000002"
    ):
        moelab.load(out)


def test_load_keeps_each_tensors_dtype_bf16_experts_with_float32_routers(tmp_path):
    lm = _lm("sharede-v3")
    for layer in lm.moe_layers:  # the experts in bf16, the routers (and the selection bias) in float32
        layer.experts.to(torch.bfloat16)
    lm.save_pretrained(tmp_path / "lm")
    back = moelab.load(tmp_path / "lm")
    want = {name: t for name, t in [*lm.named_parameters(), *lm.named_buffers()]}
    got = dict([*back.named_parameters(), *back.named_buffers()])
    assert {n: got[n].dtype for n in want} == {n: t.dtype for n, t in want.items()}
    assert {got[n].dtype for n in got if ".experts." in n} == {torch.bfloat16}
    assert all(torch.equal(got[n], t) for n, t in want.items())  # bit-exact, nothing rounded
    assert back.head.weight is back.tok_emb.weight  # still tied
    layer = moelab.MoE(8, 4, 2)
    layer.experts.double()  # a bare layer too
    moelab.save(layer, tmp_path / "layer")
    assert moelab.load(tmp_path / "layer").experts.w_in.dtype == torch.float64


def test_a_layer_saved_before_its_options_became_a_typed_config_loads_and_computes_the_same():
    """``tests/golden/saved_before_config``: an ``MoE`` (sharede-v3 with a selection bias moved one
    step, capacity with the position policy, the global balance scope) saved by ``moelab.save``
    before ``MoEConfig``; it loads with its options, its routing context, and its outputs."""
    import json
    from pathlib import Path

    folder = Path(__file__).parent / "golden" / "saved_before_config"
    data = json.loads((folder / "io.json").read_text())
    layer = moelab.load(folder).eval()
    cfg = layer.config
    assert (cfg.method, cfg.capacity_factor, cfg.token_drop_policy, cfg.balance_scope) == (
        "sharede-v3",
        1.0,
        "position",
        "global",
    )
    assert layer.ctx.step == 1 and layer.router.selection_bias.abs().sum() > 0
    with torch.no_grad():
        y = layer(torch.tensor(data["x"]))
    assert torch.equal(y, torch.tensor(data["y"]))
