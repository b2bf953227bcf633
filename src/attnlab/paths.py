"""attnlab's cache folder, in a module of its own that imports nothing from attnlab.

Everything that keeps files between runs (joined model files, the compiled decode step)
finds its folder here, so that the lowest modules (:mod:`attnlab.native`) can use it
without reaching up into the loaders.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_ENV", "cache_dir"]

#: The environment variable that moves attnlab's cache folder.
CACHE_ENV = "ATTNLAB_CACHE"


def cache_dir() -> Path:
    """attnlab's cache folder: ``$ATTNLAB_CACHE`` if set, else ``$XDG_CACHE_HOME/attnlab``,
    else ``~/.cache/attnlab`` (not created here)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "attnlab"
