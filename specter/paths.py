"""Checks on the files and folders a user names for output, made before any work so a typo costs nothing."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

from specter.errors import ConfigError


def json_value(text: str | bytes) -> Any:
    """json.loads whose every failure on a document is a ValueError: a deeply nested one (`[[[[...`) raises
    RecursionError in the decoder, which callers catching ValueError (JSONDecodeError, UnicodeDecodeError) let
    through as a traceback."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None


# The files of a Hugging Face checkpoint folder the engine or its tokenizer reads: the weights (shards may sit in
# subfolders the index names), configurations, tokenizer files and chat templates.
CHECKPOINT_FILES = ("**/*.safetensors", "config.json", "generation_config.json", "model.safetensors.index.json",
                    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "chat_template.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


def check_not_an_input(path: str | Path, inputs: str | Path | None, option: str) -> None:
    """Refuse an output path that is a checkpoint file of the folder `inputs` (the checkpoint the run reads), by
    any name (a link, another path): writing it would destroy the model, and a float32 checkpoint's weights are
    mapped from their files, so the run would read the truncated file. A new file in that folder, or another one
    there (an earlier trace, an earlier report), is no harm."""
    path = Path(path)
    folder = Path(inputs) if inputs is not None else None
    if folder is None or not folder.is_dir() or not path.exists():
        return
    for file in (file for pattern in CHECKPOINT_FILES for file in folder.glob(pattern)):
        if file.is_file() and os.path.samefile(file, path):
            raise ConfigError(f"{option} {path}: is {file.relative_to(folder)}, a file of the checkpoint {folder}; "
                              "writing it would destroy the model; choose another path")


def check_not_the_file(path: str | Path, read: str | Path | None, option: str, read_option: str) -> None:
    """Refuse an output path that is, by any name, the file the run reads through `read_option`."""
    path = Path(path)
    if read is not None and path.exists() and Path(read).is_file() and os.path.samefile(path, read):
        raise ConfigError(f"{option} {path}: is the {read_option} this run reads; writing it would replace it; "
                          "choose another path")


def write_advice(error: OSError, instead: str) -> str:
    """What to do about a failed write: free space where the disk (or a quota) is full, else `instead`."""
    full = error.errno in (errno.ENOSPC, errno.EDQUOT)
    return f"free space or {instead}" if full else instead


def check_output_file(path: str | Path, option: str) -> Path:
    """The path of a file to write, refused (ConfigError naming `option`) when it cannot be created or overwritten."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{option} {path}: is a directory; give the path of a file to write")
    folder = path.parent
    if not folder.is_dir():
        reason = "is not a directory" if folder.exists() else "does not exist"
        raise ConfigError(f"{option} {path}: the folder {folder} {reason}; create it or choose another path")
    writable = os.access(path, os.W_OK) if path.exists() else os.access(folder, os.W_OK | os.X_OK)
    if not writable:
        raise ConfigError(f"{option} {path}: not writable by this user; choose a path you can write to")
    return path


def check_output_folder(path: str | Path, option: str) -> Path:
    """A folder to write into (made later if missing), refused when it or its nearest existing parent is unusable."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{option} {path}: is a file, not a folder; give a folder to write the results into")
    existing = next(folder for folder in (path, *path.absolute().parents) if folder.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{option} {path}: cannot write into {existing}; choose a folder you can write to")
    return path
