"""Liveness: first and last use of every tensor, in-place chains, split aliasing,
workspaces that live inside one operator, and the persistent set."""
import pytest

from sncaffe.graph import build_graph
from sncaffe.plan.liveness import analyze, op_tensors, persistent_roots, workspaces
from sncaffe.plan.planner import make_plan
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text, prepare_net

CONV = 'convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.1 } }'
# conv1 -> BN -> Scale -> ReLU, all in place; conv1 then feeds conv2 and a residual sum
# (a split); concat of two branches; pooling and a loss.
TEXT = f'''
name: "tiny"
layer {{ name: "data" type: "Input" top: "data" top: "label"
        input_param {{ shape {{ dim: 2 dim: 3 dim: 8 dim: 8 }} shape {{ dim: 2 }} }} }}
layer {{ name: "conv1" type: "Convolution" bottom: "data" top: "conv1" {CONV} }}
layer {{ name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }}
layer {{ name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param {{ bias_term: true }} }}
layer {{ name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }}
layer {{ name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2" {CONV} }}
layer {{ name: "sum" type: "Eltwise" bottom: "conv1" bottom: "conv2" top: "sum" }}
layer {{ name: "conv3" type: "Convolution" bottom: "sum" top: "conv3" {CONV} }}
layer {{ name: "cat" type: "Concat" bottom: "sum" bottom: "conv3" top: "cat" }}
layer {{ name: "pool" type: "Pooling" bottom: "cat" top: "pool" pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"
        inner_product_param {{ num_output: 2 weight_filler {{ type: "gaussian" std: 0.1 }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
'''


def graph_of(text, force_backward=False):
    param = parse_text(text, pb.NetParameter())
    param.force_backward = force_backward
    return build_graph(prepare_net(param, pb.TRAIN), pb.TRAIN)


@pytest.fixture(scope="module")
def graph():
    return graph_of(TEXT)


@pytest.fixture(scope="module")
def uses(graph):
    return {r.name: u for r, u in analyze(graph.ops, persistent_roots(graph)).values()}


def at(graph, name):
    return next(i for i, op in enumerate(graph.ops) if op.name == name)


def test_persistent_set(graph):
    names = {t.name for t in persistent_roots(graph)}
    params = {f"{layer}[{i}]" for layer, n in (("conv1", 2), ("bn1", 3), ("scale1", 2), ("conv2", 2),
                                                ("conv3", 2), ("ip", 2)) for i in range(n)}
    assert names == params | {p + ".diff" for p in params} | {"data", "label", "loss", "loss.diff"}


def test_inputs_diffs_are_persistent_with_force_backward():
    names = {t.name for t in persistent_roots(graph_of(TEXT, force_backward=True))}
    assert {"data", "data.diff", "label"} <= names and "label.diff" not in names


def test_first_and_last_use(graph, uses):
    assert (uses["conv2"].first, uses["conv2"].last) == (at(graph, "conv2:forward"), at(graph, "sum:forward"))
    # pooling's backward reads only its argmax: its output dies in ip's backward, which reads it
    assert uses["pool"].last == at(graph, "ip:backward")
    assert (uses["pool#argmax"].first, uses["pool#argmax"].last) == (at(graph, "pool:forward"),
                                                                    at(graph, "pool:backward"))
    # a diff lives from the backward that writes it to the backward that reads it
    assert (uses["ip.diff"].first, uses["ip.diff"].last) == (at(graph, "loss:backward"), at(graph, "ip:backward"))
    for name, u in uses.items():
        assert u.first == min(u.reads + u.writes) and u.last == max(u.reads + u.writes)
        assert u.writes and min(u.writes) == u.first, f"{name} is read before it is written"


def test_concat_inputs_die_at_concat_forward(graph, uses):
    # Concat's and Convolution's backward read no top: conv3's output is dead once concatenated
    assert uses["conv3"].last == at(graph, "cat:forward")
    assert uses["cat"].last == at(graph, "pool:forward")
    assert uses["conv3.diff"].first == at(graph, "cat:backward")


def test_in_place_chain_is_one_tensor(graph, uses):
    blob = graph.blobs["conv1"]
    chain = ["conv1", "bn1", "scale1", "relu1"]
    for name in chain:
        node = graph.layer(name)
        assert node.tops[0] is blob and node.tops[0].data is blob.data
    u = uses["conv1"]
    assert [at(graph, n + ":forward") for n in chain] == u.writes[:4]
    assert u.last == at(graph, "relu1:backward")            # ReLU in place reads its top
    # the in-place chain's diff is one tensor too, written down the chain in backward
    assert {at(graph, n + ":backward") for n in ("relu1", "scale1", "bn1")} <= set(uses["conv1.diff"].writes)
    assert uses["conv1.diff"].last == at(graph, "conv1:backward")


def test_split_tops_alias_the_data_but_not_the_diff(graph, uses):
    split = next(n for n in graph.layers if n.type == "Split")
    root = graph.blobs["conv1"].data
    assert [t.data.root for t in split.tops] == [root, root]
    assert not any(t.name in uses for t in split.tops if t.name != "conv1")   # no tensor of its own
    diffs = [t.diff for t in split.tops]
    assert diffs[0].root is not diffs[1].root and all(d.root is not graph.blobs["conv1"].diff for d in diffs)
    assert uses["conv1"].reads[:2] == [at(graph, "conv2:forward"), at(graph, "sum:forward")]
    # the split's backward sums both diffs into conv1's
    assert at(graph, split.name + ":backward") in uses["conv1.diff"].writes


def test_workspaces_belong_to_one_operator(graph):
    for op in graph.ops:
        ws = workspaces(op)
        assert all(t.kind == "workspace" for t in ws)
        assert not any(r.kind == "workspace" for r, _ in op_tensors(op))
    conv = graph.ops[at(graph, "conv1:forward")]
    assert workspaces(conv) and set(map(id, workspaces(conv))) == {id(t) for t in graph.layer("conv1").workspace.values()}
    roots = {id(r) for r, _ in analyze(graph.ops, persistent_roots(graph)).values()}
    assert not any(id(t) in roots for op in graph.ops for t in workspaces(op))


def _runs(schedule):
    """(index of each instruction, op) for every run, in order."""
    return [(k, ins.op) for k, ins in enumerate(schedule) if ins.kind == "run"]


def test_liveness_plan_allocates_at_first_use_and_frees_after_last(graph):
    plan = make_plan(graph, "liveness")
    instrs = list(plan.schedule)
    runs = _runs(instrs)
    op_index = {id(op): i for i, op in enumerate(graph.ops)}
    assert [op_index[id(op)] for _, op in runs] == list(range(len(graph.ops)))   # nothing recomputed
    uses = {id(r): u for r, u in analyze(graph.ops, persistent_roots(graph)).values()}
    seen = set()
    for k, ins in enumerate(instrs):
        if ins.kind not in ("alloc", "free"):
            continue
        key = id(ins.tensor)
        seen.add(key)
        if ins.kind == "alloc":
            op = next(op for j, op in runs if j > k)        # the first run after the allocation
            if ins.tensor.kind == "workspace":
                assert key in map(id, workspaces(op)), f"{ins} is not for {op.name}"
            else:
                assert op_index[id(op)] == uses[key].first, f"{ins} is not at its first use"
        else:
            op = [op for j, op in runs if j < k][-1]        # the last run before the free
            if ins.tensor.kind == "workspace":
                assert key in map(id, workspaces(op)), f"{ins} is not right after {op.name}"
            else:
                assert op_index[id(op)] == uses[key].last, f"{ins} is not right after its last use"
    assert set(uses) <= seen


@pytest.mark.parametrize("mode", ["none", "liveness"])
def test_none_keeps_everything_and_liveness_frees_it(graph, mode):
    plan = make_plan(graph, mode)
    allocs = [ins for ins in plan.schedule if ins.kind == "alloc"]
    if mode == "none":            # every tensor but the workspaces allocated once, at bind time
        assert all(ins.tensor.kind == "workspace" for ins in allocs)
        assert plan.peak >= plan.persistent_bytes
    else:
        assert make_plan(graph, "none").peak > plan.peak >= plan.lower_bound
        assert sum(a.tensor.kind != "workspace" for a in allocs) == len(analyze(graph.ops, persistent_roots(graph)))
