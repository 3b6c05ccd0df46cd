"""Workspaces in chunks: where an operator's full workspace cannot be placed, it works the
batch in chunks, the largest whose workspace fits now. A workspace grows with the chunk, so
the chunk is found by bisection over the candidate sizes: O(log batch) trials, whatever the
batch (a batch of a million is 20 trials, not a million)."""
from __future__ import annotations

from ..tensor import workspace_tensors


def chunk_sizes(node, batch):
    """The chunk sizes tried, ascending (the candidates of every chunk search): the layer's own
    (a convolution's are multiples of its reduction block: layers/conv.py's chunk contract)."""
    return node.layer.chunk_sizes(batch)


def choose_chunk(graph, op, fits):
    """((chunk, workspace tensors) or None, trials): the largest candidate chunk whose
    workspace ``fits`` (a test on block sizes), or None where none does or the layer
    cannot work in chunks."""
    node = op.node
    batch = node.bottoms[0].shape[0] if node.bottoms and node.bottoms[0].shape else 0
    sizes = chunk_sizes(node, batch)
    lo, hi, best, trials = 0, len(sizes) - 1, None, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        ws = chunk_workspace(graph, node, sizes[mid], op.writes[0].dtype)
        if ws is None:
            return None, trials         # the layer cannot work in chunks
        trials += 1
        if fits([t.nbytes for t in ws]):
            best, lo = (sizes[mid], ws), mid + 1
        else:
            hi = mid - 1
    return best, trials


def chunk_workspace(graph, node, chunk, dtype):
    """The workspace tensors of ``node`` working ``chunk`` images a pass (kept with the graph:
    every mode's plan asks for the same ones)."""
    cache = graph.__dict__.setdefault("_chunk_workspaces", {})
    key = (id(node), chunk)
    if key not in cache:
        specs = node.layer.workspace_for_chunk(chunk)
        cache[key] = None if specs is None else list(
            workspace_tensors(node.name, specs, dtype, node.layer.param.location).values())
    return cache[key]
