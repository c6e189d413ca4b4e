"""Build a text-classification task from what ships with Python: 120-byte snippets of the standard
library's sources, labelled by the package they come from (asyncio, email, tkinter, unittest).

Used by the RepLoRA vs LoRA sample-efficiency experiment of docs/results.md (Ho (2025)):

    python examples/stdlib_packages_task.py runs/h29/stdlib_packages.csv

Writes ``text,label,split`` rows: per package 400 training and 200 test snippets, drawn with a fixed
seed from non-overlapping windows of the package's ``*.py`` files (blank-only windows skipped).
``moelab finetune --task FILE`` takes its own validation rows from the training split.
"""

from __future__ import annotations

import csv
import random
import sys
import sysconfig
from pathlib import Path

PACKAGES = ("asyncio", "email", "tkinter", "unittest")
WIDTH, TRAIN, TEST = 120, 400, 200


def snippets(package: str) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"]) / package
    out = []
    for path in sorted(root.rglob("*.py")):
        if "test" in path.relative_to(root).parts:  # unittest's own tests are code of another kind
            continue
        text = " ".join(path.read_text(encoding="utf-8", errors="replace").split())  # one line, one space
        out += [text[i : i + WIDTH] for i in range(0, len(text) - WIDTH, WIDTH)]
    return [s for s in out if s.strip()]


def main(path: str) -> None:
    rng = random.Random(0)
    rows = []
    for package in PACKAGES:
        chosen = rng.sample(snippets(package), TRAIN + TEST)
        rows += [(s, package, "train") for s in chosen[:TRAIN]] + [
            (s, package, "test") for s in chosen[TRAIN:]
        ]
    rng.shuffle(rows)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label", "split"])
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows ({len(PACKAGES)} classes) to {path}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "stdlib_packages.csv")
