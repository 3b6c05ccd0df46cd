"""Each parameter updated in backward as soon as its gradient is complete: the bits of Caffe's
update after backward, in every memory mode and solver type, with the gradients then scheduled
(a layer at a time) instead of held all iteration."""
import numpy as np
import pytest

from sncaffe.backend.cpu import CPUDevice
from sncaffe.cli import main
from sncaffe.graph import build_graph, update_in_backward
from sncaffe.plan.planner import MODES, make_plan
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text
from sncaffe.solver import Solver
from sncaffe.prototxt import prepare_net

# A fused BatchNorm + Scale (BatchNorm's backward reads the Scale's factors after the Scale's own
# backward), two convolutions sharing one weight, an Eltwise + ReLU shortcut, a frozen layer
# (lr_mult 0) and BatchNorm's statistics (updated after backward, as they have no gradient).
NET = """name: "mixed"
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "msra" }
                            bias_filler { type: "uniform" min: -0.1 max: 0.1 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2" param { name: "w" } param { name: "b" }
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "conv3" type: "Convolution" bottom: "conv2" top: "conv3" param { name: "w" } param { name: "b" }
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "sum" type: "Eltwise" bottom: "conv1" bottom: "conv3" top: "sum" }
layer { name: "relu3" type: "ReLU" bottom: "sum" top: "sum" }
layer { name: "frozen" type: "InnerProduct" bottom: "sum" top: "frozen" param { lr_mult: 0 } param { lr_mult: 0 }
        inner_product_param { num_output: 6 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "frozen" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""

SOLVERS = {
    "SGD": "momentum: 0.9 weight_decay: 0.01",
    "Nesterov": "momentum: 0.9 weight_decay: 0.01 regularization_type: \"L1\"",
    "AdaGrad": "weight_decay: 0.01 delta: 1e-6",
    "RMSProp": "weight_decay: 0.01 rms_decay: 0.95",
    "AdaDelta": "momentum: 0.95 weight_decay: 0.01 base_lr: 1.0",
    "Adam": "momentum: 0.9 momentum2: 0.999 weight_decay: 0.01 base_lr: 0.01",
}


def solver_param(solver_type, mode, **fields):
    p = parse_text(f'type: "{solver_type}" lr_policy: "step" gamma: 0.5 stepsize: 2 max_iter: 3 display: 0 '
                   f"random_seed: 5 snapshot_after_train: false " + SOLVERS[solver_type], pb.SolverParameter())
    if not p.HasField("base_lr"):
        p.base_lr = 0.05
    for k, v in fields.items():
        setattr(p, k, v)
    p.net_param.CopyFrom(parse_text(NET, pb.NetParameter()))
    p.memory_param.mode = mode
    return p


def feed(net, it):
    rng = np.random.default_rng(it)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape)
    net.blobs["label"].data[...] = rng.integers(0, 3, net.blobs["label"].shape)


def run(solver_type, mode, fused, iters=3):
    solver = Solver(solver_param(solver_type, mode), device=CPUDevice("64MiB"), feed=feed,
                    update_in_backward=fused)
    peaks = []
    for _ in range(iters):
        solver.device.pool.reset_peak()
        solver.step(1)
        peaks.append(solver.device.pool.peak)
    state = {f"{name}[{i}]": b.data.copy() for name, blobs in solver.net.params.items() for i, b in enumerate(blobs)}
    state.update((f"history{k}", h.copy()) for k, h in enumerate(solver.history))
    return solver, peaks, state


_reference = {}


def reference(solver_type):
    if solver_type not in _reference:
        _reference[solver_type] = run(solver_type, "none", False)
    return _reference[solver_type]


@pytest.mark.parametrize("solver_type", list(SOLVERS))
@pytest.mark.parametrize("mode", MODES)
def test_update_in_backward_gives_the_bits_of_the_update_after_backward(solver_type, mode):
    _, _, ref = reference(solver_type)
    solver, peaks, state = run(solver_type, mode, True)
    assert solver.update_at, "no parameter was updated in backward"
    assert peaks == [solver.net.plan.peak] * len(peaks), "pool peak != planned peak"
    differ = [k for k in ref if state[k].tobytes() != ref[k].tobytes()]
    assert not differ, f"differs from the update after backward in {differ}"


def test_which_parameters_and_where():
    graph = build_graph(prepare_net(parse_text(NET, pb.NetParameter()), pb.TRAIN), pb.TRAIN)
    at = update_in_backward(graph)
    names = {op: [f"{graph.learnable[k].layer}[{graph.learnable[k].index}]" for k in ks] for op, ks in at.items()}
    # the shared weight after its first holder's backward (conv2 runs backward after conv3);
    # the Scale's factors after BatchNorm's backward, which reads them; its bias after its own
    assert names["conv2:backward"] == ["conv2[0]", "conv2[1]"]
    assert names["bn1:backward"] == ["scale1[0]"]
    assert names["scale1:backward"] == ["scale1[1]"]
    assert names["conv1:backward"] == ["conv1[0]", "conv1[1]"]
    assert names["ip:backward"] == ["ip[0]", "ip[1]"]
    learned = {f"{q.layer}[{q.index}]" for q in graph.learnable} - {n for v in names.values() for n in v}
    assert learned == {"bn1[0]", "bn1[1]", "bn1[2]", "frozen[0]", "frozen[1]"}
    # their gradients are scheduled, not persistent: the liveness plan holds less
    plain = build_graph(prepare_net(parse_text(NET, pb.NetParameter()), pb.TRAIN), pb.TRAIN)
    fused, kept = make_plan(graph, "liveness"), make_plan(plain, "liveness")
    grads = sum(r.block_bytes for r in graph.updated_in_backward.values())
    assert fused.persistent_bytes == kept.persistent_bytes - grads
    assert fused.peak < kept.peak


@pytest.mark.parametrize("fields", [dict(clip_gradients=1.0), dict(iter_size=2), dict(debug_info=True),
                                    dict(snapshot_diff=True)])
def test_left_after_backward_where_an_update_needs_more_than_its_gradient(fields):
    solver = Solver(solver_param("SGD", "liveness", **fields), device=CPUDevice("64MiB"), feed=feed,
                    update_in_backward=True)
    assert solver.update_at == {}
    assert not getattr(solver.net.graph, "updated_in_backward", None)
    solver.step(1)


def test_train_updates_in_backward(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mixed.prototxt").write_text(NET)
    assert main(["train", "mixed.prototxt", "--max-iter", "2", "--snapshot-prefix", "out/m"]) == 0
    assert "Parameters updated in backward as their gradients complete: 8 of 13" in capsys.readouterr().out


def test_plan_plans_as_train_does(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mixed.prototxt").write_text(NET)
    assert main(["plan", "mixed.prototxt"]) == 0
    out = capsys.readouterr().out
    assert "parameters updated in backward as their gradients complete (as train does without " \
           "clip_gradients or iter_size): 8 gradients" in out


# -- every net of prototxt/ and the zoo, shrunk as tests/plan/test_modes.py shrinks them ----------------------

def _modes_helpers():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).parent / "plan" / "test_modes.py"
    spec = importlib.util.spec_from_file_location("_test_modes_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TM = _modes_helpers()
SGD = parse_text('type: "SGD" base_lr: 0.01 momentum: 0.9 weight_decay: 0.0005 lr_policy: "fixed" max_iter: 2 '
                 "display: 0 random_seed: 3 snapshot_after_train: false", pb.SolverParameter())


def _train_net(path, mode, fused):
    param = pb.SolverParameter()
    param.CopyFrom(SGD)
    param.net_param.CopyFrom(TM.net_param(path))
    param.memory_param.mode = mode
    solver = Solver(param, device=CPUDevice("1GiB"), update_in_backward=fused,
                    feed=lambda net, it: TM.feed(net, np.random.default_rng(it)))
    TM.init_weights(solver.net, np.random.default_rng(0))
    peaks = []
    for _ in range(2):
        solver.device.pool.reset_peak()
        solver.step(1)
        peaks.append(solver.device.pool.peak)
    state = {f"{name}[{i}]": b.data.copy() for name, blobs in solver.net.params.items() for i, b in enumerate(blobs)}
    return solver, peaks, state


@pytest.mark.parametrize("path", [pytest.param(p, id=f"{p.parent.name}/{p.name}") for p in TM.OWN + TM.ZOO
                                  if "loss" in p.read_text().lower()])
def test_every_net_of_prototxt_and_the_zoo_trains_alike(path):
    _, _, ref = _train_net(path, "none", False)
    for mode in ("liveness", "recompute"):
        solver, peaks, state = _train_net(path, mode, True)
        assert solver.update_at
        assert peaks == [solver.net.plan.peak] * 2, mode
        differ = [k for k in ref if state[k].tobytes() != ref[k].tobytes()]
        assert not differ, (mode, differ[:5])
