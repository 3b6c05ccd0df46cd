"""The mean image of an LMDB (or LevelDB) of Datum records, as Caffe's compute_image_mean.

    python tools/compute_image_mean.py IN_DB [OUT_MEAN.binaryproto] [--backend leveldb]

Writes a BlobProto of shape 1 x C x H x W (legacy num/channels/height/width
fields, as Caffe writes it), for transform_param { mean_file: ... }, and
prints the mean of each channel (for mean_value). Sums in float32, datum
after datum, as Caffe does, so the file matches Caffe's bit for bit.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from sncaffe.data import datum  # noqa: E402
from sncaffe.data.leveldb import reader  # noqa: E402
from sncaffe.proto import sncaffe_pb2 as pb  # noqa: E402


def compute_mean(path, backend="lmdb") -> np.ndarray:
    db = reader(path, pb.DataParameter.LEVELDB if backend == "leveldb" else pb.DataParameter.LMDB)
    total, entries = None, db.entries
    for _ in range(entries):
        key, value = next(db)
        what = f"{'LevelDB' if backend == 'leveldb' else 'LMDB'} {path} key {key.decode(errors='replace')}"
        x = datum.to_array(datum.parse(value, what), None, what)     # encoded: decoded natively
        if total is None:
            total = np.zeros(x.shape, np.float32)
        elif x.shape != total.shape:
            raise SystemExit(f"{what}: shape {x.shape}, the first datum {total.shape}")
        total += x                              # float32, datum after datum, as Caffe
    db.close()
    return total / np.float32(entries)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("db", help="input database")
    ap.add_argument("out", nargs="?", help="output mean file (.binaryproto)")
    ap.add_argument("--backend", default="lmdb", choices=["lmdb", "leveldb"],
                    help="database to read (default: %(default)s; leveldb needs plyvel)")
    args = ap.parse_args(argv)
    try:
        mean = compute_mean(args.db, args.backend)
    except (OSError, ValueError, ImportError) as e:
        raise SystemExit(str(e))
    c, h, w = mean.shape
    if args.out:
        blob = pb.BlobProto(num=1, channels=c, height=h, width=w)
        blob.data.extend(mean.ravel().tolist())
        Path(args.out).write_bytes(blob.SerializeToString())
        print(f"Write to {args.out}")
    print(f"Number of channels: {c}")
    for i, m in enumerate(mean.reshape(c, -1).sum(axis=1, dtype=np.float32) / (h * w)):
        print(f"mean_value channel [{i}]: {m:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
