"""Data-parallel training: the solver hooks in one process, then real jobs under the venv's own mpiexec.

Every job is a real ``mpiexec -n N sncaffe train`` with a timeout: N ranks at
batch B equal one at N*B, a failing or killed rank ends the job, the trace
shows all-reduce behind backward. Skipped with a reason where mpi4py or the
venv's mpiexec (the ``mpi`` extra) is missing.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from sncaffe import blobproto
from sncaffe.data import datum as datums
from sncaffe.data.db import LMDBWriter
from sncaffe.parallel import overlap
from sncaffe.sizes import parse_bytes

MPIEXEC = Path(sys.executable).parent / "mpiexec"
try:
    from mpi4py import MPI
    reason = None if MPIEXEC.exists() else f"no mpiexec beside {sys.executable} (pip install 'sncaffe[mpi]')"
except ImportError:
    MPI, reason = None, "mpi4py is not installed (pip install 'sncaffe[mpi]')"
needs_mpi4py = pytest.mark.skipif(MPI is None, reason="mpi4py is not installed (pip install 'sncaffe[mpi]')")
needs_mpiexec = pytest.mark.skipif(reason is not None, reason=reason or "")

ENV = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")

LAYERS = """
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 8 kernel_size: 3 weight_filler { type: "xavier" }
                      bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool" top: "ip1"
  inner_product_param { num_output: 16 weight_filler { type: "xavier" } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu2" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2" inner_product_param { num_output: 4
  weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""
SOLVER = """net: "{net}"
base_lr: 0.05 momentum: 0.9 weight_decay: 0.0005 lr_policy: "fixed"
max_iter: {iters} display: 5 snapshot_after_train: true snapshot_prefix: "{prefix}" random_seed: 7
"""


def train(ranks, args, cwd, timeout=60, check=True):
    cmd = [str(MPIEXEC), "-n", str(ranks), sys.executable, "-m", "sncaffe.cli", "train", *map(str, args)]
    out = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode:
        raise AssertionError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out


def weights(path):
    return {(lp.name, i): np.asarray(b.data) for lp in blobproto.read_caffemodel(path).layer
            for i, b in enumerate(lp.blobs)}


def assert_same_weights(a, b, rtol=1e-5):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and wa
    for k in wa:
        err = np.linalg.norm(wa[k] - wb[k]) / np.linalg.norm(wb[k])
        assert err <= rtol, f"{k}: relative difference {err:.2e}"


def solver(tmp, name, data_layer, iters=20):
    (tmp / f"{name}.prototxt").write_text(f'name: "tiny"\n{data_layer}\n{LAYERS}')
    path = tmp / f"{name}_solver.prototxt"
    path.write_text(SOLVER.format(net=f"{name}.prototxt", iters=iters, prefix=f"out_{name}/snap"))
    (tmp / f"out_{name}").mkdir(exist_ok=True)
    return path.name


def hdf5_layer(batch):
    return (f'layer {{ name: "d" type: "HDF5Data" top: "data" top: "label" '
            f'hdf5_data_param {{ source: "list.txt" batch_size: {batch} shuffle: true }} }}')


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mpi")
    rng = np.random.default_rng(0)
    with h5py.File(tmp / "d.h5", "w") as f:
        f["data"] = rng.standard_normal((48, 1, 10, 10)).astype(np.float32)
        f["label"] = rng.integers(0, 4, 48).astype(np.float32)
    (tmp / "list.txt").write_text("d.h5\n")
    return tmp


# -- in one process: the hooks, with a communicator of one rank -----------------

def in_process_solver(iter_size=1, host_params=False, device="cpu"):
    from sncaffe.data.synthetic import SyntheticInputs
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.prototxt import parse_text
    from sncaffe.solvers import Solver
    text = ('name: "tiny" layer { name: "in" type: "Input" top: "data" top: "label" '
            'input_param { shape { dim: 4 dim: 1 dim: 10 dim: 10 } shape { dim: 4 } } }' + LAYERS)
    p = pb.SolverParameter(base_lr=0.05, momentum=0.9, weight_decay=5e-4, lr_policy="fixed", max_iter=6,
                           random_seed=7, iter_size=iter_size, snapshot_after_train=False)
    p.memory_param.host_params = host_params
    p.net_param.CopyFrom(parse_text(text, pb.NetParameter()))
    solver = Solver(p, device=device)
    solver.feed = SyntheticInputs(1)
    return solver


@needs_mpi4py
@pytest.mark.parametrize("iter_size, host_params", [(1, False), (2, False), (1, True)])
def test_one_rank_data_parallel_trains_exactly_as_without(iter_size, host_params):
    from sncaffe.parallel import DataParallel
    plain, parallel = in_process_solver(iter_size, host_params), in_process_solver(iter_size, host_params)
    parallel.feed.shard = None              # DataParallel must set it
    dp = DataParallel(parallel, MPI.COMM_SELF, bucket_bytes=600)
    assert len(dp.buckets) == 3 and parallel.feed.shard == (0, 1)
    # no hook replaced: the all-reduce operators are in the backward schedule, after their producers
    assert parallel.net.step_hook is None and parallel.before_update is None
    backward = parallel.net.plan.schedule.backward
    kinds = [ins.kind for ins in backward]
    assert kinds.count("collective") == 3
    for ins in dp.instructions:
        k = next(i for i, x in enumerate(backward) if x is ins)
        last = max(i for i, x in enumerate(backward) if x.kind == "run" and x.op.node.name in ins.op.bucket.layers)
        assert last < k
    plain.solve()
    parallel.solve()
    dp.close()
    assert "collective" not in [ins.kind for ins in parallel.net.plan.schedule.backward]
    for q, r in zip(plain._learnable, parallel._learnable):
        np.testing.assert_array_equal(q.blob.data, r.blob.data)


@needs_mpi4py
def test_an_update_without_a_full_backward_is_an_error():
    from sncaffe.parallel import DataParallel
    solver = in_process_solver()
    dp = DataParallel(solver, MPI.COMM_SELF)
    solver.net.forward()
    with pytest.raises(RuntimeError, match="bucket 0 .* was not all-reduced in iteration 0"):
        dp.wait()
    dp.close()


def test_a_collective_that_does_not_finish_times_out():
    """An all-reduce operator that outlasts its timeout ends the pass with CommTimeout; one that
    fails raises its error; the comm stream goes on."""
    from types import SimpleNamespace

    from sncaffe.backend import CPUDevice
    from sncaffe.graph import Tensor
    from sncaffe.runtime.dispatcher import Dispatcher
    from sncaffe.plan.schedule import Instr
    from sncaffe.parallel.data_parallel import CommTimeout, comm_timeout
    device = CPUDevice("1MiB")
    ex = Dispatcher(device, {}, lambda *a: None)
    grad = Tensor("g", (4,), np.dtype(np.float32), "param_diff")
    ex.alloc(grad, fill=0, persistent=True)

    def op(name, work, timeout):
        return SimpleNamespace(name=name, tensors=[grad], location="", nbytes=16, timeout=timeout,
                               before=lambda ready=None: None, run=lambda arrays, token: work(),
                               timed_out=lambda: comm_timeout(name, timeout))
    with pytest.raises(CommTimeout, match="bucket 3 did not finish within 0.05 s: another rank"):
        ex.execute([Instr("collective", op=op("all-reduce of gradient bucket 3", lambda: time.sleep(0.5), 0.05))])
    with pytest.raises(ZeroDivisionError):
        ex.execute([Instr("collective", op=op("x", lambda: 1 / 0, 5))])
    ex.stream("", "comm").submit(lambda: None).wait(5)


@needs_mpi4py
def test_the_trace_of_one_iteration_has_the_all_reduce(tmp_path):
    from sncaffe.parallel import DataParallel, IterationTrace
    solver = in_process_solver()
    dp = DataParallel(solver, MPI.COMM_SELF, bucket_bytes=600)
    tracer = IterationTrace(solver, tmp_path / "t.json", 2)
    solver.step(4)
    dp.close()
    streams = [s for s, *_ in tracer.spans]
    assert streams.count("comm") == 3 and streams.count("compute") == 8 + 7 + 2   # and the wait, the update
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert solver.net.executor.trace is None         # one iteration only


def gpu_reason():
    from sncaffe.backend.cuda import cuda_usable
    from sncaffe.parallel.nccl import nccl_available
    if MPI is None:
        return "mpi4py is not installed"
    if not cuda_usable():
        return "no GPU usable by CuPy"
    return None if nccl_available() else "CuPy cannot load NCCL (pip install nvidia-nccl-cu12)"


@pytest.mark.skipif(gpu_reason() is not None, reason=str(gpu_reason()))
def test_nccl_one_rank_trains_as_without_on_the_gpu():
    from sncaffe.backend import make_device
    from sncaffe.parallel import DataParallel
    device = make_device("cuda", "1GiB")
    plain, parallel = in_process_solver(device=device), in_process_solver(device=device)
    dp = DataParallel(parallel, MPI.COMM_SELF, bucket_bytes=600)
    assert dp.reducer.name == "NCCL" and len(dp.buckets) == 3
    plain.solve()
    parallel.solve()
    dp.close()
    for q, r in zip(plain._learnable, parallel._learnable):
        np.testing.assert_allclose(r.blob.data.get(), q.blob.data.get(), rtol=1e-6, atol=1e-7)


def test_without_mpi4py_one_process_trains_and_mpiexec_says_what_to_install(tmp_path):
    net = tmp_path / "n.prototxt"
    net.write_text('name: "tiny"\nlayer { name: "in" type: "Input" top: "data" top: "label" input_param { '
                   'shape { dim: 2 dim: 1 dim: 10 dim: 10 } shape { dim: 2 } } }\n' + LAYERS)
    run = ("import sys; sys.modules['mpi4py'] = None; from sncaffe.cli import main; "
           f"sys.exit(main(['train', {str(net)!r}, '--max-iter', '2', '--snapshot-prefix', {str(tmp_path)!r} + '/']))")
    env = {k: v for k, v in ENV.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_", "MPI_LOCAL"))}
    out = subprocess.run([sys.executable, "-c", run], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Optimization Done." in out.stdout, out.stderr
    out = subprocess.run([sys.executable, "-c", run], env=dict(env, PMI_RANK="0", PMI_SIZE="2"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "needs mpi4py" in out.stderr and "pip install 'sncaffe[mpi]'" in out.stderr, out.stderr


# -- jobs under mpiexec ------------------------------------------------------------

@needs_mpiexec
def test_two_ranks_at_batch_b_equal_one_rank_at_2b_hdf5(tmp):
    one, two = solver(tmp, "one", hdf5_layer(8)), solver(tmp, "two", hdf5_layer(4))
    alone = train(1, [one], tmp)
    out = train(2, [two, "--bucket-mb", "0.001"], tmp)          # several buckets
    assert "Data parallel: 2 ranks, batch 4 per rank (8 in all); 3 gradient buckets" in out.stdout
    assert out.stdout.count("Optimization Done.") == 1          # rank 0 alone logs
    # the two ranks on this machine split its RAM: each plans within half of what one rank has
    assert "RAM: 2 ranks on this machine, each planned within 1/2 of what it has free" in out.stdout

    def ram(text):
        return parse_bytes(re.search(r"memory plan .* of ([0-9.]+ [KMGT]?i?B) RAM", text).group(1))
    assert ram(out.stdout) < 0.75 * ram(alone.stdout), (ram(out.stdout), ram(alone.stdout))
    assert_same_weights(tmp / "out_two/snap_iter_20.caffemodel", tmp / "out_one/snap_iter_20.caffemodel")


@needs_mpiexec
def test_two_ranks_equal_one_with_synthetic_inputs(tmp):
    net = tmp / "input.prototxt"
    net.write_text('name: "tiny"\nlayer { name: "in" type: "Input" top: "data" top: "label" '
                   'input_param { shape { dim: 8 dim: 1 dim: 10 dim: 10 } shape { dim: 8 } } }\n' + LAYERS)
    common = [net.name, "--max-iter", "20", "--seed", "3"]
    train(1, common + ["--batch", "8", "--snapshot-prefix", "out_in1/"], tmp)
    train(2, common + ["--batch", "4", "--snapshot-prefix", "out_in2/"], tmp)
    assert_same_weights(tmp / "out_in2/input_iter_20.caffemodel", tmp / "out_in1/input_iter_20.caffemodel")


@needs_mpiexec
def test_a_failing_rank_stops_the_job_with_its_message(tmp):
    # Records 20..23 go to rank 1 in the third global batch of 8; record 21 is not a Datum,
    # and rank 0 never parses it.
    xs = np.random.default_rng(1).integers(0, 256, (32, 1, 10, 10), dtype=np.uint8)
    with LMDBWriter(tmp / "lmdb") as db:
        for i, x in enumerate(xs):
            db.put(f"{i:08d}", b"\xff\xff not a datum" if i == 21 else
                   datums.from_array(x, i % 4).SerializeToString())
    layer = ('layer { name: "d" type: "Data" top: "data" top: "label" transform_param { scale: 0.0039 } '
             'data_param { source: "lmdb" batch_size: 4 backend: LMDB } }')
    out = train(2, [solver(tmp, "bad", layer, iters=1000)], tmp, timeout=60, check=False)   # a hang times out
    assert out.returncode != 0
    assert "sncaffe train: rank 1 of 2: error:" in out.stderr and "00000021" in out.stderr, out.stdout + out.stderr


def _rank_pid(root, rank):
    """The pid of the rank ``rank`` under process ``root`` (from /proc: children, PMI_RANK)."""
    children = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p.name))
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            env = []
        if f"PMI_RANK={rank}".encode() in env and pid != root:
            return pid
        todo += children.get(pid, [])
    return None


@needs_mpiexec
def test_a_killed_rank_ends_the_job_within_seconds(tmp):
    cmd = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "sncaffe.cli", "train",
           solver(tmp, "killed", hdf5_layer(4), iters=10**6)]
    job = subprocess.Popen(cmd, cwd=tmp, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in job.stdout:                    # training has started on every rank
            if "Iteration 10," in line:
                break
        pid = _rank_pid(job.pid, 1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        rest = job.communicate(timeout=60)[0]      # a job that never ends fails here; no bound on speed
        assert job.returncode != 0
        assert "signal 9" in rest or "Killed" in rest, rest[-2000:]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(10)


def _trace_spans(path):
    """A Chrome trace's spans as (stream, name, start s, end s)."""
    events = json.loads(path.read_text())["traceEvents"]
    streams = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    return [(streams[e["tid"]], e["name"], e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6)
            for e in events if e["ph"] == "X"]


@needs_mpiexec
def test_trace_shows_all_reduce_overlapping_backward(tmp):
    # A convolution whose backward (milliseconds) outlasts the first buckets' all-reduce.
    net = tmp / "big.prototxt"
    net.write_text('name: "big"\nlayer { name: "in" type: "Input" top: "data" top: "label" input_param { '
                   'shape { dim: 8 dim: 1 dim: 128 dim: 128 } shape { dim: 8 } } }\n'
                   + LAYERS.replace("num_output: 8 kernel_size: 3", "num_output: 32 kernel_size: 5"))
    path = tmp / "trace.json"
    out = train(2, [net.name, "--max-iter", "4", "--bucket-mb", "0.001", "--snapshot-prefix", "out_big/",
                    "--trace", path.name, "--trace-iter", "2"], tmp)
    assert "Trace of iteration 2 written" in out.stdout
    spans = _trace_spans(path)
    names = {(s, n) for s, n, _, _ in spans}
    assert {("compute", "conv:backward"), ("compute", "update"), ("compute", "wait for the all-reduce")} <= names
    assert sum(s == "comm" for s, *_ in spans) == int(re.search(r"(\d+) gradient buckets", out.stdout)[1]) > 1
    o = overlap(spans)
    assert o["comm_s"] > 0 and o["hidden_s"] > 0, o


@needs_mpiexec
def test_batch_norm_all_gathers_run_on_each_ranks_compute_stream(tmp):
    """A cross-replica BatchNorm's all-gathers of batch sums run on the rank's compute stream, the
    thread that waits for them (parallel/sync_bn.py), three per layer an iteration, between the
    stages they join; the trace counts them apart from the gradient exchange."""
    net = tmp / "bn.prototxt"
    net.write_text('name: "bn"\nlayer { name: "in" type: "Input" top: "data" top: "label" input_param { '
                   'shape { dim: 8 dim: 1 dim: 10 dim: 10 } shape { dim: 8 } } }\n'
                   + LAYERS.replace('layer { name: "relu" type: "ReLU"',
                                    'layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }\n'
                                    'layer { name: "relu" type: "ReLU"'))
    path = tmp / "bn_trace.json"
    out = train(2, [net.name, "--max-iter", "3", "--batch", "4", "--snapshot-prefix", "out_bn/",
                    "--trace", path.name, "--trace-iter", "2"], tmp)
    assert "Trace of iteration 2 written" in out.stdout
    spans = sorted(_trace_spans(path), key=lambda s: s[2])
    exchanges = [s for s in spans if s[1].startswith("exchange bn's ")]
    assert [(s[0], s[1]) for s in exchanges] == [("compute", "exchange bn's batch sums"),
                                                 ("compute", "exchange bn's batch squares"),
                                                 ("compute", "exchange bn's gradient sums")]
    names = [s[1] for s in spans if s[0] == "compute"]
    for stage, exchange, then in (("bn:forward", "batch sums", "bn:forward center"),
                                  ("bn:forward center", "batch squares", "bn:forward normalize"),
                                  ("bn:backward", "gradient sums", "bn:backward grad input")):
        i = names.index(f"exchange bn's {exchange}")
        assert names[i - 1] == stage and names[i + 1] == then, names
    assert overlap(spans)["statistics_s"] > 0
