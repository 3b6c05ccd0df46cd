"""Caffe's extract_features: blobs of a trained net, image by image, into databases of Datum records.

    extract_features PRETRAINED.caffemodel NET.prototxt BLOB1[,BLOB2,...] DB1[,DB2,...] NUM_MINI_BATCHES lmdb|leveldb [CPU|GPU] [DEVICE_ID]

The net runs in the TEST phase (its data layers read the images); for each
mini-batch every named blob is written, one Datum per item (float_data,
channels/height/width as Caffe's legacy shape), under the key "%010d" of the
item's index, as Caffe's tool writes them.
"""
from __future__ import annotations

import sys

import numpy as np

USAGE = ("usage: extract_features pretrained_net_param feature_extraction_proto_file "
         "extract_feature_blob_name1[,name2,...] save_feature_dataset_name1[,name2,...] "
         "num_mini_batches db_type [CPU/GPU] [DEVICE_ID=0]")


def extract(weights, proto, blob_names, db_names, batches, db_type="lmdb", mode="CPU", device_id=0, log=print):
    import sncaffe.pycaffe as caffe
    from ..data.leveldb import writer
    if len(blob_names) != len(db_names):
        raise ValueError(f"{len(blob_names)} blob names but {len(db_names)} dataset names: give one dataset per blob")
    if db_type not in ("lmdb", "leveldb"):
        raise ValueError(f"db_type {db_type}: lmdb or leveldb, as Caffe's db::GetDB")
    if mode.upper() == "GPU":
        caffe.set_device(device_id)
        caffe.set_mode_gpu()
    else:
        caffe.set_mode_cpu()
    net = caffe.Net(proto, caffe.TEST, weights=weights, memory="none", keep=blob_names)
    missing = [b for b in blob_names if b not in net.blobs]
    if missing:
        raise ValueError(f'{proto}: unknown feature blob name "{missing[0]}" in the network')
    writers = []
    try:
        for d in db_names:
            writers.append(writer(d, db_type))
    except Exception:
        for w in writers:
            w.close()
        raise
    counts = [0] * len(blob_names)
    log("Extracting Features")
    try:
        for _ in range(batches):
            net.forward()
            for i, name in enumerate(blob_names):
                blob = net.blobs[name]
                data = np.asarray(blob.data, dtype=np.float32).reshape(blob.num, -1)
                for item in data:
                    datum = caffe.io.caffe_pb2.Datum(channels=blob.channels, height=blob.height, width=blob.width)
                    datum.float_data.extend(item.tolist())
                    writers[i].put(f"{counts[i]:010d}", datum.SerializeToString())
                    counts[i] += 1
        for i, name in enumerate(blob_names):
            log(f"Extracted features of {counts[i]} query images for feature blob {name}")
    finally:
        for w in writers:
            w.close()
        for layer in net._net.layers:
            if hasattr(layer, "close"):
                layer.close()
    log("Successfully extracted the features!")
    return counts


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) < 6 or len(argv) > 8:
        print(USAGE, file=sys.stderr)
        return 2
    weights, proto, blobs, dbs, n, db_type = argv[:6]
    mode = argv[6] if len(argv) > 6 else "CPU"
    try:
        extract(weights, proto, blobs.split(","), dbs.split(","), int(n), db_type, mode,
                int(argv[7]) if len(argv) > 7 else 0)
    except (ValueError, OSError, RuntimeError, ImportError) as e:
        print(f"extract_features: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
