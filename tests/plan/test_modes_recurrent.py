"""A small recurrent net (LSTM, RNN with a static input and exposed state, LSTMUnit) trained in
every memory mode: the same bits as mode none, and the pool peak the planner planned.

Three iterations, so the hidden state the LSTM carries from one batch to the next is part of
what must agree."""
import numpy as np
import pytest

from sncaffe import Net
from sncaffe.backend import CPUDevice
from sncaffe.plan.planner import MODES
from sncaffe.prototxt import parse_text
from sncaffe.proto import sncaffe_pb2 as pb

T, N = 5, 3
NET = """
name: "recurrent" force_backward: true
layer { name: "input" type: "Input" top: "x" top: "cont" top: "xs" top: "h0" top: "target"
        top: "c_prev" top: "u" top: "cont1"
  input_param { shape { dim: 5 dim: 3 dim: 4 } shape { dim: 5 dim: 3 } shape { dim: 3 dim: 2 }
                shape { dim: 1 dim: 3 dim: 3 } shape { dim: 5 dim: 3 dim: 2 }
                shape { dim: 1 dim: 3 dim: 4 } shape { dim: 1 dim: 3 dim: 5 } shape { dim: 1 dim: 3 } } }
layer { name: "ip_in" type: "InnerProduct" bottom: "x" top: "e"
  inner_product_param { num_output: 6 axis: 2 weight_filler { type: "xavier" } } }
layer { name: "act" type: "TanH" bottom: "e" top: "e" }
layer { name: "lstm" type: "LSTM" bottom: "e" bottom: "cont" top: "l"
  recurrent_param { num_output: 4 weight_filler { type: "uniform" min: -0.5 max: 0.5 }
                    bias_filler { type: "uniform" min: -0.2 max: 0.2 } } }
layer { name: "relu" type: "ReLU" bottom: "l" top: "l" }
layer { name: "rnn" type: "RNN" bottom: "l" bottom: "cont" bottom: "xs" bottom: "h0" top: "r" top: "h_T"
  recurrent_param { num_output: 3 expose_hidden: true weight_filler { type: "uniform" min: -0.5 max: 0.5 }
                    bias_filler { type: "uniform" min: -0.2 max: 0.2 } } }
layer { name: "ip_out" type: "InnerProduct" bottom: "r" top: "y"
  inner_product_param { num_output: 2 axis: 2 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "target" top: "loss" }
layer { name: "gates" type: "InnerProduct" bottom: "u" top: "g"
  inner_product_param { num_output: 16 axis: 2 weight_filler { type: "xavier" } } }
layer { name: "unit" type: "LSTMUnit" bottom: "c_prev" bottom: "g" bottom: "cont1" top: "c" top: "h" }
"""


def train(mode, iters=3):
    device = CPUDevice("1GiB")
    net = Net(parse_text(NET, pb.NetParameter()), "TRAIN", device=device, memory=mode, seed=1)
    rng = np.random.default_rng(0)
    pool, steps = device.pool, []
    for _ in range(iters):
        for name in net.inputs:
            blob = net.blobs[name]
            blob.data[...] = (rng.integers(0, 2, blob.shape) if name.startswith("cont")
                              else rng.standard_normal(blob.shape))
        net.clear_param_diffs()
        pool.reset_peak()
        loss = net.forward()
        for name in net.outputs:
            blob = net.blobs[name]
            if blob.diff is not None and name != "loss":
                blob.diff[...] = rng.standard_normal(blob.shape)
        net.backward()
        state = {"loss": np.float64(loss)}
        for name, blobs in net.params.items():
            for i, b in enumerate(blobs):
                state[f"{name}[{i}]"], state[f"{name}[{i}].diff"] = b.data.copy(), b.diff.copy()
        for name in net.inputs + net.outputs:
            for kind in ("data", "diff"):
                a = getattr(net.blobs[name], kind)
                if a is not None:
                    state[f"{name}.{kind}"] = a.copy()
        steps.append((pool.peak, state))
        for blobs in net.params.values():
            for b in blobs:
                b.data -= np.float32(0.01) * b.diff
    assert pool.in_use == net.plan.persistent_bytes, "an iteration left blocks behind"
    return net, steps


_none = {}


@pytest.mark.parametrize("mode", MODES)
def test_recurrent_net_in_every_mode(mode):
    if "none" not in _none:
        _none["none"] = train("none")
    ref_net, ref = _none["none"]
    net, steps = (ref_net, ref) if mode == "none" else train(mode)
    assert [peak for peak, _ in steps] == [net.plan.peak] * len(steps), "pool peak != planned peak"
    assert net.plan.peak <= ref_net.plan.peak
    for it, ((_, state), (_, want)) in enumerate(zip(steps, ref)):
        assert state.keys() == want.keys()
        differ = [k for k in want if state[k].tobytes() != want[k].tobytes()]
        assert not differ, f"iteration {it}: differs from mode none in {differ[:8]}"
    # the LSTM carried its state: iteration 2 started from iteration 1's last step
    assert net.layers[net.layer_names.index("lstm")]._carry is not None
