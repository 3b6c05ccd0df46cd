"""Convert MNIST idx files to an LMDB (or LevelDB) of raw Datum records, as Caffe's convert_mnist_data.

    python tools/convert_mnist_data.py IMAGES LABELS OUT_DB [--start N] [--count M] [--backend leveldb]
        [--pairs [--seed S]]

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
from sncaffe.data.leveldb import writer  # noqa: E402

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
    ap.add_argument("out", help="the database to create (must not exist)")
    ap.add_argument("--backend", default="lmdb", choices=["lmdb", "leveldb"],
                    help="database to write (default: %(default)s; leveldb needs plyvel)")
    ap.add_argument("--start", type=int, default=0, help="first item to convert")
    ap.add_argument("--count", type=int, help="how many items (default: all from --start)")
    ap.add_argument("--pairs", action="store_true",
                    help="Siamese pairs, as Caffe's examples/siamese/convert_mnist_siamese_data: record k "
                         "holds two random images of the slice as 2 channels, label 1 if same digit, else 0")
    ap.add_argument("--seed", type=int, default=0, help="seed of the --pairs draws")
    args = ap.parse_args(argv)
    images, labels = read_idx(args.images, IMAGE_MAGIC), read_idx(args.labels, LABEL_MAGIC)
    if len(images) != len(labels):
        raise SystemExit(f"{len(images)} images but {len(labels)} labels")
    end = len(images) if args.count is None else args.start + args.count
    if not 0 <= args.start < end <= len(images):
        raise SystemExit(f"--start {args.start} --count {args.count}: outside the {len(images)} items")
    try:
        with writer(args.out, args.backend) as db:
            rng = np.random.default_rng(args.seed)
            for i in range(args.start, end):
                if args.pairs:      # keys 0..n-1, as Caffe's siamese converter
                    a, b = rng.integers(args.start, end, 2)
                    d = datum.from_array(np.stack([images[a], images[b]]), int(labels[a] == labels[b]))
                    db.put(f"{i - args.start:08d}", d.SerializeToString())
                else:
                    db.put(f"{i:08d}", datum.from_array(images[i][None], labels[i]).SerializeToString())
    except (FileExistsError, ImportError) as e:
        raise SystemExit(str(e))
    rows, cols = images.shape[1:]
    print(f"Processed {end - args.start} files ({rows}x{cols}) into {args.out}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
