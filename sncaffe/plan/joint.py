"""A solver's nets planned as one: the train net, its test nets and the solver's history
share one device pool (and one host pool), so each net's plan must leave room for the
others' persistent tensors, and on the CPU both tiers together stay within the RAM.

The pool sees, in this order: the train net's persistent tensors, each test net's, then
the history. A net's iteration runs while the others' are idle (their transient blocks
freed), so each net is planned with the others' persistent blocks placed around its own
exactly where the pool will put them: ``before`` (the nets bound earlier) and the blocks
after (later nets, then the history). Every plan starts from the same base, and the
pool's measured peak is the largest of the plans' peaks.

``auto`` for the train net tries its modes cheapest first; for each, a test net takes
``liveness`` where it fits beside it (``none`` would only hold its activations for nothing).
A test runs forward alone, and every test plan covers that pass alone: each value lives
until its last forward use, so no mode has anything to offload or recompute (a test net in
``offload`` or ``all`` gets the ``liveness`` plan under that name, not one with backward's needs).
"""
from __future__ import annotations

import logging

from .passes import liveness
from .planner import AUTO_STEPS, MemoryExhausted, shared_ram_plan, quick_bound
from ..sizes import align, fmt_bytes
log = logging.getLogger("sncaffe")
TEST_ORDER = ("liveness",)     # forward alone: the other modes' plans would be the same


def persistent_blocks(graph, mode, host_params=False):
    """(sizes of the device blocks a net in ``mode`` binds, in order; host bytes its hosted
    parameters take), as the planner decides them."""
    roots, _ = liveness(graph, graph.forward_ops + graph.backward_ops, mode)
    homes = 0
    if host_params:
        params = {id(t.root) for n in graph.layers for d, dd in n.params for t in (d, dd)}
        homes = sum(r.block_bytes for r in roots if id(r) in params)
        roots = [r for r in roots if id(r) not in params]
    return [r.nbytes for r in roots if r.location == ""], homes


def plan_nets(train, tests, history, capacity, host_capacity=None, ram=None, spill=None):
    """(train plan, [test plans]) for deferred nets (``Net(..., defer=True)``): ``train.memory``
    and each test's ``memory`` say their modes (``auto`` allowed), ``train.host_params`` whether
    parameters live on the host (then ``history``, the solver's blocks, goes there too)."""
    host_history = sum(align(max(b, 1)) for b in history)
    if train.memory != "auto":
        candidates = [(train.memory, train.host_params, None)]
    else:
        candidates = [(m, train.host_params, g) for m, g in AUTO_STEPS]
        if not train.host_params:
            candidates.append(("all", True, None))
    limit = min(x for x in (capacity, ram, 1 << 62) if x is not None)
    last = None                 # (which net, the net, its plan) tried last, for the error
    for mode, hosted, granularity in candidates:
        dev_history = [] if hosted else list(history)
        own, homes = persistent_blocks(train.graph, mode, hosted)
        test_own = [persistent_blocks(t.graph, "liveness" if t.memory == "auto" else t.memory)[0] for t in tests]
        after = [b for blocks in test_own for b in blocks] + dev_history
        # (a mode given is planned even so: the error then says what it needs)
        if train.memory == "auto" and quick_bound(train.graph, mode, after, hosted, per_layer=granularity == 0) > limit:
            continue
        if len(train.graph.layers) >= 1000:
            log.info("planning memory: trying mode '%s' for the train net beside %d test net(s)", mode, len(tests))
        kw = dict(host_capacity=host_capacity, ram=ram, spill=spill)
        plan = shared_ram_plan(train.graph, mode, capacity, after, host_params=hosted,
                                host_extra=list(history) if hosted else 0, granularity=granularity, **kw)
        last = ("train net", train, plan)
        if not plan.fits:
            continue
        test_plans, before = [], list(own)
        # Beside a test net: the train net's hosted parameters and history, on the host or on disk.
        beside = dict(host_extra=plan.host_extra, disk_extra=plan.disk_base) if plan.param_disk else \
            dict(host_extra=homes + (host_history if hosted else 0))
        for i, test in enumerate(tests):
            later = [b for blocks in test_own[i + 1:] for b in blocks] + dev_history
            choice = None
            for m in (TEST_ORDER if test.memory == "auto" else (test.memory,)):
                mine = persistent_blocks(test.graph, m)[0]
                # A test net only runs forward: planned so, whatever its mode.
                p = shared_ram_plan(test.graph, m, plan.arena or capacity, later, before=before, forward_only=True,
                                     **beside, **kw)
                last = (f"test net #{i}", test, p)
                if p.fits and mine == test_own[i]:
                    choice = p
                    break
            if choice is None:
                break
            test_plans.append(choice)
            before += test_own[i]
        if len(test_plans) == len(tests):
            return plan, test_plans
    if last is None:
        raise MemoryExhausted(f"no memory mode fits the train net in {fmt_bytes(limit)}, beside its "
                              f"{len(tests)} test net(s) and the solver's history; use a smaller batch")
    what, net, plan = last
    need = f"{fmt_bytes(plan.peak + plan.host_peak)} of device and host memory together" if plan.device_fits \
        else f"{fmt_bytes(plan.peak)} of device memory" + (f" ({plan.overflow})" if plan.overflow else "")
    raise MemoryExhausted(
        f"no memory mode fits the train net ({train.name or 'net'}), its {len(tests)} test net(s) and the "
        f"solver's history, planned together, in {fmt_bytes(capacity)} of device memory"
        + (f" ({fmt_bytes(ram)} of RAM for device and host)" if ram is not None else "")
        + f"; the last tried, mode '{plan.mode}' for the {what}, needs {need}: give the device more "
          f"(--device-memory) or use a smaller batch")
