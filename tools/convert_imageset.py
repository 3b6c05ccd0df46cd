"""Caffe's convert_imageset: the code is sncaffe/tools/convert_imageset.py, installed as the `convert_imageset`
command; this path keeps working from a checkout (`python tools/convert_imageset.py ...`)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sncaffe.tools.convert_imageset import *  # noqa: E402,F401,F403
from sncaffe.tools.convert_imageset import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
