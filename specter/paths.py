"""Checks on the files and folders a user names for output, made before any work so a typo costs nothing."""

from __future__ import annotations

import os
from pathlib import Path

from specter.errors import ConfigError


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
