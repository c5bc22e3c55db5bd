"""`mawforge serve` options for chat templates, reasoning and tool calls, named as llama-server
names them (--chat-template-file, --chat-template-kwargs, --reasoning-format, --reasoning,
--reasoning-effort), plus the testing hook --allow-forced-output, and the replica options
(--replicas, --ray-address: serve/replicas.py)."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from mawforge.text.chat import ChatTemplate
from mawforge.errors import MawError
from mawforge.front.chatreq import REASONING_FORMATS, REASONING_MODES, ChatDefaults


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("chat templates, reasoning and tool calls")
    g.add_argument("--chat-template-file", default=None,
                   help="a jinja chat template to use instead of the pack's (its markers also choose the "
                        "tool-call format)")
    g.add_argument("--chat-template-kwargs", default=None,
                   help='template switches for every request, a JSON object, e.g. \'{"enable_thinking": false}\' '
                        "(a request's chat_template_kwargs override them)")
    g.add_argument("--reasoning-format", default="auto", choices=REASONING_FORMATS,
                   help="auto/deepseek: a thinking model's reasoning goes to message.reasoning_content; "
                        "none: it stays in content, unparsed")
    g.add_argument("--reasoning", default="auto", choices=REASONING_MODES,
                   help="on/off set the template's enable_thinking; auto leaves the template's default")
    g.add_argument("--reasoning-effort", default=None,
                   help="reasoning_effort given to the template (gpt-oss: low, medium, high)")
    g.add_argument("--allow-forced-output", action="store_true",
                   default=os.environ.get("MAWFORGE_ALLOW_FORCED_OUTPUT") == "1",
                   help="TESTING ONLY: accept a request field forced_output (text) whose tokens are emitted "
                        "instead of sampled ones, so tool-call and reasoning parsing can be driven end to end "
                        "(default: $MAWFORGE_ALLOW_FORCED_OUTPUT=1, else off)")


def chat_settings(a: argparse.Namespace) -> dict:
    """build_app keyword arguments from the parsed options (one-line errors for bad values)."""
    template = None
    if a.chat_template_file:
        try:
            template = Path(a.chat_template_file).read_text()
        except OSError as e:
            raise MawError(f"cannot read --chat-template-file {a.chat_template_file}: {e.strerror}") from None
        ChatTemplate(template)                   # FormatError (one line) if it does not parse
    kwargs = {}
    if a.chat_template_kwargs:
        try:
            kwargs = json.loads(a.chat_template_kwargs)
        except ValueError as e:
            raise MawError(f"--chat-template-kwargs is not JSON: {e}") from None
        if not isinstance(kwargs, dict):
            raise MawError("--chat-template-kwargs must be a JSON object")
    return {"chat_template": template, "allow_forced_output": a.allow_forced_output,
            "chat_defaults": ChatDefaults(a.reasoning_format, a.reasoning, a.reasoning_effort, kwargs)}


def add_replica_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas on a Ray cluster (Ray Serve; docs/replicas.md)")
    g.add_argument("--replicas", type=int, default=1,
                   help="serve N replicas with Ray Serve behind one endpoint; each plans its own "
                        "--memory-budget-gib on its node (default 1: this process, no Ray)")
    g.add_argument("--ray-address", default=None,
                   help="the Ray cluster to deploy on: auto (the one `ray start` made here), ray://HOST:10001, "
                        "or none given: a local Ray started for this server")
    g.add_argument("--replica-cpus", type=float, default=None,
                   help="Ray CPUs each replica takes (default: --threads, else 1)")
