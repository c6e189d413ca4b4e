import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import moelab  # noqa: E402
from moelab.hf.convert import GatedSharedExpert, from_hf  # noqa: E402

D, H, N, K = 16, 8, 8, 2


def _randomize(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _block(kind: str, seed: int = 0, **overrides) -> nn.Module:
    if kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralSparseMoeBlock

        cfg = MixtralConfig(
            hidden_size=D, intermediate_size=H, num_local_experts=N, num_experts_per_tok=K, **overrides
        )
        block = MixtralSparseMoeBlock(cfg)
    elif kind in ("qwen2", "qwen3", "olmoe"):
        from transformers.models.olmoe.modeling_olmoe import OlmoeConfig, OlmoeSparseMoeBlock
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeConfig, Qwen2MoeSparseMoeBlock
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeConfig, Qwen3MoeSparseMoeBlock

        config_cls, block_cls = {
            "qwen2": (Qwen2MoeConfig, Qwen2MoeSparseMoeBlock),
            "qwen3": (Qwen3MoeConfig, Qwen3MoeSparseMoeBlock),
            "olmoe": (OlmoeConfig, OlmoeSparseMoeBlock),
        }[kind]
        extra = {"shared_expert_intermediate_size": 12} if kind == "qwen2" else {}
        cfg = config_cls(
            hidden_size=D,
            intermediate_size=H,
            moe_intermediate_size=H,
            num_experts=N,
            num_experts_per_tok=K,
            **extra,
            **overrides,
        )
        block = block_cls(cfg)
    else:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Config, DeepseekV3MoE

        kw = dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=2, norm_topk_prob=True)
        kw.update(overrides)
        kw.setdefault("num_experts_per_tok", K)
        cfg = DeepseekV3Config(hidden_size=D, moe_intermediate_size=H, n_routed_experts=N, **kw)
        block = DeepseekV3MoE(cfg)
    _randomize(block, seed)
    if kind == "deepseek":
        with torch.no_grad():  # a non-trivial selection bias, as after training
            block.gate.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.2, N))
    return block.eval()


CASES = [
    ("mixtral", {}, "smoe"),
    ("qwen3", {"norm_topk_prob": False}, "smoe"),
    ("qwen3", {"norm_topk_prob": True}, "smoe"),
    ("olmoe", {"norm_topk_prob": False}, "smoe"),
    ("qwen2", {"norm_topk_prob": False}, "sharede-v2"),
    ("deepseek", {}, "sharede-v3"),
    (
        "deepseek",
        {"n_group": 1, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0},
        "sharede-v3",
    ),
]


@pytest.mark.parametrize(("kind", "overrides", "method"), CASES)
def test_converted_block_has_identical_outputs_and_routing(kind, overrides, method):
    block = _block(kind, **overrides)
    layer = from_hf(block)
    assert isinstance(layer, moelab.MoE) and layer.method == method and not layer.training
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), moelab.recording_routing(layer):
        expected = block(x.clone())
        got = layer(x)
        _, hf_weights, hf_indices = block.gate(x.reshape(-1, D))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # same experts chosen, same weights (order within a token may differ)
    order_hf, order_ml = hf_indices.argsort(-1), layer.last_routing.indices.argsort(-1)
    assert torch.equal(hf_indices.gather(1, order_hf), layer.last_routing.indices.gather(1, order_ml))
    torch.testing.assert_close(
        layer.last_routing.weights.gather(1, order_ml), hf_weights.gather(1, order_hf).to(x.dtype)
    )


def test_deepseek_group_limited_routing_only_uses_the_chosen_groups():
    block = _block("deepseek", n_group=4, topk_group=1)
    layer = from_hf(block)
    x = torch.randn(64, D)
    with torch.no_grad(), moelab.recording_routing(layer):
        layer(x)
    groups = layer.last_routing.indices // (N // 4)  # (T, K) group of each chosen expert
    assert (groups == groups[:, :1]).all()  # both experts of a token come from its one group
    assert layer.router.scale == 2.5 and layer.router.topk_groups == 1


def test_qwen2_shared_expert_keeps_its_sigmoid_gate():
    layer = from_hf(_block("qwen2"))
    assert isinstance(layer.shared, GatedSharedExpert)
    assert layer.shared.mlp.fc_out.in_features == 12


def test_whole_model_conversion_keeps_the_logits():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=50,
        hidden_size=D,
        intermediate_size=H,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg).eval()
    _randomize(model, 3)
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        expected = model(ids).logits
    assert from_hf(model) is model
    layers = moelab.attach(model, moelab.RoutingContext())
    assert len(layers) == 2
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    model.train()(ids)  # a training forward computes the aux losses (an inference one, none)
    assert moelab.aux_loss(model).item() > 0  # router_aux_loss_coef became balance_coef


def test_converted_layer_trains():
    layer = from_hf(_block("deepseek")).train()
    ctx = moelab.RoutingContext()
    moelab.attach(layer, ctx)
    bias_before = layer.router.selection_bias.clone()
    y = layer(torch.randn(20, D))
    (y.square().mean() + layer.aux_loss).backward()
    assert layer.router.weight.grad is not None and layer.experts.w_in.grad is not None
    ctx.advance()  # after the optimizer step
    assert not torch.equal(layer.router.selection_bias, bias_before)  # aux-loss-free balancing ran


def test_modules_without_an_moe_block_are_refused_saying_what_was_looked_for():
    with pytest.raises(
        ValueError,
        match=r"Linear is not a transformers MoE block and contains none \(no module with an 'experts' child\)",
    ):
        from_hf(nn.Linear(3, 3))
    with pytest.raises(ValueError, match=r"module=.*expected a torch.nn.Module"):
        from_hf("mixtral")


def test_unsupported_block_features_are_refused():
    with pytest.raises(ValueError, match=r"\(MixtralSparseMoeBlock\) cannot be converted.*jitter noise 0.1"):
        from_hf(_block("mixtral", router_jitter_noise=0.1))
    with pytest.raises(
        ValueError, match=r"\(Qwen3MoeSparseMoeBlock\) cannot be converted.*activation 'gelu'"
    ):
        from_hf(_block("qwen3", hidden_act="gelu"))


def test_router_options_added_for_interop_validate_their_input():
    with pytest.raises(ValueError, match="num_groups=3 is not allowed"):
        moelab.MoE(8, 8, 2, method="sharede-v3", num_groups=3)
    with pytest.raises(ValueError, match="topk_groups=1 is not allowed"):
        moelab.MoE(8, 8, 4, method="sharede-v3", num_groups=4, topk_groups=1)
    with pytest.raises(ValueError, match="scale=0 is not allowed"):
        moelab.MoE(8, 8, 2, method="sharede-v3", scale=0)


def test_unrenormalized_topk_weights_are_the_full_softmax_at_the_chosen_experts():
    layer = moelab.MoE(8, 6, 2, method="smoe", renormalize=False)
    x = torch.randn(10, 8)
    layer(x)
    r = layer.last_routing
    full = (x @ layer.router.weight.T).softmax(-1)
    expected_idx = full.topk(2, dim=-1).indices
    assert torch.equal(r.indices, expected_idx)
    torch.testing.assert_close(r.weights, full.gather(1, expected_idx))
    assert (r.weights.sum(-1) < 1).all()


# ---------------------------------------------------------------- to_hf, save_pretrained, set_method


def _tiny_causal_lm(kind: str):
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(
            vocab_size=50,
            hidden_size=D,
            intermediate_size=H,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
        cfg._experts_implementation = "eager"  # the grouped kernels take no float64
        model = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.DeepseekV3Config(
            vocab_size=50,
            hidden_size=D,
            intermediate_size=H,
            moe_intermediate_size=H,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            n_routed_experts=N,
            num_experts_per_tok=K,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            first_k_dense_replace=0,
            q_lora_rank=None,
            kv_lora_rank=8,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=4,
            head_dim=4,
        )
        cfg._experts_implementation = "eager"
        model = transformers.DeepseekV3ForCausalLM(cfg)
    model = model.double().eval()
    _randomize(model, 3)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.linspace(-0.2, 0.2, b.numel(), dtype=b.dtype))
    return model


@pytest.mark.parametrize("kind", ["mixtral", "deepseek"])
def test_round_trip_keeps_the_logits_and_save_pretrained_loads_in_plain_transformers(kind, tmp_path):
    model = _tiny_causal_lm(kind)
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
    moelab.from_hf(model)
    with torch.no_grad():
        converted = model(ids).logits
    assert (converted - expected).abs().max().item() < 1e-6  # float32 routers round
    with torch.no_grad():  # a "fine-tuned" change must travel back too
        from moelab.layer import moe_layers

        moe_layers(model)[0].experts.w_out.mul_(1.5)
        tuned = model(ids).logits
    assert moelab.to_hf(model) is model and not moe_layers(model)
    with torch.no_grad():
        back = model(ids).logits
    assert (back - tuned).abs().max().item() < 1e-6 and (back - expected).abs().max().item() > 1e-3
    model.save_pretrained(tmp_path / "hf")
    reloaded = (
        type(model)
        .from_pretrained(tmp_path / "hf", dtype=torch.float64, experts_implementation="eager")
        .eval()
    )
    with torch.no_grad():
        assert (reloaded(ids).logits - back).abs().max().item() < 1e-12  # nothing re-initialised


def test_save_pretrained_refuses_while_moelab_layers_are_in_the_model(tmp_path):
    model = moelab.from_hf(_tiny_causal_lm("mixtral"))
    with pytest.raises(
        ValueError, match=r"save_pretrained refused: the model holds 2 moelab MoE layers.*moelab.to_hf"
    ):
        model.save_pretrained(tmp_path / "hf")
    assert not (tmp_path / "hf" / "config.json").exists()


def test_to_hf_refuses_a_method_transformers_cannot_express_naming_it_and_what_is_lost():
    model = moelab.from_hf(_tiny_causal_lm("mixtral"))
    moelab.set_method(model, "pcosine")
    with pytest.raises(
        ValueError,
        match=r"method='pcosine'.*MixtralSparseMoeBlock has no counterpart.*cosine router's "
        r"projection.*would be lost.*moelab.save",
    ):
        moelab.to_hf(model)
    layer = from_hf(_block("qwen3"))
    moelab.set_method(layer, "competesmoe")
    with pytest.raises(ValueError, match=r"method='competesmoe'.*competition schedule.*would be lost"):
        moelab.to_hf(layer)
    with pytest.raises(ValueError, match=r"never was a transformers block|was never a transformers block"):
        moelab.to_hf(moelab.MoE(8, 4, 2))
    with pytest.raises(ValueError, match=r"holds no moelab MoE layer"):
        moelab.to_hf(nn.Linear(2, 2))


def test_to_hf_refuses_a_sigmoid_router_with_a_gate_bias_transformers_has_no_place_for():
    layer = from_hf(_block("deepseek"))
    assert layer.method == "sharede-v3"
    with pytest.warns(UserWarning):
        moelab.set_method(layer, "sharede-v3", gate_bias=True)
    with pytest.raises(ValueError, match=r"router options \{'gate_bias': True\} differ.*would be lost"):
        moelab.to_hf(layer)


def test_set_method_smoe_keeps_deepseek_scale_and_normalisation_so_an_equivalent_rule_matches():
    # K = 1, one group, zero bias: the normalised sigmoid and the renormalised softmax both give
    # weight 1 to the same expert; only the routed scaling factor (2.5) tells them apart
    block = _block("deepseek", n_group=1, topk_group=1, num_experts_per_tok=1)
    with torch.no_grad():
        block.gate.e_score_correction_bias.zero_()
    layer = from_hf(block)
    x = torch.randn(4, 6, D, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = block(x.clone())
    moelab.set_method(layer, "smoe")
    assert layer.method == "smoe" and layer.router.scale == 2.5 and layer.router.renormalize
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)


def test_set_method_warns_naming_what_the_new_method_cannot_express():
    layer = from_hf(_block("deepseek"))  # groups 4 → 2 and a non-zero selection bias
    with pytest.warns(
        UserWarning, match=r"drops what this method cannot express: num_groups=4.*selection_bias"
    ):
        moelab.set_method(layer, "smoe")
    assert layer.router.scale == 2.5


def test_from_hf_with_a_method_carries_the_block_rule_into_the_competition_base_router():
    block = _block("deepseek")
    layer = from_hf(block, method="competesmoe")
    assert layer.method == "competesmoe"
    base = layer.router.base
    assert (base.scale, base.num_groups, base.topk_groups, base.normalize) == (2.5, 4, 2, True)
    torch.testing.assert_close(base.selection_bias, torch.linspace(-0.2, 0.2, N))
    torch.testing.assert_close(base.weight, block.gate.weight)
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # evaluation: the base router alone, i.e. the block's rule
        torch.testing.assert_close(layer(x), block(x.clone()), rtol=1e-5, atol=1e-6)


def test_set_method_refuses_bad_input_naming_it():
    layer = from_hf(_block("qwen3"))
    with pytest.raises(ValueError, match=r"method='nope' is not a moelab method"):
        moelab.set_method(layer, "nope")
    with pytest.raises(ValueError, match=r"option 'bogus' is not accepted by method='smoe'"):
        moelab.set_method(layer, "smoe", bogus=1)
    with pytest.raises(
        ValueError, match=r"num_shared=2 is not allowed; set_method keeps the layer's shared experts"
    ):
        moelab.set_method(layer, "smoe", num_shared=2)
    with pytest.raises(ValueError, match=r"holds no moelab MoE layer"):
        moelab.set_method(nn.Linear(2, 2), "smoe")
    with pytest.raises(ValueError, match=r"options \['scale'\] are not allowed without method="):
        from_hf(_block("qwen3"), scale=2.0)


def test_a_switched_model_saves_and_loads_with_moelab(tmp_path):
    model = moelab.from_hf(_tiny_causal_lm("mixtral"), method="xmoe")
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    moelab.save(model, tmp_path / "m")
    back = moelab.load(tmp_path / "m")
    assert [m.method for m in moelab.layer.moe_layers(back)] == ["xmoe", "xmoe"]
    with torch.no_grad():
        torch.testing.assert_close(back.double()(ids).logits, model.eval()(ids).logits)


def test_output_router_logits_on_a_converted_model_called_directly_is_refused_in_one_line():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=50, hidden_size=D, intermediate_size=H, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    model = from_hf(MixtralForCausalLM(cfg))
    ids = torch.randint(0, 50, (1, 5))
    with pytest.raises(ValueError, match=r"^output_router_logits=True is not allowed on a model with moelab"):
        model(ids, output_router_logits=True)
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="output_router_logits=True is not allowed"):
        model(ids)
    model.config.output_router_logits = False
    assert model(ids).logits.shape == (1, 5, 50)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("kind", ["mixtral", "deepseek"])
def test_to_hf_exports_in_the_dtype_the_model_was_cast_to_after_conversion(kind, dtype, tmp_path):
    from safetensors import safe_open

    model = moelab.from_hf(_tiny_causal_lm(kind).float())  # converted in float32
    model.to(dtype)  # then cast: the blocks must come back in the model's dtype, not float32
    layer = moelab.layer.moe_layers(model)[0]
    want = {"router": layer.router.weight.dtype, "experts": layer.experts.w_in.dtype}
    moelab.to_hf(model)
    block = model.model.layers[0].mlp
    assert block.gate.weight.dtype == want["router"] == dtype
    assert all(p.dtype == dtype for p in block.experts.parameters())
    if kind == "deepseek":  # its selection bias stays at least float32, in moelab and in transformers alike
        bias = block.gate.e_score_correction_bias
        assert bias.dtype == (torch.float32 if dtype == torch.bfloat16 else dtype)
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits  # raised "expected m1 and m2 to have the same dtype" when mixed
    assert logits.dtype == dtype
    model.save_pretrained(tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    for name, p in model.named_parameters():  # no silent float64 → float32 rounding on disk
        if name in saved:
            assert saved[name].dtype == p.dtype and torch.equal(saved[name], p.detach()), name


def test_to_hf_refuses_a_block_tensor_that_no_moelab_tensor_restores():
    layer = from_hf(_block("mixtral"))
    layer._hf_block.register_buffer("calibration", torch.empty(3, device="meta"))  # unknown to the plan
    with pytest.raises(ValueError, match=r"MixtralSparseMoeBlock.calibration has no moelab counterpart"):
        moelab.to_hf(layer)


def test_moelab_load_keeps_the_attention_implementation_so_logits_come_back_bit_exact(tmp_path):
    import hashlib
    import json

    from moelab.io.model import _canonical

    model = _tiny_causal_lm("mixtral")
    model.config._attn_implementation = "eager"  # not the default (sdpa): it moves the logits by ~1e-7
    moelab.from_hf(model)
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.eval()(ids).logits
    moelab.save(model, tmp_path / "m")
    back = moelab.load(tmp_path / "m")
    assert back.config._attn_implementation == "eager"
    assert back.config._experts_implementation == model.config._experts_implementation
    with torch.no_grad():
        assert torch.equal(back(ids).logits, expected)
    # saved with kernels this machine cannot build: loaded with the defaults, and said so
    file = tmp_path / "m" / "config.json"
    config = json.loads(file.read_text())
    config["config"]["attn_implementation"] = "flash_attention_2"
    config.pop("sha256")
    config["sha256"] = hashlib.sha256(_canonical(config)).hexdigest()
    file.write_text(json.dumps(config))
    with pytest.warns(UserWarning, match=r"was saved with \{'attn_implementation': 'flash_attention_2'.*"
                      r"loaded with transformers' default kernels instead"):  # fmt: skip
        moelab.load(tmp_path / "m")


def test_smoe_sg_of_a_sigmoid_block_without_bias_goes_back_to_transformers():
    lfm2 = pytest.importorskip("transformers.models.lfm2_moe.modeling_lfm2_moe")
    cfg = lfm2.Lfm2MoeConfig(
        hidden_size=D,
        moe_intermediate_size=H,
        num_experts=N,
        num_experts_per_tok=K,
        use_expert_bias=False,
        norm_topk_prob=True,
    )
    cfg._experts_implementation = "eager"
    block = lfm2.Lfm2MoeSparseMoeBlock(cfg).double()
    _randomize(block, 0)
    block.eval()
    x = torch.randn(3, 5, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = block(x.clone())
    layer = from_hf(block, method="smoe-sg")
    assert layer.method == "smoe-sg" and layer.shared is None
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)  # its router rounds in float32
        layer.experts.w_out.mul_(1.5)  # a "fine-tuned" change travels back
        tuned = layer(x)
    back = moelab.to_hf(layer)
    with torch.no_grad():
        torch.testing.assert_close(back(x.clone()), tuned, rtol=1e-5, atol=1e-6)
    assert type(back) is type(block)
    refused = from_hf(block, method="smoe-sg", normalize=False)
    with pytest.raises(ValueError, match=r"router options \{'normalize': False\} differ"):
        moelab.to_hf(refused)


def _flint_block():
    from hf_families import families, tiny_block

    fam, cls = next((f, c) for f, c in families() if c.__name__ == "FlintSparseMoeBlock")
    return tiny_block(fam, cls)


@pytest.mark.parametrize("make", [lambda: _block("mixtral"), _flint_block], ids=["mixtral", "flint"])
def test_set_method_to_the_layers_own_method_changes_nothing(make):
    import warnings

    block = make()
    layer = from_hf(block)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    coefs, config = dict(layer.coefs), layer.config
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to announce either
        moelab.set_method(layer, layer.method)
    assert layer.coefs == coefs and layer.config == config  # Mixtral's z-loss stayed off
    assert layer.state_dict().keys() == state.keys()  # Flint got no selection bias
    assert all(torch.equal(layer.state_dict()[k], v) for k, v in state.items())
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(1), dtype=block.experts.down_proj.dtype)
    with torch.no_grad():
        assert torch.equal(moelab.to_hf(layer)(x.clone())[0], block(x.clone())[0])  # not refused


def test_a_sigmoid_block_without_selection_bias_keeps_none_in_another_method():
    layer = from_hf(_flint_block(), method="competesmoe")  # its base: sharede-v3's rule, no bias
    assert layer.router.base_method == "sharede-v3" and layer.router.base.selection_bias is None
    layer = from_hf(_flint_block())
    with pytest.warns(UserWarning) as record:
        moelab.set_method(layer, "smoe")
    assert not any("selection_bias" in str(w.message) for w in record)  # nothing to drop


def test_set_method_after_attach_keeps_the_context_and_steps_the_new_router():
    torch.manual_seed(0)
    model = nn.Sequential(moelab.MoE(D, N, K), moelab.MoE(D, N, K))
    ctx = moelab.routing_context(model, total_steps=30)
    with pytest.warns(UserWarning, match=r"initialises router tensors .* afresh: selection_bias"):
        moelab.set_method(model, "sharede-v3")
    layers = moelab.layer.moe_layers(model)
    assert all(m.ctx is ctx for m in layers) and [m.layer_index for m in layers] == [0, 1]
    assert len(ctx.hooks) == 2 and {h.__self__ for h in ctx.hooks} == {m.router for m in layers}
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, D, generator=torch.Generator().manual_seed(0))
    model.train()
    for _ in range(30):
        (model(x).pow(2).mean() + moelab.aux_loss(model)).backward()
        opt.step()
        opt.zero_grad()
        ctx.advance()
    assert all(m.router.selection_bias.abs().sum() > 0 for m in layers)  # was 0.0: no hook ran


def test_set_method_says_which_router_tensors_it_initialises_afresh_and_keeps_a_familys_own():
    torch.manual_seed(0)
    layer = moelab.MoE(D, N, K, method="smoe")
    with pytest.warns(UserWarning, match=r"initialises router tensors .* afresh: embeddings, temperature, "
                      r"proj.weight \(layers \[0\]\); the routing differs"):  # fmt: skip
        moelab.set_method(layer, "xmoe")
    with torch.no_grad():
        layer.router.proj.weight.mul_(2.0)  # "trained"
    proj, emb = layer.router.proj.weight.clone(), layer.router.embeddings.clone()
    with pytest.warns(
        UserWarning, match=r"afresh: temperature \(layers \[0\]\)"
    ):  # xmoe learns it, pcosine not
        moelab.set_method(layer, "pcosine")
    assert torch.equal(layer.router.proj.weight, proj) and torch.equal(layer.router.embeddings, emb)
    x = torch.randn(5, D)
    before = layer.eval()(x)
    moelab.set_method(layer, "pcosine", perturbation=0.1)  # its own method, its own value: nothing new
    assert torch.equal(layer(x), before)


def test_set_method_announces_the_loss_coefficients_it_changes():
    import warnings

    layer = from_hf(_block("mixtral"))  # router_aux_loss_coef 0.001, no z-loss
    assert layer.coefs == {"balance": 0.001}
    with pytest.warns(
        UserWarning,
        match=r"changes the loss coefficients to the method's preset: \{'balance': 0.001\} -> "
        r"\{'balance': 0.01, 'z': 0.001\} \(layers \[0\]\); pass <loss>_coef options to set them",
    ):
        moelab.set_method(layer, "xmoe")
    with pytest.warns(
        UserWarning, match=r"\{'balance': 0.01, 'z': 0.001\} -> \{'entropy': 0.001, 'z': 0.001\}"
    ):
        moelab.set_method(layer, "sigma-moe", z_coef=0.001)  # the entropy term is the preset's
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # back, with the coefficients asked for: nothing to announce
        moelab.set_method(layer, "smoe", balance_coef=0.001, z_coef=0.0, entropy_coef=0.0)
    assert layer.coefs == {"balance": 0.001}
    moelab.set_method(layer, "smoe", renormalize=True)  # the same method keeps them, zeros included
    assert layer.coefs == {"balance": 0.001}


def test_set_method_keeps_the_layers_balance_scope():
    layer = moelab.MoE(8, 4, 2, method="smoe", balance_scope="sequence")
    moelab.set_method(layer, "xmoe")
    assert layer.balance_scope == "sequence" and layer.config.options["balance_scope"] == "sequence"
    moelab.set_method(layer, "smoe", balance_scope="global")
    assert layer.balance_scope == "global"


def _tiny_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=50,
        hidden_size=D,
        intermediate_size=H,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg).double().eval()
    _randomize(model, 3)
    return from_hf(model)


def test_a_cached_decoding_step_masks_the_new_tokens_by_the_last_columns_of_the_attention_mask():
    model = _tiny_mixtral()
    ids = torch.randint(1, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0  # left padding, as generate() pads
    step = torch.randint(1, 50, (2, 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(
            input_ids=torch.cat([ids, step], 1), attention_mask=torch.cat([mask, mask[:, :1] * 0 + 1], 1)
        )
        first = model(input_ids=ids, attention_mask=mask, use_cache=True)
        nxt = model(
            input_ids=step,
            attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1),
            past_key_values=first.past_key_values,
        )
    torch.testing.assert_close(nxt.logits[:, -1], full.logits[:, -1], rtol=0, atol=1e-10)


def test_an_attention_mask_shorter_than_the_input_ids_is_refused_in_one_line():
    model = _tiny_mixtral()
    with pytest.raises(ValueError, match=r"attention_mask of shape \(2, 3\) is not allowed for 5 positions"):
        model(input_ids=torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 3, dtype=torch.long))
