"""Workspaces in chunks (plan/chunks.py): the chunk search finds the largest candidate whose
workspace fits, by bisection, on a real net's convolutions."""
import math
from dataclasses import replace

from sncaffe import config
from sncaffe.plan.chunks import choose_chunk, chunk_sizes, chunk_workspace
from sncaffe.plan.liveness import workspaces
from sncaffe.sizes import align
from conftest import ROOT
from test_modes import graph_of, net_param


def test_the_search_takes_the_largest_chunk_that_fits_in_log_trials(monkeypatch):
    monkeypatch.setattr(config, "settings", replace(config.settings, conv="native"))    # sncaffe's kernels: workspaces that shrink with the chunk
    graph = graph_of(net_param(ROOT / "prototxt" / "lenet_train_test.prototxt", batch=64))
    ops = [op for op in graph.ops if op.node.type == "Convolution" and workspaces(op)]
    assert ops
    for op in ops:
        node, dtype = op.node, op.writes[0].dtype
        sizes = chunk_sizes(node, node.bottoms[0].shape[0])
        need = {c: sum(align(t.nbytes) for t in chunk_workspace(graph, node, c, dtype)) for c in sizes}
        for limit in sorted(set(need.values()))[::7] + [min(need.values()) - 1]:
            best, trials = choose_chunk(graph, op, lambda s: sum(align(n) for n in s) <= limit)
            fitting = [c for c in sizes if need[c] <= limit]      # every candidate, one by one
            assert (best[0] if best else None) == (max(fitting) if fitting else None)
            assert 0 < trials <= math.floor(math.log2(len(sizes))) + 1
