"""`mawforge serve`: its flags, its one plan and the app it serves (serve/app.py build_app), on one
process or as replicas on Ray Serve (serve/replicas.py)."""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from mawforge.commands.run import add_runtime_arguments, make_recorder, runtime_options, should_preload
from mawforge.commands.speculative import add_speculative_arguments, spec_options
from mawforge.engine.threads import release_openmp_pool
from mawforge.errors import BudgetRejected
from mawforge.serve import limits
from mawforge.serve.app import build_app
from mawforge.serve.responses import add_responses_arguments, store_from_args
from mawforge.serve.server import _Server, bind
from mawforge.serve.servecli import add_chat_arguments, add_replica_arguments, chat_settings

help = "serve a pack over an OpenAI-compatible HTTP API, with per-request telemetry"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_runtime_arguments(p)
    p.add_argument("--config", default=None, help="JSON/YAML of option defaults (e.g. what `mawforge tune` "
                   "writes); flags on the command line override it")
    p.add_argument("--model-id", default=None, help="the id clients name (default: the pack's directory name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="0 picks a free port (printed on stderr)")
    p.add_argument("--max-tokens-default", type=int, default=96, help="max_tokens when a request gives none")
    add_speculative_arguments(p)
    p.add_argument("--no-speculative", dest="speculative", action="store_const", const="off",
                   help="plain decoding (the default; same as --speculative off)")
    p.add_argument("--api-key", default=os.environ.get("MAWFORGE_API_KEY"),
                   help="require Authorization: Bearer KEY on /v1/*, /metrics and the dashboard (default: "
                        "$MAWFORGE_API_KEY, else none; /health stays public)")
    p.add_argument("--telemetry-log", default=None, help="append one JSON line per request here")
    p.add_argument("--no-dashboard", dest="dashboard", action="store_false",
                   help="no live dashboard at / (it is on by default; --api-key guards it too)")
    p.add_argument("--max-batch", type=int, default=1,
                   help="requests stepped at once (continuous batching: each routed expert read once for all "
                        "of them; the plan counts each one's KV); 1: one at a time")
    p.add_argument("--max-waiting", "--queue-size", dest="queue_size", type=int, default=64,
                   help="requests that may wait for the engine; beyond it 429")
    p.add_argument("--request-timeout-s", type=float, default=None,
                   help="cancel a request still running this long after it arrived (finish_reason cancelled)")
    p.add_argument("--max-body-bytes", type=int, default=limits.MAX_BODY_BYTES,
                   help="larger request bodies are refused with 413")
    p.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight requests may run before they are cancelled")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    add_chat_arguments(p)
    add_responses_arguments(p)
    add_replica_arguments(p)


def plan_served(a: argparse.Namespace):
    """(options, plan, the runtime's plan or None) of `serve`'s flags, made once: with a draft
    pack the pair is planned and the target's plan is made by the runtime in what it leaves.
    `serve` and each of its replicas (serve/replica.py) plan here, where they run."""
    from mawforge.commands.plan import pair_plan_from_args
    from mawforge.commands.speculative import uses_draft_pack
    from mawforge.engine.options import plan_for_options
    from mawforge.plan import PackFacts, framework_in_process
    opts = runtime_options(a)
    if a.dashboard:                              # its kept route traces are planned in O
        from mawforge.serve.dashboard import kept_trace_bytes
        opts = replace(opts, extra_overhead_bytes=kept_trace_bytes(PackFacts.from_pack(a.pack).top_k))
    if uses_draft_pack(a):                       # the draft's L is planned beside the target's
        plan = pair_plan_from_args(a, opts)
        return replace(opts, reserved_bytes=plan.draft.L), plan, None
    plan = plan_for_options(PackFacts.from_pack(a.pack), opts, framework_in_process())
    return opts, plan, plan


def app_for(a: argparse.Namespace, opts, run_plan, chat: dict, recorder=None, telemetry_log: str | None = None):
    """(app, model): the model loaded through the API's front door and `serve`'s app on it."""
    from mawforge.api import Model
    model = Model.from_options(a.pack, opts, speculative=spec_options(a), recorder=recorder, plan=run_plan)
    try:
        if should_preload(getattr(a, "preload", None), model.runtime.plan):
            model.runtime.cache.preload()    # a warm start: blocks in (layer, expert) order until E is full
        model_id = a.model_id or Path(a.pack).resolve().name
        app = build_app(model.runtime, model_id, api_key=a.api_key, max_tokens_default=a.max_tokens_default,
                        queue_size=a.queue_size, telemetry_log=telemetry_log, speculator=model.speculator,
                        dashboard=a.dashboard, max_body_bytes=a.max_body_bytes,
                        responses_store=store_from_args(a), max_batch=a.max_batch,
                        request_timeout_s=a.request_timeout_s, **chat)
        release_openmp_pool()    # this thread loaded the model; the engine thread computes (engine/threads.py)
    except BaseException:
        model.close()
        raise
    return app, model


def main(a: argparse.Namespace) -> int:
    import signal

    if a.replicas != 1 or a.ray_address is not None:      # N replicas on Ray Serve, each planned where it runs
        from mawforge.serve.replicas import serve_replicas
        return serve_replicas(a)
    chat = chat_settings(a)                      # a bad template file or kwargs fail before the model loads
    opts, plan, run_plan = plan_served(a)
    if not plan.feasible:
        print(plan.table(), file=sys.stderr)
        print(f"mawforge serve: refusing to start: plan rejected: {plan.reason}", file=sys.stderr)
        return BudgetRejected.exit_code
    sock = bind(a.host, a.port)                  # a busy port fails before the model loads
    recorder = make_recorder(a)
    app, model = app_for(a, opts, run_plan, chat, recorder, a.telemetry_log)
    try:
        model_id = a.model_id or Path(a.pack).resolve().name
        announce = lambda url: print(f"mawforge serve: listening on {url} (model {model_id!r}, context "
                                     f"{opts.context}, queue {a.queue_size}, batch {a.max_batch})"
                                     + (f"; dashboard at {url}/" if a.dashboard else ""), file=sys.stderr, flush=True)
        # uvicorn re-raises SIGTERM after its graceful shutdown; a no-op handler makes that exit 0.
        signal.signal(signal.SIGTERM, lambda *_: None)
        _Server(app, a.log_level, a.shutdown_grace_s, announce).run(sockets=[sock])
    finally:
        model.close()
        if recorder is not None:
            recorder.save(a.trace_out)
    print("mawforge serve: stopped", file=sys.stderr)
    return 0
