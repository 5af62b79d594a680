"""Where ranks and listeners meet: ZeroMQ addresses, and the routing id that names a rank's socket."""

from __future__ import annotations

DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"


def address_problem(address: str) -> str | None:
    """Why ``address`` is not a ZeroMQ endpoint we can use, or None."""
    if address.startswith(("ipc://", "inproc://")):
        return None
    if not address.startswith("tcp://") or ":" not in address[len("tcp://"):]:
        return f"{address!r} is not an address like tcp://127.0.0.1:5555"
    port = address.rsplit(":", 1)[1]
    return None if port == "*" or (port.isdigit() and 0 < int(port) < 65536) else f"{address!r} has no valid port"


def is_loopback(address: str) -> bool:
    """Addresses nobody else on the network can reach: loopback TCP, IPC, in-process."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    if not address.startswith("tcp://"):
        return False
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def routing_id(session: str, rank: int) -> bytes:
    """The ZeroMQ routing id a rank's socket carries: how the dashboard's ROUTER tells ranks apart
    (and finds rank 0 to send it commands), and which run a message comes from (``run_of_sender``)."""
    return f"rank-{rank}-{session}".encode()


def run_of_sender(peer: bytes) -> str:
    """The run (its session id, as its hello names it) whose rank sent with routing id ``peer``; ""
    for a peer that is no rank (``ddpwatch switch``, a raw socket). The listener learns from it
    which run each message belongs to, whatever the message says, so two runs sending to one
    address at once are told apart even between their hellos."""
    prefix, _, rest = peer.partition(b"-")
    rank, _, session = rest.partition(b"-")
    if prefix != b"rank" or not rank.isdigit() or not session:
        return ""
    return session.decode("utf-8", errors="replace")
