"""``auto`` is the default memory mode of Net, the Solver and the CLI, and a
net's or solver's own memory_param wins wherever it is read."""
import numpy as np

from sncaffe import Net
from sncaffe.backend import CPUDevice
from sncaffe.plan.planner import make_plan
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.solvers.solver import Solver
from conftest import ROOT
from test_modes import feed, graph_of, net_param

LENET = ROOT / "prototxt" / "lenet_train_test.prototxt"


def tight_capacity():
    """A device where 'none' does not fit but 'liveness' does."""
    graph = graph_of(net_param(LENET, 64))
    from test_net import smallest_fit
    capacity = smallest_fit(graph, "liveness")
    assert not make_plan(graph, "none", capacity).fits
    return capacity


def test_net_defaults_to_auto_none_when_it_fits():
    net = Net(net_param(LENET, 64), "TRAIN", device=CPUDevice("1GiB"))
    assert net.plan.mode == "none"


def test_net_defaults_to_auto_the_cheapest_that_fits():
    device = CPUDevice(tight_capacity())
    net = Net(net_param(LENET, 64), "TRAIN", device=device)
    assert net.plan.mode != "none" and net.plan.fits
    feed(net, np.random.default_rng(0))
    net.forward()
    net.backward()
    assert device.pool.peak == net.plan.peak


def test_the_nets_memory_param_wins():
    param = net_param(LENET, 64)
    param.memory_param.mode = "recompute"
    assert Net(param, "TRAIN", device=CPUDevice("1GiB")).plan.mode == "recompute"
    param.memory_param.mode = "none"           # set, even to the proto's default: no auto
    device = CPUDevice(tight_capacity())
    try:
        Net(param, "TRAIN", device=device)
    except MemoryError as e:
        assert "memory mode 'none'" in str(e)
    else:
        raise AssertionError("memory_param mode none was not honoured")


def _solver(net, solver_mode=None):
    from sncaffe.solvers.solver import history_bytes
    p = pb.SolverParameter(base_lr=0.01, max_iter=1, display=0, random_seed=1, snapshot_after_train=False,
                           lr_policy="fixed")
    p.net_param.CopyFrom(net)
    if solver_mode:
        p.memory_param.mode = solver_mode
    history = history_bytes(graph_of(net), 1)          # SGD's
    return Solver(p, device=CPUDevice(tight_capacity() + history + (1 << 20)))      # room for fragmentation


def test_solver_reads_the_solvers_then_the_nets_memory_param_else_auto():
    param = net_param(LENET, 64)
    assert _solver(param).net.plan.mode not in ("none",)            # auto: none does not fit
    param.memory_param.mode = "liveness"
    assert _solver(param).net.plan.mode == "liveness"
    assert _solver(param, "recompute").net.plan.mode == "recompute"     # the solver's wins


def test_cli_commands_default_to_auto():
    from sncaffe.cli import parser
    for argv in (["train", "x"], ["test", "x"], ["time", "x"]):
        assert parser().parse_args(argv).memory is None          # resolved by Net: memory_param, else auto


def test_train_picks_a_mode_and_says_so_in_one_line(tmp_path, capsys):
    """No --memory: the CLI plans with auto under a tight device and prints the plan line
    (mode, each tier's peak, traffic, recomputation) before the first iteration."""
    from google.protobuf import text_format
    from sncaffe.cli import main
    net = tmp_path / "lenet.prototxt"
    net.write_text(text_format.MessageToString(net_param(LENET, 64)))
    args = ["train", str(net), "--max-iter", "2", "--device-memory", str(tight_capacity() + (4 << 20)),
            "--snapshot-prefix", str(tmp_path / "s" / "lenet")]
    assert main(args) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "memory plan of LeNet" in x)
    assert "(auto)" in line and "device peak" in line and "host peak" in line and "moved per iteration" in line
    assert "GFLOP recomputed" in line and "mode 'none'" not in line
    assert out.index("memory plan") < out.index("Iteration 0")


def test_plan_draws_only_when_asked(tmp_path, monkeypatch, capsys):
    from google.protobuf import text_format
    from sncaffe.cli import main
    monkeypatch.chdir(tmp_path)
    net = tmp_path / "lenet.prototxt"
    net.write_text(text_format.MessageToString(net_param(LENET, 64)))
    assert main(["plan", str(net), "--device-memory", "64MiB"]) == 0
    assert not list(tmp_path.glob("*.png"))
    assert main(["plan", str(net), "--device-memory", "64MiB", "--png", "p.png"]) == 0
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert "timelines: p.png" in capsys.readouterr().out


def test_train_reads_the_nets_memory_param(tmp_path, capsys):
    """A net trained from its own file: its memory_param's mode and device_memory are used."""
    from google.protobuf import text_format
    from sncaffe.cli import main
    param = net_param(LENET, 64)
    param.memory_param.mode, param.memory_param.device_memory = "recompute", "40MiB"
    net = tmp_path / "lenet.prototxt"
    net.write_text(text_format.MessageToString(param))
    assert main(["train", str(net), "--max-iter", "1", "--snapshot-prefix", str(tmp_path / "s" / "l")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "memory plan of LeNet" in x)
    assert "mode 'recompute'" in line and "(auto)" not in line and "of 40.00 MiB" in line
