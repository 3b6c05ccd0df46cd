"""HDF5Output: write the two bottoms to an HDF5 file at every forward (Caffe's
hdf5_output_layer)."""
from __future__ import annotations

import numpy as np

from .base import Layer, register


def _legacy4(shape):
    """Caffe's legacy (num, channels, height, width) view of a blob of at most 4 axes."""
    return tuple(shape) + (1,) * (4 - len(shape))


@register
class HDF5Output(Layer):
    """Datasets ``data`` and ``label`` (float32, in Caffe's legacy 4-D shapes) in
    ``hdf5_output_param.file_name``, a path resolved against the working directory, as Caffe.
    The file is created empty when the net is built. Caffe fails on a second forward (the
    datasets exist); here a forward replaces them, so the file holds the last batch. No top, and
    backward leaves the bottoms' diffs at 0."""
    type = "HDF5Output"
    exact_bottoms, exact_tops = 2, 0
    backward_needs = ()

    def setup(self, bottom_shapes):
        import h5py
        data, label = (tuple(s) for s in bottom_shapes)
        for name, s in (("data", data), ("label", label)):
            if not s or len(s) > 4:
                raise self.error(f"bottom {name} {s} must have 1 to 4 axes (num, channels, height, width)")
        if data[0] != label[0]:
            raise self.error(f"data blob {data} and label blob {label} must have the same batch size")
        self.file_name = self.param.hdf5_output_param.file_name
        if not self.file_name:
            raise self.error("hdf5_output_param.file_name must be set")
        self.shapes = {"data": _legacy4(data), "label": _legacy4(label)}
        if not getattr(self, "created", False):     # once, as Caffe's LayerSetUp (not at each reshape)
            try:
                h5py.File(self.file_name, "w").close()
            except OSError as e:
                raise self.error(f'failed to create HDF5 file "{self.file_name}": {e}') from None
            self.created = True
        return []

    def forward(self, bottom, top):
        import h5py
        with h5py.File(self.file_name, "a") as f:
            for name, b in zip(("data", "label"), bottom):
                arr = b.data.get() if hasattr(b.data, "get") else b.data
                if name in f:
                    del f[name]
                f.create_dataset(name, data=np.asarray(arr, np.float32).reshape(self.shapes[name]))

    def backward(self, top, propagate_down, bottom):
        for b, down in zip(bottom, propagate_down):
            if down:
                b.diff.fill(0)
