"""Caffe's upgrade tools under Caffe's names: old nets and solvers written in the current format.

    upgrade_net_proto_text    V0_OR_V1_NET.prototxt   OUT.prototxt
    upgrade_net_proto_binary  V0_OR_V1_NET.caffemodel OUT.caffemodel
    upgrade_solver_proto_text OLD_SOLVER.prototxt     OUT.prototxt

The upgrade itself is sncaffe.upgrade's (the code behind ``sncaffe upgrade``).
"""
from __future__ import annotations

import sys


def _run(tool, argv, convert) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) != 2:
        print(f"usage: {tool} INPUT OUTPUT\n{tool}: {convert.__doc__}", file=sys.stderr)
        return 2
    try:
        convert(*argv)
    except (ValueError, OSError) as e:      # PrototxtError (a bad or unreadable file) is a ValueError
        print(f"{tool}: error: {e}", file=sys.stderr)
        return 1
    print(f"Wrote upgraded {convert.what} to {argv[1]}")
    return 0


def _net(binary):
    def convert(src, out):
        from .. import blobproto
        from ..prototxt import read_text, upgrade_inputs
        from ..proto import sncaffe_pb2 as pb
        from ..prototxt import write_upgraded
        from ..upgrade import upgrade_net
        param = blobproto.read_caffemodel(src) if binary else upgrade_net(read_text(src, pb.NetParameter()), str(src))
        write_upgraded(upgrade_inputs(param), out, binary)
    convert.__doc__ = f"a V0/V1 net {'binary proto (.caffemodel)' if binary else 'prototxt'} in the current format"
    convert.what = f"NetParameter {'binary proto' if binary else 'text'}"
    return convert


def _solver(src, out):
    """a solver prototxt with the old solver_type enum written with type"""
    from google.protobuf import text_format

    from .. import blobproto
    from ..prototxt import read_solver
    blobproto.write_atomic(out, text_format.MessageToString(read_solver(src)).encode())


_solver.what = "SolverParameter text"


def net_text(argv=None) -> int:
    return _run("upgrade_net_proto_text", argv, _net(binary=False))


def net_binary(argv=None) -> int:
    return _run("upgrade_net_proto_binary", argv, _net(binary=True))


def solver_text(argv=None) -> int:
    return _run("upgrade_solver_proto_text", argv, _solver)
