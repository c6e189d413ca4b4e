"""Text corpora for language modelling: enwik8, text8, WikiText-103, a local file, and the Python
standard library's sources as offline corpora (``default``, ``stdlib``).  Every corpus becomes a
:class:`TextData` (train / valid / test token tensors split in order, a byte, character or word
tokenizer, and the metric the papers report, BPC or perplexity); downloads are cached, pinned by
sha256 where a digest is published and verified on every use.  docs/data.md ("Text corpora") gives
the splits, the offline corpora and the download checks.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import warnings
import zipfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..io.atomic import atomic_write_torch
from .download import DataError, cache_dir, fetch, verified

__all__ = [
    "CORPORA",
    "ByteTokenizer",
    "CharTokenizer",
    "TextData",
    "WordTokenizer",
    "default_corpus_text",
    "load_text",
    "split_contiguous",
]

CORPORA = ("enwik8", "text8", "wikitext103", "default", "stdlib")

ENWIK8_URLS = ("https://mattmahoney.net/dc/enwik8.zip",)  # https only
TEXT8_URLS = ("https://mattmahoney.net/dc/text8.zip",)
WIKITEXT103_URLS = (
    "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip",
    "https://wikitext.smerity.com/wikitext-103-v1.zip",
)
#: sha256 of the upstream archives, as published with their sizes in the Hugging Face ``datasets``
#: library's dataset definitions (github.com/huggingface/datasets, ``datasets/enwik8/dataset_infos.json``
#: and ``datasets/wikitext/dataset_infos.json``, commit 040102f1): enwik8.zip 36,445,475 bytes,
#: wikitext-103-v1.zip 190,229,076 bytes.  text8.zip: no published digest found (None: size-checked only).
ARCHIVE_SHA256: dict[str, str | None] = {
    "enwik8.zip": "547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc",
    "text8.zip": None,
    "wikitext-103-v1.zip": "242ba0f20b329cfdf1ccc61e9e9e5b59becf189db7f7a81cd2a0e2fc31539590",
}
#: the standard split of enwik8 / text8 (90M / 5M / 5M; Al-Rfou et al. 2019, Transformer-XL)
HUTTER_SPLIT = (90_000_000, 5_000_000, 5_000_000)


# ------------------------------------------------------------------------------ tokenizers
class ByteTokenizer:
    """UTF-8 bytes, vocabulary 256 (enwik8, local files, the default corpus)."""

    level = "byte"
    vocab_size = 256

    def encode(self, text: str | bytes) -> Tensor:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)

    def decode(self, ids: Tensor | Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def state(self) -> dict[str, Any]:
        return {"level": "byte"}


class CharTokenizer:
    """One id per character of a fixed alphabet (text8: ``" abcdefghijklmnopqrstuvwxyz"``)."""

    level = "char"

    def __init__(self, alphabet: str) -> None:
        if not alphabet or len(set(alphabet)) != len(alphabet):
            raise ValueError(f"alphabet={alphabet!r} is not allowed; expected distinct characters")
        self.alphabet = alphabet
        self.vocab_size = len(alphabet)
        self._lut = torch.full((256,), -1, dtype=torch.int64)
        if all(ord(c) < 256 for c in alphabet):
            self._lut[torch.tensor([ord(c) for c in alphabet])] = torch.arange(len(alphabet))

    def encode(self, text: str | bytes) -> Tensor:
        data = text.encode("latin-1") if isinstance(text, str) else bytes(text)
        ids = self._lut[torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)]
        if (ids < 0).any():
            bad = sorted({chr(b) for b in data if self._lut[b] < 0})[:5]
            raise ValueError(f"text holds characters {bad} outside the alphabet {self.alphabet!r}")
        return ids

    def decode(self, ids: Tensor | Sequence[int]) -> str:
        return "".join(self.alphabet[int(i)] for i in ids)

    def state(self) -> dict[str, Any]:
        return {"level": "char", "alphabet": self.alphabet}


class WordTokenizer:
    """Whitespace words with ``<eos>`` at each line end (the WikiText-103 convention of
    Transformer-XL and the Sandwich-Transformer code behind CompeteSMoE (2024)); unseen words map to
    ``<unk>``."""

    level = "word"
    EOS = "<eos>"
    UNK = "<unk>"

    def __init__(self, vocab: Sequence[str]) -> None:
        vocab = list(vocab)
        for special in (self.EOS, self.UNK):
            if special not in vocab:
                vocab.append(special)
        self.vocab = vocab
        self.index = {w: i for i, w in enumerate(vocab)}
        self.vocab_size = len(vocab)

    @staticmethod
    def words(text: str) -> list[str]:
        out: list[str] = []
        for line in text.splitlines():
            out.extend(line.split())
            out.append(WordTokenizer.EOS)
        return out

    @classmethod
    def fit(cls, text: str) -> WordTokenizer:
        """Vocabulary of ``text`` by decreasing count, ties by first appearance (deterministic)."""
        counts = Counter(cls.words(text))
        return cls([w for w, _ in counts.most_common()])

    def encode(self, text: str) -> Tensor:
        unk = self.index[self.UNK]
        return torch.tensor([self.index.get(w, unk) for w in self.words(text)], dtype=torch.int64)

    def decode(self, ids: Tensor | Sequence[int]) -> str:
        words = [self.vocab[int(i)] for i in ids]
        return " ".join(words).replace(f" {self.EOS} ", "\n").replace(f" {self.EOS}", "\n")

    def state(self) -> dict[str, Any]:
        return {"level": "word", "vocab": self.vocab}


def tokenizer_from_state(state: dict[str, Any]) -> ByteTokenizer | CharTokenizer | WordTokenizer:
    """Rebuild a tokenizer from :meth:`state` (the fine-tuning path reads it from a run)."""
    level = state.get("level")
    if level == "byte":
        return ByteTokenizer()
    if level == "char":
        return CharTokenizer(state["alphabet"])
    if level == "word":
        return WordTokenizer(state["vocab"])
    raise ValueError(f"tokenizer level={level!r} is not allowed; expected byte, char or word")


# ------------------------------------------------------------------------------ the data
@dataclass
class TextData:
    """A tokenised corpus: ``train``, ``valid``, ``test`` (1-D int64), its tokenizer and metric."""

    name: str
    train: Tensor
    valid: Tensor
    test: Tensor
    tokenizer: Any
    metric: str  # "bpc" (character/byte level) or "ppl" (word level)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def split(self, name: str) -> Tensor:
        if name not in ("train", "valid", "test"):
            raise ValueError(f"split={name!r} is not allowed; expected train, valid or test")
        return getattr(self, name)

    def check_block(self, block_size: int) -> None:
        """Every split must hold at least one block of ``block_size + 1`` tokens."""
        for name in ("train", "valid", "test"):
            n = self.split(name).numel()
            if n < block_size + 1:
                raise ValueError(
                    f"corpus {self.name!r} is too short: its {name} split has {n} tokens, fewer than one "
                    f"block of block_size+1={block_size + 1}; use a longer text or a smaller --block-size"
                )


def split_contiguous(tokens: Tensor, fractions: tuple[float, float] = (0.9, 0.05)) -> tuple[Tensor, ...]:
    """Split a token stream into first ``fractions[0]`` / next ``fractions[1]`` / rest."""
    n = tokens.numel()
    n_train = int(n * fractions[0])
    n_valid = int(n * fractions[1])
    return tokens[:n_train], tokens[n_train : n_train + n_valid], tokens[n_train + n_valid :]


def _extract(archive: Path, member: str, dest: Path) -> Path:
    if dest.exists():
        return dest
    try:
        with zipfile.ZipFile(archive) as zf:
            names = zf.namelist()
            match = [n for n in names if n == member or n.endswith("/" + member)]
            if not match:
                raise DataError(f"{archive} does not contain {member} (it holds {names[:5]}...)")
            tmp = dest.with_name(dest.name + ".part")
            with zf.open(match[0]) as src, open(tmp, "wb") as out:
                while block := src.read(1 << 22):
                    out.write(block)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, dest)
    except zipfile.BadZipFile as exc:
        raise DataError(f"{archive} is not a valid zip file ({exc}); delete it and run again") from None
    return dest


def _hutter(name: str, urls: Sequence[str], tokenizer: Any, metric: str) -> TextData:
    root = cache_dir() / name
    raw = root / name
    if not raw.exists():
        archive = fetch(f"{name}.zip", list(urls), ARCHIVE_SHA256[f"{name}.zip"], subdir=name)
        _extract(archive, name, raw)
    verified(raw, sum(HUTTER_SPLIT))
    return parse_hutter(name, raw.read_bytes(), tokenizer, metric)


def parse_hutter(name: str, data: bytes, tokenizer: Any, metric: str = "bpc") -> TextData:
    """The standard enwik8 / text8 split of ``data``: first 90M, next 5M, last 5M (scaled down
    proportionally when ``data`` is shorter than 100M, as in the tests)."""
    total = sum(HUTTER_SPLIT)
    n = len(data)
    n_train = HUTTER_SPLIT[0] * n // total
    n_valid = HUTTER_SPLIT[1] * n // total
    tokens = tokenizer.encode(data)
    return TextData(
        name,
        tokens[:n_train],
        tokens[n_train : n_train + n_valid],
        tokens[n_train + n_valid :],
        tokenizer,
        metric,
        info={"bytes": n},
    )


def parse_wikitext(name: str, train: str, valid: str, test: str) -> TextData:
    """Word-level data from the three WikiText files (vocabulary from ``train``)."""
    tok = WordTokenizer.fit(train)
    return TextData(name, tok.encode(train), tok.encode(valid), tok.encode(test), tok, "ppl")


def _wikitext103() -> TextData:
    root = cache_dir() / "wikitext103"
    files = {s: root / f"wiki.{s}.tokens" for s in ("train", "valid", "test")}
    if not all(p.exists() for p in files.values()):
        archive = fetch(
            "wikitext-103-v1.zip",
            list(WIKITEXT103_URLS),
            ARCHIVE_SHA256["wikitext-103-v1.zip"],
            subdir="wikitext103",
        )
        for p in files.values():
            _extract(archive, p.name, p)
    text = {s: verified(p).read_text(encoding="utf-8") for s, p in files.items()}
    cache = root / "tokens.pt"
    if cache.exists():
        try:  # tensors, strings and lists only: no code runs
            blob = torch.load(cache, weights_only=True)
            tok = WordTokenizer(blob["vocab"])
            return TextData("wikitext103", blob["train"], blob["valid"], blob["test"], tok, "ppl")
        except Exception as exc:  # a truncated or damaged cache (a cache of moelab < 0.3 was not atomic)
            warnings.warn(
                f"the WikiText-103 token cache {cache} is damaged ({type(exc).__name__}); rebuilding it "
                "from the verified text",
                stacklevel=2,
            )
    data = parse_wikitext("wikitext103", text["train"], text["valid"], text["test"])
    atomic_write_torch(
        cache, {"vocab": data.tokenizer.vocab, "train": data.train, "valid": data.valid, "test": data.test}
    )
    return data


#: the stdlib folders the ``stdlib`` corpus leaves out: installed packages, tests, the IDE, 2to3
_STDLIB_EXCLUDED = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3"})


def default_corpus_text(max_bytes: int = 1 << 20, whole_stdlib: bool = False) -> bytes:
    """The embedded default corpus: the standard library's top-level ``*.py`` sources (with
    ``whole_stdlib``: every ``*.py`` below it but the excluded packages), sorted by relative path and
    concatenated (each preceded by a ``# file: PATH`` line), cut at ``max_bytes``."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if whole_stdlib:
        files = sorted(
            (p for p in stdlib.rglob("*.py") if p.is_file()),
            key=lambda p: p.relative_to(stdlib).as_posix(),
        )
        files = [p for p in files if not _STDLIB_EXCLUDED & set(p.relative_to(stdlib).parts)]
    else:
        files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    if not files:
        raise DataError(f"no Python sources found in {stdlib} to build the default corpus; pass --data PATH")
    parts: list[bytes] = []
    size = 0
    for p in files:
        chunk = f"# file: {p.relative_to(stdlib).as_posix()}\n".encode() + p.read_bytes() + b"\n"
        parts.append(chunk)
        size += len(chunk)
        if size >= max_bytes:
            break
    return b"".join(parts)[:max_bytes]


def load_text(source: str, level: str = "byte", max_bytes: int = 1 << 20) -> TextData:
    """Load a corpus by name (``enwik8``, ``text8``, ``wikitext103``, ``default``, ``stdlib``) or a path.

    Args:
        source: a corpus name or the path of a UTF-8 text file.
        level: for a local file, ``byte`` (BPC) or ``word`` (PPL, the WikiText rules).
        max_bytes: size of the default corpus (``stdlib`` is always whole).

    Raises:
        FileNotFoundError: ``source`` is neither a corpus name nor an existing file.
        DataError: a download failed (offline) or a file fails verification.
    """
    if level not in ("byte", "word"):
        raise ValueError(f"level={level!r} is not allowed; expected byte or word")
    if source == "enwik8":
        return _hutter("enwik8", ENWIK8_URLS, ByteTokenizer(), "bpc")
    if source == "text8":
        return _hutter("text8", TEXT8_URLS, CharTokenizer(" abcdefghijklmnopqrstuvwxyz"), "bpc")
    if source == "wikitext103":
        return _wikitext103()
    if source in ("default", "stdlib"):
        whole = source == "stdlib"
        data = default_corpus_text(1 << 40 if whole else max_bytes, whole_stdlib=whole)
        train, valid, test = split_contiguous(ByteTokenizer().encode(data))
        info = {
            "source": "python stdlib sources" + (" (whole)" if whole else ""),
            "python": ".".join(map(str, sys.version_info[:3])),
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        return TextData(source, train, valid, test, ByteTokenizer(), "bpc", info)
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(
            f"--data {source!r} is neither a corpus ({', '.join(CORPORA)}) nor an existing file"
        )
    if not path.is_file():
        raise ValueError(f"--data {source!r} is not a regular file")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"--data {source!r} cannot be read: {exc.strerror}") from None
    if not raw.strip():
        raise ValueError(f"--data {source!r} is empty")
    info = {"source": str(path), "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    if level == "word":
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"--data {source!r} is not UTF-8 text (needed for level='word')") from None
        lines = text.splitlines(keepends=True)
        a, b = int(len(lines) * 0.9), int(len(lines) * 0.95)
        data = parse_wikitext(path.name, "".join(lines[:a]), "".join(lines[a:b]), "".join(lines[b:]))
        data.info = info
        return data
    tokens = ByteTokenizer().encode(raw)
    train, valid, test = split_contiguous(tokens)
    return TextData(path.name, train, valid, test, ByteTokenizer(), "bpc", info)
