"""pycaffe's ``caffe.io``: BlobProto and Datum conversion, image loading and resizing, Transformer.

Resizing goes through OpenCV's ``cv2.resize`` where opencv-python-headless is
installed (the ``opencv`` extra), as Caffe's C++ does: bilinear is
INTER_LINEAR, so a shrinking resize samples pixel pairs rather than averaging
areas. Without OpenCV, Pillow resizes (per channel, in float): its bilinear
filter widens with the scale factor when shrinking, so downscaled images differ
from Caffe's (upscaling agrees up to rounding). pycaffe itself resized with
scikit-image; OpenCV is what Caffe's data layers use.
"""
from __future__ import annotations

import numpy as np

from ..data import image as _image
from ..proto import sncaffe_pb2 as caffe_pb2

# -- BlobProto and Datum ----------------------------------------------------------


def blobproto_to_array(blob, return_diff=False):
    """A BlobProto's data (or diff) as an array of its shape (legacy num/channels/height/width too)."""
    from ..blobproto import blob_shape
    values = np.array(blob.diff if return_diff else blob.data, dtype=np.float32)
    if not values.size:
        values = np.array(blob.double_diff if return_diff else blob.double_data)
    return values.reshape(blob_shape(blob))


def array_to_blobproto(arr, diff=None):
    """A BlobProto with ``arr``'s shape and values (and ``diff``'s, when given)."""
    blob = caffe_pb2.BlobProto()
    blob.shape.dim.extend(arr.shape)
    blob.data.extend(np.asarray(arr, dtype=np.float32).flat)
    if diff is not None:
        blob.diff.extend(np.asarray(diff, dtype=np.float32).flat)
    return blob


def arraylist_to_blobprotovector_str(arraylist):
    vec = caffe_pb2.BlobProtoVector()
    vec.blobs.extend([array_to_blobproto(arr) for arr in arraylist])
    return vec.SerializeToString()


def blobprotovector_str_to_arraylist(s):
    vec = caffe_pb2.BlobProtoVector()
    vec.ParseFromString(s)
    return [blobproto_to_array(blob) for blob in vec.blobs]


def array_to_datum(arr, label=None):
    """A Datum of a (C, H, W) array: uint8 as bytes, anything else as float_data."""
    if arr.ndim != 3:
        raise ValueError("Incorrect array shape.")
    datum = caffe_pb2.Datum()
    datum.channels, datum.height, datum.width = arr.shape
    if arr.dtype == np.uint8:
        datum.data = arr.tobytes()
    else:
        datum.float_data.extend(arr.astype(float).flat)
    if label is not None:
        datum.label = label
    return datum


def datum_to_array(datum):
    """A raw Datum's values as (C, H, W): uint8 from bytes, float from float_data."""
    shape = (datum.channels, datum.height, datum.width)
    if len(datum.data):
        return np.frombuffer(datum.data, dtype=np.uint8).reshape(shape)
    return np.array(datum.float_data).astype(float).reshape(shape)


# -- images -------------------------------------------------------------------------

def load_image(filename, color=True):
    """An image as float32 H x W x 3 (RGB) or H x W x 1 in [0, 1], as pycaffe returns it."""
    from PIL import Image
    with Image.open(filename) as img:
        if color:
            a = np.asarray(img.convert("RGB"))
        else:
            a = np.asarray(img.convert("L"))[:, :, None]
    return a.astype(np.float32) / 255.0


def resize_image(im, new_dims, interp_order=1):
    """Resize H x W x K ``im`` to ``new_dims`` (height, width); interp_order 0 nearest, 1 bilinear,
    3 bicubic. OpenCV where installed (Caffe's cv::resize), else Pillow."""
    new_dims = (int(new_dims[0]), int(new_dims[1]))
    im = np.asarray(im, dtype=np.float32)
    if im.shape[:2] == new_dims:
        return im.copy()
    return _image.resize(im, new_dims, interp_order)


def oversample(images, crop_dims):
    """The 4 corner and the centre crops of each image and their mirrors: 10 crops per image."""
    im_shape = np.array(images[0].shape)
    crop_dims = np.array(crop_dims)
    im_center = im_shape[:2] / 2.0
    h_indices = (0, im_shape[0] - crop_dims[0])
    w_indices = (0, im_shape[1] - crop_dims[1])
    crops_ix = np.empty((5, 4), dtype=int)
    curr = 0
    for i in h_indices:
        for j in w_indices:
            crops_ix[curr] = (i, j, i + crop_dims[0], j + crop_dims[1])
            curr += 1
    crops_ix[4] = np.tile(im_center, (1, 2)) + np.concatenate([-crop_dims / 2.0, crop_dims / 2.0])
    crops_ix = np.tile(crops_ix, (2, 1))
    crops = np.empty((10 * len(images), crop_dims[0], crop_dims[1], im_shape[-1]), dtype=np.float32)
    ix = 0
    for im in images:
        for crop in crops_ix:
            crops[ix] = im[crop[0]:crop[2], crop[1]:crop[3], :]
            ix += 1
        crops[ix - 5:ix] = crops[ix - 5:ix, :, ::-1, :]     # the mirrors
    return crops


# -- Transformer --------------------------------------------------------------------

class Transformer:
    """Turns H x W x K images into a net's (K, H, W) input and back, per input blob."""

    def __init__(self, inputs):
        self.inputs = {k: tuple(v) for k, v in inputs.items()}
        self.transpose, self.channel_swap, self.raw_scale = {}, {}, {}
        self.mean, self.input_scale = {}, {}

    def _check_input(self, in_):
        if in_ not in self.inputs:
            raise Exception(f"{in_} is not one of the net inputs: {self.inputs}")

    def preprocess(self, in_, data):
        """Resize to the input's H x W, transpose, swap channels, scale raw, subtract the mean,
        scale: the layout Caffe's net takes."""
        self._check_input(in_)
        caffe_in = data.astype(np.float32, copy=False)
        transpose = self.transpose.get(in_)
        channel_swap = self.channel_swap.get(in_)
        raw_scale = self.raw_scale.get(in_)
        mean = self.mean.get(in_)
        input_scale = self.input_scale.get(in_)
        in_dims = self.inputs[in_][2:]
        if caffe_in.shape[:2] != in_dims:
            caffe_in = resize_image(caffe_in, in_dims)
        if transpose is not None:
            caffe_in = caffe_in.transpose(transpose)
        if channel_swap is not None:
            caffe_in = caffe_in[list(channel_swap), :, :]
        if raw_scale is not None:
            caffe_in = caffe_in * raw_scale
        if mean is not None:
            caffe_in = caffe_in - mean
        if input_scale is not None:
            caffe_in = caffe_in * input_scale
        return caffe_in

    def deprocess(self, in_, data):
        """Undo preprocess (but not the resize)."""
        self._check_input(in_)
        decaf_in = data.copy().squeeze()
        transpose = self.transpose.get(in_)
        channel_swap = self.channel_swap.get(in_)
        raw_scale = self.raw_scale.get(in_)
        mean = self.mean.get(in_)
        input_scale = self.input_scale.get(in_)
        if input_scale is not None:
            decaf_in /= input_scale
        if mean is not None:
            decaf_in += mean
        if raw_scale is not None:
            decaf_in /= raw_scale
        if channel_swap is not None:
            decaf_in = decaf_in[np.argsort(channel_swap), :, :]
        if transpose is not None:
            decaf_in = decaf_in.transpose(np.argsort(transpose))
        return decaf_in

    def set_transpose(self, in_, order):
        self._check_input(in_)
        if len(order) != len(self.inputs[in_]) - 1:
            raise Exception("Transpose order needs to have the same number of dimensions as the input.")
        self.transpose[in_] = order

    def set_channel_swap(self, in_, order):
        self._check_input(in_)
        if len(order) != self.inputs[in_][1]:
            raise Exception("Channel swap needs to have the same number of dimensions as the input channels.")
        self.channel_swap[in_] = order

    def set_raw_scale(self, in_, scale):
        self._check_input(in_)
        self.raw_scale[in_] = scale

    def set_mean(self, in_, mean):
        """A per-channel mean (K,) or an elementwise one (K, H, W) / (H, W)."""
        self._check_input(in_)
        ms = mean.shape
        if mean.ndim == 1:
            if ms[0] != self.inputs[in_][1]:
                raise ValueError("Mean channels incompatible with input.")
            mean = mean[:, np.newaxis, np.newaxis]
        else:
            if len(ms) == 2:
                ms = (1,) + ms
            if len(ms) != 3:
                raise ValueError("Mean shape invalid")
            if ms != self.inputs[in_][1:]:
                raise ValueError("Mean shape incompatible with input shape.")
        self.mean[in_] = mean

    def set_input_scale(self, in_, scale):
        self._check_input(in_)
        self.input_scale[in_] = scale
