"""Parameters shared by ParamSpec name (sharing.py), as Caffe's Net::AppendParam: one tensor,
diffs summed over sharers, Caffe's multiplier rules and refusals, the solver and its snapshots."""
import numpy as np
import pytest

from sncaffe import Net
from sncaffe.backend.cpu import CPUDevice
from sncaffe.graph import GraphError
from sncaffe.sizes import align
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text
from sncaffe.solver import Solver

NET = """
name: "twins"
layer { name: "input" type: "Input" top: "x" top: "x2" top: "t"
        input_param { shape { dim: 3 dim: 6 } shape { dim: 3 dim: 6 } shape { dim: 3 dim: 4 } } }
layer { name: "ip_a" type: "InnerProduct" bottom: "x" top: "ya" %(a)s
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "uniform" min: -0.5 max: 0.5 } } }
layer { name: "ip_b" type: "InnerProduct" bottom: "x2" top: "yb" %(b)s
        inner_product_param { num_output: 4 weight_filler { type: "gaussian" std: 0.5 }
                              bias_filler { type: "uniform" min: -0.5 max: 0.5 } } }
layer { name: "sum" type: "Eltwise" bottom: "ya" bottom: "yb" top: "y" }
layer { name: "loss" type: "EuclideanLoss" bottom: "y" bottom: "t" top: "loss" }
"""
RNG = np.random.default_rng(3)
INPUTS = {k: RNG.standard_normal(s).astype(np.float32) for k, s in (("x", (3, 6)), ("x2", (3, 6)), ("t", (3, 4)))}


def param(a="", b=""):
    return parse_text(NET % dict(a=a, b=b), pb.NetParameter())


def run(net, weights=None):
    if weights:
        for name, arrays in weights.items():
            for blob, arr in zip(net.params[name], arrays):
                blob.data[...] = arr
    for k, v in INPUTS.items():
        net.blobs[k].data[...] = v
    net.forward()
    net.clear_param_diffs()
    net.backward()
    return net


def test_shared_weight_is_one_tensor_and_its_diff_the_sum_over_sharers():
    shared = run(Net(param('param { name: "w" }', 'param { name: "w" }'), device=CPUDevice(8 << 20)))
    w = shared.params["ip_a"][0].data.copy()
    plain = Net(param(), device=CPUDevice(8 << 20))
    run(plain, {"ip_a": [w, shared.params["ip_a"][1].data], "ip_b": [w, shared.params["ip_b"][1].data]})
    a, b = shared.params["ip_a"][0], shared.params["ip_b"][0]
    assert a.data is not b.data and np.shares_memory(a.data, b.data) and np.shares_memory(a.diff, b.diff)
    expect = plain.params["ip_a"][0].diff + plain.params["ip_b"][0].diff
    np.testing.assert_allclose(a.diff, expect, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(shared.params["ip_b"][1].diff, plain.params["ip_b"][1].diff)
    # the memory plan holds the weight and its diff once
    wbytes = 2 * align(w.nbytes)
    assert plain.plan.persistent_bytes - shared.plan.persistent_bytes == wbytes
    assert [q.layer for q in shared.graph.learnable] == ["ip_a", "ip_a", "ip_b"]
    assert shared.graph.learnable[0].sharers == [("ip_b", 0)]


def test_owner_values_win_at_initialisation():
    net = Net(param('param { name: "w" }', 'param { name: "w" }'), device=CPUDevice(8 << 20), seed=5)
    alone = Net(param(), device=CPUDevice(8 << 20), seed=5)
    np.testing.assert_array_equal(net.params["ip_b"][0].data, alone.params["ip_a"][0].data)


@pytest.mark.parametrize("order", ["owner frozen", "sharer frozen"])
def test_a_frozen_sharer_adds_nothing_whatever_the_order(order):
    """lr_mult 0 on one side: the shared diff is the learning layer's gradient alone, whether the
    frozen layer's backward runs before or after the learner's."""
    a, b = ('param { name: "w" lr_mult: 0 }', 'param { name: "w" }') if order == "owner frozen" else \
        ('param { name: "w" }', 'param { name: "w" lr_mult: 0 }')
    shared = run(Net(param(a, b), device=CPUDevice(8 << 20)))
    w = shared.params["ip_a"][0].data.copy()
    plain = run(Net(param(), device=CPUDevice(8 << 20)),
                {"ip_a": [w, shared.params["ip_a"][1].data], "ip_b": [w, shared.params["ip_b"][1].data]})
    learner = "ip_b" if order == "owner frozen" else "ip_a"
    np.testing.assert_allclose(shared.params["ip_a"][0].diff, plain.params[learner][0].diff, rtol=1e-6)
    assert np.abs(plain.params["ip_a" if learner == "ip_b" else "ip_b"][0].diff).max() > 0.1
    # Caffe's merged multiplier: the one layer that names lr_mult sets it (0) for the owner
    assert shared.graph.learnable[0].lr_mult == 0 and shared.graph.learnable[0].has_lr


@pytest.mark.parametrize("b, message", [
    ('param { name: "w" lr_mult: 2 }', "shared param 'w' has mismatched lr_mult (2 vs. 1"),
    ('param { name: "w" decay_mult: 3 }', "shared param 'w' has mismatched decay_mult (3 vs. 1"),
])
def test_mismatched_multipliers_are_refused_naming_the_layer(b, message):
    with pytest.raises(GraphError) as e:
        Net(param('param { name: "w" lr_mult: 1 decay_mult: 1 }', b), device=CPUDevice(8 << 20))
    assert message in str(e.value) and 'layer "ip_b"' in str(e.value) and "ip_a" in str(e.value)


def test_shape_checks_strict_and_permissive():
    text = NET.replace("bottom: \"x2\" top: \"yb\" %(b)s\n        inner_product_param { num_output: 4",
                       "bottom: \"x2\" top: \"yb\" %(b)s\n        inner_product_param { num_output: 4 transpose: true")
    strict = parse_text(text % dict(a='param { name: "w" }', b='param { name: "w" }'), pb.NetParameter())
    with pytest.raises(GraphError, match=r"ip_b.*shape mismatch.*\(4, 6\).*\(6, 4\)"):
        Net(strict, device=CPUDevice(8 << 20))
    permissive = parse_text(text % dict(a='param { name: "w" }', b='param { name: "w" share_mode: PERMISSIVE }'),
                            pb.NetParameter())
    net = run(Net(permissive, device=CPUDevice(8 << 20)))
    a, b = net.params["ip_a"][0], net.params["ip_b"][0]
    assert b.data.shape == (6, 4) and np.shares_memory(a.data, b.data)
    np.testing.assert_array_equal(a.data.ravel(), b.data.ravel())
    bias = param('param { name: "w" } param { name: "bias" }',
                 'param { name: "w" } param { name: "w" share_mode: PERMISSIVE }')
    with pytest.raises(GraphError, match=r"ip_b.*count mismatch"):
        Net(bias, device=CPUDevice(8 << 20))


def solver(tmp_path, a, b, **fields):
    fields = {**dict(weight_decay=0.01, max_iter=2), **fields}
    p = pb.SolverParameter(base_lr=0.1, lr_policy="fixed", random_seed=1, display=0,
                           snapshot_prefix=str(tmp_path / "snap"), **fields)
    p.net_param.CopyFrom(param(a, b))
    device = CPUDevice(8 << 20)

    def feed(net, i):
        for k, v in INPUTS.items():
            net.blobs[k].data[...] = v
    return Solver(p, device=device, feed=feed)


def test_solver_updates_owners_once_and_snapshots_as_caffe(tmp_path):
    s = solver(tmp_path, 'param { name: "w" }', 'param { name: "w" }', type="Nesterov")
    assert [(q.layer, q.index) for q in s._learnable] == [("ip_a", 0), ("ip_a", 1), ("ip_b", 1)]
    pool = s.device.pool
    s.net.clear_param_diffs()
    pool.reset_peak()
    s.solve()
    assert pool.peak == s.net.plan.peak
    w = s.net.params["ip_a"][0].data
    model, state = s.snapshot()
    saved = pb.NetParameter.FromString(open(model, "rb").read())
    blobs = {lp.name: lp.blobs for lp in saved.layer if lp.blobs}
    assert len(blobs["ip_a"]) == len(blobs["ip_b"]) == 2      # each layer's copy, as Caffe writes them
    np.testing.assert_array_equal(np.array(blobs["ip_b"][0].data).reshape(w.shape), w)
    st = pb.SolverState.FromString(open(state, "rb").read())
    assert len(st.history) == 3                             # the owner only
    again = solver(tmp_path, 'param { name: "w" }', 'param { name: "w" }', type="Nesterov")
    again.restore(state)
    np.testing.assert_array_equal(again.net.params["ip_b"][0].data, w)
    np.testing.assert_array_equal(again.history[0], s.history[0])


def test_solver_leaves_a_weight_frozen_by_its_sharer(tmp_path):
    """Owner names no lr_mult, the sharer 0: Caffe's learnable lr_mult becomes 0."""
    s = solver(tmp_path, 'param { name: "w" }', 'param { name: "w" lr_mult: 0 }', weight_decay=0.0)
    before = s.net.params["ip_a"][0].data.copy()
    bias = s.net.params["ip_a"][1].data.copy()
    s.step(1)
    np.testing.assert_array_equal(s.net.params["ip_a"][0].data, before)
    assert np.abs(s.net.params["ip_a"][1].data - bias).max() > 0


def test_data_parallel_buckets_send_a_shared_gradient_once_after_its_last_sharer():
    from sncaffe.parallel import make_buckets
    net = Net(param('param { name: "w" }', 'param { name: "w" }'), device=CPUDevice(8 << 20))
    slots = [(s.layer, s.index) for b in make_buckets(net, bucket_bytes=1) for s in b.slots]
    # backward runs ip_b, then ip_a: the shared weight is complete only after ip_a's
    assert sorted(slots) == [("ip_a", 0), ("ip_a", 1), ("ip_b", 1)]
    assert slots.index(("ip_a", 0)) > slots.index(("ip_b", 1))


def test_sharing_is_logged_as_caffe(caplog):
    import logging
    with caplog.at_level(logging.INFO, logger="sncaffe"):
        Net(param('param { name: "w" }', 'param { name: "w" }'), device=CPUDevice(8 << 20))
    assert "Sharing parameters 'w' owned by layer 'ip_a', param index 0" in caplog.text


@pytest.mark.parametrize("mode", ["liveness", "offload", "recompute", "all"])
def test_every_memory_mode_same_bits_and_planned_peak(mode):
    """Shared weights (one frozen side: its gradient goes to a planned workspace) in every mode."""
    text = param('param { name: "w" lr_mult: 0 }', 'param { name: "w" }')

    def go(m):
        device = CPUDevice(8 << 20)
        net = Net(text, device=device, memory=m, seed=2)
        device.pool.reset_peak()
        run(net)
        return net, device.pool.peak, [b.diff.tobytes() for bl in net.params.values() for b in bl]
    _, _, ref = go("none")
    net, peak, got = go(mode)
    assert peak == net.plan.peak and got == ref
    assert any("frozen_param0_diff" in k for k in net.graph.layer("ip_a").backward_workspace)


def test_n_iterations_equal_half_snapshot_resume_half_to_the_last_bit(tmp_path):
    a, b = 'param { name: "w" decay_mult: 2 }', 'param { name: "w" lr_mult: 1 }'
    whole = solver(tmp_path, a, b, type="Adam", max_iter=4, snapshot_after_train=False)
    whole.solve()
    half = solver(tmp_path, a, b, type="Adam", max_iter=2)
    half.solve()                                        # snapshots at 2
    resumed = solver(tmp_path, a, b, type="Adam", max_iter=4, snapshot_after_train=False)
    resumed.solve(str(tmp_path / "snap_iter_2.solverstate"))
    for name in ("ip_a", "ip_b"):
        for x, y in zip(whole.net.params[name], resumed.net.params[name]):
            assert x.data.tobytes() == y.data.tobytes()
    assert whole.net.params["ip_a"][0].data.tobytes() != half.net.params["ip_a"][0].data.tobytes()
