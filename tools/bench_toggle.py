"""Time one of sncaffe's CPU fast paths on and off, iteration by iteration in one process (not a test).

    python tools/bench_toggle.py --path share-dy [--net prototxt/cifar10_resnet.prototxt] [--batch 128]
                                 [--threads 1] [--iterations 8] [--input 1,28,28] [--cpu-time]

The paths (each is on by default; "off" is what sncaffe ran before it):

- ``share-dy``: a convolution's two backward passes read one copy of dy reordered into oneDNN's
  layout (``onednn.Conv.run_two``); off: each pass reorders its own;
- ``sum``: Eltwise's SUM and Split's backward on oneDNN's binary kernel (``onednn.sum_for``);
  off: NumPy;
- ``binary``: Scale's and BatchNorm's element-wise steps on oneDNN's binary kernel
  (``onednn.binary_for``); off: NumPy;
- ``relu``: ReLU on oneDNN's eltwise kernel (``onednn.relu_for``); off: NumPy;
- ``bn-scale``: a training BatchNorm and the in-place Scale after it run as one (``graph.Fusion``);
  off: each layer on its own;
- ``eltwise-relu``: an Eltwise sum and the in-place ReLU after it run as one
  (``graph.EltwiseReLU``); off: each layer on its own;
- ``sgd-step``: SGD's update of a large parameter in three oneDNN passes (``update.SGD.step``);
  off: NumPy's calls. This one times the solver's update, the others forward + backward;
- ``pooling``: MAX and AVE pooling on oneDNN's kernel (``onednn.Pool``); off: NumPy's taps. The
  two forms plan different workspaces, so they are two nets with the same weights and inputs;
- ``nhwc``: convolutions whose outputs per group do not fill a block of 8 in NHWC
  (``conv_onednn.layout``); off: in oneDNN's own layout. Two nets, as pooling (LeNet:
  ``--net prototxt/lenet_train_test.prototxt --batch 64``);
- ``nchw-1x1``: 1x1 convolutions on x and y as given, NCHW (``conv_onednn.layout``); off: in
  oneDNN's own layout. Two nets, as pooling (``--net prototxt/resnet50.prototxt --batch 2``);
- ``dw-add``: a convolution's weight gradient added into the diff by oneDNN's reorder out of its
  layout (``onednn.Conv.adds``); off: written to the workspace and added by NumPy. Two nets (the
  off form's workspace holds the gradient), the switch also flipped at each iteration.

The machine this was written on is shared and noisy (one process's speed moves by 10-30 % from
run to run), so the two forms alternate every iteration in one process, after one warm-up
iteration each: printed are the median forward + backward milliseconds of each and their ratio
(off / on: above 1, the path pays). Every form gives the same bytes (tests/layers/test_onednn.py,
tests/test_solver.py, tests/layers/test_eltwise_relu.py) but ``bn-scale``'s gradients, which agree to rounding
(tests/layers/test_batchnorm_scale.py).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from unittest.mock import patch

ROOT = Path(__file__).resolve().parents[1]


PATHS = ["share-dy", "sum", "binary", "relu", "bn-scale", "eltwise-relu", "sgd-step", "pooling", "nhwc", "nchw-1x1",
         "dw-add"]


def _switch(path, net):
    """(on, off): two callables that put the path's entry point back or replace it by 'never'; for
    a path whose two forms are only two nets (``_off_net``), nothing to switch."""
    from sncaffe.backend import onednn
    from sncaffe.solvers.update import SGD
    if path in ("bn-scale", "eltwise-relu"):
        from sncaffe.graph import EltwiseReLU, Fusion
        kind = Fusion if path == "bn-scale" else EltwiseReLU

        def turn(state):
            for f in net.graph.fusions:
                if isinstance(f, kind):
                    f.forward, f.backward = state, state and f.on("backward")
        return (lambda: turn(True)), (lambda: turn(False))
    owner, name, never = {
        "sgd-step": (SGD, "step", lambda self, *a: False),
        "share-dy": (onednn.Conv, "_pair", lambda self, *a: None),
        "sum": (onednn, "sum_for", lambda *a, **k: None),
        "binary": (onednn, "binary_for", lambda *a, **k: None),
        "relu": (onednn, "relu_for", lambda *a, **k: None),
        "dw-add": (onednn.Conv, "adds", lambda self, first=None: False),
    }.get(path, (None, None, None))
    if owner is None:
        return (lambda: None), (lambda: None)
    real = getattr(owner, name)
    return (lambda: setattr(owner, name, real)), (lambda: setattr(owner, name, never))


def _off_net(path):
    """(owner, name, value) that turns ``path`` off while the off form's net is built, where the
    two forms plan different nets (workspaces, layouts, kernels), else None."""
    from sncaffe.backend import onednn
    from sncaffe.layers import conv_onednn, pooling
    return {
        "pooling": (pooling, "ONEDNN", False),
        "nhwc": (conv_onednn, "layout", lambda plan, rule=conv_onednn.layout: "any" if rule(plan) == "nhwc"
                 else rule(plan)),
        "nchw-1x1": (conv_onednn, "layout", lambda plan, rule=conv_onednn.layout: "any" if rule(plan) == "nchw"
                     else rule(plan)),
        "dw-add": (onednn.Conv, "adds", lambda self, first=None: False),    # and switched each turn
    }.get(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", required=True, choices=PATHS)
    ap.add_argument("--net", default="prototxt/cifar10_resnet.prototxt")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--input", default="1,28,28", help="C,H,W of the data of a net with data layers (LeNet's)")
    ap.add_argument("--iterations", type=int, default=8, help="timed iterations of each form")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by the process's CPU time (at one thread every kernel runs on the calling thread: "
                         "time other processes hold the core is not counted)")
    args = ap.parse_args(argv)
    clock = time.process_time if args.cpu_time else time.perf_counter
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from sncaffe.backend import onednn
    from sncaffe.backend import runtimes
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.prototxt import DATA_LAYERS, filter_net, read_text, replace_data_layers, set_batch
    from sncaffe.solver import Solver
    runtimes.configure(args.threads)
    if onednn.choice() != "onednn":
        raise SystemExit("oneDNN is not in use (SNCAFFE_CONV=native, or the library is not installed)")
    sp = pb.SolverParameter(base_lr=1e-3, momentum=0.9, weight_decay=5e-4, lr_policy="fixed", type="SGD",
                            max_iter=1 << 30, display=0, random_seed=0, snapshot_after_train=False)
    net = read_text(ROOT / args.net, pb.NetParameter())
    if any(layer.type in DATA_LAYERS for layer in net.layer):     # a train net: Input layers of --input's shape
        net = filter_net(net, "TRAIN")
        data = next(layer for layer in net.layer if layer.type in DATA_LAYERS)
        shape = tuple(int(d) for d in args.input.split(","))
        net = replace_data_layers(net, {data.top[0]: (args.batch,) + shape, data.top[1]: (args.batch,)})
    sp.net_param.CopyFrom(set_batch(net, args.batch))
    sp.memory_param.mode = "none"

    def build():
        solver = Solver(sp, device="cpu")
        rng = np.random.default_rng(0)
        for name in solver.net.inputs:
            blob = solver.net.blobs[name].data
            blob[...] = rng.integers(0, 10, blob.shape) if "label" in name else rng.standard_normal(blob.shape)
        solver.net.forward()
        solver.net.backward()
        if args.path == "sgd-step":
            return solver, solver.apply_update
        return solver, lambda: (solver.net.forward(), solver.net.backward())
    solver, timed = build()
    runs = {"on": timed, "off": timed}
    off_net = _off_net(args.path)
    if off_net is not None:         # the off form plans another net: built with the path turned off
        with patch.object(*off_net):
            runs["off"] = build()[1]
    on, off = _switch(args.path, solver.net)
    forms = {"on": on, "off": off}
    times = {"on": [], "off": []}
    try:
        for i in range(2 * (args.iterations + 1)):
            form = ("on", "off")[i % 2]
            forms[form]()
            t0 = clock()
            runs[form]()
            if i >= 2:                      # the first of each: warm-up
                times[form].append(clock() - t0)
    finally:
        on()
    a, b = (statistics.median(times[f]) * 1e3 for f in ("on", "off"))
    load = os.getloadavg()[0]
    what = "update" if args.path == "sgd-step" else "forward + backward"
    timed_by = "CPU time" if args.cpu_time else "wall clock"
    print(f"{args.net} batch {args.batch}, {args.threads} thread(s), {args.path} ({what}): on {a:.1f} ms, off {b:.1f} ms, "
          f"off/on {b / a:.3f} (median of {args.iterations} each, alternating, {timed_by}; load average {load:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
