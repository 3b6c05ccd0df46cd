"""Every mode gives mode none's bits also where its plan chunks convolutions over the
batch. A chunk is a multiple of the layer's reduce_block, and the weight and bias gradients
(and the CPU's GEMMs) are summed per reduction block in image order (layers/conv.py, the chunk
contract), so a chunked pass runs the arithmetic of the whole batch.

Each net the tight-capacity mode tests cover (test_modes.TIGHT, one of each family) runs at a
capacity where its plan chunks a convolution (asserted), at the smallest batch where its plan
can (a chunk is at least one reduction block): state arrays equal mode none's to the bit, and
the device and host pools' measured peaks are the plan's. Then LeNet's solver at 12.95 MiB
(train and test net planned together, SGD history compared), and the disk tier's device plan.

These run on sncaffe's own kernels (SNCAFFE_CONV=native), whose workspace shrinks with the
chunk: oneDNN's runs block by block whatever the chunk (layers/conv_onednn.py), so its
workspace is one block's and a plan gains nothing by chunking it.
"""
from dataclasses import replace

import pytest

from sncaffe import config
from sncaffe.backend import CPUDevice
from sncaffe.plan.planner import make_plan
from sncaffe.runtime.spill import spill_of
from conftest import ROOT, SHARED
from test_modes import assert_peaks, assert_same_bits, graph_of, net_param, train

# (file, batch, mode): the smallest batch at which the net's plan chunks a convolution somewhere
# below its uncached peak
NETS = [("prototxt/lenet_train_test.prototxt", 64, "offload"),
        ("prototxt/resnet50.prototxt", 16, "all"),
        ("zoo/bvlc/bvlc_googlenet__train_val.prototxt", 8, "offload"),
        ("zoo/bvlc/cifar10__cifar10_full_train_test.prototxt", 16, "all"),
        ("zoo/bvlc/cifar10__cifar10_full_sigmoid_train_test_bn.prototxt", 16, "offload"),
        ("zoo/resnet/ResNet-50-deploy.prototxt", 16, "offload"),
        ("zoo/bvlc/bvlc_alexnet__train_val.prototxt", 32, "all")]


@pytest.fixture(autouse=True)
def native_kernels(monkeypatch):
    monkeypatch.setattr(config, "settings", replace(config.settings, conv="native"))


def _path(name):
    return ROOT / name if name.startswith("prototxt/") else (SHARED / name if SHARED else None)


def chunked(plan):
    """{convolution: chunk} of the plan's chunked runs."""
    return {ins.op.node.name: ins.chunk for ins in plan.schedule if ins.kind == "run" and ins.chunk}


def chunking_capacity(graph, mode, parts=128):
    """The largest capacity below the uncached peak, in steps of 1/parts of its transient bytes,
    whose plan fits and chunks a convolution; None if none does before plans stop fitting."""
    uncached = make_plan(graph, mode)
    step = max(256, (uncached.peak - uncached.persistent_bytes) // parts // 256 * 256)
    for capacity in range(uncached.peak + 256, uncached.persistent_bytes, -step):
        plan = make_plan(graph, mode, capacity)
        if not plan.fits:
            return None
        if chunked(plan):
            return capacity
    return None


def run_on(param, mode, device):
    """train() on ``device``; returns the plan, the steps and the host pool's measured peak."""
    plan, steps = train(param, mode, device=device)
    return plan, steps, device.host_pool.peak


@pytest.mark.parametrize("name,batch,mode", [pytest.param(*c, id=c[0]) for c in NETS])
def test_chunked_plans_give_the_bits_of_none(name, batch, mode):
    path = _path(name)
    if path is None or not path.exists():
        pytest.skip(f"{name} is not present")
    param = net_param(path, batch)
    capacity = chunking_capacity(graph_of(param), mode)
    assert capacity, f"no capacity where {mode}'s plan chunks a convolution at batch {batch}"
    _, ref = train(param, "none")
    plan, steps, host_peak = run_on(param, mode, CPUDevice(capacity))
    chunks = chunked(plan)
    assert plan.fits and chunks and all(c < batch for c in chunks.values()), chunks
    assert_peaks(steps, plan)
    assert host_peak == plan.host_peak
    assert_same_bits(steps, ref)


@pytest.mark.parametrize("mib,chunks", [(11.2, True), (12.95, False)])
def test_lenet_solver_at_a_tight_device_trains_the_bits_of_none(mib, chunks):
    """LeNet's solver (auto; train and test net planned together; batch 64): at 12.95 MiB chunked
    convolutions used to change all 16 state arrays (8 parameter blobs and their momentum); at
    11.2 MiB, about the smallest device it trains on, conv1 is chunked."""
    from test_joint import MiB, solver

    def state(s):
        out = {f"{n}[{i}]": b.data.tobytes() for n, blobs in s.net.params.items() for i, b in enumerate(blobs)}
        out.update({f"history[{i}]": h.tobytes() for i, h in enumerate(s.history)})
        return out
    ref = solver(1 << 30, "none")
    ref.step(4)
    s = solver(int(mib * MiB))
    assert s.net.plan.mode != "none"
    assert bool(chunked(s.net.plan)) == chunks, chunked(s.net.plan)
    s.step(4)
    plans = [s.net.plan] + [n.plan for n in s.test_nets]
    assert s.device.pool.peak == max(p.peak for p in plans)
    assert s.device.host_pool.peak == max(p.host_peak for p in plans)
    a, b = state(ref), state(s)
    assert len(a) == 16 and [k for k in a if a[k] != b[k]] == []


@pytest.mark.parametrize("mode", ["offload", "all"])
def test_disk_tier_device_plan_chunks_and_gives_the_bits_of_none(tmp_path, mode):
    """A host pool too small for the offloads: the device is planned at its need x 1.02, where a
    convolution chunks, the rest spills to disk; every tier's measured peak is the plan's."""
    param = net_param(ROOT / "prototxt" / "resnet50.prototxt", 16)      # conv1's blocks: 7 images
    _, ref = train(param, "none")
    device = CPUDevice("1GiB", make_plan(graph_of(param), mode).host_peak // 3)
    device.spill_dir = tmp_path
    plan, steps, host_peak = run_on(param, mode, device)
    assert plan.disk_peak > 0 and chunked(plan), "the disk tier's device plan did not chunk"
    assert_same_bits(steps, ref)
    assert_peaks(steps, plan)
    assert host_peak == plan.host_peak
    spill = spill_of(device)
    assert spill.pool.peak == plan.disk_peak and spill.pool.in_use == 0
