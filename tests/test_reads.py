"""Expert block reads on native threads (cache/store.py NativeReadPool, kernels/native/reader.c)
against the Python reader pool and the file's own bytes: the same bytes, the same errors, raised on
the thread that takes the result, and nothing left in flight at shutdown."""
from __future__ import annotations

import errno
import os
import shutil

import pytest

from mawforge.cache.store import ExpertStore, NativeReadPool, ReadPool, SlotMemory
from mawforge.errors import IntegrityError
from mawforge.pack.manifest import EXPERTS, read_index

from helpers import needs_cc

pytestmark = needs_cc       # the native pool is in the kernels' library, compiled at first use


def _blocks(pack):
    index = read_index(pack)
    return index, [(l, e) for l, lb in enumerate(index.layers) for e in range(len(lb.offsets))]


def _file_bytes(pack, index, key):
    off, n, _ = index.block(*key)
    with open(pack / EXPERTS, "rb") as f:
        f.seek(off)
        return f.read(n)


def test_native_reads_give_every_blocks_bytes(packs):
    pack = packs[("qwen3_moe", "Q4_K_M")]
    index, keys = _blocks(pack)
    stores = {"native": ExpertStore(pack, index), "python": ExpertStore(pack, index, native_reads=False)}
    assert isinstance(stores["native"].pool, NativeReadPool) and isinstance(stores["python"].pool, ReadPool)
    try:
        for name, store in stores.items():
            mems = {k: SlotMemory(index.block(*k)[1]) for k in keys}
            futures = {k: store.submit(*k, mems[k].buf, demand=i % 3 == 0) for i, k in enumerate(keys)}
            for k, f in futures.items():
                n = index.block(*k)[1]
                assert f.result() == n and f.done() and f.exception() is None, (name, k)
                assert bytes(memoryview(mems[k].buf)[:n]) == _file_bytes(pack, index, k), (name, k)
            assert store.bytes_read == sum(index.block(*k)[1] for k in keys)
            some = keys[:5]                      # read_many: the demand path, several at once
            mems = {k: SlotMemory(index.block(*k)[1]) for k in some}
            store.read_many([(*k, mems[k].buf) for k in some])
            for k in some:
                assert bytes(memoryview(mems[k].buf)[:index.block(*k)[1]]) == _file_bytes(pack, index, k)
    finally:
        for store in stores.values():
            store.close()


@pytest.mark.parametrize("native_reads", [True, False], ids=["native", "python"])
def test_a_damaged_block_is_an_integrity_error_to_whoever_takes_it(packs, tmp_path, native_reads):
    pack = tmp_path / "p"
    shutil.copytree(packs[("qwen3_moe", "Q4_K_M")], pack)
    index, _ = _blocks(pack)
    off, n, _ = index.block(1, 2)
    with open(pack / EXPERTS, "r+b") as f:
        f.seek(off + 7)
        b = f.read(1)
        f.seek(off + 7)
        f.write(bytes([b[0] ^ 0x40]))
    store = ExpertStore(pack, index, native_reads=native_reads)
    try:
        good, bad = SlotMemory(index.block(0, 0)[1]), SlotMemory(n)
        fg, fb = store.submit(0, 0, good.buf), store.submit(1, 2, bad.buf)
        assert fg.result() == index.block(0, 0)[1]
        with pytest.raises(IntegrityError, match="layer 1 expert 2 is damaged"):
            fb.result()
        assert isinstance(fb.exception(), IntegrityError)          # asked again: the same answer
        with pytest.raises(IntegrityError, match="damaged"):
            store.read_many([(0, 1, SlotMemory(index.block(0, 1)[1]).buf), (1, 2, bad.buf)])
        assert store.bytes_read == index.block(0, 0)[1] + index.block(0, 1)[1]   # only good blocks count
    finally:
        store.close()


def test_a_truncated_pack_and_a_failed_read_are_errors_not_garbage(packs, tmp_path):
    pack = tmp_path / "p"
    shutil.copytree(packs[("qwen3_moe", "Q4_K_M")], pack)
    index, keys = _blocks(pack)
    last = keys[-1]
    off, n, _ = index.block(*last)
    os.truncate(pack / EXPERTS, off + n // 2)
    store = ExpertStore(pack, index, check_digests=False)
    try:
        with pytest.raises(IntegrityError, match=f"truncated at layer {last[0]} expert {last[1]}"):
            store.submit(*last, SlotMemory(n).buf).result()
        fd, store.fd = store.fd, os.open(os.devnull, os.O_WRONLY)  # a descriptor pread refuses
        try:
            err = store.submit(0, 0, SlotMemory(index.block(0, 0)[1]).buf).exception()
            assert isinstance(err, OSError) and err.errno == errno.EBADF and "layer 0 expert 0" in str(err)
        finally:
            os.close(store.fd)
            store.fd = fd
        assert store.submit(0, 0, SlotMemory(index.block(0, 0)[1]).buf).result() == index.block(0, 0)[1]
    finally:
        store.close()


def test_shutdown_reads_every_queued_block_then_refuses_more(packs):
    pack = packs[("qwen3_moe", "Q4_K_M")]
    index, keys = _blocks(pack)
    store = ExpertStore(pack, index, threads=1)
    mems = {k: SlotMemory(index.block(*k)[1]) for k in keys}
    futures = {k: store.submit(*k, mems[k].buf) for k in keys}
    store.close()                                 # drains the queue before the descriptor closes
    for k, f in futures.items():
        assert f.done() and f.result() == index.block(*k)[1]
        assert bytes(memoryview(mems[k].buf)[:index.block(*k)[1]]) == _file_bytes(pack, index, k)
    with pytest.raises(RuntimeError, match="shut down"):
        store.submit(*keys[0], mems[keys[0]].buf)
