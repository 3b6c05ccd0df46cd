"""Reading datasets as Caffe's data layers do.

- ``db``: LMDB databases (read in key order with wrap-around; written in batches)
- ``datum``: Caffe's Datum record <-> (C, H, W) arrays
- ``image``: image files and encoded bytes via Pillow, in OpenCV's BGR layout
- ``transform``: the DataTransformer (crop, mirror, mean, scale)
- ``prefetch``: batches made ahead on a background thread
"""
