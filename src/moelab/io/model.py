"""One persistence format for every moelab model: :func:`save` writes ``config.json`` +
``model.safetensors``, which :func:`load` rebuilds in a fresh process, bit-exactly, without the
code that made it and without unpickling anything, from a fixed table of model kinds that other
packages extend with :func:`register_kind` (any other module's weights load with
:func:`load_weights`); every file is written atomically and sha256-verified, ``config.json`` last.
docs/errors.md ("The saved-model format") lists the files and the keys of ``config.json``;
training checkpoints (:mod:`moelab.train.checkpoint`) are this folder plus ``state.pt``.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import stat
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import CheckpointError
from .atomic import atomic_write_bytes, atomic_write_json, sha256_file

__all__ = [
    "CONFIG_NAME",
    "FORMAT",
    "FORMAT_VERSION",
    "KINDS",
    "WEIGHTS_NAME",
    "Kind",
    "load",
    "load_weights",
    "read_config",
    "rebuild",
    "register_kind",
    "resolve",
    "save",
]

FORMAT = "moelab"
FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

# ----------------------------------------------------------------------------- what a model is
#: kind → the module that registers it when imported (a :class:`Persistent` subclass defined there,
#: or :func:`register_kind`): a fixed table, so that loading imports nothing named in a file
_KIND_MODULES = {
    "TransformerLM": "moelab.models.lm",
    "LMClassifier": "moelab.models.classifier",
    "ImageMoE": "moelab.models.vision",
    "SingleModel": "moelab.models.vision",
    "PatchTransformer": "moelab.models.vit",
    "transformers": "moelab.hf.kind",
}
#: the kinds :func:`load` rebuilds: the table's and a bare :class:`moelab.MoE`
KINDS = (*_KIND_MODULES, "MoE")


@dataclass(frozen=True)
class Kind:
    """How :func:`save` describes a model of one kind and :func:`load` rebuilds it.

    Attributes:
        describe: ``model -> config``: the JSON-ready constructor config of a model of this kind,
            ``None`` for a model of another kind.
        build: ``(config, file) -> model``: the model rebuilt from that config, with random
            weights (``file``, the ``config.json`` being read, names it in error messages).
    """

    describe: Callable[[nn.Module], dict[str, Any] | None]
    build: Callable[[dict[str, Any], Path], nn.Module]


_KINDS: dict[str, Kind] = {}


def register_kind(name: str, kind: Kind) -> None:
    """Make ``name`` a kind that :func:`save` records and :func:`load` rebuilds.

    Only the names of the fixed table of kind modules are allowed: :func:`load` imports the
    module of a kind it has not seen registered, and nothing named in a file.

    Raises:
        ValueError: ``name`` is not in the table.
    """
    if name not in _KIND_MODULES:
        raise ValueError(f"kind={name!r} is not allowed; expected one of {list(_KIND_MODULES)}")
    _KINDS[name] = kind


class Persistent:
    """Base of moelab's own models: registers the class as a kind :func:`load` rebuilds, and gives
    it ``save_pretrained`` / ``from_pretrained`` (thin wrappers over :func:`save` / :func:`load`).

    A subclass provides ``moelab_config() -> dict`` (JSON-ready constructor config) and the
    classmethod ``from_moelab_config(config)``.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__name__ in _KIND_MODULES and cls.__module__ == _KIND_MODULES[cls.__name__]:
            register_kind(
                cls.__name__,
                Kind(
                    describe=lambda model: model.moelab_config() if type(model) is cls else None,
                    build=lambda config, file: cls.from_moelab_config(config),
                ),
            )

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """:func:`moelab.save` of this model (``config.json`` + ``model.safetensors``)."""
        return save(self, directory)  # type: ignore[arg-type]

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> Any:
        """:func:`moelab.load` of ``directory`` (a save folder or a run), checked to be an
        instance of this class."""
        model = load(directory)
        if not isinstance(model, cls):
            raise ValueError(
                f"directory={str(directory)!r} holds a {type(model).__name__}; expected a {cls.__name__}"
            )
        return model


def _kinds() -> dict[str, Kind]:
    """Every kind of the table, its module imported (a fixed name, never one read from a file)."""
    for module in _KIND_MODULES.values():
        importlib.import_module(module)
    return _KINDS


def _json_ready(value: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"{what}={value!r} is not allowed; expected JSON-serialisable values ({exc})"
        ) from None


def describe(model: nn.Module) -> tuple[str, dict[str, Any] | None]:
    """``(kind, constructor config)`` of ``model``; ``("module", None)`` for a module moelab
    cannot rebuild."""
    from ..layer import MoE

    if type(model) is MoE and not model.custom_experts:
        return "MoE", _json_ready(model.config.arguments(), "MoE options")
    for name, kind in _kinds().items():
        config = kind.describe(model)
        if config is not None:
            return name, _json_ready(config, f"{name} config")
    return "module", None


def _layer_records(model: nn.Module) -> dict[str, dict[str, Any]]:
    from ..layer import MoE

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, MoE):
            c = m.config
            out[name] = {"method": c.method, "num_experts": c.num_experts, "top_k": c.top_k,
                         "options": dict(c.options)}  # fmt: skip
    return _json_ready(out, "MoE layer options")


def _context_of(model: nn.Module) -> Any:
    from ..layer import moe_layers

    return next((layer.ctx for layer in moe_layers(model) if layer.ctx is not None), None)


# ----------------------------------------------------------------------------- tensors
def _tensors(model_or_state: nn.Module | Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors to store and the tied keys (``alias -> source``).  The one rule for tied
    weights: a key whose tensor is the same view (storage, offset, shape, stride, dtype) as an
    earlier key is stored once, under the earlier key."""
    state = model_or_state.state_dict() if isinstance(model_or_state, nn.Module) else model_or_state
    out: dict[str, Tensor] = {}
    tied: dict[str, str] = {}
    views: dict[tuple, str] = {}
    for key, value in state.items():
        if not isinstance(value, Tensor):
            raise ValueError(f"state entry {key!r} is a {type(value).__name__}; expected a tensor")
        if _is_dtensor(value):  # FSDP2 / expert-parallel shards: a local block is not the weight
            raise ValueError(
                f"state entry {key!r} is sharded (a DTensor: FSDP2 or expert parallelism); gather the full "
                "weights on every rank with moelab.train.parallelize.full_state_dict(model) and save that "
                "dict from rank 0"
            )
        view = (value.device, value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
                value.stride(), value.dtype)  # fmt: skip
        if value.numel() and view in views:
            tied[key] = views[view]
            continue
        views[view] = key
        t = value.detach().to("cpu").contiguous()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.data_ptr() in {
            o.data_ptr() for o in out.values() if o.numel()
        }:
            t = t.clone()  # safetensors refuses shared or partial storage
        out[key] = t
    return out, tied


def _is_dtensor(value: Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _canonical(config: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in config.items() if k != "sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")


def save(
    model: nn.Module | Mapping[str, Tensor],
    directory: str | os.PathLike,
    *,
    ctx: Any = None,
    metadata: Mapping[str, Any] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    sharded_files: Mapping[str, str] | None = None,
) -> Path:
    """Write ``model`` to ``directory`` as ``config.json`` + ``model.safetensors``.

    Args:
        model: any module; moelab's models, a bare :class:`moelab.MoE` and upcycled / converted
            transformers models are rebuilt by :func:`load`, any other module's weights (or a
            state dict's: ``moelab.train.parallelize.full_state_dict`` of a sharded model) load with
            :func:`load_weights`.
        directory: created if missing; the files in it are replaced atomically.
        ctx: the :class:`moelab.RoutingContext` to record (default: the one attached to the
            model's MoE layers, if any).
        metadata: JSON-serialisable extra facts (step, validation metric), under ``"metadata"``.
        extra_files: more files of the folder (name → bytes), written with the same writer and
            recorded with their sha256 (a training checkpoint's ``state.pt``).
        sharded_files: the weights are already in ``directory`` as ``torch.distributed.checkpoint``
            shards (name → sha256 of each file, ``.metadata`` included; a sharded training
            checkpoint): no ``model.safetensors`` is written, ``config.json`` records
            ``"weights": "dcp"`` and vouches for those files (:mod:`moelab.io.sharded`); ``model``
            then gives only the structure (kind, config, dtype).

    Returns:
        the directory.
    """
    from .._version import __version__

    if not isinstance(model, (nn.Module, Mapping)):
        raise ValueError(
            f"model={type(model).__name__} is not allowed; expected a torch.nn.Module or a state dict"
        )
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"directory={str(directory)!r} is not allowed; it exists and is not a folder")
    module = model if isinstance(model, nn.Module) else nn.Module()  # a state dict: weights only
    kind, config = describe(module) if module is model else ("module", None)
    ctx = _context_of(module) if ctx is None else ctx
    if sharded_files is None:
        tensors, tied = _tensors(model)
        floating = [t.dtype for t in tensors.values() if t.is_floating_point()]
    else:  # the structure's own dtypes, nothing copied (its weights are not the saved ones)
        tied, floating = {}, [t.dtype for t in module.state_dict().values() if t.is_floating_point()]
    payload: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "moelab_version": __version__,
        "kind": kind,
        "config": config,
        "dtype": str(floating[0]).removeprefix("torch.") if floating else None,
        "moe_layers": _layer_records(module),
        "routing_context": None if ctx is None else ctx.state_dict(),
        "tied": tied,
        "metadata": _json_ready(dict(metadata or {}), "metadata"),
    }
    from safetensors.torch import save as st_save

    directory.mkdir(parents=True, exist_ok=True)
    files = {} if sharded_files is not None else {WEIGHTS_NAME: st_save(tensors, metadata={"format": FORMAT})}
    for name, data in (extra_files or {}).items():
        if (
            name in (CONFIG_NAME, WEIGHTS_NAME)
            or "/" in name
            or name.startswith(".")
            or name in (sharded_files or {})
        ):
            raise ValueError(f"extra_files name {name!r} is not allowed; expected a plain new file name")
        files[name] = data
    digests = dict(sharded_files or {})
    if sharded_files is not None:
        from .sharded import METADATA_NAME, SHARDED

        if METADATA_NAME not in digests:
            raise ValueError(
                f"sharded_files={sorted(digests)[:4]} is not allowed; expected the folder's "
                f"torch.distributed.checkpoint files, {METADATA_NAME} included"
            )
        payload["weights"] = SHARDED
    for name, data in files.items():
        atomic_write_bytes(directory / name, data)
        digests[name] = hashlib.sha256(data).hexdigest()
    payload["files"] = digests
    payload["sha256"] = hashlib.sha256(_canonical(payload)).hexdigest()
    atomic_write_json(directory / CONFIG_NAME, payload)  # last: it vouches for the others
    return directory


# ----------------------------------------------------------------------------- reading
def resolve(path: str | os.PathLike) -> Path:
    """The saved-model folder that ``path`` names.

    * a folder with ``config.json`` (:func:`save`, ``moelab upcycle``, a checkpoint
      ``ckpt/step-*``): itself;
    * a run directory (``config.yaml``; ``moelab train`` / ``compare`` / ``finetune``):
      ``best/``, the best-validation weights with the routing context the run's test figure
      (``test_bpc`` / ``test_acc`` in ``metrics.json``) was computed with; without one (a run
      stopped before its first evaluation), its newest checkpoint that verifies.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} does not exist or is not a folder; expected a moelab.save folder or a run"
        )
    if (path / CONFIG_NAME).is_file():
        return path
    if (path / "config.yaml").is_file():
        if (path / "best" / CONFIG_NAME).is_file():
            return path / "best"
        latest = latest_checkpoint(path / "ckpt")
        if latest is not None:
            if (path / "best").exists():  # deleted, or a save killed before its last file
                warnings.warn(
                    f"{str(path / 'best' / CONFIG_NAME)!r} is missing; loading the newest checkpoint "
                    f"{latest.name}, not the best-validation weights",
                    stacklevel=2,
                )
            return latest
        if (path / "best.safetensors").is_file():
            raise CheckpointError(
                f"{str(path / 'best.safetensors')!r} is in the format of moelab < 0.2; re-run the run to "
                "write best/ (config.json + model.safetensors)"
            )
        raise CheckpointError(f"run {str(path)!r} holds no saved model (best/ or ckpt/step-*/)")
    raise CheckpointError(f"{str(path / CONFIG_NAME)!r} is missing; not a moelab.save folder or a run")


def weights_digest(path: str | os.PathLike) -> str | None:
    """The sha256 of the ``config.json`` of the weights :func:`load` of ``path`` reads (it holds the
    sha256 of every weight file): what a result derived from a run's model (``diagnostics.json``,
    ``benchmark``'s ``cost.json``) records, to be found stale once the run is trained on.  ``None``:
    ``path`` holds no saved model."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return sha256_file(resolve(path) / CONFIG_NAME)
    except (CheckpointError, OSError):
        return None


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Checkpoint folders ``step-*`` under ``root`` (a run's ``ckpt/``), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if p.is_dir())


def latest_checkpoint(root: str | os.PathLike, verify: Callable[[Path], Any] | None = None) -> Path | None:
    """The newest checkpoint under ``root`` that verifies (``verify``, default :func:`read_config`);
    a bad one is skipped with a warning naming its file.  ``None`` when there is none."""
    for path in reversed(list_checkpoints(root)):
        try:
            (verify or read_config)(path)
        except CheckpointError as exc:
            warnings.warn(f"{exc}; falling back to an older checkpoint", stacklevel=2)
            continue
        return path
    return None


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` of the folder :func:`resolve` finds, verified: its own digest and the
    sha256 of every file it lists (a mismatch raises :class:`CheckpointError` naming the file)."""
    directory = resolve(path)
    file = directory / CONFIG_NAME
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{str(file)!r} is corrupted (not JSON)") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        got = config.get("format") if isinstance(config, dict) else None
        raise CheckpointError(f"{str(file)!r} has format={got!r}; expected {FORMAT!r} (a moelab.save folder)")
    if config.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{str(file)!r} has format_version={config.get('format_version')!r}; this moelab reads "
            f"{FORMAT_VERSION}"
        )
    if hashlib.sha256(_canonical(config)).hexdigest() != config.get("sha256"):
        raise CheckpointError(f"{str(file)!r} is corrupted or was edited (sha256 does not match its content)")
    files = config.get("files")
    weights = _weights_file(config)
    if not isinstance(files, dict) or weights not in files:
        raise CheckpointError(
            f"{str(file)!r} lists no {weights} in its files; a moelab.save folder lists (and "
            "verifies) every file it holds"
        )
    for name, digest in files.items():
        if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
            raise CheckpointError(
                f"{str(file)!r} lists the file {name!r}; expected plain file names inside {str(directory)!r}"
            )
        if not (isinstance(digest, str) and len(digest) == 64):
            raise CheckpointError(f"{str(file)!r} has sha256={digest!r} for {name!r}; expected 64 hex digits")
        f = directory / name
        try:
            mode = os.lstat(f).st_mode
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {f} is missing") from None
        if not stat.S_ISREG(mode):  # a link or a device (/dev/zero would never end) is not read
            raise CheckpointError(f"checkpoint file {f} is not a regular file (a link or a device); refused")
        if sha256_file(f) != digest:
            raise CheckpointError(f"checkpoint file {f} is truncated or corrupted (sha256 mismatch)")
    config["directory"] = str(directory)
    return config


def _weights_file(config: Mapping[str, Any]) -> str:
    """The file that holds (or indexes) the weights: ``model.safetensors``, or DCP's ``.metadata``
    for a sharded checkpoint (``"weights": "dcp"``)."""
    from .sharded import METADATA_NAME, SHARDED

    return METADATA_NAME if config.get("weights") == SHARDED else WEIGHTS_NAME


def _load_tensors(directory: Path, config: dict[str, Any], model: nn.Module) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    from .sharded import SHARDED, read_tensors

    if config.get("weights") == SHARDED:  # every rank's shards, gathered here (no process group)
        return read_tensors(directory, config["files"], "model.")

    file = directory / WEIGHTS_NAME
    try:
        tensors = load_file(str(file))
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(f"{str(file)!r} cannot be read: {str(exc).splitlines()[0]}") from None
    for alias, source in config.get("tied", {}).items():
        tensors[alias] = tensors[source]
    return tensors


def load_weights(path: str | os.PathLike, model: nn.Module, *, strict: bool = True) -> dict[str, Any]:
    """Load the verified weights of a saved folder (or a run: :func:`resolve`) into ``model``,
    bit-exactly, and its routing context; returns the verified ``config.json``.

    A model whose MoE layers have no routing context gets the saved one (its step, planned steps and
    schedule), attached: it routes as the saved model (StableMoE past its stage switch routes with
    its frozen light router).  A context already attached (a trainer's) is left as it is."""
    return _load_weights(path, model, strict, keep_attached=True)


def _load_weights(
    path: str | os.PathLike, model: nn.Module, strict: bool, keep_attached: bool
) -> dict[str, Any]:
    """:func:`load_weights`; ``keep_attached=False`` replaces an attached context (:func:`load`)."""
    config = read_config(path)
    directory = Path(config["directory"])
    tensors = _load_tensors(directory, config, model)
    file = directory / _weights_file(config)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{str(file)!r} does not fit the model: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}"
        )
    try:
        with torch.no_grad():
            model.load_state_dict(tensors, strict=False)
    except RuntimeError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        raise CheckpointError(
            f"{str(file)!r} does not fit the model: {' '.join(lines[1:3] or lines)}"
        ) from None
    _restore_routing(model, config, directory / CONFIG_NAME, keep_attached)
    return config


def _restore_routing(model: nn.Module, config: dict[str, Any], file: Path, keep_attached: bool) -> None:
    from ..layer import attach, moe_layers
    from ..routing import RoutingContext
    from ..schedules import schedule_from_state

    state = config.get("routing_context")
    layers = moe_layers(model)
    if state is None or not layers:
        return
    if keep_attached and any(layer.ctx is not None for layer in layers):
        return  # the caller's context (a trainer's) is its own
    try:
        saved = {**state, "schedule": _schedule_state(state)}
        ctx = RoutingContext(
            total_steps=state.get("total_steps"), schedule=schedule_from_state(saved["schedule"])
        )
        ctx.load_state_dict(saved)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{str(file)!r} has a routing_context that does not rebuild: {e}") from None
    attach(model, ctx)


def rebuild(kind: str, config: dict[str, Any]) -> nn.Module:
    """A new model of ``kind`` from its constructor ``config`` (what :func:`describe` gives and
    :func:`load` rebuilds from), with fresh weights: how :mod:`moelab.prune` builds a model of the
    same class with fewer experts."""
    return _build(kind, config, Path("<in memory>"))


def _build(kind: str, config: dict[str, Any], file: Path) -> nn.Module:
    if kind == "MoE":
        from ..layer import MoE

        c = dict(config)
        return MoE(**{k: v for k, v in c.items() if k != "options"}, **c.get("options", {}))
    if kind == "module":
        raise CheckpointError(
            f"{str(file)!r} holds kind='module' (a module moelab cannot rebuild); build the model and "
            "load the weights with moelab.io.load_weights(path, model)"
        )
    if kind not in _KIND_MODULES:
        raise CheckpointError(f"{str(file)!r} has kind={kind!r}; expected one of {list(KINDS)} or 'module'")
    return _kinds()[kind].build(config, file)


#: the schedule records of folders saved before the routing context carried its schedule's
#: ``state_dict``: ``{"type": class name, "args": constructor arguments}``
_RECORDED_SCHEDULES = {"CompetitionSchedule": "competition", "CoinFlipSchedule": "coin-flip"}


def _schedule_state(routing_context: Mapping[str, Any]) -> dict[str, Any] | None:
    """The schedule's ``state_dict`` in a saved ``routing_context``, in either form it was written."""
    schedule = routing_context.get("schedule")
    if isinstance(schedule, Mapping) and set(schedule) == {"type", "args"}:
        return {"type": _RECORDED_SCHEDULES.get(schedule["type"], schedule["type"]), **schedule["args"]}
    return schedule


#: safetensors' names of the floating dtypes (its header's ``dtype`` field)
_SAFETENSORS_FLOATS = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


def _match_saved_dtypes(model: nn.Module, file: Path) -> None:
    """Give each floating parameter and buffer of ``model`` the dtype its tensor has in ``file``
    (read from the header, no data): a model saved with bf16 experts and float32 routers comes
    back so, not cast to one dtype."""
    from safetensors import safe_open

    from .sharded import METADATA_NAME, entry_keys

    if file.name == METADATA_NAME:  # a sharded checkpoint: its index records the dtypes
        files = read_config(file.parent)["files"]
        saved = {
            k.removeprefix("model."): e.properties.dtype for k, e in entry_keys(file.parent, files).items()
        }
        saved = {k: v for k, v in saved.items() if v.is_floating_point}
    else:
        saved = _safetensors_dtypes(file, safe_open)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    with torch.no_grad():
        for name, t in tensors:
            dtype = saved.get(name)
            if t is not None and t.is_floating_point() and dtype is not None and t.dtype != dtype:
                t.data = t.data.to(dtype)


def _safetensors_dtypes(file: Path, safe_open: Any) -> dict[str, Any]:
    try:
        with safe_open(str(file), "pt") as f:
            return {k: _SAFETENSORS_FLOATS.get(f.get_slice(k).get_dtype()) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(f"{str(file)!r} cannot be read: {str(exc).splitlines()[0]}") from None


def load(path: str | os.PathLike) -> nn.Module:
    """Rebuild the model saved in ``path`` (see :func:`resolve`: a :func:`save` folder, a
    checkpoint, or a run directory, whose ``best/`` is returned) and restore its routing context.

    Every file is verified first (sha256); nothing is unpickled.  The model comes back in eval
    mode, on the CPU, each tensor in its saved dtype (mixed dtypes included), bit-exact, its MoE layers attached to a
    :class:`moelab.RoutingContext` at the saved step (so StableMoE routes with its frozen light
    router after the stage switch, as at the end of training).
    """
    config = read_config(path)
    directory = Path(config["directory"])
    file = directory / CONFIG_NAME
    model = _build(config.get("kind"), config.get("config") or {}, file)
    dtype = config.get("dtype")
    if dtype is not None:
        target = getattr(torch, dtype, None)
        if not isinstance(target, torch.dtype):
            raise CheckpointError(f"{str(file)!r} has dtype={dtype!r}; expected a torch dtype name")
        if any(p.is_floating_point() and p.dtype != target for p in model.parameters()):
            model.to(target)
    _match_saved_dtypes(model, directory / _weights_file(config))  # mixed dtypes (bf16 experts, fp32 routers)
    rebuilt = _layer_records(model)
    if rebuilt != config.get("moe_layers", {}):
        raise CheckpointError(
            f"{str(file)!r}: the rebuilt model's MoE layers do not match moe_layers "
            f"({sorted(rebuilt)[:3]} vs {sorted(config.get('moe_layers', {}))[:3]})"
        )
    _load_weights(directory, model, True, keep_attached=False)  # and a new routing context
    return model.eval()
