"""Run the app with uvicorn on a socket bound first (so ``--port 0`` reports its port)."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from typing import Any

__all__ = ["is_loopback", "serve"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` only listens on this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6).

    Raises:
        OSError: the address is taken or not available here.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    on_start: Callable[[str], None] | None = None,
) -> None:
    """Serve ``app`` until Ctrl-C (uvicorn; clean shutdown on SIGINT/SIGTERM).

    Args:
        app: the ASGI app (:func:`attnlab.serve.create_app`).
        host: the address to listen on (127.0.0.1 unless told otherwise).
        port: the TCP port (0: any free port).
        on_start: called with the URL once the server is serving and Ctrl-C (SIGINT)
            and SIGTERM stop it: a signal sent after this call always stops the server.

    Raises:
        OSError: the address cannot be bound.
    """
    import uvicorn

    sock = bind(host, port)
    real_port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{real_port}"

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            # Announce only now: uvicorn installs its SIGINT/SIGTERM handlers when it
            # starts serving (Server.capture_signals), not before. A signal sent between
            # an earlier announcement and that moment met the process's inherited
            # disposition, and a process started with SIGINT ignored (a background job
            # of a non-interactive shell, and whatever it starts) lost that Ctrl-C and
            # kept serving. From here on every SIGINT reaches uvicorn's handler.
            if self.started and on_start is not None:
                on_start(url)

    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=3
    )
    server = Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        pool = getattr(getattr(app, "state", None), "pool", None)
        if pool is not None:
            pool.shutdown()
