"""Running the app: bind a socket (a busy port fails before the model loads), uvicorn with a
graceful shutdown that still answers every client, and ServerThread for in-process use:

    with ServerThread(build_app(rt, "tiny")) as s: s.url
"""
from __future__ import annotations

import asyncio
import socket
import threading

import uvicorn

from mawforge.errors import MawError
from mawforge.serve.worker import EngineWorker


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as e:
        raise MawError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


class _Server(uvicorn.Server):
    """uvicorn that reports the bound address once it accepts connections, and at shutdown
    refuses new jobs, lets in-flight ones run for grace_s, then cancels them in the engine, so
    every client still gets a well-formed answer. uvicorn's own task cancellation (grace_s + 10)
    is only the backstop for a forward pass that never returns."""

    def __init__(self, app, log_level: str, grace_s: float | None, on_listen=None):
        super().__init__(uvicorn.Config(app, log_level=log_level, lifespan="on",
                                        timeout_graceful_shutdown=None if grace_s is None else grace_s + 10))
        self.worker: EngineWorker | None = getattr(app.state, "worker", None)
        self.on_listen, self.url, self.grace_s = on_listen, None, grace_s

    async def shutdown(self, sockets=None):
        if self.worker is not None:
            self.worker.closing = True
            if self.grace_s is not None:
                asyncio.get_running_loop().call_later(self.grace_s, self.worker.cancel_all)
        await super().shutdown(sockets)

    async def startup(self, sockets=None):
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
            if self.on_listen is not None:
                self.on_listen(self.url)


class ServerThread:
    """The app on a free port in a background thread: `with ServerThread(app) as s: s.url`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 grace_s: float | None = 30.0):
        self.ready = threading.Event()
        self.sock = bind(host, port)
        self.server = _Server(app, log_level, grace_s, lambda url: self.ready.set())
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="mawforge-serve", daemon=True)

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> "ServerThread":
        self.thread.start()
        while not self.ready.wait(0.05):
            if not self.thread.is_alive():
                raise RuntimeError("the server thread exited during startup")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
