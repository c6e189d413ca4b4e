"""Every MoE family of the installed transformers, built tiny (helpers of test_hf_convert_families.py).

A family's MoE block is found by its parts (a class of ``modeling_<family>.py`` that assigns
``self.experts``); its config class is the one of ``configuration_<family>.py`` whose name shares
the longest prefix with the block's; the config is shrunk by setting the size attributes it has.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re

import torch
from torch import nn

D, H, N, K = 16, 8, 8, 2

TINY = {
    "hidden_size": D,
    "intermediate_size": H,
    "moe_intermediate_size": H,
    "expert_ffn_hidden_size": H,
    "ffn_hidden_size": H,
    "shared_expert_intermediate_size": 12,
    "moe_shared_expert_intermediate_size": 12,
    "num_experts": N,
    "n_routed_experts": N,
    "num_local_experts": N,
    "moe_num_experts": N,
    "num_experts_per_tok": K,
    "moe_topk": K,
    "top_k_experts": K,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "moe_latent_size": None,
    "router_jitter_noise": 0.0,
    "input_jitter_noise": 0.0,
    "router_hidden_size": 8,
    "enable_moe_block": True,
    "num_expert": 4,  # ViTPose's per-dataset experts
    "part_features": 8,
}

#: config classes the name heuristic would not pick
CONFIGS = {
    "DbrxFFN": "DbrxConfig",
    "Qwen3OmniMoeThinkerTextSparseMoeBlock": "Qwen3OmniMoeTextConfig",
}


def families() -> list[tuple[str, type]]:
    """``(family, block class)`` for every MoE block class of the installed transformers."""
    import transformers.models as tm

    base = os.path.dirname(tm.__file__)
    out = []
    for fam in sorted(os.listdir(base)):
        path = os.path.join(base, fam, f"modeling_{fam}.py")
        if not os.path.isfile(path) or "self.experts =" not in open(path, encoding="utf-8").read():
            continue
        try:
            mod = importlib.import_module(f"transformers.models.{fam}.modeling_{fam}")
        except Exception:  # an optional dependency missing
            continue
        for cls in vars(mod).values():
            if inspect.isclass(cls) and issubclass(cls, nn.Module) and cls.__module__ == mod.__name__:
                try:
                    src = inspect.getsource(cls.__init__)
                except (OSError, TypeError):
                    continue
                if re.search(r"self\.experts\s*=", src):
                    out.append((fam, cls))
    return out


def _config_class(fam: str, block_cls: type):
    from transformers import PretrainedConfig

    mod = importlib.import_module(f"transformers.models.{fam}.configuration_{fam}")
    configs = [
        c
        for c in vars(mod).values()
        if inspect.isclass(c) and issubclass(c, PretrainedConfig) and c.__module__ == mod.__name__
    ]

    def score(c):
        a, b = c.__name__.removesuffix("Config"), block_cls.__name__
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return (n, "Text" in c.__name__)

    if block_cls.__name__ in CONFIGS:
        return getattr(mod, CONFIGS[block_cls.__name__])
    return max(configs, key=score)


def tiny_block(fam: str, block_cls: type, seed: int = 0) -> nn.Module:
    """The block of ``fam`` at tiny sizes, float64, random weights, a non-trivial selection bias."""
    cfg = _config_class(fam, block_cls)()
    for key, value in TINY.items():
        try:
            if hasattr(cfg, key):
                setattr(cfg, key, value)
        except Exception:  # a per-layer or typed attribute: keep the default
            pass
    if not hasattr(cfg, "shared_expert_intermediate_size"):
        cfg.shared_expert_intermediate_size = 12
    for sub in ("text_config", "ffn_config"):
        sub_cfg = getattr(cfg, sub, None)
        for key, value in TINY.items():
            try:
                if sub_cfg is not None and hasattr(sub_cfg, key):
                    setattr(sub_cfg, key, value)
            except Exception:
                pass
    params = inspect.signature(block_cls.__init__).parameters
    kwargs = {}
    for name in list(params)[2:]:
        if name == "layer_idx":
            kwargs[name] = 1
        elif name in ("intermediate_size", "ffn_dim"):
            kwargs[name] = H
        elif params[name].kind is inspect.Parameter.VAR_KEYWORD:
            continue
        elif params[name].default is inspect.Parameter.empty:
            raise TypeError(f"{block_cls.__name__} needs {name}")
    torch.manual_seed(seed)
    block = block_cls(cfg, **kwargs).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
        for name, b in block.named_buffers():
            if name.split(".")[-1] in ("e_score_correction_bias", "expert_bias") and b.is_floating_point():
                b.copy_(torch.linspace(-0.2, 0.2, b.numel(), dtype=b.dtype).view(b.shape))
            if name.split(".")[-1] == "tid2eid":  # a hash router's token id → experts table (DeepSeek-V4)
                rows, k = b.shape
                b.copy_(torch.rand(rows, N, generator=g).argsort(dim=1)[:, :k])
    return block.eval()


#: whole models of converted families that build at the tiny sizes: the padding-mask tests
MODELS = (
    "AfmoeForCausalLM",
    "Dots1ForCausalLM",
    "ExaoneMoeForCausalLM",
    "FlexOlmoForCausalLM",
    "FlintForCausalLM",
    "Glm4MoeForCausalLM",
    "GraniteMoeForCausalLM",
    "GraniteMoeSharedForCausalLM",
    "HunYuanMoEV1ForCausalLM",
    "LagunaForCausalLM",
    "MellumForCausalLM",
    "MiMoV2FlashForCausalLM",
    "MiniMaxForCausalLM",
    "MiniMaxM2ForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "SolarOpenForCausalLM",
)
VOCAB = 64
MODEL_SIZES = {
    "num_hidden_layers": 2,
    "vocab_size": VOCAB,
    "first_k_dense_replace": 0,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "mlp_only_layers": [],
    "decoder_sparse_step": 1,
}


def tiny_model(name: str, seed: int = 0) -> nn.Module:
    """The transformers model class ``name`` at tiny sizes (two MoE decoder layers), float64, random weights."""
    import transformers

    cls = getattr(transformers, name)
    cfg = cls.config_class()
    for key, value in {**TINY, **MODEL_SIZES}.items():
        try:
            if hasattr(cfg, key):
                setattr(cfg, key, value)
        except Exception:  # a typed attribute: keep the default
            pass
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[: cfg.num_hidden_layers]
    torch.manual_seed(seed)
    model = cls(cfg).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return model


# the table of docs/scaling-hf.md: PYTHONPATH=src:tests python tests/hf_families.py
if __name__ == "__main__":
    import moelab

    print("| family | block | converts to | block output max abs diff (float64) | refused because |")
    print("|---|---|---|---|---|")
    for fam, cls in families():
        block = tiny_block(fam, cls)
        x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        try:
            layer = moelab.from_hf(block)
        except ValueError as e:
            why = str(e).split("from_hf: ", 1)[1].replace("|", "/")
            why = why if len(why) <= 160 else why[:157] + "..."
            print(f"| {fam} | `{cls.__name__}` | — | — | {why} |")
            continue
        ids = {}  # the token ids, for a block that routes by them (DeepSeek-V4's hash layers)
        if "input_ids" in inspect.signature(block.forward).parameters:
            ids = {"input_ids": torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(2))}
        with torch.no_grad():
            ref = block(x.clone(), **ids)
            ref = ref[0] if isinstance(ref, tuple) else ref
            diff = (layer(x, **ids) - ref).abs().max().item()
        print(f"| {fam} | `{cls.__name__}` | `{layer.method}` | {diff:.1e} | |")
