"""sncaffe side by side with PyTorch (and real Caffe where a `caffe` binary is on PATH), in one run.

    python tools/compare.py [--suite tools/compare.yaml] [--quick] [--threads N] [--out out/compare]
    python tools/compare.py depth --limit 3GiB      # the deepest ResNet in a memory cgroup: tools/compare_depth.py

The suite file names the nets, batch sizes, memory budgets and frameworks; ``--quick``
applies its ``quick:`` section on top. Three suites, each measured the same way for
every framework, N threads each (default 1: OPENBLAS/OMP/MKL_NUM_THREADS,
torch.set_num_threads and sncaffe's thread policy all set to N before a BLAS loads):

memory      peak memory of one training step (forward + backward; the SGD momentum
            buffer counted as resident), every net of the suite
throughput  time per training iteration (forward, backward, SGD update) and images/s,
            sncaffe and PyTorch steps interleaved after warm-up, each framework in a
            process of its own (``Worker``), the median of N; the
            median of ``repeats`` such whole runs, with their spread; against the faster
            of PyTorch's two forms (below); and images/s against depth for ResNets [3, 4, k, 3]
scaling     the suite's ``threads`` (2) against one: sncaffe and PyTorch each in a worker of
            that many threads, stepping on one thread and on all of them by turns, the
            frameworks interleaved (both scale in the same minutes on the same machine), with
            the machine's own speed-up beside them (a GEMM and a copy stepped by turns with them)

The two PyTorch forms: "twin" is tools/torch_net.TorchNet, a layer-by-layer replay of the
Caffe graph (separate BatchNorm and Scale, every blob kept by name); "idiomatic" is
tools/torch_idiomatic.py, the net as PyTorch users write it (affine BatchNorm2d, in-place ReLU),
where the net has such a form (LeNet, the CIFAR ResNet, the bottleneck ResNets). Both get the
Net's weights and batch, so the first losses agree.

What is counted (memory suite)
  sncaffe   the device pool's peak: parameters, parameter diffs, SGD history and the
            solver's two work buffers, and every activation, diff, layer scratch and
            workspace the plan places (sncaffe.plan.planner.make_plan, no compute). The
            runtime allocates exactly what the plan places, so the pool peak of a real
            step equals the plan; `verify` runs check it. "all+host" is mode all with
            parameters, diffs and history in host memory (--host-params).
  PyTorch   bytes of live tensors counted on the meta device (parameters, buffers,
            gradients, momentum, the peak of what autograd saves, the largest transient),
            with the allocator's peak of a real step beside it (`verify`).
The whole process, both frameworks in real runs inside a memory cgroup: `compare.py depth`.
Dropout in the twin uses torch's own masks (they need not match sncaffe's). Results go to
--out: tables.md, results.json, throughput_vs_depth.png.
"""
from __future__ import annotations

import os

import sys  # noqa: E402

if __name__ == "__main__" and sys.argv[1:2] == ["depth"]:
    # the deepest ResNet in a memory limit: a light parent, each point a fresh process (compare_depth.py)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import compare_depth
    sys.exit(compare_depth.main(sys.argv[2:]))

THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _threads_flag(argv) -> int:
    """``--threads N`` of the command line, read before anything loads a BLAS (MKL picks its
    sequential or threaded layer when it loads); 1 by default and when imported."""
    for i, a in enumerate(argv):
        if a == "--threads" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--threads="):
            return int(a.split("=", 1)[1])
    return 1


THREADS = _threads_flag(sys.argv[1:]) if __name__ == "__main__" else 1
for _var in THREAD_VARS:
    os.environ[_var] = str(THREADS)   # N threads each: set before NumPy and torch load their BLAS

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import yaml  # noqa: E402

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
sys.path.insert(0, str(TOOLS))
import gen_resnet  # noqa: E402

from sncaffe.backend import blas, onednn  # noqa: E402
from sncaffe.backend import threads as policy  # noqa: E402
from sncaffe.backend.cpu import CPUDevice  # noqa: E402
from sncaffe.graph import build_graph  # noqa: E402
from sncaffe.plan.planner import make_plan  # noqa: E402
from sncaffe.sizes import fmt_bytes  # noqa: E402
from sncaffe.proto import sncaffe_pb2 as pb  # noqa: E402
from sncaffe.prototxt import parse_text, prepare_net, read_text, replace_data_layers, set_batch  # noqa: E402
from sncaffe.solvers.solver import Solver, history_bytes  # noqa: E402

# A worker that steps sncaffe (``serve``) leaves PyTorch out of its process, as `sncaffe train` does
# (PyTorch's GNU OpenMP would change which of MKL's layers sncaffe loads: ``backend/blas.py``).
_SNCAFFE_WORKER = __name__ == "__main__" and "--worker" in sys.argv and sys.argv[-2:-1] == ["sncaffe"]

try:
    if _SNCAFFE_WORKER:
        raise ImportError("not in sncaffe's worker")
    import torch
    import torch.nn.functional as F
    import torch_idiomatic
    import torch_net
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.checkpoint import checkpoint_sequential
except ImportError:            # PyTorch is an optional extra: sncaffe's columns are still measured
    torch = None
    TorchDispatchMode = object

DEFAULT_SUITE = TOOLS / "compare.yaml"
HOST = "all+host"               # mode all, parameters/diffs/history on the host
GiB = 1 << 30


# -- the suite --------------------------------------------------------------------------------
def merge(base, over):
    """``over`` on top of ``base``: dicts merge key by key, anything else is replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: merge(base.get(k), v) for k, v in over.items()}}
    return over


def load_suite(path=DEFAULT_SUITE, quick=False) -> dict:
    suite = yaml.safe_load(Path(path).read_text())
    quick_part = suite.pop("quick", None) or {}
    return merge(suite, quick_part) if quick else suite


def net_param(suite, name, batch) -> "pb.NetParameter":
    """The TRAIN net ``name`` of the suite at ``batch``: a prototxt (data layers become Input
    layers of the ``input`` shape) or a bottleneck ResNet ``resnet: [a, b, c, d]``."""
    spec = suite["nets"][name]
    if "resnet" in spec:
        return resnet(spec["resnet"], batch, spec.get("image_size", 224))
    param = read_text(ROOT / spec["prototxt"], pb.NetParameter())
    if "input" in spec:
        param = replace_data_layers(param, {"data": (batch, *spec["input"]), "label": (batch,)})
    return set_batch(param, batch)


def resnet(blocks, batch, image_size) -> "pb.NetParameter":
    return parse_text(gen_resnet.generate(tuple(blocks), batch=batch, image_size=image_size), pb.NetParameter())


def depth(k) -> int:
    return 3 * (k + 10) + 2


def graph_of(param):
    """The TRAIN graph of ``param``: shapes only, nothing allocated."""
    return build_graph(prepare_net(param, pb.TRAIN), pb.TRAIN)


# -- machine and threads --------------------------------------------------------------------------
def blas_threads():
    """Threads of NumPy's OpenBLAS (forced to 1 here if NumPy was loaded before this module)."""
    if blas.openblas_threads() not in (None, 1):
        blas.set_openblas_threads(1)
    return blas.openblas_threads()


def machine() -> dict:
    try:
        model = next((line.split(":", 1)[1].strip() for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    except OSError:
        model = platform.processor() or "?"
    if torch is not None:
        torch.set_num_threads(THREADS)
    from sncaffe.backend import runtimes
    runtimes.configure(THREADS)
    return {
        "nproc": os.cpu_count(), "cpu": model, "python": platform.python_version(),
        "numpy": np.__version__, "torch": torch.__version__ if torch is not None else None,
        "sncaffe_blas": blas.BLAS.describe(),
        "threads": {**{v: os.environ.get(v) for v in THREAD_VARS}, "numpy_blas": blas_threads(), "sncaffe": THREADS,
                    "torch": torch.get_num_threads() if torch is not None else None},
        "loadavg_start": os.getloadavg()[0],
    }


# -- sncaffe ---------------------------------------------------------------------------------------
def sncaffe_plan(graph, mode, capacity=None):
    """The plan of one training step with SGD (momentum history + work buffers) on a device of
    ``capacity`` bytes (None: unbounded, every workspace for the whole batch, nothing cached)."""
    if mode == HOST:
        return make_plan(graph, "all", capacity, 0, host_params=True)
    return make_plan(graph, mode, capacity, history_bytes(graph, 1))


def plan_peak(graph, mode, capacity=None) -> int:
    return sncaffe_plan(graph, mode, capacity).peak


def peak_within(graph, mode, budget) -> int:
    """The least planned peak of a step that trains on a device of ``budget`` bytes: the unbounded
    plan's, or where only the plan made for the budget fits (convolution workspaces chunked to
    fit), that one's; the unbounded plan's (above ``budget``) where no plan fits."""
    free, bound = sncaffe_plan(graph, mode), sncaffe_plan(graph, mode, budget)
    return min(free.peak, bound.peak) if bound.fits else max(free.peak, budget + 1)


def make_solver(param, mode="none", capacity=None, seed=0) -> Solver:
    sp = pb.SolverParameter(base_lr=1e-3, momentum=0.9, weight_decay=5e-4, lr_policy="fixed", type="SGD",
                            max_iter=1 << 30, display=0, random_seed=seed, snapshot_after_train=False)
    sp.net_param.CopyFrom(param)
    sp.memory_param.mode = "all" if mode == HOST else mode
    sp.memory_param.host_params = mode == HOST
    device = CPUDevice(capacity if capacity is not None else 8 * GiB, host_capacity=8 * GiB)
    solver = Solver(sp, device=device)
    fill_inputs(solver.net)
    return solver


def fill_inputs(net, seed=0):
    """Data N(0, 1); labels integers below the number of classes (as `sncaffe train` does)."""
    from sncaffe.data.synthetic import SyntheticInputs
    SyntheticInputs(seed)(net)


def sncaffe_true_peak(param, mode, capacity, exact=True) -> int:
    """The pool peak of one real training step (solver history included) on a device of
    ``capacity`` bytes (not ``exact``: a little more where the plan's blocks do not pack into it)."""
    from sncaffe.plan.planner import MemoryExhausted
    for slack in (1.0,) if exact else (1.0, 1.02, 1.1, 1.25):
        try:
            solver = make_solver(param, mode, int(capacity * slack) + (0 if exact else 4096))
            break
        except MemoryExhausted:
            if exact or slack == 1.25:
                raise
    solver.device.pool.reset_peak()
    solver.step(1)
    return solver.device.pool.peak


# -- PyTorch ---------------------------------------------------------------------------------------
class Skeleton:
    """An sncaffe Net's graph without its memory: what TorchNet reads, for a twin on the meta device
    (the parameters are zero-stride views; the twin copies each into a meta tensor, no bytes)."""

    def __init__(self, graph):
        self.phase, self.graph = pb.TRAIN, graph
        self.params = {n.name: [SimpleNamespace(data=np.broadcast_to(np.zeros((), d.dtype), d.shape))
                                for d, _ in n.params] for n in graph.layers if n.params}


@contextlib.contextmanager
def torch_dropout():
    """TRAIN-phase dropout with torch's own masks: a baseline needs the same work, not the same masks."""
    def dropout(twin, node, bottoms, blobs):
        return [F.dropout(bottoms[0], node.layer.param.dropout_param.dropout_ratio, training=True)]
    saved, torch_net.OPS["Dropout"] = torch_net.OPS["Dropout"], dropout
    try:
        yield
    finally:
        torch_net.OPS["Dropout"] = saved


def torch_inputs(graph, device, net=None) -> dict:
    """The Input blobs as tensors: ``net``'s values when given (the same batch sncaffe sees), else zeros."""
    out = {}
    for node in graph.layers:
        if node.type == "Input":
            for t in node.tops:
                value = net.blobs[t.name].data if net is not None else np.zeros(t.shape, np.float32)
                out[t.name] = torch.tensor(np.array(value), device=device)
    return out


def pieces(twin, inputs) -> list:
    """The net after its Input layer, cut where exactly one blob is live (labels aside) and the next
    layer is not in place on it (a ResNet: one piece per block): functions of that blob for
    checkpoint_sequential; the last returns the loss."""
    layers = [n for n in twin.layers if n.type != "Input"]
    feeds = [t.name for n in twin.layers if n.type == "Input" for t in n.tops]
    side = {k: inputs[k] for k in feeds[1:]}
    uses = {}
    for n in layers:
        for b in n.bottoms:
            uses[b.name] = uses.get(b.name, 0) + 1
    live, bounds = {feeds[0]}, [(0, feeds[0])]
    for i, n in enumerate(layers):
        for b in n.bottoms:
            uses[b.name] -= 1
            if not uses[b.name]:
                live.discard(b.name)
        live.update(t.name for t in n.tops if uses.get(t.name))
        cut = live - set(side)
        if len(cut) == 1 and i + 1 < len(layers) and not cut & {t.name for t in layers[i + 1].tops}:
            bounds.append((i + 1, next(iter(cut))))     # (not inside a chain of in-place layers)
    bounds.append((len(layers), None))
    ops = dict(torch_net.OPS)       # as now (torch_dropout's): backward replays pieces outside it

    def piece(nodes, inp, out):
        def run(x):
            env, loss = {**side, inp: x}, 0
            with torch.device(x.device):        # also when backward replays it (another thread)
                for node in nodes:
                    tops = ops[node.type](twin, node, [env[b.name] for b in node.bottoms],
                                          twin.blobs_of(node.name))
                    for t, v, w in zip(node.tops, tops, node.loss_weights or [0] * len(tops)):
                        env[t.name] = v
                        loss = loss + w * v.sum() if w else loss
            return env[out] if out else loss
        return run
    return [piece(layers[a:b], inp, out) for (a, inp), (b, out) in zip(bounds, bounds[1:])]


def torch_loss(twin, inputs, checkpoint):
    with torch_dropout():
        if not checkpoint:
            return twin(inputs).loss
        fns = pieces(twin, inputs)
        data = next(iter(inputs.values())).detach().requires_grad_(True)   # reentrant checkpoints need it
        return checkpoint_sequential(fns, max(1, round(math.sqrt(len(fns)))), data,
                                     use_reentrant=True, preserve_rng_state=False)


def _storage(t):
    s = t.untyped_storage()
    return s._cdata, s.nbytes()


class _Saved:
    """What a saved_tensors_hooks pack returns: lives exactly as long as autograd keeps the tensor."""
    __slots__ = ("count", "key", "tensor")

    def __init__(self, count, key, tensor):
        self.count, self.key, self.tensor = count, key, tensor

    def __del__(self):
        self.count.release(self.key)


class LiveTensors(TorchDispatchMode):
    """Counts one training step: the storages autograd saves (peak over time) and the largest
    transient (over every aten op, its arguments and results neither fixed nor saved)."""

    def __init__(self, fixed):
        super().__init__()
        self.fixed = fixed              # storages counted apart: parameters, buffers, gradients, momentum
        self.saved = {}                 # storage -> [references, bytes]
        self.saved_bytes = self.saved_peak = self.transient = 0

    def pack(self, t):
        key, nbytes = _storage(t)
        if key in self.fixed:
            return t
        entry = self.saved.setdefault(key, [0, nbytes])
        if not entry[0]:
            self.saved_bytes += nbytes
            self.saved_peak = max(self.saved_peak, self.saved_bytes)
        entry[0] += 1
        return _Saved(self, key, t)

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def release(self, key):
        entry = self.saved[key]
        entry[0] -= 1
        if not entry[0]:
            del self.saved[key]
            self.saved_bytes -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {}
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor):
                key, nbytes = _storage(t)
                if key not in self.fixed and key not in self.saved:
                    seen[key] = nbytes
        self.transient = max(self.transient, sum(seen.values()))
        return out


class TorchTrainer:
    """TorchNet of a graph with SGD (momentum 0.9, weight decay 5e-4), on ``device``."""

    def __init__(self, graph, device="cpu", net=None, checkpoint=False):
        self.device, self.checkpoint = device, checkpoint
        with torch.device(device):
            self.twin = torch_net.TorchNet(net if net is not None else Skeleton(graph))
        self.inputs = torch_inputs(graph, device, net)
        self._sgd()

    def _sgd(self):
        """SGD over ``self.twin``'s learnable parameters, gradients and momentum resident from the
        start (as sncaffe's diffs and history); ``fixed``: what lives for the whole step."""
        params = [p for p in self.twin.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        self.opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9, weight_decay=5e-4)
        for p in params:
            self.opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
        self.fixed = [*self.twin.parameters(), *self.twin.buffers(), *(p.grad for p in params),
                      *(self.opt.state[p]["momentum_buffer"] for p in params)]

    def loss(self):
        with torch.device(self.device):
            return torch_loss(self.twin, self.inputs, self.checkpoint)

    def step(self, update=True) -> float:
        self.opt.zero_grad(set_to_none=False)
        loss = self.loss()
        with torch.device(self.device):
            loss.backward()
        if update:
            self.opt.step()
        return float(loss.detach()) if self.device != "meta" else 0.0

    def count(self, allocator=False) -> dict:
        """The counted peak of one step (forward + backward), by component; with ``allocator``, the
        CPU allocator's own peak of that step beside it (``allocator_peak``)."""
        keys = {_storage(t) for t in self.fixed}
        live = LiveTensors({k for k, _ in keys})
        with torch.autograd.graph.saved_tensors_hooks(live.pack, live.unpack), live:
            self.step(update=False)
        # a step of its own: the profiler's stack capture is slow through the counting mode
        alloc = allocator_peak(self.step, [*self.fixed, *self.inputs.values()]) if allocator else None
        params = self.opt.param_groups[0]["params"]

        def total(tensors):
            return sum(n for _, n in {_storage(t) for t in tensors})
        fixed = sum(n for _, n in keys)
        return {"params": total([*self.twin.parameters(), *self.twin.buffers()]), "grads": total(p.grad for p in params),
                "momentum": total(self.opt.state[p]["momentum_buffer"] for p in params), "saved": live.saved_peak,
                "transient": live.transient, "peak": fixed + live.saved_peak + live.transient,
                **({"allocator": alloc} if allocator else {})}


class IdiomaticTrainer(TorchTrainer):
    """The net as PyTorch users write it (tools/torch_idiomatic.py), same weights, batch and SGD;
    ``model_for(graph)`` says whether the net has such a form."""

    def __init__(self, graph, device="cpu", net=None, checkpoint=False):
        self.device, self.checkpoint = device, checkpoint
        with torch.device(device):
            self.model = torch_idiomatic.model_for([n.name for n in graph.layers])
        if net is not None:
            self.model.load_caffe(net)
        inputs = torch_inputs(graph, device, net)
        self.x, self.y = inputs["data"], inputs["label"].long()
        self.seq = torch_idiomatic.sequential(self.model) if checkpoint else None
        self.twin, self.inputs = self.model, {"data": self.x, "label": self.y}     # what count() reads
        self._sgd()

    @staticmethod
    def available(graph) -> bool:
        return torch is not None and torch_idiomatic.model_for([n.name for n in graph.layers]) is not None

    def loss(self):
        with torch.device(self.device):
            if self.seq is None:
                logits = self.model(self.x)
            else:
                logits = checkpoint_sequential(self.seq, max(1, round(math.sqrt(len(self.seq)))), self.x,
                                               use_reentrant=False)
            return F.cross_entropy(logits, self.y)


def torch_variants_for(graph, variants) -> list:
    """The ``variants`` the net has: "twin" always, "idiomatic" (and its "+checkpoint") where
    tools/torch_idiomatic.py has the net's form; none without PyTorch."""
    if torch is None:
        return []
    return [v for v in variants or [] if not v.startswith("idiomatic") or IdiomaticTrainer.available(graph)]


def pytorch_trainers(graph, net, variants, device="cpu") -> dict:
    """PyTorch trainers by variant name: "twin" (tools/torch_net.py's Caffe-style replay) and, where
    the net has an idiomatic form, "idiomatic"; each "+checkpoint" with checkpoint_sequential."""
    out = {}
    for v in torch_variants_for(graph, variants):
        style, _, saver = v.partition("+")
        cls = IdiomaticTrainer if style == "idiomatic" else TorchTrainer
        out[v] = cls(graph, device, net=net, checkpoint=saver == "checkpoint")
    return out


def pytorch_trainers_on(graph, device, variants) -> dict:
    return pytorch_trainers(graph, None, variants, device)


@contextlib.contextmanager
def quiet_stderr():
    """The profiler (Kineto) prints its start and stop on file descriptor 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def allocator_peak(step, resident):
    """The CPU allocator's peak during ``step(update=False)``: the bytes of ``resident`` (what lives
    before it: parameters, buffers, gradients, momentum, inputs) + the highest sum of allocations
    less frees within it, from torch.profiler's memory timeline (a private API: None if missing)."""
    try:
        from torch.profiler import ProfilerActivity, profile
        from torch.profiler._memory_profiler import Action
        with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                                     record_shapes=True, with_stack=True) as prof:
            step(update=False)
        timeline = prof._memory_profile().timeline
    except Exception as e:       # noqa: BLE001  (a private API: report it, never fail the run)
        print(f"  (torch.profiler memory timeline unavailable: {e})")
        return None
    live = peak = 0
    for _, action, _, size in timeline:
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, live)
    return sum(n for _, n in {_storage(t) for t in resident}) + peak


def torch_count(graph, checkpoint, style="twin") -> dict:
    """The counted PyTorch peak of a graph's training step, on the meta device."""
    return pytorch_trainers_on(graph, "meta", [style + ("+checkpoint" if checkpoint else "")])[
        style + ("+checkpoint" if checkpoint else "")].count()


# -- timing ----------------------------------------------------------------------------------------
# Seconds between two workers' steps on more than one thread: the last step's OpenMP threads in
# the other process stop spinning first, else every framework's steps at two threads run slower.
SETTLE_S = 0.1


def interleaved(steps: dict, warmup: int, iterations: int, pause: float = 0.0) -> dict:
    """(median, fastest, median page faults) of each step function, calls interleaved (the same
    machine load), ``pause`` seconds before each timed call. A step that times itself (a
    ``Worker``'s) returns (seconds, page faults); any other is timed here, its faults not counted
    (None)."""
    for _ in range(warmup):
        for fn in steps.values():
            fn()
    times, faults = {k: [] for k in steps}, {k: [] for k in steps}
    for _ in range(iterations):
        for k, fn in steps.items():
            if pause:
                time.sleep(pause)
            t0 = time.perf_counter()
            got = fn()
            times[k].append(got[0] if isinstance(got, tuple) else time.perf_counter() - t0)
            if isinstance(got, tuple):
                faults[k].append(got[1])
    return {k: (statistics.median(v), min(v), statistics.median(faults[k]) if faults[k] else None)
            for k, v in times.items()}


# -- each framework in a process of its own ------------------------------------------------------
class Worker:
    """One framework's training step in a process of its own (``compare.py --worker``), stepped on
    request: the parent interleaves the frameworks' steps under the same machine load, and nothing
    of one framework's model lives in another's process, as for their users.

    Why not one process: the C library's allocator is the process's. In one process, the PyTorch
    twin's large blocks raised malloc's mmap and trim thresholds for the idiomatic model too, which
    then reused heap memory where it alone maps and faults in fresh pages at every step (the CIFAR
    ResNet at batch 128 then ran faster beside the twin than alone, from tens of thousands fewer
    page faults a step). Each worker builds sncaffe's solver (seed 0)
    and takes the weights and batch from it, so every framework starts from the same numbers."""

    def __init__(self, param_file, framework, kind, threads=None):
        self.name = f"{framework} {kind}"
        threads = THREADS if threads is None else threads
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--threads", str(threads),
                                      "--worker", str(param_file), framework, kind],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._ready = False

    def _reply(self):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: its process ended (exit status {self.proc.wait()})")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"{self.name}: {msg['error']}")
        return msg

    def ask(self, cmd):
        if not self._ready:          # built: its first line says so (or why not)
            self.info = self._reply()
            self.pid, self._ready = self.info["ready"], True
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def step(self, threads=None):
        """(seconds, page faults) of one training step, on ``threads`` of the worker's own (None:
        all of them; the scaling suite's one-thread turns). ``last``: the whole reply (its CPU
        seconds, the threads the step ran on)."""
        self.last = r = self.ask("step" if threads is None else f"step {threads}")
        return r["s"], r["faults"]

    def close(self):
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def workers_on(param, specs: dict, threads=None):
    """{name: Worker} for ``specs`` {name: (framework, kind)}, each on ``param`` (written to a
    temporary file for them) with ``threads`` (None: this process's), all closed on leaving."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        param_file = Path(tmp) / "net.pb"
        param_file.write_bytes(param.SerializeToString())
        workers = {}
        try:
            for name, (framework, kind) in specs.items():
                workers[name] = Worker(param_file, framework, kind, threads)
            yield workers
        finally:
            for w in workers.values():
                w.close()


def serve(param_file, framework, kind) -> int:
    """A ``Worker``'s process: builds the step, says ``ready`` (its pid), then answers ``step``
    (seconds, CPU seconds and minor page faults of one training step), ``loss`` (the first loss, before any
    step) and ``split`` (``type_split``/``torch_split``) until its input ends; one JSON line each on
    the original stdout (what the frameworks print goes to stderr)."""
    import gc
    import resource
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def say(**msg):
        out.write(json.dumps(msg) + "\n")

    try:
        machine()                                 # the thread settings of the parent
        param = pb.NetParameter()
        param.ParseFromString(Path(param_file).read_bytes())
        if framework == "machine":
            step, loss, split = machine_probe(kind), (lambda: 0.0), dict
        elif framework == "sncaffe":
            solver = make_solver(param, kind)
            step, loss, split = (lambda: solver.step(1)), solver.net.forward, (lambda: type_split(solver.net))
        else:
            solver = make_solver(param, "none")
            trainer = pytorch_trainers(solver.net.graph, solver.net, [kind])[kind]
            solver.net.release()
            del solver
            gc.collect()
            step, split = trainer.step, (lambda: torch_split(trainer.step))
            loss = lambda: float(trainer.loss().detach())       # noqa: E731
        on = _torch_threads_held if framework == "pytorch" else policy.held
        say(ready=os.getpid(), torch="torch" in sys.modules)
        for line in sys.stdin:
            cmd, _, n = line.strip().partition(" ")
            if cmd == "step":
                with on(int(n)) if n else contextlib.nullcontext():
                    f0, c0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
                    t0 = time.perf_counter()
                    step()
                    t = time.perf_counter() - t0
                    threads = _threads_now(framework)
                say(s=t, cpu=time.process_time() - c0, faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0,
                    threads=threads)
            elif cmd == "loss":
                say(loss=float(loss()))
            elif cmd == "split":
                say(split=split())
            else:
                say(error=f"unknown request {line.strip()!r}")
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        say(error=f"{type(e).__name__}: {e}")
        return 1
    return 0


# The machine's own two-thread speed-up, probed beside the nets (``scaling``): two 1024^3 float32
# GEMMs on sncaffe's BLAS (compute-bound: 4.3 GFLOP) and a copy of 128 MiB on oneDNN's binary
# kernel (memory bandwidth), each on the thread budget of the turn. On a VM where the host places
# the second vCPU sets what any program gets (docs/benchmarks.md, "Two threads against one").
PROBES = {"gemm": "GEMM 2 x 1024^3 (BLAS)", "copy": "copy of 128 MiB (oneDNN)"}


def machine_probe(kind):
    """The step function of the ``kind`` probe (``PROBES``), on the thread budget of each call; it
    returns what it computed (from ``default_rng(0)``'s numbers: a @ b, or the copy)."""
    rng = np.random.default_rng(0)
    if kind == "gemm":
        a, b, c = (rng.random((1024, 1024), dtype=np.float32) for _ in range(3))

        def step():
            for _ in range(2):
                blas.gemm(a, b, c)
            return c
        return step
    if kind == "copy":
        src = rng.random(32 << 20, dtype=np.float32)
        dst = np.empty_like(src)
        one = np.ones(1, np.float32)

        def step():
            mul = onednn.binary_for(onednn.flat(src.size), (src, dst), onednn.MUL)
            if mul is None:
                raise RuntimeError("the copy probe needs oneDNN (SNCAFFE_CONV is native or it is not installed)")
            mul.run(src, one, dst)
            return dst
        return step
    raise ValueError(f"unknown machine probe {kind!r}: give one of {', '.join(PROBES)}")


def _onednn_in_use() -> bool:
    try:
        return onednn.choice() == "onednn"
    except (ValueError, RuntimeError):
        return False


def _threads_now(framework) -> int:
    """The threads a step of ``framework`` runs on now (sncaffe's budget; PyTorch's intra-op threads)."""
    return torch.get_num_threads() if framework == "pytorch" else policy.current().threads


@contextlib.contextmanager
def _torch_threads_held(n):
    """PyTorch's intra-op threads at ``n`` (at most the worker's own) for the enclosed step."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(n, THREADS)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def type_split(net) -> dict:
    """Seconds of one forward + backward pass by layer type (``Net.forward(timings=...)``)."""
    timings = {}
    net.forward(timings=timings)
    net.backward(timings=timings)
    types = {n.name: n.type for n in net.graph.layers}
    out = {}
    for k, v in timings.items():
        kind = types.get(k.split(":")[0], "other")
        out[kind] = out.get(kind, 0.0) + v
    return out


def conv_share(split) -> float | None:
    """Share of a step's time (a ``type_split`` or ``torch_split``) in its convolutions, or None
    where there is no split."""
    total = sum(split.values()) if split else 0.0
    return split.get("Convolution", 0.0) / total if total else None


# PyTorch's aten operators grouped as the Caffe layer types they stand for (first match wins).
TORCH_GROUPS = [("Convolution", ("conv",)), ("BatchNorm", ("batch_norm",)),
                ("ReLU", ("relu", "threshold", "clamp")), ("Pooling", ("pool",)),
                ("InnerProduct", ("addmm", "linear", "aten::mm", "aten::t")),
                ("solver", ("sgd", "zero_", "foreach")),
                ("Eltwise and sums", ("aten::add", "aten::sum")), ("Softmax and loss", ("softmax", "nll", "cross_entropy")),
                ("copies", ("copy_", "aten::cat", "aten::clone"))]

# The columns of "where the time goes": sncaffe's layer types and PyTorch's groups that do that work.
SPLIT_COLUMNS = [("Convolution", ("Convolution", "ConvolutionDepthwise"), ("Convolution",)),
                 ("BatchNorm + Scale", ("BatchNorm", "Scale"), ("BatchNorm",)),
                 ("ReLU", ("ReLU",), ("ReLU",)),
                 ("Eltwise + Split", ("Eltwise", "Split"), ("Eltwise and sums",)),
                 ("Pooling", ("Pooling",), ("Pooling",)),
                 ("InnerProduct", ("InnerProduct",), ("InnerProduct",)),
                 ("Concat + copies", ("Concat",), ("copies",))]


def torch_split(step) -> dict | None:
    """Self CPU seconds of one PyTorch step by operator group (``TORCH_GROUPS``; torch.profiler),
    or None where the profiler fails."""
    try:
        from torch.profiler import ProfilerActivity, profile
        with quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        out = {}
        for e in prof.key_averages():
            key = e.key.lower()
            group = next((g for g, names in TORCH_GROUPS if any(n in key for n in names)), "other")
            out[group] = out.get(group, 0.0) + e.self_cpu_time_total * 1e-6
        return out
    except Exception as e:  # noqa: BLE001 - a missing figure, not a failed comparison
        print(f"  (torch.profiler unavailable: {e})")
        return None


def time_pair(param, modes, torch_variants, warmup, iterations, batch, extras=True) -> dict:
    """images/s of sncaffe (each mode) and PyTorch (each variant of ``pytorch_trainers``) on the same
    net, weights and batch, each in a process of its own (``Worker``), steps interleaved; with
    ``extras``, also the first losses and where each framework's time goes."""
    torch_variants = torch_variants_for(graph_of(param), torch_variants) if torch_variants else []
    specs = {f"sncaffe {m}": ("sncaffe", m) for m in modes}
    specs.update((f"pytorch {v}", ("pytorch", v)) for v in torch_variants)
    out = {}
    with workers_on(param, specs) as workers:
        if extras and modes:        # the same weights and batch: the first losses agree
            out["loss"] = {("sncaffe" if k.startswith("sncaffe") else k): w.ask("loss")["loss"]
                           for k, w in workers.items() if k == f"sncaffe {modes[0]}" or k.startswith("pytorch")}
        for k, (s, fastest, faults) in interleaved({k: w.step for k, w in workers.items()}, warmup, iterations,
                                                   pause=SETTLE_S if THREADS > 1 else 0.0).items():
            out[k] = {"s_per_iter": s, "images_per_s": batch / s, "s_best": fastest, "faults": faults,
                      "pid": workers[k].pid, "torch_loaded": workers[k].info["torch"]}
        if extras and modes:
            out.setdefault("split", {})["sncaffe"] = split = workers[f"sncaffe {modes[0]}"].ask("split")["split"]
            out["conv_share"] = conv_share(split)
        if extras:
            for k, w in workers.items():
                if k.startswith("pytorch"):
                    v = k[len("pytorch "):]
                    out.setdefault("split", {})[k] = split = w.ask("split")["split"]
                    out.setdefault("torch_conv_share", {})[v] = conv_share(split)
    return out


def repeated(runs: list) -> dict:
    """Several whole interleaved runs of ``time_pair`` as one: each step's median of the runs'
    medians, with ``spread`` (the runs' lowest and highest images/s); extras from the first run."""
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, dict) and "s_per_iter" in v:
            med = statistics.median(r[k]["s_per_iter"] for r in runs)
            ips = [r[k]["images_per_s"] for r in runs]
            out[k] = {**v, "s_per_iter": med, "images_per_s": v["images_per_s"] * v["s_per_iter"] / med,
                      "s_best": min(r[k]["s_best"] for r in runs), "spread": (min(ips), max(ips)),
                      "runs": len(runs)}
            faults = [r[k]["faults"] for r in runs if r[k].get("faults") is not None]
            out[k]["faults"] = statistics.median(faults) if faults else None
    return out


def best_pytorch(row: dict):
    """(variant, figures) of the fastest PyTorch variant of a throughput row, or (None, None)."""
    cands = [(k[len("pytorch "):], v) for k, v in row.items()
             if k.startswith("pytorch ") and isinstance(v, dict) and "images_per_s" in v]
    return max(cands, key=lambda kv: kv[1]["images_per_s"]) if cands else (None, None)


# -- suites ----------------------------------------------------------------------------------------
def memory_suite(suite, say) -> list:
    """Peak memory of one step: sncaffe planned per mode; PyTorch counted on the meta device for each
    variant (twin: the Caffe-style replay; idiomatic: as PyTorch users write it, where the net has
    such a form), and with ``verify`` also a real step's allocator peak beside the count."""
    cfg = suite["memory"]
    modes, rows = cfg["modes"], []
    want_torch = torch is not None and "pytorch" in suite["frameworks"]
    variants = cfg.get("pytorch", ["twin", "twin+checkpoint", "idiomatic", "idiomatic+checkpoint"])
    for run in cfg["runs"]:
        name, batch = run["net"], run["batch"]
        param = net_param(suite, name, batch)
        graph = graph_of(param)
        row = {"net": name, "batch": batch, "sncaffe": {m: plan_peak(graph, m) for m in modes}}
        if want_torch:
            row["pytorch"] = {v: t.count() for v, t in pytorch_trainers_on(graph, "meta", variants).items()}
        if run.get("verify"):
            row["sncaffe_measured"] = {m: sncaffe_true_peak(param, m, p, exact=False)
                                       for m, p in row["sncaffe"].items()}
            if want_torch:
                row["pytorch_measured"] = {}
                for v, t in pytorch_trainers_on(graph, "cpu", variants).items():
                    c = t.count(allocator=True)
                    row["pytorch_measured"][v] = {"counted": c["peak"], "allocator": c["allocator"]}
        say(f"  {name} (batch {batch}): " + ", ".join(f"{m} {fmt_bytes(p)}" for m, p in row["sncaffe"].items())
            + "".join(f"; pytorch {v} {fmt_bytes(c['peak'])}" for v, c in row.get("pytorch", {}).items()))
        rows.append(row)
    return rows


def throughput_suite(suite, say) -> dict:
    cfg = suite["throughput"]
    want = torch is not None and "pytorch" in suite["frameworks"]
    want_torch = cfg.get("pytorch", ["twin", "idiomatic"]) if want else []
    rows = []
    for run in cfg["runs"]:
        name, batch = run["net"], run["batch"]
        param = net_param(suite, name, batch)
        r = repeated([time_pair(param, [cfg["sncaffe_mode"]], want_torch, cfg["warmup"], cfg["iterations"], batch,
                                extras=i == 0) for i in range(cfg.get("repeats", 1))])
        rows.append({"net": name, "batch": batch, **r})
        say(f"  {name} (batch {batch}): " + ", ".join(
            f"{k} {v['images_per_s']:.1f} img/s" for k, v in r.items() if isinstance(v, dict) and "images_per_s" in v))
    by_depth = []
    d = cfg.get("depth")
    if d:
        variants = [v for v in d["pytorch"] if want_torch]
        for k in d["k"]:
            param = resnet((3, 4, k, 3), d["batch"], d["image_size"])
            r = time_pair(param, d["sncaffe_modes"], variants, d.get("warmup", 1), d["iterations"], d["batch"],
                          extras=False)
            by_depth.append({"k": k, "depth": depth(k), **r})
            say(f"  ResNet-{depth(k)} (batch {d['batch']}, {d['image_size']}px): " + ", ".join(
                f"{k2} {v['images_per_s']:.2f}" for k2, v in r.items()
                if isinstance(v, dict) and "images_per_s" in v) + " img/s")
    return {"runs": rows, "depth": by_depth}


def scaling_suite(suite, say) -> dict:
    """Two threads (``threads``) against one for each net: sncaffe and PyTorch (``pytorch``, its
    fastest form by default idiomatic) each in a worker of that many threads, stepping on one
    thread and on all of them by turns (sncaffe: ``threads.held``; PyTorch: ``set_num_threads``),
    the two frameworks interleaved: both scale on the same machine in the same minutes, so where a
    shared machine gives a second thread less (its memory bandwidth, a neighbour), it shows in both."""
    cfg = suite["scaling"]
    n = int(cfg.get("threads", 2))
    want = torch is not None and "pytorch" in suite["frameworks"]
    forms = cfg.get("pytorch", "idiomatic")
    forms = [forms] if isinstance(forms, str) else list(forms)
    mode = cfg.get("sncaffe_mode", "none")
    probes = cfg.get("probes", list(PROBES))
    unknown = [p for p in probes if p not in PROBES]
    if unknown:
        raise ValueError(f"scaling: unknown probes {unknown}: give some of {', '.join(PROBES)}")
    if "copy" in probes and not _onednn_in_use():
        probes = [p for p in probes if p != "copy"]       # its kernel is oneDNN's
    rows = []
    for run in cfg["runs"]:
        name, batch = run["net"], run["batch"]
        param = net_param(suite, name, batch)
        specs = {f"sncaffe {mode}": ("sncaffe", mode)}
        specs.update((f"pytorch {v}", ("pytorch", v)) for v in (torch_variants_for(graph_of(param), forms) if want else []))
        specs.update((f"machine {p}", ("machine", p)) for p in probes)
        ran_on = {}         # the threads each worker says its steps ran on

        def step(key, w, t):
            got = w.step(t)
            ran_on[key] = w.last["threads"]
            return got
        with workers_on(param, specs, threads=n) as workers:
            steps = {f"{k} @{t}": (lambda k=k, w=w, t=t: step(f"{k} @{t}", w, t))
                     for k, w in workers.items() for t in (1, n)}
            timed = interleaved(steps, cfg.get("warmup", 1), cfg["iterations"], pause=SETTLE_S)
        row = {"net": name, "batch": batch, "threads": n}
        for k in specs:
            (one, one_best, _), (many, many_best, _) = timed[f"{k} @1"], timed[f"{k} @{n}"]
            row[k] = {"s_one": one, "s_many": many, "speedup": one / many, "speedup_best": one_best / many_best,
                      "ran_on": [ran_on[f"{k} @1"], ran_on[f"{k} @{n}"]]}
        rows.append(row)
        say(f"  {name} (batch {batch}): " + ", ".join(
            f"{k} {v['speedup']:.2f}x" for k, v in row.items() if isinstance(v, dict)) + f" on {n} threads")
    return {"threads": n, "target": cfg.get("target", 1.7), "runs": rows}


def caffe_suite(suite, say) -> dict:
    """Real Caffe's `caffe time` (and outputs given the same .caffemodel), where it is installed."""
    import caffe_baseline
    exe = caffe_baseline.find_caffe()
    if exe is None:
        say("  no `caffe` on PATH: real Caffe skipped")
        return {"skipped": "no `caffe` binary on PATH"}
    cfg = suite["throughput"]
    out = []
    for run in cfg["runs"]:
        param = net_param(suite, run["net"], run["batch"])
        r = caffe_baseline.compare(param, exe, iterations=cfg["iterations"])
        out.append({"net": run["net"], "batch": run["batch"], **r})
        say(f"  {run['net']}: caffe {r.get('images_per_s', float('nan')):.1f} img/s; outputs {r.get('outputs')}")
    return {"caffe": str(exe), "runs": out}


# -- report ----------------------------------------------------------------------------------------
def gib(n):
    return "-" if n is None else f"{n / GiB:.2f}"


def table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def ratios(results) -> list:
    """(what, value, target, met) for each target of the comparison."""
    out = []
    t = results.get("throughput")
    # the targets: 1.1x PyTorch at one thread; at more, no slower than PyTorch at as many
    threads = ((results.get("machine") or {}).get("threads") or {}).get("sncaffe", 1) or 1
    goal = 1.1 if threads == 1 else 1.0
    for r in (t or {}).get("runs", []):
        s = next((v for k, v in r.items() if k.startswith("sncaffe ")), None)
        variant, p = best_pytorch(r)
        if s and p:
            value = s["images_per_s"] / p["images_per_s"]
            out.append((f"throughput {r['net']} (batch {r['batch']}): sncaffe / fastest PyTorch ({variant})",
                        value, f">= {goal:g}", value >= goal))
    sc = results.get("scaling") or {}
    for r in sc.get("runs", []):            # the target: 1.7x the one-thread throughput on two threads
        k = next((k for k in r if k.startswith("sncaffe ")), None)
        if k:
            value = r[k]["speedup"]
            ceiling = ", ".join(f"{p}'s {r[f'machine {p}']['speedup']:.2f}x" for p in PROBES if f"machine {p}" in r)
            out.append((f"scaling {r['net']} (batch {r['batch']}): sncaffe {r['threads']} threads / 1"
                        + (f" (the machine's in the same minutes: {ceiling})" if ceiling else ""), value,
                        f">= {sc['target']:g}", value >= sc["target"]))
    for r in (results.get("caffe") or {}).get("runs", []):
        if r.get("images_per_s"):          # `sncaffe time` against `caffe time`: forward + backward
            value = r["sncaffe_images_per_s"] / r["images_per_s"]
            out.append((f"throughput {r['net']} (batch {r['batch']}): sncaffe / caffe", value, ">= 1", value >= 1))
    return out


def report(results) -> str:
    m = results["machine"]
    parts = [f"Machine: {m['nproc']} cores, {m['cpu']}; Python {m['python']}, NumPy {m['numpy']}, "
             f"PyTorch {m['torch']}; sncaffe's CPU GEMMs: {m.get('sncaffe_blas', '?')}; threads: "
             + ", ".join(f"{k}={v}" for k, v in m["threads"].items())
             + f"; load average {m['loadavg_start']:.2f} at the start, {m.get('loadavg_end', 0):.2f} at the end; "
             f"{results['seconds']:.0f} s in all; the tool's own peak RSS {gib(m.get('peak_rss'))} GiB (each PyTorch "
             "depth runs in a child of its own)."]
    mem = results.get("memory")
    if mem:
        modes = list(mem[0]["sncaffe"])
        variants = list(dict.fromkeys(v for r in mem for v in r.get("pytorch", {})))
        header = ["net", "batch", *[f"sncaffe {x}" for x in modes], *[f"PyTorch {v}" for v in variants]]
        rows = []
        for r in mem:
            cells = [r["net"], r["batch"]]
            for x in modes:
                meas = r.get("sncaffe_measured", {}).get(x)
                cells.append(gib(r["sncaffe"][x]) + ("" if meas is None else " =" if meas == r["sncaffe"][x]
                                                     else f" ({gib(meas)} run)"))
            for v in variants:
                c = r.get("pytorch", {}).get(v)
                meas = r.get("pytorch_measured", {}).get(v)
                cells.append("-" if c is None else gib(c["peak"]) + (
                    "" if meas is None else f" (alloc {gib(meas['allocator'])})"))
            rows.append(cells)
        parts.append("### Peak memory of a training step (GiB)\n\n" + table(header, rows) + (
            "\n\n`=`: a real step on a device of the planned size peaked exactly at the plan; `(x run)`: it "
            "peaked at x (the plan made for that capacity chunks a workspace or evicts a cached copy to pack "
            "its blocks). PyTorch: counted on the meta device; `alloc`: the CPU allocator's peak of a real "
            "step (torch.profiler) beside it. twin: tools/torch_net.py's Caffe-style replay; idiomatic: "
            "tools/torch_idiomatic.py (affine BatchNorm2d, in-place ReLU), where the net has that form."))
    t = results.get("throughput")
    if t and t["runs"]:
        rows = []
        for r in t["runs"]:
            s = next((v for k, v in r.items() if k.startswith("sncaffe ")), {})
            variant, p = best_pytorch(r)
            others = {k[len("pytorch "):]: v for k, v in r.items() if k.startswith("pytorch ") and k[8:] != variant
                      and isinstance(v, dict) and "images_per_s" in v}
            spread = (lambda v: f"{v['spread'][0]:.1f}-{v['spread'][1]:.1f}" if v and "spread" in v else "-")
            loss = r.get("loss") or {}
            rows.append([r["net"], r["batch"], f"{s.get('s_per_iter', 0) * 1e3:.1f}",
                         f"{s.get('images_per_s', 0):.1f} ({spread(s)})",
                         variant or "-", f"{p['images_per_s']:.1f} ({spread(p)})" if p else "-",
                         ", ".join(f"{k} {v['images_per_s']:.1f}" for k, v in others.items()) or "-",
                         f"{s['images_per_s'] / p['images_per_s']:.2f}" if p and s else "-",
                         f"{r['conv_share']:.0%}" if r.get("conv_share") is not None else "-",
                         " / ".join(f"{v['faults']:.0f}" if v and v.get("faults") is not None else "-" for v in (s, p)),
                         " / ".join(f"{loss[k]:.4f}" for k in loss) or "-"])
        n = m["threads"].get("sncaffe", 1)
        parts.append(f"### Training throughput, {n} thread{'s' * (n != 1)} each\n\n" + table(
            ["net", "batch", "sncaffe ms/iter", "sncaffe img/s (spread)", "fastest PyTorch",
             "its img/s (spread)", "other PyTorch img/s", "sncaffe / fastest PyTorch",
             "sncaffe time in conv", "page faults a step: sncaffe / fastest PyTorch",
             "first loss: " + " / ".join(next((r.get("loss") or {} for r in t["runs"]), {}))],
            rows) + f"\n\nEach figure: the median of {next((v['runs'] for v in t['runs'][0].values() if isinstance(v, dict) and 'runs' in v), 1)} whole "
            "interleaved runs (each the median of its iterations); spread: the runs' lowest and highest. Each "
            "framework steps in a process of its own (nothing else in its heap, as for its users), on request of "
            "this one, which interleaves them (on more than one thread 0.1 s apart: the other process's OpenMP "
            "threads stop spinning first); page faults: minor faults of one step in that process (median).")
    if t and any(r.get("split") for r in t["runs"]):
        rows = []
        for r in t["runs"]:
            for who, split in (r.get("split") or {}).items():
                if not split:
                    continue
                sncaffe = who == "sncaffe"
                cells, used = [], set()
                for _, ours, theirs in SPLIT_COLUMNS:
                    keys = ours if sncaffe else theirs
                    used.update(keys)
                    cells.append(f"{sum(split.get(k, 0.0) for k in keys) * 1e3:.1f}")
                rest = sum(v for k, v in split.items() if k not in used)
                rows.append([r["net"], who, f"{sum(split.values()) * 1e3:.1f}", *cells, f"{rest * 1e3:.1f}"])
        parts.append("### Where the time goes (ms of one step, after the timed runs)\n\n" + table(
            ["net", "framework", "total", *[c for c, _, _ in SPLIT_COLUMNS], "other"], rows) +
            "\n\nsncaffe: one forward and backward timed layer by layer (`Net.forward(timings=...)`; no "
            "update); PyTorch: the self CPU time of one training step's aten operators (torch.profiler, "
            "which adds its own overhead), grouped by name: `conv`, `batch_norm` (with its affine: Scale's "
            "work), `relu`/`threshold`/`clamp`, `add`/`sum`, `pool`, `addmm`/`mm`/`linear`, `copy_`/`cat`; "
            "`other` holds the rest (its autograd engine, the loss, the optimizer).")
    sc = results.get("scaling")
    if sc and sc["runs"]:
        n, rows = sc["threads"], []
        for r in sc["runs"]:
            for k, v in r.items():
                if isinstance(v, dict) and "speedup" in v:
                    rows.append([r["net"], r["batch"], k, f"{v['s_one'] * 1e3:.1f}", f"{v['s_many'] * 1e3:.1f}",
                                 f"{v['speedup']:.2f}x", f"{v['speedup_best']:.2f}x"])
        parts.append(f"### {n} threads against one, by turns\n\n" + table(
            ["net", "batch", "framework", "1 thread ms/iter", f"{n} threads ms/iter", "speed-up (medians)",
             "speed-up (fastest steps)"], rows) +
            f"\n\nEach framework in a worker of {n} threads, stepping on one thread and on {n} by turns "
            "(sncaffe: `threads.held`; PyTorch: `torch.set_num_threads`), the frameworks interleaved, 0.1 s "
            "between steps: both scale in the same minutes, so what the machine gives a second thread "
            "shows in both. `machine` rows: probes stepped by turns with them, what the machine gives a "
            "second thread at that time, " + "; ".join(f"{k}: {v}" for k, v in PROBES.items()) + ".")
    if t and t["depth"]:
        keys = [k for k in t["depth"][0] if isinstance(t["depth"][0][k], dict) and "images_per_s" in t["depth"][0][k]]
        rows = [[f"ResNet-{r['depth']}", r["k"], *[f"{r[k]['images_per_s']:.2f}" for k in keys]] for r in t["depth"]]
        parts.append("### Images/s against depth\n\n" + table(["net", "k", *keys], rows))
    c = results.get("caffe")
    if c and c.get("runs"):
        parts.append("### Real Caffe (`caffe time` / `sncaffe time`: forward + backward)\n\n" + table(
            ["net", "batch", "caffe img/s (BLAS)", "sncaffe img/s (BLAS)", "sncaffe img/s on OpenBLAS",
             "outputs, same .caffemodel"],
            [[r["net"], r["batch"], f"{r['images_per_s']:.1f} ({r.get('caffe_blas', '?')})",
              f"{r['sncaffe_images_per_s']:.1f} ({r.get('sncaffe_blas', '?')})",
              f"{r['sncaffe_openblas_images_per_s']:.1f}" if "sncaffe_openblas_images_per_s" in r else "-",
              r["outputs"]] for r in c["runs"]]))
    elif c:
        parts.append(f"Real Caffe: {c.get('skipped')}.")
    rs = ratios(results)
    if rs:
        parts.append("### Ratios and targets\n\n" + table(["ratio", "value", "target", "met"], [
            [w, "inf" if v == math.inf else f"{v:.2f}", tg, {True: "yes", False: "NO", None: "-"}[met]]
            for w, v, tg, met in rs]))
    return "\n\n".join(parts) + "\n"


def plots(results, out: Path) -> list:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []
    t = results.get("throughput")
    if t and t["depth"]:
        fig, ax = plt.subplots(figsize=(8, 5))
        keys = [k for k in t["depth"][0] if isinstance(t["depth"][0][k], dict) and "images_per_s" in t["depth"][0][k]]
        for key in keys:
            ax.plot([r["depth"] for r in t["depth"]], [r[key]["images_per_s"] for r in t["depth"]], marker="o",
                    label=key, ls="--" if key.startswith("pytorch") else "-")
        n = results["machine"]["threads"].get("sncaffe", 1)
        ax.set(xlabel="ResNet depth (blocks [3, 4, k, 3])", ylabel=f"images/s ({n} thread{'s' * (n != 1)})",
               title="Training throughput against depth")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "throughput_vs_depth.png", dpi=120)
        plt.close(fig)
        written.append(out / "throughput_vs_depth.png")
    return written


# The suites in the order they run, by their name in the suite file.
SUITES = {"memory": memory_suite, "throughput": throughput_suite, "scaling": scaling_suite}


def run(suite, out: Path, say=print) -> dict:
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    results = {"machine": machine()}
    th = results["machine"]["threads"]
    say("machine: {nproc} cores, {cpu}; sncaffe's CPU GEMMs: {sncaffe_blas}".format(**results["machine"]))
    say("threads: " + ", ".join(f"{k}={v}" for k, v in th.items()))
    if torch is None:
        say("PyTorch is not installed (pip install torch==2.13.0): its columns are left out")
    for key, fn in SUITES.items():
        if suite.get(key):
            t1 = time.perf_counter()
            say(f"{key}:")
            results[key] = fn(suite, say)
            say(f"  ({time.perf_counter() - t1:.0f} s)")
    if "caffe" in suite["frameworks"] and suite.get("throughput"):
        say("caffe:")
        results["caffe"] = caffe_suite(suite, say)
    results["machine"]["loadavg_end"] = os.getloadavg()[0]
    import resource
    results["machine"]["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    results["seconds"] = time.perf_counter() - t0
    text = report(results)
    (out / "tables.md").write_text(text)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    written = plots(results, out)
    say("\n" + text)
    say("written: " + ", ".join(str(p) for p in [out / "tables.md", out / "results.json", *written]))
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default=str(DEFAULT_SUITE), help="the suites (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="apply the suite file's quick: section")
    ap.add_argument("--out", default="out/compare", help="folder for tables and plots (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="threads of each framework (read before the BLAS "
                                                           "loads; default 1)")
    ap.add_argument("--only", default="", help="comma-separated suites to run of memory, throughput, scaling, "
                                                "(default: all that the suite file has)")
    ap.add_argument("--worker", nargs=3, metavar=("NET_PB", "FRAMEWORK", "KIND"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:             # one framework's steps for a parent's interleaved timing (``Worker``)
        return serve(*args.worker)
    suite = load_suite(args.suite, args.quick)
    if args.only:
        keep = set(args.only.split(","))
        unknown = keep - set(SUITES)
        if unknown:
            ap.error(f"--only: unknown suite(s) {', '.join(sorted(unknown))} ({', '.join(SUITES)})")
        suite = {k: v for k, v in suite.items() if k not in set(SUITES) - keep}
    print(f"python tools/compare.py --suite {args.suite}{' --quick' if args.quick else ''} --threads {args.threads}"
          f"{f' --only {args.only}' if args.only else ''} --out {args.out}")
    run(suite, Path(args.out), say=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
