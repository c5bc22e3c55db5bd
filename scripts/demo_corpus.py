"""The demo model's training text: English prose and technical writing that Debian ships
offline under licenses that allow training and redistribution, cleaned to plain text.

Sources (each a registry entry: the Debian packages it needs, the license, and an extractor):
    kjv        King James Bible (1611), public domain; `bible-kjv` prints it verse by verse.
    pydocs     Python 3.11 documentation, reStructuredText sources from python3.11-doc,
               PSF License Agreement v2 (code examples also Zero-Clause BSD).
The Debian Reference (GPL-2+) is left out on purpose: weights trained on it would carry a
copyleft question the demo does not need.

Documents (a Bible chapter, a docs page) are split into train and held-out by a hash of their
name, so the held-out perplexity is measured on whole unseen documents. A share of the train
documents also becomes ChatML conversations (a docs heading asked as a question and its first
paragraph as the answer; a verse reference and its verse), so the chat template means something
to the model and `make demo --chat` gets prose back.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
HELDOUT_EVERY = 40          # ~2.5% of documents, chosen by name hash


@dataclass(frozen=True)
class Source:
    name: str
    packages: tuple[str, ...]
    license: str
    origin: str
    extract: Callable[[], Iterator[tuple[str, str]]]     # yields (doc name, text)


def _kjv() -> Iterator[tuple[str, str]]:
    out = subprocess.run(["bible", "-l10000", "Gen1:1-Rev22:21"], capture_output=True, text=True,
                         check=True).stdout
    # "Genesis 1" headings, then "  1 In the beginning ..." verse lines
    for m in re.finditer(r"^(\S.*? \d+)\n(.*?)(?=^\S.*? \d+\n|\Z)", out, re.M | re.S):
        verses = [re.sub(r"^\s*\d+\s+", "", v).strip() for v in m[2].strip().splitlines() if v.strip()]
        yield f"kjv/{m[1]}", f"{m[1]}\n\n" + "\n".join(verses)


_ROLE = re.compile(r":[\w:.-]+:`!?~?([^`<]*?)(?:\s*<[^>]*>)?`")
_HEADING_RULE = re.compile(r"^([=*\-~^\"#+`'])\1{2,}\s*$")
_DROP_DIRECTIVES = ("index", "toctree", "highlight", "module", "currentmodule", "sectionauthor",
                    "moduleauthor", "testsetup", "testcleanup", "only", "raw", "include", "audit-event",
                    "impl-detail", "versionchanged", "versionadded", "deprecated", "seealso", "tabularcolumns")


def clean_rst(text: str) -> str:
    """reST source to plain prose: roles to their text, directives that carry no prose dropped
    with their indented bodies, heading rules and label lines removed."""
    out, skip_indent = [], None
    for line in text.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if not stripped or indent > skip_indent:
                continue
            skip_indent = None
        if stripped.startswith(".. "):
            m = re.match(r"\.\. ([\w:-]+)::", stripped)
            if stripped.startswith(".. _") or stripped.startswith(".. |") or m is None \
                    or m[1].split(":")[-1] in _DROP_DIRECTIVES or stripped == "..":
                skip_indent = indent
                continue
            line = " " * indent + stripped.split("::", 1)[1].strip()   # e.g. ".. note:: text"
        if _HEADING_RULE.match(stripped):
            continue
        line = _ROLE.sub(r"\1", line)
        line = re.sub(r"``([^`]*)``", r"\1", line)
        line = re.sub(r"`([^`<]*?)(?:\s*<[^>]*>)?`_{1,2}", r"\1", line)
        line = line.replace("\\", "") if "::" not in line else line
        out.append(line.rstrip())
    text = "\n".join(out)
    text = re.sub(r"::$", ":", text, flags=re.M)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _pydocs() -> Iterator[tuple[str, str]]:
    root = Path("/usr/share/doc/python3.11/html/_sources")
    for path in sorted(root.rglob("*.rst.txt")):
        rel = str(path.relative_to(root))
        if rel.startswith(("whatsnew/changelog", "license", "c-api/")):
            continue        # release notes are lists of issue numbers; license text is legal boilerplate
        text = clean_rst(path.read_text(errors="replace"))
        if len(text) > 200:
            yield f"pydocs/{rel}", text


SOURCES = {s.name: s for s in (
    Source("kjv", ("bible-kjv", "bible-kjv-text"), "public domain (King James Version, 1611)",
           "Debian bookworm packages bible-kjv-text 4.38 / bible-kjv", _kjv),
    Source("pydocs", ("python3.11-doc",), "PSF License Agreement for Python 3.11 (docs); examples 0BSD",
           "Debian bookworm package python3.11-doc, html/_sources/*.rst.txt", _pydocs),
)}


def ensure_packages(sources) -> None:
    """Install the Debian packages the sources need (apt-get; a no-op when present)."""
    missing = [p for s in sources for p in s.packages
               if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode != 0]
    if missing:
        if shutil.which("apt-get") is None:
            raise SystemExit(f"need Debian packages {missing} and there is no apt-get here")
        subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", *missing], check=True,
                       env={"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})


def _held_out(name: str) -> bool:
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0


def _chat(user: str, answer: str) -> str:
    return f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{answer}{IM_END}\n"


_ASK = ("Tell me about {}.", "What is {}?", "Explain {}.", "Can you describe {}?")


def chat_samples(name: str, text: str, rng: random.Random) -> list[str]:
    """Conversations taken from one document (see the module docstring)."""
    out = []
    if name.startswith("kjv/"):
        book_ch = name[4:]
        for i, verse in enumerate(text.split("\n\n", 1)[1].splitlines(), 1):
            if rng.random() < 0.15:
                out.append(_chat(f"What does {book_ch}:{i} say?", verse))
        return out
    paras = text.split("\n\n")
    for i, para in enumerate(paras[:-1]):
        head, body = para.strip(), paras[i + 1]
        if "\n" in head or not (3 <= len(head) <= 60) or head.endswith(".") or len(body) < 80 \
                or body[:1].isspace() or body.startswith(">>>") or ". " not in body:
            continue
        body = body.strip()
        out.append(_chat(rng.choice(_ASK).format(head.rstrip(".:")), body))
    return out


def build_corpus(out_dir: Path, seed: int = 0) -> dict:
    """Write train.txt and heldout.txt (documents joined by <|endoftext|>) and sources.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ensure_packages(SOURCES.values())
    rng = random.Random(seed)
    train, held, chats, stats = [], [], [], {}
    for src in SOURCES.values():
        n_docs = n_chars = 0
        for name, text in src.extract():
            (held if _held_out(name) else train).append(text)
            if not _held_out(name):
                chats.extend(chat_samples(name, text, rng))
            n_docs, n_chars = n_docs + 1, n_chars + len(text)
        stats[src.name] = {"license": src.license, "origin": src.origin, "packages": list(src.packages),
                           "documents": n_docs, "chars": n_chars}
    docs = train + chats
    rng.shuffle(docs)
    (out_dir / "train.txt").write_text(EOT.join(docs) + EOT)
    (out_dir / "heldout.txt").write_text(EOT.join(held) + EOT)
    meta = {"sources": stats, "train_documents": len(train), "chat_samples": len(chats),
            "heldout_documents": len(held), "heldout_every": HELDOUT_EVERY,
            "train_chars": sum(map(len, docs)), "heldout_chars": sum(map(len, held))}
    (out_dir / "sources.json").write_text(json.dumps(meta, indent=2))
    return meta
