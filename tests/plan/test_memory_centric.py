"""Memory-centric recomputation (SuperNeurons' second strategy): a segment is
replayed from its checkpoint for each backward step that needs it, and what the replay made
is freed after that step, instead of one replay whose results are kept (speed-centric). It
gives the bits of mode none and the planned peak; ``make_plan`` uses it per segment only
where a capacity-bound plan does not fit and it lowers the plan's cost."""
import pytest

from sncaffe.plan.planner import _cost, make_plan
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
    assert plan.memory_centric > 0 and plan.recomputed_ops > 0 and speed.recomputed_ops > 0
    # (not more replays than speed-centric's, necessarily: it replays every segment whole once,
    # memory-centric only up to what each step reads, and not what a backward step left for the
    # next: cifar10_resnet in mode all 23 operators to 55)
    assert_peaks(steps, plan)
    assert_same_bits(steps, reference(path)[1])


def test_chosen_per_segment_only_where_it_costs_less():
    graph = graph_of(net_param(ROOT / "prototxt" / "alexnet.prototxt"))
    tight = make_plan(graph, "recompute").peak - 4096           # the speed-centric plan does not fit
    plan = make_plan(graph, "recompute", tight)
    speed = make_plan(graph, "recompute", tight, memory_centric=False)
    assert _cost(plan) <= _cost(speed)
    assert bool(plan.memory_centric) == ("memory-centric" in plan.note)


@pytest.mark.parametrize("mode", ["recompute", "all"])
def test_what_a_backward_step_writes_for_a_later_one_is_not_freed_between(mode):
    """A fused Scale's backward writes BatchNorm's per-image sums (partials) and BatchNorm's
    backward reads them: a replay for BatchNorm does not give them back, so the memory-centric
    plan keeps them between the two steps (it freed them, and the pool handed back the same bytes
    only while nothing else was placed there)."""
    from sncaffe.plan.liveness import op_tensors
    plan = make_plan(graph_of(net_param(ROOT / "prototxt" / "cifar10_resnet.prototxt")), mode,
                     cost_aware=False, memory_centric=True)
    written, freed = {}, {}     # id(root) -> the backward step that wrote it, not yet read
    checked = 0
    for ins in plan.schedule.backward:
        if ins.kind == "run" and not ins.recompute:
            for r, w in op_tensors(ins.op):
                if not w and written.pop(id(r), None):
                    checked += 1
            written.update({id(r): ins.op.name for r, w in op_tensors(ins.op) if w})
        elif ins.kind == "free" and id(ins.tensor) in written:
            freed[id(ins.tensor)] = written.pop(id(ins.tensor))
        elif ins.kind == "alloc":
            assert id(ins.tensor) not in freed, f"{ins.tensor.name}, written by {freed[id(ins.tensor)]}, " \
                                                "was freed and allocated again before it was read"
    assert checked > 50
