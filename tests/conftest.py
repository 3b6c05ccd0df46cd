import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The runtime tests reuse the mode tests' nets and checks (tests/plan/test_modes.py).
sys.path.insert(0, str(ROOT / "tests" / "plan"))


def shared_dir():
    """Real Caffe files the tests compare against: tests/data/shared (golden outputs of BVLC Caffe,
    the zoo's prototxt), or another copy named by SNCAFFE_SHARED; None where neither holds golden/."""
    env = os.environ.get("SNCAFFE_SHARED")
    cand = Path(env) if env else ROOT / "tests" / "data" / "shared"
    return cand if (cand / "golden").is_dir() else None


SHARED = shared_dir()
needs_shared = pytest.mark.skipif(SHARED is None, reason="tests/data/shared (golden Caffe data) is not present")
