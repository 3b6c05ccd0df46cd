"""The CPU GEMM (backend/blas.py) on each BLAS it can load: MKL (the ``mkl`` extra), NumPy's
OpenBLAS, and NumPy's matmul; a convolution's gradients through each."""
import os
import subprocess
import sys

import numpy as np
import pytest

from sncaffe.backend import blas
from sncaffe.gradcheck import check_gradient

from test_conv import LAYOUT_IDS, LAYOUTS, _layer


def _blas(name):
    """The BLAS ``name``, its GEMM calls counted (``calls``)."""
    if name == "mkl" and blas._mkl_path() is None:
        pytest.skip("MKL is not installed (pip install 'sncaffe[mkl]')")
    loaded = blas.load(name)
    assert loaded.name == name
    loaded.calls = []

    def counted(fn):
        def call(*args):
            loaded.calls.append(args)
            return fn(*args)
        return call
    loaded.gemm = {dtype: counted(fn) for dtype, fn in loaded.gemm.items()}
    return loaded


@pytest.mark.parametrize("name", blas.CHOICES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("trans_a,trans_b,beta", [(False, False, 0.0), (True, False, 1.0), (False, True, 1.0),
                                                  (True, True, 0.0), (False, False, 0.5)])
def test_gemm_views(name, dtype, trans_a, trans_b, beta):
    """Strided views, transposed operands and outputs, beta: as ``a @ b + beta * c``."""
    lib = _blas(name)
    rng = np.random.default_rng(6)
    a = rng.standard_normal((7, 5) if not trans_a else (5, 7)).astype(dtype)
    b = (rng.standard_normal((13, 5))[2:11] if trans_b else rng.standard_normal((5, 13))[:, 2:11]).astype(dtype)
    a, b = (a.T if trans_a else a), (b.T if trans_b else b)
    c = rng.standard_normal((7, 12)).astype(dtype)[:, 2:11]
    want = a.astype(np.float64) @ b + beta * c
    blas.gemm(a, b, c, beta, blas=lib)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(c, want, rtol=tol, atol=tol)
    ct = np.full((9, 7), np.nan, dtype)
    blas.gemm(a, b, ct.T, blas=lib)                # a transposed output, beta 0 ignores its NaNs
    np.testing.assert_allclose(ct.T, a.astype(np.float64) @ b, rtol=tol, atol=tol)
    assert len(lib.calls) == (0 if name == "numpy" else 2)      # BLAS took every view


@pytest.mark.parametrize("name", blas.CHOICES)
def test_gemm_layouts_blas_cannot_take(name):
    """Views with no unit stride fall back to matmul (same result)."""
    lib = _blas(name)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((6, 8)).astype(np.float32)[:, ::2]
    b = rng.standard_normal((4, 10)).astype(np.float32)[:, ::2]
    c = np.ones((6, 5), np.float32)
    blas.gemm(a, b, c, 1.0, blas=lib)
    np.testing.assert_allclose(c, a @ b + 1, rtol=1e-5, atol=1e-5)
    assert not lib.calls


@pytest.mark.parametrize("name", blas.CHOICES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_conv_gradients_on_each_blas(monkeypatch, name, layout):
    """A strided, grouped, padded convolution's gradients, with its GEMMs on this BLAS (ConvPlan's
    layouts)."""
    lib = _blas(name)
    monkeypatch.setattr(blas, "BLAS", lib)
    check_gradient(_layer("Convolution", 4, dict(kernel_size=3, stride=2, pad=1, group=2), layout),
                   [np.random.default_rng(7).standard_normal((2, 4, 6, 5))], max_probes=30)
    assert bool(lib.calls) == (name != "numpy")


def _loaded_in_child(**env):
    """What a fresh process loads under ``env`` (unset: no choice, no MKL thread count)."""
    code = "from sncaffe.backend import blas; print(blas.BLAS.describe())"
    base = {k: v for k, v in os.environ.items() if k not in ("MKL_NUM_THREADS", "SNCAFFE_BLAS")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**base, **env})
    return run.returncode, (run.stdout + run.stderr).strip()


def test_choice_and_threads_from_the_environment():
    assert _loaded_in_child(SNCAFFE_BLAS="openblas", OPENBLAS_NUM_THREADS="1") == (0, "openblas, 1 thread")
    assert _loaded_in_child(SNCAFFE_BLAS="numpy") == (0, "numpy")
    rc, out = _loaded_in_child(SNCAFFE_BLAS="cublas")
    assert rc != 0 and "SNCAFFE_BLAS='cublas'" in out and "mkl, openblas, numpy" in out
    if blas._mkl_path() is not None:
        # MKL follows OpenBLAS's thread count unless told otherwise
        assert _loaded_in_child(OPENBLAS_NUM_THREADS="1") == (0, "mkl, 1 thread")
        assert _loaded_in_child(OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="2") == (0, "mkl, 2 threads")
    else:
        rc, out = _loaded_in_child(SNCAFFE_BLAS="mkl")
        assert rc != 0 and "sncaffe[mkl]" in out
