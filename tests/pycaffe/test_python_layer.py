"""Python layers (type "Python") as pycaffe defines them: a data layer, a loss layer, a layer with
learnable blobs; checked by the gradient checker and against the built-in layers, in the memory runtime."""
import logging
import sys

from dataclasses import replace

import numpy as np
import pytest

import sncaffe.pycaffe as caffe
from sncaffe import config
from sncaffe.gradcheck import check_gradient, make_layer
from sncaffe.graph import GraphError
from sncaffe.layers import LayerError

MODULE = '''
import numpy as np

import sncaffe.pycaffe as caffe


class EuclideanLossLayer(caffe.Layer):
    """Caffe's examples/pycaffe/layers/pyloss.py, scaled by the top's diff (its loss_weight)."""

    def setup(self, bottom, top):
        if len(bottom) != 2:
            raise Exception("Need two inputs to compute distance.")

    def reshape(self, bottom, top):
        if bottom[0].count != bottom[1].count:
            raise Exception("Inputs must have the same dimension.")
        self.diff = np.zeros_like(bottom[0].data)
        top[0].reshape(1)

    def forward(self, bottom, top):
        self.diff[...] = bottom[0].data - bottom[1].data
        top[0].data[...] = np.sum(self.diff ** 2) / bottom[0].num / 2.

    def backward(self, top, propagate_down, bottom):
        for i in range(2):
            if not propagate_down[i]:
                continue
            sign = 1 if i == 0 else -1
            bottom[i].diff[...] = sign * self.diff / bottom[i].num * top[0].diff[0]


class RandomData(caffe.Layer):
    """A data layer: param_str "batch,dim,seed"; tops: data (batch, dim) and target (batch, 3)."""

    def setup(self, bottom, top):
        self.batch, self.dim, seed = (int(v) for v in self.param_str.split(","))
        self.rng = np.random.default_rng(seed)
        self.w = np.random.default_rng(99).standard_normal((self.dim, 3))

    def reshape(self, bottom, top):
        top[0].reshape(self.batch, self.dim)
        top[1].reshape(self.batch, 3)

    def forward(self, bottom, top):
        x = self.rng.standard_normal((self.batch, self.dim))
        top[0].data[...] = x
        top[1].data[...] = x @ self.w

    def backward(self, top, propagate_down, bottom):
        pass


class Bias(caffe.Layer):
    """top = bottom + b, b a learnable vector over axis 1 (started at 0.5 in setup)."""

    def setup(self, bottom, top):
        self.blobs.add_blob(bottom[0].channels)
        self.blobs[0].data[...] = 0.5

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = bottom[0].data + self.blobs[0].data

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            bottom[0].diff[...] = top[0].diff
        self.blobs[0].diff[...] += top[0].diff.sum(0)


class Broken(caffe.Layer):
    def setup(self, bottom, top):
        raise ValueError("param_str must be a number, got %r" % self.param_str)
'''


@pytest.fixture
def pymod(tmp_path, monkeypatch):
    (tmp_path / "mylayers.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "mylayers"
    sys.modules.pop("mylayers", None)


NET = """name: "pynet"
force_backward: {force}
layer {{ name: "data" type: "Python" top: "data" top: "target"
  python_param {{ module: "mylayers" layer: "RandomData" param_str: "8,5,1" }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param {{ num_output: 3 weight_filler {{ type: "gaussian" std: 0.1 }} }} }}
layer {{ name: "bias" type: "Python" bottom: "ip" top: "out" python_param {{ module: "mylayers" layer: "Bias" }} }}
{loss}
"""
PYLOSS = """layer { name: "loss" type: "Python" bottom: "out" bottom: "target" top: "loss" loss_weight: 1
  python_param { module: "mylayers" layer: "EuclideanLossLayer" } }"""
LOSS = 'layer { name: "loss" type: "EuclideanLoss" bottom: "out" bottom: "target" top: "loss" }'


def test_python_loss_layer_gradient(pymod):
    layer = make_layer('type: "Python" python_param { module: "mylayers" layer: "EuclideanLossLayer" }', n_bottoms=2)
    rng = np.random.default_rng(0)
    check_gradient(layer, [rng.standard_normal((4, 3, 2)), rng.standard_normal((4, 3, 2))])


def test_python_layer_with_learnable_blob_gradient(pymod):
    layer = make_layer('type: "Python" python_param { module: "mylayers" layer: "Bias" }')
    check_gradient(layer, [np.random.default_rng(1).standard_normal((3, 4))])
    assert layer.param_shapes == [(4,)]


@pytest.mark.parametrize("memory", ["none", "all"])
def test_python_layers_train_as_the_builtin_ones(pymod, tmp_path, memory):
    for name, loss in (("py", PYLOSS), ("builtin", LOSS)):
        (tmp_path / f"{name}.prototxt").write_text(NET.format(force="false", loss=loss))
        (tmp_path / f"{name}_solver.prototxt").write_text(
            f'net: "{tmp_path / name}.prototxt" base_lr: 0.05 momentum: 0.9 lr_policy: "fixed" '
            f'max_iter: 20 display: 0 random_seed: 3 snapshot_after_train: false '
            f'memory_param {{ mode: "{memory}" }}')
    py = caffe.SGDSolver(str(tmp_path / "py_solver.prototxt"))
    ref = caffe.SGDSolver(str(tmp_path / "builtin_solver.prototxt"))
    losses = []
    for it in range(15):
        py.step(1)
        ref.step(1)
        assert py.net.blobs["loss"].data.item() == pytest.approx(ref.net.blobs["loss"].data.item(), rel=1e-5)
        losses.append(py.net.blobs["loss"].data.item())
    assert losses[-1] < 0.7 * losses[0]
    np.testing.assert_allclose(py.net.params["bias"][0].data, ref.net.params["bias"][0].data, rtol=1e-5)
    assert not np.allclose(py.net.params["bias"][0].data, 0.5)          # the Python layer's blob learned
    plan = py.net.memory_plan
    assert plan.mode == memory and not {"data", "target", "out", "loss"} & set(plan.dropped)   # never recomputed
    layer = py.net.layer_dict["loss"]
    assert isinstance(layer, caffe.Layer) and layer.diff.shape == (8, 3)   # the user's object itself


def test_import_failures_name_the_layer_and_module(tmp_path, pymod):
    net = NET.format(force="false", loss=PYLOSS)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "onlyhere.py").write_text(MODULE)        # beside the prototxt: not searched
    (tmp_path / "folder" / "a.prototxt").write_text(net.replace('module: "mylayers" layer: "Bias"',
                                                                'module: "onlyhere" layer: "Bias"'))
    with pytest.raises(GraphError, match=r'layer "bias" \(Python\): cannot import python_param.module "onlyhere"'):
        caffe.Net(str(tmp_path / "folder" / "a.prototxt"), caffe.TRAIN)
    (tmp_path / "b.prototxt").write_text(net.replace('layer: "Bias"', 'layer: "Nope"'))
    with pytest.raises(GraphError, match=r'layer "bias" \(Python\): module "mylayers" .* has no python_param.layer "Nope"'):
        caffe.Net(str(tmp_path / "b.prototxt"), caffe.TRAIN)
    (tmp_path / "c.prototxt").write_text(net.replace('layer: "Bias"', 'layer: "Broken" param_str: "x"'))
    with pytest.raises(GraphError, match=r"layer \"bias\" \(Python mylayers.Broken\): setup raised ValueError: "
                                         r"param_str must be a number, got 'x'"):
        caffe.Net(str(tmp_path / "c.prototxt"), caffe.TRAIN)
    (tmp_path / "bad.py").write_text("import numpy\nraise ImportError('needs yaml')\n")
    with pytest.raises(LayerError, match=r'layer "x" \(Python\): cannot import python_param.module "bad": '
                                         r"ImportError: needs yaml"):
        make_layer('name: "x" type: "Python" python_param { module: "bad" layer: "L" }')


def test_a_layer_that_is_no_caffe_layer_class_is_refused_before_it_is_called(tmp_path, monkeypatch):
    (tmp_path / "notlayers.py").write_text("import pathlib\nCALLED = pathlib.Path(__file__).with_suffix('.called')\n"
                                           "def make(*args):\n    CALLED.touch()\n"
                                           "class Plain:\n    def __init__(self, *args):\n        CALLED.touch()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module, name, what in (("os", "getcwd", "a builtin_function_or_method"), ("notlayers", "make", "a function"),
                               ("notlayers", "Plain", "a class not derived from caffe.Layer")):
        with pytest.raises(LayerError, match=rf'layer "x" \(Python\): python_param.layer "{name}" of module '
                                             rf'"{module}" is {what}; it must name a class derived from caffe.Layer'):
            make_layer(f'name: "x" type: "Python" python_param {{ module: "{module}" layer: "{name}" }}')
    assert not (tmp_path / "notlayers.called").exists()
    sys.modules.pop("notlayers", None)


RELU_MODULE = '''
import numpy as np

import sncaffe.pycaffe as caffe

CALLS = {"forward": 0}


class PyReLU(caffe.Layer):
    """max(x, 0); it may be recomputed instead of kept."""
    recomputable = True

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        CALLS["forward"] += 1
        top[0].data[...] = np.maximum(bottom[0].data, 0)

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = top[0].diff * (bottom[0].data > 0)


class KeptReLU(PyReLU):
    recomputable = False


class RecomputedData(caffe.Layer):
    recomputable = True

    def reshape(self, bottom, top):
        top[0].reshape(2, 3)
'''

CONV_NET = """name: "pyrelu"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 4 dim: 3 dim: 6 dim: 6 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 5 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "Python" bottom: "conv1" top: "relu1" python_param { module: "pyrelu" layer: "%s" } }
layer { name: "pool1" type: "Pooling" bottom: "relu1" top: "pool1" pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool1" top: "ip" inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def _train_two_steps(proto, mode):
    """Two SGD steps on fixed data in a pool of its own: (plan, [(pool peak, state)])."""
    from sncaffe.backend.cpu import CPUDevice
    from sncaffe.net import Net
    device = CPUDevice("64MiB")
    net = Net(proto, "TRAIN", device=device, memory=mode, seed=1)
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(2):
        net.blobs["data"].data[...] = rng.standard_normal((4, 3, 6, 6))
        net.blobs["label"].data[...] = rng.integers(0, 3, 4)
        net.clear_param_diffs()
        device.pool.reset_peak()
        loss = net.forward()
        net.backward()
        state = {"loss": np.float64(loss).tobytes()}
        for name, blobs in net.params.items():
            for i, b in enumerate(blobs):
                state[f"{name}[{i}]"], state[f"{name}[{i}].diff"] = b.data.tobytes(), b.diff.tobytes()
        steps.append((device.pool.peak, state))
        for blobs in net.params.values():
            for b in blobs:
                b.data -= np.float32(0.1) * b.diff
    return net.plan, steps


@pytest.fixture
def pyrelu(tmp_path, monkeypatch):
    (tmp_path / "pyrelu.py").write_text(RELU_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import pyrelu
    yield pyrelu
    sys.modules.pop("pyrelu", None)


@pytest.mark.parametrize("mode", ["recompute", "all"])
def test_a_recomputable_python_layer_is_recomputed_with_the_same_bits(pyrelu, tmp_path, mode, monkeypatch):
    # mode all drops relu1 only where that lowers the peak: on ConvPlan the activations set it (on
    # oneDNN this 6x6 net's peak is the convolution's blocked copies and scratchpad)
    monkeypatch.setattr(config, "settings", replace(config.settings, conv="native"))
    for cls in ("PyReLU", "KeptReLU"):
        (tmp_path / f"{cls}.prototxt").write_text(CONV_NET % cls)
    _, ref = _train_two_steps(str(tmp_path / "PyReLU.prototxt"), "none")
    pyrelu.CALLS["forward"] = 0
    plan, steps = _train_two_steps(str(tmp_path / "PyReLU.prototxt"), mode)
    assert "relu1" in plan.dropped                          # its top is dropped and made again in backward
    assert pyrelu.CALLS["forward"] == 4                     # two forwards and two replays
    assert [s for _, s in steps] == [s for _, s in ref]     # mode none's bits
    assert [p for p, _ in steps] == [plan.peak] * 2         # measured pool peak == planned peak
    kept, _ = _train_two_steps(str(tmp_path / "KeptReLU.prototxt"), mode)
    assert "relu1" not in kept.dropped                       # the default: never recomputed
    check_gradient(make_layer('type: "Python" python_param { module: "pyrelu" layer: "PyReLU" }'),
                   [np.random.default_rng(3).standard_normal((3, 4))])


def test_a_recomputable_data_layer_is_refused(pyrelu):
    with pytest.raises(LayerError, match=r'layer "d" \(Python pyrelu.RecomputedData\): recomputable = True, '
                                         r"but a layer without bottoms"):
        make_layer('name: "d" type: "Python" top: "x" python_param { module: "pyrelu" layer: "RecomputedData" }',
                   n_bottoms=0)


BATCHES_MODULE = '''
import numpy as np

import sncaffe.pycaffe as caffe


class Batches(caffe.Layer):
    """A data layer whose batches differ in size (param_str: the sizes, in turn), set in reshape
    as Caffe's FCN data layers do: reshape reads the current item, forward moves on."""

    def setup(self, bottom, top):
        self.sizes = [int(n) for n in self.param_str.split(",")]
        self.idx = 0
        self.rng = np.random.default_rng(5)

    def reshape(self, bottom, top):
        n = self.sizes[self.idx % len(self.sizes)]
        self.x = self.rng.standard_normal((n, 3)).astype(np.float32)
        self.y = (np.arange(n) % 2).astype(np.float32)
        top[0].reshape(n, 3)
        top[1].reshape(n)

    def forward(self, bottom, top):
        top[0].data[...] = self.x
        top[1].data[...] = self.y
        self.idx += 1

    def backward(self, top, propagate_down, bottom):
        pass


class Repeat(caffe.Layer):
    """Its bottom repeated k times along axis 0, k = 1, 2, 3, ... in turn (set in forward)."""

    def setup(self, bottom, top):
        self.k = 0
        top[0].reshape(*bottom[0].data.shape)

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        self.k += 1
        top[0].reshape(self.k * bottom[0].data.shape[0], *bottom[0].data.shape[1:])
        top[0].data[...] = np.concatenate([bottom[0].data] * self.k)

    def backward(self, top, propagate_down, bottom):
        n = bottom[0].data.shape[0]
        bottom[0].diff[...] = top[0].diff.reshape(self.k, n, *bottom[0].data.shape[1:]).sum(0)


class ReshapesInForward(Batches):
    """Its tops keep their first shapes in reshape and take each batch's in forward."""

    def reshape(self, bottom, top):
        if not hasattr(self, "x"):
            super().reshape(bottom, top)

    def forward(self, bottom, top):
        super().reshape(bottom, top)
        super().forward(bottom, top)
'''

BATCHES_NET = """name: "batches"
layer { name: "data" type: "Python" top: "data" top: "label"
  python_param { module: "batches" layer: "%s" param_str: "%s" } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@pytest.fixture
def batches(tmp_path, monkeypatch):
    (tmp_path / "batches.py").write_text(BATCHES_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("batches", None)


def _assert_softmax_step(net, layer, n, loss):
    """The batch of ``n`` the data layer gave, and the loss and weight gradient of an inner
    product + softmax loss on it, computed by hand."""
    x, y = layer.x, layer.y.astype(int)
    assert net.blobs["data"].shape == (n, 3) and net.blobs["ip"].data.shape == (n, 2)
    np.testing.assert_array_equal(net.blobs["data"].data, x)
    w, b = net.params["ip"][0].data, net.params["ip"][1].data
    z = x @ w.T + b
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    assert loss == pytest.approx(-np.log(p[np.arange(n), y]).mean(), rel=1e-5)
    p[np.arange(n), y] -= 1
    np.testing.assert_allclose(net.params["ip"][0].diff, p.T @ x / n, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("memory", ["none", "all"])
def test_python_data_layer_with_batches_of_changing_size(batches, memory):
    (batches / "net.prototxt").write_text(BATCHES_NET % ("Batches", "6,4,5,6"))
    net = caffe.Net(str(batches / "net.prototxt"), caffe.TRAIN, memory=memory, keep=True)
    layer = net.layer_dict["data"]
    for n in (6, 4, 5, 6):          # the first reshape (at setup) gave 6: later batches fit its block
        loss = net.forward()["loss"]
        net.clear_param_diffs()         # backward adds into them, as in Caffe
        net.backward()
        _assert_softmax_step(net, layer, n, loss)


@pytest.mark.parametrize("layer", ["Batches", "ReshapesInForward"])
@pytest.mark.parametrize("memory", ["none", "all"])
def test_python_top_outgrowing_its_block_plans_the_net_again(batches, layer, memory, caplog, monkeypatch):
    """A batch larger than the first: the net is planned again for it in the middle of the pass,
    whether the layer reshapes its top in reshape or in forward (py-faster-rcnn's layers), and the
    layer keeps its object (its batch counter goes on)."""
    from sncaffe.backend.cpu import CPUDevice
    from sncaffe.pycaffe import mode
    device = CPUDevice("64MiB")          # a pool of its own: its peak is this net's
    device._pycaffe_name = "cpu"
    monkeypatch.setitem(mode._state, "device", device)
    monkeypatch.setitem(mode._state, "mode", "cpu")
    (batches / "grow.prototxt").write_text(BATCHES_NET % (layer, "4,6,3,6,9"))
    net = caffe.Net(str(batches / "grow.prototxt"), caffe.TRAIN, memory=memory, keep=True)
    obj = net.layer_dict["data"]
    peaks = []
    for n in (4, 6, 3, 6, 9):
        plan = net.memory_plan
        with caplog.at_level(logging.INFO, logger="sncaffe"):
            caplog.clear()
            device.pool.reset_peak()
            loss = net.forward()["loss"]
        grew = n in (6, 9) and net.memory_plan is not plan
        assert grew == any("planned again" in r.getMessage() for r in caplog.records)
        net.clear_param_diffs()
        net.backward()
        peaks.append((n, grew, device.pool.peak, net.memory_plan.peak))
        assert net.layer_dict["data"] is obj and obj.idx == len(peaks)
        _assert_softmax_step(net, obj, n, loss)
    assert [g for _, g, _, _ in peaks] == [False, True, False, False, True]     # a bound grows; smaller fit
    assert [(m, p) for _, grew, m, p in peaks if not grew] == [(p, p) for _, grew, m, p in peaks if not grew]
    assert net._net.graph.blobs["data"].shape == (9, 3)        # the bound the plan is made for


@pytest.mark.parametrize("tested", [False, True])
def test_a_solver_trains_through_batches_that_outgrow_their_blocks(batches, tested):
    """A solver's train net planned again beside the history (and a test net's blocks): SGD with
    momentum over batches of 4, 6, 3 and 9 items matches NumPy's, step by step."""
    (batches / "grow.prototxt").write_text(BATCHES_NET % ("ReshapesInForward", "4,6,3,9"))
    test = (f'test_net: "{batches / "grow.prototxt"}" test_iter: 1 test_interval: 2 test_initialization: false '
            if tested else "")
    (batches / "solver.prototxt").write_text(f'train_net: "{batches / "grow.prototxt"}" {test}base_lr: 0.5 '
                                             f'momentum: 0.9 lr_policy: "fixed" max_iter: 4 display: 0 '
                                             f'snapshot_after_train: false')
    solver = caffe.SGDSolver(str(batches / "solver.prototxt"))
    w, b = (np.array(a.data, np.float64) for a in solver.net.params["ip"])
    vw, vb = np.zeros_like(w), np.zeros_like(b)
    plans = {id(solver.net.memory_plan)}
    for n in (4, 6, 3, 9):
        solver.step(1)
        plans.add(id(solver.net.memory_plan))
        layer = solver.net.layer_dict["data"]
        x, y = layer.x.astype(np.float64), layer.y.astype(int)
        z = x @ w.T + b
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        assert solver.net.blobs["loss"].data.item() == pytest.approx(-np.log(p[np.arange(n), y]).mean(), rel=1e-4)
        p[np.arange(n), y] -= 1
        vw, vb = 0.9 * vw + 0.5 * p.T @ x / n, 0.9 * vb + 0.5 * p.sum(0) / n
        w, b = w - vw, b - vb
        np.testing.assert_allclose(solver.net.params["ip"][0].data, w, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(solver.net.params["ip"][1].data, b, rtol=1e-4, atol=1e-6)
    assert len(plans) == 3                  # planned for 4, then 6, then 9 items
    if tested:                  # its test net (tested with 4 items at iteration 2) takes 6 now, and shares
        net = solver.test_nets[0]
        loss = net.forward()["loss"]
        layer = net.layer_dict["data"]
        x, y = layer.x.astype(np.float64), layer.y.astype(int)
        assert x.shape == (6, 3) and net.blobs["data"].shape == (6, 3)
        z = x @ w.T + b
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        assert loss == pytest.approx(-np.log(p[np.arange(6), y]).mean(), rel=1e-4)
        solver.step(1)                      # the train net's parameters, seen by the test net
        assert net.params["ip"][0].data is solver.net.params["ip"][0].data


REPEAT_NET = """force_backward: true
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } } }
layer { name: "c" type: "Convolution" bottom: "x" top: "c"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "r" type: "ReLU" bottom: "c" top: "c" }
layer { name: "c2" type: "Convolution" bottom: "c" top: "c2"
  convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "p" type: "Pooling" bottom: "c2" top: "p" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "rep" type: "Python" bottom: "p" top: "q" python_param { module: "batches" layer: "Repeat" } }
layer { name: "ip" type: "InnerProduct" bottom: "q" top: "ip"
  inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "Reduction" bottom: "ip" top: "loss" reduction_param { operation: SUMSQ } loss_weight: 1 }
"""


def _repeat_steps(mode):
    from sncaffe.backend.cpu import CPUDevice
    from sncaffe.net import Net
    from sncaffe.prototxt import parse_text
    from sncaffe.proto import sncaffe_pb2 as pb
    net = Net(parse_text(REPEAT_NET, pb.NetParameter()), "TRAIN", device=CPUDevice("64MiB"), memory=mode, seed=1)
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(3):                  # the Python layer's top outgrows its block at every step
        net.blobs["x"].data[...] = rng.standard_normal((4, 3, 8, 8))
        net.clear_param_diffs()
        loss = net.forward()
        net.backward()
        steps.append((loss, net.blobs["x"].diff.copy(), {k: b[0].diff.copy() for k, b in net.params.items()}))
    return steps, net.plan


@pytest.mark.parametrize("mode", ["liveness", "offload", "recompute", "all"])
def test_growth_mid_net_gives_every_memory_mode_the_gradients_of_none(batches, mode, caplog):
    """The pass goes on in a new plan from a layer in the middle of the net: what the old plan had
    dropped or overwritten in place (ReLU on the convolution's output, copied before it for
    recomputation) runs again, the rest is carried over."""
    want, _ = _repeat_steps("none")
    with caplog.at_level(logging.INFO, logger="sncaffe"):
        got, plan = _repeat_steps(mode)
    assert caplog.text.count("planned again") == 2
    if mode == "recompute":
        assert "c" in plan.dropped and "layers before it ran again for the new plan" in caplog.text
    for (loss, dx, grads), (loss2, dx2, grads2) in zip(want, got):
        assert loss2 == pytest.approx(loss, rel=1e-5)
        np.testing.assert_allclose(dx2, dx, rtol=1e-4, atol=1e-6)
        for k in grads:
            np.testing.assert_allclose(grads2[k], grads[k], rtol=1e-4, atol=1e-6)


def test_growth_over_several_locations_is_a_clear_error(batches):
    """A net placed over locations is not planned again (its Copy operators and workers)."""
    from sncaffe.backend.cpu import CPUDevice
    from sncaffe.net import Net
    from sncaffe.prototxt import parse_text
    from sncaffe.proto import sncaffe_pb2 as pb
    text = (BATCHES_NET % ("Batches", "4,6")).replace('layer { name: "ip" type: "InnerProduct"',
                                                     'layer { name: "ip" type: "InnerProduct" location: "cpu:1"')
    net = Net(parse_text(text, pb.NetParameter()), "TRAIN", device=CPUDevice("16MiB"),
              devices={"cpu:1": CPUDevice("16MiB")})
    net.forward()
    with pytest.raises(LayerError, match=r'layer "data" \(Python\): top "data" to \(6, 3\) \(planned \(4, 3\)\).*: '
                                         r"the net cannot be planned again over several locations"):
        net.forward()
