"""A job's ddpwatch settings from its environment, for a script the user cannot pass flags to.

``DDPWATCH_ADDRESS`` (where ddpwatch listens), ``DDPWATCH_KEY`` (the dashboard's ``client.json``,
beyond loopback), ``DDPWATCH_DISABLE=1`` (watch nothing) and ``DDPWATCH_UNWATCHED`` (the steps left
unwatched to measure what watching costs: ``timing.unwatched_blocks``) are read by ``attach``, the Trainer and
Lightning callbacks and ``train.py``, as a scheduler's job template sets them once for every rank.
An argument or a flag given wins over its variable; a variable set to "" counts as unset.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from instrumented_ddp.timing.unwatched_blocks import UNWATCHED_ENV, UnwatchedBlocks, parse_unwatched
from instrumented_ddp.wire.endpoints import DEFAULT_ADDRESS

ADDRESS_ENV = "DDPWATCH_ADDRESS"
KEY_ENV = "DDPWATCH_KEY"
DISABLE_ENV = "DDPWATCH_DISABLE"
_YES = ("1", "true", "yes", "on")
_NO = ("", "0", "false", "no", "off")


class WatchEnvironmentError(ValueError):
    """A variable set to something that cannot mean what it names (``DDPWATCH_DISABLE=maybe``)."""


def watch_address(given: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """``given``, else ``DDPWATCH_ADDRESS``, else the default address."""
    return given if given is not None else environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS


def watch_key_file(given: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """``given``, else ``DDPWATCH_KEY``, else None (no CURVE keys: loopback only)."""
    return given if given is not None else environ.get(KEY_ENV) or None


def watching_disabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``DDPWATCH_DISABLE`` says to watch nothing: 1, true, yes or on (any case); 0, false,
    no, off or unset watch. Anything else raises ``WatchEnvironmentError`` in one line: a typo must
    neither switch watching off nor leave it on unnoticed."""
    value = environ.get(DISABLE_ENV, "").strip().lower()
    if value in _YES:
        return True
    if value in _NO:
        return False
    raise WatchEnvironmentError(f"{DISABLE_ENV}={environ[DISABLE_ENV]!r}: set it to 1 to watch nothing, or to 0 (or unset it) to watch")


def unwatched_blocks(given: str | None = None, environ: Mapping[str, str] = os.environ) -> UnwatchedBlocks:
    """The schedule ``given`` (a flag's text), else ``DDPWATCH_UNWATCHED``'s, else the default
    (``parse_unwatched``); a text it cannot read raises ``WatchEnvironmentError`` in one line."""
    text = given if given is not None else environ.get(UNWATCHED_ENV, "")
    try:
        return parse_unwatched(text)
    except ValueError as error:
        raise WatchEnvironmentError(f"{'--unwatched' if given is not None else UNWATCHED_ENV}: {error}") from None
