"""The net as a bipartite graph of operators and tensors (Purine's model).

``build_graph`` turns a prepared NetParameter into layer nodes, blob nodes and
tensors (data, diff, param, param diff, scratch, workspace) with shapes
inferred at build time, decides which layers run backward (Caffe's Net::Init
rules: lr_mult, force_backward, propagate_down, contribution to a loss), and
lists the operators in execution order with the tensors each reads and
writes. The graph is plain data: nothing here allocates memory or computes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .tensor import Tensor, workspace_tensors
from .validate import check_fields, check_shape, located
from .layers import create_layer, unsupported
from .layers.base import Layer, LayerError
from .sharing import append_params, frozen_shared

# Layers whose tops are the bottom's memory in another shape, as Caffe shares them.
ALIASING = {"Split": ("data",), "Flatten": ("data", "diff"), "Reshape": ("data", "diff")}
# Scratch one layer may take from the layer that wrote its bottom, because it holds the same
# bits: an in-place Scale keeps a copy of its input, and when a training BatchNorm wrote that
# input, BatchNorm's x_norm is that very copy (Caffe keeps both). (layer type, scratch) ->
# (writer type, writer's scratch).
SHARED_SCRATCH = {("Scale", "bottom"): ("BatchNorm", "x_norm"),
                  ("Scale", "partials"): ("BatchNorm", "partials")}


@dataclass(eq=False)
class _Pair:
    """Two neighbouring layers run as one (``first``, then ``last``: the fields ``ends`` names).
    ``forward``/``backward``: whether they run as one in this pass, which needs both layers in it
    (pycaffe's partial passes turn it off where one of the two is left out); ``on(kind)``: the
    setting of a whole pass, backward only where ``can_backward``."""
    forward: bool = field(default=True, kw_only=True)
    backward: bool = field(default=True, kw_only=True)
    ends = ()

    def __post_init__(self):
        self.backward = self.can_backward

    def on(self, kind) -> bool:
        return kind == "forward" or self.can_backward

    @property
    def first(self):
        return getattr(self, self.ends[0])

    @property
    def last(self):
        return getattr(self, self.ends[1])


@dataclass(eq=False)
class Fusion(_Pair):
    """A training BatchNorm and the in-place Scale right after it, run as one on the CPU. Forward,
    BatchNorm writes x_norm only, centered and not yet divided by std, and Scale computes
    ((x_norm / std) * scale) + bias in one pass (BatchNorm's top is not written, then copied to
    x_norm, then read again, nor x_norm divided in a pass of its own). Backward, Scale leaves dy
    as it is and takes each image's sums of dy and dy * x_norm into BatchNorm's per-image sums
    (its own gradients are their sums over the images), and BatchNorm's dx is one pass over
    x_norm and dy with per-channel factors (the same two sums are not taken twice, nor dy * scale
    or x_norm * mean(dy * x_norm) written and read again). Where BatchNorm does not run in place
    (``in_place`` false: DenseNet's, whose bottom is a Concat's top), its top's diff, which
    pycaffe shows, is then multiplied by the scale in place, after dx, to be dy * scale as Caffe
    leaves it (the bits of Scale's own backward)."""
    bn: "LayerNode"
    scale: "LayerNode"
    in_place: bool = True
    can_backward = True
    ends = ("bn", "scale")


@dataclass(eq=False)
class EltwiseReLU(_Pair):
    """An Eltwise SUM of two bottoms with coefficients 1 and the in-place ReLU (no negative slope)
    right after it, run as one on the CPU (ResNet's shortcut sum). Forward, Eltwise writes
    max(a + b, 0) in one pass, the bits of the sum and then the ReLU, and the ReLU does nothing
    (the two read and wrote the top twice). Backward, the ReLU does nothing and Eltwise writes
    dy * (y > 0) into the top's diff (the ReLU's in-place dx, which pycaffe shows) and into each
    bottom's diff in the same pass (the ReLU's pass and then Eltwise's copies). Backward only
    where both layers run it (``can_backward``)."""
    eltwise: "LayerNode"
    relu: "LayerNode"
    can_backward: bool = True
    ends = ("eltwise", "relu")


class GraphError(ValueError):
    """A net that cannot be built: unknown blobs, shape mismatches, bad settings."""


@dataclass(eq=False, repr=False)
class BlobNode:
    name: str
    data: Tensor
    producer: "LayerNode"
    diff: Tensor | None = None
    need_backward: bool = False

    @property
    def shape(self):
        return self.data.shape

    def __repr__(self):
        return f"BlobNode({self.name!r}, {self.shape})"


@dataclass(eq=False, repr=False)
class LayerNode:
    layer: Layer
    bottoms: list
    tops: list
    params: list = field(default_factory=list)        # [(data Tensor, diff Tensor)]
    param_need_backward: list = field(default_factory=list)
    loss_weights: list = field(default_factory=list)
    need_backward: bool = False
    propagate_down: list = field(default_factory=list)
    scratch: dict = field(default_factory=dict)
    param_owner: list = field(default_factory=list)     # per param: (owner layer, index) if shared, else None
    frozen_diffs: dict = field(default_factory=dict)    # param index -> backward workspace key (sharing.py)
    workspace: dict = field(default_factory=dict)             # forward's
    backward_workspace: dict = field(default_factory=dict)

    @property
    def name(self):
        return self.layer.name

    def __repr__(self):
        return f"LayerNode({self.name!r}, {self.type})"

    @property
    def type(self):
        return self.layer.type

    @property
    def shared_scratch(self):
        """Scratch keys taken from another layer (SHARED_SCRATCH): read, never written, here."""
        return self.layer.shared_scratch


@dataclass(eq=False, repr=False)
class Operator:
    name: str
    kind: str                       # forward | backward
    node: LayerNode
    reads: list
    writes: list

    def __repr__(self):
        return f"Operator({self.name!r})"


@dataclass(eq=False, repr=False)
class Graph:
    param: object                   # the prepared NetParameter
    phase: int
    layers: list
    blobs: dict                     # name -> BlobNode, in Caffe's blob order
    ops: list = field(default_factory=list)
    learnable: list = field(default_factory=list)   # sharing.LearnableParam: owners, Caffe's order
    fusions: list = field(default_factory=list)     # Fusion: BatchNorm + Scale pairs run as one

    def __repr__(self):
        return f"Graph({self.param.name!r}, {len(self.layers)} layers, {len(self.ops)} operators)"

    @property
    def forward_ops(self):
        return [op for op in self.ops if op.kind == "forward"]

    @property
    def backward_ops(self):
        return [op for op in self.ops if op.kind == "backward"]

    def outputs(self) -> list:
        """The net's outputs, as Caffe counts them: blobs no layer consumes after (re)writing them;
        an in-place layer consumes and writes its blob back, so it keeps it an output."""
        available = {}
        for node in self.layers:
            for b in node.bottoms:
                available.pop(b.name, None)
            for t in node.tops:
                available[t.name] = t
        return [b for name, b in self.blobs.items() if name in available]

    def tensors(self):
        """Every distinct tensor, in first-use order."""
        seen, out = set(), []
        for op in self.ops:
            for t in op.reads + op.writes:
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
        return out

    def layer(self, name) -> LayerNode:
        for node in self.layers:
            if node.name == name:
                return node
        raise KeyError(name)


def _describe(bottom: BlobNode) -> str:
    p = bottom.producer
    return f'"{bottom.name}" {tuple(bottom.shape)} from layer "{p.name}" ({p.type})'


def build_graph(param, phase, dtype=np.float32, target=None, setup_shapes=None, reuse=None) -> Graph:
    """The graph of ``param`` for ``target``: the device it will run on (or a planning target;
    None: the CPU), which each layer's setup sizes its workspaces for. ``setup_shapes``: layer
    name -> the bottom shapes to set that layer up for instead of its bottoms' (pycaffe's
    partial forward reshapes only the layers it runs; the others keep their shapes, as in Caffe).
    ``reuse``: layer name -> (layer, bottom shapes, top shapes) of a net being planned again
    (sncaffe.dynamic.grow): that layer object is kept, its state with it, and where its bottoms have
    those shapes it keeps those tops without being set up again."""
    dtype = np.dtype(dtype)
    setup_shapes, reuse = setup_shapes or {}, reuse or {}
    lacking = unsupported.missing((lp.defined_at, lp.name, lp.type) for lp in param.layer)
    if lacking:                                 # all of them at once, not the first alone
        raise GraphError(unsupported.message(lacking))
    blobs: dict[str, BlobNode] = {}
    seen: dict[str, tuple] = {}                  # layer name -> (LayerParameter, has parameters)
    nodes: list[LayerNode] = []
    last_writer: dict[str, LayerNode] = {}      # blob name -> the layer that wrote it last
    learnable, owners = [], {}                  # Caffe's learnable_params; ParamSpec name -> owner
    for lp in param.layer:
        where = located(lp)
        kept = reuse.get(lp.name)
        try:
            layer = kept[0] if kept is not None else create_layer(lp, phase)
        except LayerError as e:
            raise GraphError(where + str(e)) from None
        missing = [b for b in lp.bottom if b not in blobs]
        if missing:
            raise GraphError(f'{where}layer "{lp.name}" ({lp.type}): unknown bottom blob "{missing[0]}"')
        bottoms = [blobs[b] for b in lp.bottom]
        layer.inplace = any(t in lp.bottom for t in lp.top)
        layer.target, layer.dtype = target, dtype
        try:
            check_fields(lp, layer.error)
            layer.check_counts(len(bottoms), len(lp.top))
            shapes = setup_shapes.get(lp.name) or [b.shape for b in bottoms]
            if kept is not None and [tuple(s) for s in shapes] == kept[1]:
                top_shapes = kept[2]
            else:
                top_shapes = [tuple(int(d) for d in s) for s in layer.setup(shapes)]
            for name, shape in zip(lp.top, top_shapes):
                check_shape(shape, f'top "{name}"', layer.error)
            for i, shape in enumerate(layer.param_shapes):
                check_shape(tuple(shape), f"parameter {i}", layer.error)
        except LayerError as e:
            context = "; ".join("bottom " + _describe(b) for b in bottoms)
            raise GraphError(f"{e}" + (f" [{context}]" if context else "")) from None   # e names file:line
        except (ArithmeticError, ValueError, IndexError, TypeError, MemoryError) as e:  # a setting setup did not check
            raise GraphError(f'{where}layer "{lp.name}" ({lp.type}): cannot be set up with these settings '
                             f"({type(e).__name__}: {e})") from None
        other = seen.get(lp.name)
        if other is not None and (layer.param_shapes or other[1]):
            q = other[0]
            raise GraphError(f'{where}layer "{lp.name}" ({lp.type}) has the name of another layer ({q.type}'
                             + (f", {q.defined_at}" if q.defined_at else "") + "), and one of them has "
                             "parameters: weights and snapshots are matched by layer name, so a layer with "
                             "parameters needs a name of its own")
        seen[lp.name] = (lp, bool(layer.param_shapes))
        node = LayerNode(layer, bottoms, [])
        aliased = ALIASING.get(lp.type, ())
        for j, (name, shape) in enumerate(zip(lp.top, top_shapes)):
            if name in lp.bottom:
                blob = blobs[name]
                if tuple(blob.shape) != shape and lp.name not in setup_shapes:
                    raise GraphError(f'{where}layer "{lp.name}" ({lp.type}) runs in place on "{name}" '
                                     f"but changes its shape {tuple(blob.shape)} -> {shape}")
            elif name in blobs:
                raise GraphError(f'{where}layer "{lp.name}" ({lp.type}): top blob "{name}" is already '
                                 f'produced by layer "{blobs[name].producer.name}"')
            else:
                # (a layer set up for other shapes, see setup_shapes, keeps tops of its own)
                alias = "data" in aliased and math.prod(shape) == math.prod(bottoms[0].shape)
                base = bottoms[0].data if alias else None
                blob = blobs[name] = BlobNode(name, Tensor(name, shape, dtype, "data", base, lp.location), node)
            node.tops.append(blob)
        _set_loss_weights(node, lp)
        append_params(node, dtype, learnable, owners, error=GraphError,
                      make_tensor=lambda n, s, k, base: Tensor(n, s, dtype, k, base, lp.location))
        node.scratch = {k: Tensor(f"{lp.name}#{k}", tuple(s), np.dtype(d or dtype), "scratch", location=lp.location)
                        for k, (s, d) in layer.scratch_specs.items()}
        _share_scratch(node, [last_writer.get(b) for b in lp.bottom])
        last_writer.update((t, node) for t in lp.top)
        node.workspace = workspace_tensors(lp.name, layer.workspace_specs, dtype, lp.location)
        bspecs = layer.backward_workspace_specs
        node.backward_workspace = node.workspace if bspecs is None else workspace_tensors(lp.name, bspecs, dtype, lp.location)
        nodes.append(node)
    _decide_backward(nodes, param.force_backward)
    fusions = _fuse_batch_norm_scale(nodes) + _fuse_eltwise_relu(nodes)
    _make_diffs(nodes, blobs, dtype)
    _frozen_diff_workspaces(nodes, dtype)
    graph = Graph(param, phase, nodes, blobs, learnable=learnable, fusions=fusions)
    graph.ops = _operators(nodes)
    return graph


def _frozen_diff_workspaces(nodes, dtype) -> None:
    """A backward workspace for each shared parameter a layer does not learn while a sharer does."""
    frozen_shared(nodes)
    for node in nodes:
        if node.frozen_diffs:
            specs = {k: (node.params[i][1].shape, None) for i, k in node.frozen_diffs.items()}
            node.backward_workspace = {**node.backward_workspace,
                                       **workspace_tensors(node.name, specs, dtype, node.layer.param.location)}


def _set_loss_weights(node: LayerNode, lp) -> None:
    n = len(lp.top)
    if lp.loss_weight:
        if len(lp.loss_weight) != n:
            raise GraphError(f'{located(lp)}layer "{lp.name}": loss_weight must be given once per top '
                             f"({n} tops, {len(lp.loss_weight)} loss_weight)")
        node.loss_weights = [float(w) for w in lp.loss_weight]
    else:
        node.loss_weights = [1.0 if (node.layer.is_loss and j == 0) else 0.0 for j in range(n)]


def _decide_backward(nodes, force_backward: bool) -> None:
    """Caffe's rules for which layers and bottoms get gradients."""
    blob_need: dict[int, bool] = {}
    for node in nodes:
        lp = node.layer.param
        need = False
        node.propagate_down = []
        for j, b in enumerate(node.bottoms):
            nb = blob_need.get(id(b), False)
            need |= nb
            if lp.propagate_down:
                nb = bool(lp.propagate_down[j])
            node.propagate_down.append(nb)
        need |= any(node.param_need_backward)
        node.need_backward = need
        if need:
            for t in node.tops:
                blob_need[id(t)] = True
    under_loss, skip = set(), set()
    for node in reversed(nodes):
        contributes = any(w != 0 or id(t) in under_loss for w, t in zip(node.loss_weights, node.tops))
        skip_down = all(id(t) in skip for t in node.tops) if node.tops else True
        if node.need_backward and skip_down:
            node.need_backward = False
            node.propagate_down = [False] * len(node.bottoms)
        if not contributes:
            node.need_backward = False
        for j, b in enumerate(node.bottoms):
            if contributes:
                under_loss.add(id(b))
            else:
                node.propagate_down[j] = False
            if not node.propagate_down[j]:
                skip.add(id(b))
    if force_backward:
        for node in nodes:
            node.need_backward = bool(node.bottoms or node.params)   # data layers have nothing to do
            node.propagate_down = [pd or node.layer.allow_force_backward(j)
                                   for j, pd in enumerate(node.propagate_down)]
    for node in nodes:
        if not node.need_backward:
            node.propagate_down = [False] * len(node.bottoms)
        for j, b in enumerate(node.bottoms):
            if node.propagate_down[j]:
                b.need_backward = True
        if node.need_backward:
            for t in node.tops:
                t.need_backward = True


def _make_diffs(nodes, blobs, dtype) -> None:
    """A diff tensor for every blob whose gradient is read or written."""
    for blob in blobs.values():
        if blob.need_backward:
            blob.diff = Tensor(blob.name + ".diff", blob.shape, dtype, "diff", location=blob.data.location)
    for node in nodes:
        if "diff" in ALIASING.get(node.type, ()):
            src = node.bottoms[0]
            for t in node.tops:
                if t.diff is not None and src.diff is not None and t.diff.nbytes == src.diff.nbytes:
                    t.diff.base = src.diff


def _share_scratch(node, writers) -> None:
    """Point ``node``'s scratch at its bottom writer's where SHARED_SCRATCH allows (same shape,
    dtype and device); the layer is told (``layer.shared_scratch``) and skips its copy."""
    w = writers[0] if writers else None
    for key, t in list(node.scratch.items()):
        rule = SHARED_SCRATCH.get((node.type, key))
        if rule is None or w is None or w.type != rule[0] or rule[1] not in w.scratch:
            continue
        src = w.scratch[rule[1]]
        if (src.shape, src.dtype, src.location) == (t.shape, t.dtype, t.location):
            node.scratch[key] = src
            node.layer.shared_scratch |= {key}


def _fuse_batch_norm_scale(nodes) -> list:
    """The Fusion of each training BatchNorm (on the CPU) and the in-place Scale that shares its
    x_norm and per-image sums, where no layer between the two touches BatchNorm's top, both run
    backward and the Scale has its scale as a parameter."""
    fusions, index = [], {id(node): i for i, node in enumerate(nodes)}
    bns = {id(n.scratch["x_norm"]): n for n in nodes if n.type == "BatchNorm" and "x_norm" in n.scratch}
    for sc in nodes:
        if sc.type != "Scale" or not {"bottom", "partials"} <= sc.shared_scratch:
            continue
        bn = bns[id(sc.scratch["bottom"])]
        between = nodes[index[id(bn)] + 1:index[id(sc)]]      # (a replicated net interleaves its replicas)
        if sc.bottoms[0] is not bn.tops[0] or any(bn.tops[0] in n.bottoms + n.tops for n in between):
            continue
        if not (sc.need_backward and sc.propagate_down[0] and bn.need_backward and bn.propagate_down[0]):
            continue
        fusion = Fusion(bn, sc, in_place=bn.tops[0] is bn.bottoms[0])
        bn.layer.fusion = sc.layer.fusion = fusion
        fusions.append(fusion)
    for node in nodes:          # scratch kept only for a fusion: dropped where none formed
        for key in node.layer.optional_scratch & set(node.scratch) if node.layer.fusion is None else ():
            del node.scratch[key]
            node.layer.shared_scratch -= {key}
    return fusions


def _fuse_eltwise_relu(nodes) -> list:
    """The EltwiseReLU of each CPU Eltwise SUM of two bottoms with coefficients 1, not in place,
    whose top is next touched by an in-place ReLU with no negative slope on the same location,
    neither with a loss weight."""
    fusions = []
    for k, el in enumerate(nodes):
        layer = el.layer
        if el.type != "Eltwise" or layer.op != "SUM" or len(el.bottoms) != 2 or any(c != 1 for c in layer.coeffs) \
                or layer.on_gpu or el.tops[0] in el.bottoms:
            continue
        y = el.tops[0]
        relu = next((n for n in nodes[k + 1:] if y in n.bottoms or y in n.tops), None)
        if relu is None or relu.type != "ReLU" or relu.bottoms != [y] or relu.tops != [y] or relu.layer.slope != 0 \
                or relu.layer.param.location != layer.param.location or any(el.loss_weights + relu.loss_weights):
            continue
        backward = relu.need_backward and relu.propagate_down[0] and el.need_backward
        fusion = EltwiseReLU(el, relu, can_backward=backward)
        layer.fusion = relu.layer.fusion = fusion
        fusions.append(fusion)
    return fusions


def _operators(nodes) -> list:
    ops = []
    for node in nodes:
        reads = [b.data for b in node.bottoms] + [p for p, _ in node.params]
        fusion = node.layer.fusion if isinstance(node.layer.fusion, Fusion) else None
        if fusion is not None and fusion.scale is node:         # reads BatchNorm's x_norm and std
            reads += [node.scratch["bottom"], fusion.bn.scratch["std"]]
        writes = [t.data for t in node.tops] + [t for k, t in node.scratch.items() if k not in node.shared_scratch]
        ops.append(Operator(node.name + ":forward", "forward", node, reads,
                            writes + list(node.workspace.values())))
    for node in reversed(nodes):
        if not node.need_backward:
            continue
        needs = node.layer.backward_needs
        reads = [t.diff for t in node.tops if t.diff is not None]
        if "bottom" in needs:
            reads += [b.data for b in node.bottoms]
        if "top" in needs:
            reads += [t.data for t in node.tops if t.data not in reads]
        reads += [p for p, _ in node.params] + list(node.scratch.values())
        writes = [b.diff for j, b in enumerate(node.bottoms) if node.propagate_down[j]]
        writes += [d for (_, d), need in zip(node.params, node.param_need_backward) if need]
        fusion = node.layer.fusion
        if isinstance(fusion, EltwiseReLU):
            if fusion.eltwise is node and fusion.can_backward:  # the ReLU's mask and in-place dx
                reads += [t.data for t in node.tops if t.data not in reads]
                writes += [t.diff for t in node.tops]
            fusion = None
        if fusion is not None and fusion.scale is node:     # BatchNorm's std, and its x_norm: divided
            reads.append(fusion.bn.scratch["std"])          # there if a fused forward left it centered
            writes.append(node.scratch["bottom"])
        if fusion is not None and fusion.scale is node:     # BatchNorm's per-image sums
            writes.append(node.scratch["partials"])
        elif fusion is not None:                            # the scale; not in place, its top's diff * scale
            reads.append(fusion.scale.params[0][0])
            if not fusion.in_place:
                writes += [t.diff for t in node.tops if t.diff not in writes]
        ops.append(Operator(node.name + ":backward", "backward", node, reads,
                            writes + list(node.backward_workspace.values())))
    return ops


def update_in_backward(graph) -> dict:
    """Mark the parameters a solver may update inside backward, each as soon as its gradient is
    complete: {name of the backward operator after which to update: [index in graph.learnable]}.

    Caffe updates every parameter after the whole backward; each update reads only its own
    parameter, gradient and history, so applying it right after the last backward operator that
    touches the parameter or its gradient gives the same bits (a fused BatchNorm's backward reads
    its Scale's factors after the Scale's own backward), and the gradient then lives from that
    layer's first write (zeroed: layers add into parameter gradients) to the update instead of all
    iteration (``graph.updated_in_backward``: the gradients' roots, which liveness then schedules).
    A layer's forward is replayed only before its own backward, so none reads a parameter after
    its update where every layer reading it runs backward. A parameter is left to the update
    after backward where a layer holding it does not write its gradient (lr_mult 0 there,
    BatchNorm's statistics) or does not run backward, and so is every parameter of a net over
    several locations."""
    graph.updated_in_backward = {}
    for key in [k for k in graph.__dict__ if isinstance(k, tuple)]:
        del graph.__dict__[key]         # the planner's analyses (persistent roots change)
    if len({n.layer.param.location for n in graph.layers}) > 1:
        return {}
    able = {}               # id(root) -> False where a holder does not learn it in backward
    for node in graph.layers:
        for (d, g), need in zip(node.params, node.param_need_backward):
            ok = bool(need and node.need_backward)
            for r in (d.root, g.root):
                able[id(r)] = able.get(id(r), True) and ok
    for op in graph.forward_ops:        # a layer reading a parameter (another's) without a backward
        if not op.node.need_backward:
            for t in op.reads:
                if t.kind == "param":
                    able[id(t.root)] = False
    ops = graph.backward_ops
    last, written = {}, set()           # id(root) -> index of the last backward operator touching it
    for j, op in enumerate(ops):
        for t in op.reads + op.writes:
            if t.kind in ("param", "param_diff"):
                last[id(t.root)] = j
        written.update(id(t.root) for t in op.writes if t.kind == "param_diff")
    at = {}
    for k, q in enumerate(graph.learnable):
        d, g = id(q.data.root), id(q.diff.root)
        if g not in written or not (able.get(d, False) and able.get(g, False)):
            continue
        graph.updated_in_backward[g] = q.diff.root
        op = ops[max(last[g], last.get(d, 0))]
        if all(t.root is not q.diff.root for t in op.writes):    # the update there reads and writes it
            op.writes.append(q.diff)
            for cached in [c for c in op.__dict__ if c.startswith("_")]:
                del op.__dict__[cached]
        at.setdefault(op.name, []).append(k)
    return at
