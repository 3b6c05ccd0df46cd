"""sncaffe.run: what the commands do, resolved in one place and callable as the command line calls it."""
import pytest

from sncaffe import backend
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text
from sncaffe.run import Resources, net_param, score, solver_param, train

NET = """name: "tiny"
memory_param { mode: "liveness" device_memory: "40MiB" }
layer { name: "input" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 3 dim: 4 dim: 4 } shape { dim: 4 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def test_flags_then_the_files_memory_param_then_the_machine():
    net = parse_text(NET, pb.NetParameter())
    solver = pb.SolverParameter()
    solver.memory_param.mode = "offload"
    assert Resources().mode(net) == "liveness" and Resources().capacity(net) == "40MiB"
    assert Resources().mode(solver, net) == "offload"                      # the solver's first
    assert Resources(memory="all", device_memory="1GiB").mode(solver, net) == "all"
    assert Resources(device_memory="1GiB").capacity(net) == "1GiB"
    assert Resources().mode(pb.NetParameter()) == "auto" and Resources().capacity(pb.NetParameter()) is None
    assert Resources(spill="somewhere").make_device(net).spill_dir == "somewhere"


def test_a_gpu_is_planned_for_without_one():
    capacity, kw = backend.budgets("cuda", "2GiB", "1GiB")
    assert capacity == 2 << 30 and kw == {"host_capacity": 1 << 30, "ram": None}     # no disk tier on a GPU
    capacity, kw = backend.budgets("cpu", "2GiB", "1GiB")
    assert capacity == 2 << 30 and kw["host_capacity"] == 1 << 30 and kw["ram"] is None and kw["spill"] > 0
    with pytest.raises(ValueError, match="unknown device"):
        backend.plan_target("tpu")


def test_train_and_score_as_the_command_line_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.prototxt").write_text(NET)
    p, from_net = solver_param("tiny.prototxt", max_iter=3, batch=2, snapshot_prefix="m/t")
    assert from_net and p.max_iter == 3 and p.net_param.layer[0].input_param.shape[0].dim[0] == 2
    solver = train(p, Resources(memory="recompute"), path="tiny.prototxt", from_net=True)    # over the net's
    assert solver.iter == 3 and solver.net.plan.mode == "recompute" and (tmp_path / "m/t_iter_3.caffemodel").is_file()
    means = score(net_param("tiny.prototxt", batch=2), Resources(memory="none"), weights="m/t_iter_3.caffemodel",
                  iterations=2)
    assert set(means) == {"loss"} and means["loss"].shape == (1,)


ROWS = '''
import sncaffe.pycaffe as caffe

class Rows(caffe.Layer):
    """Batch k: 2 + k rows of 2 values, each k + 1 (param_str "fixed": 2 rows always)."""
    def setup(self, bottom, top):
        self.k = 0
    def reshape(self, bottom, top):
        top[0].reshape(2 if self.param_str == "fixed" else 2 + self.k, 2)
    def forward(self, bottom, top):
        top[0].data[...] = self.k + 1
        self.k += 1
'''


@pytest.mark.parametrize("rows,want", [("fixed", [2.0] * 4), ("growing", [(4 * 1 + 6 * 2 + 8 * 3) / 18])])
def test_score_averages_outputs_whose_size_changes_over_all_their_values(tmp_path, monkeypatch, caplog, rows,
                                                                         want):
    """As a Faster R-CNN's scores, one row per proposal: Caffe's element-wise mean has no meaning."""
    (tmp_path / "rows_layer.py").write_text(ROWS)
    monkeypatch.syspath_prepend(str(tmp_path))
    net = parse_text(f'layer {{ name: "rows" type: "Python" top: "x" python_param {{ module: "rows_layer" '
                     f'layer: "Rows" param_str: "{rows}" }} }} '
                     f'layer {{ name: "y" type: "Power" bottom: "x" top: "y" }}', pb.NetParameter())
    means = score(net, Resources(memory="none"), iterations=3)
    assert list(means) == ["y"] and means["y"].tolist() == pytest.approx(want)
    assert ('output "y" has 6 values in batch 1, 4 in those before' in caplog.text) == (rows == "growing")
