"""Data parallelism inside one process: the net replicated over cpu:0 and cpu:1 with summing
operators trains as one location at the summed batch (up to float summation order)."""
import re

import numpy as np
import pytest

from sncaffe.parallel.replicas import Replicas, replicate
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text, prepare_net
from sncaffe.solvers import Solver

LAYERS = """
layer { name: "in" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 8 dim: 1 dim: 10 dim: 10 } shape { dim: 8 } } }
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
LOCATIONS = ["cpu:0", "cpu:1"]


def net_param():
    return parse_text('name: "tiny"\n' + LAYERS, pb.NetParameter())


def feed(net, iteration):
    rng = np.random.default_rng(iteration)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].data.shape)
    net.blobs["label"].data[...] = rng.integers(0, 4, 8)


def make_solver(param, iter_size=1):
    p = pb.SolverParameter(base_lr=0.05, momentum=0.9, weight_decay=5e-4, lr_policy="fixed", max_iter=5,
                           random_seed=7, iter_size=iter_size, snapshot_after_train=False)
    p.net_param.CopyFrom(param)
    solver = Solver(p, device="cpu")
    solver.feed = feed
    return solver


def test_replicate_slices_the_data_and_repeats_the_rest():
    prepared = prepare_net(replicate(net_param(), LOCATIONS))
    names = [layer.name for layer in prepared.layer]
    assert "in" in names and "data_replicas" in names and "conv@cpu:0" in names and "conv@cpu:1" in names
    cut = next(layer for layer in prepared.layer if layer.name == "data_replicas")
    assert cut.type == "Slice" and list(cut.top) == ["data@cpu:0", "data@cpu:1"]
    loss = [layer for layer in prepared.layer if layer.name.startswith("loss@")]
    assert [list(layer.loss_weight) for layer in loss] == [[0.5], [0.5]]
    copies = {layer.name for layer in prepared.layer if layer.type == "Copy"}
    assert any("data@cpu:1" in c for c in copies)       # each part is carried to its location
    with pytest.raises(ValueError, match="two or more distinct locations"):
        replicate(net_param(), ["cpu:0"])


@pytest.mark.parametrize("iter_size", [1, 2])
def test_two_replicas_train_as_one_location_at_the_summed_batch(iter_size):
    one = make_solver(net_param(), iter_size)
    two = make_solver(replicate(net_param(), LOCATIONS), iter_size)
    reps = Replicas(two)
    assert two.net.executor.threaded and len(reps.ops) == 3        # conv, ip1, ip2
    kinds = [ins.kind for ins in two.net.plan.schedule.backward]
    assert kinds.count("collective") == 3
    one.solve()
    two.solve()
    reps.close()
    assert "collective" not in [ins.kind for ins in two.net.plan.schedule.backward]
    for name, blobs in one.net.params.items():
        a, b = two.net.params[f"{name}@cpu:0"], two.net.params[f"{name}@cpu:1"]
        for x, y, z in zip(blobs, a, b):
            assert np.array_equal(y.data, z.data), name       # the replicas stay equal to the bit
            # and equal to one location at the summed batch, up to float summation order
            np.testing.assert_allclose(y.data, x.data, rtol=2e-5, atol=2e-6, err_msg=name)
    assert two.net.blobs["loss@cpu:0"].data is not None
    # the replicas' weights live on their own devices
    w1 = two.net.params["conv@cpu:1"][0].data
    assert np.shares_memory(w1, two.net.devices["cpu:1"].arena)


def test_each_replica_is_updated_on_its_own_locations_worker_to_the_same_bits(monkeypatch):
    """Solver.update_streams: each location's parameters are stepped on that location's worker,
    the two at once, and the weights are those of the update on the calling thread."""
    import threading
    serial = make_solver(replicate(net_param(), LOCATIONS))
    Replicas(serial)
    serial.update_streams = None
    serial.solve()
    two = make_solver(replicate(net_param(), LOCATIONS))
    reps = Replicas(two)
    assert set(two.update_streams) == set(LOCATIONS)
    where = {}                                  # parameter data's address -> threads that stepped it
    real = type(two.rule).step

    def step(self, data, *args):
        where.setdefault(data.ctypes.data, set()).add(threading.current_thread())
        return real(self, data, *args)
    monkeypatch.setattr(type(two.rule), "step", step)
    two.solve()
    reps.close()
    assert two.update_streams is None
    threads = {loc: set() for loc in LOCATIONS}
    for name, blobs in two.net.params.items():
        loc = name.rpartition("@")[2]
        for b, s in zip(blobs, serial.net.params[name]):
            threads[loc] |= where[b.data.ctypes.data]
            assert np.array_equal(b.data, s.data), name
    assert all(len(t) == 1 for t in threads.values())          # one worker per location
    assert threads["cpu:0"] != threads["cpu:1"]
    assert threading.main_thread() not in threads["cpu:0"] | threads["cpu:1"]


def test_without_the_summing_operators_the_replicas_drift_apart():
    """The check above can fail: each replica alone follows its own half of the batch."""
    two = make_solver(replicate(net_param(), LOCATIONS))
    reps = Replicas(two)
    reps.close()                               # the summing operators taken out again
    two.solve()
    a, b = two.net.params["ip2@cpu:0"][0].data, two.net.params["ip2@cpu:1"][0].data
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("mode", ["offload", "all", "recompute", "none"])     # the last two: programs
def test_replicas_meet_each_planned_peak_and_time_their_operators(mode):
    """Two workers, offloads and prefetches in flight (or each worker's program): every
    location's pool peaks where its plan says, and per-operator timings (``sncaffe time``) do
    not wait on streams from a worker (which could wait for work queued behind it: run in a
    thread, so a hang fails)."""
    import threading

    from sncaffe import Net
    from sncaffe.backend import CPUDevice
    net = Net(replicate(net_param(), LOCATIONS), "TRAIN", device=CPUDevice(64 << 20), seed=3, memory=mode)
    assert (net.plan.d2h_bytes > 0) == (mode in ("offload", "all"))
    timings, errors = {}, []

    def work():
        try:
            for i in range(3):
                feed(net, i)
                for d in net.devices.values():
                    d.pool.reset_peak()
                net.forward(timings=timings)
                net.backward(timings=timings)
                for loc, peak in net.plan.peaks.items():
                    assert net.devices[loc].pool.peak == peak, loc
        except BaseException as e:
            errors.append(e)
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "forward/backward with timings did not finish"
    assert not errors, errors
    assert "conv@cpu:1:backward" in timings and "conv@cpu:0:forward" in timings


def test_cli_trains_replicas_as_one_location(tmp_path, capsys):
    """``sncaffe train --replicas cpu:0,cpu:1``: the same weights as one location at that batch."""
    from sncaffe import blobproto
    from sncaffe.cli import main
    net = tmp_path / "tiny.prototxt"
    net.write_text('name: "tiny"\n' + LAYERS)
    for name, extra in (("one", []), ("two", ["--replicas", "cpu:0,cpu:1"])):
        assert main(["train", str(net), "--max-iter", "3", "--seed", "5",
                     "--snapshot-prefix", str(tmp_path / name) + "/", *extra]) == 0
    out = capsys.readouterr()
    done = [line for line in (out.out + out.err).splitlines() if "Trained to iteration 3" in line]
    assert len(done) == 2 and "cpu:0" not in done[0]          # each location's pool, where there are several
    assert re.search(r"pool peak \S+ \S+ \(main \S+ \S+, cpu:0 \S+ \S+, cpu:1 \S+ \S+\)", done[1]), done[1]
    one = {(lp.name, i): np.asarray(b.data) for lp in blobproto.read_caffemodel(
        tmp_path / "one" / "tiny_iter_3.caffemodel").layer for i, b in enumerate(lp.blobs)}
    two = {(lp.name, i): np.asarray(b.data) for lp in blobproto.read_caffemodel(
        tmp_path / "two" / "tiny_iter_3.caffemodel").layer for i, b in enumerate(lp.blobs)}
    assert one and all((f"{name}@cpu:1", i) in two for name, i in one)
    for (name, i), w in one.items():
        np.testing.assert_allclose(two[f"{name}@cpu:0", i], w, rtol=1e-5, atol=1e-6, err_msg=name)
        assert np.array_equal(two[f"{name}@cpu:0", i], two[f"{name}@cpu:1", i])
    # fine-tuning from the unreplicated net's weights: every replica starts from them (and, with
    # no learning, ends there)
    assert main(["train", str(net), "--max-iter", "1", "--base-lr", "0", "--snapshot-prefix",
                 str(tmp_path / "w") + "/", "--replicas", "cpu:0,cpu:1",
                 "--weights", str(tmp_path / "one" / "tiny_iter_3.caffemodel")]) == 0
    start = {(lp.name, i): np.asarray(b.data) for lp in blobproto.read_caffemodel(
        tmp_path / "w" / "tiny_iter_1.caffemodel").layer for i, b in enumerate(lp.blobs)}
    for (name, i), w in one.items():
        assert np.array_equal(start[f"{name}@cpu:0", i], w) and np.array_equal(start[f"{name}@cpu:1", i], w)
    assert main(["train", str(net), "--replicas", "cpu:0", "--max-iter", "1",
                 "--snapshot-prefix", str(tmp_path / "bad") + "/"]) != 0
    assert "replicate needs two or more distinct locations" in capsys.readouterr().err


def test_a_replicated_nets_outputs_are_logged_as_the_one_nets(caplog):
    """Caffe's log of a replicated net: each output once, the mean of its replicas' (each the mean
    over its half of the batch), a loss with the sum of their weights (the net's weight); the
    scores keep each replica's."""
    import logging

    from sncaffe.solvers.solver import _replicas_as_one
    outputs = {"accuracy@cpu:0": np.array([0.25]), "accuracy@cpu:1": np.array([0.75]),
               "loss@cpu:0": np.array([2.0]), "loss@cpu:1": np.array([3.0]), "other": np.array([7.0])}
    merged, weights = _replicas_as_one(outputs, {"loss@cpu:0": 0.5, "loss@cpu:1": 0.5})
    assert list(merged) == ["accuracy", "loss", "other"]
    assert merged["accuracy"][0] == 0.5 and merged["loss"][0] == 2.5 and merged["other"][0] == 7.0
    assert weights["loss"] == 1.0 and not weights.get("accuracy")
    alone = {"a@b": np.array([1.0]), "c": np.array([2.0])}          # one "@" name: not a replica group
    assert list(_replicas_as_one(alone, {})[0]) == ["a@b", "c"]
    solver = make_solver(replicate(net_param(), LOCATIONS))
    reps = Replicas(solver)
    solver.step(1)
    with caplog.at_level(logging.INFO, logger="sncaffe"):
        solver._log_outputs(solver.net, "Train", solver._outputs(solver.net))
    reps.close()
    lines = [r.getMessage() for r in caplog.records if "net output" in r.getMessage()]
    losses = [float(solver.net.blobs[f"loss@{loc}"].data.ravel()[0]) for loc in LOCATIONS]
    assert len(lines) == 1 and "@" not in lines[0] and "(* 1 = " in lines[0], lines
    assert float(lines[0].split("loss = ")[1].split()[0]) == pytest.approx(np.mean(losses), rel=1e-5)
