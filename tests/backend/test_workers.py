"""The kernel threads (backend/workers.py): the split itself, and every split layer computing
the same bits on two threads as on one (pieces forced down to a few elements, so even these
small tensors split)."""
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from sncaffe import Net, config
from sncaffe.backend import threads, workers
from sncaffe.backend.cpu import CPUDevice
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text, read_text, set_batch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def two_threads(monkeypatch):
    """A budget of two, every tensor split into pieces (GEMMs keep the process's own BLAS);
    returns the list of the split calls' thread counts, to show the pieces ran."""
    counts = []
    sized = workers.threads_for

    # oneDNN's convolutions split a weight gradient's batch over their OpenMP threads, so their
    # bits follow the thread count (as a threaded GEMM's may); these tests are about the layers
    # sncaffe splits itself, so convolutions run on sncaffe's own kernels
    monkeypatch.setattr(config, "settings", replace(config.settings, conv="native"))

    def use():
        monkeypatch.setattr(threads, "_decision", threads.Decision(2, 2, "--threads"))
        monkeypatch.setattr(config, "settings", replace(config.settings, kernel_threads=2))
        monkeypatch.setattr(workers, "ELEMENTS_PER_THREAD", 1)
        monkeypatch.setattr(workers, "threads_for", lambda work, n: counts.append(sized(work, n)) or counts[-1])
        return counts
    return use


def test_split_covers_the_range_once_on_both_threads(monkeypatch):
    monkeypatch.setattr(threads, "_decision", threads.Decision(2, 2, "--threads"))
    monkeypatch.setattr(config, "settings", replace(config.settings, kernel_threads=2))
    seen, names = [], set()
    main = threading.current_thread()
    arrived = {True: threading.Event(), False: threading.Event()}       # by "is the caller"

    def fn(rows):
        seen.extend(range(rows.start, rows.stop))
        names.add(threading.current_thread().name)
        mine = threading.current_thread() is main
        if not arrived[mine].is_set():      # each thread's first piece lasts until the other has
            arrived[mine].set()             # taken one, however late a loaded machine starts it
            arrived[not mine].wait(60)
    workers.split(37, 37 * workers.ELEMENTS_PER_THREAD, fn)
    assert sorted(seen) == list(range(37))
    assert len(names) == 2
    seen.clear()
    workers.split(37, workers.ELEMENTS_PER_THREAD - 1, fn)      # too little work: one call
    assert seen == list(range(37))


def test_kernels_stay_on_the_calling_thread_unless_asked(monkeypatch):
    """The default (see workers' doc: on this machine a second kernel thread cost more than it
    gave): one call, on the calling thread, however large the work and the budget."""
    monkeypatch.setattr(threads, "_decision", threads.Decision(2, 2, "--threads"))
    monkeypatch.setattr(config, "settings", replace(config.settings, kernel_threads=1))
    calls = []
    workers.split(37, 37 * workers.ELEMENTS_PER_THREAD, lambda rows: calls.append((rows, threading.current_thread())))
    assert calls == [(slice(0, 37), threading.current_thread())]


def test_kernel_threads_come_from_the_environment():
    for text, want in (("3", 3), ("0", 1), ("many", 1)):
        assert config.from_environment({"SNCAFFE_KERNEL_THREADS": text}).kernel_threads == want
    assert config.from_environment({}).kernel_threads == 1


def test_sizing_follows_the_budget_and_the_work(monkeypatch):
    monkeypatch.setattr(threads, "_decision", threads.Decision(4, 4, "--threads"))
    monkeypatch.setattr(config, "settings", replace(config.settings, kernel_threads=4))
    step = workers.ELEMENTS_PER_THREAD
    assert [workers.threads_for(w, 100) for w in (0, step - 1, 2 * step, 3.5 * step, 100 * step)] == [1, 1, 2, 3, 4]
    assert workers.threads_for(100 * step, 2) == 2          # never more pieces than rows
    assert workers.chunks(10, 3) == [slice(0, 3), slice(3, 6), slice(6, 10)]


def test_an_error_in_a_piece_reaches_the_caller_once_no_piece_runs(monkeypatch):
    monkeypatch.setattr(threads, "_decision", threads.Decision(2, 2, "--threads"))
    monkeypatch.setattr(config, "settings", replace(config.settings, kernel_threads=2))
    started, finished = [], []

    def fn(rows):
        started.append(rows.start)
        if rows.start == 0:
            raise ValueError("bad piece")
        threading.Event().wait(0.002)
        finished.append(rows.start)
    with pytest.raises(ValueError, match="bad piece"):
        workers.split(8, 8 * workers.ELEMENTS_PER_THREAD, fn)
    assert sorted(finished) == sorted(started)[1:]      # what the other thread began, it ended


def test_a_split_inside_a_piece_runs_inline(monkeypatch):
    """A piece that splits again runs that split on its own thread: the pool's threads may all
    be busy with the outer pieces, and waiting on them would never end."""
    monkeypatch.setattr(threads, "_decision", threads.Decision(2, 2, "--threads"))
    monkeypatch.setattr(config, "settings", replace(config.settings, kernel_threads=2))
    seen = []
    piece = threading.Thread(target=workers.split, name=workers._PREFIX + "_0",
                             args=(4, 4 * workers.ELEMENTS_PER_THREAD, lambda rows: seen.append(rows)))
    piece.start()
    piece.join(timeout=30)
    assert not piece.is_alive() and seen == [slice(0, 4)]


def test_elementwise_flattens_contiguous_arrays_and_passes_none(monkeypatch):
    monkeypatch.setattr(threads, "_decision", threads.Decision(2, 2, "--threads"))
    monkeypatch.setattr(config, "settings", replace(config.settings, kernel_threads=2))
    monkeypatch.setattr(workers, "ELEMENTS_PER_THREAD", 1)
    x = np.arange(12, dtype=np.float32).reshape(1, 3, 4)       # a batch of one still splits
    y = np.empty_like(x)
    pieces = []

    def fn(a, none, b):
        assert none is None and a.ndim == 1
        pieces.append(a.size)
        np.negative(a, out=b)
    workers.elementwise(fn, x, None, y)
    assert np.array_equal(y, -x) and len(pieces) > 1


# Every layer type the workers split, each with a gradient, in one small net.
LAYERS = """
name: "split_layers"
force_backward: true
layer { name: "in" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 3 dim: 5 dim: 9 dim: 9 } shape { dim: 3 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 6 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "conv_s2" type: "Convolution" bottom: "data" top: "conv_s2"
        convolution_param { num_output: 6 kernel_size: 3 stride: 2 pad: 1 bias_term: false weight_filler { type: "xavier" } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "scale" type: "Scale" bottom: "conv" top: "conv" scale_param { bias_term: true } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "leaky" type: "ReLU" bottom: "conv_s2" top: "leaky" relu_param { negative_slope: 0.1 } }
layer { name: "bn_global" type: "BatchNorm" bottom: "leaky" top: "bn_global" batch_norm_param { use_global_stats: true } }
layer { name: "maxpool" type: "Pooling" bottom: "conv" top: "maxpool" pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "avepool" type: "Pooling" bottom: "conv" top: "avepool" pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "sum" type: "Eltwise" bottom: "maxpool" bottom: "bn_global" top: "sum" eltwise_param { coeff: 1 coeff: -0.5 } }
layer { name: "prod" type: "Eltwise" bottom: "sum" bottom: "maxpool" top: "prod" eltwise_param { operation: PROD } }
layer { name: "max" type: "Eltwise" bottom: "prod" bottom: "avepool" top: "max" eltwise_param { operation: MAX } }
layer { name: "lrn" type: "LRN" bottom: "max" top: "lrn" lrn_param { local_size: 3 alpha: 0.5 beta: 0.75 } }
layer { name: "lrn_within" type: "LRN" bottom: "lrn" top: "lrn_within" lrn_param { local_size: 3 norm_region: WITHIN_CHANNEL } }
layer { name: "elu" type: "ELU" bottom: "lrn_within" top: "elu" }
layer { name: "sigmoid" type: "Sigmoid" bottom: "elu" top: "sigmoid" }
layer { name: "tanh" type: "TanH" bottom: "sum" top: "tanh" }
layer { name: "power" type: "Power" bottom: "tanh" top: "power" power_param { power: 2 shift: 1 } }
layer { name: "concat" type: "Concat" bottom: "sigmoid" bottom: "power" top: "concat" }
layer { name: "gpool" type: "Pooling" bottom: "concat" top: "gpool" pooling_param { pool: MAX global_pooling: true } }
layer { name: "gave" type: "Pooling" bottom: "concat" top: "gave" pooling_param { pool: AVE global_pooling: true } }
layer { name: "softmax" type: "Softmax" bottom: "concat" top: "softmax" }
layer { name: "ip" type: "InnerProduct" bottom: "softmax" top: "ip" inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "ip2" type: "InnerProduct" bottom: "gpool" top: "ip2" inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "ip3" type: "InnerProduct" bottom: "gave" top: "ip3" inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "all" type: "Eltwise" bottom: "ip" bottom: "ip2" bottom: "ip3" top: "all" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "all" bottom: "label" top: "loss" }
"""


def _step(param, memory="none", dtype=None):
    """Forward and backward of a fresh net: every blob's data and diff, every param's diff."""
    net = Net(param, "TRAIN", device=CPUDevice(256 << 20), seed=0, memory=memory)
    rng = np.random.default_rng(1)
    for name in net.inputs:
        blob = net.blobs[name].data
        blob[...] = rng.integers(0, 4, blob.shape) if name == "label" else rng.standard_normal(blob.shape)
    net.forward()
    net.backward()
    out = {f"{k}.data": b.data.copy() for k, b in net.blobs.items() if b.data is not None}
    out.update({f"{k}.diff": b.diff.copy() for k, b in net.blobs.items() if b.diff is not None})
    out.update({f"{k}.{i}": p.diff.copy() for k, ps in net.params.items() for i, p in enumerate(ps)
                if p.diff is not None})
    out.update({f"{k}.{i}.data": p.data.copy() for k, ps in net.params.items() for i, p in enumerate(ps)})
    return out


def _same_bits(one, two):
    assert one.keys() == two.keys()
    differ = [k for k in one if not np.array_equal(one[k], two[k])]
    assert not differ, f"differ on two threads: {differ}"


@pytest.mark.parametrize("memory, batch", [("none", 3), ("all", 3), ("none", 1)])
def test_every_split_layer_gives_the_same_bits_on_two_threads(two_threads, memory, batch):
    """Memory mode "all" recomputes (BatchNorm's replay); a batch of one splits channels."""
    param = set_batch(parse_text(LAYERS, pb.NetParameter()), batch)
    one = _step(param, memory)
    counts = two_threads()
    _same_bits(one, _step(param, memory))
    assert counts.count(2) >= 40, counts


def test_a_batchnorm_resnet_step_gives_the_same_bits_on_two_threads(two_threads):
    """The CIFAR ResNet-20 (BatchNorm, Scale, ReLU, Eltwise, Split, pooling, convolutions'
    packing) at batch 4: one forward and backward at one thread, then at two."""
    param = set_batch(read_text(ROOT / "prototxt" / "cifar10_resnet.prototxt", pb.NetParameter()), 4)
    one = _step(param)
    counts = two_threads()
    _same_bits(one, _step(param))
    assert counts.count(2) >= 100, counts
