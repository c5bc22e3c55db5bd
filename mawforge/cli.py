"""`mawforge` command: a dispatcher. Each command's arguments and main live with its module."""
from __future__ import annotations

import argparse
import importlib
import sys

from mawforge.errors import MawError

# name -> "module:attr"; attr is a class or module with help, add_arguments(p) and main(args).
COMMANDS = {
    "pack": "mawforge.commands.pack:Pack",
    "inspect": "mawforge.commands.pack:Inspect",
    "verify": "mawforge.commands.pack:Verify",
    "synth": "mawforge.synth:",
    "plan": "mawforge.commands.plan:",
    "run": "mawforge.commands.run:",
    "serve": "mawforge.commands.serve:",
    "replay": "mawforge.trace.replay:",
    "synth-trace": "mawforge.trace.synthetic:",
    "trace": "mawforge.trace.stats:",
    "bench": "mawforge.bench.command:",
    "tune": "mawforge.bench.tune:",
}


def os_message(e: OSError) -> str:
    """One line for an OSError: what failed, on which path."""
    import errno
    what = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded"}.get(e.errno, e.strerror or str(e))
    paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
    return f"{what}: {paths}" if paths else what


def _load(spec: str):
    mod, _, attr = spec.partition(":")
    m = importlib.import_module(mod)
    return getattr(m, attr) if attr else m


def load_config(path: str) -> dict:
    """A config file's `serve` mapping (as `mawforge tune` writes it), or its top-level mapping.
    Keys are option names (dashes or underscores); they become defaults, flags override them."""
    import json
    from pathlib import Path

    import yaml
    try:
        text = Path(path).read_text()
        d = yaml.safe_load(text) if path.endswith((".yaml", ".yml")) else json.loads(text)
    except FileNotFoundError:
        raise MawError(f"--config {path}: no such file") from None
    except (ValueError, yaml.YAMLError) as e:
        raise MawError(f"--config {path}: not valid JSON/YAML ({e})") from None
    d = d.get("serve", d) if isinstance(d, dict) else None
    if not isinstance(d, dict):
        raise MawError(f"--config {path}: expected a mapping of option names")
    return {k.replace("-", "_"): v for k, v in d.items()}


def _config_arg(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return None


def build_parser(only: str | None = None, defaults: dict | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mawforge", description="Run MoE models larger than memory.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, spec in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help="(see mawforge NAME --help)")
            continue
        try:
            cmd = _load(spec)
        except ImportError as e:   # a missing dependency: say which, never drop the command silently
            raise MawError(f"the {name} command cannot load: {e} (reinstall with `make venv`)") from None
        p = sub.add_parser(name, help=getattr(cmd, "help", None) or (cmd.__doc__ or "").split("\n")[0])
        cmd.add_arguments(p)
        if defaults:
            known = {a.dest for a in p._actions}
            unknown = sorted(set(defaults) - known)
            if unknown:
                raise MawError(f"--config: unknown options for {name}: {', '.join(unknown)}")
            p.set_defaults(**defaults)
            for act in p._actions:
                if act.dest in defaults:
                    act.required = False   # given by the config file
        p.set_defaults(_main=cmd.main)
    return ap


# commands whose --pack (and --draft-pack) may name a source instead: a GGUF file, any shard of a
# split GGUF or its directory, or a Hugging Face directory, packed on first use as load() does
SOURCE_PACK_COMMANDS = ("plan", "run", "serve")


def _resolve_packs(args) -> None:
    if getattr(args, "command", None) not in SOURCE_PACK_COMMANDS:
        return
    from mawforge.api import open_pack
    for attr in ("pack", "draft_pack"):
        if getattr(args, attr, None):
            setattr(args, attr, str(open_pack(args.pack if attr == "pack" else args.draft_pack,
                                              progress=sys.stderr.isatty())))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    first = next((a for a in argv if not a.startswith("-")), None)
    if first == "bench":
        from mawforge.bench.command import normalize
        argv = normalize(argv)
    try:
        cfg = _config_arg(argv)
        defaults = load_config(cfg) if cfg and first in COMMANDS else None
        args = build_parser(first if first in COMMANDS else None, defaults).parse_args(argv)
    except MawError as e:
        print(f"mawforge: error: {e}", file=sys.stderr)
        return e.exit_code
    try:
        _resolve_packs(args)
        return int(args._main(args) or 0)
    except MawError as e:
        print(f"mawforge {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:   # `mawforge inspect X | head`: the reader left, nothing to say
        sys.stderr.close()
        return 0
    except OSError as e:      # permissions, a file where a directory belongs, a full disk: the user's to fix
        print(f"mawforge {args.command}: error: {os_message(e)}", file=sys.stderr)
        return MawError.exit_code
    except KeyboardInterrupt:
        print(f"mawforge {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
