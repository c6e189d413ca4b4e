"""download.fetch: verified, cached, refetched when corrupted, a useful message offline."""

from __future__ import annotations

import hashlib

import pytest

from moelab.data.download import DataError, cache_dir, fetch, sha256sum

PAYLOAD = b"moelab test payload\n" * 100
SHA = hashlib.sha256(PAYLOAD).hexdigest()
OFFLINE = "https://127.0.0.1:9/x"  # discard port: nothing listens


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "src" / "data.bin"
    path.parent.mkdir()
    path.write_bytes(PAYLOAD)
    return path


def test_cache_dir_follows_moelab_data(tmp_path, monkeypatch):
    monkeypatch.setenv("MOELAB_DATA", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"


def test_fetch_downloads_and_verifies_sha256(source):
    path = fetch("data.bin", source.as_uri(), SHA, subdir="sets", progress=False)
    assert path == cache_dir() / "sets" / "data.bin"
    assert path.read_bytes() == PAYLOAD
    assert sha256sum(path) == SHA
    assert [p.name for p in path.parent.iterdir()] == ["data.bin"]  # no partial file left


def test_fetch_uses_the_cache_without_the_network(source):
    fetch("data.bin", source.as_uri(), SHA, progress=False)
    path = fetch("data.bin", OFFLINE, SHA, timeout=0.5, progress=False)
    assert path.read_bytes() == PAYLOAD


def test_fetch_refetches_a_corrupted_cache(source):
    path = fetch("data.bin", source.as_uri(), SHA, progress=False)
    path.write_bytes(b"corrupted")
    again = fetch("data.bin", source.as_uri(), SHA, progress=False)
    assert again.read_bytes() == PAYLOAD


def test_fetch_refuses_a_download_with_the_wrong_sha256(source):
    bad = "0" * 64
    with pytest.raises(DataError, match=rf"data.bin downloaded from .* has sha256 {SHA}, expected {bad}"):
        fetch("data.bin", source.as_uri(), bad, progress=False)
    assert not (cache_dir() / "data.bin").exists()


def test_fetch_tries_mirrors_in_order(source):
    path = fetch("data.bin", [OFFLINE, source.as_uri()], SHA, timeout=0.5, progress=False)
    assert path.read_bytes() == PAYLOAD


def test_fetch_offline_names_the_url_and_destination():
    dest = cache_dir() / "sets" / "data.bin"
    with pytest.raises(DataError, match=r"cannot download data.bin \(offline\?\)") as info:
        fetch("data.bin", OFFLINE, SHA, subdir="sets", timeout=0.5, progress=False)
    message = str(info.value)
    assert OFFLINE in message and str(dest) in message and "MOELAB_DATA" in message
    assert isinstance(info.value, ValueError)


def test_fetch_rejects_an_empty_url_list():
    with pytest.raises(ValueError, match=r"urls=\[\] is not allowed; expected at least one URL"):
        fetch("data.bin", [], SHA, progress=False)


def test_plain_http_sources_are_refused():
    with pytest.raises(
        ValueError, match=r"url='http://example.org/x' is not allowed; expected an https:// \(or file:\) URL"
    ):
        fetch("data.bin", ["http://example.org/x"], SHA, progress=False)


def _capture_fetches(monkeypatch, module):
    calls = []

    def fake_fetch(name, urls, sha256, subdir="", **kwargs):
        calls.append((subdir, name, sha256))
        raise DataError("offline (test)")

    monkeypatch.setattr(module, "fetch", fake_fetch)
    return calls


@pytest.mark.parametrize(
    "corpus,expected",
    [("enwik8", ("enwik8", "enwik8.zip", "547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc")),
     ("wikitext103", ("wikitext103", "wikitext-103-v1.zip",
                      "242ba0f20b329cfdf1ccc61e9e9e5b59becf189db7f7a81cd2a0e2fc31539590"))],
)  # fmt: skip
def test_text_downloads_are_pinned_to_the_published_sha256(monkeypatch, tmp_path, corpus, expected):
    from moelab.data import text

    monkeypatch.setenv("MOELAB_DATA", str(tmp_path))
    calls = _capture_fetches(monkeypatch, text)
    with pytest.raises(DataError):
        text.load_text(corpus)
    assert calls == [expected]


@pytest.mark.parametrize(
    "task,expected",
    [("sst2", ("sst2", "SST-2.zip", "d67e16fb55739c1b32cdce9877596db1c127dc322d93c082281f64057c16deaa")),
     ("imdb", ("imdb", "aclImdb_v1.tar.gz", "c40f74a18d3b61f90feba1e17730e0d38e8b97c05fde7008942e91923d1658fe")),
     ("banking77", ("banking77", "train.csv",
                    "b06e26ac675513959a63135f11b94ea7786ed02da65db93a5650d8838cbc664b"))],
)  # fmt: skip
def test_classification_downloads_are_pinned_to_the_published_sha256(monkeypatch, tmp_path, task, expected):
    from moelab.data import classification

    monkeypatch.setenv("MOELAB_DATA", str(tmp_path))
    calls = _capture_fetches(monkeypatch, classification)
    with pytest.raises(DataError):
        classification.load_classification(task)
    assert calls == [expected]
