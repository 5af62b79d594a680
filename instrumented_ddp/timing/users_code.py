"""Which code is the user's own: what the collective stand-ins rebind, and where a stall's probe
says a stalled rank is.

The user's code is what is loaded from outside the interpreter's library folders (its standard
library and installed packages, and torch's wherever it is installed from) and outside ddpwatch's
own packages: their script, a project's modules beside it, one installed editable.
"""

from __future__ import annotations

import functools
import os
import sysconfig

import torch

#: The top-level packages that are never the user's, wherever they are installed from.
NOT_USERS = ("instrumented_ddp", "ddpwatch", "torch")
_OUR_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds instrumented_ddp/


def library_folders() -> tuple[str, ...]:
    """Where the interpreter's standard library and installed packages live, and torch itself: a
    module from there is not the user's. Each as written and with its links resolved, so that a
    module's path is compared as it is (no look-up of its own), each ending in a separator."""
    paths = sysconfig.get_paths()
    folders = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    folders.add(os.path.dirname(os.path.dirname(torch.__file__ or "")))  # torch's own folder's parent: site-packages
    return tuple({os.path.join(way(folder), "") for folder in folders if folder for way in (os.path.abspath, os.path.realpath)})


@functools.lru_cache(maxsize=1024)
def is_users_file(path: str) -> bool:
    """Whether a frame's file is the user's code: a real file (not ``<string>`` nor a frozen
    module) outside the library folders and ddpwatch's own packages."""
    if not path or path.startswith("<"):
        return False
    absolute = os.path.abspath(path)
    if absolute.startswith(_libraries()):
        return False
    ours = tuple(os.path.join(_OUR_PARENT, name, "") for name in NOT_USERS)
    return not absolute.startswith(ours)


@functools.lru_cache(maxsize=1)
def _libraries() -> tuple[str, ...]:
    return library_folders()
