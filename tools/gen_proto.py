"""Regenerate sncaffe/proto/sncaffe_pb2.py from proto/sncaffe.proto.

    python tools/gen_proto.py           # rewrite the committed module
    python tools/gen_proto.py --check   # exit 1 if the committed module is stale

Uses the protoc bundled with grpcio-tools (python -m grpc_tools.protoc), so the
output depends only on the .proto and the grpcio-tools version. protoc's check for a
runtime at least as new as itself is replaced by sncaffe/proto/__init__.py's (protobuf
>= 4.21), so the module imports on the older runtimes of a GPU image.
"""
import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO = ROOT / "proto" / "sncaffe.proto"
TARGET = ROOT / "sncaffe" / "proto" / "sncaffe_pb2.py"


# protoc's runtime check refuses any protobuf runtime older than the protoc that generated the
# module (import fails on a GPU image with protobuf 4, 5 or 6). The module itself needs only the
# builder API (protobuf >= 3.20), so the check becomes sncaffe/proto/__init__.py's own, which
# names what to install.
RUNTIME_CHECK = re.compile(r"from google\.protobuf import runtime_version as _runtime_version\n(.*?)"
                           r"_runtime_version\.ValidateProtobufRuntimeVersion\(.*?\)\n", re.S)
RELAXED = ("\\1# protoc's runtime version check is left out: sncaffe/proto/__init__.py checks for protobuf >= 4.21,\n"
           "# all this module needs (tools/gen_proto.py)\n")


def generate(out_dir):
    """Run protoc into out_dir and return the generated module's text (runtime check relaxed)."""
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc",
         f"--proto_path={PROTO.parent}", f"--python_out={out_dir}", PROTO.name],
        check=True)
    text = (Path(out_dir) / "sncaffe_pb2.py").read_text()
    relaxed, n = RUNTIME_CHECK.subn(RELAXED, text)
    if n != 1 and "ValidateProtobufRuntimeVersion" in text:
        raise SystemExit("tools/gen_proto.py: protoc's runtime check has a new shape; update RUNTIME_CHECK")
    return relaxed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="compare a fresh generation with the committed file")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(tmp)
    if args.check:
        if not TARGET.exists() or TARGET.read_text() != fresh:
            print(f"{TARGET.relative_to(ROOT)} is stale: run python tools/gen_proto.py",
                  file=sys.stderr)
            return 1
        print(f"{TARGET.relative_to(ROOT)} is up to date")
        return 0
    TARGET.write_text(fresh)
    print(f"wrote {TARGET.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
