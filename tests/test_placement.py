"""Model parallelism: layers placed at locations, Copy operators where blobs cross."""
import threading

import numpy as np
import pytest

from sncaffe import Net
from sncaffe.backend.cpu import CPUDevice
from sncaffe.gradcheck import check_gradient, make_layer
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import PrototxtError, parse_text, place, prepare_net

NET = """
name: "two"
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } shape { dim: 2 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "sum" type: "Eltwise" bottom: "conv2" bottom: "pool1" top: "sum" }
layer { name: "ip" type: "InnerProduct" bottom: "sum" top: "ip" inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
SPLIT = {"input": "cpu:0", "conv1": "cpu:0", "bn1": "cpu:0", "relu1": "cpu:0", "pool1": "cpu:0",
         "conv2": "cpu:1", "sum": "cpu:1", "ip": "cpu:1", "loss": "cpu:1"}


def param():
    return parse_text(NET, pb.NetParameter())


def run(net, seed=0):
    rng = np.random.default_rng(seed)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].data.shape)
    net.blobs["label"].data[...] = [0, 2]
    loss = net.forward()
    net.backward()
    return loss


def test_copies_are_inserted_where_blobs_cross_locations():
    prepared = prepare_net(place(param(), SPLIT))
    copies = [layer for layer in prepared.layer if layer.type == "Copy"]
    # One copy of pool1 serves both of its readers at cpu:1 (the split comes after the copy).
    assert [c.name for c in copies] == ["pool1_to_cpu:1", "label_to_cpu:1"]
    assert all(c.location == "cpu:1" for c in copies)
    split = next(layer for layer in prepared.layer if layer.type == "Split")
    assert split.location == "cpu:1" and list(split.bottom) == ["pool1_to_cpu:1"]
    conv2 = next(layer for layer in prepared.layer if layer.name == "conv2")
    assert list(conv2.bottom) == ["pool1_to_cpu:1_pool1_to_cpu:1_0_split_0"]


@pytest.mark.parametrize("mode", ["none", "liveness", "offload", "recompute", "all"])
def test_model_parallel_equals_one_device_and_each_pool_meets_its_plan(mode):
    one = Net(param(), "TRAIN", device=CPUDevice(64 << 20), seed=3, memory=mode)
    two = Net(place(param(), SPLIT), "TRAIN", device=CPUDevice(64 << 20), seed=3, memory=mode,
              devices={"cpu:0": CPUDevice(64 << 20), "cpu:1": CPUDevice(64 << 20)})
    for d in two.devices.values():
        d.pool.reset_peak()
    assert run(one) == run(two)
    for name in one.params:
        for a, b in zip(one.params[name], two.params[name]):
            assert np.array_equal(a.data, b.data) and np.array_equal(a.diff, b.diff), name
    assert set(two.plan.peaks) == {"", "cpu:0", "cpu:1"}
    for loc, peak in two.plan.peaks.items():
        assert two.devices[loc].pool.peak == peak, loc
    # Each device holds only its own layers' parameters.
    conv2 = two.params["conv2"][0].data
    assert np.shares_memory(conv2, two.devices["cpu:1"].arena)
    assert not np.shares_memory(conv2, two.devices["cpu:0"].arena)


def test_in_place_across_locations_is_refused():
    bad = place(param(), {"relu1": "cpu:1"})
    with pytest.raises(PrototxtError, match='layer "relu1" \\(ReLU\\) runs in place on "conv1"'):
        prepare_net(bad)


def test_place_names_unknown_layers():
    with pytest.raises(PrototxtError, match='unknown layer "nope"'):
        place(param(), {"nope": "cpu:1"})


def test_copy_gradient():
    check_gradient(make_layer('type: "Copy"'), [np.random.default_rng(0).standard_normal((2, 3, 4))])


# An Inception-style block: two branches from one input, one per location, joined by a Concat.
INCEPTION = """
name: "branches"
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } shape { dim: 2 } } }
layer { name: "a1" type: "Convolution" bottom: "data" top: "a1"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "a2" type: "ReLU" bottom: "a1" top: "a1" }
layer { name: "b1" type: "Convolution" bottom: "data" top: "b1"
        convolution_param { num_output: 4 kernel_size: 1 weight_filler { type: "xavier" } } }
layer { name: "b2" type: "ReLU" bottom: "b1" top: "b1" }
layer { name: "cat" type: "Concat" bottom: "a1" bottom: "b1" top: "cat" }
layer { name: "ip" type: "InnerProduct" bottom: "cat" top: "ip" inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
BRANCHES = {"input": "cpu:0", "a1": "cpu:0", "a2": "cpu:0", "b1": "cpu:1", "b2": "cpu:1",
            "cat": "cpu:0", "ip": "cpu:0", "loss": "cpu:0"}


def branches(placement=None, memory="none"):
    p = parse_text(INCEPTION, pb.NetParameter())
    devices = {"cpu:0": CPUDevice(64 << 20), "cpu:1": CPUDevice(64 << 20)} if placement else None
    return Net(place(p, placement) if placement else p, "TRAIN", device=CPUDevice(64 << 20), seed=5,
               memory=memory, devices=devices)


def test_branches_at_two_locations_run_at_the_same_time():
    """Each location has its own worker: branch a's forward at cpu:0 holds its worker until branch
    b's forward at cpu:1 has started. A serial executor would never start b (the gate times out);
    the dispatcher's record shows b's operator issued while a's was still running."""
    net = branches(BRANCHES)
    ex, run_op = net.executor, net.executor.run_op
    assert ex.threaded
    b_started, timed_out = threading.Event(), []

    def gated(op, recompute, ws, chunk):
        if op.name == "b1:forward":
            b_started.set()
        if op.name == "a1:forward" and not b_started.wait(20):
            timed_out.append(op.name)
        run_op(op, recompute, ws, chunk)
    ex.run_op, ex.record = gated, []
    one = branches()
    assert run(net) == run(one) and not timed_out
    rec = {r["name"]: r for r in ex.record}
    a, b = rec["a1:forward"], rec["b1:forward"]
    assert (a["location"], b["location"]) == ("cpu:0", "cpu:1")
    # b was issued after a, and began (its event's start) before a ended: a held its worker until then
    assert b["index"] > a["index"] and b["event"].start < a["event"].end
    threads = {r["location"]: r["stream"] for r in ex.record if r["name"].endswith(":forward")}
    assert threads == {"cpu:0": "compute", "cpu:1": "compute"}
    for name in one.params:
        for x, y in zip(one.params[name], net.params[name]):
            assert np.array_equal(x.data, y.data) and np.array_equal(x.diff, y.diff), name


def test_copies_are_asynchronous_operators_on_copy_streams():
    net = Net(place(param(), SPLIT), "TRAIN", device=CPUDevice(64 << 20), seed=3,
              devices={"cpu:0": CPUDevice(64 << 20), "cpu:1": CPUDevice(64 << 20)})
    net.executor.record = []
    run(net)
    copies = [r for r in net.executor.record if r["stream"] != "compute"]    # memory "none": no offloads
    # forward: into cpu:1 on its h2d stream; backward (pool1's gradient): into cpu:0 on its h2d stream
    assert {(r["name"], r["location"], r["stream"]) for r in copies} == {
        ("pool1_to_cpu:1:forward", "cpu:1", "h2d"), ("label_to_cpu:1:forward", "cpu:1", "h2d"),
        ("pool1_to_cpu:1:backward", "cpu:0", "h2d")}
    pool1 = net.blobs["pool1"].data
    assert all(r["bytes"] == pool1.nbytes for r in copies if r["name"].startswith("pool1"))
    # the copies ran on the copy stream's thread of their device, not on a compute worker
    assert all(r["event"].start is not None for r in copies)


@pytest.mark.parametrize("mode", ["offload", "recompute", "all"])
def test_one_location_dispatched_to_workers_gives_the_same_bits_and_peak(mode):
    """The dispatcher's dependencies alone keep a net right: a one-location net forced onto the
    worker threads (the issuing thread runs ahead) matches the serial run to the bit."""
    ref = Net(param(), "TRAIN", device=CPUDevice(64 << 20), seed=3, memory=mode)
    net = Net(param(), "TRAIN", device=CPUDevice(64 << 20), seed=3, memory=mode)
    net.executor.threaded = True
    for _ in range(2):
        net.device.pool.reset_peak()
        assert run(ref) == run(net)
        assert net.device.pool.peak == net.plan.peak
    for name in ref.params:
        for x, y in zip(ref.params[name], net.params[name]):
            assert np.array_equal(x.data, y.data) and np.array_equal(x.diff, y.diff), name


@pytest.mark.parametrize("mode", ["offload", "none"])     # the general path; programs (dispatcher.py)
def test_trace_has_a_row_per_location_and_stream_copy_bytes_and_pool_counters(tmp_path, mode):
    import json

    from sncaffe.trace import trace_iteration
    net = Net(place(param(), SPLIT), "TRAIN", device=CPUDevice(64 << 20), seed=3, memory=mode,
              devices={"cpu:0": CPUDevice(64 << 20), "cpu:1": CPUDevice(64 << 20)})
    rng = np.random.default_rng(0)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].data.shape)
    spans = trace_iteration(net, tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    rows = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert {"cpu:0/compute", "cpu:1/compute", "cpu:1/h2d", "cpu:0/h2d"} <= rows
    assert {s[0] for s in spans} == rows
    copy = next(e for e in events if e["ph"] == "X" and e["name"] == "pool1_to_cpu:1:forward")
    assert copy["args"]["bytes"] == net.graph.blobs["pool1"].data.nbytes > 0
    counters = [e for e in events if e["ph"] == "C"]
    assert {e["name"] for e in counters} >= {"pool bytes cpu:0", "pool bytes cpu:1"}
    top = max(e["args"]["bytes"] for e in counters if e["name"] == "pool bytes cpu:1")
    assert top == net.plan.peaks["cpu:1"]             # the counter reaches the planned peak
    assert net.executor.trace is None and net.executor.pool_trace is None


def test_an_error_on_a_worker_is_raised_by_forward_and_the_net_recovers():
    net = branches(BRANCHES)
    ex, run_op = net.executor, net.executor.run_op

    def failing(op, recompute, ws, chunk):
        if op.name == "b1:forward":
            raise FloatingPointError("b1 failed")
        run_op(op, recompute, ws, chunk)
    ex.run_op = failing
    with pytest.raises(FloatingPointError, match="b1 failed"):
        run(net)
    ex.run_op = run_op
    net.devices["cpu:1"].pool.reset_peak()
    assert run(net) == run(branches())                 # the partial pass is cleaned up
    assert net.devices["cpu:1"].pool.peak == net.plan.peaks["cpu:1"]
