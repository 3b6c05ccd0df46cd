"""``import caffe`` for pycaffe scripts, over sncaffe.pycaffe: ``caffe.io``, ``caffe.proto.caffe_pb2``,
``caffe.net_spec``, ``caffe.classifier`` and ``from caffe import layers as L, params as P`` work as in
pycaffe. Install with ``pip install ./compat/caffe-shim`` (never beside BVLC Caffe's own package)."""
import sys

from sncaffe.pycaffe import *  # noqa: F401,F403
from sncaffe.pycaffe import Layer, NetSpec, layers, params, to_proto  # noqa: F401
from sncaffe.pycaffe import __version__, _caffe, classifier, io, net, net_spec, proto, solver  # noqa: F401

for _name, _module in (("io", io), ("net_spec", net_spec), ("classifier", classifier), ("proto", proto),
                       ("proto.caffe_pb2", proto.caffe_pb2), ("_caffe", _caffe), ("pycaffe", net)):
    sys.modules[f"{__name__}.{_name}"] = _module
