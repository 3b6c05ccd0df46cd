"""The disk tier. Offloads the host pool cannot hold go to a spill file on the
copy streams; results are the bits of mode none, the spill file's measured peak is the plan's,
the file has no name once made (nothing is left behind), and a full disk is an error naming it."""
import os

import numpy as np
import pytest

from sncaffe.backend import CPUDevice
from sncaffe.runtime.spill import SpillFile, SpillFull, spill_of
from conftest import ROOT
from test_modes import assert_same_bits, net_param, train

R50 = ROOT / "prototxt" / "resnet50.prototxt"


@pytest.mark.parametrize("mode", ["offload", "all"])
def test_offloads_beyond_the_host_pool_spill_to_disk(tmp_path, mode):
    ref = net_param(R50)
    _, ref_steps = train(ref, "none")
    from test_modes import graph_of
    from sncaffe.plan.planner import make_plan
    host = make_plan(graph_of(ref), mode).host_peak // 3       # a host pool too small for the offloads
    device = CPUDevice("1GiB", host)
    device.spill_dir = tmp_path
    plan, steps = train(ref, mode, device=device)
    assert plan.fits and plan.disk_peak > 0 and 0 < plan.host_peak <= host
    assert any(ins.kind == "offload" and ins.tier == "disk" for ins in plan.schedule)
    assert_same_bits(steps, ref_steps)
    spill = spill_of(device)
    assert device.pool.peak == plan.peak
    assert device.host_pool.peak == plan.host_peak
    assert spill.pool.peak == plan.disk_peak and spill.pool.in_use == 0
    assert os.listdir(tmp_path) == []              # the spill file was unlinked when made
    assert str(tmp_path) in spill.path


def test_a_full_disk_is_an_error_naming_the_spill_file(tmp_path):
    spill = SpillFile(tmp_path)
    os.close(spill.fd)
    spill.fd = os.open("/dev/full", os.O_WRONLY)     # a device that is always full
    with pytest.raises(SpillFull, match=f"disk is full.*{tmp_path}"):
        spill.write(spill.alloc(4096), np.zeros(1024, np.float32))


def test_a_full_disk_during_training_stops_it_naming_the_spill_file(tmp_path):
    """The copy stream's error reaches the step that waits for the copy."""
    from test_modes import graph_of
    from sncaffe import Net
    from sncaffe.plan.planner import make_plan
    param = net_param(R50)
    device = CPUDevice("1GiB", make_plan(graph_of(param), "offload").host_peak // 3)
    device.spill_dir = tmp_path
    net = Net(param, "TRAIN", device=device, memory="offload", seed=1)
    assert net.plan.disk_peak > 0
    spill = spill_of(device)
    os.close(spill.fd)
    spill.fd = os.open("/dev/full", os.O_WRONLY)
    with pytest.raises(SpillFull, match="disk is full.*spill file"):
        net.forward()
        net.backward()
