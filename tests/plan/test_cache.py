"""The LRU cache of offloaded tensors: hits, misses and evictions under a capacity, least
recently used first, and schedules that stay within the capacity, placement included."""
import numpy as np
import pytest

from sncaffe import Net
from sncaffe.backend import CPUDevice
from sncaffe.plan.liveness import analyze, persistent_roots
from sncaffe.plan.planner import make_plan
from sncaffe.runtime.pool import OutOfMemory, Pool
from conftest import ROOT
from test_modes import feed, graph_of, net_param
from test_planner import Planned, check_schedule, resnet

MiB = 1 << 20


@pytest.fixture(scope="module")
def r50():
    return Planned("resnet50 batch 16", resnet(50))


def offloaded(plan):
    """Device values (not checkpoint copies) the plan copies to host."""
    return [ins.tensor for ins in plan.schedule if ins.kind == "offload" and ins.source is None]


def prefetched(plan):
    return [ins.tensor for ins in plan.schedule if ins.kind == "prefetch" and ins.source is None]


def capacities(plan, n=6):
    """From the uncached plan's peak up to room for every offloaded value."""
    top = plan.peak + sum(t.nbytes for t in offloaded(plan))
    return [int(c) // 256 * 256 for c in np.linspace(plan.peak, top, n)]


def test_without_capacity_every_value_comes_back_by_prefetch(r50):
    plan = r50.plans["offload"]
    values = offloaded(plan)
    assert values and plan.cache_hits == 0 and plan.cache_misses == len(values)
    assert {id(t) for t in prefetched(plan)} == {id(t) for t in values}
    assert plan.h2d_bytes == plan.d2h_bytes == sum(t.nbytes for t in values)


def test_with_room_for_everything_every_value_is_a_hit(r50):
    plan = make_plan(r50.graph, "offload", 64 << 30)
    assert plan.fits and plan.cache_misses == 0 and plan.h2d_bytes == 0 and not prefetched(plan)
    assert plan.cache_hits == len(offloaded(plan)) and plan.d2h_bytes > 0
    assert plan.peak >= r50.plans["offload"].peak            # the cache uses what memory there is


@pytest.mark.parametrize("mode", ["offload", "all"])
def test_hits_and_misses_under_a_capacity(r50, mode):
    results = []
    for capacity in capacities(make_plan(r50.graph, mode, cost_aware=False)):
        plan = make_plan(r50.graph, mode, capacity, cost_aware=False)   # the cache alone
        if not plan.fits:
            continue
        values = offloaded(plan)
        missed = prefetched(plan)
        assert plan.cache_hits + plan.cache_misses == len(values)
        assert len(missed) == plan.cache_misses and {id(t) for t in missed} <= {id(t) for t in values}
        checkpoints = sum(ins.tensor.nbytes for ins in plan.schedule if ins.kind == "prefetch" and ins.source)
        assert plan.h2d_bytes == sum(t.nbytes for t in missed) + checkpoints
        assert plan.peak <= capacity
        check_schedule(plan)
        results.append((capacity, plan.cache_misses))
    assert len(results) >= 3
    misses = [m for _, m in results]
    assert misses[0] > misses[-1] and misses[-1] == 0
    assert misses == sorted(misses, reverse=True)        # more room, fewer misses


def test_evictions_are_least_recently_used_first(r50):
    graph = r50.graph
    plan = make_plan(graph, "offload", capacities(r50.plans["offload"])[1])
    assert plan.fits and plan.cache_misses > 0
    uses = {id(r): u for r, u in analyze(graph.ops, persistent_roots(graph)).values()}
    nf = len(graph.forward_ops)
    # A value enters the cache after its last forward use; a hit takes it out for good.
    entered = {id(t): max(x for x in uses[id(t)].reads + uses[id(t)].writes if x < nf) for t in offloaded(plan)}
    instrs = list(plan.schedule)
    hosted, evictions = set(), []
    for k, ins in enumerate(instrs):
        key = id(ins.tensor)
        if ins.kind == "offload":
            hosted.add(key)
        elif ins.kind in ("prefetch", "drop"):
            hosted.discard(key)                            # brought back, or done with
        elif ins.kind == "free" and key in hosted and key in entered:
            after = instrs[k + 1] if k + 1 < len(instrs) else None
            if not (after and after.kind == "drop" and after.tensor is ins.tensor):   # a release, not an eviction
                evictions.append(key)
    assert evictions and [entered[k] for k in evictions] == sorted(entered[k] for k in evictions)
    # and what was evicted is exactly what had to be prefetched
    assert {id(t) for t in prefetched(plan)} == set(evictions)


@pytest.mark.parametrize("mode", ["offload", "all"])
def test_a_fitting_plan_places_on_the_device_allocator(r50, mode):
    """Replaying the schedule on a real Pool of the capacity never runs out of blocks."""
    checked = 0
    for capacity in capacities(r50.plans[mode], 4):
        plan = make_plan(r50.graph, mode, capacity, cost_aware=False)   # the cache alone
        if not plan.fits:
            continue
        checked += 1
        pool, where = Pool(capacity), {}
        for r in plan.persistent:
            pool.alloc(r.nbytes)
        for ins in plan.schedule:
            try:
                if ins.kind == "alloc":
                    where[id(ins.tensor)] = pool.alloc(ins.tensor.nbytes)
                elif ins.kind == "free":
                    pool.free(where.pop(id(ins.tensor)))
            except OutOfMemory as e:
                pytest.fail(f"{mode} at {capacity}: {ins}: {e}")
        assert pool.peak == plan.peak
    assert checked, "no capacity fitted: nothing was replayed"


def test_device_run_moves_what_the_plan_says():
    param = net_param(ROOT / "prototxt" / "resnet50.prototxt", 14)    # chunks of conv1's 7-image blocks
    graph = graph_of(param)
    uncached = make_plan(graph, "offload")

    def evicts(plan):
        return plan.fits and plan.cache_misses > 0 and plan.cache_hits > 0
    # from above the uncached peak (a capacity just above it can fail on fragmentation where a
    # convolution's workspace does not shrink with its chunk: oneDNN's scratchpads) down to where
    # the cache misses
    capacity = next(c for c in range(2 * uncached.peak, uncached.peak // 2, -4096)
                    if evicts(make_plan(graph, "offload", c)))
    net = Net(param, "TRAIN", device=CPUDevice(capacity), memory="offload")
    assert net.plan.cache_misses > 0 and net.plan.cache_hits > 0
    feed(net, np.random.default_rng(0))
    net.forward()
    net.backward()
    stats = net.executor.stats
    assert stats["d2h_bytes"] == net.plan.d2h_bytes and stats["h2d_bytes"] == net.plan.h2d_bytes
    assert net.device.host_pool.in_use == 0 and net.device.pool.in_use == net.plan.persistent_bytes
    assert net.device.pool.peak == net.plan.peak


def test_the_least_recently_kept_value_on_a_location_is_evicted_first():
    from sncaffe.plan.cache import LRUCache
    graph = graph_of(net_param(ROOT / "prototxt" / "lenet_train_test.prototxt"))
    a, b, c = [r for r, _ in analyze(graph.ops, persistent_roots(graph)).values()][:3]
    cache = LRUCache()
    for r in (a, b, c):
        cache.keep(r)
    assert cache.victim("") is a and cache.victim("elsewhere") is None
    assert cache.take(a) and not cache.take(a)          # used again: a hit once, then not cached
    assert cache.victim("") is b
    cache.take(b)
    cache.keep(b)                                       # used, then kept again: now the most recent
    assert cache.victim("") is c
