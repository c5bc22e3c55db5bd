"""One replica of `mawforge serve --replicas N`: a Ray Serve deployment that runs the very app of
`mawforge serve` (serve/app.py build_app: the same engine worker, Ledger, dashboard and
telemetry) on whatever node Ray placed it.

Its constructor makes the plan there, before the model loads: the node's measured framework
bytes under this replica's own --memory-budget-gib (which Ray also reserved as the `memory`
resource when it placed the replica); a plan that does not fit refuses to start with the plan's
one-line reason, and the deployment fails with it. The ingress (serve/replicas.py) hands each
HTTP request over as a plain dict through a Ray Serve handle; `http` runs it through the app's
ASGI interface and streams back the status line, then the body as it is sent. A caller that goes
away (the client disconnected, the ingress cancelled the call) is the app's http.disconnect, so
the engine stops the job as it does for a client of a single server.
"""
from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

from mawforge.errors import BudgetRejected

START, BODY = "start", "body"         # the kinds of what `http` yields: (START, status, headers), (BODY, bytes)


def build_replica_app(a, name: str):
    """(app, closers): `mawforge serve`'s app for the options `a`, planned here first (the same
    plan_served and app_for as the single server)."""
    from mawforge.commands.run import make_recorder
    from mawforge.commands.serve import app_for, plan_served
    from mawforge.serve.servecli import chat_settings

    chat = chat_settings(a)
    opts, plan, run_plan = plan_served(a)
    if not plan.feasible:
        raise BudgetRejected(f"replica {name} on {socket.gethostname()}: plan rejected: {plan.reason}")
    recorder = make_recorder(a)
    app, model = app_for(a, opts, run_plan, chat, recorder, _per_replica(a.telemetry_log, name))
    closers = [model.close]
    if recorder is not None:                   # --trace-out t.npz: replica r1 saves t.r1.npz when it stops
        closers.append(lambda: recorder.save(_per_replica(a.trace_out, name)))
    return app, closers


def _per_replica(path: str | None, name: str) -> str | None:
    """--telemetry-log x.jsonl: replica r1 writes x.r1.jsonl (replicas on one node share a disk);
    --trace-out likewise."""
    if path is None:
        return None
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{name}{p.suffix}"))


class Replica:
    """The deployment class (serve/replicas.py wraps it in serve.deployment, one deployment per
    replica so the ingress can address each). Ray Serve runs every method on one event loop."""

    def __init__(self, args, name: str):
        import ray

        self.name, self.args = name, args
        self.app, self.closers = build_replica_app(args, name)
        ctx = ray.get_runtime_context()
        self.info = {"replica": name, "pid": os.getpid(), "host": socket.gethostname(), "node_id": ctx.get_node_id(),
                     "actor_name": ctx.get_actor_name(), "plan": _plan(self.app)}
        self.life = None                       # the app's lifespan (engine thread), entered on the loop

    async def _started(self) -> None:
        if self.life is None:
            self.life = self.app.router.lifespan_context(self.app)
            await self.life.__aenter__()

    async def ping(self) -> dict:
        """Who and where this replica is, once its engine runs (the ingress's health probe)."""
        await self._started()
        worker = self.app.state.worker
        return {**self.info, "queue_depth": worker.queue_depth, "busy": worker.current is not None,
                "closing": worker.closing}

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine thread died is replaced."""
        worker = self.app.state.worker
        if self.life is not None and not worker.thread.is_alive() and not worker.closing:
            raise RuntimeError(f"replica {self.name}: the engine thread is gone")

    async def http(self, req: dict):
        """One HTTP request through the app: yields (START, status, headers), then (BODY, bytes)..."""
        await self._started()
        sent: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body = [req["body"]]

        async def receive():
            if body:
                return {"type": "http.request", "body": body.pop(), "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            await sent.put(message)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.1"}, "http_version": "1.1",
                 "method": req["method"], "scheme": "http", "path": req["path"], "raw_path": req["path"].encode(),
                 "query_string": req["query"].encode(), "root_path": "",
                 "headers": [(k.encode().lower(), v.encode()) for k, v in req["headers"]],
                 "client": tuple(req["client"]) if req.get("client") else None, "server": None, "app": self.app}
        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda t: sent.put_nowait(None))
        try:
            while (message := await sent.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = [(k.decode(), v.decode()) for k, v in message.get("headers", [])]
                    yield START, message["status"], headers + [("x-mawforge-replica", self.name)]
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield BODY, message["body"]
                    if not message.get("more_body", False):
                        break
        finally:
            gone.set()                          # the caller left (or the answer is whole): the app's disconnect
            if not task.done():
                await asyncio.wait([task], timeout=5)

    async def __del__(self):
        """Ray Serve's graceful shutdown: the engine stops (queued jobs get their 503), the runtime closes."""
        if self.life is not None:
            life, self.life = self.life, None
            await life.__aexit__(None, None, None)
        for close in self.closers:
            close()


def _plan(app) -> dict:
    p = app.state.api.rt.plan
    return {"C": p.C, "E": p.E, "K": p.K, "P": p.P, "O": p.O, "F": p.F, "budget_bytes": p.budget_bytes,
            "budget_source": p.budget_source, "feasible": p.feasible}
