"""The RAM budget of the CPU device: the machine's, or a memory cgroup's (a container's)."""
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import ROOT
from sncaffe.backend.cpu import CPUDevice
from sncaffe.runtime import budget

GiB = 1 << 30


def _tree(tmp_path, lines, files):
    proc = tmp_path / "cgroup"
    proc.write_text("\n".join(lines) + "\n")
    for rel, text in files.items():
        f = tmp_path / "fs" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return str(proc), str(tmp_path / "fs")


def test_cgroup_v1_limit_and_usage_less_inactive_cache(tmp_path):
    proc, root = _tree(tmp_path, ["4:memory:/job", "0::/"], {
        "memory/job/memory.limit_in_bytes": str(3 * GiB), "memory/job/memory.usage_in_bytes": str(GiB),
        "memory/job/memory.stat": "cache 5\ntotal_inactive_file 268435456\n"})
    assert budget.cgroup_memory(proc, root) == (3 * GiB, GiB - (256 << 20))


def test_cgroup_v1_without_a_limit(tmp_path):
    proc, root = _tree(tmp_path, ["4:memory:/"], {"memory/memory.limit_in_bytes": "9223372036854771712"})
    assert budget.cgroup_memory(proc, root) == (None, 0)


def test_cgroup_v2_limit_and_max(tmp_path):
    proc, root = _tree(tmp_path, ["0::/box"], {
        "box/memory.max": str(2 * GiB), "box/memory.current": str(GiB // 2), "box/memory.stat": "inactive_file 0\n"})
    assert budget.cgroup_memory(proc, root) == (2 * GiB, GiB // 2)
    Path(root, "box", "memory.max").write_text("max\n")
    assert budget.cgroup_memory(proc, root)[0] is None


def test_device_memory_over_the_ram_is_said(caplog):
    over = budget.ram_budget() + GiB
    with caplog.at_level("WARNING", logger="sncaffe"):
        device = CPUDevice(over)
    assert device.pool.capacity == over // 256 * 256          # kept as given, never lowered silently
    assert any("more than the" in r.getMessage() for r in caplog.records)


def _memory_cgroup(limit):
    base = Path("/sys/fs/cgroup/memory")
    if not base.is_dir() or not os.access(base, os.W_OK):
        v2 = Path("/sys/fs/cgroup")
        if (v2 / "cgroup.controllers").exists() and os.access(v2, os.W_OK):
            base = v2
        else:
            pytest.skip("no writable memory cgroup hierarchy (needs root and cgroupfs)")
    group = base / f"sncaffe-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / ("memory.limit_in_bytes" if base.name == "memory" else "memory.max")).write_text(str(limit))
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup: {e}")
    return group


# LeNet's layers with an Input layer in place of its MNIST LMDBs, which a clone has not made yet.
LENET = """name: "LeNet"
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 8 dim: 1 dim: 28 dim: 28 } shape { dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1" convolution_param { num_output: 20 kernel_size: 5
        weight_filler { type: "xavier" } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2" convolution_param { num_output: 50 kernel_size: 5
        weight_filler { type: "xavier" } } }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool2" top: "ip1" inner_product_param { num_output: 500
        weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2" inner_product_param { num_output: 10
        weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" }
"""


@pytest.fixture
def lenet(tmp_path):
    path = tmp_path / "lenet.prototxt"
    path.write_text(LENET)
    return str(path)


def test_a_container_limit_is_the_budget(lenet):
    """Inside a 1 GiB memory cgroup, as a container sets it, the CPU device's RAM is within it and
    LeNet's step runs there (the machine's MemAvailable would be many times that)."""
    group = _memory_cgroup(GiB)
    code = (f"import os; open({str(group / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
            "from sncaffe.backend.cpu import CPUDevice\n"
            "d = CPUDevice(); print(d.ram)\n"
            "from sncaffe.cli import main\n"
            f"raise SystemExit(main(['time', {lenet!r}, '-n', '1']))\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    finally:
        group.rmdir() if not (group / "cgroup.procs").read_text().strip() else None
    assert out.returncode == 0, out.stderr[-2000:]
    ram = int(out.stdout.splitlines()[0])
    assert 0 < ram <= GiB


def test_an_address_space_limit_bounds_the_arenas(lenet):
    """Under ulimit -v (4 GB, on a machine with far more RAM) LeNet's step runs: the arenas are
    sized to what the process may still map, not to the machine's free RAM."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4_000_000 * 1024, resource.RLIM_INFINITY))
    out = subprocess.run([sys.executable, "-m", "sncaffe.entry", "time", lenet, "-n", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         preexec_fn=limit, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Pool peak" in out.stdout


WIDE = """name: "wide"
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 64 dim: 8 dim: 64 dim: 64 } shape { dim: 64 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1" convolution_param { num_output: 16 kernel_size: 3 pad: 1 } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "relu1" }
layer { name: "conv2" type: "Convolution" bottom: "relu1" top: "conv2" convolution_param { num_output: 16 kernel_size: 3 pad: 1 } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "relu2" }
layer { name: "ip" type: "InnerProduct" bottom: "relu2" top: "ip" inner_product_param { num_output: 10 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def test_a_plan_is_made_again_where_the_process_grew_into_its_room(tmp_path, caplog, monkeypatch):
    """The RAM budget is taken when the device is made; what the process grows by outside the
    pools afterwards (the graph, planning) is taken off it, and a plan the growth no longer
    leaves room for is made again."""
    from sncaffe import net as net_module
    from sncaffe.net import Net, grown_outside_pools, ram_left
    from sncaffe.plan import planner
    from sncaffe.plan.planner import make_plan
    from sncaffe.runtime.budget import process_memory
    (tmp_path / "wide.prototxt").write_text(WIDE)
    device = CPUDevice()
    net = Net(str(tmp_path / "wide.prototxt"), "TRAIN", device=device, defer=True)
    plan = net.make_plan("auto")
    lean = make_plan(net.graph, "liveness")
    assert plan.mode == "none" and plan.fits and plan.peak + plan.host_peak <= ram_left(device)
    assert plan.peak - lean.peak > 64 << 20         # room between them for the process's own noise
    # (measured from now: the earlier tests' garbage, given back, may have lowered the RSS since)
    device.rss_at_budget = process_memory()["rss"]
    noise = 16 << 20
    grown = device.ram - (plan.peak + lean.peak) // 2
    ram = net.budgets()[1]["ram"]
    device.rss_at_budget -= grown                   # as if it had grown since by all but that
    assert grown_outside_pools(device) >= grown - noise and plan.peak + plan.host_peak > ram_left(device)
    assert net.budgets()[1]["ram"] <= ram - grown + noise   # a plan made now is made within what is left
    device.rss_at_budget += grown
    # The growth during planning (a plan of millions of steps): the plan made first is made again.
    made = []

    def growing(*args, **kw):
        made.append(planner.auto_plan(*args, **kw))
        if len(made) == 1:
            device.rss_at_budget -= grown
        return made[-1]
    monkeypatch.setattr(net_module, "auto_plan", growing)
    with caplog.at_level("INFO", logger="sncaffe"):
        again = net.make_plan("auto")
    assert "over the RAM budget: planning again" in caplog.text
    assert [p.mode for p in made][0] == "none" and len(made) == 2
    assert again.mode != "none" and again.fits and again.peak + again.host_peak <= again.ram < made[0].ram
