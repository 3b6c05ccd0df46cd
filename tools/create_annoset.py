"""SSD's create_annoset: the code is sncaffe/tools/create_annoset.py, installed as the `create_annoset`
command; this path keeps working from a checkout (`python tools/create_annoset.py ...`)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sncaffe.tools.create_annoset import *  # noqa: E402,F401,F403
from sncaffe.tools.create_annoset import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
