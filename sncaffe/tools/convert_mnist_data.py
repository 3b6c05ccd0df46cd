"""Convert MNIST idx files to an LMDB of raw Datum records, as Caffe's convert_mnist_data.

    python tools/convert_mnist_data.py IMAGES LABELS OUT_LMDB [--start N] [--count M]

IMAGES and LABELS are idx files (gzip-compressed ones are read as they are).
Each image becomes a 1 x rows x cols uint8 Datum with its label, under the
key "%08d" of its index in the file, so key order is file order. --start and
--count take a slice, e.g. the first 8,000 images for training and the last
2,000 held out:

    python tools/convert_mnist_data.py data/mnist/t10k-images-idx3-ubyte.gz \\
        data/mnist/t10k-labels-idx1-ubyte.gz data/mnist/mnist_train_lmdb --count 8000
    python tools/convert_mnist_data.py data/mnist/t10k-images-idx3-ubyte.gz \\
        data/mnist/t10k-labels-idx1-ubyte.gz data/mnist/mnist_test_lmdb --start 8000
"""
from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

import numpy as np

from sncaffe.data import datum  # noqa: E402
from sncaffe.data.db import LMDBWriter  # noqa: E402

IMAGE_MAGIC, LABEL_MAGIC = 2051, 2049


def read_idx(path, magic) -> np.ndarray:
    """An idx file's items: (n, rows, cols) for images, (n,) for labels."""
    opener = gzip.open if Path(path).read_bytes()[:2] == b"\x1f\x8b" else open
    with opener(path, "rb") as f:
        raw = f.read()
    header = np.frombuffer(raw[:4], ">u4")[0]
    if header != magic:
        raise SystemExit(f"{path}: magic number {header}, expected {magic} "
                         f"({'images' if magic == IMAGE_MAGIC else 'labels'} idx file)")
    ndim = 3 if magic == IMAGE_MAGIC else 1
    dims = [int(d) for d in np.frombuffer(raw[4:4 + 4 * ndim], ">u4")]
    body = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise SystemExit(f"{path}: {body.size} bytes of items, the header says {dims}")
    return body.reshape(dims)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("images")
    ap.add_argument("labels")
    ap.add_argument("out", help="the LMDB to create (must not exist)")
    ap.add_argument("--backend", default="lmdb", choices=["lmdb"], help="only lmdb is supported")
    ap.add_argument("--start", type=int, default=0, help="first item to convert")
    ap.add_argument("--count", type=int, help="how many items (default: all from --start)")
    args = ap.parse_args(argv)
    images, labels = read_idx(args.images, IMAGE_MAGIC), read_idx(args.labels, LABEL_MAGIC)
    if len(images) != len(labels):
        raise SystemExit(f"{len(images)} images but {len(labels)} labels")
    end = len(images) if args.count is None else args.start + args.count
    if not 0 <= args.start < end <= len(images):
        raise SystemExit(f"--start {args.start} --count {args.count}: outside the {len(images)} items")
    try:
        with LMDBWriter(args.out) as db:
            for i in range(args.start, end):
                db.put(f"{i:08d}", datum.from_array(images[i][None], labels[i]).SerializeToString())
    except FileExistsError as e:
        raise SystemExit(str(e))
    rows, cols = images.shape[1:]
    print(f"Processed {end - args.start} files ({rows}x{cols}) into {args.out}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
