"""Caffe's convert_mnist_data: the code is sncaffe/tools/convert_mnist_data.py, installed as the `convert_mnist_data`
command; this path keeps working from a checkout (`python tools/convert_mnist_data.py ...`)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sncaffe.tools.convert_mnist_data import *  # noqa: E402,F401,F403
from sncaffe.tools.convert_mnist_data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
