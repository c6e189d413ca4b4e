"""Upcycling knows what an MLP is: plain MLPs, OPT/BART/Whisper fc1/fc2 layers, and refusals."""

import json

import pytest
import torch
from torch import nn

import moelab
from moelab.cli import main
from moelab.hf.upcycle import find_mlps, upcycle

transformers = pytest.importorskip("transformers")

V = 40  # vocabulary of the tiny language models
TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)


def _opt():
    return transformers.OPTForCausalLM(
        transformers.OPTConfig(
            vocab_size=V, hidden_size=16, ffn_dim=24, num_hidden_layers=2, num_attention_heads=2,
            word_embed_proj_dim=16, max_position_embeddings=32, dropout=0.0, **TOKENS,
        )
    )  # fmt: skip


def _bart(activation_dropout: float = 0.0):
    return transformers.BartForConditionalGeneration(
        transformers.BartConfig(
            vocab_size=V, d_model=16, encoder_ffn_dim=24, decoder_ffn_dim=24, encoder_layers=1,
            decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
            max_position_embeddings=32, dropout=0.0, activation_dropout=activation_dropout, **TOKENS,
        )
    )  # fmt: skip


def _whisper():
    return transformers.WhisperModel(
        transformers.WhisperConfig(
            vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24, num_mel_bins=8,
            max_source_positions=8, max_target_positions=16, **TOKENS,
        )
    )  # fmt: skip


def _gpt2():
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    )


def _llama():
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=V, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1,
        )
    )  # fmt: skip


def _vision(kind: str):
    config_cls, model_cls = {
        "vit": (transformers.ViTConfig, transformers.ViTModel),
        "clip": (transformers.CLIPVisionConfig, transformers.CLIPVisionModel),
        "siglip": (transformers.SiglipVisionConfig, transformers.SiglipVisionModel),
    }[kind]
    cfg = config_cls(
        hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2, image_size=8,
        patch_size=4,
    )  # fmt: skip
    return model_cls(cfg)


BUILD = {
    "opt": _opt,
    "bart": _bart,
    "whisper": _whisper,
    "gpt2": _gpt2,
    "llama": _llama,
    "vit": lambda: _vision("vit"),
    "clip": lambda: _vision("clip"),
    "siglip": lambda: _vision("siglip"),
}
#: (recognised MLPs, the first one's name)
EXPECTED = {
    "opt": (2, "model.decoder.layers.0.fc1+fc2"),
    "bart": (2, "model.encoder.layers.0.fc1+fc2"),
    "whisper": (2, "encoder.layers.0.fc1+fc2"),
    "gpt2": (2, "transformer.h.0.mlp"),
    "llama": (2, "model.layers.0.mlp"),
    "vit": (2, "layers.0.mlp"),
    "clip": (2, "encoder.layers.0.mlp"),
    "siglip": (3, "encoder.layers.0.mlp"),  # + the pooling head's MLP
}


def _inputs(arch: str) -> dict:
    g = torch.Generator().manual_seed(1)
    if arch in ("vit", "clip", "siglip"):
        return {"pixel_values": torch.randn(2, 3, 8, 8, generator=g, dtype=torch.float64)}
    if arch == "whisper":
        return {
            "input_features": torch.randn(2, 8, 16, generator=g, dtype=torch.float64),
            "decoder_input_ids": torch.randint(3, V, (2, 5), generator=g),
        }
    return {"input_ids": torch.randint(3, V, (2, 6), generator=g)}


def _out(model, inputs) -> torch.Tensor:
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("arch", list(BUILD))
def test_upcycled_model_runs_and_equals_the_dense_model_at_init(arch):
    torch.manual_seed(0)
    model = BUILD[arch]().double().eval()
    inputs = _inputs(arch)
    with torch.no_grad():
        dense = _out(model, inputs)
    names = find_mlps(model)
    assert (len(names), names[0]) == EXPECTED[arch]
    upcycle(model, num_experts=4, top_k=2)
    layers = moelab.attach(model, moelab.RoutingContext())
    assert len(layers) == EXPECTED[arch][0]
    with torch.no_grad(), moelab.recording_routing(model):
        sparse = _out(model, inputs)
    torch.testing.assert_close(sparse, dense, rtol=0, atol=1e-10)
    assert all(layer.last_routing.indices.shape[-1] == 2 for layer in layers)  # every MoE layer ran
    model.train()
    out = model(**inputs)
    sum(v.square().mean() for v in out.values() if torch.is_tensor(v) and v.is_floating_point()).backward()
    # trains: gradients reach every router
    assert all(layer.router.weight.grad is not None for layer in layers)


@pytest.mark.parametrize("arch", ["opt", "bart"])
def test_an_opt_or_bart_layer_keeps_its_attention_and_norms_and_upcycles_only_fc1_act_fc2(arch):
    torch.manual_seed(0)
    model = BUILD[arch]()
    layer = model.model.decoder.layers[0]
    kept = {n: p.detach().clone() for n, p in layer.named_parameters() if not n.startswith(("fc1", "fc2"))}
    fc1, fc2 = layer.fc1.weight.detach().clone(), layer.fc2.weight.detach().clone()
    upcycle(model, 4, 2)
    assert isinstance(layer.fc1, moelab.MoE)
    assert isinstance(layer.fc2, nn.Identity) and isinstance(layer.activation_fn, nn.Identity)
    assert type(layer.self_attn).__name__.endswith("Attention")
    for name, value in kept.items():  # attention and norms: the same modules, the same weights
        assert torch.equal(layer.get_parameter(name), value), name
    assert torch.equal(layer.fc1.experts.w_in[3], fc1) and torch.equal(layer.fc1.experts.w_out[0], fc2)
    assert find_mlps(model) == []  # nothing dense is left to upcycle


def test_dropout_between_fc1_and_fc2_is_dropped_and_after_the_mlp_kept():
    model = _bart(activation_dropout=0.3)
    upcycle(model, 4, 2, layers=[1])
    assert model.model.decoder.layers[0].activation_dropout == 0.0  # inside the MLP: dropped
    assert model.model.encoder.layers[0].activation_dropout == 0.3  # not upcycled: untouched
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.2)
    )
    upcycle(gpt2, 4, 2)
    moe, drop = gpt2.transformer.h[0].mlp
    assert isinstance(moe, moelab.MoE) and isinstance(drop, nn.Dropout) and drop.p == 0.2


def test_an_upcycled_opt_model_saves_and_reloads_bit_exactly(tmp_path):
    torch.manual_seed(0)
    model = upcycle(_opt().eval(), 4, 2, method="smoe", layers=[1])
    moelab.save(model, tmp_path / "m")
    again = moelab.load(tmp_path / "m").eval()
    ids = _inputs("opt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


# ------------------------------------------------------------------------------------- refusals
class NormBetween(nn.Module):  # a layer with fc1/fc2/activation_fn and a norm between them (Kosmos-2.5)
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.activation_fn = nn.GELU()
        self.ffn_layernorm = nn.LayerNorm(16)

    def forward(self, x):
        x = x + self.attn(x)
        h = self.activation_fn(self.fc1(x))
        h = self.ffn_layernorm(h)
        h = self.fc2(h)
        return x + h


class ActAfter(nn.Module):  # a plain-looking MLP with an activation after fc2 (Llama-4 vision)
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.activation_fn = nn.Linear(8, 16), nn.Linear(16, 8), nn.GELU()

    def forward(self, x):
        return self.activation_fn(self.fc2(self.activation_fn(self.fc1(x))))


class Clamped(nn.Module):  # SwiGLU with clamping (DeepSeek-V4 style)
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        gate = self.gate_proj(x).clamp(max=7.0)
        return self.down_proj(self.act_fn(gate) * self.up_proj(x))


class WithNorm(nn.Module):  # timm's Mlp with a norm between the projections
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.norm, self.fc2 = (
            nn.Linear(8, 16),
            nn.GELU(),
            nn.LayerNorm(16),
            nn.Linear(16, 8),
        )

    def forward(self, x):
        return self.fc2(self.norm(self.act(self.fc1(x))))


class NoActivation(nn.Module):  # two projections, no activation: a low-rank map, not an MLP
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 4), nn.Linear(4, 8)

    def forward(self, x):
        return self.fc2(self.fc1(x))


class Plain(nn.Module):  # a plain MLP defined here: recognised, as the others are refused
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(8, 16), nn.Linear(16, 8), nn.ReLU()
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        x = self.fc1(x)
        x = self.act(x)
        return self.drop(self.fc2(x))


@pytest.mark.parametrize(
    ("module", "message"),
    [
        (NormBetween, r"NormBetween.forward does not compute fc2\(activation_fn\(fc1\(h\)\)\) between fc1 and fc2 "
                      r"\(with that MLP in their place it raises RuntimeError: .*normalized_shape.*\); not upcycled$"),
        (ActAfter, r"ActAfter.forward does not compute fc2\(activation_fn\(fc1\(x\)\)\) \(on random inputs they "
                   r"differ by up to .* times the output's largest entry\); moelab upcycles only that MLP$"),
        (Clamped, r"Clamped.forward does not compute down_proj\(act_fn\(gate_proj\(x\)\) \* up_proj\(x\)\) \(on "
                  r"random inputs they differ by up to .*\); moelab upcycles only that MLP$"),
        (WithNorm, r"WithNorm holds fc1, fc2 but 'norm' besides them: not a plain MLP \(2 or 3 Linear "
                   r"projections and an activation, nothing else\) nor an OPT/BART-style layer"),
        (NoActivation, r"NoActivation holds fc1, fc2 but no activation \(activation_fn, act or act_fn\)"),
    ],
)  # fmt: skip
def test_anything_but_an_mlp_is_refused_before_the_model_changes(module, message):
    torch.manual_seed(0)
    model = nn.Sequential(Plain(), module())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"^'1': {message}"):
        upcycle(model, 4, 2)
    with pytest.raises(ValueError, match=message):
        upcycle(model, 4, 2, layers=[0])  # refused even when only the plain MLP is asked for
    with pytest.raises(ValueError, match=f"^{message}"):
        find_mlps(model[1])
    assert isinstance(model[0], Plain) and model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    layer = upcycle(Plain(), 4, 2)  # the plain one alone is recognised (dropout after it kept)
    assert isinstance(layer[0], moelab.MoE) and layer[1].p == 0.1


def test_dropout_between_fc1_and_fc2_that_is_not_activation_dropout_is_refused():
    class Layer(NormBetween):
        def __init__(self):
            super().__init__()
            del self.ffn_layernorm
            self.dropout = 0.1

        def forward(self, x):
            h = self.activation_fn(self.fc1(x + self.attn(x)))
            h = nn.functional.dropout(h, p=self.dropout, training=self.training)
            return x + self.fc2(h)

    with pytest.raises(
        ValueError,
        match=r"^Layer.forward applies a dropout between fc1 and fc2 in training mode other than "
        r"activation_dropout, which upcycling cannot keep or drop safely; set it to 0$",
    ):
        upcycle(Layer(), 4, 2)
    layer = Layer()
    layer.dropout = 0.0
    assert isinstance(upcycle(layer, 4, 2).fc1, moelab.MoE)  # p = 0: nothing to keep or drop


class Branching(nn.Module):  # an MLP whose forward is no straight-line code: judged by what it computes
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        if x.dim() == 3:
            return torch.stack([self.forward(row) for row in x])
        gate, up = self.gate_proj(x), self.up_proj(x)
        for _ in range(1):
            gate = self.act_fn(gate)
        return self.down_proj(gate * up)


def test_an_mlp_is_recognised_by_what_it_computes_not_by_how_its_forward_is_written():
    torch.manual_seed(0)
    mlp = Branching()
    x = torch.randn(3, 5, 8)
    with torch.no_grad():
        dense = mlp(x)
        layer = upcycle(mlp, 4, 2)
        torch.testing.assert_close(layer(x), dense, rtol=1e-5, atol=1e-6)
    assert isinstance(layer, moelab.MoE) and layer.experts.activation == "swiglu"


def test_checking_an_mlp_leaves_the_model_and_the_random_stream_as_they_were():
    model = _bart(activation_dropout=0.3).train()
    model.model.encoder.eval()
    torch.manual_seed(5)
    find_mlps(model)  # runs every candidate in evaluation and training mode
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(3))
    assert model.training and model.model.decoder.training and not model.model.encoder.training
    assert not any(m.training for m in model.model.encoder.modules())
    assert model.model.encoder.layers[0].activation_dropout == 0.3


def test_an_mlp_with_a_functional_dropout_is_refused():
    class FunctionalDropout(Plain):
        def forward(self, x):
            return nn.functional.dropout(self.fc2(self.act(self.fc1(x))), p=0.1, training=self.training)

    with pytest.raises(
        ValueError,
        match=r"^FunctionalDropout.forward computes something else in training mode, besides its dropout "
        r"modules \(a functional dropout\?\), which upcycling cannot keep; not upcycled$",
    ):
        upcycle(FunctionalDropout(), 4, 2)


def test_an_mlp_on_the_meta_device_is_refused_as_it_cannot_be_checked():
    with torch.device("meta"):
        mlp = Plain()
    with pytest.raises(
        ValueError,
        match=r"^Plain has its weights on the meta device; moelab checks by running it that it computes "
        r"fc2\(act\(fc1\(x\)\)\) before upcycling it: load or initialise the weights first$",
    ):
        upcycle(mlp, 4, 2)


def test_the_cli_refuses_a_model_it_cannot_upcycle_and_writes_nothing(tmp_path, capsys):
    # Moonshine's decoder MLP is gated (fc1 → chunk → act(gate) · x → fc2): its fc1 is twice as wide as
    # fc2 takes, not fc2(act(fc1(x)))
    cfg = transformers.MoonshineConfig(
        vocab_size=V, hidden_size=16, intermediate_size=24, encoder_num_hidden_layers=1,
        decoder_num_hidden_layers=1, encoder_num_attention_heads=2, decoder_num_attention_heads=2,
        max_position_embeddings=32, **TOKENS,
    )  # fmt: skip
    cfg.architectures = ["MoonshineForConditionalGeneration"]
    cfg.save_pretrained(tmp_path / "cfg")
    out = tmp_path / "out"
    argv = [
        "upcycle",
        "--model",
        str(tmp_path / "cfg"),
        "--num-experts",
        "4",
        "--top-k",
        "2",
        "--out",
        str(out),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert (
        "'model.decoder.layers.0.mlp': MoonshineDecoderMLP: fc1 (16, 48) and fc2 (24, 16) (in, out) do not chain"
        in err
    )
    assert not out.exists()
    out.mkdir()
    (out / "config.yaml").write_text("old run\n")  # --force: the old run survives a refusal
    assert main([*argv, "--force"]) == 2
    assert (out / "config.yaml").read_text() == "old run\n" and sorted(p.name for p in out.iterdir()) == [
        "config.yaml"
    ]


def test_the_cli_upcycles_an_opt_config(tmp_path):
    cfg = _opt().config
    cfg.architectures = ["OPTForCausalLM"]
    cfg.save_pretrained(tmp_path / "cfg")
    out = tmp_path / "out"
    argv = [
        "upcycle",
        "--model",
        str(tmp_path / "cfg"),
        "--num-experts",
        "4",
        "--top-k",
        "2",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["num_mlps"] == 2 and metrics["num_moe_layers"] == 2
    model = moelab.load(out).eval()
    assert len(moelab.attach(model, moelab.RoutingContext())) == 2
    with torch.no_grad():
        assert model(_inputs("opt")["input_ids"]).logits.shape == (2, 6, V)


@pytest.mark.parametrize("arch", ["opt", "gpt2", "llama"])
def test_an_upcycled_decoder_routes_and_balances_only_the_real_tokens_of_the_attention_mask(arch):
    torch.manual_seed(0)
    model = upcycle(BUILD[arch]().double(), num_experts=4, top_k=2).train()
    ids = _inputs(arch)["input_ids"]
    mask = torch.ones_like(ids)
    mask[1, 3:] = 0
    aux = []
    for pad_id in (5, 9):  # other ids at the padded positions
        torch.manual_seed(1)  # GPT-2's dropout: the same draws
        out = model(input_ids=ids.masked_fill(mask == 0, pad_id), attention_mask=mask).logits
        aux.append((moelab.aux_loss(model).detach(), out[mask.bool()].detach()))
    assert torch.equal(aux[0][0], aux[1][0]) and torch.equal(aux[0][1], aux[1][1])
