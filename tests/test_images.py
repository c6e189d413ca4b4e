"""Image data of the specialization lab: the IDX reader, local folders, the combined set, CIFAR-100."""

import gzip
import hashlib
import os
import pickle

import numpy as np
import pytest
import torch

from moelab.data import images
from moelab.data.download import DataError
from moelab.data.images import IDX_FILES, load_images, read_idx


def write_idx(path, array: np.ndarray, gz: bool = False) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if gz else data)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_reader_returns_the_array_it_was_given(tmp_path, gz):
    a = np.arange(3 * 4 * 5, dtype=np.uint8).reshape(3, 4, 5)
    p = tmp_path / ("a.idx.gz" if gz else "a.idx")
    write_idx(p, a, gz)
    np.testing.assert_array_equal(read_idx(p), a)
    np.testing.assert_array_equal(read_idx(p, (3, 4, 5)), a)


def test_truncated_idx_file_is_named_in_the_error(tmp_path):
    p = tmp_path / "train-images-idx3-ubyte"
    write_idx(p, np.zeros((4, 2, 2)))
    p.write_bytes(p.read_bytes()[:-3])
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte is truncated"):
        read_idx(p)


def test_truncated_gzip_is_named_in_the_error(tmp_path):
    p = tmp_path / "x.gz"
    write_idx(p, np.zeros((50, 9, 9)), gz=True)
    p.write_bytes(p.read_bytes()[:20])
    with pytest.raises(DataError, match=r"x.gz"):
        read_idx(p)


def test_bad_magic_and_wrong_shape_are_refused(tmp_path):
    p = tmp_path / "bad"
    p.write_bytes(b"\x01\x02\x03\x04rest")
    with pytest.raises(DataError, match="no valid IDX header"):
        read_idx(p)
    q = tmp_path / "q"
    write_idx(q, np.zeros((2, 3)))
    with pytest.raises(DataError, match=r"has shape \(2, 3\), expected \(3, 2\)"):
        read_idx(q, (3, 2))
    with pytest.raises(DataError, match="missing"):
        read_idx(tmp_path / "none")


def fake_idx_folder(folder, n_train=30, n_test=12, seed=0, gz=True):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {
        "train_images": rng.integers(0, 256, (n_train, 28, 28)),
        "train_labels": np.arange(n_train) % 10,
        "test_images": rng.integers(0, 256, (n_test, 28, 28)),
        "test_labels": np.arange(n_test) % 10,
    }
    for key, stem in IDX_FILES.items():
        write_idx(folder / (stem + (".gz" if gz else "")), arrays[key], gz)
    return arrays


@pytest.fixture
def small_shapes(monkeypatch):
    monkeypatch.setattr(
        images,
        "IDX_SHAPES",
        {
            "train_images": (30, 28, 28),
            "train_labels": (30,),
            "test_images": (12, 28, 28),
            "test_labels": (12,),
        },
    )


def test_mnist_from_a_local_folder_is_normalised(tmp_path, small_shapes):
    arrays = fake_idx_folder(tmp_path / "m", gz=False)
    d = load_images("mnist", tmp_path / "m")
    assert d.x_train.shape == (30, 1, 28, 28) and d.x_test.shape == (12, 1, 28, 28)
    expected = (torch.from_numpy(arrays["train_images"].astype(np.float32)) / 255 - 0.1307) / 0.3081
    torch.testing.assert_close(d.x_train[:, 0], expected)
    assert d.y_train.tolist() == (np.arange(30) % 10).tolist()


def test_missing_file_in_a_local_folder_is_named(tmp_path, small_shapes):
    fake_idx_folder(tmp_path / "m")
    (tmp_path / "m" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte"):
        load_images("mnist", tmp_path / "m")


def content_hashes(arrays):
    return {k: hashlib.sha256(a.astype(np.uint8).tobytes()).hexdigest() for k, a in arrays.items()}


def test_fashion_mnist_is_found_where_debian_installs_it(tmp_path, small_shapes, monkeypatch):
    arrays = fake_idx_folder(tmp_path / "debian")
    monkeypatch.setattr(images, "DEBIAN_FASHION_MNIST", tmp_path / "debian")
    monkeypatch.setattr(images, "FMNIST_CONTENT_SHA256", content_hashes(arrays))
    d = load_images("fmnist")
    assert d.x_train.shape == (30, 1, 28, 28) and d.class_names[0] == "t-shirt"


def test_fashion_mnist_with_other_content_is_refused(tmp_path, small_shapes, monkeypatch):
    fake_idx_folder(tmp_path / "f")
    with pytest.raises(DataError, match="does not hold the Fashion-MNIST"):
        load_images("fmnist", tmp_path / "f")


def test_combined_set_takes_fashion_0_to_5_and_digits_4_to_9(tmp_path, small_shapes, monkeypatch):
    f = fake_idx_folder(tmp_path / "f", seed=1)
    fake_idx_folder(tmp_path / "m", seed=2)
    monkeypatch.setattr(images, "FMNIST_CONTENT_SHA256", content_hashes(f))
    d = load_images("fmnist+mnist", tmp_path / "f", mnist_dir=tmp_path / "m")
    assert d.num_classes == 12 and len(d.class_names) == 12
    # 30 train samples each, labels 0..9 cycling: fmnist keeps 0-5 (18), mnist keeps 4-9 (18) -> 6..11
    assert len(d.y_train) == 36 and sorted(set(d.y_train.tolist())) == list(range(12))
    assert d.class_names[5] == "sandal" and d.class_names[6] == "4"


def test_digits_split_is_fixed_and_offline():
    a, b = load_images("digits"), load_images("digits")
    assert a.x_train.shape == (1437, 1, 8, 8) and a.x_test.shape == (360, 1, 8, 8)
    assert torch.equal(a.y_test, b.y_test)
    assert abs(float(a.x_train.mean())) < 1e-5


def test_cifar100_python_pickles(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for part, n in (("train", 6), ("test", 4)):
        d = {
            b"data": rng.integers(0, 256, (n, 3072)).astype(np.uint8),
            b"fine_labels": list(range(n)),
            b"coarse_labels": [0] * n,
        }
        (folder / part).write_bytes(pickle.dumps(d))
    data = load_images("cifar100", tmp_path)
    assert data.x_train.shape == (6, 3, 32, 32) and data.num_classes == 100
    assert data.y_test.tolist() == [0, 1, 2, 3] and data.coarse_train.tolist() == [0] * 6
    (folder / "test").write_bytes(b"\x80\x04trunc")
    with pytest.raises(DataError, match="cifar-100-python/test"):
        load_images("cifar100", tmp_path)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch should-not-exist",))


def test_a_cifar100_file_that_would_run_code_is_refused_without_running_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for part in ("train", "test"):
        (folder / part).write_bytes(
            pickle.dumps({b"data": _RunsCode(), b"fine_labels": [], b"coarse_labels": []})
        )
    with pytest.raises(
        DataError,
        match=r"cifar-100-python/train is truncated or not the python version \(global posix.system is not allowed",
    ):
        load_images("cifar100", tmp_path)
    assert not (tmp_path / "should-not-exist").exists()


def test_unknown_dataset_is_refused():
    with pytest.raises(ValueError, match="data='svhn' is not allowed"):
        load_images("svhn")
