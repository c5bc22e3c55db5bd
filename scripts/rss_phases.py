"""Where a MawForge process's memory goes, phase by phase (init, a 64-token prefill, 16 decode steps,
a long prompt): VmRSS, RssAnon, RssFile and the high-water mark against the plan's C, E, K, O and F.

    python scripts/rss_phases.py PACK BUDGET_GIB PREFILL_CHUNK
"""
import sys

import numpy as np
import torch

from mawforge.bench.prompts import prompt_for
from mawforge.engine.runtime import Runtime, RuntimeOptions
from mawforge.plan import Budget


def rss():
    s = open('/proc/self/status').read()
    g = lambda k: int([l for l in s.splitlines() if l.startswith(k)][0].split()[1]) * 1024
    return g('VmRSS:'), g('RssAnon:'), g('RssFile:'), g('VmHWM:')


def show(tag):
    r = rss()
    print('%-12s rss %.3f anon %.3f file %.3f hwm %.3f GiB' % (tag, *(x / 2**30 for x in r)), flush=True)


def main():
    torch.set_num_threads(2)
    rt = Runtime(sys.argv[1], RuntimeOptions(context=1024, budget=Budget.from_gib(float(sys.argv[2]), "argv[2]"),
                                             prefill_chunk=int(sys.argv[3]), threads=2,
                                             check_digests=False, stream_embeddings=True))
    p = rt.plan
    print('plan C %.3f E %.3f K %.3f O %.3f F %.3f GiB' % tuple(x / 2**30 for x in (p.C, p.E, p.K, p.O, p.F)))
    show('init')
    rng = np.random.default_rng(1)
    rt.forward([int(t) for t in rng.integers(1000, 150000, 64)])
    show('prefill64')
    for i in range(16):
        rt.forward([int(rng.integers(1000, 150000))], kind='decode')
    show('decode16')
    rt.reset()
    ids = rt.tokenizer.encode(prompt_for('summarization', 0))
    rt.forward(ids)
    show('prefill%d' % len(ids))
    s = rt.cache.stats()
    print('held %.3f peak_held %.3f cap %.3f' % (s['held_bytes'] / 2**30, s['peak_held_bytes'] / 2**30,
                                                 s['capacity_bytes'] / 2**30))


if __name__ == "__main__":
    main()
