"""An argument parser whose refusals are one line.

argparse prints its whole usage before the error: five lines for ``ddpwatch tune --out`` missing,
and under torchrun that block once per rank, the reason last where a user looks first. A wrong
flag gets the one line saying what is wrong (``--help`` has the rest). Pure standard library, shared by
``train.py`` and ``ddpwatch``; subcommands' parsers are of this class too (argparse makes them of
their parent's).
"""

from __future__ import annotations

import argparse
from typing import NoReturn


class OneLineErrorParser(argparse.ArgumentParser):
    """``PROG: error: MESSAGE``, argparse's own last line, alone; exit 2, argparse's own code."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")
