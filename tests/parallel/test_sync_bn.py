"""Cross-replica BatchNorm: replicas on cpu:0 and cpu:1 (and MPI ranks) normalize with the batch
statistics of the whole batch, by exchange operators of the graph, and compute one location's bits.

What is bit-equal and what is not: BatchNorm's own arithmetic is (the same per-image sums added in
the same order, mean, variance, running statistics, dx), given the same inputs. A learned
parameter's gradient is summed over each replica's images and then across replicas, where one
location sums over the whole batch at once: float summation order, so after an update the
weights (and what depends on them) agree to rounding, not to the bit.
"""
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from sncaffe.parallel.replicas import Replicas, replicate
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text
from sncaffe.solvers import Solver

LOCATIONS = ["cpu:0", "cpu:1"]
B = 3           # images per replica

# Only elementwise layers around the BatchNorms: their inputs and top diffs are the same bits at
# one location and at the replicas, so whatever differs would be BatchNorm's.
ELEMENTWISE = f"""name: "bn"
layer {{ name: "in" type: "Input" top: "data" top: "target"
  input_param {{ shape {{ dim: {2 * B} dim: 3 dim: 5 dim: 5 }} shape {{ dim: {2 * B} dim: 3 dim: 5 dim: 5 }} }} }}
layer {{ name: "s1" type: "Scale" bottom: "data" top: "s1"
  scale_param {{ filler {{ type: "uniform" min: 0.5 max: 1.5 }} }} }}
layer {{ name: "bn1" type: "BatchNorm" bottom: "s1" top: "s1" }}
layer {{ name: "sc1" type: "Scale" bottom: "s1" top: "s1"
  scale_param {{ bias_term: true filler {{ type: "uniform" min: 0.5 max: 1.5 }} }} }}
layer {{ name: "relu" type: "ReLU" bottom: "s1" top: "s1" }}
layer {{ name: "bn2" type: "BatchNorm" bottom: "s1" top: "bn2" }}
layer {{ name: "loss" type: "EuclideanLoss" bottom: "bn2" bottom: "target" top: "loss" }}
"""

# A small CIFAR-like ResNet piece: conv, BatchNorm, Scale, ReLU, a residual sum, pooling.
CONV = f"""name: "cifar_bn"
layer {{ name: "in" type: "Input" top: "data" top: "label"
  input_param {{ shape {{ dim: {2 * B} dim: 3 dim: 8 dim: 8 }} shape {{ dim: {2 * B} }} }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param {{ num_output: 6 kernel_size: 3 pad: 1 bias_term: false weight_filler {{ type: "msra" }} }} }}
layer {{ name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }}
layer {{ name: "sc1" type: "Scale" bottom: "conv1" top: "conv1" scale_param {{ bias_term: true }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }}
layer {{ name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
  convolution_param {{ num_output: 6 kernel_size: 3 pad: 1 bias_term: false weight_filler {{ type: "msra" }} }} }}
layer {{ name: "bn2" type: "BatchNorm" bottom: "conv2" top: "conv2" }}
layer {{ name: "sc2" type: "Scale" bottom: "conv2" top: "conv2" scale_param {{ bias_term: true }} }}
layer {{ name: "sum" type: "Eltwise" bottom: "conv1" bottom: "conv2" top: "sum" }}
layer {{ name: "relu2" type: "ReLU" bottom: "sum" top: "sum" }}
layer {{ name: "pool" type: "Pooling" bottom: "sum" top: "pool" pooling_param {{ pool: AVE global_pooling: true }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
  inner_product_param {{ num_output: 4 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
"""
BN_LAYERS = ("bn1", "bn2")


def feed(net, iteration):
    rng = np.random.default_rng(iteration)
    data = net.blobs["data"].data
    data[...] = rng.standard_normal(data.shape) * 3 + 1
    if "target" in net.blobs:
        net.blobs["target"].data[...] = rng.standard_normal(data.shape)
    else:
        net.blobs["label"].data[...] = rng.integers(0, 4, data.shape[0])


def make_solver(text, replicas, lr=0.1, mode="none", iter_size=1, iters=3, dtype=np.float64):
    p = pb.SolverParameter(base_lr=lr, momentum=0.9, weight_decay=5e-4, lr_policy="fixed", max_iter=iters,
                           random_seed=7, iter_size=iter_size, snapshot_after_train=False)
    p.memory_param.mode = mode
    param = parse_text(text, pb.NetParameter())
    p.net_param.CopyFrom(replicate(param, LOCATIONS) if replicas else param)
    solver = Solver(p, device="cpu", dtype=dtype)
    solver.feed = feed
    return solver


def replica_blobs(net, name):
    return [net.params[f"{name}@{loc}"] for loc in LOCATIONS]


def joined(net, blob, what):
    return np.concatenate([getattr(net.blobs[f"{blob}@{loc}"], what) for loc in LOCATIONS])


@pytest.mark.parametrize("mode, dtype", [("none", np.float64), ("all", np.float64), ("none", np.float32)])
def test_replicas_batch_norm_computes_one_locations_bits(mode, dtype):
    """Fixed weights, so every input of BatchNorm is the same bits at one location and at the
    replicas: the running statistics after three iterations, and then the normalized tops and
    the bottom diffs of both BatchNorms, are one location's to the bit (float32: the compiled
    per-image sums of backend/fused.py where numba is installed)."""
    one = make_solver(ELEMENTWISE, False, lr=0, mode=mode, dtype=dtype)
    two = make_solver(ELEMENTWISE, True, lr=0, mode=mode, dtype=dtype)
    reps = Replicas(two)
    assert len(reps.batch_norms) == 2
    one.solve()
    two.solve()
    for name in BN_LAYERS:
        for k, blob in enumerate(one.net.params[name]):
            for rep in replica_blobs(two.net, name):
                assert np.array_equal(rep[k].data, blob.data), (name, k)
        assert one.net.params[name][2].data[0] > 0         # the statistics moved
    if mode != "none":
        return                  # activations are transient there: the blobs compared above
    feed(one.net, 9)
    feed(two.net, 9)
    one.net.forward()
    one.net.backward()
    two.net.forward()
    two.net.backward()
    for blob in ("s1", "bn2"):          # bn1's and bn2's tops; their bottom diffs (bn1 in place)
        for what in ("data", "diff"):
            assert np.array_equal(joined(two.net, blob, what), getattr(one.net.blobs[blob], what)), (blob, what)
    reps.close()


def state(solver):
    """{parameter name: [data, history...]} of a solver (state_arrays: the data, then the history)."""
    arrays = solver.state_arrays()
    names = {id(b.data): (name, k) for name, blobs in solver.net.params.items() for k, b in enumerate(blobs)}
    n = next(i for i, a in enumerate(arrays) if id(a) not in names)
    out = {names[id(a)]: [a] for a in arrays[:n]}
    for i, h in enumerate(arrays[n:]):
        out[names[id(arrays[i % n])]].append(h)
    return out


@pytest.mark.parametrize("iter_size", [1, 2])
def test_replicas_with_batch_norm_train_as_one_location(iter_size):
    """Learning: parameters, BatchNorm statistics and history agree with one location at the summed
    batch to rounding (float64), the replicas with each other to the bit; with per-replica
    statistics (the exchange taken out) the statistics are far off."""
    one = make_solver(CONV, False, iter_size=iter_size, iters=4)
    two = make_solver(CONV, True, iter_size=iter_size, iters=4)
    alone = make_solver(CONV, True, iter_size=iter_size, iters=4)
    reps, control = Replicas(two), Replicas(alone)
    assert len(reps.batch_norms) == 2
    for group in control.batch_norms:
        group.detach()
    for s in (one, two, alone):
        s.solve()
    ref, got = state(one), state(two)
    for (name, k), arrays in ref.items():
        a, b = got[(f"{name}@cpu:0", k)], got[(f"{name}@cpu:1", k)]
        assert len(a) == len(arrays) == 2           # data and momentum history
        for x, y, z in zip(arrays, a, b):
            assert np.array_equal(y, z), (name, k)
            np.testing.assert_allclose(y, x, rtol=1e-10, atol=1e-12, err_msg=f"{name}[{k}]")
    for name in BN_LAYERS:
        for k, blob in enumerate(one.net.params[name]):
            for rep in replica_blobs(two.net, name):
                np.testing.assert_allclose(rep[k].data, blob.data, rtol=1e-10, atol=1e-12, err_msg=name)
    # the same check fails with per-replica batch statistics
    off = np.abs(alone.net.params["bn1@cpu:0"][1].data - one.net.params["bn1"][1].data).max()
    assert off > 1e-3
    reps.close()
    control.close()


def test_the_exchanges_are_operators_in_the_dispatchers_record():
    """Each BatchNorm's exchanges run on cpu:0's exchange stream, two in forward, one in backward; every
    replica's next stage runs on its own location after the exchange has finished."""
    two = make_solver(CONV, True, iters=1)
    reps = Replicas(two)
    record = two.net.executor.record = []
    two.solve()
    reps.close()
    names = [r["name"] for r in record]
    for bn in BN_LAYERS:
        exchanges = [r for r in record if r["name"].startswith(f"exchange {bn}'s ")]
        assert [r["name"] for r in exchanges] == [f"exchange {bn}'s batch sums", f"exchange {bn}'s batch squares",
                                                 f"exchange {bn}'s gradient sums"]
        assert all((r["location"], r["stream"]) == ("cpu:0", "exchange") for r in exchanges)
        for loc in LOCATIONS:
            before = [f"{bn}@{loc}:forward", f"{bn}@{loc}:forward center", f"{bn}@{loc}:backward"]
            after = [f"{bn}@{loc}:forward center", f"{bn}@{loc}:forward normalize", f"{bn}@{loc}:backward grad input"]
            for first, then, exchange in zip(before, after, exchanges):
                first, then = record[names.index(first)], record[names.index(then)]
                assert (then["location"], then["stream"]) == (loc, "compute")
                assert first["event"].end <= exchange["event"].start        # its sums went in
                assert then["event"].start >= exchange["event"].end         # it waited for the exchange
    # taken out again: the operators are whole
    record.clear()
    two.net.forward()
    assert not any(r["name"].startswith("exchange ") for r in record)


# -- over MPI ranks: 2 ranks at B are one rank at 2B ----------------------------------------

MPIEXEC = Path(sys.executable).parent / "mpiexec"
try:
    import mpi4py  # noqa: F401
    reason = None if MPIEXEC.exists() else f"no mpiexec beside {sys.executable} (pip install 'sncaffe[mpi]')"
except ImportError:
    reason = "mpi4py is not installed (pip install 'sncaffe[mpi]')"

MPI_LAYERS = """
layer { name: "s1" type: "Scale" bottom: "data" top: "s1" scale_param { filler { type: "constant" value: 1.5 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "s1" top: "s1" }
layer { name: "sc1" type: "Scale" bottom: "s1" top: "s1" scale_param { bias_term: true } }
layer { name: "relu" type: "ReLU" bottom: "s1" top: "s1" }
layer { name: "conv" type: "Convolution" bottom: "s1" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "msra" } } }
layer { name: "bn2" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip" inner_product_param { num_output: 4
  weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@pytest.mark.skipif(reason is not None, reason=reason or "")
@pytest.mark.parametrize("lr", [0, 0.05])
def test_two_ranks_batch_norm_statistics_are_one_ranks_at_twice_the_batch(tmp_path, lr):
    """Fixed weights (base_lr 0): the running statistics of 2 ranks at batch 4 are those of 1 rank
    at 8 to the bit; with per-rank statistics they would be rank 0's half-batch's. Learning: the
    weights agree to rounding (BatchNorm's backward reduced over the ranks too)."""
    from sncaffe import blobproto
    rng = np.random.default_rng(0)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["data"] = (rng.standard_normal((48, 3, 6, 6)) * 2 + 1).astype(np.float32)
        f["label"] = rng.integers(0, 4, 48).astype(np.float32)
    (tmp_path / "list.txt").write_text("d.h5\n")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    for ranks, batch in ((1, 8), (2, 4)):
        (tmp_path / f"n{ranks}.prototxt").write_text(
            f'name: "bn"\nlayer {{ name: "d" type: "HDF5Data" top: "data" top: "label" '
            f'hdf5_data_param {{ source: "list.txt" batch_size: {batch} }} }}\n' + MPI_LAYERS)
        (tmp_path / f"s{ranks}.prototxt").write_text(
            f'net: "n{ranks}.prototxt" base_lr: {lr} momentum: 0.9 lr_policy: "fixed" max_iter: 4 '
            f'snapshot_after_train: true snapshot_prefix: "out{ranks}/snap" random_seed: 7\n')
        (tmp_path / f"out{ranks}").mkdir()
        cmd = [str(MPIEXEC), "-n", str(ranks), sys.executable, "-m", "sncaffe.cli", "train", f"s{ranks}.prototxt"]
        out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]

    def weights(path):
        return {(lp.name, i): np.asarray(b.data) for lp in blobproto.read_caffemodel(path).layer
                for i, b in enumerate(lp.blobs)}
    one, two = weights(tmp_path / "out1/snap_iter_4.caffemodel"), weights(tmp_path / "out2/snap_iter_4.caffemodel")
    assert one.keys() == two.keys()
    for key in one:
        np.testing.assert_allclose(two[key], one[key], rtol=1e-5, atol=1e-6, err_msg=str(key))
    if lr == 0:                 # bn2's input is a convolution's: its GEMM may round the last image apart
        for k in range(3):
            assert np.array_equal(two["bn1", k], one["bn1", k]), k


def test_the_dispatchers_record_of_pending_work_stays_bounded():
    """Two locations: every operator goes to a worker and joins the dispatcher's list of work that
    may be pending (runtime/dispatcher.py); the list is pruned as it grows, not kept for ever."""
    solver = make_solver(ELEMENTWISE, True, iters=40)
    reps = Replicas(solver)
    solver.solve()
    ex = solver.net.executor
    assert ex.threaded and len(ex._async) < 40 * len(solver.net.graph.ops) // 4
    reps.close()                        # waits for everything: nothing is pending any more
    assert not ex._pending_async() and ex._async == []
