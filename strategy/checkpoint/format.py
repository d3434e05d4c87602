"""The checkpoint format interface, and what every format shares.

A format is one way a checkpoint lies on disk. :class:`CheckpointFormat` is what the checkpointer asks of the
ones Cuboid writes (:class:`~cuboid.checkpoint.sharded.ShardedFormat`, a DCP directory;
:class:`~cuboid.checkpoint.full.FullFormat`, one Lightning file); :class:`CheckpointReader` is what it asks of
a format it only reads (:class:`~cuboid.checkpoint.lightning.LightningFormat`, the DCP directories of
Lightning's ModelParallelStrategy and FSDPStrategy). Each call takes one request object, so the arguments are
written once, here. The helpers below (state by parameter name, atomic publish, RNG, Lightning's pickled state)
are shared by the formats.
"""

from __future__ import annotations

import pickle
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from cuboid.adapters import frozen_base_names
from cuboid.storage import COMMIT, RemotePath, commit, readable

META_FILE = "meta.pt"  # Lightning's state beside the DCP shards (the name Lightning's own strategies use)
RNG_DIR = "rng"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class SaveRequest:
    """What a format's ``save`` is given: the path, the state to write, and how to write it."""

    path: Path
    module: nn.Module
    optimizers: Sequence[Optimizer]
    lightning_state: dict[str, Any]  # Lightning's own state (loops, callbacks, schedulers) and Cuboid's
    mesh: Any = None
    group: dist.ProcessGroup | None = None  # a gloo group for checkpoints (async saves; full on NCCL)
    background: bool = False  # write in the background; save returns the thread to join
    model_order: Sequence[str] | None = None  # parameter names before a pipeline split
    storage_writer: Callable[[Path], Any] | None = None  # advanced: directory -> DCP StorageWriter
    stager: Any = None  # a DCP AsyncStager kept across async saves
    checkpoint_io: Any = None  # a user's CheckpointIO plugin: a full file is written with its save_checkpoint


@dataclass
class LoadRequest:
    """What a format's ``load`` is given."""

    path: Path
    module: nn.Module
    optimizers: Sequence[Optimizer] = field(default_factory=list)
    strict: bool = True
    weights_only: bool | None = None  # for Lightning's pickled state: None means True
    model_order: Sequence[str] | None = None
    checkpoint_io: Any = None  # a user's CheckpointIO plugin: a full file is read with its load_checkpoint


class CheckpointReader(Protocol):
    """A checkpoint layout Cuboid loads into any layout of its own."""

    name: str

    def recognizes(self, path: Path) -> bool:
        """True when ``path`` (complete, checked by :func:`check_loadable`) lies in this format."""
        ...

    def load(self, request: LoadRequest) -> dict[str, Any]:
        """Load model (and optimizer) state into this layout; return Lightning's state."""
        ...


class CheckpointFormat(CheckpointReader, Protocol):
    """A checkpoint layout Cuboid also writes (``checkpoint_format=`` names it)."""

    needs_gloo_group: bool  # the format moves host tensors between ranks (on NCCL it needs a gloo group)

    def save(self, request: SaveRequest) -> threading.Thread | None:
        """Write ``request.path`` atomically; with ``background``, return the thread to join before the next."""
        ...


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded here; nothing was changed."""


class LiveWeights(dict):
    """The strategy's ``lightning_module_state_dict()``: empty, for the model is written shard by shard. Where a
    callback moves it (``WeightAveraging``: to ``current_model_state``, its average in ``state_dict``'s place), the
    full format writes the live weights."""


def check_loadable(path: Path, allow_file: bool = False) -> None:
    """Refuse, with a clear message, anything that is not a complete Cuboid checkpoint.

    ``allow_file``: a file passes (a ``checkpoint_format="full"`` checkpoint, checked when read).
    """
    if path.name.startswith(".") and ".tmp" in path.name:
        raise CheckpointError(
            f"{path} is the temporary copy of a save that never finished; load the previous complete "
            f"checkpoint instead (its name has no leading dot)."
        )
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist.")
    if path.is_file() and allow_file:
        return
    if isinstance(path, RemotePath) and not path.is_file() and not (path / COMMIT).is_file():
        raise CheckpointError(
            f"{path} has no commit marker ({COMMIT}): its save never finished (on object storage a checkpoint is "
            "written under its real name and completed by that marker, written last). Load an earlier checkpoint; "
            "ckpt_path='auto' skips this one by itself."
        )
    if path.is_file():
        raise CheckpointError(
            f"{path} is a file, not a Cuboid sharded checkpoint (a directory written by CuboidStrategy with "
            f"'.metadata' and '{META_FILE}')."
        )
    missing = [name for name in (".metadata", META_FILE) if not (path / name).is_file()]
    if missing:
        raise CheckpointError(
            f"{path} is not a complete Cuboid checkpoint: {', '.join(missing)} missing. A save that was "
            f"interrupted leaves only a hidden '.<name>.tmp' directory; load the previous checkpoint."
        )


def _rebase_of(stored: set[str], expected: dict[str, Any]) -> tuple[str, str] | None:
    """``(ours, theirs)``: the name prefix to swap so that this model's parameter names are the checkpoint's, when
    they differ by one leading prefix on either side, as a model trained in a Fabric loop (``layers.0.w``) and the
    same model as a LightningModule's child (``model.layers.0.w``) do; ``None`` when the names already match or no
    one prefix explains the difference. Decided on every rank's names together (pipeline stages hold parts)."""
    wanted = set(expected)
    if dist.is_initialized():
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, wanted)
        wanted = set().union(*everyone)
    have = {k[len("model.") :] for k in stored if k.startswith("model.")}
    if not wanted or not have or wanted == have:
        return None
    first_wanted, first_have = min(wanted), min(have)
    for ours, theirs in (("", first_have[: -len(first_wanted)]), (first_wanted[: -len(first_have)], "")):
        if not (ours or theirs).endswith(".") or not (first_have if theirs else first_wanted).startswith(ours + theirs):
            continue
        if {theirs + k[len(ours) :] for k in wanted if k.startswith(ours)} == have and all(
            k.startswith(ours) for k in wanted
        ):
            return ours, theirs
    return None


def _rebased(state: dict[str, Any], ours: str, theirs: str) -> dict[str, Any]:
    """``state`` (``{"model": ..., "optimizer_<i>": ...}``, flattened) with the parameter-name prefix ``ours``
    replaced by ``theirs`` in every key (the optimizers' ``state.<name>...`` and ``param_groups.<name>...`` too)."""

    def swap(key: str, heads: tuple[str, ...]) -> str:
        for head in heads:
            if key.startswith(head + ours):
                return head + theirs + key[len(head + ours) :]
        return key

    return {
        part: {swap(k, ("",) if part == "model" else ("state.", "param_groups.")): v for k, v in entries.items()}
        for part, entries in state.items()
    }


def _check_keys(path: Path, stored: set[str], expected: dict[str, Any]) -> None:
    """Refuse a checkpoint whose model entries (``model.<fqn>``) are not this model's parameters."""
    wanted = {f"model.{k}" for k in expected}
    if dist.is_initialized():  # pipeline stages each hold part of the model: compare the union
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, wanted)
        wanted = set().union(*everyone)
    have = {k for k in stored if k.startswith("model.")}
    missing, unexpected = sorted(wanted - have), sorted(have - wanted)
    if missing or unexpected:
        raise CheckpointError(
            f"{path} holds another model: {len(missing)} parameters missing (e.g. {[m[6:] for m in missing[:3]]}) "
            f"and {len(unexpected)} unexpected (e.g. {[u[6:] for u in unexpected[:3]]}). Nothing was loaded."
        )


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    """Wait for every rank (nothing to wait for without a process group)."""
    if dist.is_initialized():
        dist.barrier()


def save_failed(path: Path, tmp: Path, err: BaseException) -> CheckpointError:
    """The error a failed save raises: what failed, that nothing was replaced, and where the partial write is."""
    failures = getattr(err, "failures", None)  # DCP's CheckpointException: rank -> (exception, traceback)
    if failures:
        what = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, (e, _) in sorted(failures.items()))
    else:
        what = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    partial = f"the partial write {path} (no commit marker: never loaded)" if isinstance(path, RemotePath) else ""
    partial = partial or f"the partial write {tmp.name}"
    return CheckpointError(
        f"saving {path.name} failed ({what}). Nothing was replaced: the previous "
        f"checkpoints in {path.parent} are intact and resumable; {partial} may be deleted. "
        "Free disk space or fix the directory's permissions, then resume (ckpt_path='auto' picks the newest "
        "complete checkpoint)."
    )


def publish(tmp: Path, path: Path) -> None:
    """Rank 0 moves the finished temporary directory (or file) to its real name, replacing an older one."""
    if rank() != 0:
        return
    if isinstance(path, RemotePath):  # written under its real name (no rename on object storage): the marker, last
        commit(path)
        return
    old = path.with_name(f".{path.name}.old")
    if path.exists() or path.is_symlink():
        remove_path(old)
        path.rename(old)
    tmp.rename(path)
    remove_path(old)


def state_dicts(module: nn.Module, optimizers: Sequence[Optimizer]) -> dict[str, Any]:
    """What both formats store: ``{"model": ..., "optimizer_<i>": ...}``, by parameter name (flattened optimizer
    state), values as this rank holds them (DTensor shards). A PEFT model's frozen base weights are left out: an
    adapter's checkpoint holds the adapter (and its optimizer state); the base comes from where it came at the
    start (``pretrained=``, or the model's own construction), as it does in PEFT's own adapter files."""
    frozen = frozen_base_names(module)
    model = get_model_state_dict(module, options=_OPTIONS)
    state: dict[str, Any] = {"model": {k: v for k, v in model.items() if k not in frozen}}
    for idx, opt in enumerate(optimizers):
        state[f"optimizer_{idx}"] = get_optimizer_state_dict(module, opt, options=_OPTIONS)
    return state


def load_state(
    path: Path, module: nn.Module, optimizers: Sequence[Optimizer], strict: bool, stored: set[str], **dcp_load: Any
) -> None:
    """Read a checkpoint's entries (``stored``: its flattened keys) into this layout with DCP and set them.

    A checkpoint without optimizer entries (``ModelCheckpoint(save_weights_only=True)``) sets the model
    only; Lightning itself refuses to resume training from it, with its own message.
    """
    if not any(k.startswith("optimizer_") for k in stored):
        optimizers = []
    state = state_dicts(module, optimizers)
    names = _rebase_of(stored, state["model"])
    if names is not None:  # the same model one level up or down (a Fabric loop's model, a LightningModule's child)
        state = _rebased(state, *names)
    if strict:
        _check_keys(path, stored, state["model"])
    # A parameter that never had a gradient (a layer the model's forward skips, as LLaVA skips its vision tower's
    # last layer) has no optimizer state in the checkpoint: only what it holds is read; the fresh state stays.
    reading = {
        part: entries
        if not part.startswith("optimizer_")
        else {k: v for k, v in entries.items() if not k.startswith("state.") or f"{part}.{k}" in stored}
        for part, entries in state.items()
    }
    try:
        dcp.load(reading, **dcp_load)
    except Exception as err:  # DCP wraps per-rank read failures
        raise CheckpointError(f"could not read {path} (corrupted or incomplete?): {err}") from err
    for part, entries in reading.items():
        state[part].update(entries)  # (tensors are read in place; other values replaced in the dict read)
    if names is not None:
        state = _rebased(state, names[1], names[0])
    partial = bool(frozen_base_names(module))  # an adapter's checkpoint: the frozen base stays as it is
    set_model_state_dict(module, state["model"], options=StateDictOptions(strict=strict and not partial))
    for idx, opt in enumerate(optimizers):
        set_optimizer_state_dict(module, opt, state[f"optimizer_{idx}"], options=_OPTIONS)


def remove_path(path: Path) -> None:
    """Delete a checkpoint directory, file or link (a link only, never what it points to)."""
    if isinstance(path, RemotePath):
        path.remove_tree()
    elif path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def load_pickled(path: Path, weights_only: bool | None, mmap: bool = False) -> dict[str, Any]:
    """``torch.load`` of Lightning's state (loops, callbacks, hyper-parameters), with ``weights_only`` as given.

    Lightning's state is pickled: only objects torch deems safe load unless ``weights_only=False`` is passed (as
    ``trainer.fit(..., weights_only=False)``), which can run code from the file. ``None`` is passed on as it is, as
    Lightning's own strategies pass it: torch's default then applies, with its environment switches
    (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``, which torch honours only for a caller that left it unset).
    """
    remote = isinstance(path, RemotePath)  # read whole into memory: there is nothing to map
    try:
        return torch.load(readable(path), map_location="cpu", weights_only=weights_only, mmap=mmap and not remote)
    except pickle.UnpicklingError as err:
        if weights_only is False:
            raise CheckpointError(f"could not unpickle {path} (corrupted?): {err}") from err
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(readable(path))
        raise CheckpointError(
            f"{path} holds pickled objects that a weights-only load refuses ({', '.join(unsafe[:4]) or 'see torch'}), "
            "e.g. in the LightningModule's hyper-parameters. If the checkpoint comes from a place you trust, load it "
            "with trainer.fit(..., weights_only=False) (trainer.validate/test/predict take it too), or set "
            "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1."
        ) from None
    except (RuntimeError, EOFError, OSError) as err:
        raise CheckpointError(f"could not read {path} (corrupted or incomplete?): {err}") from err


def same_world(meta: dict[str, Any]) -> bool:
    world = dist.get_world_size() if dist.is_initialized() else 1
    return meta.get("cuboid", {}).get("world_size") == world


def collect_rng() -> dict[str, Any]:
    """This rank's RNG states (torch, CUDA, numpy, random) as tensors and plain values (weights-only loadable)."""
    from cuboid.compat import collect_rng_states

    states = collect_rng_states(include_cuda=torch.cuda.is_available())
    name, keys, pos, has_gauss, cached = states["numpy"]
    states["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    return states


def restore_rng(states: dict[str, Any]) -> None:
    from cuboid.compat import set_rng_states

    name, keys, pos, has_gauss, cached = states["numpy"]
    states["numpy"] = (name, keys.numpy().astype("uint32"), pos, has_gauss, cached)
    set_rng_states(states)


# --- hyper-parameters: what can be stored is, what cannot is left out with a warning -----------------------------
# A LightningModule that calls ``self.save_hyperparameters()`` with a module among its arguments (the network a Hydra
# config instantiates and passes in) keeps that module in ``hparams``. Under DDP the checkpoint pickles it whole;
# under Cuboid ``fully_shard`` gave it a class made at run time (``FSDP<Name>``) that pickle cannot find, and its
# weights are DTensor shards the checkpoint already holds by name. Lightning advises
# ``save_hyperparameters(ignore=[...])`` for modules; Cuboid turns that advice into a warning instead of a crash.

HPARAM_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")  # Lightning's checkpoint keys
_warned: set[tuple[str, str]] = set()


def _why_not_storable(value: Any) -> str | None:
    if isinstance(value, nn.Module):
        return f"it holds a module ({type(value).__name__}), whose weights the checkpoint already stores by name"
    try:
        pickle.dumps(value)
    except Exception as err:  # what pickle raises varies: PicklingError, TypeError, AttributeError
        return f"it cannot be pickled ({type(err).__name__}: {err})"
    return None


def storable_hparams(state: dict[str, Any]) -> list[str]:
    """Replace ``state``'s hyper-parameter dicts (Lightning dumps ``dict(hparams)``, or the OmegaConf container
    itself) by copies without the entries that cannot be stored; return their names (each warned about once per
    process). The module's own ``hparams`` are not touched."""
    left_out = []
    for key in HPARAM_KEYS:
        hparams = state.get(key)
        if not isinstance(hparams, Mapping) or type(hparams).__module__.startswith("omegaconf"):
            continue  # an OmegaConf container holds no modules (OmegaConf refuses them)
        kept = {}
        for name, value in hparams.items():
            reason = _why_not_storable(value)
            if reason is None:
                kept[name] = value
                continue
            left_out.append(name)
            if (key, name) not in _warned:
                _warned.add((key, name))
                rank_zero_warn(
                    f"Cuboid: the hyper-parameter {name!r} is left out of checkpoints: {reason}. To load one with "
                    f"`load_from_checkpoint`, pass it again (`load_from_checkpoint(path, {name}=...)`); to silence "
                    f"this, `self.save_hyperparameters(ignore=[{name!r}])`."
                )
        if len(kept) < len(hparams):
            state[key] = kept
    return left_out
