"""Fillers: statistics of each on a large array, exact bilinear kernels, Caffe's fan rules and errors."""
import math

import numpy as np
import pytest
from google.protobuf import text_format

from sncaffe.fillers import fill
from sncaffe.proto import sncaffe_pb2 as pb

SHAPE = (64, 32, 3, 3)          # fan_in 288, fan_out 576, 18432 values


def filled(text, shape=SHAPE, dtype=np.float64, seed=0):
    a = np.full(shape, np.nan, dtype)
    fill(text_format.Parse(text, pb.FillerParameter()), a, np.random.default_rng(seed))
    return a


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_constant(dtype):
    a = filled('type: "constant" value: 2.5', dtype=dtype)
    assert a.dtype == dtype and np.all(a == 2.5)
    assert np.all(filled("", (3, 4)) == 0)      # the default type is constant 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_uniform(dtype):
    a = filled('type: "uniform" min: -1 max: 3', dtype=dtype)
    assert a.dtype == dtype and a.min() >= -1 and a.max() <= 3
    assert abs(a.mean() - 1) < 0.05 and abs(a.std() - 4 / math.sqrt(12)) < 0.03


def test_gaussian():
    a = filled('type: "gaussian" mean: 0.5 std: 2')
    assert abs(a.mean() - 0.5) < 0.05 and abs(a.std() - 2) < 0.05


def test_gaussian_sparse_keeps_sparse_over_shape0():
    # Caffe's probability is sparse / shape[0] (its num_outputs), whatever the fan-in.
    a = filled('type: "gaussian" std: 1 sparse: 16', shape=(64, 500))
    kept = a != 0
    assert abs(kept.mean() - 16 / 64) < 0.015
    assert abs(a[kept].std() - 1) < 0.05
    assert np.all(filled('type: "gaussian" sparse: 0', shape=(8, 10)) == 0)
    with pytest.raises(ValueError, match="sparse"):
        filled('type: "gaussian" sparse: 9', shape=(8, 10))     # probability 9/8 > 1


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_positive_unitball_rows_sum_to_one(dtype):
    a = filled('type: "positive_unitball"', shape=(10, 3, 4, 5), dtype=dtype)
    assert a.min() >= 0 and a.max() <= 1
    np.testing.assert_allclose(a.reshape(10, -1).sum(axis=1), 1, rtol=1e-5)


# fan_in = count / shape[0], fan_out = count / shape[1]
N_BY_NORM = {"FAN_IN": 288, "FAN_OUT": 576, "AVERAGE": (288 + 576) / 2}


@pytest.mark.parametrize("norm", sorted(N_BY_NORM))
def test_xavier(norm):
    a = filled(f'type: "xavier" variance_norm: {norm}')
    scale = math.sqrt(3 / N_BY_NORM[norm])
    assert np.abs(a).max() <= scale and np.abs(a).max() > 0.99 * scale
    assert abs(a.mean()) < 0.02 * scale and abs(a.std() - scale / math.sqrt(3)) < 0.02 * scale


@pytest.mark.parametrize("norm", sorted(N_BY_NORM))
def test_msra(norm):
    a = filled(f'type: "msra" variance_norm: {norm}')
    std = math.sqrt(2 / N_BY_NORM[norm])
    assert abs(a.mean()) < 0.03 * std and abs(a.std() - std) < 0.02 * std


def test_xavier_default_fan_in_and_low_rank_blobs():
    assert np.abs(filled('type: "xavier"')).max() <= math.sqrt(3 / 288)
    # A 2-D InnerProduct weight (out, in): fan_in = in. A 1-D blob: fan_in 1, fan_out = count.
    assert np.abs(filled('type: "xavier"', shape=(10, 300))).max() <= math.sqrt(3 / 300)
    assert np.abs(filled('type: "xavier"', shape=(5000,))).max() > 0.99 * math.sqrt(3)
    assert np.abs(filled('type: "xavier" variance_norm: FAN_OUT', shape=(5000,))).max() <= math.sqrt(3 / 5000)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bilinear_4x4_exact(dtype):
    # f = ceil(4/2) = 2, c = (4-1)/(2f) = 0.75: 1 - |x/2 - 0.75| = .25 .75 .75 .25 per axis.
    w = np.array([0.25, 0.75, 0.75, 0.25])
    a = filled('type: "bilinear"', shape=(2, 3, 4, 4), dtype=dtype)
    assert a.dtype == dtype
    for kernel in a.reshape(6, 4, 4):
        np.testing.assert_array_equal(kernel, np.outer(w, w))


def test_bilinear_odd_kernel_is_symmetric():
    # Caffe master's fixed formula (PR #5713): kernel 3 gives f = 2, c = 0.5.
    w = np.array([0.5, 1.0, 0.5])
    np.testing.assert_array_equal(filled('type: "bilinear"', shape=(1, 1, 3, 3))[0, 0], np.outer(w, w))


@pytest.mark.parametrize("shape", [(1, 1, 3, 4), (9, 9)])
def test_bilinear_needs_square_4d(shape):
    with pytest.raises(ValueError, match="bilinear"):
        filled('type: "bilinear"', shape=shape)


def test_errors():
    with pytest.raises(ValueError, match='"nonsense"'):
        filled('type: "nonsense"')
    with pytest.raises(ValueError, match="sparsity"):
        filled('type: "uniform" sparse: 3')
    with pytest.raises(ValueError, match="std"):
        filled('type: "gaussian" std: 0')


def test_same_seed_same_values_and_device_arrays():
    assert np.array_equal(filled('type: "xavier"', seed=3), filled('type: "xavier"', seed=3))

    class DeviceArray:                       # stands in for a CuPy array: written through .set
        shape, dtype = (4, 5), np.dtype(np.float32)

        def set(self, host):
            self.host = host

    a = DeviceArray()
    fill(text_format.Parse('type: "constant" value: 7', pb.FillerParameter()), a, np.random.default_rng(0))
    assert a.host.shape == (4, 5) and a.host.dtype == np.float32 and np.all(a.host == 7)
