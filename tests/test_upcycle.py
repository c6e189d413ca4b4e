import copy
import json

import pytest
import torch
from torch import nn

import moelab
from moelab.cli import main
from moelab.experts import MLP
from moelab.hf.upcycle import find_mlps, upcycle

transformers = pytest.importorskip("transformers")


def _gpt2(dropout: float = 0.0):
    cfg = transformers.GPT2Config(
        vocab_size=40,
        n_positions=16,
        n_embd=16,
        n_layer=2,
        n_head=2,
        resid_pdrop=dropout,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def _llama(mlp_bias: bool = False):
    cfg = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        mlp_bias=mlp_bias,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).double().eval()


def _vision(kind: str):
    config_cls, model_cls = {
        "siglip": (transformers.SiglipVisionConfig, transformers.SiglipVisionModel),
        "vit": (transformers.ViTConfig, transformers.ViTModel),
        "clip": (transformers.CLIPVisionConfig, transformers.CLIPVisionModel),
    }[kind]
    cfg = config_cls(
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=8,
        patch_size=4,
    )
    torch.manual_seed(0)
    return model_cls(cfg).double().eval()


@pytest.mark.parametrize(
    ("arch", "method"),
    [
        ("gpt2", "smoe"),
        ("gpt2", "sharede-v3"),
        ("llama", "xmoe"),
        ("llama_bias", "sharede-v2"),
        ("llama", "smoe"),
    ],
)
def test_upcycled_language_model_equals_the_dense_model_at_init(arch, method):
    model = {"gpt2": _gpt2, "llama": _llama, "llama_bias": lambda: _llama(True)}[arch]()
    ids = torch.randint(0, 40, (2, 6))
    with torch.no_grad():
        dense = model(ids).logits
    upcycle(model, num_experts=4, top_k=2, method=method)
    layers = moelab.attach(model, moelab.RoutingContext())
    assert len(layers) == 2 and all(m.method == method for m in layers)
    with torch.no_grad(), moelab.recording_routing(model):
        sparse = model(ids).logits
    torch.testing.assert_close(sparse, dense, rtol=0, atol=1e-10)
    for layer in layers:  # the routing really is sparse: different tokens pick different experts
        assert layer.last_routing.indices.shape[-1] == 2
        torch.testing.assert_close(layer.last_routing.weights.sum(-1), torch.ones(12, dtype=torch.float64))


@pytest.mark.parametrize(
    ("kind", "num_mlps"), [("siglip", 3), ("vit", 2), ("clip", 2)]
)  # siglip: + pooling head
def test_upcycled_vision_model_equals_the_dense_model_at_init(kind, num_mlps):
    model = _vision(kind)
    pixels = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        dense = model(pixel_values=pixels).last_hidden_state
    upcycle(model, num_experts=3, top_k=1)
    assert len(moelab.attach(model, moelab.RoutingContext())) == num_mlps
    with torch.no_grad():
        sparse = model(pixel_values=pixels).last_hidden_state
    torch.testing.assert_close(sparse, dense, rtol=0, atol=1e-10)


def test_experts_copy_the_dense_weights_and_the_router_starts_at_std_002():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    layer = upcycle(mlp, num_experts=8, top_k=2)
    assert isinstance(layer, moelab.MoE) and layer.experts.activation == "gelu"
    for e in range(8):
        assert torch.equal(layer.experts.w_in[e], mlp[0].weight)
        assert torch.equal(layer.experts.w_out[e], mlp[2].weight)
        assert torch.equal(layer.experts.b_in[e], mlp[0].bias)
    std = layer.router.weight.std().item()
    assert 0.017 < std < 0.023, std  # 512 draws of N(0, 0.02²)
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x), mlp(x))


def test_shared_expert_methods_split_the_output_projection():
    torch.manual_seed(0)
    mlp = MLP(8, 12, activation="swiglu", bias=True)
    layer = upcycle(mlp, num_experts=4, top_k=2, method="sharede-v2", num_shared=2)
    assert layer.shared.fc_out.in_features == 24
    torch.testing.assert_close(layer.experts.w_out[0], mlp.fc_out.weight / 3)
    x = torch.randn(6, 8)
    torch.testing.assert_close(layer(x), mlp(x))


def test_weights_not_summing_to_one_scale_the_output():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8, bias=False))
    layer = upcycle(mlp, num_experts=4, top_k=2, renormalize=False)
    x = torch.randn(6, 8)
    y = layer(x)
    total = layer.last_routing.weights.sum(-1, keepdim=True)
    assert (total < 1).all()
    torch.testing.assert_close(y, total * mlp(x))


def test_layers_selects_mlps_in_module_order_and_dropout_is_kept():
    model = _gpt2(dropout=0.1)
    assert find_mlps(model) == ["transformer.h.0.mlp", "transformer.h.1.mlp"]
    upcycle(model, 4, 2, layers=[1])
    assert type(model.transformer.h[0].mlp).__name__ == "GPT2MLP"
    new = model.transformer.h[1].mlp
    assert isinstance(new[0], moelab.MoE) and isinstance(new[1], nn.Dropout) and new[1].p == 0.1
    assert find_mlps(model) == ["transformer.h.0.mlp"]  # MoE layers are not upcycled again


def test_bad_input_is_refused_naming_what_is_supported():
    with pytest.raises(ValueError, match=r"no recognisable dense MLP; supported: .*GPT-2.*LLaMA.*SigLIP"):
        upcycle(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4)), 4, 2)
    with pytest.raises(ValueError, match=r"activation Tanh\(\).*supported: ReLU, GELU"):
        upcycle(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), 4, 2)
    with pytest.raises(ValueError, match="layers=5 is not allowed"):
        upcycle(_gpt2(), 4, 2, layers=[5])
    with pytest.raises(ValueError, match="top_k=5 is not allowed"):
        upcycle(_gpt2(), 4, 5)
    with pytest.raises(ValueError, match="method='nope' is not a moelab method"):
        upcycle(_gpt2(), 4, 2, method="nope")
    with pytest.raises(ValueError, match=r"model=.*expected a torch.nn.Module"):
        upcycle("gpt2", 4, 2)


def test_cli_writes_a_checkpoint_that_reloads_bit_exactly(tmp_path):
    dense = _gpt2().float()
    dense.save_pretrained(tmp_path / "gpt2")
    out = tmp_path / "up"
    argv = [
        "upcycle",
        "--model",
        str(tmp_path / "gpt2"),
        "--num-experts",
        "4",
        "--top-k",
        "2",
        "--out",
        str(out),
    ]
    assert main([*argv, "--option", "balance_coef=0.02"]) == 0
    assert (out / "model.safetensors").is_file() and (out / "config.yaml").is_file()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["num_moe_layers"] == 2 and metrics["num_parameters"] > metrics["num_parameters_dense"]

    model = moelab.load(out)
    layers = moelab.attach(model, moelab.RoutingContext())
    assert len(layers) == 2 and layers[0].coefs["balance"] == 0.02
    ids = torch.randint(0, 40, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-5)
        again = moelab.load(out)
        assert torch.equal(again(ids).logits, model(ids).logits)
    assert main(argv) == 2  # refuses to overwrite without --force


def test_cli_accepts_a_config_json_and_reports_bad_input(tmp_path, capsys):
    cfg = transformers.LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(tmp_path / "cfg")
    argv = ["upcycle", "--model", str(tmp_path / "cfg" / "config.json"), "--num-experts", "4", "--top-k", "1"]
    assert main([*argv, "--layers", "0", "--out", str(tmp_path / "a")]) == 0
    model = moelab.load(tmp_path / "a")
    assert len(moelab.attach(model, moelab.RoutingContext())) == 1
    with pytest.raises(SystemExit) as exit_:  # argparse's own error: a flag's type
        main([*argv, "--layers", "x", "--out", str(tmp_path / "b")])
    assert exit_.value.code == 2
    assert "argument --layers: 'x' is not a comma-separated list of integers" in capsys.readouterr().err
    assert main([*argv[:2], str(tmp_path / "missing"), *argv[3:], "--out", str(tmp_path / "c")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("accumulate", [1, 2])
def test_hf_trainer_fine_tunes_an_upcycled_model_with_aux_loss_and_routing_context(tmp_path, accumulate):
    from moelab.hf.trainer import MoETrainer, MoETrainerCallback

    model = _gpt2().float().train()
    upcycle(model, 4, 2, method="smoe-dropout", k_max=4, balance_coef=0.5)  # K grows with ctx.progress
    torch.manual_seed(0)
    data = [{"input_ids": torch.randint(0, 40, (8,)), "labels": torch.randint(0, 40, (8,))} for _ in range(8)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulate,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        disable_tqdm=True,
    )
    seen = []

    class Spy(MoETrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            seen.append((state.global_step, model.transformer.h[0].mlp.ctx.step))

    trainer = MoETrainer(model=model, args=args, train_dataset=data, callbacks=[Spy()])
    aux_seen = []
    original = trainer.compute_loss

    def spy_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        task = transformers.Trainer.compute_loss(
            trainer, model, inputs, num_items_in_batch=num_items_in_batch
        )
        loss = original(model, inputs, return_outputs, num_items_in_batch)
        aux_seen.append(((loss - task).item(), moelab.aux_loss(model).item()))
        return loss

    trainer.compute_loss = spy_loss
    before = model.transformer.h[0].mlp.experts.w_in.detach().clone()
    trainer.train()
    assert seen == [(0, 0), (1, 1), (2, 2)]  # the context follows the Trainer's step
    ctx = model.transformer.h[0].mlp.ctx
    assert ctx.step == 3 and ctx.total_steps == 3
    assert model.transformer.h[0].mlp.router.current_k(ctx) == 4
    assert len(aux_seen) == 3 * accumulate
    for added, aux in aux_seen:  # the balance loss was added, scaled like the task loss under accumulation
        assert aux > 0.5 and added == pytest.approx(aux / accumulate, rel=1e-4)
    assert not torch.equal(model.transformer.h[0].mlp.experts.w_in, before)


def test_an_upcycled_model_records_how_to_rebuild_it_offline(tmp_path):
    cfg = transformers.LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2
    )
    model = upcycle(transformers.LlamaForCausalLM(cfg), 4, 2, "smoe", [1], balance_coef=0.02)
    moelab.save(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["kind"] == "transformers" and config["config"]["model_class"] == "LlamaForCausalLM"
    assert config["config"]["recipe"] == [{"op": "upcycle", "num_experts": 4, "top_k": 2, "method": "smoe",
                                           "layers": [1], "options": {"balance_coef": 0.02}}]  # fmt: skip
    again = moelab.load(tmp_path)
    for (k, a), (k2, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k


@pytest.mark.parametrize(
    "case,message",
    [("pipeline", "has architectures[0]='pipeline', which is not a transformers model class"),
     ("AutoConfig", "has architectures[0]='AutoConfig', which is not a transformers model class"),
     ("pickle weights", "holds .bin weights (a pickle, which moelab does not read)")],
)  # fmt: skip
def test_cli_refuses_a_model_it_cannot_build_before_writing_anything(tmp_path, capsys, case, message):
    cfg = transformers.LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2
    )
    cfg.architectures = ["LlamaForCausalLM"] if case == "pickle weights" else [case]
    cfg.save_pretrained(tmp_path / "m")
    if case == "pickle weights":
        (tmp_path / "m" / "pytorch_model.bin").write_bytes(b"not read")
    out = tmp_path / "out"
    argv = [
        "upcycle",
        "--model",
        str(tmp_path / "m"),
        "--num-experts",
        "4",
        "--top-k",
        "1",
        "--out",
        str(out),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_trainer_checkpoints_of_a_model_with_moelab_layers_reload_and_save_pretrained_refuses(tmp_path):
    from moelab.hf.trainer import MoETrainer

    model = _gpt2().float().train()
    upcycle(model, 4, 2)
    with pytest.raises(ValueError, match="save_pretrained refused"):
        model.save_pretrained(tmp_path / "refused")
    torch.manual_seed(0)
    data = [{"input_ids": torch.randint(0, 40, (8,)), "labels": torch.randint(0, 40, (8,))} for _ in range(4)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "t"), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-3,
        report_to=[], save_strategy="steps", save_steps=2, use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    MoETrainer(model=model, args=args, train_dataset=data).train()
    ckpt = tmp_path / "t" / "checkpoint-2"
    assert (ckpt / "model.safetensors").is_file() and not (ckpt / "config.json").exists()
    reloaded = moelab.load(ckpt / "moelab")  # rebuilt offline, the trained weights
    a, b = model.state_dict(), reloaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_train_force_over_an_upcycled_run_leaves_nothing_of_it(tmp_path):
    from moelab.models.lm import TransformerLM

    _gpt2().float().save_pretrained(tmp_path / "gpt2")
    out = tmp_path / "run"
    assert main(["upcycle", "--model", str(tmp_path / "gpt2"), "--num-experts", "4", "--top-k", "2",
                 "--out", str(out)]) == 0  # fmt: skip
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i} of text.\n" for i in range(300)))
    train = ["train", "--data", str(corpus), "--size", "cpu", "--block-size", "16", "--batch-size", "4",
             "--num-experts", "4", "--steps", "2", "--eval-every", "2", "--eval-tokens", "64",
             "--test-tokens", "64", "--no-progress", "--out", str(out)]  # fmt: skip
    assert main(train) == 2  # a run of another command is not overwritten without --force
    assert main([*train, "--force"]) == 0
    assert not (out / "config.json").exists() and not (out / "model.safetensors").exists()
    assert isinstance(moelab.load(out), TransformerLM)


@pytest.mark.parametrize("method", ["smoe", "sharede-v3", "competesmoe"])
def test_top1_upcycling_keeps_the_dense_function_unless_switch_weighting_is_asked(method):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    x = torch.randn(5, 8)
    layer = upcycle(copy.deepcopy(mlp), num_experts=4, top_k=1, method=method).eval()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), mlp(x))  # weight 1: the dense MLP
    switch = upcycle(copy.deepcopy(mlp), num_experts=4, top_k=1, renormalize=False).eval()
    r = switch.router(x, switch.experts, None)
    torch.testing.assert_close(r.weights, r.probs.gather(1, r.indices))  # Switch: p of the chosen


def test_cli_refuses_more_experts_than_memory_holds_before_allocating(tmp_path, capsys):
    _gpt2().float().save_pretrained(tmp_path / "gpt2")
    out = tmp_path / "up"
    capsys.readouterr()
    assert main(["upcycle", "--model", str(tmp_path / "gpt2"), "--num-experts", "4096000000", "--top-k", "2",
                 "--out", str(out)]) == 2  # fmt: skip
    line = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' own loading bar
    assert line.startswith(
        "moelab upcycle: error: --num-experts=4096000000 is not allowed here: the upcycled model would need at least"
    )
    assert line.endswith("expected a smaller --num-experts") and not out.exists()


@pytest.mark.parametrize(
    "damage, message",
    [
        ("junk+bin", "holds .bin weights (a pickle, which moelab does not read)"),
        ("junk", "holds ['junk.safetensors'] but no model.safetensors (or its index)"),
        ("truncated", "transformers cannot load its weights (SafetensorError: "),
    ],
)
def test_cli_refuses_weights_it_would_not_load_instead_of_a_random_init(tmp_path, capsys, damage, message):
    model = tmp_path / "gpt2"
    _gpt2().float().save_pretrained(model)
    weights = model / "model.safetensors"
    if damage.startswith("junk"):
        weights.unlink()
        (model / "junk.safetensors").write_bytes(b"not a safetensors file")
        if damage == "junk+bin":
            torch.save({}, model / "pytorch_model.bin")
    else:
        weights.write_bytes(weights.read_bytes()[:100])
    out = tmp_path / "up"
    capsys.readouterr()
    assert (
        main(["upcycle", "--model", str(model), "--num-experts", "2", "--top-k", "1", "--out", str(out)]) == 2
    )
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"moelab upcycle: error: --model {str(model)!r}") and message in line
    assert not out.exists()


def test_resume_refuses_a_model_folder_whose_weights_changed(tmp_path, capsys):
    _gpt2().float().save_pretrained(tmp_path / "gpt2")
    out = tmp_path / "up"
    argv = [
        "upcycle",
        "--model",
        str(tmp_path / "gpt2"),
        "--num-experts",
        "2",
        "--top-k",
        "1",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    written = (out / "model.safetensors").read_bytes()
    assert main([*argv, "--resume"]) == 0  # the same model: the same upcycled weights again
    other = _gpt2().float()
    with torch.no_grad():
        other.transformer.wte.weight.add_(1.0)
    other.save_pretrained(tmp_path / "gpt2")  # other weights under the same path
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"moelab upcycle: error: --resume: --model {str(tmp_path / 'gpt2')!r} has sha256 ")
    assert (out / "model.safetensors").read_bytes() == written
