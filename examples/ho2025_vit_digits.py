"""Active-Attention (Ho (2025)) vs standard attention on scikit-learn's digits: a small
:class:`moelab.models.vit.PatchTransformer` (2×2 patches of the 8×8 images, 16 patches) trained with
AdamW for a fixed number of full-batch-shuffled epochs; writes ``<out>/<name>/seed<s>/metrics.json``
with ``test_acc`` (percent) so that ``examples/ho2025_summary.py vit <out>`` summarises it.

    python examples/ho2025_vit_digits.py runs/h29/vit --seeds 0 1 2 3 4 --epochs 30
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from moelab.data.images import load_images
from moelab.models.vit import PatchTransformer, ViTConfig

NAMES = ("standard", "gelu", "tanh", "relu", "sigmoid", "silu")


def run(name: str, seed: int, epochs: int, batch: int, lr: float) -> dict[str, float]:
    data = load_images("digits")
    torch.manual_seed(seed)
    attn = {} if name == "standard" else {"attention": "active", "attention_activation": name}
    model = PatchTransformer(ViTConfig(image_size=8, patch_size=2, d_model=64, n_layer=2, n_head=4, **attn))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    steps = epochs * -(-len(data.y_train) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(data.y_train), generator=g)
        for i in range(0, len(perm), batch):
            idx = perm[i : i + batch]
            loss = F.cross_entropy(model(data.x_train[idx]), data.y_train[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    model.eval()
    with torch.no_grad():
        logits = model(data.x_test)
    acc = 100.0 * (logits.argmax(-1) == data.y_test).float().mean().item()
    return {"test_acc": acc, "test_loss": F.cross_entropy(logits, data.y_test).item(),
            "train_seconds": time.perf_counter() - t0}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--names", nargs="+", default=list(NAMES), choices=NAMES)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for seed in args.seeds:  # seeds outermost: a cut-off grid still has every arm at the same seeds
        for name in args.names:
            folder = Path(args.out) / name / f"seed{seed}"
            if (folder / "metrics.json").exists():
                continue
            m = run(name, seed, args.epochs, args.batch, args.lr)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "metrics.json").write_text(json.dumps(m))
            print(name, seed, json.dumps(m), flush=True)


if __name__ == "__main__":
    main()
