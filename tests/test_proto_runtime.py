"""The schema module imports on older protobuf runtimes (a GPU image's may be 4.x to 6.x): protoc's
own runtime check is left out by tools/gen_proto.py, and sncaffe/proto/__init__.py refuses only
runtimes without the builder API, with a message saying what to do."""
import subprocess
import sys

from conftest import ROOT


def test_generated_module_does_not_demand_its_protoc_version():
    text = (ROOT / "sncaffe" / "proto" / "sncaffe_pb2.py").read_text()
    assert "ValidateProtobufRuntimeVersion(" not in text and "_builder.BuildMessageAndEnumDescriptors" in text


def test_a_runtime_without_the_builder_api_gets_a_clear_message():
    code = ("import google.protobuf as g; g.__version__ = '3.19.6'\n"
            "try:\n    import sncaffe.proto.sncaffe_pb2\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert "needs protobuf >= 4.21" in out.stdout and "3.19.6" in out.stdout, out.stderr
