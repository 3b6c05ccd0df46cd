"""The optional top-level ``caffe`` package (compat/caffe-shim): pycaffe's own import lines work."""
import subprocess
import sys
from pathlib import Path

SHIM = Path(__file__).resolve().parents[2] / "compat/caffe-shim"


def test_pycaffe_import_lines_resolve_to_sncaffe():
    code = """
import caffe
import caffe.io
from caffe import layers as L, params as P
from caffe.proto import caffe_pb2
import sncaffe.pycaffe
assert caffe.Net is sncaffe.pycaffe.Net and caffe.io is sncaffe.pycaffe.io
assert caffe_pb2.NetParameter is sncaffe.pycaffe.caffe_pb2.NetParameter
assert issubclass(caffe.SGDSolver, sncaffe.pycaffe.solver.Solver) and caffe.TEST == 1
n = caffe.NetSpec()
n.data = L.Input(shape=dict(dim=[1, 2]))
n.out = L.Pooling(n.data, pool=P.Pooling.MAX, kernel_size=1)
print(caffe_pb2.NetParameter.FromString(n.to_proto().SerializeToString()).layer[1].type)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(SHIM), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "Pooling"


LAYER = '''
import caffe
import numpy as np
from caffe._caffe import RawBlobVec


class Scaled(caffe.Layer):
    """As the published triplet-loss and Faster R-CNN layers write them."""

    def setup(self, bottom, top):
        assert type(bottom) is RawBlobVec and type(top) is RawBlobVec
        self.k = float(self.param_str_)     # the Faster R-CNN fork's name
        self.cfg_key = str(self.phase)      # "TRAIN" or "TEST" there

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        assert type(bottom) is RawBlobVec
        top[0].data[...] = self.k * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = self.k * top[0].diff
'''

NET = '''name: "n"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "scaled" type: "Python" bottom: "data" top: "scaled"
  python_param { module: "scaled_layer" layer: "Scaled" param_str: "2.5" } }
layer { name: "ip" type: "InnerProduct" bottom: "scaled" top: "ip" inner_product_param { num_output: 4 } }
'''


def test_what_published_python_layers_import_from_caffe__caffe(tmp_path):
    (tmp_path / "scaled_layer.py").write_text(LAYER)
    (tmp_path / "net.prototxt").write_text(NET)
    code = """
import numpy as np
import caffe
from caffe._caffe import RawBlobVec, BlobVec, Blob, Layer, LayerVec, Net, log, solver_count, solver_rank, Timer
net = caffe.Net("net.prototxt", caffe.TEST)
x = np.arange(6, dtype=np.float32).reshape(2, 3)
out = net.forward(end="scaled", data=x)
assert np.array_equal(out["scaled"], 2.5 * x)
assert net.layers[1].cfg_key == "TEST" and net.layers[1].phase == caffe.TEST == 1
assert type(net.params["ip"]) is BlobVec and type(net.layers) is LayerVec and Layer is caffe.Layer
assert isinstance(net.blobs["data"], Blob) and isinstance(net.params["ip"][0], Blob) and isinstance(net, Net)
assert caffe._caffe.SGDSolver is caffe.SGDSolver and caffe._caffe.get_solver is caffe.get_solver
assert (solver_count(), solver_rank(), caffe._caffe.has_nccl()) == (1, 0, False)
t = Timer(); t.start(); t.stop(); assert t.ms >= 0
log("logged")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": f"{SHIM}:{tmp_path}", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
