"""Liveness: which tensors each step uses, and where each tensor's life begins and ends.

Works on roots (an aliasing layer's top shares its bottom's block), over the
forward operators then the backward operators of one iteration. Workspaces
live only inside their operator; persistent tensors (parameters, their
gradients, the net's inputs and outputs) live across iterations and are not
scheduled.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Uses:
    reads: list = field(default_factory=list)     # op indices
    writes: list = field(default_factory=list)

    @property
    def first(self):
        return min(self.reads + self.writes)

    @property
    def last(self):
        return max(self.reads + self.writes)


def persistent_roots(graph) -> list:
    """Roots that live across iterations: parameters and gradients, net inputs and outputs, and
    the blobs named in ``graph.keep`` (read after a pass: pycaffe's ``net.blobs[name].data``).
    A gradient the solver applies inside backward (``graph.updated_in_backward``) is scheduled
    instead, from its first write to the update."""
    out, seen = [], set(getattr(graph, "updated_in_backward", ()))
    keep = getattr(graph, "keep", ())

    def add(t):
        if t is not None and id(t.root) not in seen:
            seen.add(id(t.root))
            out.append(t.root)
    outputs = {id(b) for b in graph.outputs()}
    for node in graph.layers:
        for d, g in node.params:
            add(d)
            add(g)
        for t in node.tops:
            if not node.bottoms or id(t) in outputs or t.name in keep:   # filled by the caller / read after
                add(t.data)
                add(t.diff)
    return out


def op_tensors(op, kinds=("reads", "writes")):
    """(root, is_write) for every non-workspace tensor the operator touches (kept on the
    operator: the planner asks for each many times per plan; treat the list as read-only)."""
    cache = op.__dict__.setdefault("_op_tensors", {})
    if kinds not in cache:
        cache[kinds] = _op_tensors(op, kinds)
    return cache[kinds]


def _op_tensors(op, kinds):
    seen = {}
    for kind in kinds:
        for t in getattr(op, kind):
            if t.kind == "workspace":
                continue
            r = t.root
            seen[id(r)] = (r, seen.get(id(r), (r, False))[1] or kind == "writes")
    return list(seen.values())


def analyze(ops, persistent) -> dict:
    """id(root) -> (root, Uses) for every scheduled (transient, non-workspace) root."""
    keep = {id(t) for t in persistent}
    uses: dict = {}
    for i, op in enumerate(ops):
        for r, write in op_tensors(op):
            if id(r) in keep:
                continue
            entry = uses.get(id(r))
            if entry is None:
                entry = uses[id(r)] = (r, Uses())
            (entry[1].writes if write else entry[1].reads).append(i)
    return uses


def workspaces(op) -> list:
    """The operator's workspace tensors (kept on the operator, as ``op_tensors``; read-only)."""
    ws = op.__dict__.get("_workspaces")
    if ws is None:
        ws = op.__dict__["_workspaces"] = [t for t in op.writes if t.kind == "workspace"]
    return ws


def locations(graph, ops) -> list:
    """The locations the tensors of ``ops`` live on, in first-use order (once per graph)."""
    key = ("_locations", len(ops))
    if key not in graph.__dict__:
        graph.__dict__[key] = list(dict.fromkeys(t.location for op in ops for t in op.reads + op.writes))
    return graph.__dict__[key]
