"""Caffe's compute_image_mean: the code is sncaffe/tools/compute_image_mean.py, installed as the `compute_image_mean`
command; this path keeps working from a checkout (`python tools/compute_image_mean.py ...`)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sncaffe.tools.compute_image_mean import *  # noqa: E402,F401,F403
from sncaffe.tools.compute_image_mean import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
