"""Mutated input files besides prototxt (.caffemodel, .solverstate, .caffemodel.h5, LMDB, Datum
records, images) end in a result or an error sncaffe raises naming the file, never another
exception. tools/fuzz_inputs.py runs the same cases by the thousand, in worker processes that
also count hangs and crashes."""
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import ROOT

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (the test extra)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))
import fuzz_inputs  # noqa: E402

FUZZ = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def reader():
    with tempfile.TemporaryDirectory() as seeds, tempfile.TemporaryDirectory() as work:
        fuzz_inputs.make_seeds(Path(seeds))
        yield fuzz_inputs.Reader(Path(seeds), Path(work))


@pytest.mark.parametrize("kind", fuzz_inputs.KINDS)
def test_a_mutated_input_is_read_or_refused_naming_it(reader, kind, monkeypatch):
    monkeypatch.setenv("SNCAFFE_IMAGES", "")            # the image cases choose their decoder

    @FUZZ
    @given(rng=st.randoms(use_true_random=False))
    def case(rng):
        try:
            reader.read(kind, rng)
        except Exception as e:  # noqa: BLE001 - the point: classify every exception
            outcome, detail = fuzz_inputs.classify(e, reader.named)
            assert outcome == "clean", f"{kind}: {detail}"
    case()


@pytest.mark.parametrize("kind, seed", [("h5", 26), ("h5", 38), ("image", 251), ("image", 13329), ("lmdb", 39),
                                        ("lmdb", 177)])
def test_cases_the_fuzzer_found(reader, kind, seed, monkeypatch):
    """HDF5's RuntimeError on a damaged file, Pillow's ValueError and OpenCV's cv2.error on a damaged
    image, liblmdb's abort (a failed assertion) and SIGBUS on a damaged or truncated data.mdb."""
    monkeypatch.setenv("SNCAFFE_IMAGES", "")
    try:
        reader.case(kind, seed)
    except Exception as e:  # noqa: BLE001
        outcome, detail = fuzz_inputs.classify(e, reader.named)
        assert outcome == "clean", f"{kind}: {detail}"
