"""How the executor drives devices, checked on CPU devices that record what they are asked:
each layer runs under its own device (model parallelism over GPUs), copy dependencies are
waited for on the device (stream side) and the host waits only where it reuses host memory,
and a traced operator is waited for before its span ends."""
import sys
import threading
from contextlib import contextmanager

import numpy as np
import pytest

from sncaffe import Net
from sncaffe.backend.cpu import CPUDevice
from sncaffe.runtime.dispatcher import Dispatcher
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text, place

NET = """
name: "two"
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } shape { dim: 2 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "ip" type: "InnerProduct" bottom: "conv2" top: "ip" inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
SPLIT = {"input": "cpu:0", "conv1": "cpu:0", "relu1": "cpu:0", "pool1": "cpu:0",
         "conv2": "cpu:1", "relu2": "cpu:1", "ip": "cpu:1", "loss": "cpu:1"}


class _Current(threading.local):
    value = None


class RecordingDevice(CPUDevice):
    """A CPU device that says which device is current (as CUDADevice.active() makes its GPU
    current: per host thread, as CUDA's current device is) and counts the device-side waits and
    compute synchronizations it is asked for."""
    current = _Current()

    def __init__(self, label, *a, **k):
        super().__init__(*a, **k)
        self.label, self.stream_waits, self.syncs = label, 0, 0

    @contextmanager
    def active(self):
        previous, RecordingDevice.current.value = RecordingDevice.current.value, self.label
        try:
            yield self
        finally:
            RecordingDevice.current.value = previous

    def wait_event(self, event, stream="compute"):
        self.stream_waits += 1
        super().wait_event(event, stream)

    def synchronize_compute(self):
        self.syncs += 1


def run(net):
    net.blobs["data"].data[...] = np.random.default_rng(0).standard_normal(net.blobs["data"].data.shape)
    net.blobs["label"].data[...] = [0, 2]
    net.forward()
    net.backward()


def test_each_layer_runs_under_its_own_device():
    """Two devices built one after the other: the last one built must not run every layer."""
    devices = {loc: RecordingDevice(loc, 64 << 20) for loc in ("cpu:0", "cpu:1")}
    net = Net(place(parse_text(NET, pb.NetParameter()), SPLIT), "TRAIN", device=RecordingDevice("", 64 << 20),
              devices=devices)
    seen = []
    # a Copy runs on the streams of the location its data moves into (backward: its bottom's)
    net.step_hook = lambda op, recompute: seen.append(
        (op.writes[0].location if op.node.type == "Copy" else op.node.layer.param.location,
         RecordingDevice.current.value))
    run(net)
    assert seen and {loc for loc, _ in seen} == {"cpu:0", "cpu:1"}
    assert all(loc == active for loc, active in seen), [s for s in seen if s[0] != s[1]][:4]
    assert RecordingDevice.current.value is None             # restored after each layer


def test_copy_dependencies_are_waited_for_on_the_device(monkeypatch):
    """Offload mode: every prefetch an operator reads (and every offload of what it overwrites or
    frees) is waited for with device.wait_event, so the host goes on queueing kernels; the host
    itself waits only to reuse host blocks (drop, reset)."""
    host_waits = []
    real = Dispatcher._wait

    def record(self, event):
        if event is not None:
            host_waits.append(sys._getframe(1).f_code.co_name)
        real(self, event)
    monkeypatch.setattr(Dispatcher, "_wait", record)
    device = RecordingDevice("", 64 << 20)
    net = Net(parse_text(NET, pb.NetParameter()), "TRAIN", device=device, memory="offload")
    assert net.plan.offloaded, "the plan should offload something for this test to mean anything"
    run(net)
    assert device.stream_waits >= len(net.plan.offloaded)
    assert set(host_waits) <= {"_drop", "reset"}, set(host_waits)


@pytest.mark.parametrize("memory", ["none", "offload"])
def test_traced_operators_wait_for_their_kernels(memory):
    device = RecordingDevice("", 64 << 20)
    net = Net(parse_text(NET, pb.NetParameter()), "TRAIN", device=device, memory=memory)
    net.executor.trace = []
    run(net)
    spans = [s for s in net.executor.trace_events() if s[0] == "compute"]
    assert spans and device.syncs == len(spans)
    if memory == "offload":
        copies = [s for s in net.executor.trace_events() if s[0] != "compute"]
        assert copies and all(s[2] <= s[3] for s in copies)
