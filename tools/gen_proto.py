"""Regenerate sncaffe/proto/sncaffe_pb2.py from proto/sncaffe.proto.

    python tools/gen_proto.py           # rewrite the committed module
    python tools/gen_proto.py --check   # exit 1 if the committed module is stale

Uses the protoc bundled with grpcio-tools (python -m grpc_tools.protoc), so the
output depends only on the .proto and the grpcio-tools version.
"""
import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO = ROOT / "proto" / "sncaffe.proto"
TARGET = ROOT / "sncaffe" / "proto" / "sncaffe_pb2.py"


def generate(out_dir):
    """Run protoc into out_dir and return the generated module's text."""
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc",
         f"--proto_path={PROTO.parent}", f"--python_out={out_dir}", PROTO.name],
        check=True)
    return (Path(out_dir) / "sncaffe_pb2.py").read_text()


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
