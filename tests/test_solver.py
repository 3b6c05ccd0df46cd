"""The solvers on small Input-layer nets: update arithmetic by hand, lr policies, the loop, snapshots."""
import logging

from dataclasses import replace

import numpy as np
import pytest

from sncaffe import config
from sncaffe import Net
from sncaffe.backend.cpu import CPUDevice
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text
from sncaffe.solver import (POLICIES, RULES, SnapshotError, Solver, SolverParamError, TrainingError,
                            learning_rate)

NET = """
name: "tiny"
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: %(batch)d dim: 6 } shape { dim: %(batch)d } } }
layer { name: "ip1" type: "InnerProduct" bottom: "data" top: "ip1" %(ip1_params)s
        inner_product_param { num_output: %(hidden)d weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "uniform" min: -0.2 max: 0.2 } } }
layer { name: "relu" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "uniform" min: -0.2 max: 0.2 } } }
layer { name: "acc" type: "Accuracy" bottom: "ip2" bottom: "label" top: "acc" include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""
IP1_PARAMS = "param { lr_mult: 1 } param { lr_mult: 2 decay_mult: 0 }"

RNG = np.random.default_rng(7)
X = RNG.standard_normal((48, 6)).astype(np.float32)
Y = RNG.integers(0, 3, 48).astype(np.float32)


def net_param(batch=4, hidden=5, ip1_params=IP1_PARAMS):
    return parse_text(NET % dict(batch=batch, hidden=hidden, ip1_params=ip1_params), pb.NetParameter())


def solver_param(tmp_path, text="", batch=4, hidden=5, ip1_params=IP1_PARAMS, **fields):
    p = parse_text(text, pb.SolverParameter())
    defaults = dict(base_lr=0.1, lr_policy="fixed", max_iter=4, random_seed=11, display=0,
                    snapshot_prefix=str(tmp_path / "snap"))
    for k, v in {**defaults, **fields}.items():
        if not p.HasField(k):
            setattr(p, k, v)
    if not (p.HasField("net_param") or p.HasField("train_net_param")):
        p.net_param.CopyFrom(net_param(batch, hidden, ip1_params))
    return p


def feed_by_iteration(net, i):
    """Batch i of X (train) or test batch i, from the iteration number alone (so a resumed run sees the same)."""
    b = net.blobs["data"].data.shape[0]
    j = (i * b + (24 if net.phase == pb.TEST else 0)) % 48
    net.blobs["data"].data[...] = X[j:j + b]
    net.blobs["label"].data[...] = Y[j:j + b]


class SequentialFeed:
    """Consecutive rows, like a data layer, whatever the iteration: for iter_size."""

    def __init__(self):
        self.pos = 0

    def __call__(self, net, i):
        b = net.blobs["data"].data.shape[0]
        net.blobs["data"].data[...] = X[self.pos:self.pos + b]
        net.blobs["label"].data[...] = Y[self.pos:self.pos + b]
        self.pos = (self.pos + b) % 48


def make(tmp_path, text="", feed=feed_by_iteration, **fields):
    return Solver(solver_param(tmp_path, text, **fields), device=CPUDevice(32 << 20), feed=feed)


def params(solver):
    return {f"{name}[{i}]": b.data.copy() for name, blobs in solver.net.params.items() for i, b in enumerate(blobs)}


# -- the update arithmetic, by hand ------------------------------------------

class Reference:
    """Gradients from an independent Net, and Caffe's update formulas written out in float64."""

    def __init__(self, solver):
        self.net = Net(solver.net.graph.param, "TRAIN", device=CPUDevice(8 << 20))
        self.p = solver.param
        self.specs = [(name, i, (1.0, 1.0) if (name, i) != ("ip1", 1) else (2.0, 0.0))
                      for name, blobs in solver.net.params.items() for i in range(len(blobs))]
        self.hist = {}

    def gradient(self, w, it):
        for name, i, _ in self.specs:
            self.net.params[name][i].data[...] = w[f"{name}[{i}]"]
        feed_by_iteration(self.net, it)
        self.net.clear_param_diffs()
        self.net.forward()
        self.net.backward()
        return {f"{name}[{i}]": self.net.params[name][i].diff.astype(np.float64) for name, i, _ in self.specs}

    def step(self, w, it):
        p, kind = self.p, self.p.type
        grads = self.gradient(w, it)
        out = {}
        for name, i, (lr_mult, decay_mult) in self.specs:
            k = f"{name}[{i}]"
            x = w[k].astype(np.float64)
            reg = np.sign(x) if p.regularization_type == "L1" else x
            g = grads[k] + np.float64(np.float32(p.weight_decay)) * decay_mult * reg
            lr, m, d = float(np.float32(p.base_lr)) * lr_mult, float(np.float32(p.momentum)), p.delta
            h1, h2 = self.hist.get(k, (np.zeros_like(x), np.zeros_like(x)))
            if kind == "SGD":
                h1 = m * h1 + lr * g
                step = h1
            elif kind == "Nesterov":
                old, h1 = h1, m * h1 + lr * g
                step = (1 + m) * h1 - m * old
            elif kind == "AdaGrad":
                h1 = h1 + g * g
                step = lr * g / (np.sqrt(h1) + d)
            elif kind == "RMSProp":
                r = float(np.float32(p.rms_decay))
                h1 = r * h1 + (1 - r) * g * g
                step = lr * g / (np.sqrt(h1) + d)
            elif kind == "AdaDelta":
                h1 = m * h1 + (1 - m) * g * g
                dx = g * np.sqrt((h2 + d) / (h1 + d))
                h2 = m * h2 + (1 - m) * dx * dx
                step = lr * dx
            elif kind == "Adam":
                b2, t = float(np.float32(p.momentum2)), it + 1
                h1 = m * h1 + (1 - m) * g
                h2 = b2 * h2 + (1 - b2) * g * g
                step = lr * np.sqrt(1 - b2 ** t) / (1 - m ** t) * h1 / (np.sqrt(h2) + d)
            self.hist[k] = (h1, h2)
            out[k] = x - step
        return out


HYPER = {"SGD": "momentum: 0.9", "Nesterov": "momentum: 0.9", "AdaGrad": "delta: 1e-6",
         "RMSProp": "rms_decay: 0.9 delta: 1e-6", "AdaDelta": "momentum: 0.9 delta: 1e-4",
         "Adam": "momentum: 0.9 momentum2: 0.99 delta: 1e-6"}


def close(a, b, rtol=3e-5):
    """Relative to the blob's magnitude, so values near zero do not need an absolute guess."""
    scale = max(np.abs(b).max(), 1e-30)
    return np.abs(a - b).max() <= rtol * scale


@pytest.mark.parametrize("reg", ["L2", "L1"])
@pytest.mark.parametrize("kind", list(RULES))
def test_first_two_updates_equal_the_formulas(tmp_path, kind, reg):
    s = make(tmp_path, f'type: "{kind}" {HYPER[kind]} weight_decay: 0.05 regularization_type: "{reg}"',
             base_lr=0.5 if kind == "AdaDelta" else 0.05)
    ref = Reference(s)
    w = params(s)
    for it in range(2):
        w = ref.step(w, it)
        s.step(1)
        got = params(s)
        for k in w:
            assert close(got[k], w[k]), (kind, reg, it, k, np.abs(got[k] - w[k]).max())
    n = len(ref.specs)
    assert len(s.history) == n * RULES[kind].n_history
    for j, (name, i, _) in enumerate(ref.specs):
        h1, h2 = ref.hist[f"{name}[{i}]"]
        assert close(s.history[j], h1)
        if RULES[kind].n_history == 2:
            assert close(s.history[n + j], h2)


def test_history_is_carved_from_the_device_pool(tmp_path):
    s = make(tmp_path, 'type: "Adam"')
    arena = s.device.arena
    assert all(np.shares_memory(h, arena) for h in s.history)
    assert [h.shape for h in s.history] == 2 * [b.data.shape for bl in s.net.params.values() for b in bl]


def test_lr_mult_zero_is_never_updated_but_keeps_a_history(tmp_path):
    s = make(tmp_path, 'type: "Adam" weight_decay: 0.1', ip1_params="param { lr_mult: 0 } param { lr_mult: 0 }")
    before = params(s)
    s.step(3)
    after = params(s)
    assert np.array_equal(after["ip1[0]"], before["ip1[0]"]) and np.array_equal(after["ip1[1]"], before["ip1[1]"])
    assert not np.array_equal(after["ip2[0]"], before["ip2[0]"])
    assert len(s.history) == 8
    # as in Caffe, weight decay still reaches the history of a frozen parameter
    assert np.abs(s.history[0]).max() > 0


def test_clip_gradients_scales_the_global_norm(tmp_path):
    def first_step(clip):
        s = make(tmp_path, f"clip_gradients: {clip}", base_lr=1.0, ip1_params="")   # the step is the gradient
        w0 = params(s)
        s.step(1)
        return {k: w0[k].astype(np.float64) - v for k, v in params(s).items()}

    free = first_step(-1)
    norm = np.sqrt(sum((d ** 2).sum() for d in free.values()))
    clipped = first_step(norm / 4)
    assert np.isclose(np.sqrt(sum((d ** 2).sum() for d in clipped.values())), norm / 4, rtol=1e-5)
    for k in free:
        np.testing.assert_allclose(clipped[k], free[k] / 4, rtol=1e-4, atol=1e-7 * norm)
    unclipped = first_step(norm * 2)
    for k in free:
        np.testing.assert_array_equal(unclipped[k], free[k])


# -- learning-rate policies ---------------------------------------------------

def lr_param(**kw):
    p = pb.SolverParameter(base_lr=0.1, gamma=0.5, power=0.75, stepsize=3, max_iter=10)
    for k, v in kw.items():
        setattr(p, k, v) if not isinstance(v, list) else getattr(p, k).extend(v)
    return p


F = float(np.float32(0.1))
POLICY_CASES = {
    "fixed": lambda it: F,
    "step": lambda it: F * 0.5 ** (it // 3),
    "exp": lambda it: F * 0.5 ** it,
    "inv": lambda it: F * (1 + 0.5 * it) ** -0.75,
    "multistep": lambda it: F * 0.5 ** sum(it >= v for v in (2, 5, 9)),
    "poly": lambda it: F * (1 - it / 10) ** 0.75,
    "sigmoid": lambda it: F / (1 + np.exp(-0.5 * (it - 3))),
}


@pytest.mark.parametrize("policy", POLICIES)
def test_lr_policy_values(policy):
    p = lr_param(lr_policy=policy, stepvalue=[2, 5, 9])
    step = 0
    for it in range(10):
        rate, step = learning_rate(p, it, step)
        assert np.isclose(rate, POLICY_CASES[policy](it), rtol=1e-6), (policy, it)
    if policy == "multistep":
        assert step == 3
    if policy == "step":
        assert step == 3     # current_step = iter // stepsize, saved in the .solverstate


@pytest.mark.parametrize("fields, message", [
    (dict(lr_policy="steps"), 'unknown lr_policy "steps"'),
    (dict(lr_policy="step", stepsize=0), "stepsize > 0"),
    (dict(type="Adamw"), 'unknown solver type "Adamw"'),
    (dict(type="AdaGrad", momentum=0.9), "momentum cannot be used with AdaGrad"),
    (dict(solver_type=pb.SolverParameter.ADAM, type="SGD"), "disagree"),
    (dict(snapshot_format=pb.SolverParameter.HDF5), "HDF5 is not supported"),
    (dict(iter_size=0), "iter_size"),
    (dict(regularization_type="L3"), 'unknown regularization_type "L3"'),
])
def test_bad_settings_are_clear_errors(tmp_path, fields, message):
    with pytest.raises(SolverParamError, match=message):
        make(tmp_path, **fields)


def test_legacy_solver_type_enum(tmp_path):
    s = make(tmp_path, "solver_type: NESTEROV")
    assert s.rule.type == "Nesterov"


# -- the loop ---------------------------------------------------------------

@pytest.mark.parametrize("kind", list(RULES))
def test_n_iterations_equal_half_snapshot_resume_half_to_the_last_bit(tmp_path, kind, monkeypatch):
    text = (f'type: "{kind}" {HYPER[kind]} weight_decay: 0.01 '
            'lr_policy: "multistep" gamma: 0.5 stepvalue: 1 stepvalue: 4')
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    straight = make(tmp_path, text, max_iter=6, snapshot=3, snapshot_prefix="snap")
    straight.solve()
    monkeypatch.chdir(tmp_path / "b")
    make(tmp_path, text, max_iter=3, snapshot_prefix="snap").solve()
    resumed = make(tmp_path, text, max_iter=6, snapshot_prefix="snap")
    resumed.solve(resume_file="snap_iter_3.solverstate")
    assert resumed.iter == 6 and resumed.current_step == straight.current_step == 2
    for k, v in params(straight).items():
        assert np.array_equal(params(resumed)[k], v), k
    for a, b in zip(straight.history, resumed.history):
        assert np.array_equal(a, b)
    for name in ("snap_iter_3.caffemodel", "snap_iter_3.solverstate", "snap_iter_6.caffemodel",
                 "snap_iter_6.solverstate"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_iter_size_k_at_batch_b_equals_batch_k_times_b(tmp_path):
    text = 'type: "SGD" momentum: 0.9 weight_decay: 0.01'
    small = make(tmp_path, text + " iter_size: 3", batch=2, feed=SequentialFeed())
    big = make(tmp_path, text, batch=6, feed=SequentialFeed())
    losses = {}
    for name, s in (("small", small), ("big", big)):
        s.callbacks.append(lambda it, loss, lr, name=name: losses.setdefault(name, []).append(loss))
        s.step(4)
    np.testing.assert_allclose(losses["small"], losses["big"], rtol=1e-5)
    for k, v in params(big).items():
        np.testing.assert_allclose(params(small)[k], v, rtol=1e-5, atol=1e-6)


def test_average_loss_smooths_the_displayed_loss(tmp_path):
    raw, smooth = [], []
    a = make(tmp_path)
    a.callbacks.append(lambda it, loss, lr: raw.append(loss))
    a.step(5)
    b = make(tmp_path, average_loss=3)
    b.callbacks.append(lambda it, loss, lr: smooth.append(loss))
    b.step(5)
    expect = [np.mean(raw[max(0, i - 2):i + 1]) for i in range(5)]
    np.testing.assert_allclose(smooth, expect, rtol=1e-6)


def test_random_seed_makes_a_run_repeatable(tmp_path):
    a, b, c = make(tmp_path), make(tmp_path), make(tmp_path, random_seed=12)
    assert all(np.array_equal(v, params(b)[k]) for k, v in params(a).items())
    assert not np.array_equal(params(a)["ip1[0]"], params(c)["ip1[0]"])
    a.step(3)
    b.step(3)
    assert all(np.array_equal(v, params(b)[k]) for k, v in params(a).items())


def test_solve_logs_like_caffe_and_tests_with_the_train_weights(tmp_path, caplog):
    s = make(tmp_path, "test_iter: 2 test_interval: 3", max_iter=6, display=2, snapshot=3)
    test_net = s.test_nets[0]
    assert np.shares_memory(test_net.params["ip1"][0].data, s.net.params["ip1"][0].data)
    with caplog.at_level(logging.INFO, logger="sncaffe"):
        s.solve()
    lines = [r.getMessage() for r in caplog.records]
    for expected in ("Solving tiny", "Learning Rate Policy: fixed", "Iteration 0, Testing net (#0)",
                     "Iteration 3, Testing net (#0)", "Iteration 6, Testing net (#0)",
                     "Iteration 2, lr = 0.1", f"Snapshotting to binary proto file {tmp_path}/snap_iter_3.caffemodel",
                     f"Snapshotting solver state to binary proto file {tmp_path}/snap_iter_6.solverstate",
                     "Optimization Done."):
        assert expected in lines, expected
    assert not any(line.startswith("Iteration 1 (") for line in lines)          # display: 2
    assert any(line.startswith("Iteration 2 (") and "iter/s" in line and ", loss = " in line for line in lines)
    assert any(line.startswith("Iteration 6, loss = ") for line in lines)       # the extra forward
    assert any(line.startswith("    Train net output #0: loss = ") and "(* 1 = " in line for line in lines)
    # test outputs are the mean over test_iter batches, in Caffe's (sorted) output order
    acc, loss = [], []
    for k in range(2):
        feed_by_iteration(test_net, k)
        loss.append(test_net.forward())
        acc.append(float(test_net.blobs["acc"].data))
    assert s.test_scores[0]["acc"] == pytest.approx(np.mean(acc), rel=1e-6)
    assert s.test_scores[0]["loss"] == pytest.approx(np.mean(loss), rel=1e-6)
    out = [line for line in lines if line.startswith("    Test net output")][-2:]
    assert out[0].startswith("    Test net output #0: acc = ") and "(* 1 =" not in out[0]
    assert out[1].startswith("    Test net output #1: loss = ") and "(* 1 = " in out[1]


def test_test_initialization_false_and_test_and_train_state(tmp_path, caplog):
    p = solver_param(tmp_path, 'test_iter: 1 test_interval: 2 test_initialization: false '
                               'test_state { stage: "val" } train_state { level: 3 }', max_iter=2)
    p.net_param.layer[4].include[0].stage.append("val")     # acc only in the "val" stage
    s = Solver(p, device=CPUDevice(32 << 20), feed=feed_by_iteration)
    assert "acc" in s.test_nets[0].outputs
    assert s.net.graph.param.state.level == 3 and s.net.graph.param.state.phase == pb.TRAIN
    with caplog.at_level(logging.INFO, logger="sncaffe"):
        s.solve()
    lines = [r.getMessage() for r in caplog.records]
    assert "Iteration 0, Testing net (#0)" not in lines and "Iteration 2, Testing net (#0)" in lines


def test_request_stop_snapshots_and_returns(tmp_path, caplog):
    s = make(tmp_path, max_iter=10, snapshot=4, snapshot_after_train=False)
    s.callbacks.append(lambda it, loss, lr: s.request_stop() if it == 3 else None)
    with caplog.at_level(logging.INFO, logger="sncaffe"):
        s.solve()
    assert s.iter == 3
    assert (tmp_path / "snap_iter_3.caffemodel").exists() and (tmp_path / "snap_iter_3.solverstate").exists()
    assert "Optimization stopped early." in [r.getMessage() for r in caplog.records]


def test_request_snapshot_writes_one_and_goes_on(tmp_path):
    s = make(tmp_path, max_iter=4, snapshot_after_train=False)
    s.callbacks.append(lambda it, loss, lr: s.request_snapshot() if it == 2 else None)
    s.solve()
    assert s.iter == 4 and sorted(p.name for p in tmp_path.glob("snap_iter_*")) == \
        ["snap_iter_2.caffemodel", "snap_iter_2.solverstate"]


def test_snapshot_prefix_defaults_to_the_solver_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(NET % dict(batch=4, hidden=5, ip1_params=IP1_PARAMS))
    (tmp_path / "runs").mkdir()
    (tmp_path / "my_solver.prototxt").write_text('net: "net.prototxt" base_lr: 0.1 lr_policy: "fixed" max_iter: 1')
    assert Solver("my_solver.prototxt").param.snapshot_prefix == "my_solver"
    (tmp_path / "my_solver.prototxt").write_text('net: "net.prototxt" base_lr: 0.1 lr_policy: "fixed" '
                                                 'snapshot_prefix: "runs" max_iter: 1')
    assert Solver("my_solver.prototxt").param.snapshot_prefix == "runs/my_solver"


# -- snapshots -----------------------------------------------------------------

def test_snapshot_files_round_trip_and_parse_as_caffe_messages(tmp_path):
    s = make(tmp_path, 'type: "Adam"', max_iter=2)
    s.solve()
    model = (tmp_path / "snap_iter_2.caffemodel").read_bytes()
    state_bytes = (tmp_path / "snap_iter_2.solverstate").read_bytes()
    net = pb.NetParameter.FromString(model)
    state = pb.SolverState.FromString(state_bytes)
    assert net.SerializeToString() == model and state.SerializeToString() == state_bytes
    assert state.iter == 2 and state.learned_net == f"{tmp_path}/snap_iter_2.caffemodel"
    assert len(state.history) == 8
    for h, mine in zip(state.history, s.history):
        assert tuple(h.shape.dim) == mine.shape
        np.testing.assert_array_equal(np.asarray(h.data, np.float32).reshape(mine.shape), mine)
    blobs = {lp.name: lp.blobs for lp in net.layer if lp.blobs}
    assert list(blobs) == ["ip1", "ip2"]
    for name, bl in s.net.params.items():
        for bp, b in zip(blobs[name], bl):
            np.testing.assert_array_equal(np.asarray(bp.data, np.float32).reshape(b.shape), b.data)
    again = make(tmp_path, 'type: "Adam"', max_iter=2)
    again.restore(tmp_path / "snap_iter_2.solverstate")
    assert again.iter == 2
    assert all(np.array_equal(a, b) for a, b in zip(again.history, s.history))
    assert all(np.array_equal(v, params(s)[k]) for k, v in params(again).items())


def test_learned_net_is_found_next_to_the_solverstate(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make(tmp_path, max_iter=1, snapshot_prefix="snap").solve()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    s = make(tmp_path, max_iter=1)
    s.restore(tmp_path / "snap_iter_1.solverstate")
    assert s.iter == 1


@pytest.fixture
def saved(tmp_path):
    s = make(tmp_path, 'type: "SGD" momentum: 0.9', max_iter=1)
    s.solve()
    return tmp_path / "snap_iter_1.solverstate"


@pytest.mark.parametrize("other, message", [
    (dict(hidden=7), r'history blob 0 has shape \(5, 6\), but parameter 0 of layer "ip1" has shape \(7, 6\)'),
    (dict(text='type: "Adam"'), "holds 4 history blobs, but Adam on this net needs 8.*another type"),
])
def test_state_from_a_different_net_or_solver_is_a_clear_error(tmp_path, saved, other, message):
    s = make(tmp_path, **other)
    before = params(s)
    with pytest.raises(SnapshotError, match=message):
        s.restore(saved)
    assert s.iter == 0 and all(np.array_equal(v, params(s)[k]) for k, v in before.items())


def test_caffemodel_from_a_different_net_names_the_layer(tmp_path, saved):
    p = solver_param(tmp_path)
    p.net_param.layer[3].name = "fc"           # ip2 renamed: same shapes, different net
    p.net_param.layer[3].ClearField("include")
    s = Solver(p, device=CPUDevice(32 << 20), feed=feed_by_iteration)
    with pytest.raises(SnapshotError, match='layer "fc" \\(InnerProduct\\) of the net has no parameters in the file'):
        s.restore(saved)


def test_corrupt_or_missing_snapshot_files(tmp_path, saved):
    bad = tmp_path / "bad.solverstate"
    bad.write_bytes(b"\xff\xff\xff not a protobuf")
    with pytest.raises(ValueError, match="not a binary SolverState"):
        make(tmp_path).restore(bad)
    (tmp_path / "snap_iter_1.caffemodel").unlink()
    with pytest.raises(SnapshotError, match="learned_net .* is not found"):
        make(tmp_path).restore(saved)
    with pytest.raises(SnapshotError, match="HDF5"):
        make(tmp_path).restore(tmp_path / "x.solverstate.h5")


@pytest.mark.filterwarnings("error::RuntimeWarning")     # sncaffe's error alone, no NumPy warning before it
def test_nan_loss_names_the_iteration_and_layer_and_keeps_the_last_snapshot(tmp_path):
    def poisoned(net, it):
        feed_by_iteration(net, it)
        if it == 5:
            net.params["ip2"][0].data[0, 0] = np.inf
    s = make(tmp_path, max_iter=10, snapshot=2, feed=poisoned)
    with pytest.raises(TrainingError, match=r'iteration 5: .*loss is nan; layer "ip2" \(InnerProduct\) is the first '
                                            r'whose output went non-finite.*snap_iter_4.solverstate'):
        s.solve()
    good = (tmp_path / "snap_iter_4.caffemodel").read_bytes()
    assert np.all(np.isfinite(pb.NetParameter.FromString(good).layer[3].blobs[0].data))
    assert not (tmp_path / "snap_iter_5.caffemodel").exists() and not (tmp_path / "snap_iter_6.caffemodel").exists()


def test_non_finite_parameters_are_never_snapshotted(tmp_path):
    s = make(tmp_path)
    s.step(1)
    s.net.params["ip1"][1].data[2] = np.nan
    with pytest.raises(TrainingError, match='parameter 1 of layer "ip1" went non-finite'):
        s.snapshot()
    assert not list(tmp_path.glob("snap_iter_*"))


@pytest.mark.skipif(__import__("sncaffe.backend.onednn", fromlist=["x"]).choice() != "onednn",
                    reason="oneDNN is not in use on this machine")
@pytest.mark.parametrize("weight_decay", [0.0, 5e-4])
@pytest.mark.parametrize("team", [1, 2])
def test_sgd_step_on_onednn_gives_numpys_bytes(tmp_path, monkeypatch, weight_decay, team):
    """Without the compiled step (numba absent): a large float32 parameter's SGD step (L2 decay,
    momentum, Net::Update) runs on oneDNN's binary kernel (SGD.step; with a team of two its copy
    too); a small one on NumPy. Both give the bytes of NumPy's calls."""
    from sncaffe.backend import fused, onednn, threads
    monkeypatch.setattr(fused, "_kernels", False)
    monkeypatch.setattr(threads, "_decision", threads.Decision(team, 2, "--threads"))
    hidden = (onednn.BINARY_MIN + 5) // 6 + 1          # ip1's weights past the threshold, ip2's under
    runs, calls = [], []
    real = onednn.Binary.run
    monkeypatch.setattr(onednn.Binary, "run", lambda self, *a: calls.append(1) or real(self, *a))
    for native in (False, True):
        if native:
            monkeypatch.setattr(config, "settings", replace(config.settings, conv="native"))
        calls.clear()
        s = make(tmp_path, hidden=hidden, momentum=0.9, weight_decay=weight_decay, max_iter=3)
        s.solve()
        assert (len(calls) > 0) != native
        runs.append([a.copy() for a in s.state_arrays()] + [q.blob.diff.copy() for q in s._learnable])
    assert [a.tobytes() for a in runs[0]] == [b.tobytes() for b in runs[1]]


@pytest.mark.skipif(__import__("sncaffe.backend.fused", fromlist=["x"]).kernels() is None,
                    reason="numba is not installed (pip install 'sncaffe[fast]')")
@pytest.mark.parametrize("weight_decay", [0.0, 5e-4])
@pytest.mark.parametrize("team", [1, 2])
def test_sgd_step_compiled_gives_numpys_bytes(tmp_path, monkeypatch, weight_decay, team):
    """With numba, every float32 parameter's SGD step is one compiled pass (fused.sgd_step, its
    parallel build from fused.PARALLEL_MIN values on a team of two): three iterations give the
    weights, history and diffs of NumPy's calls (no oneDNN, no kernels) to the byte."""
    from sncaffe.backend import fused, threads
    monkeypatch.setattr(threads, "_decision", threads.Decision(team, 2, "--threads"))
    kernels, calls = fused.kernels(), []
    real = type(kernels).sgd_step
    monkeypatch.setattr(type(kernels), "sgd_step", lambda self, *a: calls.append(1) or real(self, *a))
    hidden = (fused.PARALLEL_MIN + 5) // 6 + 1          # ip1's weights past the parallel threshold
    runs = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(config, "settings", replace(config.settings, conv="native"))
            monkeypatch.setattr(fused, "_kernels", False)
        calls.clear()
        s = make(tmp_path, hidden=hidden, momentum=0.9, weight_decay=weight_decay, max_iter=3)
        s.solve()
        assert (len(calls) > 0) == compiled
        runs.append([a.copy() for a in s.state_arrays()] + [q.blob.diff.copy() for q in s._learnable])
    assert [a.tobytes() for a in runs[0]] == [b.tobytes() for b in runs[1]]
