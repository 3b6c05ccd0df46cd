"""Checkmate's optimal rematerialization (sncaffe/plan/checkmate.py) on a net small enough to
solve in well under a second: its schedules replayed by an independent checker, its optimum
against sncaffe's own choice of what to replay, evaluated in the same model."""
import pytest

from sncaffe.graph import build_graph
from sncaffe.plan import checkmate as cm
from sncaffe.plan.planner import GRANULARITIES, make_plan
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text, prepare_net

pytest.importorskip("highspy", reason="HiGHS's MILP solver (pip install highspy, the checkmate extra)")

DEPTH = 5


def _conv(i, bottom):
    return f'''layer {{ name: "conv{i}" type: "Convolution" bottom: "{bottom}" top: "conv{i}"
  convolution_param {{ num_output: 4 kernel_size: 3 pad: 1 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "relu{i}" type: "ReLU" bottom: "conv{i}" top: "conv{i}" }}
'''


@pytest.fixture(scope="module")
def graph():
    """A chain of convolutions with in-place ReLUs: each convolution's output is needed again in
    backward, so holding them all is the peak and replaying some lowers it."""
    text = '''name: "chain" force_backward: true
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 2 dim: 4 dim: 8 dim: 8 } shape { dim: 2 } } }
''' + "".join(_conv(i, "data" if i == 1 else f"conv{i - 1}") for i in range(1, DEPTH + 1)) + f'''
layer {{ name: "ip" type: "InnerProduct" bottom: "conv{DEPTH}" top: "ip" inner_product_param {{ num_output: 3 }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
'''
    return build_graph(prepare_net(parse_text(text, pb.NetParameter()), pb.TRAIN), pb.TRAIN)


@pytest.fixture(scope="module")
def problem(graph):
    return cm.build_problem(graph)


def _top(problem):
    """The peak with nothing recomputed."""
    return cm.check(problem, *cm.replay_schedule(problem, set()))


def _floor(problem):
    """No schedule goes below the most one node needs: its inputs and its output."""
    return max(problem.mem[k] + sum(problem.mem[i] for i in problem.deps[k]) for k in range(len(problem)))


def test_problem_shape(problem):
    # one forward node per convolution chain (with its ReLU), the input, ip and the loss; one
    # backward node per chain with a backward; backward nodes are never recomputed
    assert problem.nf == DEPTH + 3
    assert len(problem) == problem.nf + DEPTH + 2
    assert not any(problem.recomputable[problem.nf:])
    assert all(max(d, default=-1) < j for j, d in enumerate(problem.deps))
    assert _floor(problem) < _top(problem)


def test_budget_that_fits_everything_recomputes_nothing(problem):
    top = _top(problem)
    sol = cm.solve(problem, top)
    assert sol.status == "optimal"
    assert sol.cost == 0
    assert cm.check(problem, sol.R, sol.S, top) <= top


def test_tighter_budgets_are_valid_and_no_worse_than_sncaffe(graph, problem):
    """sncaffe's whole-segment plans, their replayed chains scheduled as sncaffe replays them;
    Checkmate at each one's peak in the model must be valid, within it, and replay no more."""
    top, compared = _top(problem), 0
    for g in GRANULARITIES[:5]:
        plan = make_plan(graph, "recompute", None, granularity=g)
        R, S = cm.replay_schedule(problem, cm.replayed_nodes(problem, plan))
        peak = cm.check(problem, R, S)
        theirs = cm.recomputed_flops(problem, R)
        sol = cm.solve(problem, peak)
        assert sol.status == "optimal", (g, sol.status)
        assert cm.check(problem, sol.R, sol.S, peak) <= peak
        assert 0 <= sol.cost <= theirs, (g, sol.cost, theirs)
        assert sol.cost == cm.recomputed_flops(problem, sol.R)
        compared += peak < top
    assert compared, "no sncaffe plan lowered the peak in the model: nothing was compared"


def test_cost_grows_as_the_budget_shrinks(problem):
    top, floor = _top(problem), _floor(problem)
    costs = []
    for k in range(5):
        budget = top - (top - floor) * k // 4
        sol = cm.solve(problem, budget)
        assert sol.feasible, budget
        assert cm.check(problem, sol.R, sol.S, budget) <= budget
        costs.append(sol.cost)
    assert costs == sorted(costs)
    assert costs[-1] > 0


def test_infeasible_budget(problem):
    sol = cm.solve(problem, _floor(problem) - 1)
    assert sol.status == "infeasible"
    assert not sol.feasible and sol.cost is None


def test_checker_rejects_broken_schedules(problem):
    floor = _floor(problem)
    sol = cm.solve(problem, floor)
    assert sol.cost > 0
    # a recomputation taken away: the node that needed it runs without its input
    t, i = next((t, i) for t in range(len(problem)) for i in range(t) if sol.R[t][i])
    R = [row[:] for row in sol.R]
    R[t][i] = 0
    with pytest.raises(cm.ScheduleError):
        cm.check(problem, R, sol.S)
    # nothing recomputed does not fit the floor
    with pytest.raises(cm.ScheduleError):
        cm.check(problem, *cm.replay_schedule(problem, set()), floor)
