"""Shapes that change at run time, as Caffe reshapes every layer before its Forward: a layer
whose tops depend on its bottoms' values (``data_dependent``: Filter keeps the items its selector
picks) sets its top shapes at each forward, and every layer after it is set up again for the
shapes it now gets.

Memory stays planned with the shapes the net was built with (Caffe's first Reshape: Filter's
tops hold the whole batch), which bound every later shape: a blob, scratch or workspace only
shrinks with the batch. At run time each is a view of the first elements of its planned block,
in this forward's shape, so the pool sees exactly the planned allocations and the measured peak
still equals the plan. Nets without a data-dependent layer never take this path.

A top may also outgrow its block (a Python layer giving a top more elements than its first
reshape did, in ``reshape`` or in ``forward`` as py-faster-rcnn's proposal layer does): it is
then held in an array of its own for the rest of that layer's call, and ``Grown`` tells the net,
which plans again with that shape as the top's new bound and goes on with the pass (``grow``).
"""
from __future__ import annotations

import logging
from functools import partial

import numpy as np

from .graph import build_graph, update_in_backward
from .layers.structure import transfer
from .plan.liveness import op_tensors
from .sizes import fmt_bytes
from .tensor import array_module

log = logging.getLogger("sncaffe")


class Grown(Exception):
    """``node``'s tops {index: shape} outgrew their planned blocks in this forward."""

    def __init__(self, node, shapes):
        super().__init__(f'layer "{node.name}": tops {shapes} outgrew their planned blocks')
        self.node, self.shapes = node, shapes


def _count(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def view(full, shape):
    """The first count(shape) elements of ``full``, in ``shape`` (``full`` itself when equal)."""
    shape = tuple(shape)
    if tuple(full.shape) == shape:
        return full
    n = int(np.prod(shape, dtype=np.int64))
    if n > full.size:
        raise ValueError(f"shape {shape} needs {n} elements, the planned block holds {full.size}")
    return full.reshape(-1)[:n].reshape(shape)


class DynamicShapes:
    def __init__(self, graph, device=None):
        self.active = any(getattr(n.layer, "data_dependent", False) for n in graph.layers)
        self.device = device
        self.current = {}       # key -> shape of this forward, where it differs from the plan
        self.full = {}          # (key, part) -> the planned array last bound
        self.planned = {}       # key -> planned shape
        self.setup_shapes = {n.name: [tuple(b.shape) for b in n.bottoms] for n in graph.layers}
        self.grown_node, self.grown = None, {}      # the layer whose tops outgrew their blocks: {index: shape}
        for n in graph.layers:
            if getattr(n.layer, "data_dependent", False):
                n.layer.reshape_top = partial(self.reshape_top, n)      # a top reshaped inside forward

    def fit(self, key, part, array, planned):
        """The array a binder gives to a blob or scratch: planned shape, or this forward's."""
        full = array.reshape(planned)
        if not self.active or key is None:
            return full
        self.full[(key, part)] = full
        self.planned[key] = tuple(planned)
        return view(full, self.current.get(key, planned))

    def _set(self, key, shape, targets):
        """Record ``key``'s shape and re-view its bound arrays: [(part, setter)]."""
        shape = tuple(shape)
        if shape == self.planned.get(key, shape):
            self.current.pop(key, None)
        else:
            self.current[key] = shape
        for part, setter in targets:
            full = self.full.get((key, part))
            if full is not None:
                setter(view(full, shape))

    def before_forward(self, node):
        """Set ``node``'s layer up for the shapes its bottoms have now; re-view its tops and scratch."""
        layer = node.layer
        if getattr(layer, "data_dependent", False):
            for i, shape in enumerate(layer.top_shapes(node.bottom_blobs)):
                self.reshape_top(node, i, shape)
            tops = ()
        else:
            shapes = [tuple(b.data.shape) for b in node.bottom_blobs]
            if shapes == self.setup_shapes[node.name]:
                return
            params = [tuple(s) for s in layer.param_shapes]
            tops = layer.setup(shapes)         # layer.target was set when the graph was built
            if [tuple(s) for s in layer.param_shapes] != params:
                raise layer.error(f"bottom shapes {shapes} change its parameter shapes {params}")
            self.setup_shapes[node.name] = shapes
        for blob, shape in zip(node.top_blobs, tops):
            self._set(blob.name, shape, [(p, lambda a, blob=blob, p=p: setattr(blob, p, a)) for p in ("data", "diff")])
        for k in node.scratch:
            self._set(("scratch", node.name, k), layer.scratch_specs[k][0],
                      [("data", lambda a, k=k: layer.scratch.__setitem__(k, a))])

    def reshape_top(self, node, i, shape):
        """Give ``node``'s top ``i`` this forward's ``shape``: a view of its block where it fits,
        else an array of its own until the net is planned again for it (``grown``)."""
        blob, shape = node.top_blobs[i], tuple(shape)
        planned = self.planned.get(blob.name, tuple(node.tops[i].shape))
        if _count(shape) <= _count(planned):
            self._set(blob.name, shape, [(p, lambda a, p=p: setattr(blob, p, a)) for p in ("data", "diff")])
            self.grown.pop(i, None)
            return
        full = self.full.get((blob.name, "data"))
        xp = array_module(full) if full is not None else np
        dtype = full.dtype if full is not None else node.tops[i].dtype
        blob.data = xp.zeros(shape, dtype)
        blob.diff = None if blob.diff is None else xp.zeros(shape, dtype)
        self.grown_node = node
        self.grown[i] = shape

    def workspace(self, layer, kind, workspace):
        """The call's workspace arrays viewed in the shapes the layer now asks for."""
        specs = layer.workspace_specs if kind == "forward" or layer.backward_workspace_specs is None \
            else layer.backward_workspace_specs
        return {k: view(a, specs[k][0]) if k in specs else a for k, a in workspace.items()}


# -- growth: a top larger than its planned block ---------------------------------------

def _host(a):
    """A host copy of a NumPy or CuPy array (None stays None)."""
    if a is None:
        return None
    return a.get() if hasattr(a, "get") else np.array(a)


def grow(net, grown, select):
    """Caffe reshapes every layer before its Forward, so a top reshaped in a forward gives the
    layers after it new shapes. Where it outgrew its planned block, the net is planned again
    with the new shape as that top's bound (later, smaller shapes are views of it, see
    sncaffe.dynamic): what the pass computed so far is carried into the new plan's blocks,
    and the rest of the pass, in the new plan, is returned. Data and Python layers keep
    their objects (their state: a data cursor, a Python layer's attributes)."""
    node = grown.node
    old, old_peak = net.graph, net.plan.peak
    index = {n.name: i for i, n in enumerate(old.layers)}
    shapes = [tuple(t.shape) for t in node.tops]
    for i, shape in grown.shapes.items():
        shapes[i] = shape
    what = ", ".join(f'top "{node.tops[i].name}" to {s} (planned {tuple(node.tops[i].shape)})'
                     for i, s in grown.shapes.items())
    if net.replan_reserve is not None:         # the history and the other nets' blocks stay where they are
        plan_args = (net.memory, net.replan_reserve(), 0)
    else:
        plan_args = getattr(net, "_plan_args", None)
    why = ("with its parameters on the host" if net.host_params else
           "over several locations (replicas, placed layers)" if len(net.devices) > 1 else
           "(it was planned by another)" if plan_args is None else None)
    if why:
        raise node.layer.error(f"{what}: the net cannot be planned again {why}; give the top its largest "
                               f"shape in the layer's first reshape")
    net.executor.synchronize()
    values = _carried(net, index[node.name])
    params = {n.name: [(_host(b.data), _host(b.diff)) for b in n.layer.blobs] for n in old.layers if n.layer.blobs}
    rngs = {n.name: n.layer.rng for n in old.layers if getattr(n.layer, "rng", None) is not None}
    reuse = {n.name: (n.layer, [tuple(b.shape) for b in n.bottoms], [tuple(t.shape) for t in n.tops])
             for n in old.layers if not n.bottoms or n.type == "Python"}
    reuse[node.name] = (node.layer, reuse[node.name][1] if node.name in reuse else None, shapes)
    bound, node.layer.shapes = node.layer.shapes, shapes      # a Python layer's bound
    try:
        graph = build_graph(old.param, net.phase, net._dtype, net.device, net._setup_shapes, reuse)
        if getattr(old, "updated_in_backward", None):
            update_in_backward(graph)           # planned as the old one (the solver maps it again)
        for n in graph.layers:
            mine, theirs = [tuple(d.shape) for d, _ in n.params], [p[0].shape for p in params.get(n.name, [])]
            if mine != theirs:
                raise n.layer.error(f'{what} in layer "{node.name}" would change its parameter shapes '
                                    f"{theirs} -> {mine}")
    except BaseException:
        node.layer.shapes = bound
        raise
    states = list(net._state_blocks)  # a solver's history, kept where it is
    net.release()                      # every block of the plan (no host homes: see above)
    net._finalizer.detach()
    log.info('layer "%s" (%s): %s; the net is planned again for it (its peak was %s)', node.name, node.type,
             what, fmt_bytes(old_peak))
    net.graph = graph
    try:
        plan = net._make_plan(*plan_args)
    except BaseException:               # the net as it was (its plan fits again), then the error
        net.graph, graph, node.layer.shapes = old, old, bound
        plan = net.plan
        raise
    finally:
        net.place(plan, fill=False)
        net._state_blocks.extend(states)
        for n in graph.layers:
            if n.name in rngs:
                n.layer.rng = rngs[n.name]
            for blob, (data, diff) in zip(n.layer.blobs, params.get(n.name, ())):
                transfer(blob.data, data)
                if diff is not None and blob.diff is not None:
                    transfer(blob.diff, diff)
    instrs = select(net.plan.schedule)
    at = next(k for k, ins in enumerate(instrs) if ins.kind == "run" and not ins.recompute
              and ins.op.kind == "forward" and ins.op.node.name == node.name)
    _restore(net, instrs[:at + 1], values, instrs[at + 1:] + list(net.plan.schedule.backward), what)
    for hook in net.replan_hooks:
        hook()
    return instrs[at + 1:]

def _carried(net, upto):
    """Host copies of what layers 0..upto computed in this pass: {("blob", name) or
    ("scratch", layer, key): array}; a value offloaded to the host tier is read there."""
    values, ex = {}, net.executor
    for n in net.graph.layers[:upto + 1]:
        for t, blob in zip(n.tops, n.top_blobs):
            if blob.data is not None:
                values[("blob", blob.name)] = _host(blob.data)
            elif id(t.data.root) in ex.host:
                root = t.data.root
                values[("blob", blob.name)] = np.array(ex.host[id(root)][1][:root.nbytes].view(root.dtype)
                                                       .reshape(root.shape))
        for k, a in n.layer.scratch.items():
            if a is not None:
                values[("scratch", n.name, k)] = _host(a)
    return values

def _restore(net, prefix, values, rest, what):
    """Replay ``prefix`` (the new plan's steps up to the grown layer) with each layer's forward
    replaced by the values the pass had computed. A layer runs again instead where the value
    the new plan wants of it is not among them: a state an in-place layer overwrote later (a
    pre-ReLU output the plan copies for recomputation), or a tensor the old plan dropped that
    the rest of the pass reads; a data or Python layer is never run twice (an error names it)."""
    value_of = {}                           # id(root) -> a value the pass had for it at the grown layer
    for n in net.graph.layers:
        for t in n.tops:
            v = values.get(("blob", t.name))
            if v is not None:
                value_of[id(t.data.root)] = v
        for k, st in n.scratch.items():
            v = values.get(("scratch", n.name, k))
            if v is not None:
                value_of[id(st.root)] = v
    final, before, cur, demands = {}, {}, {}, []     # cur: id(root) -> the run that wrote it last
    for k, ins in enumerate(prefix):
        if ins.kind == "run" and ins.op.kind == "forward" and not ins.recompute:
            before[k] = [(id(r), cur.get(id(r))) for r, _ in op_tensors(ins.op, ("reads",))]
            for r, _ in op_tensors(ins.op, ("writes",)):
                cur[id(r)] = final[id(r)] = k
        elif ins.kind in ("snapshot", "offload"):        # copies the tensor's state at this step
            root = ins.tensor if ins.kind == "snapshot" else (ins.source or ins.tensor)
            demands.append((id(root), cur.get(id(root))))
    written = set()                          # the rest of the pass: what it reads before writing
    for ins in rest:
        if ins.kind == "run":
            demands += [(id(r), final.get(id(r))) for r, _ in op_tensors(ins.op, ("reads",))
                        if id(r) not in written]
            written.update(id(r) for r, _ in op_tensors(ins.op, ("writes",)))
        elif ins.kind in ("restore", "prefetch"):
            written.add(id(ins.source if ins.kind == "prefetch" and ins.source else ins.tensor))
    real = set()

    def demand(root, k):
        if k is not None and (final.get(root) != k or root not in value_of):
            real.add(k)
    for root, k in demands:
        demand(root, k)
    for k in sorted(before, reverse=True):   # what a layer run again reads, as it was then
        if k in real:
            node = prefix[k].op.node
            if not node.bottoms or node.type == "Python":
                missing = [t.name for t in node.tops if id(t.data.root) not in value_of]
                if missing:
                    raise node.layer.error(f'{what}: planning again in the middle of the pass needs its '
                                           f'top "{missing[0]}", which memory mode "{net.plan.mode}" did not '
                                           f"keep, and the layer cannot run twice; use memory mode none or "
                                           f"liveness, or give the grown top its largest shape in the layer's "
                                           f"first reshape")
                real.discard(k)
                continue
            for root, w in before[k]:
                demand(root, w)
    again = {id(prefix[k].op) for k in real}

    def fill(op, recompute=False, workspace=None, chunk=None):
        n = op.node
        if op.kind != "forward" or recompute:
            return
        if id(op) in again:
            return net._run_op(op, recompute, workspace, chunk)
        for blob in n.top_blobs:
            v = values.get(("blob", blob.name))      # by name: views of one root (Reshape) differ in shape
            if v is None:
                continue
            if tuple(blob.data.shape) != v.shape:        # a shape of this forward (sncaffe.dynamic)
                net.shapes.reshape_top(n, n.top_blobs.index(blob), v.shape)
            transfer(blob.data, v)
        for k, a in n.layer.scratch.items():
            v = values.get(("scratch", n.name, k))
            if v is not None and a is not None and a.shape == v.shape:
                transfer(a, v)
    net.executor.run_op = fill
    try:
        net.executor.execute(prefix)
    finally:
        net.executor.run_op = net._run_op
    if again:
        log.info("%d layers before it ran again for the new plan", len(again))
