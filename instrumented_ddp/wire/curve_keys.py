"""Who may talk to a dashboard that listens beyond loopback: the ZeroMQ CURVE key files.

``ddpwatch --keys DIR`` makes (once) a server key pair and one client key pair, each in a file
only its user can read: ``DIR/server.json`` stays with the dashboard, ``DIR/client.json`` goes to
the training nodes (``train.py --watch-key``) and to ``ddpwatch switch --key``. Keys are Z85 text,
as ZeroMQ uses. This module reads and writes the files, both halves; making a key pair and
authenticating a peer need zmq, and are ``ddpwatch.ingest.curve_server``'s.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

SERVER_FILE = "server.json"
CLIENT_FILE = "client.json"


@dataclass(frozen=True)
class ClientKeys:
    """What a rank (or ``ddpwatch switch``) needs to talk to a dashboard that authenticates:
    the dashboard's public key and the client key pair it accepts."""

    server_public: str
    client_public: str
    client_secret: str

    def socket_options(self) -> list[tuple[str, bytes]]:
        """(pyzmq socket attribute, value) pairs that make a socket this CURVE client."""
        return [("curve_serverkey", self.server_public.encode()), ("curve_publickey", self.client_public.encode()),
                ("curve_secretkey", self.client_secret.encode())]


@dataclass(frozen=True)
class ServerKeys:
    """What the dashboard's socket needs to be the CURVE server: its key pair and the one client key accepted."""

    server_public: str
    server_secret: str
    client_public: str


def load_client_keys(path: str) -> ClientKeys:
    """Read a client key file written by ``ddpwatch --keys``; a one-line error if it is unusable."""
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
        return ClientKeys(data["server_public"], data["client_public"], data["client_secret"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"cannot read CURVE client keys from {path}: {error}") from None


def load_server_keys(path: Path) -> ServerKeys:
    """Read the server key file; a one-line error if others may read it or it is unusable."""
    if path.stat().st_mode & 0o077:
        raise ValueError(f"{path} is readable by other users; chmod 600 it")
    try:
        data = json.loads(path.read_text())
        return ServerKeys(data["server_public"], data["server_secret"], data["client_public"])
    except (ValueError, KeyError) as error:
        raise ValueError(f"cannot read CURVE server keys from {path}: {error}") from None


def write_key_files(directory: Path, server: tuple[str, str], client: tuple[str, str]) -> None:
    """Write ``directory``'s two key files from a (public, secret) pair each, readable only by
    their user (the directory too, where it is made); a file already there is never overwritten."""
    (server_public, server_secret), (client_public, client_secret) = server, client
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    _write_private(directory / SERVER_FILE, {"server_public": server_public, "server_secret": server_secret,
                                             "client_public": client_public})
    _write_private(directory / CLIENT_FILE, {"server_public": server_public, "client_public": client_public,
                                             "client_secret": client_secret})


def _write_private(path: Path, data: dict[str, str]) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        json.dump(data, file, indent=1)
