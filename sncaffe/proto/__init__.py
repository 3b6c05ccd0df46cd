"""The schema module (sncaffe_pb2, generated from proto/sncaffe.proto by tools/gen_proto.py).

It needs protobuf's builder API (4.21 and later: the runtimes of GPU images too, which may be
older than the protoc that generated it); an older runtime is refused here with what to do.
"""
import google.protobuf

MIN_PROTOBUF = (4, 21)


def _version(text):
    return tuple(int(p) for p in text.split(".")[:2] if p.isdigit())


if _version(google.protobuf.__version__) < MIN_PROTOBUF:
    raise ImportError(f"sncaffe needs protobuf >= {'.'.join(map(str, MIN_PROTOBUF))}, this Python has "
                      f"{google.protobuf.__version__}: pip install -U protobuf")
