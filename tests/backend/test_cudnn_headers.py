"""The ctypes bindings of backend/cudnn.py against the cuDNN headers of the installed
nvidia-cudnn wheel: every bound function's argument count, order and types and its return
type, the AlgoPerf struct, and the enum values sncaffe hard-codes. No GPU needed; skipped,
with the reason, where no wheel with headers is installed (pip install 'sncaffe[gpucheck]')."""
import ctypes
import glob
import os
import re
import sys

import pytest

from sncaffe.backend import cudnn


def _include_dir():
    for root in sys.path:
        found = glob.glob(os.path.join(root, "nvidia", "cudnn", "include", "cudnn_graph.h"))
        if found:
            return os.path.dirname(found[0])
    return None


INCLUDE = _include_dir()
pytestmark = pytest.mark.skipif(INCLUDE is None, reason="no nvidia-cudnn wheel with headers is installed "
                                                        "(pip install 'sncaffe[gpucheck]')")


def _headers() -> str:
    """The cuDNN 9 API headers (not the *_v9.h copies), comments removed."""
    text = "\n".join(open(p).read() for p in sorted(glob.glob(os.path.join(INCLUDE, "cudnn*.h")))
                     if not p.endswith("_v9.h"))
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


@pytest.fixture(scope="module")
def api():
    text = _headers()
    pointers = set(re.findall(r"typedef\s+struct\s+\w+\s*\*\s*(\w+)\s*(?:CUDNN_DEPRECATED\s*)?;", text)) | {"cudaStream_t"}
    enums = {}
    for body, name in re.findall(r"typedef\s+enum\s*\w*\s*\{(.*?)\}\s*(\w+)\s*(?:CUDNN_DEPRECATED\s*)?;", text, flags=re.S):
        value, members = -1, {}
        for entry in (e.strip() for e in body.split(",")):
            if not entry:
                continue
            key, _, expr = (s.strip() for s in entry.partition("="))
            key = key.split()[0]
            if expr:
                expr = expr.split()[0]
                value = int(expr, 0) if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", expr) else members.get(expr, value)
            else:
                value += 1
            members[key] = value
        enums[name] = members
    return text, pointers, enums


LETTERS = {"int": "i", "unsigned": "u", "unsigned int": "u", "double": "d", "float": "f", "size_t": "z",
           "unsigned long long": "q", "int64_t": "q"}


def _letter(param, pointers, enums):
    """The _PROTOTYPES letter a C parameter declaration needs."""
    if "*" in param or "[" in param:
        return "p"
    words = [w for w in re.findall(r"\w+", param) if w not in ("const", "CUDNN_DEPRECATED")]
    ctype = " ".join(words[:-1])
    if ctype in pointers:
        return "p"
    if ctype in enums:
        return "i"
    return LETTERS.get(ctype, f"?{ctype}")


@pytest.mark.parametrize("name", sorted(cudnn._PROTOTYPES))
def test_prototype_matches_the_header(api, name):
    text, pointers, enums = api
    found = re.search(r"(\w+)\s+CUDNNWINAPI\s+" + name + r"\s*\(([^)]*)\)", text)
    assert found, f"{name} is not declared in the headers of {INCLUDE}"
    ret, params = found.group(1), [p.strip() for p in found.group(2).split(",") if p.strip() not in ("", "void")]
    assert ret == "cudnnStatus_t", f"{name} returns {ret}, bound as an int status"
    want = "".join(_letter(p, pointers, enums) for p in params)
    assert cudnn._PROTOTYPES[name] == want, f"{name}({', '.join(params)})"


def test_algo_perf_struct(api):
    text, _, _ = api
    for kind in ("Fwd", "BwdData", "BwdFilter"):
        body = re.search(r"typedef\s+struct\s+cudnnConvolution" + kind + r"AlgoPerfStruct\s*\{(.*?)\}", text,
                         flags=re.S).group(1)
        fields = re.findall(r"(\w+)\s*(?:\[\s*(\d+)\s*\])?\s*;", body)
        assert [f for f, _ in fields] == [f for f, _ in cudnn.AlgoPerf._fields_], kind
        assert dict(fields)["reserved"] == "3"
    assert ctypes.sizeof(cudnn.AlgoPerf) == 48


def test_enum_values(api):
    _, _, enums = api
    data = enums["cudnnDataType_t"]
    for name, value in {"float32": "FLOAT", "float64": "DOUBLE", "float16": "HALF", "int8": "INT8",
                        "int32": "INT32", "uint8": "UINT8"}.items():
        assert cudnn._DATA_TYPES[name] == data["CUDNN_DATA_" + value], name
    math = enums["cudnnMathType_t"]
    assert cudnn.MATH_TYPES == {"default": math["CUDNN_DEFAULT_MATH"], "tensor_op": math["CUDNN_TENSOR_OP_MATH"],
                                "tensor_op_allow_conversion": math["CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION"],
                                "fma": math["CUDNN_FMA_MATH"]}
    for algos, enum, prefix in ((cudnn.FWD_ALGOS, "cudnnConvolutionFwdAlgo_t", "CUDNN_CONVOLUTION_FWD_ALGO_"),
                                (cudnn.BWD_DATA_ALGOS, "cudnnConvolutionBwdDataAlgo_t",
                                 "CUDNN_CONVOLUTION_BWD_DATA_ALGO_"),
                                (cudnn.BWD_FILTER_ALGOS, "cudnnConvolutionBwdFilterAlgo_t",
                                 "CUDNN_CONVOLUTION_BWD_FILTER_ALGO_")):
        names = [prefix[:-len("ALGO_")] + a if a.startswith("ALGO_") else prefix + a for a in algos]
        assert [enums[enum][n] for n in names] == list(range(len(algos))), enum


def test_a_wrong_prototype_is_caught(api):
    """The check can fail: one argument too few, or a size_t bound as an int."""
    text, pointers, enums = api
    params = re.search(r"CUDNNWINAPI\s+cudnnConvolutionForward\s*\(([^)]*)\)", text).group(1).split(",")
    want = "".join(_letter(p, pointers, enums) for p in params)
    assert want == cudnn._PROTOTYPES["cudnnConvolutionForward"]
    assert want[:-1] != cudnn._PROTOTYPES["cudnnConvolutionForward"] and "z" in want


@pytest.mark.skipif(not cudnn.available(), reason="libcudnn.so.9 cannot be loaded here")
def test_every_bound_function_is_exported():
    lib = cudnn.load()
    missing = [name for name in cudnn._PROTOTYPES if not hasattr(lib, name)]
    assert not missing, f"{cudnn.library_path()} does not export {missing}"
