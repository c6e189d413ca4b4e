import pytest
import torch

import moelab
from moelab import prune
from moelab.layer import moe_layers
from moelab.models.lm import LMConfig, TransformerLM


def _lm(
    method: str = "smoe", num_experts: int = 8, top_k: int = 2, seed: int = 0, **options
) -> TransformerLM:
    torch.manual_seed(seed)
    cfg = LMConfig(vocab_size=50, block_size=16, n_layer=2, d_model=16, n_head=2, method=method,
                   num_experts=num_experts, top_k=top_k, dropout=0.0, method_options=options)  # fmt: skip
    return TransformerLM(cfg).eval()


def _ids(seed: int = 1, batch: int = 4) -> torch.Tensor:
    return torch.randint(0, 50, (batch, 16), generator=torch.Generator().manual_seed(seed))


def _layer(method: str, n: int = 8, k: int = 2, seed: int = 0, **options) -> moelab.MoE:
    torch.manual_seed(seed)
    layer = moelab.MoE(16, n, k, d_hidden=12, method=method, **options).eval()
    router = layer.router.base_router
    for name in (
        "selection_bias",
        *router.expert_tensors,
    ):  # trained state (β of quantile balancing), not zeros
        buffer = router._buffers.get(name)
        if buffer is not None:
            buffer.copy_(torch.linspace(-0.05, 0.05, buffer.numel()).flip(0))
    return layer


# ------------------------------------------------------------------ the statistics
def test_reap_saliency_equals_a_literal_per_token_computation():
    model = _lm("sharede-v3")
    for layer in moe_layers(model):
        layer.router.selection_bias.copy_(torch.linspace(-0.1, 0.1, 8))
    batches = [_ids(1), _ids(2)]
    stats = prune.expert_statistics(model, batches)
    # the literal: every token of every batch, every slot, one at a time
    inputs, routings = {}, {}
    layers = dict(model.named_modules())
    paths = [p for p, m in layers.items() if isinstance(m, moelab.MoE)]
    sums = {p: [[0.0] * 8, [0] * 8] for p in paths}
    for batch in batches:
        hooks = [
            layers[p].register_forward_pre_hook(lambda m, a, p=p: inputs.__setitem__(p, a[0])) for p in paths
        ]
        with moelab.recording_routing(model), torch.no_grad():
            model(batch)
            for p in paths:
                routings[p] = layers[p].last_routing
        for h in hooks:
            h.remove()
        for p in paths:
            x = inputs[p].reshape(-1, 16)
            r = routings[p]
            for t in range(x.shape[0]):
                for k in range(r.indices.shape[1]):
                    e = int(r.indices[t, k])
                    with torch.no_grad():  # expert e of the bank: W_out relu(W_in x), no biases
                        w_in, w_out = layers[p].experts.w_in[e].double(), layers[p].experts.w_out[e].double()
                        out = w_out @ torch.relu(w_in @ x[t].double())
                    sums[p][0][e] += float(r.weights[t, k]) * float(out.norm())
                    sums[p][1][e] += 1
    for p in paths:
        counts = torch.tensor(sums[p][1], dtype=torch.float64)
        want = torch.tensor([s / c if c else 0.0 for s, c in zip(*sums[p], strict=True)], dtype=torch.float64)
        assert torch.equal(stats[p].counts, counts)
        assert torch.allclose(stats[p].reap, want, rtol=1e-6, atol=1e-9)  # float32 expert outputs
        assert stats[p].tokens == 2 * 4 * 16


def test_an_expert_no_token_is_routed_to_scores_zero_as_in_reap():
    model = _lm("smoe", selection_bias=True)
    layer = moe_layers(model)[0]
    layer.router.selection_bias[3] = -1e3  # never chosen
    stats = prune.expert_statistics(model, [_ids(1)])
    s = stats["blocks.0.ffn"]
    assert s.counts[3] == 0 and s.reap[3] == 0 and (s.reap[s.counts > 0] > 0).all()


def test_choose_experts_keeps_the_highest_scores_in_index_order():
    s = prune.ExpertStatistics(
        counts=torch.tensor([5.0, 1.0, 9.0, 0.0]),
        reap=torch.tensor([0.1, 0.7, 0.2, 0.0]),
        logit_gram=None,
        tokens=8,
    )
    assert prune.choose_experts({"l": s}, "reap", 0.5)["l"].tolist() == [1, 2]
    assert prune.choose_experts({"l": s}, "frequency", 0.5)["l"].tolist() == [0, 2]
    a = prune.choose_experts(None, "random", 0.5, num_experts={"l": 4}, seed=3)["l"]
    assert a.tolist() == prune.choose_experts(None, "random", 0.5, num_experts={"l": 4}, seed=3)["l"].tolist()
    assert a.numel() == 2 and a.tolist() == sorted(a.tolist())


# ------------------------------------------------------------------ consistency
METHODS = ["smoe", "sharede-v3", "sharede-v2", "xmoe", "stablemoe", "hyperrouter", "remoe", "smoe-sg",
           "sigma-moe", "quantile-balancing", "deepseek-v4", "competesmoe", "competition"]  # fmt: skip


@pytest.mark.parametrize("method", METHODS)
def test_a_token_whose_experts_are_all_kept_routes_and_outputs_identically(method):
    layer = _layer(method)
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(0))
    keep = torch.tensor([0, 1, 2, 4, 5, 7])
    small = prune.shrink(layer, {"": keep})
    assert small.config.num_experts == 6 and small.router.num_experts == 6
    with moelab.recording_routing(layer), moelab.recording_routing(small), torch.no_grad():
        y, y2 = layer(x), small(x)
        before, after = layer.last_routing, small.last_routing
    mapped = torch.full((8,), -1, dtype=torch.int64)
    mapped[keep] = torch.arange(6)
    active = before.mask if before.mask is not None else torch.ones_like(before.indices, dtype=torch.bool)
    inside = (mapped[before.indices].ge(0) | ~active).all(dim=1)
    assert inside.sum() >= 20  # enough tokens to compare
    for t in inside.nonzero().flatten().tolist():
        a = active[t]
        got = after.indices[t][after.mask[t]] if after.mask is not None else after.indices[t]
        assert got.tolist() == mapped[before.indices[t][a]].tolist()
    assert torch.allclose(y2[inside], y[inside], atol=1e-6, rtol=1e-5)


def test_pruning_keeps_shared_experts_and_the_selection_bias_rows():
    layer = _layer("sharede-v3")
    keep = torch.tensor([1, 3, 6, 7])
    small = prune.shrink(layer, {"": keep})
    assert torch.equal(small.router.selection_bias, layer.router.selection_bias[keep])
    assert torch.equal(small.router.weight, layer.router.weight[keep])
    assert torch.equal(small.experts.w_in, layer.experts.w_in[keep])
    for a, b in zip(small.shared.parameters(), layer.shared.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_pruned_lm_saves_and_loads_and_evaluates(tmp_path):
    model = _lm("xmoe")
    stats = prune.expert_statistics(model, [_ids(1)])
    small = prune.shrink(model, prune.choose_experts(stats, "reap", 0.5))
    assert isinstance(small, TransformerLM) and small.cfg.num_experts == 4
    moelab.save(small, tmp_path / "p")
    back = moelab.load(tmp_path / "p")
    with torch.no_grad():
        assert torch.equal(back(_ids(5)), small(_ids(5)))


# ------------------------------------------------------------------ merging
def test_merged_experts_are_the_literal_weighted_averages_of_their_groups():
    layer = _layer("smoe")
    group = torch.tensor([0, 0, 1, 2, 1, 1, 2, 0])
    counts = torch.tensor([3.0, 1.0, 0.0, 4.0, 0.0, 0.0, 4.0, 0.0])
    keep = torch.tensor([0, 2, 3])
    for method in ("average", "frequency"):
        c = prune.merge_coefficients(group, counts, method)
        small = prune.shrink(layer, {"": keep}, {"": c})
        w = layer.experts.w_in.detach().double()
        if method == "average":
            want = [(w[0] + w[1] + w[7]) / 3, (w[2] + w[4] + w[5]) / 3, (w[3] + w[6]) / 2]
        else:  # group 1 had no routed token: uniform
            want = [(3 * w[0] + 1 * w[1]) / 4, (w[2] + w[4] + w[5]) / 3, (4 * w[3] + 4 * w[6]) / 8]
        for g in range(3):
            assert torch.allclose(small.experts.w_in[g].double(), want[g], atol=1e-7)
        assert torch.equal(small.router.weight, layer.router.weight[keep])


def test_merge_groups_join_the_dominant_expert_with_the_most_similar_logits():
    gram = torch.tensor(
        [[1.0, 0.9, 0.0, 0.1], [0.9, 1.0, 0.2, 0.0], [0.0, 0.2, 1.0, 0.8], [0.1, 0.0, 0.8, 1.0]],
        dtype=torch.float64,
    )
    s = prune.ExpertStatistics(
        counts=torch.tensor([1.0, 9.0, 2.0, 8.0]), reap=torch.zeros(4), logit_gram=gram, tokens=4
    )
    dominant, group = prune.merge_groups({"l": s}, 0.5)["l"]
    assert dominant.tolist() == [1, 3] and group.tolist() == [0, 0, 1, 1]


# ------------------------------------------------------------------ HF export
def _tiny_transformers(family: str):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=50, hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, num_experts_per_tok=2)  # fmt: skip
    if family == "mixtral":
        cfg, cls = transformers.MixtralConfig(num_local_experts=6, **common), transformers.MixtralForCausalLM
    else:  # a shared expert with its sigmoid gate beside the routed ones
        cfg = transformers.Qwen2MoeConfig(num_experts=6, moe_intermediate_size=8, shared_expert_intermediate_size=12,
                                          norm_topk_prob=True, **common)  # fmt: skip
        cls = transformers.Qwen2MoeForCausalLM
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    return cls(cfg).double().eval(), cls


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_pruned_converted_transformers_model_exports_exactly(family, tmp_path):
    original, cls = _tiny_transformers(family)
    model = moelab.from_hf(original)
    ids = _ids(3, 2)
    stats = prune.expert_statistics(model, [ids])
    small = prune.shrink(model, prune.choose_experts(stats, "reap", 0.5)).eval()
    with torch.no_grad():
        ours = small(ids).logits
    key = "num_local_experts" if family == "mixtral" else "num_experts"
    assert getattr(small.config, key) == 3
    shared = [k for k in small.state_dict() if ".shared." in k]
    assert all(torch.equal(small.state_dict()[k], model.state_dict()[k]) for k in shared)
    assert bool(shared) == (family == "qwen2_moe")
    moelab.to_hf(small)
    with torch.no_grad():
        back = small(ids).logits
    assert (back - ours).abs().max().item() < 1e-6  # moelab's float32 router rounds, as from_hf's round trip
    small.save_pretrained(tmp_path / "hf")
    plain = cls.from_pretrained(tmp_path / "hf", dtype=torch.float64, experts_implementation="eager").eval()
    assert getattr(plain.config, key) == 3
    with torch.no_grad():
        assert (plain(ids).logits - back).abs().max().item() < 1e-12  # nothing re-initialised


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    "method, options, message",
    [
        ("top-p", {}, r"top-p takes experts until their softmax probability over all N experts reaches p"),
        ("expert-choice", {}, r"expert-choice weighs by the softmax over all N experts"),
        ("expert-threshold", {}, r"expert-threshold weighs by the softmax over all N experts"),
        (
            "smoe",
            {"renormalize": False},
            r"its weights are the softmax over all N experts \(renormalize=False\)",
        ),
        ("sharede-v3", {"num_groups": 2}, r"its experts form num_groups=2 groups"),
        (
            "deepseek-v4",
            {"hash_layers": 1, "vocab_size": 50},
            r"its first hash_layers=1 layers route by a token id",
        ),
        ("moepp", {}, r"its two-layer gate's hidden width is 8·M"),
        ("smoe", {"eval_k": 6}, r"its eval_k=6 exceeds the 4 kept experts"),
    ],
)
def test_a_router_whose_rule_reads_every_expert_is_refused_naming_why(method, options, message):
    layer = _layer(method, **options)
    with pytest.raises(ValueError, match=rf"the layer \(method='{method}'\) cannot lose experts: {message}"):
        prune.shrink(layer, {"": torch.tensor([0, 1, 2, 3])})


def test_keeping_fewer_experts_than_top_k_is_refused():
    with pytest.raises(ValueError, match=r"keep leaves 1 experts in the layer, fewer than its top_k=2"):
        prune.shrink(_layer("smoe"), {"": torch.tensor([3])})


def test_bad_keep_arguments_are_refused_in_one_line():
    with pytest.raises(
        ValueError, match=r"keep=1.5 is not allowed; expected a fraction of the experts in \(0, 1\]"
    ):
        prune.kept_count(8, 1.5)
    with pytest.raises(ValueError, match=r"keep=0.01 is not allowed for num_experts=8; it keeps no expert"):
        prune.kept_count(8, 0.01)
    with pytest.raises(ValueError, match=r"keep\[''\]=\[0, 0\] is not allowed; expected distinct int64"):
        prune.shrink(_layer("smoe"), {"": torch.tensor([0, 0])})
    with pytest.raises(ValueError, match=r"method='magnitude' is not allowed; expected one of \['reap'"):
        prune.choose_experts(None, "magnitude", 0.5)
    with pytest.raises(
        ValueError, match=r"method='ties' is not allowed; expected one of \['average', 'frequency'\]"
    ):
        prune.merge_coefficients(torch.tensor([0, 0]), torch.ones(2), "ties")
    with pytest.raises(ValueError, match=r"keep names layers \['x'\] that are not MoE layers"):
        prune.shrink(_layer("smoe"), {"": torch.tensor([0, 1]), "x": torch.tensor([0])})
    with pytest.raises(ValueError, match=r"holds no moelab MoE layer; nothing to prune"):
        prune.expert_statistics(torch.nn.Linear(2, 2), [torch.zeros(1, 2)])


def test_merging_a_router_without_logits_is_refused():
    layer = _layer("competition")
    stats = prune.expert_statistics(layer, [torch.randn(32, 16)])
    with pytest.raises(
        ValueError, match=r"the layer has a router without logits; merging groups the experts"
    ):
        prune.merge_groups(stats, 0.5)


def test_a_bank_that_is_not_an_expert_bank_is_refused():
    from moelab.experts import ModuleExperts

    experts = ModuleExperts([torch.nn.Linear(16, 16) for _ in range(4)])
    layer = moelab.MoE(16, 4, 2, experts=experts)
    with pytest.raises(ValueError, match=r"has experts of type ModuleExperts; expected an ExpertBank"):
        prune.expert_statistics(layer, [torch.randn(8, 16)])


# ------------------------------------------------------------------ the commands
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from moelab.cli import main

    root = tmp_path_factory.mktemp("prune")
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(400)))
    out = root / "lm"
    args = ["train", "--data", str(corpus), "--size", "cpu", "--block-size", "16", "--batch-size", "4",
            "--num-experts", "8", "--steps", "4", "--eval-every", "4", "--eval-tokens", "64",
            "--test-tokens", "64", "--no-progress", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    return out, corpus


def test_prune_and_merge_commands_write_runs_that_load_and_read_as_lm_runs(trained, tmp_path):
    from moelab.cli import main
    from moelab.experiments.finetune import read_lm_run

    run, corpus = trained
    common = ["--from", str(run), "--keep", "0.5", "--calib", str(corpus), "--calib-tokens", "256"]
    assert main(["prune", *common, "--method", "reap", "--out", str(tmp_path / "p")]) == 0
    assert main(["merge-experts", *common, "--method", "frequency", "--out", str(tmp_path / "m")]) == 0
    for out in ("p", "m"):
        model = moelab.load(tmp_path / out)
        assert isinstance(model, TransformerLM) and model.cfg.num_experts == 4
        config, tokenizer = read_lm_run(tmp_path / out)  # what `moelab eval` / `finetune` open
        assert config.num_experts == 4 and tokenizer is not None
    import json

    metrics = json.loads((tmp_path / "p" / "metrics.json").read_text())
    kept = metrics["kept"]["blocks.0.ffn"]
    reap = metrics["reap"]["blocks.0.ffn"]
    assert kept == sorted(sorted(range(8), key=lambda e: -reap[e])[:4])


def test_prune_command_refusals_are_one_line(trained, tmp_path, capsys):
    from moelab.cli import main

    run, _ = trained
    assert main(["prune", "--from", str(run), "--keep", "0.5", "--out", str(tmp_path / "a")]) == 2
    assert "--method 'reap' needs --calib (the calibration tokens)" in capsys.readouterr().err
    assert (
        main(
            ["prune", "--from", str(run), "--keep", "0.1", "--method", "random", "--out", str(tmp_path / "b")]
        )
        == 2
    )
    assert "keep leaves 1 experts in blocks.0.ffn, fewer than its top_k=2" in capsys.readouterr().err
    assert main(["prune", "--from", str(tmp_path / "nope"), "--keep", "0.5", "--method", "random",
                 "--out", str(tmp_path / "c")]) == 2  # fmt: skip
    assert "is not a folder; expected a moelab run or a transformers model" in capsys.readouterr().err
    tokens = tmp_path / "t.safetensors"
    from safetensors.torch import save_file

    save_file({"ids": torch.zeros(10, dtype=torch.int64)}, tokens)
    assert (
        main(
            [
                "prune",
                "--from",
                str(run),
                "--keep",
                "0.5",
                "--calib",
                str(tokens),
                "--out",
                str(tmp_path / "d"),
            ]
        )
        == 2
    )
    assert "holds no integer tensor 'tokens'" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "d").exists()  # refused before the folder opens


def test_prune_command_takes_a_transformers_folder_with_a_token_file(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from moelab.cli import main

    cfg = transformers.MixtralConfig(vocab_size=50, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                     num_experts_per_tok=2)  # fmt: skip
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    tokens = tmp_path / "tokens.safetensors"
    save_file({"tokens": torch.randint(0, 50, (2000,), generator=torch.Generator().manual_seed(0))}, tokens)
    base = [
        "prune",
        "--from",
        str(tmp_path / "hf"),
        "--keep",
        "0.5",
        "--block-size",
        "16",
        "--calib-tokens",
        "256",
    ]
    assert main([*base, "--calib", "stdlib", "--out", str(tmp_path / "x")]) == 2
    assert (
        "is a text dataset, which moelab cannot tokenize for a transformers model" in capsys.readouterr().err
    )
    assert main([*base, "--calib", str(tokens), "--out", str(tmp_path / "p")]) == 0
    model = moelab.load(tmp_path / "p")
    assert model.config.num_local_experts == 2 and moe_layers(model)[0].config.num_experts == 2
