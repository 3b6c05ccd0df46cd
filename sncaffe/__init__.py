"""sncaffe: Caffe networks in Python with a tensor-granular memory runtime."""
__version__ = "0.1.0"

# Loaded on first use, so that importing a light module (sncaffe.config, the command line's
# entry) does not load NumPy and the BLAS before the process environment is set.
_EXPORTS = {"Net": "net", "load_net": "prototxt", "read_solver": "prototxt", "Solver": "solvers"}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'sncaffe' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))
