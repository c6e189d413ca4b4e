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
