"""How much all-reduce hides behind backward, measured on spans; one iteration's trace without MPI."""
import json

import pytest

from sncaffe.parallel import IterationTrace, overlap


def test_hidden_share_counts_all_reduce_time_under_backward_compute():
    spans = [("compute", "ip:forward", 0.0, 1.0),           # forward hides nothing
             ("comm", "all-reduce bucket 0", 0.5, 1.5),
             ("compute", "ip2:backward", 2.0, 4.0),
             ("compute", "ip1:backward", 4.0, 5.0),
             ("comm", "all-reduce bucket 1", 3.0, 6.0),
             ("comm", "all-reduce bucket 2", 3.5, 4.5),        # overlaps bucket 1: counted once
             ("d2h", "offload x", 2.0, 6.0)]
    o = overlap(spans)
    assert o["comm_s"] == pytest.approx(1.0 + 3.0)
    assert o["backward_s"] == pytest.approx(3.0)
    assert o["hidden_s"] == pytest.approx(2.0) and o["hidden_share"] == pytest.approx(0.5)
    # the update waits only for what runs after backward's last operator (5.0 to 6.0)
    assert o["exposed_s"] == pytest.approx(1.0) and o["in_backward_share"] == pytest.approx(0.75)
    assert overlap([("compute", "a:backward", 0, 1)])["hidden_share"] == 0.0


def test_exchange_in_a_gap_of_backward_is_not_hidden_but_not_exposed():
    """An all-reduce running while backward waits (a BatchNorm's batch sums, the GIL) overlaps no
    backward operator, yet the update does not wait for it."""
    spans = [("compute", "b:backward", 0.0, 1.0),
             ("exchange", "exchange bn's gradient sums", 1.0, 2.0),
             ("compute", "a:backward", 2.0, 3.0),
             ("comm", "all-reduce bucket 0", 1.0, 2.0),
             ("comm", "all-reduce bucket 1", 3.0, 3.5)]
    o = overlap(spans)
    assert o["hidden_share"] == pytest.approx(0.0)
    assert o["exposed_s"] == pytest.approx(0.5) and o["in_backward_share"] == pytest.approx(2 / 3)


def test_batchnorm_sums_are_not_gradient_exchange_and_its_stages_are_backward():
    """A cross-replica BatchNorm's exchanges (on comm over MPI, on exchange in one process) are
    counted apart; its backward stages are backward compute that an all-reduce may hide behind."""
    spans = [("compute", "bn:backward grad input", 0.0, 2.0),
             ("comm", "all-reduce bucket 0", 1.0, 3.0),
             ("comm", "exchange bn's gradient sums", 3.0, 3.5),
             ("cpu:0/exchange", "exchange bn2's batch sums", 4.0, 4.25)]
    o = overlap(spans)
    assert o["comm_s"] == pytest.approx(2.0) and o["hidden_share"] == pytest.approx(0.5)
    assert o["statistics_s"] == pytest.approx(0.75)


def test_a_single_process_trace_has_every_operator_and_the_update(tmp_path):
    from sncaffe.data.synthetic import SyntheticInputs
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.prototxt import parse_text
    from sncaffe.solvers import Solver
    p = pb.SolverParameter(base_lr=0.1, lr_policy="fixed", max_iter=3, snapshot_after_train=False)
    p.net_param.CopyFrom(parse_text(
        'layer { name: "in" type: "Input" top: "x" top: "label" input_param { shape { dim: 2 dim: 3 } '
        'shape { dim: 2 } } } layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" '
        'inner_product_param { num_output: 4 } } '
        'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "y" bottom: "label" top: "loss" }', pb.NetParameter()))
    solver = Solver(p, device="cpu")
    solver.feed = SyntheticInputs(0)
    tracer = IterationTrace(solver, tmp_path / "trace.json", 0)       # the first iteration: armed at once
    solver.solve()
    assert [n for _, n, _, _ in tracer.spans] == ["in:forward", "ip:forward", "loss:forward", "loss:backward",
                                                  "ip:backward", "update"]
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert [e["args"]["name"] for e in events if e["ph"] == "M"] == ["compute"]
