"""RNN, LSTM, LSTMUnit: gradients, Caffe's golden cases standalone, the hidden state carried
between forwards, expose_hidden, refusals."""
import numpy as np
import pytest

from conftest import needs_shared
from golden import run_golden_layer
from sncaffe.gradcheck import Harness, check_gradient, make_layer
from sncaffe.layers import LayerError

T, N, H = 4, 3, 3
# cont: stream 1 restarts at t=2, stream 2 at t=3; every stream starts at t=0, so the state a
# previous forward left is multiplied away (the gradient checker reruns forward for every probe)
CONT = np.array([[0, 0, 0], [1, 1, 1], [1, 0, 1], [1, 1, 0]], float)


def recurrent(kind, expose=False, static=False):
    n_state = (2 if kind == "LSTM" else 1) * expose
    return make_layer(f'type: "{kind}" recurrent_param {{ num_output: {H} expose_hidden: {str(expose).lower()} '
                      f'weight_filler {{ type: "uniform" min: -0.5 max: 0.5 }} '
                      f'bias_filler {{ type: "uniform" min: -0.2 max: 0.2 }} }}',
                      n_bottoms=2 + static + n_state, n_tops=1 + n_state)


def inputs(rng, static=False, x_shape=(T, N, 2, 2)):
    xs = [rng.standard_normal(x_shape), CONT]
    if static:
        xs.append(rng.standard_normal((N, 3)))
    return xs


@pytest.mark.parametrize("kind", ["RNN", "LSTM"])
@pytest.mark.parametrize("static", [False, True])
def test_gradient(kind, static):
    layer = recurrent(kind, static=static)
    h = check_gradient(layer, inputs(np.random.default_rng(3), static))
    assert not h.bottom[1].diff.any()       # no gradient into cont
    ds = 1 if static else 0
    n_params = {"RNN": 5, "LSTM": 3}[kind] + ds
    assert len(layer.blobs) == n_params


@pytest.mark.parametrize("kind", ["RNN", "LSTM"])
@pytest.mark.parametrize("static", [False, True])
def test_gradient_through_exposed_state(kind, static):
    """With expose_hidden, h_0 (and c_0) feed the first step, which cont 1 keeps: the gradients of
    x, x_static and the parameters account for them. As in Caffe, the diffs of the exposed tops
    are ignored and h_0/c_0 get none (zeros)."""
    rng = np.random.default_rng(4)
    n_state = 2 if kind == "LSTM" else 1
    cont = CONT.copy()
    cont[0] = 1
    bottoms = inputs(rng, static)
    bottoms[1] = cont
    bottoms += [rng.standard_normal((1, N, H)) for _ in range(n_state)]
    layer = recurrent(kind, expose=True, static=static)
    state = list(range(len(bottoms) - n_state, len(bottoms)))
    h = check_gradient(layer, bottoms, check_bottoms=[0] + [2] * static,
                       ignored_tops=list(range(1, 1 + n_state)))
    bottom_diffs, _ = h.backward([rng.standard_normal(s) for s in h.top_shapes],
                                 [i != 1 for i in range(len(bottoms))])
    for i in state:
        assert not bottom_diffs[i].any()
    # the exposed tops are the last step's state: h_T is the output's last row (LSTM)
    tops = h.forward()
    if kind == "LSTM":
        np.testing.assert_array_equal(tops[1][0], tops[0][-1])
    # and the exposed h_0 really is read: another h_0 gives another output
    h.inputs[state[0]] += 1
    assert not np.allclose(h.forward()[0], tops[0])


def test_exposed_top_diffs_are_ignored():
    rng = np.random.default_rng(5)
    cont = CONT.copy()
    cont[0] = 1
    bottoms = inputs(rng) + [rng.standard_normal((1, N, H)) for _ in range(2)]
    bottoms[1] = cont
    h = Harness(recurrent("LSTM", expose=True), bottoms)
    tops = h.forward()
    dy = rng.standard_normal(tops[0].shape)
    pd = [True, False, True, True]
    a = h.backward([dy, np.zeros_like(tops[1]), np.zeros_like(tops[2])], pd)
    b = h.backward([dy, rng.standard_normal(tops[1].shape), rng.standard_normal(tops[2].shape)], pd)
    for u, v in zip(a[0] + a[1], b[0] + b[1]):
        np.testing.assert_array_equal(u, v)


def lstm_unit():
    return make_layer('type: "LSTMUnit"', n_bottoms=3, n_tops=2)


def test_lstm_unit_gradient():
    rng = np.random.default_rng(6)
    layer = lstm_unit()
    h = check_gradient(layer, [rng.standard_normal((1, 4, H)), rng.standard_normal((1, 4, 4 * H)),
                               np.array([[1, 0, 1, 0]], float)])
    assert layer.allow_force_backward(0) and not layer.allow_force_backward(2)
    # cont 0 cuts the cell: c_prev gets no gradient in those streams (Caffe's golden case shows it)
    dc_prev = h.backward([rng.standard_normal(s) for s in h.top_shapes])[0][0]
    assert not dc_prev[0, 1].any() and not dc_prev[0, 3].any() and dc_prev[0, 0].all()


def test_lstm_is_its_units():
    """LSTM = per step: gates = W_xc x_t + b_c + W_hc (cont_t h_{t-1}), then LSTMUnit."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((T, N, 5))
    lstm = Harness(recurrent("LSTM"), [x, CONT])
    out = lstm.forward()[0]
    w_xc, b_c, w_hc = (b.data for b in lstm.layer.blobs)
    hs, c = np.zeros((N, H)), np.zeros((1, N, H))
    for t in range(T):
        gates = x[t] @ w_xc.T + b_c + (CONT[t][:, None] * hs) @ w_hc.T
        unit = Harness(lstm_unit(), [c, gates[None], CONT[t][None]])
        c, hs = unit.forward()
        hs = hs[0]
        np.testing.assert_allclose(out[t], hs, rtol=1e-12)


@pytest.mark.parametrize("kind", ["RNN", "LSTM"])
def test_state_carries_over_between_forwards(kind):
    """Without expose_hidden, a forward starts where the last one ended (Caffe copies h_T to
    h_0): two forwards of T steps equal one of 2T steps; reset() starts from zero again."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2 * T, N, 2))
    cont = np.ones((2 * T, N))
    cont[0] = 0
    cont[5, 1] = 0
    whole = Harness(recurrent(kind), [x, cont])
    params = [b.data.copy() for b in whole.layer.blobs]
    expected = whole.forward()[0]
    halves = Harness(recurrent(kind), [x[:T], cont[:T]], params=params)
    first = halves.forward()[0]
    halves.inputs = [x[T:], cont[T:]]
    second = halves.forward()[0]
    np.testing.assert_allclose(np.concatenate([first, second]), expected, rtol=1e-12)
    halves.layer.reset()
    fresh = Harness(recurrent(kind), [x[T:], cont[T:]], params=params).forward()[0]
    np.testing.assert_allclose(halves.forward()[0], fresh, rtol=1e-12)
    assert not np.allclose(fresh, second)


@pytest.mark.parametrize("kind", ["RNN", "LSTM"])
def test_exposed_state_matches_carried_state(kind):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2 * T, N, 2))
    cont = np.ones((2 * T, N))
    carried = Harness(recurrent(kind), [x[:T], cont[:T]])
    params = [b.data.copy() for b in carried.layer.blobs]
    carried.forward()
    state = [s.reshape(1, N, H) for s in carried.layer._carry]
    carried.inputs = [x[T:], cont[T:]]
    expected = carried.forward()[0]
    exposed = Harness(recurrent(kind, expose=True), [x[T:], cont[T:]] + state, params=params)
    tops = exposed.forward()
    np.testing.assert_allclose(tops[0], expected, rtol=1e-12)
    for top, end in zip(tops[1:], carried.layer._carry):
        np.testing.assert_allclose(top[0], end, rtol=1e-12)


@pytest.mark.parametrize("text,shapes,message", [
    ("num_output: 0", [(T, N, 2), (T, N)], "num_output"),
    ("num_output: 3", [(T,), (T,)], "at least 2 axes"),
    ("num_output: 3", [(T, N, 2), (T, N, 1)], "cont"),
    ("num_output: 3", [(T, N, 2), (T, N), (N + 1, 2)], "x_static"),
    ("num_output: 3 expose_hidden: true", [(T, N, 2), (T, N), (1, N, 4), (1, N, 3)], "hidden state"),
])
def test_bad_settings_name_the_layer(text, shapes, message):
    layer = make_layer(f'name: "rec" type: "LSTM" recurrent_param {{ {text} }}', n_bottoms=len(shapes))
    with pytest.raises(LayerError, match=f'"rec" \\(LSTM\\).*{message}'):
        layer.setup(shapes)


def test_bottom_counts():
    layer = make_layer('type: "LSTM" recurrent_param { num_output: 2 expose_hidden: true }', n_bottoms=3)
    with pytest.raises(LayerError, match="at least 4 bottom"):
        layer.check_counts(3, 3)
    with pytest.raises(LayerError, match="exactly 3 top"):
        layer.check_counts(4, 1)
    with pytest.raises(LayerError, match=r"4 \* 2 = 8 channels, got 7"):
        lstm_unit().setup([(1, 3, 2), (1, 3, 7), (1, 3)])


@needs_shared
@pytest.mark.parametrize("case", ["lstm", "lstm_unit", "rnn", "rnn_static"])
def test_golden(case):
    run_golden_layer(case, folder="coverage")


NET = """
name: "seq" force_backward: true
layer { name: "input" type: "Input" top: "x" top: "cont"
  input_param { shape { dim: 4 dim: 3 dim: 2 } shape { dim: 4 dim: 3 } } }
layer { name: "lstm" type: "LSTM" bottom: "x" bottom: "cont" top: "h" %s
  recurrent_param { num_output: 3 %s weight_filler { type: "uniform" min: -0.5 max: 0.5 } } }
"""


def seq_net(layer_extra="", param_extra=""):
    from sncaffe import Net
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.prototxt import parse_text
    net = Net(parse_text(NET % (layer_extra, param_extra), pb.NetParameter()), "TRAIN")
    net.blobs["x"].data[...] = np.random.default_rng(0).standard_normal((4, 3, 2))
    net.blobs["cont"].data[...] = CONT
    return net


def test_no_backward_into_cont():
    """force_backward leaves cont without a diff; asking for one is refused, as Caffe's CHECK does."""
    net = seq_net()
    net.forward()
    net.blobs["h"].diff[...] = 1
    net.backward()
    assert net.blobs["cont"].diff is None and net.blobs["x"].diff.any()
    net = seq_net("loss_weight: 1 propagate_down: true propagate_down: true")
    net.forward()
    with pytest.raises(LayerError, match='"lstm" \\(LSTM\\): cannot backpropagate to the sequence indicators'):
        net.backward()


def test_debug_info_logs_the_unrolled_state(caplog):
    net = seq_net(param_extra="debug_info: true")
    with caplog.at_level("INFO", logger="sncaffe"):
        net.forward()
        net.blobs["h"].diff[...] = 1
        net.backward()
    text = caplog.text
    for what in ("[Forward] Layer lstm, h data", "[Forward] Layer lstm, c data",
                 "[Backward] Layer lstm, bottom blob x diff", "[Backward] Layer lstm, param blob 2 diff"):
        assert what in text
    caplog.clear()
    with caplog.at_level("INFO", logger="sncaffe"):
        seq_net().forward()
    assert "Layer lstm" not in caplog.text


def test_lstm_unit_non_binary_cont_keeps_caffes_f_derivative():
    """For cont outside {0, 1} Caffe's f' is f (1 - f) of f = cont * sigmoid(x_f), not the true
    cont * s (1 - s); sncaffe keeps Caffe's arithmetic (exact for the 0/1 cont of real nets)."""
    rng = np.random.default_rng(10)
    c_prev, x = rng.standard_normal((1, 2, H)), rng.standard_normal((1, 2, 4 * H))
    cont = np.array([[0.5, 2.0]])
    h = Harness(lstm_unit(), [c_prev, x, cont])
    c, hh = h.forward()
    dc, dh = rng.standard_normal(c.shape), rng.standard_normal(hh.shape)
    dx = h.backward([dc, dh])[0][1]
    s = lambda v: 1 / (1 + np.exp(-v))       # noqa: E731
    i, o, g = s(x[0, :, :H]), s(x[0, :, 2 * H:3 * H]), np.tanh(x[0, :, 3 * H:])
    f = cont[0][:, None] * s(x[0, :, H:2 * H])
    c_term = dc[0] + dh[0] * o * (1 - np.tanh(c[0]) ** 2)
    np.testing.assert_allclose(dx[0, :, H:2 * H], c_term * c_prev[0] * f * (1 - f), rtol=1e-12)
    np.testing.assert_allclose(c[0], f * c_prev[0] + i * g, rtol=1e-12)
