"""The paper's nets in prototxt/, tools/gen_inception_v4.py, tools/compare.py and tools/caffe_baseline.py.

The nets build, plan and (at tiny sizes) match their PyTorch twin's forward; compare.py runs a
tiny suite end to end; its depth search and PyTorch accounting are checked on small cases; the
Caffe baseline skips cleanly without a `caffe` binary and runs end to end against a stand-in.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import caffe_baseline  # noqa: E402
import compare  # noqa: E402
import compare_depth  # noqa: E402
import gen_inception_v4  # noqa: E402

from sncaffe import Net  # noqa: E402
from sncaffe.backend.cpu import CPUDevice  # noqa: E402
from sncaffe.runtime.budget import physical_ram  # noqa: E402
from sncaffe.proto import sncaffe_pb2 as pb  # noqa: E402
from sncaffe.prototxt import parse_text, read_text, set_batch  # noqa: E402

needs_torch = pytest.mark.skipif(compare.torch is None, reason="PyTorch (sncaffe[torch]) is not installed")

# name: (file, default batch, image size, classes, (batch, image size, dtype) of the twin test)
NETS = {
    "alexnet": ("alexnet.prototxt", 128, 227, 1000, (2, 67, np.float32)),
    "vgg16": ("vgg16.prototxt", 32, 224, 1000, (2, 32, np.float32)),
    "vgg19": ("vgg19.prototxt", 32, 224, 1000, (2, 32, np.float32)),
    # float64 and batch 4: BatchNorm over a few values (the 1x1 grid at 75x75) magnifies rounding
    "inception_v4": ("inception_v4.prototxt", 16, 299, 1000, (4, 75, np.float64)),
    "cifar10_resnet": ("cifar10_resnet.prototxt", 128, 32, 10, (2, 32, np.float32)),
}
TOL = {np.float32: 1e-4, np.float64: 1e-7}


def load(name):
    return read_text(ROOT / "prototxt" / NETS[name][0], pb.NetParameter())


def resized(param, batch, size):
    """``param`` at ``batch`` and ``size`` x ``size`` images, dropout off (the twin cannot draw
    sncaffe's masks)."""
    out = set_batch(param, batch)
    dims = out.layer[0].input_param.shape[0].dim
    dims[2] = dims[3] = size
    for lp in out.layer:
        if lp.type == "Dropout":
            lp.dropout_param.dropout_ratio = 0
    return out


@pytest.mark.parametrize("name", list(NETS))
def test_net_is_a_trainable_train_net(name):
    file, batch, size, classes, _ = NETS[name]
    param = load(name)
    data = param.layer[0]
    assert data.type == "Input" and list(data.top) == ["data", "label"]
    assert [list(s.dim) for s in data.input_param.shape] == [[batch, 3, size, size], [batch]]
    fillers = {lp.convolution_param.weight_filler.type for lp in param.layer if lp.type == "Convolution"}
    fillers |= {lp.inner_product_param.weight_filler.type for lp in param.layer if lp.type == "InnerProduct"}
    assert fillers <= {"msra", "xavier"}
    assert param.layer[-2].type == "SoftmaxWithLoss"
    graph = compare.graph_of(param)
    scores = graph.layer(param.layer[-2].bottom[0]).tops[0].shape
    assert scores == (batch, classes)
    peaks = {m: compare.plan_peak(graph, m) for m in ("none", "liveness", "all+host")}
    assert peaks["none"] > peaks["liveness"] > peaks["all+host"] > 0
    # `sncaffe train` runs it in mode none on an idle machine (the default device takes the RAM available)
    assert peaks["none"] < physical_ram() // 2


def test_layer_counts():
    def count(name, type):
        return sum(lp.type == type for lp in load(name).layer)
    assert (count("alexnet", "Convolution"), count("alexnet", "InnerProduct"), count("alexnet", "LRN")) == (5, 3, 2)
    assert (count("vgg16", "Convolution"), count("vgg16", "InnerProduct")) == (13, 3)
    assert (count("vgg19", "Convolution"), count("vgg19", "InnerProduct")) == (16, 3)
    assert count("cifar10_resnet", "Convolution") == 19 + 2 and count("cifar10_resnet", "Eltwise") == 9
    inception = load("inception_v4")
    assert count("inception_v4", "Convolution") == count("inception_v4", "BatchNorm") == 149
    blocks = {lp.name.split("/")[0] for lp in inception.layer if lp.type == "Concat"}
    assert {f"inception_a{i}" for i in range(1, 5)} | {f"inception_b{i}" for i in range(1, 8)} | \
        {f"inception_c{i}" for i in range(1, 4)} | {"reduction_a", "reduction_b"} <= blocks


def test_inception_grids():
    graph = compare.graph_of(load("inception_v4"))
    assert graph.blobs["stem/concat3"].shape == (16, 384, 35, 35)
    assert graph.blobs["reduction_a/concat"].shape == (16, 1024, 17, 17)
    assert graph.blobs["reduction_b/concat"].shape == (16, 1536, 8, 8)
    assert graph.blobs["inception_c3/concat"].shape == (16, 1536, 8, 8)


def test_inception_v4_committed_file_is_fresh():
    assert (ROOT / gen_inception_v4.COMMITTED).read_text() == gen_inception_v4.committed_text(), \
        "prototxt/inception_v4.prototxt is stale: run python tools/gen_inception_v4.py --committed"
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_inception_v4.py"), "--committed", "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_inception_v4_generator():
    a = gen_inception_v4.generate(2, 75, command=gen_inception_v4.command_line(2, 75))
    assert a == gen_inception_v4.generate(2, 75, command=gen_inception_v4.command_line(2, 75))
    assert "# Generated by: python tools/gen_inception_v4.py --batch 2 --image-size 75" in a
    with pytest.raises(ValueError, match="stem/concat1"):
        gen_inception_v4.generate(2, 74)


def test_cifar_resnet_trains_from_the_command_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "sncaffe.cli", "train", str(ROOT / "prototxt" / "cifar10_resnet.prototxt"),
                          "--max-iter", "1", "--batch", "4", "--snapshot-prefix", str(tmp_path / "snap")],
                         capture_output=True, text=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Trained to iteration 1" in run.stdout + run.stderr


@needs_torch
@pytest.mark.parametrize("name", list(NETS))
def test_torch_twin_agrees_at_a_tiny_size(name):
    batch, size, dtype = NETS[name][4]
    net = Net(resized(load(name), batch, size), "TRAIN", device=CPUDevice(1 << 30), dtype=dtype)
    compare.fill_inputs(net)
    values = {k: np.array(net.blobs[k].data) for k in net.inputs}
    twin = compare.torch_net.TorchNet(net)          # before forward: BatchNorm statistics move
    loss = net.forward()
    out = twin(values, all_blobs=True)
    tol = TOL[dtype]
    assert out.loss.item() == pytest.approx(loss, rel=tol)
    for blob, value in net.blobs.items():
        expected = np.asarray(value.data, np.float64)
        np.testing.assert_allclose(out[blob].detach().numpy(), expected, rtol=10 * tol,
                                   atol=tol * max(1.0, np.abs(expected).max()), err_msg=blob)


# -- compare.py ------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", ["linear", "steps", "flat", "none fit", "all fit"])
def test_deepest_search_matches_brute_force(shape):
    fn = {"linear": lambda k: 100 + 7 * k, "steps": lambda k: 100 + 7 * k + 40 * (k // 10),
          "flat": lambda k: 120, "none fit": lambda k: 10 ** 6, "all fit": lambda k: k}[shape]
    budget, k_max = 500, 300
    calls = []
    found, _ = compare_depth.deepest(lambda k: calls.append(k) or fn(k), budget, k_max)
    assert found == max([k for k in range(1, k_max + 1) if fn(k) <= budget], default=0)
    assert len(calls) == len(set(calls)) and len(calls) <= {"linear": 4, "flat": 3}.get(shape, 12)


@needs_torch
@pytest.mark.parametrize("checkpoint", [False, True])
def test_torch_count_on_meta_equals_the_cpu_count(checkpoint):
    graph = compare.graph_of(compare.resnet((1, 1, 2, 1), 2, 32))
    meta = compare.torch_count(graph, checkpoint)
    cpu = compare.TorchTrainer(graph, "cpu", checkpoint=checkpoint).count()
    assert meta == cpu
    assert meta["peak"] == meta["params"] + meta["grads"] + meta["momentum"] + meta["saved"] + meta["transient"]
    assert meta["grads"] == meta["momentum"] and meta["saved"] > 0


@needs_torch
def test_checkpointed_pieces_give_the_eager_loss_and_gradients():
    param = compare.resnet((1, 1, 2, 1), 2, 32)
    net = Net(param, "TRAIN", device=CPUDevice(1 << 30))
    compare.fill_inputs(net)
    grads = []
    for checkpoint in (False, True):
        t = compare.TorchTrainer(net.graph, "cpu", net=net, checkpoint=checkpoint)
        loss = t.loss()
        loss.backward()
        grads.append((float(loss.detach()), [p.grad.clone() for p in t.twin.parameters() if p.requires_grad]))
    pieces = compare.pieces(t.twin, t.inputs)
    assert len(pieces) == 2 + 5 + 3          # conv1..relu, pool1; one per block; pool5, fc1000, loss
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6)
    for a, b in zip(grads[0][1], grads[1][1]):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6)


TINY_SUITE = """
frameworks: [sncaffe, pytorch, caffe]
nets:
  LeNet: {prototxt: prototxt/lenet_train_test.prototxt, input: [1, 28, 28]}
  Tiny ResNet: {resnet: [1, 1, 1, 1], image_size: 32}
memory:
  modes: [none, liveness, all, all+host]
  runs:
    - {net: LeNet, batch: 4, verify: true}
    - {net: Tiny ResNet, batch: 2}
throughput:
  sncaffe_mode: none
  warmup: 0
  iterations: 1
  runs:
    - {net: LeNet, batch: 4}
  pytorch: [twin, idiomatic]
  repeats: 1
  depth: {batch: 2, image_size: 32, k: [1], warmup: 0, iterations: 1,
          sncaffe_modes: [none], pytorch: [idiomatic]}
scaling:
  threads: 2
  warmup: 0
  iterations: 1
  runs:
    - {net: LeNet, batch: 4}
quick:
  throughput: {repeats: 2}
"""


def test_compare_runs_a_tiny_suite_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))          # no `caffe`: that part is skipped
    monkeypatch.delenv("CAFFE_BIN", raising=False)
    (tmp_path / "suite.yaml").write_text(TINY_SUITE)
    suite = compare.load_suite(tmp_path / "suite.yaml", quick=True)
    assert suite["throughput"]["repeats"] == 2                 # the quick: section on top
    out = tmp_path / "out"
    results = compare.run(suite, out, say=lambda s: None)

    threads = results["machine"]["threads"]
    assert threads["OPENBLAS_NUM_THREADS"] == "1" and threads["numpy_blas"] in (1, None)
    assert threads["torch"] in (1, None) and results["machine"]["sncaffe_blas"].endswith(", 1 thread")
    lenet = results["memory"][0]
    assert lenet["sncaffe_measured"]["liveness"] == lenet["sncaffe"]["liveness"]   # the plan is the pool peak
    assert lenet["sncaffe_measured"]["none"] == lenet["sncaffe"]["none"]
    assert results["caffe"]["skipped"]

    text = (out / "tables.md").read_text()
    for heading in ("Peak memory of a training step", "Training throughput", "Images/s against depth",
                    "Real Caffe: no `caffe`"):
        assert heading in text
    assert "deepest" not in json.loads((out / "results.json").read_text())
    assert (out / "throughput_vs_depth.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if compare.torch is not None:
        row = results["throughput"]["runs"][0]
        assert "Ratios and targets" in text and "fastest PyTorch" in text
        for v in ("twin", "idiomatic"):            # LeNet has both forms; both ran, twice each
            assert row[f"pytorch {v}"]["images_per_s"] > 0 and row[f"pytorch {v}"]["runs"] == 2
            assert row["loss"]["sncaffe"] == pytest.approx(row["loss"][f"pytorch {v}"], rel=1e-4)
        lo, hi = row["sncaffe none"]["spread"]
        assert lo <= row["sncaffe none"]["images_per_s"] <= hi
        assert set(row["torch_conv_share"]) == {"twin", "idiomatic"}
        # where the time goes: LeNet's convolutions and inner products, in both frameworks
        split = row["split"]
        assert set(split) == {"sncaffe", "pytorch twin", "pytorch idiomatic"}
        assert {"Convolution", "InnerProduct"} <= set(split["sncaffe"])      # grouped by layer type
        for v in ("twin", "idiomatic"):
            if split[f"pytorch {v}"] is not None:            # None: the profiler failed (printed)
                assert "Convolution" in split[f"pytorch {v}"]          # aten's conv ops found by name
        assert "Where the time goes" in text
        assert "PyTorch twin" in text and "PyTorch idiomatic" in text      # the memory table's columns
    # two threads against one: each framework's worker ran its turns on one thread and on two
    row = results["scaling"]["runs"][0]
    frameworks = ["sncaffe none"] + (["pytorch idiomatic"] if compare.torch is not None else [])
    frameworks += ["machine gemm"] + (["machine copy"] if compare._onednn_in_use() else [])    # by turns with them
    assert [k for k in row if isinstance(row[k], dict)] == frameworks
    for k in frameworks:
        assert row[k]["ran_on"] == [1, 2], k
        assert row[k]["s_one"] > 0 and row[k]["s_many"] > 0
        assert row[k]["speedup"] == pytest.approx(row[k]["s_one"] / row[k]["s_many"])
    assert "2 threads against one, by turns" in text and "scaling LeNet (batch 4): sncaffe 2 threads / 1" in text
    assert "the machine's in the same minutes: gemm's" in text and "| machine gemm |" in text


def test_machine_probes_compute_what_they_say_and_unknown_ones_are_named():
    # the scaling suite's ceiling: a GEMM and a copy, each a real computation on the turn's budget
    rng = np.random.default_rng(0)
    a, b = (rng.random((1024, 1024), dtype=np.float32) for _ in range(2))
    got = compare.machine_probe("gemm")()
    np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-5)
    if compare._onednn_in_use():
        src = np.random.default_rng(0).random(32 << 20, dtype=np.float32)
        assert np.array_equal(compare.machine_probe("copy")(), src)
    with pytest.raises(ValueError, match="unknown machine probe 'disk'"):
        compare.machine_probe("disk")
    suite = compare.load_suite()
    suite["scaling"] = {"runs": [], "probes": ["gemm", "disk"]}
    with pytest.raises(ValueError, match=r"scaling: unknown probes \['disk'\]"):
        compare.scaling_suite(suite, say=lambda s: None)


def test_each_framework_steps_in_a_process_of_its_own():
    # as its users run it: nothing of another framework's model in its heap (compare.Worker)
    suite = compare.load_suite()
    param = compare.net_param(suite, "LeNet", 4)
    variants = ["twin", "idiomatic"] if compare.torch is not None else []
    r = compare.time_pair(param, ["none"], variants, warmup=0, iterations=2, batch=4)
    keys = ["sncaffe none", *(f"pytorch {v}" for v in variants)]
    pids = {r[k]["pid"] for k in keys}
    assert len(pids) == len(keys) and os.getpid() not in pids
    assert not r["sncaffe none"]["torch_loaded"]         # as `sncaffe train` runs: no PyTorch in its process
    assert all(r[f"pytorch {v}"]["torch_loaded"] for v in variants)
    for k in keys:
        assert r[k]["images_per_s"] > 0 and r[k]["faults"] >= 0
    for v in variants:      # each took the weights and batch of its own sncaffe solver: the same numbers
        assert r["loss"][f"pytorch {v}"] == pytest.approx(r["loss"]["sncaffe"], rel=1e-4)
    assert {"Convolution", "InnerProduct"} <= set(r["split"]["sncaffe"])


def test_interleaved_pauses_before_each_timed_step_only(monkeypatch):
    # on more than one thread the workers' steps are SETTLE_S apart (another process's OpenMP threads
    # stop spinning first); warm-up calls and self-timed steps' figures are taken as they come
    calls, slept = [], []
    monkeypatch.setattr(compare.time, "sleep", lambda s: slept.append((s, len(calls))))
    steps = {"a": lambda: calls.append("a") or (0.25, 7), "b": lambda: calls.append("b")}
    out = compare.interleaved(steps, warmup=1, iterations=3, pause=0.1)
    assert calls == ["a", "b"] * 4
    assert slept == [(0.1, n) for n in range(2, 8)]          # before each of the 6 timed calls
    assert out["a"] == (0.25, 0.25, 7) and out["b"][2] is None
    slept.clear()
    compare.interleaved(steps, warmup=0, iterations=2)
    assert slept == []


def test_a_failing_worker_says_which_and_why(tmp_path):
    bad = tmp_path / "net.pb"
    bad.write_bytes(b"\xff\xff not a NetParameter")
    worker = compare.Worker(bad, "sncaffe", "none")
    try:
        with pytest.raises(RuntimeError, match=r"sncaffe none: DecodeError"):
            worker.step()
    finally:
        worker.close()
    assert worker.proc.returncode == 1


def test_default_suite_names_known_nets():
    for quick in (False, True):
        suite = compare.load_suite(quick=quick)
        names = [r["net"] for key in ("memory", "throughput", "scaling") for r in suite[key]["runs"]]
        assert set(names) <= set(suite["nets"])
        for name in set(names):
            spec = suite["nets"][name]
            assert "resnet" in spec or (ROOT / spec["prototxt"]).is_file()


# -- caffe_baseline.py -----------------------------------------------------------------------------
CAFFE_TIME_LOG = """\
I1130 10:00:01.000000  4242 caffe.cpp:397] Iteration: 10 forward-backward time: 51 ms.
I1130 10:00:01.100000  4242 caffe.cpp:400] Average time per layer:
I1130 10:00:01.200000  4242 caffe.cpp:415] Average Forward pass: 20.5 ms.
I1130 10:00:01.200000  4242 caffe.cpp:417] Average Backward pass: 30.1 ms.
I1130 10:00:01.200000  4242 caffe.cpp:419] Average Forward-Backward: 50.7 ms.
I1130 10:00:01.200000  4242 caffe.cpp:421] Total Time: 507 ms.
"""
CAFFE_TEST_LOG = """\
I1130 10:00:02.000000  4242 caffe.cpp:281] Running for 1 iterations.
I1130 10:00:02.100000  4242 caffe.cpp:304] Batch 0, accuracy = 0.25
I1130 10:00:02.100000  4242 caffe.cpp:304] Batch 0, loss = 2.31
I1130 10:00:02.100000  4242 caffe.cpp:309] Loss: 2.31
I1130 10:00:02.100000  4242 caffe.cpp:321] accuracy = 0.25
I1130 10:00:02.100000  4242 caffe.cpp:321] loss = 2.30259 (* 1 = 2.30259 loss)
"""


def test_caffe_log_parsers():
    assert caffe_baseline.forward_backward_ms(CAFFE_TIME_LOG) == 50.7
    assert caffe_baseline.test_outputs(CAFFE_TEST_LOG) == {"accuracy": 0.25, "loss": 2.30259}
    with pytest.raises(ValueError):
        caffe_baseline.forward_backward_ms("no timing here")


def test_caffe_baseline_skips_without_caffe(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CAFFE_BIN", raising=False)
    assert caffe_baseline.find_caffe() is None
    assert "skipped" in caffe_baseline.compare(pb.NetParameter())
    assert caffe_baseline.main([str(ROOT / "prototxt" / "cifar10_resnet.prototxt")]) == 0
    assert "skipped" in capsys.readouterr().out


# A stand-in `caffe`: the same flags, answered by sncaffe's own `time` and `test` (whose output
# has Caffe's format), so the whole path (files written, commands, parsing, comparison) runs.
FAKE_CAFFE = """\
#!{python}
import subprocess, sys
cmd, args = sys.argv[1], dict(zip(sys.argv[2::2], sys.argv[3::2]))
out = [sys.executable, "-m", "sncaffe.cli", cmd, args["-model"], "-n", args["-iterations"]]
if "-weights" in args:
    out += ["--weights", args["-weights"]]
sys.exit(subprocess.call(out))
"""


def test_caffe_baseline_end_to_end_with_a_stand_in(tmp_path, monkeypatch):
    fake = tmp_path / "caffe"
    fake.write_text(FAKE_CAFFE.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setenv("CAFFE_BIN", str(fake))
    assert caffe_baseline.find_caffe() == fake
    param = parse_text(textwrap.dedent("""
        layer { name: "data" type: "Input" top: "data" top: "label"
                input_param { shape { dim: 4 dim: 1 dim: 12 dim: 12 } shape { dim: 4 } } }
        layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
                convolution_param { num_output: 3 kernel_size: 3 weight_filler { type: "msra" } } }
        layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip"
                inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
        layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
        layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc" include { phase: TEST } }
        """), pb.NetParameter())
    r = caffe_baseline.compare(param, iterations=1, workdir=tmp_path / "work")
    assert r["outputs"] == "agree", r
    assert set(r["caffe_outputs"]) == {"loss", "acc"} and r["caffe_ms"] > 0 and r["images_per_s"] > 0
    assert (tmp_path / "work" / "weights.caffemodel").is_file() and (tmp_path / "work" / "inputs.h5").is_file()


# -- compare.py depth (tools/compare_depth.py) -----------------------------------------------------


def _can_make_cgroups():
    from in_memory_cgroup import make_group
    try:
        group, _ = make_group(1 << 30)
    except OSError:
        return False
    group.rmdir()
    return True


needs_cgroup = pytest.mark.skipif(os.geteuid() != 0 or not _can_make_cgroups(),
                                  reason="making a memory cgroup needs root on cgroupfs")


@pytest.mark.parametrize("resolution", [1, 3])
def test_depth_search_closes_in_through_runs_that_are_killed(resolution):
    def rss(k):                      # a peak that bends upward, and past k = 77 a run the kernel kills
        return 100 + 5 * k + k * k // 40 if k <= 77 else math.inf
    calls = []
    lo, hi = compare_depth.deepest(lambda k: calls.append(k) or rss(k), 10 ** 9, 300, start=(10, 20),
                                   resolution=resolution)
    assert rss(lo) <= 10 ** 9 < rss(hi) and 0 < hi - lo <= resolution and lo <= 77 < hi
    assert len(calls) == len(set(calls)) <= 12


def test_depth_search_by_peak_stops_where_the_budget_is_crossed():
    lo, hi = compare_depth.deepest(lambda k: 1000 + 37 * k, 5000, 822, start=(20, 40))
    assert (lo, hi) == ((5000 - 1000) // 37, (5000 - 1000) // 37 + 1)


@needs_cgroup
def test_a_run_over_its_cgroup_is_killed_and_one_within_reports_its_own_peak():
    code = ("import json; b = b'x' * ({} << 20); "
            "print(json.dumps({{'rss': next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') "
            "if l.startswith('VmHWM')), 'size': len(b)}}))")
    within = compare_depth.run_limited([sys.executable, "-c", code.format(64)], 512 << 20, dict(os.environ))
    assert within["fits"] and 64 << 20 < within["rss"] < 512 << 20 and within["wall_s"] >= 0
    over = compare_depth.run_limited([sys.executable, "-c", code.format(400)], 256 << 20, dict(os.environ))
    assert not over["fits"] and over["killed"] and "rss" not in over


@needs_cgroup
def test_sncaffe_train_runs_in_a_cgroup_with_no_room_on_disk():
    from sncaffe.runtime.spill import spill_room
    with compare_depth.no_disk() as tmp:
        assert spill_room(tmp) < 1 << 20
    args = argparse.Namespace(batch=2, image_size=32, spill_dir=None)
    r = compare_depth.sncaffe_run(1, 2 << 30, 1, False, args)
    assert r["fits"] and 0 < r["rss"] < 2 << 30 and r["depth"] == compare_depth.depth(1) == 35
    assert r["malloc"] == "glibc default" and r["cpu_s"] > 0


def test_the_result_file_quotes_pytorchs_best_and_renders(tmp_path):
    import render_benchmarks

    def found(k, variant=None, malloc="glibc default", rss=2.9 * 2 ** 30, **extra):
        return {"deepest_k": k, "first_failing_k": k + 1, "variant": variant, "malloc": malloc,
                "runs": [{"k": k, "fits": True, "rss": rss, "wall_s": 10.0, "device": 2 ** 30 + k * 2 ** 24, **extra},
                         {"k": k - 10, "fits": True, "rss": rss / 2, "wall_s": 5.0, "device": 2 ** 30 + (k - 10) * 2 ** 24}]}
    data = {"limit": 3 << 30, "batch": 16, "image_size": 224, "threads": 1, "machine": "here", "command": "c",
            "pytorch": {"configs": {"eager (default malloc)": found(25, "eager"),
                                    "checkpoint (tuned malloc)": found(92, "checkpoint"),
                                    "checkpoint_sequential (tuned malloc)": found(80, "checkpoint_sequential",
                                                                                  segments=17)}},
            "sncaffe": {"no disk": found(100)}}
    out = compare_depth.result_file(data)
    notes = " ".join(out["notes"])
    assert f"{compare_depth.depth(100) / compare_depth.depth(92):.2f}x" in notes and "ResNet-308" in notes
    assert "(17 segments)" in str(out["tables"][0]["rows"])
    assert [t["caption"].split(":")[0] for t in out["tables"]] == ["Whole process", "Device view"]
    path = tmp_path / "depth.json"
    path.write_text(json.dumps(out))
    assert "Whole process" in render_benchmarks.render_table(render_benchmarks.load(path))
