"""The compiled row kernels of BatchNorm's and Scale's per-image sums (backend/fused.py): the sums
of einsum to float32 rounding, x - mean to the bit, each row's sum the same bits whatever the
rows beside it, its address and the thread count, and NaN carried through."""
import threading

import numpy as np
import pytest

from sncaffe.backend import fused

pytestmark = pytest.mark.skipif(fused.kernels() is None, reason="numba is not installed (pip install 'sncaffe[fast]')")


def data(shape, seed=3):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape) * 3 + 1).astype(np.float32) for _ in range(3)]


@pytest.mark.parametrize("shape", [(2, 5, 7), (3, 4, 49), (2, 3, 3136), (1, 2, 1)])
def test_the_kernels_give_einsums_sums_and_the_exact_difference(shape):
    k = fused.kernels()
    x, dy, _ = data(shape)
    n, c, s = shape
    mean = x.mean(axis=(0, 2)).astype(np.float32)
    out, out2 = np.empty((n, c), np.float32), np.empty((n, c), np.float32)
    k.row_sums(x, out)
    np.testing.assert_allclose(out, np.einsum("ncs->nc", x.astype(np.float64)), rtol=2e-6, atol=2e-5 * s)
    xn = np.empty_like(x)
    k.center_squares(x, mean, xn, out)
    assert np.array_equal(xn, x - mean[:, None])                 # the subtraction: exact, as NumPy's
    np.testing.assert_allclose(out, np.einsum("ncs,ncs->nc", xn.astype(np.float64), xn), rtol=2e-6, atol=1e-5)
    k.two_sums(dy, xn, out, out2)
    np.testing.assert_allclose(out, np.einsum("ncs->nc", dy.astype(np.float64)), rtol=2e-6, atol=2e-5 * s)
    np.testing.assert_allclose(out2, np.einsum("ncs,ncs->nc", dy.astype(np.float64), xn), rtol=2e-5,
                               atol=1e-4 * s)


def placed(a, offset):
    """A copy of ``a`` starting ``offset`` bytes past a 64-byte line."""
    buf = np.empty(a.nbytes + 128, np.uint8)
    start = (-buf.ctypes.data) % 64 + offset
    out = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def run_all(x, dy, mean):
    """Every kernel's per-row output for these rows."""
    k = fused.kernels()
    n, c, _ = x.shape
    a, b, sq = (np.empty((n, c), np.float32) for _ in range(3))
    xn = np.empty_like(x)
    k.row_sums(x, a)
    k.center_squares(x, mean, xn, sq)
    s0, s1 = np.empty((n, c), np.float32), np.empty((n, c), np.float32)
    k.two_sums(dy, xn, s0, s1)
    return np.stack([a, sq, s0, s1])


def test_each_rows_sum_is_the_same_bits_for_any_batch_address_and_thread():
    """What lets the replicas of cross-replica BatchNorm add one location's bits: images [2, 5)
    of a batch of 6, alone, at every float offset in memory, on a worker thread (one thread)
    and on the main thread (the budget's), against the whole batch's rows."""
    x, dy, _ = data((6, 5, 391))
    mean = x.mean(axis=(0, 2)).astype(np.float32)
    whole = run_all(x, dy, mean)
    for offset in range(0, 64, 4):
        part = run_all(placed(x[2:5], offset), placed(dy[2:5], offset), mean)
        assert part.tobytes() == whole[:, 2:5].tobytes(), offset
    got = []
    worker = threading.Thread(target=lambda: got.append(run_all(x, dy, mean)))
    worker.start()
    worker.join(60)
    assert got and got[0].tobytes() == whole.tobytes()


def test_nan_and_infinity_are_carried_as_numpy_carries_them():
    x = np.ones((1, 2, 16), np.float32)
    x[0, 0, 3] = np.nan
    x[0, 1, 5] = np.inf
    out = np.empty((1, 2), np.float32)
    fused.kernels().row_sums(x, out)
    assert np.isnan(out[0, 0]) and out[0, 1] == np.inf


def test_the_layers_give_einsums_results_to_rounding(monkeypatch):
    """A BatchNorm + Scale pair (run as one) forward and backward with the kernels and with
    einsum (the kernels switched off): the same tops and bottom diffs to float32 rounding."""
    from sncaffe import Net
    from sncaffe.proto import sncaffe_pb2 as pb
    from sncaffe.prototxt import parse_text
    text = """layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 4 dim: 6 dim: 9 dim: 11 } } }
layer { name: "c" type: "Convolution" bottom: "x" top: "c" convolution_param { num_output: 6 kernel_size: 1
  weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "bn" type: "BatchNorm" bottom: "c" top: "c" }
layer { name: "sc" type: "Scale" bottom: "c" top: "c" scale_param { bias_term: true filler { type: "uniform" } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "c" bottom: "x" top: "l" }"""
    results = []
    kernels = fused.kernels()
    for on in (True, False):
        monkeypatch.setattr(fused, "_kernels", kernels if on else False)
        net = Net(parse_text(text, pb.NetParameter()), "TRAIN", seed=4)
        net.blobs["x"].data[...] = np.random.default_rng(5).standard_normal(net.blobs["x"].data.shape)
        net.forward()
        net.backward()
        results.append((net.blobs["c"].data.copy(), net.params["c"][0].diff.copy(),
                        [b.diff.copy() for b in net.params["sc"]], [b.data.copy() for b in net.params["bn"]]))
    (y1, dx1, g1, s1), (y2, dx2, g2, s2) = results
    np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx1, dx2, rtol=1e-4, atol=1e-6)
    for a, b in zip(g1 + s1, g2 + s2):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_the_parallel_and_the_serial_kernels_give_the_same_bits():
    """Budgets of two or more run each kernel's parallel build (rows over numba's threads), one the
    serial build: the same bits either way, at one and at two threads."""
    import numba
    k = fused.kernels()
    x, dy, _ = data((3, 7, 785))
    mean = x.mean(axis=(0, 2)).astype(np.float32)
    rows, dy_rows = x.reshape(-1, 785), dy.reshape(-1, 785)
    outs = []
    parallel = k.parallel_build()
    for build, threads in ((k.serial, 1), (parallel, 1), (parallel, min(2, numba.config.NUMBA_NUM_THREADS))):
        numba.set_num_threads(threads)
        a, b, c, d = (np.empty(21, np.float32) for _ in range(4))
        xn = np.empty_like(rows)
        build["row_sums"](rows, a)
        build["center_squares"](rows, mean, xn, b)
        build["two_sums"](dy_rows, xn, c, d)
        outs.append(np.concatenate([a, b, c, d, xn.reshape(-1)]).tobytes())
    numba.set_num_threads(1)
    assert outs[0] == outs[1] == outs[2]


def test_numbas_thread_pool_leaves_onednns_team_at_the_budget():
    """numba's OpenMP pool and oneDNN share libgomp: starting the pool set the calling thread's
    OpenMP count to numba's thread count, and oneDNN then ran a budget of one on two threads
    (a one-thread run took 1.8 CPU-seconds a second). oneDNN reads the count back each time."""
    import numba
    from sncaffe.backend import onednn
    from sncaffe.backend import threads as policy
    if onednn.version() is None:
        pytest.skip("oneDNN is not installed")
    budget = policy.current().threads
    onednn._set_threads()
    k = fused.kernels()
    parallel = k.parallel_build()
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    x = np.ones((4, 9), np.float32)
    parallel["row_sums"](x, np.empty(4, np.float32))        # the pool started (or reused)
    onednn._gomp.omp_set_num_threads(budget + 1)             # what the pool's start did to this thread
    assert onednn._set_threads() == budget
    assert onednn._omp_max() == budget


def _sgd_numpy(data, diff, h, decay, rate, momentum):
    """Caffe's order as the solver's NumPy path computes it (solvers/update.py)."""
    if decay:
        diff += np.multiply(data, decay)
    h *= momentum
    diff *= rate
    h += diff
    diff[...] = h
    data -= diff


@pytest.mark.parametrize("size", [1, 37, (1 << 16) + 5, 300_001])
@pytest.mark.parametrize("decay", [0.0, 5e-4])
def test_sgds_one_pass_gives_numpys_bytes(size, decay):
    """The compiled SGD step (serial and parallel builds, one and two threads) writes the data,
    history and diff bytes NumPy's separate calls write, NaN and infinity included."""
    import numba
    k = fused.kernels()
    rng = np.random.default_rng(size)
    data, diff, h = ((rng.standard_normal(size) * 10 ** rng.uniform(-6, 3, size)).astype(np.float32)
                     for _ in range(3))
    if size > 1:
        data[0], diff[-1] = np.nan, np.inf
    scalars = np.float32(decay), np.float32(0.01), np.float32(0.9)
    want = [a.copy() for a in (data, diff, h)]
    _sgd_numpy(*want, *scalars)
    parallel = k.parallel_build()
    name = "sgd_step" if decay else "sgd_step_no_decay"
    for build, threads in ((k.serial, 1), (parallel, min(2, numba.config.NUMBA_NUM_THREADS))):
        numba.set_num_threads(threads)
        got = [a.copy() for a in (data, diff, h)]
        build[name](*got, *(scalars if decay else scalars[1:]))
        for g, w in zip(got, want):
            assert g.tobytes() == w.tobytes()
    numba.set_num_threads(1)
    got = [a.copy() for a in (data, diff, h)]
    k.sgd_step(*got, *scalars)          # the method: the decay chooses the kernel
    assert all(g.tobytes() == w.tobytes() for g, w in zip(got, want))


@pytest.mark.parametrize("shapes", [[(1, 3)], [(128, 16)], [(8, 64), (8, 64)], [(0, 5), (3, 5), (2, 5)]])
def test_the_compiled_image_sum_adds_in_numpys_order(shapes):
    """normalization.sum_over_images through the kernel gives the bits of its Python loop (out =
    row 0, then out += each row, part after part), which one location and the replicas share."""
    from sncaffe.layers.normalization import sum_over_images
    rng = np.random.default_rng(len(shapes))
    parts = [(rng.standard_normal(s) * 10 ** rng.uniform(-3, 3, s)).astype(np.float32) for s in shapes]
    if parts[-1].size:
        parts[-1][-1, 0] = np.nan
    want = None
    for part in parts:
        for row in part:
            want = row.copy() if want is None else want + row
    calls = []
    k = fused.kernels()
    real = k.image_sum
    k.image_sum = lambda *a: calls.append(1) or real(*a)
    try:
        got = sum_over_images(parts, np.empty(shapes[0][1], np.float32))
    finally:
        del k.image_sum
    assert len(calls) == sum(1 for p in parts if len(p))
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("size", [1, 37, 300_001])
def test_eltwise_relus_one_pass_gives_numpys_bytes(size):
    """Eltwise's sum with the ReLU after it (add_relu) and its backward (relu_grad_copy, one or two
    bottoms), serial and parallel builds: the bytes of np.add, np.maximum(y, 0) and
    np.multiply(dy, y > 0) and copies, with NaN, infinities and signed zeros in them."""
    import numba
    k = fused.kernels()
    rng = np.random.default_rng(size)
    a, b, dy = (rng.standard_normal(size).astype(np.float32) for _ in range(3))
    special = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, -1.0], np.float32)
    for arr, shift in ((a, 0), (b, 1), (dy, 2)):
        arr[:min(size, 6)] = np.roll(special, shift)[:min(size, 6)]
    with np.errstate(invalid="ignore"):        # inf + -inf, inf * 0: NaN, as wanted
        y_want = np.add(a, b)
        np.maximum(y_want, 0, out=y_want)
        dy_want = np.multiply(dy, y_want > 0)
    parallel = k.parallel_build()
    for build, threads in ((k.serial, 1), (parallel, min(2, numba.config.NUMBA_NUM_THREADS))):
        numba.set_num_threads(threads)
        y = np.empty_like(a)
        build["add_relu"](a, b, y)
        assert y.tobytes() == y_want.tobytes()
        g, d0, d1 = dy.copy(), np.empty_like(dy), np.empty_like(dy)
        build["relu_grad_copy"](y, g, d0, d1)
        assert g.tobytes() == d0.tobytes() == d1.tobytes() == dy_want.tobytes()
        g, d0 = dy.copy(), np.empty_like(dy)
        build["relu_grad_copy"](y, g, d0, d0)               # one bottom
        assert g.tobytes() == d0.tobytes() == dy_want.tobytes()
    numba.set_num_threads(1)
    g, d0 = dy.copy(), np.empty_like(dy)
    k.relu_grad_copy(y, g, d0)                              # the method, one bottom
    assert g.tobytes() == d0.tobytes() == dy_want.tobytes()
    numba.set_num_threads(1)
