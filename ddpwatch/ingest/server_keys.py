"""Who may talk to a dashboard that listens beyond loopback: ZeroMQ CURVE.

``ddpwatch --keys DIR`` makes (once) a server key pair and one client key pair, each in a file
only its user can read: ``DIR/server.json`` stays with the dashboard, ``DIR/client.json`` goes to
the training nodes (``train.py --watch-key``) and to ``ddpwatch switch --key``. The dashboard's
socket is a CURVE server that accepts exactly that client key: a sender or a controller without it
fails the handshake, so none of its messages or commands ever arrive; each failure is counted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from instrumented_ddp.wire.protocol import ClientKeys, load_client_keys


@dataclass(frozen=True)
class ServerKeys:
    server_public: str
    server_secret: str
    client_public: str  # the one client key accepted


def _write_private(path: Path, data: dict[str, str]) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        json.dump(data, file, indent=1)


def ensure_keys(directory: Path) -> tuple[ServerKeys, Path]:
    """Load the keys in ``directory``, making them first if there are none; returns the server
    keys and the path of the client file to hand to the training nodes."""
    server_file, client_file = directory / "server.json", directory / "client.json"
    if not server_file.exists():
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        _write_private(server_file, {"server_public": server_public.decode(), "server_secret": server_secret.decode(),
                                     "client_public": client_public.decode()})
        _write_private(client_file, {"server_public": server_public.decode(), "client_public": client_public.decode(),
                                     "client_secret": client_secret.decode()})
    if server_file.stat().st_mode & 0o077:
        raise ValueError(f"{server_file} is readable by other users; chmod 600 it")
    try:
        data = json.loads(server_file.read_text())
        return ServerKeys(data["server_public"], data["server_secret"], data["client_public"]), client_file
    except (ValueError, KeyError) as error:
        raise ValueError(f"cannot read CURVE server keys from {server_file}: {error}") from None


class _AcceptOneClient:
    def __init__(self, client_public: str) -> None:
        self.client_public = client_public.encode()

    def callback(self, domain: str, key: bytes) -> bool:
        return zmq.utils.z85.encode(key) == self.client_public if len(key) == 32 else key == self.client_public


def secure_server(context: zmq.Context, socket: zmq.Socket, keys: ServerKeys) -> ThreadAuthenticator:
    """Make ``socket`` a CURVE server accepting only the client key; returns the authenticator
    (stop it when the socket closes)."""
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve_callback(domain="*", credentials_provider=_AcceptOneClient(keys.client_public))
    socket.curve_secretkey = keys.server_secret.encode()
    socket.curve_publickey = keys.server_public.encode()
    socket.curve_server = True
    return authenticator


def secure_client(socket: zmq.Socket, keys: ClientKeys) -> None:
    for name, value in keys.socket_options():
        setattr(socket, name, value)


__all__ = ["ServerKeys", "ensure_keys", "load_client_keys", "secure_client", "secure_server"]
