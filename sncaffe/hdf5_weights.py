"""Caffe's HDF5 weights (Net::ToHDF5, CopyTrainedLayersFromHDF5): ``data/<layer>/<index>`` datasets.

A parameter shared by ParamSpec name is written by its owner only, and a
sharer without a dataset is fine on load, as in Caffe; shapes must match
exactly (Caffe loads with reshape off). ``diff/<layer>/<index>`` holds the
gradients when asked for. ``Net.copy_from`` reads such a file wherever a
.caffemodel goes (Caffe's CopyTrainedLayersFrom tells them apart by content).
"""
from __future__ import annotations

import logging

import numpy as np

from .layers.structure import transfer

log = logging.getLogger("sncaffe")


def is_hdf5(path) -> bool:
    """Caffe's H5Fis_hdf5: how CopyTrainedLayersFrom tells an HDF5 file from a binary proto."""
    import h5py
    try:
        return bool(h5py.is_hdf5(str(path)))
    except OSError:
        return False


def warn_nonfinite(arr, what) -> None:
    """Loaded weights that are NaN or infinite make every output they touch so: say which."""
    bad = arr.size - int(np.count_nonzero(np.isfinite(arr)))
    if bad:
        log.warning("%s holds %d non-finite value(s) (NaN or infinity) of %d: outputs computed from it "
                    "will be non-finite too", what, bad, arr.size)


def save(net, path, write_diff=False) -> None:
    """Write ``net``'s (an sncaffe.Net) parameters to ``path``."""
    import h5py
    with h5py.File(str(path), "w") as f:
        data = f.create_group("data")
        diff = f.create_group("diff") if write_diff else None
        for node in net.graph.layers:
            group = data.create_group(node.name)
            dgroup = diff.create_group(node.name) if diff is not None else None
            for j, blob in enumerate(node.layer.blobs):
                if node.param_owner[j] is None:             # only parameters that own themselves
                    group.create_dataset(str(j), data=_host(blob.data))
                if dgroup is not None:
                    dgroup.create_dataset(str(j), data=_host(blob.diff))


def load(net, path) -> None:
    """Copy the parameters in ``path`` into ``net``'s layers of the same names; names and shapes are
    checked before any data is read."""
    from .blobproto import read_h5_blobs
    nodes = {n.name: n for n in net.graph.layers}

    def keep(name, shapes):
        node = nodes.get(name)
        if node is None:
            log.info("Ignoring source layer %s", name)
            return False
        blobs = node.layer.blobs
        if len(shapes) > len(blobs) or any(j >= len(blobs) for j in shapes):
            raise ValueError(f'incompatible number of blobs for layer "{name}": {len(shapes)} in '
                             f"the file, {len(blobs)} in the net")
        for j, blob in enumerate(blobs):
            if j not in shapes:
                if node.param_owner[j] is not None:     # shared: its owner's dataset fills it
                    continue
                raise ValueError(f'incompatible number of blobs for layer "{name}": no dataset '
                                 f'"data/{name}/{j}"')
            if tuple(shapes[j]) != tuple(blob.data.shape):
                raise ValueError(f'layer "{name}" blob {j}: cannot load blob from hdf5; shape mismatch: '
                                 f"source shape {tuple(shapes[j])}, target shape {tuple(blob.data.shape)}")
        return True

    for name, group in read_h5_blobs(path, keep).items():
        for j, blob in enumerate(nodes[name].layer.blobs):
            if j in group:
                arr = np.asarray(group[j], dtype=blob.data.dtype)
                transfer(blob.data, arr)
                warn_nonfinite(arr, f'{path}: layer "{name}" blob {j}')


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)     # a CuPy array comes to the host
