"""Image classification data for the expert-specialization lab (Krishnamurthy et al. (2023)):
scikit-learn's digits (offline), MNIST, Fashion-MNIST, the two together (``fmnist+mnist``) and
CIFAR-100, read by :func:`load_images` with fixed seeded splits and the normalisation of the
authors' code.  docs/data.md ("Images") says where each file is looked for, how it is checked, and
the splits and normalisation.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import pickle
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .download import DataError, fetch

__all__ = ["DATASETS", "DEBIAN_FASHION_MNIST", "ImageData", "load_images", "read_idx"]

DATASETS = ("digits", "mnist", "fmnist", "fmnist+mnist", "cifar100")

#: where Debian's ``dataset-fashion-mnist`` package installs the IDX files
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")

IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
#: expected shape of each file (checked against the header)
IDX_SHAPES = {
    "train_images": (60000, 28, 28),
    "train_labels": (60000,),
    "test_images": (10000, 28, 28),
    "test_labels": (10000,),
}

MNIST_URLS = (
    "https://yann.lecun.com/exdb/mnist/",  # canonical
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)
#: sha256 of the canonical MNIST .gz files
MNIST_SHA256 = {
    "train_images": "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
    "train_labels": "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
    "test_images": "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    "test_labels": "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
}
FMNIST_URLS = (  # the authors' repository over https (their S3 website serves plain http only)
    "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
)
#: sha256 of the Fashion-MNIST IDX payloads (the bytes after the header, decompressed).  The .gz
#: archives differ by packager (Debian recompresses them), so the content is what is verified,
#: whatever the source.
FMNIST_CONTENT_SHA256 = {
    "train_images": "2e487a6c89124f78f2d7521542223cafe96f7123c3ca13d447772ac6ecbb3012",
    "train_labels": "657fbd221bfc9f4198cc14b5619cc33ec57c58dd0e47af4d99d6650759e869a7",
    "test_images": "c867c93ff95360594e8ec3287995350b824dd110b11595c0e13d5423f621867a",
    "test_labels": "3d0e6c6ea990b53b6f8f500a41cac93881d981b315f84578b7d915342ade01e9",
}
CIFAR100_URL = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"
CIFAR100_SHA256 = "85cd44d02ba6437773c5bbd22e183051d648de2e7d6b014e1ef29b855ba677a7"

FMNIST_CLASSES = [
    "t-shirt",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "boot",
]
NORMALISATION = {"mnist": (0.1307, 0.3081), "fmnist": (0.2860, 0.3530)}

_IDX_DTYPES = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


@dataclass
class ImageData:
    """Train and test tensors: ``x (B, C, S, S)`` float32 normalised, ``y (B,)`` int64."""

    name: str
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    num_classes: int
    class_names: list[str]
    coarse_train: Tensor | None = None
    coarse_test: Tensor | None = None

    def subset(self, train: int | None = None, test: int | None = None, seed: int = 0) -> ImageData:
        """A random subset (seeded) of at most ``train`` / ``test`` samples."""
        g = torch.Generator().manual_seed(seed)

        def pick(x: Tensor, y: Tensor, n: int | None) -> tuple[Tensor, Tensor]:
            if n is None or n >= len(y):
                return x, y
            idx = torch.randperm(len(y), generator=g)[:n]
            return x[idx], y[idx]

        xtr, ytr = pick(self.x_train, self.y_train, train)
        xte, yte = pick(self.x_test, self.y_test, test)
        return ImageData(self.name, xtr, ytr, xte, yte, self.num_classes, self.class_names)


# ---------------------------------------------------------------------- IDX
def read_idx(path: str | os.PathLike, expected_shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Read an IDX file (``.gz`` or raw), checking its header and size.

    Raises:
        DataError: the file is missing, not IDX, truncated / too long for its header, or its
            shape differs from ``expected_shape``; the message names the file.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"IDX file {path} is missing")
    try:
        raw = gzip.open(path, "rb").read() if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError) as exc:
        raise DataError(f"IDX file {path} cannot be read ({exc}); it is truncated or corrupted") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DataError(f"IDX file {path} has no valid IDX header (magic {raw[:4].hex() or 'empty'})")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(raw) < header:
        raise DataError(
            f"IDX file {path} is truncated: its header needs {header} bytes, the file has {len(raw)}"
        )
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = header + int(np.prod(shape)) * dtype.itemsize
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "too long"
        raise DataError(
            f"IDX file {path} is {what}: header says shape {shape} ({expected} bytes), the file has {len(raw)}"
        )
    if expected_shape is not None and shape != tuple(expected_shape):
        raise DataError(f"IDX file {path} has shape {shape}, expected {tuple(expected_shape)}")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def _find_idx(folder: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        if (folder / name).is_file():
            return folder / name
    raise DataError(f"IDX file {folder / stem} (or {stem}.gz) is missing from {folder}")


def _idx_paths(name: str, data_dir: str | os.PathLike | None) -> dict[str, Path]:
    if data_dir is not None:
        folder = Path(data_dir)
        if not folder.is_dir():
            raise FileNotFoundError(f"--data-dir {folder} is not a folder")
        return {k: _find_idx(folder, stem) for k, stem in IDX_FILES.items()}
    if name == "fmnist" and DEBIAN_FASHION_MNIST.is_dir():
        return {k: _find_idx(DEBIAN_FASHION_MNIST, stem) for k, stem in IDX_FILES.items()}
    urls = MNIST_URLS if name == "mnist" else FMNIST_URLS
    out = {}
    for key, stem in IDX_FILES.items():
        sha = MNIST_SHA256[key] if name == "mnist" else None  # fmnist: content verified after reading
        out[key] = fetch(stem + ".gz", [u + stem + ".gz" for u in urls], sha, subdir=name)
    return out


def _load_idx(name: str, data_dir: str | os.PathLike | None) -> dict[str, np.ndarray]:
    paths = _idx_paths(name, data_dir)
    arrays = {k: read_idx(p, IDX_SHAPES[k]) for k, p in paths.items()}
    if name == "fmnist":
        for k, a in arrays.items():
            got = hashlib.sha256(a.tobytes()).hexdigest()
            if got != FMNIST_CONTENT_SHA256[k]:
                raise DataError(
                    f"IDX file {paths[k]} does not hold the Fashion-MNIST {k.replace('_', ' ')} (sha256 {got})"
                )
    return arrays


def _to_tensor(images: np.ndarray, mean: float, std: float) -> Tensor:
    x = torch.from_numpy(images.astype(np.float32) / 255.0)
    return ((x - mean) / std).unsqueeze(1)


def _idx_dataset(name: str, data_dir: str | os.PathLike | None) -> ImageData:
    a = _load_idx(name, data_dir)
    mean, std = NORMALISATION[name]
    names = [str(i) for i in range(10)] if name == "mnist" else list(FMNIST_CLASSES)
    return ImageData(
        name,
        _to_tensor(a["train_images"], mean, std),
        torch.from_numpy(a["train_labels"].astype(np.int64)),
        _to_tensor(a["test_images"], mean, std),
        torch.from_numpy(a["test_labels"].astype(np.int64)),
        10,
        names,
    )


def _combined(mnist_dir: str | os.PathLike | None, fmnist_dir: str | os.PathLike | None) -> ImageData:
    """Krishnamurthy et al. (2023) §4.1: FMNIST classes 0–5 → 0–5, MNIST digits 4–9 → 6–11; 10,000 / 2,000
    samples (seed 0)."""
    f = _idx_dataset("fmnist", fmnist_dir)
    m = _idx_dataset("mnist", mnist_dir)

    def join(xf: Tensor, yf: Tensor, xm: Tensor, ym: Tensor) -> tuple[Tensor, Tensor]:
        keep_f, keep_m = yf <= 5, ym >= 4
        return torch.cat([xf[keep_f], xm[keep_m]]), torch.cat([yf[keep_f], ym[keep_m] + 2])

    xtr, ytr = join(f.x_train, f.y_train, m.x_train, m.y_train)
    xte, yte = join(f.x_test, f.y_test, m.x_test, m.y_test)
    names = FMNIST_CLASSES[:6] + [str(d) for d in range(4, 10)]
    return ImageData("fmnist+mnist", xtr, ytr, xte, yte, 12, names).subset(10000, 2000, seed=0)


def _digits() -> ImageData:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.from_numpy(d.images.astype(np.float32) / 16.0).unsqueeze(1)
    y = torch.from_numpy(d.target.astype(np.int64))
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = perm[:1437], perm[1437:]
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return ImageData("digits", x[train], y[train], x[test], y[test], 10, [str(i) for i in range(10)])


def _cifar100(data_dir: str | os.PathLike | None) -> ImageData:
    if data_dir is not None:
        folder = Path(data_dir)
        folder = folder / "cifar-100-python" if (folder / "cifar-100-python").is_dir() else folder
        for part in ("train", "test"):
            if not (folder / part).is_file():
                raise DataError(f"CIFAR-100 file {folder / part} is missing")
    else:
        archive = fetch("cifar-100-python.tar.gz", CIFAR100_URL, CIFAR100_SHA256, subdir="cifar100")
        folder = archive.parent / "cifar-100-python"
        if not (folder / "test").is_file():
            with tarfile.open(archive) as tar:
                tar.extractall(archive.parent, filter="data")

    def part(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        try:
            with open(folder / name, "rb") as fh:
                d = _CifarUnpickler(fh).load()
            x = np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
            return x, np.asarray(d[b"fine_labels"]), np.asarray(d[b"coarse_labels"])
        except (pickle.UnpicklingError, EOFError, KeyError, ValueError) as exc:
            raise DataError(
                f"CIFAR-100 file {folder / name} is truncated or not the python version ({exc})"
            ) from None

    xtr, ftr, ctr = part("train")
    xte, fte, cte = part("test")
    xtr_f = torch.from_numpy(xtr.astype(np.float32) / 255.0)
    mean, std = xtr_f.mean(dim=(0, 2, 3), keepdim=True), xtr_f.std(dim=(0, 2, 3), keepdim=True)
    norm = lambda a: (torch.from_numpy(a.astype(np.float32) / 255.0) - mean) / std
    names = [str(i) for i in range(100)]
    meta = folder / "meta"
    if meta.is_file():
        with open(meta, "rb") as fh:
            names = [n.decode() for n in _CifarUnpickler(fh).load()[b"fine_label_names"]]
    t = lambda a: torch.from_numpy(a.astype(np.int64))
    return ImageData("cifar100", norm(xtr), t(ftr), norm(xte), t(fte), 100, names, t(ctr), t(cte))


class _CifarUnpickler(pickle.Unpickler):
    """Reads the CIFAR python batches (dicts of bytes, lists, ints and numpy arrays) and nothing
    else: the only globals it resolves are numpy's array reconstructors, so a crafted file cannot
    run code (any other global is refused as :class:`pickle.UnpicklingError`)."""

    _ALLOWED = frozenset(
        {
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
        }
    )

    def __init__(self, fh) -> None:
        super().__init__(fh, encoding="bytes")

    def find_class(self, module: str, name: str):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR-100 file")


def load_images(
    name: str,
    data_dir: str | os.PathLike | None = None,
    mnist_dir: str | os.PathLike | None = None,
) -> ImageData:
    """Load one of :data:`DATASETS` (see the module docstring for sources and splits).

    Args:
        name: dataset name.
        data_dir: a local folder holding the dataset's files (IDX files, or the CIFAR-100 python
            folder); for ``fmnist+mnist`` the Fashion-MNIST folder.
        mnist_dir: for ``fmnist+mnist``, the MNIST folder (default: cache / download).
    """
    if name not in DATASETS:
        raise ValueError(f"data={name!r} is not allowed; expected one of {list(DATASETS)}")
    if name == "digits":
        return _digits()
    if name in ("mnist", "fmnist"):
        return _idx_dataset(name, data_dir)
    if name == "fmnist+mnist":
        return _combined(mnist_dir, data_dir)
    return _cifar100(data_dir)
