"""Gradient buckets: which parameters go together, in the order backward makes them."""
import numpy as np

from sncaffe import Net
from sncaffe.backend.cpu import CPUDevice
from sncaffe.parallel import make_buckets
from sncaffe.parallel.buckets import describe
from sncaffe.proto import sncaffe_pb2 as pb
from sncaffe.prototxt import parse_text

NET = """name: "b"
layer { name: "in" type: "Input" top: "x" top: "label"
        input_param { shape { dim: 2 dim: 3 dim: 6 dim: 6 } shape { dim: 2 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "c" convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "bn" type: "BatchNorm" bottom: "c" top: "c" }
layer { name: "ip1" type: "InnerProduct" bottom: "c" top: "h" param { lr_mult: 1 } param { lr_mult: 0 }
        inner_product_param { num_output: 8 } }
layer { name: "ip2" type: "InnerProduct" bottom: "h" top: "y" inner_product_param { num_output: 3 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "y" bottom: "label" top: "loss" }
"""


def net():
    return Net(parse_text(NET, pb.NetParameter()), "TRAIN", device=CPUDevice(4 << 20))


def test_one_bucket_in_backward_order_without_parameters_that_get_no_gradient():
    (b,) = make_buckets(net())
    # ip1's bias has lr_mult 0 and BatchNorm's statistics are no gradients: neither is sent.
    assert [(s.layer, s.index) for s in b.slots] == [("ip2", 0), ("ip2", 1), ("ip1", 0), ("conv", 0), ("conv", 1)]
    sizes = [3 * 8, 3, 8 * 64, 4 * 27, 4]
    assert [s.size for s in b.slots] == sizes and b.size == sum(sizes)
    assert [s.offset for s in b.slots] == list(np.cumsum([0] + sizes[:-1]))
    assert b.nbytes == 4 * sum(sizes) and b.dtype == np.float32
    assert b.layers == {"ip2", "ip1", "conv"}


def test_buckets_close_before_they_would_exceed_the_limit():
    buckets = make_buckets(net(), bucket_bytes=4 * 500)
    assert [[(s.layer, s.index) for s in b.slots] for b in buckets] == \
        [[("ip2", 0), ("ip2", 1)], [("ip1", 0)], [("conv", 0), ("conv", 1)]]
    assert [b.size for b in buckets] == [27, 512, 112]      # ip1's weights alone exceed the limit
    one_each = make_buckets(net(), bucket_bytes=1)        # a parameter larger than the limit goes alone
    assert [len(b.slots) for b in one_each] == [1] * 5
    assert describe(buckets).startswith("bucket 0 (0.00 MB): ip2[0], ip2[1]; bucket 1")


def test_the_pass_puts_each_all_reduce_after_its_last_producer_in_bucket_order():
    """Operators after the same backward operator keep their buckets' order (every rank issues
    the same collectives in the same order)."""
    from types import SimpleNamespace

    from sncaffe.plan.schedule import Instr, Schedule
    from sncaffe.parallel.data_parallel import insert_allreduce

    def run(name):
        return Instr("run", op=SimpleNamespace(kind="backward", node=SimpleNamespace(name=name)))
    schedule = Schedule(backward=[run("c"), run("b"), run("a")])
    ops = [SimpleNamespace(name=n, layers=set(ls)) for n, ls in
           (("0", {"c"}), ("1", {"c"}), ("2", {"b", "c"}), ("3", {"a"}))]
    insert_allreduce(schedule, ops)
    assert [ins.op.name if ins.kind == "collective" else ins.op.node.name for ins in schedule.backward] == \
        ["c", "0", "1", "b", "2", "a", "3"]
