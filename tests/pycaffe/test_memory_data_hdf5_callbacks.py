"""pycaffe scripts feeding a MemoryData layer with set_input_arrays, saving and loading Caffe's HDF5
weights (save_hdf5, load_hdf5, Net(proto, weights.h5, phase)) and hooking layers with
before_forward/after_forward/before_backward/after_backward."""
import re

import h5py
import numpy as np
import pytest

import sncaffe.pycaffe as caffe
from sncaffe.layers import pooling
from pycaffe_fixtures import lenet_fixture, trained_fixture  # noqa: F401 (fixtures)

MEMNET = """name: "mem"
layer { name: "data" type: "MemoryData" top: "data" top: "label"
  memory_data_param { batch_size: 4 channels: 2 height: 3 width: 3 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "relu" type: "ReLU" bottom: "ip" top: "ip" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@pytest.fixture
def memnet(tmp_path):
    path = tmp_path / "mem.prototxt"
    path.write_text(MEMNET)
    return str(path)


@pytest.mark.parametrize("memory", ["none", "all"])
def test_set_input_arrays_feeds_memory_data_in_order(memnet, memory):
    rng = np.random.default_rng(0)
    data = rng.standard_normal((8, 2, 3, 3)).astype(np.float32)
    labels = rng.integers(0, 3, 8).astype(np.float32)
    net = caffe.Net(memnet, caffe.TRAIN, memory=memory, keep=["data", "label"])
    net.set_input_arrays(data, labels)
    for step in range(3):                          # batches in order, wrapping around
        out = net.forward()
        rows = slice(4 * (step % 2), 4 * (step % 2) + 4)
        np.testing.assert_array_equal(net.blobs["data"].data, data[rows])
        np.testing.assert_array_equal(net.blobs["label"].data, labels[rows])
        assert np.isfinite(out["loss"]) and out["loss"] > 0
        net.backward()
    assert np.abs(net.params["ip"][0].diff).sum() > 0


def test_set_input_arrays_refusals_are_pycaffes(memnet, lenet):
    net = caffe.Net(memnet, caffe.TEST)
    good, labels = np.zeros((8, 2, 3, 3), np.float32), np.zeros(8, np.float32)
    for bad, msg in ((good.astype(np.float64), "data array must be float32"),
                     (np.zeros((8, 3, 3, 2), np.float32).transpose(0, 3, 1, 2), "data array must be C contiguous"),
                     (np.zeros((8, 18), np.float32), "data array must be 4-d"),
                     (np.zeros((8, 1, 3, 3), np.float32), "data array has wrong channels"),
                     (good[:6], "data and labels must have the same first dimension")):
        with pytest.raises(RuntimeError, match=msg):
            net.set_input_arrays(bad, labels)
    with pytest.raises(RuntimeError, match="multiple of batch size"):
        net.set_input_arrays(good[:6], labels[:6])
    with pytest.raises(RuntimeError, match="labels array must be float32"):
        net.set_input_arrays(good, labels.astype(np.int64))
    with pytest.raises(RuntimeError, match=r'first layer is a MemoryDataLayer \(layer "data" is Input\)'):
        caffe.Net(str(lenet["deploy"]), caffe.TEST).set_input_arrays(good, labels)


def test_solver_trains_from_set_input_arrays(memnet, tmp_path):
    (tmp_path / "solver.prototxt").write_text(f'net: "{memnet}" base_lr: 0.5 lr_policy: "fixed" max_iter: 30 '
                                              f'display: 0 random_seed: 1 snapshot_after_train: false')
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 3, 16)
    data = (rng.standard_normal((16, 2, 3, 3)) + 2 * labels[:, None, None, None]).astype(np.float32)
    solver = caffe.SGDSolver(str(tmp_path / "solver.prototxt"))
    solver.net.set_input_arrays(data, labels.astype(np.float32))
    solver.step(1)
    first = float(solver.net.blobs["loss"].data)
    solver.step(20)
    assert float(solver.net.blobs["loss"].data) < 0.7 * first


def test_hdf5_weights_round_trip(lenet, trained, tmp_path, capsys):
    net = caffe.Net(str(lenet["deploy"]), str(trained), caffe.TEST)
    h5 = tmp_path / "lenet.caffemodel.h5"
    net.save_hdf5(str(h5))
    with h5py.File(h5, "r") as f:                 # Caffe's layout: data/<layer>/<param index>
        assert sorted(f["data"]) == sorted(net._layer_names)
        assert f["data/conv1/0"].shape == (20, 1, 5, 5) and f["data/conv1/0"].dtype == np.float32
        np.testing.assert_array_equal(f["data/ip2/1"][...], net.params["ip2"][1].data)
        assert len(f["data/pool1"]) == 0 and "diff" not in f
    loaded = caffe.Net(str(lenet["deploy"]), str(h5), caffe.TEST)       # told from a caffemodel as Caffe does
    other = caffe.Net(str(lenet["deploy"]), caffe.TEST)
    other.load_hdf5(str(h5))
    x = np.random.default_rng(2).random((10, 1, 28, 28), np.float32)
    want = net.forward(data=x)["prob"].copy()
    for n in (loaded, other):
        for name in net.params:
            for a, b in zip(net.params[name], n.params[name]):
                np.testing.assert_array_equal(a.data, b.data)
        np.testing.assert_array_equal(n.forward(data=x)["prob"], want)
    from sncaffe.cli import main                    # Caffe's command line takes them too, to the same result
    scores = []
    for weights in (h5, trained):
        capsys.readouterr()
        assert main(["test", "-model", str(lenet["train_val"]), "-weights", str(weights), "-iterations", "1"]) == 0
        scores.append(re.findall(r"\] (accuracy|loss) = ([0-9.e-]+)", capsys.readouterr().out))
    assert scores[0] == scores[1] and len(scores[0]) == 2
    with h5py.File(h5, "a") as f:
        del f["data/ip1/0"]
        f["data/ip1/0"] = np.zeros((500, 10), np.float32)
    with pytest.raises(ValueError, match=r'layer "ip1" blob 0: .*shape mismatch: source shape \(500, 10\), '
                                         r"target shape \(500, 800\)"):
        other.copy_from(str(h5))


def test_hdf5_shared_parameters_written_by_their_owner(tmp_path):
    (tmp_path / "shared.prototxt").write_text("""name: "shared"
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 4 } } }
layer { name: "a" type: "InnerProduct" bottom: "x" top: "a" param { name: "w" } param { name: "b" }
  inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 1 } bias_filler { type: "gaussian" std: 1 } } }
layer { name: "b" type: "InnerProduct" bottom: "a" top: "b" param { name: "w" } param { name: "b" }
  inner_product_param { num_output: 4 } }
""")
    net = caffe.Net(str(tmp_path / "shared.prototxt"), caffe.TEST)
    net.save_hdf5(str(tmp_path / "w.h5"))
    with h5py.File(tmp_path / "w.h5", "r") as f:
        assert sorted(f["data/a"]) == ["0", "1"] and len(f["data/b"]) == 0
    caffe.set_random_seed(7)
    try:
        fresh = caffe.Net(str(tmp_path / "shared.prototxt"), caffe.TEST)
    finally:
        caffe.set_random_seed(0)
    fresh.copy_from(str(tmp_path / "w.h5"))
    np.testing.assert_array_equal(fresh.params["b"][0].data, net.params["a"][0].data)


CONV = """name: "conv"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 4 dim: 3 dim: 6 dim: 6 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "relu1" }
layer { name: "pool1" type: "Pooling" bottom: "relu1" top: "pool1" pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool1" top: "ip" inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@pytest.mark.parametrize("memory", ["none", "recompute"])
def test_forward_and_backward_callbacks(tmp_path, memory, monkeypatch):
    (tmp_path / "conv.prototxt").write_text(CONV)
    # NumPy's pooling: oneDNN's blocked pooling (AVX2 machines) holds a copy of relu1 in its
    # workspace, and recomputing relu1 and pool1 would not lower that peak
    monkeypatch.setattr(pooling, "ONEDNN", False)
    net = caffe.Net(str(tmp_path / "conv.prototxt"), caffe.TRAIN, memory=memory)
    # relu1, pool1 recomputed in backward (conv1's 16 channels make that lower the peak)
    assert (memory == "recompute") == bool(net.memory_plan.dropped)
    net.blobs["data"].data[...] = np.random.default_rng(0).standard_normal((4, 3, 6, 6))
    seen = []
    for when in ("before_forward", "after_forward", "before_backward", "after_backward"):
        getattr(net, when)(lambda i, when=when: seen.append((when, i)))
    net.forward()
    n = len(net.layers)
    assert seen == [(w, i) for i in range(n) for w in ("before_forward", "after_forward")]  # never for recomputations
    seen.clear()
    net.backward()
    assert {w for w, _ in seen} == {"before_backward", "after_backward"}    # replays call none
    order = [i for w, i in seen if w == "before_backward"]
    assert order == sorted(order, reverse=True) and net._layer_names.index("conv1") in order
    assert [i for w, i in seen if w == "after_backward"] == order
    assert seen[0] == ("before_backward", order[0]) and seen[1] == ("after_backward", order[0])


def test_after_backward_on_a_solvers_net(lenet):
    solver = caffe.SGDSolver(str(lenet["solver"]))
    grads = []
    conv1 = solver.net._layer_names.index("conv1")
    solver.net.after_backward(lambda i: grads.append(np.abs(solver.net.params["conv1"][0].diff).sum())
                              if i == conv1 else None)
    solver.step(2)
    assert len(grads) == 2 and all(g > 0 for g in grads)


def test_solver_add_callback_and_share_weights(lenet):
    solver = caffe.SGDSolver(str(lenet["solver"]))
    events = []
    solver.add_callback(lambda: events.append(("start", solver.iter)),
                        lambda: events.append(("ready", solver.iter,
                                               float(np.abs(solver.net.params["ip2"][0].diff).sum()))))
    solver.step(2)
    assert [e[:2] for e in events] == [("start", 0), ("ready", 0), ("start", 1), ("ready", 1)]
    assert all(e[2] > 0 for e in events if e[0] == "ready")          # the gradients are there
    deploy = caffe.Net(str(lenet["deploy"]), caffe.TEST)
    solver.share_weights(deploy)
    solver.step(1)                                                   # the deploy net sees the update
    np.testing.assert_array_equal(deploy.params["conv1"][0].data, solver.net.params["conv1"][0].data)
