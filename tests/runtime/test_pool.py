import threading

import numpy as np
import pytest

from sncaffe.runtime.pool import OutOfMemory, Pool
from sncaffe.sizes import ALIGNMENT, parse_bytes


def test_alignment_and_accounting():
    pool = Pool(1 << 20)
    a = pool.alloc(1)
    b = pool.alloc(300)
    assert a % ALIGNMENT == 0 and b % ALIGNMENT == 0
    assert pool.size_of(a) == 256 and pool.size_of(b) == 512
    assert pool.in_use == 768 and pool.peak == 768
    pool.free(a)
    assert pool.in_use == 512 and pool.peak == 768


def test_free_neighbours_merge_back_into_one_block():
    pool = Pool(4096)
    offs = [pool.alloc(256) for _ in range(16)]
    assert pool.largest_free == 0
    with pytest.raises(OutOfMemory):
        pool.alloc(1)
    for o in offs[::2] + offs[1::2]:       # free out of order: merges on both sides
        pool.free(o)
    assert pool.largest_free == 4096 and pool.fragmentation == 0.0
    assert pool.alloc(4096) == 0


def test_best_fit_and_fragmentation():
    pool = Pool(256 * 10)
    offs = [pool.alloc(256) for _ in range(10)]
    pool.free(offs[1])                      # a 1-block hole
    pool.free(offs[4]); pool.free(offs[5])  # a 2-block hole
    assert pool.alloc(256) == offs[1]       # best fit takes the small hole
    assert pool.fragmentation == 0.0
    pool.free(offs[8])
    assert pool.fragmentation == pytest.approx(1 / 3)


def test_out_of_memory_names_tensor_and_shortfall():
    pool = Pool(1024)
    pool.alloc(512)
    with pytest.raises(OutOfMemory) as e:
        pool.alloc(1000, name="conv1")
    msg = str(e.value)
    assert 'tensor "conv1"' in msg and "short" in msg and e.value.nbytes == 1024


def test_random_alloc_free_keeps_invariants():
    rng = np.random.default_rng(0)
    pool = Pool(1 << 16)
    live = {}
    for _ in range(2000):
        if live and rng.random() < 0.5:
            off = list(live)[rng.integers(len(live))]
            pool.free(off)
            del live[off]
        else:
            try:
                off = pool.alloc(int(rng.integers(1, 4000)))
            except OutOfMemory:
                continue
            live[off] = pool.size_of(off)
        spans = sorted((o, o + s) for o, s in live.items())
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "blocks overlap"
        assert pool.in_use == sum(live.values())
        assert sum(s for s, _ in pool._by_size) == pool.capacity - pool.in_use


def test_thread_safety():
    pool = Pool(1 << 20)

    def work():
        for _ in range(500):
            pool.free(pool.alloc(512))
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.in_use == 0 and pool.largest_free == pool.capacity


def test_parse_bytes():
    assert parse_bytes("12GiB") == 12 << 30
    assert parse_bytes("512MB") == 512 << 20
    assert parse_bytes("1.5G") == 3 << 29
    assert parse_bytes(4096) == 4096
