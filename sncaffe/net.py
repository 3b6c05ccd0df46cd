"""A net bound to a device: every tensor of the graph carved from the device pool.

``Net`` is what a Caffe user knows: ``forward()`` returns the loss,
``backward()`` fills diffs, ``blobs[name].data/.diff`` and
``params[layer][i].data/.diff`` are arrays, ``copy_from`` loads a
.caffemodel by layer name and ``to_proto`` writes one.
"""
from __future__ import annotations

import collections
import logging
import time
import weakref
import zlib
from collections import OrderedDict

import numpy as np

from . import blobproto
from . import hdf5_weights
from .hdf5_weights import warn_nonfinite
from .backend import default_device, make_device
from .plan.planner import MODES, MemoryExhausted, PlanError, auto_plan, check_fits, paused_gc, shared_ram_plan
from .plan.report import plan_line
from .runtime.spill import spill_of, spill_room
from .sizes import fmt_bytes
from .upgrade import upgrade_net
from .dynamic import DynamicShapes, Grown, grow
from .graph import build_graph
from .layers.base import Blob, array_module
from .layers.structure import transfer
from .proto import sncaffe_pb2 as pb
from .prototxt import _phase, load_net, prepare_net
from .runtime.budget import give_back_freed, process_memory
from .runtime.dispatcher import Dispatcher

log = logging.getLogger("sncaffe")


def memory_mode(*params) -> str:
    """The first ``memory_param.mode`` set among ``params`` (solver, then net), else ``auto``."""
    for p in params:
        if p is not None and p.HasField("memory_param") and p.memory_param.HasField("mode"):
            return p.memory_param.mode
    return "auto"


def _some(names, n=5) -> str:
    return ", ".join(f'"{x}"' for x in names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


# The pool blocks of nets collected without release(), given back when the next net is made: never
# from inside a garbage collection, which may run while a pool is in the middle of an allocation.
_dropped = collections.deque()         # (weak reference to the device, its method that frees, offset)


def _on_dropped(ex, locations, states):
    """A net was collected: note its blocks (plain reads only, as inside a collection)."""
    devices = {loc: weakref.ref(d) for loc, d in ex["devices"].items()}
    for key, off in list(ex["offsets"].items()):
        t = ex["transient"].get(key)
        _dropped.append((devices[t.location if t is not None else locations.get(key, "")], "free", off))
    for key, (off, _) in list(ex["host"].items()):
        _dropped.append((devices[ex["host_loc"].get(key) or locations.get(key, "")], "host_free", off))
    for off, loc in list(ex["disk"].values()):
        _dropped.append((devices[loc], "spill_free", off))
    for in_host_pool, off in states:
        _dropped.append((devices[""], "host_free" if in_host_pool else "free", off))


def _give_back_dropped():
    while _dropped:
        device, method, off = _dropped.popleft()
        device = device()
        if device is None:                      # a net's own device, gone with it
            continue
        if method == "spill_free":
            spill_of(device).free(off)
        else:
            getattr(device, method)(off)


# What a plan holds while its net runs, per operator of the graph: its schedule (several
# instructions per operator, about a KiB each with their records; ResNet-2500's plan kept 122 MiB
# for 23,338 operators after planning).
PLAN_BYTES_PER_OP = 10 << 10
# Operators from which planning's freed heap is worth a full collection and a trim (thousands of
# layers: millions of objects; below, a collection per plan would cost more than it gives back).
BIG_GRAPH = 2000


def grown_outside_pools(device) -> int:
    """What the process has grown by outside the pools since ``device`` took its RAM budget: the
    graph and the plans of a net of thousands of layers take a large share of a small container,
    more than the budget's margin."""
    then = getattr(device, "rss_at_budget", None)
    if then is None:
        return 0
    host = getattr(device, "host_pool", None)
    touched = device.pool.peak + (host.peak if host is not None else 0)      # pool pages resident
    return max(0, process_memory()["rss"] - then - touched)


def ram_left(device):
    """The RAM ``device``'s pools may still take together (None: no shared RAM, a GPU): its
    budget less what they hold and what the process has grown by outside them."""
    if getattr(device, "ram", None) is None:
        return None
    host = getattr(device, "host_pool", None)
    return device.ram - device.pool.in_use - (host.in_use if host is not None else 0) - grown_outside_pools(device)


def within_ram(device, n_ops, make, plan_of=lambda made: made):
    """``make()``, made again once where the process grew while planning (the plan itself:
    millions of steps on the deepest nets) into the room the plan counted on. A graph of
    ``n_ops`` operators from BIG_GRAPH has planning's freed heap given back first."""
    for _ in range(2):
        made = make()
        if n_ops >= BIG_GRAPH:
            give_back_freed()
        plan, left = plan_of(made), ram_left(device)
        if left is None or plan.ram is None or not plan.fits or plan.peak + plan.host_peak <= left:
            return made
        log.info("the plan's %s and this process's %s are over the RAM budget: planning again",
                 fmt_bytes(plan.peak + plan.host_peak), fmt_bytes(process_memory()["rss"]))
    return made


class Net:
    """A net bound to a device. ``memory`` is the memory mode (``none``, ``liveness``,
    ``offload``, ``recompute``, ``all`` or ``auto``); None takes the net's own
    ``memory_param`` and, without one, ``auto`` (``none`` when it fits, else the cheapest
    mode that fits). ``reserve`` is pool bytes that others take beside the net (the
    solver's history), so the plan accounts for them. ``defer``: build the graph only; the
    caller plans and calls ``place(plan)`` (plan/joint.py plans a solver's nets together)."""

    def __init__(self, source, phase="TRAIN", device=None, stages=(), level=None,
                 weights=None, seed=0, dtype=np.float32, memory=None, reserve=0, host_params=False,
                 devices=None, defer=False, setup_shapes=None, reuse=None):
        _give_back_dropped()
        phase = _phase(phase)
        if isinstance(source, pb.NetParameter):
            param = prepare_net(source, phase, stages, level)
            self.source = None
        else:
            param = load_net(source, phase, stages, level)
            self.source = str(source)
        if device is None:
            device = default_device()
        self.device = device
        self.phase = phase
        if memory is None:              # standalone: the net's own memory_param, else auto
            memory = memory_mode(param)
            host_params = host_params or param.memory_param.host_params
        # a GPU's layers size cuDNN's workspaces; setup_shapes, reuse: see build_graph
        with paused_gc():       # (hundreds of thousands of objects on the deepest nets, no garbage)
            self.graph = build_graph(param, phase, dtype, device, setup_shapes, reuse)
        self._dtype, self._setup_shapes = dtype, setup_shapes
        self.replan_hooks = []          # called after the net is planned again mid-pass (pycaffe's views)
        # A solver's nets share the pool with the history and each other: () -> the bytes the others
        # still need beside this net's plan when it is planned again (None: a net planned alone)
        self.replan_reserve = None
        self.name = param.name
        # One device per location (model parallelism); "" is the default device.
        self.devices = {"": device}
        for loc in sorted({n.layer.param.location for n in self.graph.layers} - {""}):
            self.devices[loc] = (devices or {}).get(loc) or make_device(loc)
        self.host_params = host_params
        self.memory, self.seed = memory, seed
        if defer:           # the owner plans (a Solver: its nets together) and calls place()
            return
        blocks = reserve(self.graph) if callable(reserve) else reserve
        # with host parameters the solver's history is on the host too
        self.place(self._make_plan(memory, 0 if host_params else blocks, blocks if host_params else 0))
        if weights is not None:
            self.copy_from(weights)

    def place(self, plan, fill=True):
        """Bind the net to ``plan``: its persistent tensors allocated now, parameters filled
        (``fill``; else the caller fills them)."""
        self.plan = plan
        self.host_params = bool(plan.host_params)      # auto may have chosen them
        # The arena the plan placed its blocks in: the runtime's allocator then places each
        # where the plan did (a pool that already holds blocks is left as it is).
        self.device.pool.restrict(plan.arena or plan.capacity)
        if len(self.graph.layers) >= 1000:      # seconds to minutes: say what is happening
            n = sum(int(np.prod(d.shape, dtype=np.int64)) for node in self.graph.layers for d, _ in node.params)
            log.info("binding %s: %s of persistent tensors, %.1f M parameters filled", self.name or "the net",
                     fmt_bytes(plan.persistent_bytes), n / 1e6)
        self._bind()
        if fill:
            self.init_params(self.seed)

    # -- memory ---------------------------------------------------------------
    def _make_plan(self, memory, reserve, host_reserve=0):
        self._plan_args = (memory, reserve, host_reserve)      # a net planned alone can plan again (dynamic.grow)
        if memory not in MODES and memory != "auto":
            raise PlanError(f"unknown memory mode {memory!r} (one of {', '.join(MODES)}, auto)")

        def make():
            capacity, kw = self.budgets()
            kw.update(host_params=self.host_params, host_extra=host_reserve)
            if memory == "auto":
                return capacity, auto_plan(self.graph, capacity, reserve, **kw)
            # the mode given, fitted to the host tier (and disk) where it can be
            return capacity, shared_ram_plan(self.graph, memory, capacity, reserve, **kw)
        capacity, plan = within_ram(self.device, len(self.graph.ops), make, plan_of=lambda made: made[1])
        check_fits(self.graph, plan, capacity, reserve)
        for loc, peak in plan.peaks.items():
            pool = self.devices[loc].pool
            if loc and peak > pool.capacity - pool.in_use:
                raise MemoryExhausted(f'location "{loc}" needs {peak} bytes, its device has '
                                      f"{pool.capacity - pool.in_use} free")
        log.info("%s", plan_line(plan, memory == "auto", self.name, process_memory()["rss"]))
        return plan

    def make_plan(self, memory=None, reserve=0, host_reserve=0):
        """Plan this (deferred) net alone, as the constructor does."""
        return self._make_plan(memory or self.memory, reserve, host_reserve)

    def budgets(self):
        """(device capacity, planner keywords for the host tier): what the pools have free now,
        and on the CPU the RAM both share (see runtime/budget.py)."""
        dev = self.device
        capacity = dev.pool.capacity - dev.pool.in_use
        host = getattr(dev, "host_pool", None)
        kw = {"host_capacity": None if host is None else host.capacity - host.in_use, "ram": None}
        if getattr(dev, "ram", None) is not None:      # less the plan about to be made, kept while it runs
            kw["ram"] = ram_left(dev) - PLAN_BYTES_PER_OP * len(self.graph.ops)
        if getattr(dev, "spills", False):       # a disk tier: the free space where the spill file goes
            kw["spill"] = spill_room(getattr(dev, "spill_dir", None))
        return capacity, kw

    def _binders(self):
        """id(root) -> setters that point every view of that root at its block (or None)."""
        binders = {}

        def on(tensor, setter, key=None, part="data"):
            if tensor is not None:
                shape = tensor.shape        # planned; this forward's where shapes are dynamic
                binders.setdefault(id(tensor.root), []).append(
                    lambda a: setter(None if a is None else self.shapes.fit(key, part, a, shape)))
        for name, b in self.graph.blobs.items():
            blob = self.blobs[name]
            on(b.data, lambda a, blob=blob: setattr(blob, "data", a), name)
            on(b.diff, lambda a, blob=blob: setattr(blob, "diff", a), name, "diff")
        for node in self.graph.layers:
            layer = node.layer
            for (d, g), blob in zip(node.params, layer.blobs):
                on(d, lambda a, blob=blob: setattr(blob, "data", a))
                on(g, lambda a, blob=blob: setattr(blob, "diff", a))
            for k, t in node.scratch.items():
                on(t, lambda a, layer=layer, k=k: layer.scratch.__setitem__(k, a), ("scratch", node.name, k))
        return binders

    def _bind(self):
        """Blobs for every tensor; the plan's persistent tensors allocated (zeroed) now."""
        self.shapes = DynamicShapes(self.graph, self.device)
        self.blobs = OrderedDict((name, Blob(name)) for name in self.graph.blobs)
        self.params = OrderedDict()
        for node in self.graph.layers:
            layer = node.layer
            layer.blobs = [Blob(d.name) for d, _ in node.params]
            layer.scratch = {k: None for k in node.scratch}
            node.bottom_blobs = [self.blobs[b.name] for b in node.bottoms]
            node.top_blobs = [self.blobs[t.name] for t in node.tops]
            if layer.blobs:
                self.params[node.name] = layer.blobs
        self.executor = Dispatcher(self.device, self._binders(), self._run_op, self.devices)
        self._state_blocks = []         # (in the host pool, offset) of alloc_state's arrays
        # What the executor holds, by its containers (never the executor: its binders hold the net).
        ex = {k: getattr(self.executor, k) for k in ("offsets", "transient", "host", "host_loc", "disk")}
        ex["devices"] = self.devices
        locations = {id(t): t.location for t in (*self.plan.persistent, *self.plan.host_params)}
        self._finalizer = weakref.finalize(self, _on_dropped, ex, locations, self._state_blocks)
        for root in self.plan.persistent:
            self.executor.alloc(root, fill=0, persistent=True)
        for root in self.plan.host_params:
            self.executor.host_home(root, disk=getattr(self.plan, "param_disk", False))
        self._set_loss_diffs()

    def alloc_state(self, shape, dtype, name, spillable=False):
        """An array for state beside the net (the solver's history): in the device pool, or in
        the host pool when the parameters live on the host, or (``spillable``) in the spill
        file with them where the host pool cannot hold them (runtime/spill.py)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if spillable and self.host_params and getattr(self.plan, "param_disk", False):
            return self.executor.disk_state(shape, dtype, name)
        if self.host_params:
            off, raw = self.device.host_alloc(max(nbytes, 1), name)
            self._state_blocks.append((True, off))
            arr = raw[:nbytes].view(dtype).reshape(shape)
            arr[...] = 0
            return arr
        off, arr = self.device.alloc(shape, dtype, name, zero=True)
        self._state_blocks.append((False, off))
        return arr

    def _set_loss_diffs(self):
        for node in self.graph.layers:
            for w, top in zip(node.loss_weights, node.top_blobs):
                if w and top.diff is not None:
                    top.diff[...] = w

    def release(self):
        """Give every pool block back to the device."""
        self.executor.reset()
        for root in self.plan.persistent:
            self.executor.free(root)

    # -- parameters -----------------------------------------------------------
    def init_params(self, seed=0):
        """Fill parameters from the fillers; each layer's random stream depends on the seed and
        its name only, so inserted Split or Copy layers do not change any other layer's values.
        Last layer first: a shared parameter keeps its owner's (the first layer's) values, as in Caffe."""
        for node in reversed(self.graph.layers):
            layer = node.layer
            child = np.random.SeedSequence([seed, zlib.crc32(node.name.encode())])
            rng = np.random.default_rng(child)
            layer.rng = np.random.default_rng(child.spawn(1)[0])
            if layer.blobs:
                try:
                    layer.init_params(rng)
                except ValueError as e:         # a filler setting (unknown type, bad range): name the layer
                    raise layer.error(str(e)) from None

    def _report_weights(self, src, layers, where):
        """Say what a weights file will load: an error when it matches no layer with parameters,
        a summary line, and warnings of its layers that match nothing and of the net's learnable
        layers it leaves at their fillers."""
        if src.layers:
            return                              # V1: refused (or upgraded) by the caller
        in_file = [lp for lp in src.layer if lp.blobs]
        matched = [lp for lp in in_file if lp.name in layers and layers[lp.name].layer.blobs]
        unmatched = [lp.name for lp in in_file if lp.name not in layers]
        if not matched and any(n.layer.blobs for n in self.graph.layers):
            raise ValueError(f"{where}no layer of the file matches a layer with parameters in the net "
                             f"({len(in_file)} layers with parameters in the file"
                             + (f": {_some(unmatched)}" if unmatched else "") + "); is it the weights of "
                             "another net?")
        log.info("%sloading %d layers (%d blobs)", where, len(matched), sum(len(lp.blobs) for lp in matched))
        if unmatched:
            log.warning("%s%d layers of the file match no layer of the net: %s", where, len(unmatched),
                        _some(unmatched))
        names = {lp.name for lp in matched}
        left = [n.name for n in self.graph.layers if n.layer.blobs and n.layer.learnable and n.name not in names]
        if left:
            log.warning("%s%d learnable layers of the net are not in the file and keep their fillers' "
                        "values: %s", where, len(left), _some(left))

    def copy_from(self, weights):
        """Load parameters by layer name from a .caffemodel path or NetParameter (Caffe's CopyTrainedLayersFrom)."""
        if not isinstance(weights, pb.NetParameter) and hdf5_weights.is_hdf5(weights):
            return hdf5_weights.load(self, weights)     # Caffe's HDF5 weights (told apart by content)
        src = upgrade_net(weights, binary=True) if isinstance(weights, pb.NetParameter) \
            else blobproto.read_caffemodel(weights)
        where = "" if isinstance(weights, pb.NetParameter) else f"{weights}: "
        layers = {n.name: n for n in self.graph.layers}
        if not isinstance(weights, pb.NetParameter):
            self._report_weights(src, layers, where)    # before copying: a file matching nothing changes nothing
        for lp in list(src.layer) or []:
            node = layers.get(lp.name)
            if node is None or not lp.blobs:
                continue
            mine = node.layer.blobs
            if len(lp.blobs) != len(mine):
                raise ValueError(f'{where}layer "{lp.name}" has {len(lp.blobs)} blobs in the file, '
                                 f"{len(mine)} in the net")
            for i, (bp, blob) in enumerate(zip(lp.blobs, mine)):
                try:
                    arr = blobproto.to_array(bp, blob.data.dtype)
                except ValueError as e:
                    raise ValueError(f'{where}layer "{lp.name}" blob {i}: {e}') from None
                if arr.shape != blob.data.shape:
                    if arr.size == blob.data.size and any(bp.HasField(f) for f in ("num", "channels", "height", "width")):
                        arr = arr.reshape(blob.data.shape)     # legacy 4-D shapes
                    else:
                        raise ValueError(f'{where}layer "{lp.name}" blob {i}: shape {arr.shape} in the '
                                         f"file, {blob.data.shape} in the net")
                transfer(blob.data, arr)        # into a NumPy or a device (CuPy) array
                warn_nonfinite(arr, f'{where}layer "{lp.name}" blob {i}')

    def to_proto(self, write_diff=False) -> "pb.NetParameter":
        """The net with its parameters, as Caffe's Net::ToProto."""
        out = pb.NetParameter()
        out.name = self.graph.param.name
        for node in self.graph.layers:
            lp = out.layer.add()
            lp.CopyFrom(node.layer.param)
            del lp.blobs[:]
            lp.ClearField("defined_at")
            for blob in node.layer.blobs:
                blobproto.from_array(blob.data, lp.blobs.add(), blob.diff if write_diff else None)
        return out

    def proto_chunks(self, write_diff=False):
        """The bytes of ``to_proto()``, a layer at a time (Caffe's field order: name, then layers)."""
        yield pb.NetParameter(name=self.graph.param.name).SerializeToString()
        for node in self.graph.layers:
            lp = pb.LayerParameter()
            lp.CopyFrom(node.layer.param)
            del lp.blobs[:]
            lp.ClearField("defined_at")
            for blob in node.layer.blobs:
                blobproto.from_array(blob.data, lp.blobs.add(), blob.diff if write_diff else None)
            yield blobproto.field(100, lp)        # NetParameter.layer

    def save(self, path, write_diff=False):
        """Write a .caffemodel; memory for one layer at a time, never the whole model twice."""
        blobproto.write_atomic(path, self.proto_chunks(write_diff))

    def clear_param_diffs(self):
        for blobs in self.params.values():
            for b in blobs:
                if b.diff is not None:      # (a gradient updated in backward: allocated zeroed)
                    b.diff[...] = 0

    # -- running --------------------------------------------------------------
    def _run_op(self, op, recompute=False, workspace=None, chunk=None):
        node = op.node
        layer = node.layer
        if self.shapes.active:                      # Caffe's Reshape before each Forward (Filter)
            if op.kind == "forward":
                self.shapes.before_forward(node)
            if not chunk:                           # a chunk's workspace does not grow with the batch
                workspace = self.shapes.workspace(layer, op.kind, workspace or {})
        layer.workspace = workspace or {}
        if chunk:
            saved, layer.chunk = layer.chunk, chunk
        t0 = time.perf_counter()
        try:
            if op.kind == "forward":
                (layer.recompute if recompute else layer.forward)(node.bottom_blobs, node.top_blobs)
            else:
                shared = [(layer.blobs[i], layer.blobs[i].diff) for i in node.frozen_diffs]
                for (blob, diff), key in zip(shared, node.frozen_diffs.values()):
                    ws = layer.workspace.get(key)    # dropped after: a sharer learns this parameter
                    # (a chunked backward's workspace, chosen by the planner, lacks it: a transient array)
                    blob.diff = ws.reshape(diff.shape) if ws is not None else array_module(diff).zeros_like(diff)
                try:
                    layer.backward(node.top_blobs, node.propagate_down, node.bottom_blobs)
                finally:
                    for blob, diff in shared:
                        blob.diff = diff
                for i, (blob, need) in enumerate(zip(layer.blobs, node.param_need_backward)):
                    if not need and i not in node.frozen_diffs:
                        blob.diff[...] = 0      # frozen parameters keep a zero gradient, as in Caffe
                if self.update_hook is not None and not recompute:
                    self.update_hook(op)        # parameters whose gradients are now complete
        finally:
            layer.workspace = {}
            if chunk:
                layer.chunk = saved
        if self.step_hook is not None:
            self.step_hook(op, recompute)
        timings = self._timings
        if timings is not None:
            if not self.executor.threaded:      # a worker's op is done here; waiting on streams could deadlock
                self.device.synchronize()
            name = op.name + (" (recompute)" if recompute else "")
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0
        if self.shapes.grown_node is not None:      # a top outgrew its block: plan again (dynamic.grow)
            raise Grown(self.shapes.grown_node, dict(self.shapes.grown))

    _timings = None
    step_hook = None        # called after every operator with (op, recompute): progress within a pass
    update_hook = None      # called after every backward operator with (op): a solver's update in backward

    def forward(self, timings=None) -> float:
        if self.executor.busy:
            self.executor.reset()       # the last forward had no backward
        self._timings = timings
        try:
            self.execute(lambda schedule: schedule.forward)
        finally:
            self._timings = None
        return self.loss()

    def execute(self, select):
        """Run the instructions ``select(schedule)`` takes from the plan's schedule; where a layer's
        top outgrows its planned block, plan again and go on (sncaffe.dynamic.grow)."""
        instrs = select(self.plan.schedule)
        while True:
            try:
                return self.executor.execute(instrs)
            except Grown as grown:
                instrs = grow(self, grown, select)

    @property
    def batch_size(self) -> int:
        """Images per forward pass: the first top of the first layer without bottoms (0 if none)."""
        for node in self.graph.layers:
            if not node.bottoms and node.tops and node.tops[0].shape:
                return int(node.tops[0].shape[0])
        return 0

    def loss(self) -> float:
        total = 0.0
        for node in self.graph.layers:
            for w, top in zip(node.loss_weights, node.top_blobs):
                if w:
                    total += w * float(np.sum(top.data, dtype=np.float64))
        return total

    def backward(self, timings=None) -> None:
        self._set_loss_diffs()
        self._timings = timings
        try:
            self.executor.execute(self.plan.schedule.backward)
        finally:
            self._timings = None
        self.executor.reset()

    def forward_backward(self) -> float:
        loss = self.forward()
        self.backward()
        return loss

    # -- introspection --------------------------------------------------------
    @property
    def layers(self):
        return [n.layer for n in self.graph.layers]

    @property
    def layer_names(self):
        return [n.name for n in self.graph.layers]

    @property
    def inputs(self):
        return [t.name for n in self.graph.layers if n.type == "Input" for t in n.tops]

    @property
    def outputs(self):
        return [b.name for b in self.graph.outputs()]

    @property
    def layer_types(self) -> "OrderedDict":
        """{layer name: type}, in the net's order."""
        return OrderedDict((n.name, n.type) for n in self.graph.layers)

    @property
    def loss_weights(self) -> dict:
        """{top name: loss weight} of the tops that count in the loss (empty: a net with no loss)."""
        return {t.name: w for n in self.graph.layers for w, t in zip(n.loss_weights, n.tops) if w}

    @property
    def needs_backward(self) -> bool:
        """Whether a backward pass computes anything (a deploy net without a loss: no)."""
        return any(n.need_backward for n in self.graph.layers)

    def output(self, name):
        """The data of blob ``name`` as a NumPy array (a GPU's copied to the host)."""
        data = self.blobs[name].data
        return data.get() if hasattr(data, "get") else np.asarray(data)

    # -- export (sncaffe/export/) ------------------------------------------------
    def to_onnx(self, path=None, rtol=1e-4):
        """The net's deploy part (export/deploy.py) as an ONNX ModelProto, written to ``path``
        if given, after one random batch through onnxruntime gave outputs within ``rtol``
        (relative) of sncaffe's (None: unchecked); ExportError otherwise."""
        from .export import deploy, onnx
        return onnx.export(deploy.deploy_net(self), path, rtol)[0]

    def to_torch(self, path=None, rtol=1e-4):
        """The net's deploy part as a PyTorch nn.Module with these parameters, in train mode for
        the TRAIN phase; with ``path`` its source (.py) and weights (.pt) are written. Checked
        as ``to_onnx`` is."""
        from .export import deploy, pytorch
        return pytorch.export(deploy.deploy_net(self), path, rtol)[0]
