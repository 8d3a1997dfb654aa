"""The optional extras of pyproject.toml, and the one-line hint that names
the extra to install when a command or an example lacks one of its modules.

`fastattn bench`, `fastattn demo --plot` and the scripts of examples/ check
what they import before any work: a user with NumPy alone gets the command
that installs the rest, not a ModuleNotFoundError traceback.
"""
from __future__ import annotations

import importlib
import sys
from typing import Iterable

# extra -> the modules it installs, as [project.optional-dependencies] of
# pyproject.toml lists them (tests/test_extras.py keeps the two the same)
EXTRAS = {
    "plot": ("matplotlib",),
    "bench": ("tqdm", "threadpoolctl"),
    "bfloat16": ("ml_dtypes",),
    "transformers": ("torch", "transformers", "ml_dtypes"),
    "ray": ("ray",),
    "minilm": ("safetensors", "tokenizers", "scipy"),
}


def install_command(extra: str) -> str:
    """How to install an extra of EXTRAS."""
    if extra not in EXTRAS:
        raise ValueError(f"extra must be one of {', '.join(EXTRAS)}, got {extra!r}")
    return f"pip install 'fastattn[{extra}]'"


def require(modules: Iterable[str], command: str, who: str = "fastattn bench") -> bool:
    """True when every module imports; else False, after telling stderr
    which do not and the command that installs them."""
    absent = []
    for m in modules:
        try:
            importlib.import_module(m)
        except ImportError:
            absent.append(m)
    if absent:
        sys.stderr.write(f"{who}: {', '.join(absent)} cannot be imported; "
                         f"install with: {command}\n")
        return False
    return True


def require_extra(extra: str, who: str) -> bool:
    """require() of the modules of an extra, with the command that installs it."""
    command = install_command(extra)  # a ValueError for an unknown extra
    return require(EXTRAS[extra], command, who)


def need(extra: str, who: str) -> None:
    """For a script: return when the extra's modules import, else end the
    process with status 2 and require()'s one line on stderr."""
    if not require_extra(extra, who):
        raise SystemExit(2)
