"""Caffe's ``caffe_pb2``: this module is sncaffe's generated schema (Caffe's names and numbers)."""
import sys

from ...proto import sncaffe_pb2

sys.modules[__name__] = sncaffe_pb2
