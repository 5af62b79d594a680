"""Which files are the user's own code (``instrumented_ddp.timing.users_code``): the stand-ins
rebind names in them, and a stall's probe names the innermost frame in them."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch

import instrumented_ddp.timing.timeline
from instrumented_ddp.timing.users_code import is_users_file


def test_a_script_or_a_project_module_is_the_users() -> None:
    assert is_users_file(__file__)
    assert is_users_file(str(Path("/home/someone/project/train.py")))


def test_torch_ddpwatch_the_standard_library_and_made_up_files_are_not() -> None:
    assert not is_users_file(torch.__file__ or "")
    assert not is_users_file(instrumented_ddp.timing.timeline.__file__ or "")
    assert not is_users_file(threading.__file__ or "")
    assert not is_users_file(json.__file__ or "")
    assert not is_users_file("<string>") and not is_users_file("<frozen runpy>") and not is_users_file("")
