"""Text corpora: tokenisers round-trip, deterministic splits, offline errors, verification."""

from __future__ import annotations

import urllib.error
import zipfile

import pytest
import torch

from moelab.data import text as T
from moelab.data.download import DataError, verified


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No network and an empty cache."""

    def refuse(*args, **kwargs):
        raise urllib.error.URLError("network is unreachable")

    monkeypatch.setattr("urllib.request.urlopen", refuse)
    monkeypatch.setenv("MOELAB_DATA", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_byte_tokenizer_round_trips_unicode():
    tok = T.ByteTokenizer()
    s = "naïve café — ∑ 🙂\nnew line"
    ids = tok.encode(s)
    assert ids.dtype == torch.int64 and int(ids.max()) < 256
    assert ids.numel() == len(s.encode("utf-8"))
    assert tok.decode(ids) == s


def test_char_tokenizer_round_trips_and_rejects_outside_alphabet():
    tok = T.CharTokenizer(" abcdefghijklmnopqrstuvwxyz")
    assert tok.vocab_size == 27
    ids = tok.encode("the quick brown fox")
    assert ids.tolist()[:3] == [20, 8, 5]
    assert tok.decode(ids) == "the quick brown fox"
    with pytest.raises(ValueError, match="outside the alphabet"):
        tok.encode("Capital")


def test_word_tokenizer_round_trips_with_eos_and_maps_unseen_words_to_unk():
    tok = T.WordTokenizer.fit("a b a\nc a\n")
    assert tok.vocab[:2] == ["a", "<eos>"]  # by count, ties by first appearance
    ids = tok.encode("a b\nc\n")
    assert tok.decode(ids).split() == ["a", "b", "c"]
    assert ids.tolist().count(tok.index["<eos>"]) == 2
    assert tok.encode("zzz").tolist()[0] == tok.index["<unk>"]


def test_split_contiguous_is_90_5_5_in_order():
    tokens = torch.arange(1000)
    train, valid, test = T.split_contiguous(tokens)
    assert (train.numel(), valid.numel(), test.numel()) == (900, 50, 50)
    assert torch.equal(torch.cat([train, valid, test]), tokens)


def test_local_file_split_is_deterministic_and_contiguous(tmp_path):
    path = tmp_path / "corpus.txt"
    raw = "".join(f"line {i}: the cat sat on the mat.\n" for i in range(300)).encode()
    path.write_bytes(raw)
    a, b = T.load_text(str(path)), T.load_text(str(path))
    assert torch.equal(a.train, b.train) and torch.equal(a.test, b.test)
    n = len(raw)
    assert a.train.numel() == int(0.9 * n) and a.valid.numel() == int(0.05 * n)
    assert bytes(torch.cat([a.train, a.valid, a.test]).to(torch.uint8).tolist()) == raw
    assert a.metric == "bpc" and a.vocab_size == 256


def test_local_file_word_level_uses_wikitext_rules(tmp_path):
    path = tmp_path / "words.txt"
    path.write_text("".join(f"w{i % 7} w{i % 3} end\n" for i in range(100)))
    data = T.load_text(str(path), level="word")
    assert data.metric == "ppl"
    assert data.tokenizer.EOS in data.tokenizer.vocab
    assert data.train.numel() == 90 * 4  # 90 lines of 3 words + <eos>


def test_default_corpus_is_offline_and_deterministic():
    a = T.default_corpus_text(50_000)
    assert len(a) == 50_000 and a == T.default_corpus_text(50_000)
    data = T.load_text("default")
    assert data.name == "default" and data.metric == "bpc"
    assert data.info["bytes"] == 1 << 20 and len(data.info["sha256"]) == 64
    assert data.train.numel() == int(0.9 * (1 << 20))


def test_stdlib_corpus_is_the_whole_standard_library_without_tests_and_installed_packages():
    import sysconfig

    text = T.default_corpus_text(1 << 40, whole_stdlib=True)
    names = [line[len(b"# file: ") :].decode() for line in text.splitlines() if line.startswith(b"# file: ")]
    assert names == sorted(names) and len(names) > 300
    assert "json/decoder.py" in names and "os.py" in names
    assert not [
        n for n in names if {"site-packages", "test", "tests", "idlelib", "lib2to3"} & set(n.split("/"))
    ]
    stdlib = sysconfig.get_paths()["stdlib"]
    assert text.count(b"# file: ") >= len(names) and stdlib  # every file has its header line


def test_parse_hutter_scales_the_90_5_5_split():
    data = T.parse_hutter("enwik8", bytes(range(256)) * 40, T.ByteTokenizer())
    assert (data.train.numel(), data.valid.numel(), data.test.numel()) == (9216, 512, 512)


def test_parse_wikitext_takes_the_vocabulary_from_train():
    data = T.parse_wikitext("wt", "a b c\na b\n", "a d\n", "b\n")
    unk = data.tokenizer.index["<unk>"]
    assert unk in data.valid.tolist()  # "d" is not in train
    assert data.metric == "ppl"


def test_offline_download_error_says_what_to_fetch_and_where(offline):
    with pytest.raises(DataError, match=r"enwik8\.zip.*mattmahoney\.net/dc/enwik8\.zip.*place it at"):
        T.load_text("enwik8")
    with pytest.raises(DataError, match=r"wikitext-103-v1\.zip"):
        T.load_text("wikitext103")


def test_a_truncated_extracted_corpus_is_refused_naming_the_file(offline):
    folder = offline / "text8"
    folder.mkdir(parents=True)
    with zipfile.ZipFile(folder / "text8.zip", "w") as zf:
        zf.writestr("text8", "only a few characters")
    with pytest.raises(DataError, match=r"text8/text8 has 21 bytes, expected 100000000"):
        T.load_text("text8")


def test_a_bad_zip_is_refused(offline):
    folder = offline / "text8"  # text8.zip has no published digest: its zip is opened
    folder.mkdir(parents=True)
    (folder / "text8.zip").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="not a valid zip"):
        T.load_text("text8")


def test_a_cached_archive_that_differs_from_the_pinned_sha256_is_discarded(offline):
    folder = offline / "enwik8"
    folder.mkdir(parents=True)
    (folder / "enwik8.zip").write_bytes(b"not the enwik8 archive")
    with pytest.raises(DataError, match=r"cannot download enwik8\.zip"):  # refetched (offline here)
        T.load_text("enwik8")
    assert not (folder / "enwik8.zip").exists()


def test_a_changed_file_is_detected_by_its_recorded_sha256(tmp_path):
    f = tmp_path / "wiki.train.tokens"
    f.write_text("hello world\n")
    verified(f)  # records the digest
    assert (tmp_path / "wiki.train.tokens.sha256").exists()
    f.write_text("hello w0rld\n")
    with pytest.raises(DataError, match=r"wiki\.train\.tokens has sha256 .* was recorded"):
        verified(f)


def test_bad_sources_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a corpus"):
        T.load_text(str(tmp_path / "missing.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        T.load_text(str(empty))
    with pytest.raises(ValueError, match="level='char' is not allowed"):
        T.load_text("default", level="char")
    short = tmp_path / "short.txt"
    short.write_text("x" * 200)
    with pytest.raises(ValueError, match="too short: its valid split has 10 tokens"):
        T.load_text(str(short)).check_block(64)


def test_a_damaged_wikitext103_token_cache_is_rebuilt_and_written_atomically(offline):
    folder = offline / "wikitext103"
    folder.mkdir(parents=True)
    for split, text in (("train", "a b c\na b\n" * 50), ("valid", "a d\n"), ("test", "b c\n")):
        (folder / f"wiki.{split}.tokens").write_text(text)
    first = T.load_text("wikitext103")
    cache = folder / "tokens.pt"
    cache.write_bytes(cache.read_bytes()[:100])  # a kill while a former moelab wrote it
    with pytest.warns(UserWarning, match=r"token cache .*tokens\.pt is damaged \(.*\); rebuilding it"):
        again = T.load_text("wikitext103")
    assert torch.equal(again.train, first.train) and again.tokenizer.vocab == first.tokenizer.vocab
    assert T.load_text("wikitext103").test.tolist() == first.test.tolist()  # the rebuilt cache reads back
    assert not list(folder.glob(".tokens.pt.*.tmp"))
