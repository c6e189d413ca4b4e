"""Text-classification data for fine-tuning (CompeteSMoE (2024) §6.3, Table 3 and App. C.3): SST-2,
SST-5, IMDB, BANKING77, or a local CSV/TSV of (text, label), each a :class:`ClassificationData`
with train / valid / test texts and integer labels; the validation split is a seeded 10% of the
training rows.  docs/data.md ("Text classification") gives the splits, the local file format and
the download rules.
"""

from __future__ import annotations

import csv
import io
import json
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .download import DataError, cache_dir, fetch, verified

__all__ = ["TASKS", "ClassificationData", "load_classification", "read_table", "subsample_train"]

TASKS = ("sst2", "sst5", "imdb", "banking77")

SOURCES = {
    "sst2": ["https://dl.fbaipublicfiles.com/glue/data/SST-2.zip"],
    "sst5": [
        "https://huggingface.co/datasets/SetFit/sst5/resolve/main/train.jsonl",
        "https://huggingface.co/datasets/SetFit/sst5/resolve/main/test.jsonl",
    ],
    "imdb": ["https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"],
    "banking77": [
        "https://raw.githubusercontent.com/PolyAI-LDN/task-specific-datasets/master/banking_data/train.csv",
        "https://raw.githubusercontent.com/PolyAI-LDN/task-specific-datasets/master/banking_data/test.csv",
    ],
}

#: sha256 of each downloaded file, as published with their sizes in the Hugging Face ``datasets``
#: library's dataset definitions (github.com/huggingface/datasets at commit 040102f1,
#: ``datasets/{glue,imdb,banking77}/dataset_infos.json``): SST-2.zip 7,439,277 bytes,
#: aclImdb_v1.tar.gz 84,125,825 bytes, BANKING77 train.csv 839,073 and test.csv 239,961 bytes.
#: SST-5 (SetFit's copy on the Hugging Face hub): no published digest found (None: the digest is
#: recorded on first use and verified afterwards).
SHA256: dict[str, str | None] = {
    "sst2/SST-2.zip": "d67e16fb55739c1b32cdce9877596db1c127dc322d93c082281f64057c16deaa",
    "sst5/train.jsonl": None,
    "sst5/test.jsonl": None,
    "imdb/aclImdb_v1.tar.gz": "c40f74a18d3b61f90feba1e17730e0d38e8b97c05fde7008942e91923d1658fe",
    "banking77/train.csv": "b06e26ac675513959a63135f11b94ea7786ed02da65db93a5650d8838cbc664b",
    "banking77/test.csv": "d12d6e3bc4c3103966ae786dc435913c0c563dfa328f5a3646d0e62cfeeb474d",
}

_TEXT_COLUMNS = ("text", "sentence", "review")
_LABEL_COLUMNS = ("label", "category")


@dataclass
class ClassificationData:
    name: str
    texts: dict[str, list[str]]  # split → texts
    labels: dict[str, list[int]]  # split → labels in 0..C-1
    label_names: list[str]

    @property
    def num_classes(self) -> int:
        return len(self.label_names)


def _permutation(n: int, seed: int = 0) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def _label_map(values: list[str]) -> list[str]:
    unique = sorted(set(values))
    if all(v.lstrip("-").isdigit() for v in unique):
        unique = sorted(unique, key=int)
    return unique


def _build(name: str, rows: dict[str, list[tuple[str, str]]]) -> ClassificationData:
    """Rows per split → data; a missing ``valid`` split takes 10% of ``train``."""
    if "valid" not in rows:
        train = rows["train"]
        perm = _permutation(len(train))
        n_valid = max(1, len(train) // 10)
        rows = {
            **rows,
            "valid": [train[i] for i in perm[:n_valid]],
            "train": [train[i] for i in perm[n_valid:]],
        }
    names = _label_map([label for split in rows.values() for _, label in split])
    index = {n: i for i, n in enumerate(names)}
    if len(names) < 2:
        raise ValueError(f"{name}: found {len(names)} distinct label(s); classification needs at least 2")
    for split in ("train", "valid", "test"):
        if not rows.get(split):
            raise ValueError(f"{name}: the {split} split is empty; add rows (or a split column)")
    return ClassificationData(
        name,
        {s: [t for t, _ in r] for s, r in rows.items()},
        {s: [index[label] for _, label in r] for s, r in rows.items()},
        names,
    )


def read_table(path: str | Path) -> ClassificationData:
    """A local CSV/TSV of (text, label) rows (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--task {str(path)!r} is neither a task ({', '.join(TASKS)}) nor a file")
    try:
        content = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--task {str(path)!r} cannot be read as UTF-8 text: {exc}") from None
    delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    table = [r for r in csv.reader(io.StringIO(content), delimiter=delimiter) if r]
    if not table:
        raise ValueError(f"--task {str(path)!r} holds no rows")
    header = [c.strip().lower() for c in table[0]]
    text_col = next((header.index(c) for c in _TEXT_COLUMNS if c in header), None)
    label_col = next((header.index(c) for c in _LABEL_COLUMNS if c in header), None)
    split_col = header.index("split") if "split" in header else None
    if text_col is not None and label_col is not None:
        body = table[1:]
    else:
        text_col, label_col, split_col, body = 0, 1, None, table
    rows: dict[str, list[tuple[str, str]]] = {}
    width = max(text_col, label_col, split_col or 0) + 1
    for i, r in enumerate(body, 2 if body is not table else 1):
        if len(r) < width:
            raise ValueError(
                f"--task {str(path)!r}: row {i} has {len(r)} column(s), expected at least {width}"
            )
        split = r[split_col].strip().lower() if split_col is not None else "all"
        split = {"validation": "valid", "dev": "valid", "val": "valid"}.get(split, split)
        if split not in ("train", "valid", "test", "all"):
            raise ValueError(
                f"--task {str(path)!r}: row {i} has split {split!r}; expected train, valid or test"
            )
        rows.setdefault(split, []).append((r[text_col], r[label_col].strip()))
    if "all" in rows:
        data = rows.pop("all")
        perm = _permutation(len(data))
        n_test = n_valid = max(1, len(data) // 10)
        rows.setdefault("test", []).extend(data[i] for i in perm[:n_test])
        rows.setdefault("valid", []).extend(data[i] for i in perm[n_test : n_test + n_valid])
        rows.setdefault("train", []).extend(data[i] for i in perm[n_test + n_valid :])
    return _build(path.stem, rows)


def _sst2() -> ClassificationData:
    archive = fetch("SST-2.zip", SOURCES["sst2"], SHA256["sst2/SST-2.zip"], subdir="sst2")
    verified(archive)
    with zipfile.ZipFile(archive) as zf:
        read = lambda n: list(csv.reader(io.StringIO(zf.read(f"SST-2/{n}").decode()), delimiter="\t"))[1:]
        rows = {
            "train": [(r[0], r[1]) for r in read("train.tsv")],
            "test": [(r[0], r[1]) for r in read("dev.tsv")],
        }
    return _build("sst2", rows)


def _sst5() -> ClassificationData:
    rows = {}
    for url, split in zip(SOURCES["sst5"], ("train", "test")):
        path = verified(fetch(f"{split}.jsonl", [url], SHA256[f"sst5/{split}.jsonl"], subdir="sst5"))
        items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows[split] = [(it["text"], str(it["label"])) for it in items]
    return _build("sst5", rows)


def _imdb() -> ClassificationData:
    root = cache_dir() / "imdb"
    parsed = root / "imdb.json"
    if not parsed.exists():
        archive = verified(
            fetch("aclImdb_v1.tar.gz", SOURCES["imdb"], SHA256["imdb/aclImdb_v1.tar.gz"], subdir="imdb")
        )
        rows: dict[str, list[tuple[str, str]]] = {"train": [], "test": []}
        with tarfile.open(archive) as tf:
            for member in tf:
                parts = member.name.split("/")
                if member.isfile() and len(parts) == 4 and parts[1] in rows and parts[2] in ("pos", "neg"):
                    text = tf.extractfile(member).read().decode("utf-8", errors="replace")
                    rows[parts[1]].append((text, parts[2]))
        for split in rows:
            rows[split].sort(key=lambda r: (r[1], r[0]))  # archive order is not guaranteed
        parsed.write_text(json.dumps(rows))
    return _build("imdb", {k: [tuple(r) for r in v] for k, v in json.loads(parsed.read_text()).items()})


def _banking77() -> ClassificationData:
    rows = {}
    for url, split in zip(SOURCES["banking77"], ("train", "test")):
        path = verified(fetch(f"{split}.csv", [url], SHA256[f"banking77/{split}.csv"], subdir="banking77"))
        table = list(csv.reader(io.StringIO(path.read_text(encoding="utf-8"))))[1:]
        rows[split] = [(r[0], r[1]) for r in table if len(r) >= 2]
    return _build("banking77", rows)


def load_classification(task: str) -> ClassificationData:
    """``sst2``, ``sst5``, ``imdb``, ``banking77`` (downloaded once) or a local CSV/TSV path."""
    loaders = {"sst2": _sst2, "sst5": _sst5, "imdb": _imdb, "banking77": _banking77}
    if task in loaders:
        try:
            return loaders[task]()
        except (zipfile.BadZipFile, tarfile.TarError, KeyError, json.JSONDecodeError) as exc:
            raise DataError(
                f"{task}: the downloaded file is not in the expected format ({exc}); delete "
                f"{cache_dir() / task} and run again"
            ) from None
    return read_table(task)


def subsample_train(data: ClassificationData, fraction: float, seed: int = 0) -> ClassificationData:
    """``data`` with a seeded ``fraction`` of its training rows (at least one; the order kept),
    validation and test untouched: the sample-efficiency curves of Ho (2025) (RepLoRA)."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction!r} is not allowed; expected a number in (0, 1]")
    n = len(data.labels["train"])
    keep = sorted(_permutation(n, seed)[: max(1, round(fraction * n))])
    texts = {**data.texts, "train": [data.texts["train"][i] for i in keep]}
    labels = {**data.labels, "train": [data.labels["train"][i] for i in keep]}
    return ClassificationData(data.name, texts, labels, data.label_names)
