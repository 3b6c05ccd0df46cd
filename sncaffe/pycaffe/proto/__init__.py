"""``from caffe.proto import caffe_pb2``: sncaffe's schema carries Caffe's messages and numbers."""
from . import caffe_pb2  # noqa: F401
