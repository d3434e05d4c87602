"""Pretrained weights straight into the sharded layout: ``CuboidStrategy(pretrained={"model": PATH})``.

``PATH`` is read twice. Before anything is parallelized, every rank reads only its *index* (safetensors
headers, a DCP ``.metadata``, a memory-mapped file's tensor shapes) and checks it against the submodule: the
names (1:1, through the module's ``pretrained_names()`` adapter, or with the submodule's prefix, whichever
matches), the shapes and the dtypes; anything wrong stops every rank with the whole list, before any work.
After parallelizing, each rank reads *only the slices it holds* with ``torch.distributed.checkpoint``'s load
planner: safetensors files (a Hugging Face directory, or one file) memory-mapped (only the pages of a rank's
slices are read), a Cuboid sharded checkpoint through DCP's own reader, a full-format Cuboid file memory-mapped. A file's dtype is cast to the parameter's (bf16 weights into fp32 master weights).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from cuboid import compat
from cuboid.adapters import base_name, is_adapter_name, peft_models
from cuboid.checkpoint.packed import PackedExperts, per_expert_keys, saved_name

# safetensors dtype names: those Cuboid reads into floating-point parameters (cast to the parameter's dtype), then
# every name it maps to a torch dtype (and back, for DCP metadata and a full file).
_FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_VIEW_DTYPES = {**_FLOAT_DTYPES, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                "U8": torch.uint8, "BOOL": torch.bool}  # fmt: skip
_TORCH_NAMES = {dtype: name for name, dtype in _VIEW_DTYPES.items()}


class PretrainedError(ValueError):
    """A ``pretrained=`` source that cannot fill its submodule exactly (raised before training starts)."""


@dataclass
class _Source:
    """What a weights path holds: ``kind`` (``"safetensors"``, ``"dcp"``, ``"full"``) and each tensor's shape
    and dtype name by its key there."""

    path: Path
    kind: str
    tensors: dict[str, tuple[tuple[int, ...], str]]
    files: list[Path] = field(default_factory=list)
    config: dict | None = None
    mapped: dict[str, torch.Tensor] | None = None  # the full-format file's tensors, memory-mapped
    packed: dict[str, list[list[str]]] = field(default_factory=dict)  # packed experts key -> its per-expert keys


def _open_source(path: str | Path, what: str) -> _Source:
    """Read the index of a weights path (no tensor data)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise PretrainedError(
            f"pretrained weights for {what!r}: {path} does not exist. Give a Hugging Face model directory "
            "(model.safetensors or model.safetensors.index.json), a .safetensors file, or a Cuboid checkpoint."
        )
    if path.is_dir() and (path / ".metadata").is_file():
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = dcp.FileSystemReader(path).read_metadata()
        tensors = {
            key[len("model.") :]: (tuple(m.size), _TORCH_NAMES.get(m.properties.dtype, str(m.properties.dtype)))
            for key, m in metadata.state_dict_metadata.items()
            if key.startswith("model.") and isinstance(m, TensorStorageMetadata)
        }
        return _Source(path, "dcp", tensors)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        index = path / "model.safetensors.index.json"
        if index.is_file():
            listed = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
            absent = [f.name for f in listed if not f.is_file()]
            if absent:
                raise PretrainedError(
                    f"pretrained weights for {what!r}: {index} lists {len(absent)} file(s) that are not there: "
                    f"{', '.join(absent[:5])}. Finish the download (all shards) and start again."
                )
            stray = sorted(set(files) - set(listed))
            if stray:
                raise PretrainedError(
                    f"pretrained weights for {what!r}: {path} holds .safetensors files its index does not list: "
                    f"{', '.join(f.name for f in stray[:5])}. Move them out of the directory."
                )
        if not files:
            present = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
            raise PretrainedError(
                f"pretrained weights for {what!r}: {path} has no .safetensors files and no DCP .metadata (it holds "
                f"{present}). Download the model's safetensors weights, or point at a Cuboid checkpoint."
            )
        config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else None
        return _Source(path, "safetensors", _safetensors_index(files), files, config)
    if path.suffix == ".safetensors":
        return _Source(path, "safetensors", _safetensors_index([path]), [path])
    return _full_file(path, what)


def _safetensors_index(files: list[Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    from safetensors import safe_open

    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                piece = f.get_slice(key)
                tensors[key] = (tuple(piece.get_shape()), piece.get_dtype())
    return tensors


def _full_file(path: Path, what: str) -> _Source:
    from cuboid.checkpoint.format import CheckpointError, load_pickled

    try:
        state = load_pickled(path, weights_only=None, mmap=True).get("state_dict")
    except (CheckpointError, RuntimeError, OSError) as err:
        raise PretrainedError(
            f"pretrained weights for {what!r}: {path} is neither a .safetensors file nor a Cuboid checkpoint ({err})."
        ) from err
    if not isinstance(state, dict):
        raise PretrainedError(f"pretrained weights for {what!r}: {path} has no 'state_dict': not a Cuboid checkpoint.")
    tensors = {k: (tuple(v.shape), _TORCH_NAMES.get(v.dtype, str(v.dtype))) for k, v in state.items()}
    return _Source(path, "full", tensors, mapped=state)


@dataclass
class Plan:
    """How one submodule's tensors are found in its source: ``keys`` maps each name (relative to the submodule,
    tied names included) to its key in the source."""

    submodule: str
    source: _Source
    keys: dict[str, str]

    def lightning_names(self) -> set[str]:
        return {f"{self.submodule}.{name}" for name in self.keys}


def _expected(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, list[str]], set[str]]:
    """The tensors a weights file must fill (parameters and persistent buffers, by every name), the alias groups
    of tied ones (first name -> names), and the non-persistent buffers' names (never in a file)."""
    tensors: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    transient: set[str] = set()
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for name, buf in mod.named_buffers(recurse=False):
            full = f"{mod_name}.{name}" if mod_name else name
            if name in mod._non_persistent_buffers_set:
                transient.add(full)
            else:
                tensors[full] = buf
    groups: dict[int, list[str]] = {}
    for name, tensor in tensors.items():
        groups.setdefault(id(tensor), []).append(name)
    return tensors, {names[0]: names for names in groups.values()}, transient


def plan_submodule(lm: nn.Module, submodule: str, path: str | Path) -> Plan:
    """Check a source against one submodule of the (still unsharded, usually meta) LightningModule."""
    try:
        module = lm.get_submodule(submodule)
    except AttributeError:
        children = [n for n, _ in lm.named_children()]
        raise PretrainedError(
            f"pretrained={{{submodule!r}: ...}}: {type(lm).__name__} has no submodule {submodule!r} (built in "
            f"__init__ or configure_model); its children are {children}."
        ) from None
    source = _open_source(path, submodule)
    tensors, groups, transient = _expected(module)
    prefix = f"{submodule}."
    candidates: dict[str, dict[str, str]] = {}
    adapter = getattr(module, "pretrained_names", None)
    peft = source.kind not in ("dcp", "full") and any(not n for n, _ in peft_models(module))
    if peft:  # a PEFT model: the file is its base model's; the adapters get PEFT's own init
        tensors = {n: t for n, t in tensors.items() if not is_adapter_name(n)}
        groups = {first: [n for n in names if n in tensors] for first, names in groups.items() if first in tensors}
        # the wrapped model's own adapter (Cuboid's Llama: Hugging Face names), which sees PEFT's LoRA layers too
        own = dict(adapter()) if callable(adapter) else {}
        inner = {name: name.removeprefix("base_model.model.") for name in tensors}
        candidates["base model"] = {name: own.get(inner[name], base_name(name)) for name in tensors}
    if source.kind in ("dcp", "full"):  # a Cuboid checkpoint: the LightningModule's own names
        candidates["checkpoint"] = {name: prefix + name for name in tensors}
    else:
        if callable(adapter):
            names = dict(adapter())
            candidates["adapter"] = {name: names.get(name, name) for name in tensors}
        candidates["1:1"] = {name: name for name in tensors}
        candidates["prefixed"] = {name: prefix + name for name in tensors}
        renamed = compat.saved_names(module, source.tensors) if source.kind == "safetensors" else {}
        if renamed:  # transformers' own renames of what it saves (LLaVA's language_model.model.layers...)
            candidates["by transformers' renames"] = {name: renamed.get(name, name) for name in tensors}
    label, keys = max(candidates.items(), key=lambda kv: sum(k in source.tensors for k in kv[1].values()))
    if source.kind == "safetensors":  # transformers' save format: renamed blocks, experts one by one
        keys.update(
            {n: saved for n, k in keys.items() if k not in source.tensors and (saved := saved_name(k, source.tensors))}
        )
        _find_packed_experts(source, {keys[n]: t for n, t in tensors.items()})
    # A tied name absent from the file (Hugging Face saves one of them) reads its group's first present key.
    for names in groups.values():
        present = next((keys[n] for n in names if keys[n] in source.tensors), None)
        if present is not None:
            keys.update({n: present for n in names if keys[n] not in source.tensors})
    problems: list[str] = []
    _missing_and_unexpected(source, keys, groups, transient, prefix if label in ("checkpoint", "prefixed") else "",
                            problems)  # fmt: skip
    for name, tensor in tensors.items():
        key = keys[name]
        if key not in source.tensors:
            continue
        shape, dtype = source.tensors[key]
        if tuple(tensor.shape) != shape:
            problems.append(
                f"shape of {key!r}: {list(shape)} in the file, {list(tensor.shape)} in {prefix}{name} "
                "(another model size or config?)"
            )
        elif tensor.is_floating_point() and dtype not in _FLOAT_DTYPES:
            problems.append(
                f"dtype of {key!r}: {dtype}, unsupported for the {str(tensor.dtype)[6:]} parameter {prefix}{name} "
                f"(Cuboid reads {', '.join(_FLOAT_DTYPES)}; dequantize the weights first)"
            )
        elif not tensor.is_floating_point() and _TORCH_NAMES.get(tensor.dtype) != dtype:
            problems.append(f"dtype of {key!r}: {dtype} in the file, {tensor.dtype} in {prefix}{name}")
    check_config = getattr(module, "check_pretrained_config", None)
    if source.config is not None and callable(check_config):
        problems += [f"config.json: {p}" for p in check_config(source.config)]
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise PretrainedError(
            f"pretrained weights for {submodule!r} from {source.path} do not fit {type(module).__name__} "
            f"(names matched {label}; nothing was loaded):\n  {shown}"
        )
    return Plan(submodule, source, keys)


def _find_packed_experts(source: _Source, wanted: dict[str, torch.Tensor]) -> None:
    """Packed experts parameters the file keeps one expert at a time (transformers' save format): listed in
    ``source.tensors`` under the packed key, with the shape they make, and their per-expert keys kept."""
    for key, tensor in wanted.items():
        if key in source.tensors or tensor.dim() != 3:
            continue
        recipe = per_expert_keys(key, tensor.shape[0], source.tensors)
        if recipe is None:
            continue
        rows = sum(source.tensors[k][0][0] for k in recipe[0])
        source.tensors[key] = (
            (len(recipe), rows, *source.tensors[recipe[0][0]][0][1:]),
            source.tensors[recipe[0][0]][1],
        )
        source.packed[key] = recipe


def _missing_and_unexpected(
    source: _Source,
    keys: dict[str, str],
    groups: dict[str, list[str]],
    transient: set[str],
    prefix: str,
    problems: list[str],
) -> None:
    wanted = set(keys.values()) | {k for recipe in source.packed.values() for ks in recipe for k in ks}
    pool = [k for k in source.tensors if k.startswith(prefix) and k not in source.packed]
    ignorable = {prefix + t for t in transient} | set(transient)  # old files carry e.g. rotary inv_freq
    missing = [keys[names[0]] for names in groups.values() if keys[names[0]] not in source.tensors]
    unexpected = [k for k in pool if k not in wanted and k not in ignorable]
    for key in missing[:10]:
        # a key the model does not use is the likelier counterpart (a renamed tensor) than one it does
        close = difflib.get_close_matches(key, unexpected, n=1, cutoff=0.5) or difflib.get_close_matches(
            key, pool, n=1, cutoff=0.5
        )
        problems.append(f"missing {key!r}" + (f" (closest in the file: {close[0]!r})" if close else ""))
    if len(missing) > 10:
        problems.append(f"... {len(missing) - 10} more missing")
    for key in unexpected[:10]:
        close = difflib.get_close_matches(key, sorted(wanted), n=1, cutoff=0.5)
        problems.append(f"unexpected {key!r}" + (f" (closest expected: {close[0]!r})" if close else ""))
    if len(unexpected) > 10:
        problems.append(f"... {len(unexpected) - 10} more unexpected")


def plan_all(lm: nn.Module, pretrained: Mapping[str, str | Path]) -> list[Plan]:
    return [plan_submodule(lm, sub, path) for sub, path in pretrained.items()]


@torch.no_grad()
def load(lm: nn.Module, plan: Plan) -> None:
    """Read this rank's slices of the planned tensors into the (sharded) submodule, in place."""
    module = lm.get_submodule(plan.submodule)
    state: dict[str, torch.Tensor] = {}
    copies: list[tuple[torch.Tensor, str]] = []  # a second tensor for one key (a tie split by pipeline stages)
    seen: set[int] = set()
    current = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers())}
    for name, tensor in current.items():
        if name not in plan.keys or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        key = plan.keys[name]
        if key in state:
            copies.append((tensor, key))
        else:
            state[key] = tensor
    kind = plan.source.kind
    if kind == "dcp":
        dcp.load({f"model.{k}": v for k, v in state.items()}, storage_reader=dcp.FileSystemReader(plan.source.path))
    elif kind == "full":
        from cuboid.checkpoint.full import _MappedReader

        assert plan.source.mapped is not None
        dcp.load({f"w.{k}": v for k, v in state.items()}, storage_reader=_MappedReader({"w": plan.source.mapped}))
    else:
        _load_safetensors(plan.source, state)
    for tensor, key in copies:
        tensor.copy_(state[key])


def _load_safetensors(source: _Source, state: dict[str, torch.Tensor]) -> None:
    """Every file memory-mapped; DCP's planner copies out this rank's slices. Measured as fast as DCP's own
    ``HuggingFaceStorageReader`` with the same peak memory (README, "Fine-tune a pretrained model"), and it also
    reads one file that sits among others (that reader takes every ``.safetensors`` of a directory)."""
    from cuboid.checkpoint.full import _MappedReader

    mapped: dict[str, Any] = {}
    for file in source.files:
        mapped.update(_mmap_safetensors(file))
    for key, recipe in source.packed.items():  # read region by region: each rank its own experts
        mapped[key] = PackedExperts([[mapped[k] for k in ks] for ks in recipe])
    dcp.load({f"w.{k}": v for k, v in state.items()}, storage_reader=_MappedReader({"w": mapped}))


def _mmap_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A ``.safetensors`` file's tensors as views of one private memory map: only the pages a slice touches
    are read. (Layout: an 8-byte little-endian header length, a JSON header, then the raw data.)"""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    data = torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)[8 + length :]
    out = {}
    for key, entry in header.items():
        start, end = entry["data_offsets"]
        raw = data[start:end]
        dtype = _VIEW_DTYPES[entry["dtype"]]
        try:
            tensor = raw.view(dtype)
        except RuntimeError:  # an unaligned offset: copy this tensor's bytes
            tensor = raw.clone().view(dtype)
        out[key] = tensor.view(entry["shape"])
    return out
