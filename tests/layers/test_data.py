"""Input and DummyData: Caffe's shape and filler rules, refilling, no backward."""
import numpy as np
import pytest
from google.protobuf import text_format

from sncaffe.fillers import fill
from sncaffe.gradcheck import Harness, make_layer
from sncaffe.layers.base import LayerError
from sncaffe.proto import sncaffe_pb2 as pb


def source(text, n_tops=1):
    return make_layer(text, n_bottoms=0, n_tops=n_tops)


@pytest.mark.parametrize("shapes, n_tops, expected", [
    ("shape { dim: 2 dim: 3 }", 1, [(2, 3)]),
    ("shape { dim: 2 dim: 3 }", 2, [(2, 3), (2, 3)]),          # one shape shared by all tops
    ("shape { dim: 4 dim: 1 dim: 5 dim: 5 } shape { dim: 4 }", 2, [(4, 1, 5, 5), (4,)]),
])
def test_input_shapes(shapes, n_tops, expected):
    layer = source(f'type: "Input" input_param {{ {shapes} }}', n_tops)
    assert layer.backward_needs == ()
    h = Harness(layer, [])
    assert h.top_shapes == expected
    h.top[0].data[...] = 3                       # the caller fills the data; forward leaves it
    assert np.all(h.forward()[0] == 3)
    h.backward([np.zeros(s) for s in expected])


@pytest.mark.parametrize("text", ['type: "Input"',
                                  'type: "Input" input_param { shape { dim: 1 } shape { dim: 2 } }'])
def test_input_shape_errors(text):
    with pytest.raises(LayerError, match="shape"):
        Harness(source(text, 3), [])


def filler(text):
    return text_format.Parse(text, pb.FillerParameter())


def test_dummy_data_default_constant_zero_and_legacy_shape():
    h = Harness(source('type: "DummyData" dummy_data_param { num: 2 channels: 3 height: 4 width: 5 }'), [])
    assert h.top_shapes == [(2, 3, 4, 5)]
    h.top[0].data[...] = 7
    assert np.all(h.forward()[0] == 0)          # refilled: tops are not kept between passes


def test_dummy_data_one_filler_for_all_tops_draws_from_layer_rng():
    text = ('type: "DummyData" dummy_data_param { shape { dim: 3 dim: 4 } shape { dim: 5 } '
            'data_filler { type: "gaussian" std: 2 } }')
    layer = source(text, 2)
    h = Harness(layer, [])
    a, b = h.forward()
    rng = np.random.default_rng(h.seed + 1)      # the rng Harness gives the layer before forward
    ref_a, ref_b = np.zeros((3, 4)), np.zeros(5)
    fill(filler('type: "gaussian" std: 2'), ref_a, rng)
    fill(filler('type: "gaussian" std: 2'), ref_b, rng)
    np.testing.assert_array_equal(a, ref_a)
    np.testing.assert_array_equal(b, ref_b)
    layer.rng = np.random.default_rng(99)        # a new draw on the next pass
    layer.forward(h.bottom, h.top)
    assert not np.array_equal(h.top[0].data, a)


def test_dummy_data_filler_per_top_and_legacy_per_top():
    text = ('type: "DummyData" dummy_data_param { num: 2 num: 1 channels: 1 channels: 2 height: 1 height: 1 '
            'width: 3 width: 1 data_filler { type: "constant" value: 1.5 } '
            'data_filler { type: "uniform" min: 4 max: 5 } }')
    h = Harness(source(text, 2), [], np.float32)
    assert h.top_shapes == [(2, 1, 1, 3), (1, 2, 1, 1)]
    a, b = h.forward()
    assert a.dtype == np.float32 and np.all(a == 1.5)
    assert np.all((b >= 4) & (b <= 5))
    assert h.layer.backward_needs == () and not h.layer.allow_force_backward(0)


@pytest.mark.parametrize("params, match", [
    ("shape { dim: 2 } num: 1 channels: 1 height: 1 width: 1", "not both"),
    ("num: 1 channels: 1 height: 1", "same number"),
    ("", "needs a shape"),
    ("shape { dim: 2 } shape { dim: 3 }", "once per top"),
    ("shape { dim: 2 } data_filler { } data_filler { }", "data_filler"),
])
def test_dummy_data_errors(params, match):
    with pytest.raises(LayerError, match=match):
        Harness(source(f'type: "DummyData" dummy_data_param {{ {params} }}', 3), [])
