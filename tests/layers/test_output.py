"""HDF5Output: the file Caffe writes (created at setup, datasets in legacy 4-D shapes)."""
import h5py
import numpy as np
import pytest

from sncaffe.gradcheck import Harness, make_layer
from sncaffe.layers.base import LayerError


def test_hdf5_output(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    layer = make_layer('type: "HDF5Output" hdf5_output_param { file_name: "out.h5" }', n_bottoms=2, n_tops=0)
    data, label = np.arange(12.0).reshape(2, 3, 2), np.array([1.0, 0.0])
    h = Harness(layer, [data, label], np.float32)
    with h5py.File("out.h5") as f:
        assert list(f) == []                # created empty when the net is built
    for scale in (1, 2):                    # a later forward replaces the datasets
        h.inputs[0] = data * scale
        h.forward()
        with h5py.File("out.h5") as f:
            assert f["data"].shape == (2, 3, 2, 1) and f["label"].shape == (2, 1, 1, 1)
            assert f["data"].dtype == np.float32
            np.testing.assert_array_equal(f["data"][()].reshape(2, 3, 2), data * scale)
            np.testing.assert_array_equal(f["label"][()].ravel(), label)
    (dd, dl), _ = h.backward([], [True, True])
    assert not dd.any() and not dl.any()


def test_hdf5_output_refusals(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LayerError, match=r'\(HDF5Output\): data blob .* must have the same batch size'):
        Harness(make_layer('type: "HDF5Output" hdf5_output_param { file_name: "o.h5" }', n_bottoms=2, n_tops=0),
                [np.ones((2, 3)), np.ones(3)])
    with pytest.raises(LayerError, match="failed to create HDF5 file"):
        Harness(make_layer('type: "HDF5Output" hdf5_output_param { file_name: "no/such/dir/o.h5" }', n_bottoms=2,
                           n_tops=0), [np.ones((2, 3)), np.ones(2)])
