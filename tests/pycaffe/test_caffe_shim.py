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
