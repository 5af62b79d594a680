"""The dashboard's socket as a ZeroMQ CURVE server: what of CURVE needs zmq.

The key files are ``instrumented_ddp.wire.curve_keys``'s. The socket accepts exactly the client
key of its directory: a sender or a controller without it fails the handshake, so none of its
messages or commands ever arrive; each failure is counted.
"""

from __future__ import annotations

from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from instrumented_ddp.wire.curve_keys import CLIENT_FILE, SERVER_FILE, ServerKeys, load_server_keys, write_key_files


def ensure_keys(directory: Path) -> tuple[ServerKeys, Path]:
    """Load the keys in ``directory``, making them first if there are none; returns the server
    keys and the path of the client file to hand to the training nodes."""
    server_file = directory / SERVER_FILE
    if not server_file.exists():
        server, client = zmq.curve_keypair(), zmq.curve_keypair()
        write_key_files(directory, (server[0].decode(), server[1].decode()), (client[0].decode(), client[1].decode()))
    return load_server_keys(server_file), directory / CLIENT_FILE


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

