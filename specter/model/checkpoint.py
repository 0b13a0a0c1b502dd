"""Reading a Hugging Face checkpoint directory: config.json plus safetensors, single file or sharded.

Tensors are read by their on-disk names, one at a time, and every problem is reported as a
CheckpointError naming the file and the tensor and saying what was expected.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from specter.errors import CheckpointError, abbreviate, unreadable
from specter.model.spec import ModelSpec, declared_dtype, spec_from_config
from specter.paths import json_value

FLOAT_DTYPES = {torch.float32, torch.float16, torch.bfloat16}
_STORED_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # safetensors' header names of FLOAT_DTYPES
_HEADER_DTYPES = _STORED_DTYPES | {  # the others, so that a refusal from the header names the dtype as torch does
    "F64": "float64", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32",
    "U16": "uint16", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
_PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth")


class Checkpoint:
    """An opened checkpoint directory: its config, its ModelSpec and a name -> file index of tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            from specter.builtin import BUILTIN

            missing = "" if self.path.exists() else f" (or a built-in model's name: {', '.join(sorted(BUILTIN))})"
            raise CheckpointError(f"{self.path}: not a directory; pass the checkpoint directory holding config.json and "
                                  f"*.safetensors{missing}")
        self.config = self._read_config()
        self.weight_map: dict[str, str] = {}  # tensor name -> file name, from model.safetensors.index.json when there is one
        self.files = self._find_files()  # first: a pickle checkpoint is refused whatever its config says
        self.spec: ModelSpec = spec_from_config(self.config, str(self.path / "config.json"))
        self.index = self._index_tensors()  # by the names the engine reads (`model.` prefixed), see _add_model_prefix
        self._unprefixed = False  # a base model's save: names in the files lack `model.` (_add_model_prefix)
        self._add_model_prefix()
        self._handles: dict[Path, Any] = {}
        self.spec = self._adapt_expert_prefix(self.spec)
        self.spec = self._stored_dtype(self.spec)

    def _adapt_expert_prefix(self, spec: ModelSpec) -> ModelSpec:
        """transformers v5 writes Mixtral's and Phi-MoE's `block_sparse_moe` as `mlp`, and Phi-MoE's router `gate` as
        `router`; follow whichever the files use (the first MoE layer's router says)."""
        if not spec.moe_layers:
            return spec
        layer = spec.layer_prefix(spec.moe_layers[0])
        for prefix, router in ((spec.expert_prefix, spec.router), ("mlp", "gate"), ("mlp", "router")):
            if f"{layer}.{prefix}.{router}.weight" in self.index:
                return dataclasses.replace(spec, expert_prefix=prefix, router=router)
        return spec  # the loader names the missing router

    def _add_model_prefix(self) -> None:
        """A base model's save (transformers' `model.model.save_pretrained`, or a converter's) names its tensors without
        the `model.` prefix (`embed_tokens.weight`, `layers.0....`); transformers loads it, so index it by the prefixed
        names the engine reads, keeping the names in the file to read them by. Its LM head is the tied embedding."""
        if "model.embed_tokens.weight" in self.index or "embed_tokens.weight" not in self.index:
            return
        self._unprefixed = True
        self.index = {name if name.startswith("lm_head.") else f"model.{name}": file for name, file in self.index.items()}

    def _stored_dtype(self, spec: ModelSpec) -> ModelSpec:
        """Without a dtype in config.json, the checkpoint's is the one its tensors are stored in, as transformers'
        dtype="auto" takes it: the embedding's, from the safetensors header (nothing else is read)."""
        name = "model.embed_tokens.weight"
        if declared_dtype(self.config) is not None or name not in self.index:
            return spec
        stored = _STORED_DTYPES.get(self._handle(name).get_slice(self.disk_name(name)).get_dtype())
        return spec if stored is None else dataclasses.replace(spec, dtype=stored)  # (another dtype: refused when read)

    def disk_name(self, name: str) -> str:
        """The name in the files of the tensor the engine calls `name` (errors name that one)."""
        return name.removeprefix("model.") if self._unprefixed else name

    def _read_config(self) -> dict[str, Any]:
        config_path = self.path / "config.json"
        try:
            config = json_value(config_path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{config_path}: missing; a Hugging Face checkpoint directory needs config.json") from None
        except IsADirectoryError:
            raise CheckpointError(f"{config_path}: a directory, not the model's JSON configuration; replace it with "
                                  "the checkpoint's config.json file") from None
        except OSError as error:
            raise unreadable(config_path, error) from None
        except ValueError as error:  # not JSON, not UTF-8, nested too deeply
            raise CheckpointError(f"{config_path}: not valid JSON ({error})") from None
        if not isinstance(config, dict):
            raise CheckpointError(f"{config_path}: expected a JSON object at the top level")
        return config

    def _find_files(self) -> list[Path]:
        index_path = self.path / "model.safetensors.index.json"
        if index_path.is_file():
            return self._files_from_index(index_path)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            pickles = [name for name in _PICKLE_NAMES if (self.path / name).exists()] + [p.name for p in self.path.glob("pytorch_model-*.bin")]
            if pickles:
                raise CheckpointError(
                    f"{self.path / pickles[0]}: pickle-based checkpoints are refused (loading them can run arbitrary code); "
                    "convert to safetensors, e.g. `model.save_pretrained(path, safe_serialization=True)` in transformers"
                )
            raise CheckpointError(f"{self.path}: no *.safetensors files found")
        return files

    def _files_from_index(self, index_path: Path) -> list[Path]:
        malformed = f"{index_path}: malformed shard index, expected an object with 'weight_map' (tensor name -> file name)"
        try:
            weight_map = json_value(index_path.read_text())["weight_map"]
        except OSError as error:
            raise unreadable(index_path, error) from None
        except (ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"{malformed} ({error!r})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
            raise CheckpointError(f"{malformed}, got 'weight_map' = {abbreviate(weight_map, 80)}")
        self.weight_map = weight_map
        files = sorted({self.path / name for name in weight_map.values()})
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{file}: listed in {index_path.name} but missing")
        return files

    def _index_tensors(self) -> dict[str, Path]:
        index: dict[str, Path] = {}
        for file in self.files:
            for name in self._open(file, check=True).keys():
                index[name] = self._holder(name, index[name], file) if name in index else file
        return index

    def _holder(self, name: str, first: Path, second: Path) -> Path:
        """The file to read a tensor that two files hold: the one the shard index names; without that, an error
        (a stale copy left beside the weights must not win by its file name's sort order)."""
        listed = self.weight_map.get(name)
        if listed is not None and self.path / listed in (first, second):
            return self.path / listed
        where = ("model.safetensors.index.json names neither; fix its weight_map" if self.weight_map
                 else "remove the stale file, or add a model.safetensors.index.json whose weight_map says which file holds each tensor")
        raise CheckpointError(f"{self.path}: tensor '{name}' is in both {first.name} and {second.name}; {where}")

    def _open(self, file: Path, check: bool = False) -> Any:
        try:
            with file.open("rb"):  # safetensors reports a file it may not read as missing
                pass
        except OSError as error:
            raise unreadable(file, error) from None
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except (SafetensorError, OSError, ValueError) as error:
            raise CheckpointError(f"{file}: not a readable safetensors file, truncated or corrupt ({error})") from None
        if check:
            _check_file_size(file, handle)
        return handle

    def has(self, name: str) -> bool:
        return name in self.index

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(self.disk_name(name)).get_shape())

    def _handle(self, name: str) -> Any:
        if name not in self.index:
            raise CheckpointError(f"{self.path}: tensor '{self.disk_name(name)}' is missing from the checkpoint "
                                  f"(files: {', '.join(f.name for f in self.files)})")
        file = self.index[name]
        if file not in self._handles:
            self._handles[file] = self._open(file)
        return self._handles[file]

    def check(self, name: str, shape: tuple[int, ...] | None = None) -> None:
        """What `tensor` checks before it reads, from the safetensors header alone (no tensor data): the tensor exists,
        has `shape` (when given) and holds floating-point weights. `specter info` checks a whole checkpoint this way
        (`weights.check_checkpoint`), so it refuses what a load would, with the load's message."""
        view = self._handle(name).get_slice(self.disk_name(name))
        file, disk = self.index[name], self.disk_name(name)
        found = tuple(view.get_shape())
        if shape is not None and found != tuple(shape):
            raise CheckpointError(f"{file}: tensor '{disk}' has shape {list(found)}, expected {list(shape)} from config.json")
        stored = view.get_dtype()
        if stored not in _STORED_DTYPES:
            named = f"torch.{_HEADER_DTYPES[stored]}" if stored in _HEADER_DTYPES else stored
            raise CheckpointError(f"{file}: tensor '{disk}' has dtype {named}, expected float32, float16 or bfloat16 weights")

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Read one tensor, checking its shape and that it holds floating-point weights (`check`) first."""
        self.check(name, shape)
        file, disk = self.index[name], self.disk_name(name)
        try:
            return self._handle(name).get_tensor(disk)
        except (SafetensorError, OSError, ValueError, RuntimeError) as error:
            raise CheckpointError(f"{file}: tensor '{disk}' cannot be read, the file is truncated or corrupt ({error})") from None

    def close(self) -> None:
        self._handles.clear()


def _check_file_size(file: Path, handle: Any) -> None:
    """A truncated file can still have a valid header; check the data region covers every tensor."""
    with open(file, "rb") as raw:
        header_len = int.from_bytes(raw.read(8), "little")
        header = json.loads(raw.read(header_len))
    end = max((info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"), default=0)
    size = file.stat().st_size
    if size < 8 + header_len + end:
        raise CheckpointError(f"{file}: truncated: the header promises {8 + header_len + end} bytes, the file has {size}")


class InMemoryCheckpoint:
    """A checkpoint whose tensors are already in memory (a state dict), read through the same loaders.

    Used for benchmarks that build a Hugging Face model in memory and for tests; names are on-disk names.
    """

    def __init__(self, config: dict[str, Any], tensors: dict[str, torch.Tensor], name: str = "<memory>") -> None:
        self.path = Path(name)
        self.config = config
        self.spec: ModelSpec = spec_from_config(config, f"{name}/config.json")
        self.tensors = tensors
        self.index = {key: self.path for key in tensors}
        self.files = [self.path]
        self.spec = Checkpoint._adapt_expert_prefix(self, self.spec)  # type: ignore[arg-type]
        embed = tensors.get("model.embed_tokens.weight")
        if declared_dtype(config) is None and embed is not None and embed.dtype in FLOAT_DTYPES:  # as Checkpoint._stored_dtype
            self.spec = dataclasses.replace(self.spec, dtype=str(embed.dtype).removeprefix("torch."))

    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: tensor '{name}' is missing")
        value = self.tensors[name]
        if shape is not None and tuple(value.shape) != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor '{name}' has shape {list(value.shape)}, expected {list(shape)}")
        return value

    def close(self) -> None:
        pass
