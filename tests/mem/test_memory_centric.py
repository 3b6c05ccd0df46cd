"""Issue 12 item 3: memory-centric recomputation (SuperNeurons' second strategy): a segment is
replayed from its checkpoint for each backward step that needs it, and what the replay made
is freed after that step, instead of one replay whose results are kept (speed-centric). It
gives the bits of mode none and the planned peak; ``make_plan`` uses it per segment only
where a capacity-bound plan does not fit and it lowers the plan's cost."""
import pytest

from sncaffe.mem.planner import _cost, make_plan
from conftest import ROOT
from test_modes import assert_peaks, assert_same_bits, graph_of, net_param, reference, train

NETS = ["lenet_train_test", "alexnet", "cifar10_resnet"]


@pytest.mark.parametrize("mode", ["recompute", "all"])
@pytest.mark.parametrize("name", NETS)
def test_memory_centric_matches_plan_and_none(name, mode):
    path = ROOT / "prototxt" / f"{name}.prototxt"
    param = net_param(path)
    speed = make_plan(graph_of(param), mode, cost_aware=False)

    def planner(net):
        return make_plan(net.graph, mode, cost_aware=False, memory_centric=True)
    plan, steps = train(param, mode, planner=planner)
    assert plan.memory_centric > 0
    assert plan.recompute_flops > speed.recompute_flops or plan.recomputed_ops >= speed.recomputed_ops
    assert_peaks(steps, plan)
    assert_same_bits(steps, reference(path)[1])


def test_chosen_per_segment_only_where_it_costs_less():
    graph = graph_of(net_param(ROOT / "prototxt" / "alexnet.prototxt"))
    tight = make_plan(graph, "recompute").peak - 4096           # the speed-centric plan does not fit
    plan = make_plan(graph, "recompute", tight)
    speed = make_plan(graph, "recompute", tight, memory_centric=False)
    assert _cost(plan) <= _cost(speed)
    assert bool(plan.memory_centric) == ("memory-centric" in plan.note)
