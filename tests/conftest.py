import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The runtime tests reuse the mode tests' nets and checks (tests/plan/test_modes.py).
sys.path.insert(0, str(ROOT / "tests" / "plan"))


def shared_dir():
    """The project's shared/ folder (real Caffe files), or None where it is absent."""
    env = os.environ.get("SNCAFFE_SHARED")
    for cand in ([Path(env)] if env else []) + [ROOT.parent / "shared", ROOT / "tests" / "data" / "shared"]:
        if (cand / "golden").is_dir():
            return cand
    return None


SHARED = shared_dir()
needs_shared = pytest.mark.skipif(SHARED is None, reason="../shared (golden Caffe data) is not present")
