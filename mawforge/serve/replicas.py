"""`mawforge serve --replicas N [--ray-address auto|ray://...]`: N replicas of the server on a Ray
cluster, deployed with Ray Serve, behind one OpenAI-compatible endpoint.

    client --HTTP--> Ray Serve proxy --> Ingress (this module)  --handle--> replica r0 (serve/replica.py)
                                         picks the replica that  --handle--> replica r1   the app of
                                         holds the conversation  ...                      `mawforge serve`
Each replica is its own Ray Serve deployment of one replica (so the ingress can address it; Ray
restarts it when it dies), with its own CPUs and, given --memory-budget-gib, that budget as Ray's
`memory` resource, so Ray places it on a node with room and the replica plans within it there
before its model loads. The ingress routes by conversation (serve/affinity.py), probes every
replica each second, and sends nothing to one that is down: its conversations go to the next
replica in their order. A replica that dies mid-request fails that request cleanly: a 503 before
the answer began, else an error event that ends its stream; the others' requests go on.
`/metrics` and `/` show every replica (serve/replicaview.py); /replicas/NAME/... is that
replica's own server (its dashboard, its /metrics).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import re
import signal
import sys
from urllib.parse import unquote

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse

from mawforge.errors import BudgetRejected, MawError
from mawforge.serve.affinity import Affinity
from mawforge.serve.replica import BODY, Replica
from mawforge.serve.replicaview import merged_metrics, overview_page

ROUTED = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/responses": "responses"}
HOP = {"content-length", "transfer-encoding", "connection", "keep-alive"}
PROBE_S, PROBE_TIMEOUT_S = 1.0, 5.0


def _error(status: int, message: str, code: str, retry_after: int | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": code}},
                        status_code=status, headers={"Retry-After": str(retry_after)} if retry_after else None)


class Ingress:
    """The HTTP front: a Ray Serve deployment whose __call__ gets every request of the app."""

    def __init__(self, replicas: list, names: list[str], model_id: str, api_key: str | None):
        self.handles = dict(zip(names, replicas))
        self.names, self.model_id, self.api_key = names, model_id, api_key
        self.affinity = Affinity(names)
        self.up: set[str] = set()
        self.info: dict[str, dict] = {}
        self.routed = dict.fromkeys(names, 0)
        self.failures = dict.fromkeys(names, 0)
        self.prober: asyncio.Task | None = None

    # ---- replica health ----------------------------------------------------------------------
    async def _probe(self, name: str) -> None:
        try:
            self.info[name] = await asyncio.wait_for(self.handles[name].ping.remote(), PROBE_TIMEOUT_S)
            self.up.add(name)
        except Exception:                     # noqa: BLE001 - dead, restarting or unreachable: down until it answers
            self.up.discard(name)

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(n) for n in self.names))
            await asyncio.sleep(PROBE_S)

    async def _started(self) -> None:
        if self.prober is None:
            await asyncio.gather(*(self._probe(n) for n in self.names))
            if self.prober is None:
                self.prober = asyncio.ensure_future(self._probe_forever())

    def _down(self, name: str) -> None:
        self.up.discard(name)
        self.failures[name] += 1

    def routing(self) -> dict[str, dict]:
        return {n: {"up": n in self.up, "routed": self.routed[n], "failures": self.failures[n],
                    "info": self.info.get(n)} for n in self.names}

    # ---- HTTP --------------------------------------------------------------------------------
    async def __call__(self, request: Request) -> Response:
        await self._started()
        path, method = request.url.path, request.method
        body = await request.body()
        if path in ROUTED and method == "POST":
            return await self._routed(ROUTED[path], request, body)
        if path.startswith("/v1/responses/"):
            rid = path.split("/")[3]
            holder = self.affinity.holder(rid)
            return await self._first_found(request, body, [holder] if holder else self.names)
        if path.startswith("/replicas/"):
            name, slash, rest = path[len("/replicas/"):].partition("/")
            if name not in self.handles:
                return _error(404, f"no replica named {name!r} (replicas: {', '.join(self.names)})", "not_found")
            if not slash:                     # the dashboard's paths are relative to /replicas/NAME/
                return RedirectResponse(f"/replicas/{name}/", status_code=307)
            return await self._forward(name, request, body, "/" + rest)
        if path == "/metrics" and method == "GET":
            return await self._metrics(request)
        if path == "/health":
            ok = bool(self.up)
            return JSONResponse({"status": "ok" if ok else "no_replica_up", "model": self.model_id,
                                 "replicas": self.routing()}, status_code=200 if ok else 503)
        if path == "/" and method == "GET":
            if not self._authorized(request):
                return await self._first_found(request, body, self.names)     # the replica's key form, 401
            return HTMLResponse(overview_page(self.model_id, self.routing()), headers={"Cache-Control": "no-store"})
        return await self._first_found(request, body, self.names)             # /v1/models, the 404s, ...

    def _authorized(self, request: Request) -> bool:
        """As the dashboard: no key, or the Bearer header, or the cookie its key form sets."""
        if self.api_key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else unquote(request.cookies.get("mawforge_key", ""))
        return hmac.compare_digest(given.encode(), self.api_key.encode())

    async def _routed(self, endpoint: str, request: Request, body: bytes) -> Response:
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        order, digests = self.affinity.order(endpoint, parsed if isinstance(parsed, dict) else {}, self.up)
        if not order:
            return _error(503, "no replica is up (Ray is restarting them); retry shortly", "no_replica_up", 1)
        name = order[0]
        self.routed[name] += 1
        response = await self._forward(name, request, body)
        if response.status_code < 500:
            self.affinity.routed(name, digests, response.headers.get("x-request-id")
                                 if endpoint == "responses" else None)
        return response

    async def _first_found(self, request: Request, body: bytes, names: list[str]) -> Response:
        """The answer of the first replica up that has what the path names (a stored response:
        only the replica that made it has it), else the last 404."""
        response = None
        for name in [n for n in names if n in self.up] or names[:1]:
            response = await self._forward(name, request, body)
            if response.status_code != 404:
                return response
        return response

    def _request(self, request: Request, body: bytes, path: str) -> dict:
        return {"method": request.method, "path": path, "query": request.url.query, "body": body,
                "headers": [(k, v) for k, v in request.headers.items() if k.lower() not in HOP],
                "client": [request.client.host, request.client.port] if request.client else None}

    async def _forward(self, name: str, request: Request, body: bytes, path: str | None = None) -> Response:
        """The request through replica `name`; a replica that dies or cannot be reached is a 503."""
        return await self._call(name, self._request(request, body, path or request.url.path), request.url.path)

    async def _call(self, name: str, req: dict, path: str) -> Response:
        gen = self.handles[name].options(stream=True).http.remote(req)
        try:
            _, status, headers = await gen.__anext__()
        except Exception as e:                # noqa: BLE001 - the replica died or is unreachable
            gen.cancel()
            return self._lost(name, e)
        headers = {k: v for k, v in headers if k.lower() not in HOP}
        if headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(self._relay(name, gen, path), status_code=status, headers=headers)
        chunks = []
        try:
            async for _, chunk in gen:
                chunks.append(chunk)
        except asyncio.CancelledError:        # the client left: so does the replica's job
            gen.cancel()
            raise
        except Exception as e:                # noqa: BLE001
            return self._lost(name, e)
        return Response(b"".join(chunks), status_code=status, headers=headers)

    def _lost(self, name: str, e: Exception) -> JSONResponse:
        self._down(name)
        return _error(503, f"replica {name} failed during the request ({type(e).__name__}); Ray restarts it, "
                      "and a retry goes to another replica", "replica_unavailable", 1)

    async def _relay(self, name: str, gen, path: str):
        """A streamed answer, chunk by chunk; if the replica dies mid-stream, one error event ends it."""
        try:
            async for kind, chunk in gen:
                if kind == BODY:
                    yield chunk
        except Exception as e:                # noqa: BLE001
            self._down(name)
            msg = f"replica {name} died during the stream ({type(e).__name__}); Ray restarts it"
            error = {"message": msg, "type": "server_error", "param": None, "code": "replica_unavailable"}
            if path == "/v1/responses":
                yield f"event: error\ndata: {json.dumps({'type': 'error', **error, 'error': error})}\n\n".encode()
            else:
                yield f"data: {json.dumps({'error': error})}\n\n".encode()
        finally:
            gen.cancel()                      # a no-op once finished; stops the replica's job if the client left

    async def _metrics(self, request: Request) -> Response:
        names = [n for n in self.names if n in self.up]
        texts = {}
        auth = [(k, v) for k, v in request.headers.items() if k.lower() == "authorization"]
        for name in names:                    # each replica's exposition in the Prometheus text format, parsed here
            req = {"method": "GET", "path": "/metrics", "query": "", "body": b"", "client": None,
                   "headers": auth + [("accept", "text/plain")]}
            r = await self._call(name, req, "/metrics")
            if r.status_code == 401:
                return r
            if r.status_code == 200:
                texts[name] = r.body.decode()
        body, content_type = merged_metrics(texts, self.routing(), None)
        return Response(body, media_type=content_type)


# ---- deploying -------------------------------------------------------------------------------
def replica_names(n: int) -> list[str]:
    return [f"r{i}" for i in range(n)]


def replica_resources(a) -> dict:
    """Ray actor options of one replica: its CPUs, and its memory budget as Ray's memory resource."""
    cpus = a.replica_cpus if a.replica_cpus is not None else (a.threads or 1)
    opts = {"num_cpus": cpus}
    if a.memory_budget_gib is not None:
        opts["memory"] = int(a.memory_budget_gib * 2**30)
    return opts


def check_room(resources: dict, n: int) -> None:
    """Fail before deploying when the cluster's nodes cannot hold n replicas of these resources
    (Ray Serve would wait for room forever)."""
    import ray

    fits, biggest = 0, {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        have = node.get("Resources", {})
        per = [int(have.get("CPU" if k == "num_cpus" else k, 0) // v) for k, v in resources.items() if v]
        fits += min(per) if per else n
        biggest = max(biggest, have, key=lambda h: h.get("memory", 0))
    if fits < n:
        want = ", ".join(f"{k.replace('num_cpus', 'CPU')} {v / 2**30:.2f} GiB" if k == "memory" else f"CPU {v}"
                         for k, v in resources.items())
        raise MawError(f"the Ray cluster has room for {fits} of {n} replicas ({want} each; the largest node has "
                       f"CPU {biggest.get('CPU', 0):g}, memory {biggest.get('memory', 0) / 2**30:.2f} GiB)")


def application(a):
    """The Ray Serve application: the ingress and one deployment per replica."""
    from pathlib import Path

    from ray import serve

    names = replica_names(a.replicas)
    options = dict(num_replicas=1, max_ongoing_requests=a.queue_size + 16, health_check_period_s=2.0,
                   max_constructor_retry_count=1,              # a plan that does not fit will not fit again
                   health_check_timeout_s=30.0, graceful_shutdown_timeout_s=a.shutdown_grace_s,
                   ray_actor_options=replica_resources(a))
    replica = serve.deployment(Replica)
    replicas = [replica.options(name=n, **options).bind(a, n) for n in names]
    ingress = serve.deployment(Ingress).options(name="ingress", num_replicas=1, max_ongoing_requests=100_000,
                                                ray_actor_options={"num_cpus": 0})
    return ingress.bind(replicas, names, a.model_id or Path(a.pack).resolve().name, a.api_key)


def deploy(a, name: str = "mawforge", route_prefix: str = "/") -> str:
    """Deploy on the Ray cluster this process is connected to (ray.init done) as the Ray Serve
    application `name`; returns the URL. A replica whose plan does not fit raises BudgetRejected
    with the plan's reason (the application is removed)."""
    from ray import serve

    check_room(replica_resources(a), a.replicas)
    serve.start(http_options={"host": a.host, "port": a.port})
    try:
        serve.run(application(a), name=name, route_prefix=route_prefix)
    except RuntimeError as e:
        status = serve.status().applications.get(name)        # the replicas' own errors are in their status
        said = str(e) + "".join(f"\n{d.message}" for d in (status.deployments.values() if status else ()))
        serve.delete(name)
        rejected = re.search(r"BudgetRejected: (replica \S+ on \S+: plan rejected: [^\n]*)", said)
        if rejected:
            raise BudgetRejected(rejected.group(1)) from None
        raise MawError(f"Ray Serve could not deploy the replicas: {str(e).strip().splitlines()[-1]}") from None
    host = f"[{a.host}]" if ":" in a.host else a.host
    return f"http://{host}:{a.port}" + route_prefix.rstrip("/")


def serve_replicas(a) -> int:
    """`mawforge serve --replicas N`: connect (or start a local Ray), deploy, serve until SIGINT/SIGTERM."""
    import ray
    from ray import serve

    if a.port == 0:
        raise MawError("--port 0 is not supported with --replicas (Ray Serve's proxy needs a fixed port)")
    ray.init(address=a.ray_address or "local", include_dashboard=False, log_to_driver=False)
    try:
        try:
            url = deploy(a)
        except BudgetRejected as e:
            print(f"mawforge serve: refusing to start: {e}", file=sys.stderr)
            return BudgetRejected.exit_code
        print(f"mawforge serve: listening on {url} ({a.replicas} replicas on Ray Serve; dashboard at {url}/)",
              file=sys.stderr, flush=True)
        stop = asyncio.Event()
        loop = asyncio.new_event_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        loop.run_until_complete(stop.wait())
        serve.delete("mawforge")
        serve.shutdown()
    finally:
        ray.shutdown()
    print("mawforge serve: stopped", file=sys.stderr)
    return 0
