"""Intel oneDNN's CPU convolutions through its C API (ctypes), as the GPU path calls cuDNN.

oneDNN's direct kernels (JIT-compiled for the core's vector width, on channel-blocked layouts)
run the convolutions sncaffe's GEMM kernels (``layers/im2col.py``) run at 0.4-0.7x their
speed; PyTorch's CPU convolutions are these kernels. The library is a dependency on Linux x86_64
(``onednn-cpu-gomp``: the CPU-only build on GNU OpenMP, ``sys.prefix/lib/libdnnl.so.3``).

- ``SNCAFFE_CONV``: ``onednn`` (an error if the library is absent), ``native`` (ConvPlan),
  unset: oneDNN where it loads. float32 only: oneDNN has no float64 convolution on the CPU.
- Memory: every buffer oneDNN uses is sncaffe's. Primitives run with the user scratchpad
  mode; a ``Conv`` says how many bytes one pass needs (its scratchpad and, where the kernel
  wants a blocked layout, the reordered copies of its arguments) and takes them from a
  workspace array the memory runtime planned.
- Threads: oneDNN's OpenMP threads follow ``backend.threads`` (set on the calling thread
  before every primitive is created or run, so they never exceed the budget).
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
import sysconfig
import threading

import numpy as np

from .. import config
from . import threads as _threads

LIBRARY = "libdnnl.so.3"
INSTALL = "pip install onednn-cpu-gomp==2023.2.0 (a dependency of sncaffe on Linux x86_64)"
# dnnl_types.h / dnnl_common_types.h (oneDNN v3.2)
_CPU, _F32, _ANY, _A = 1, 3, 1, 2
_NCHW, _OIHW, _GOIHW, _NHWC = 5, 5, 6, 22
_NCHW8C = 102                # dnnl_nChw8c (dnnl_aBcd8b): channels in blocks of 8
_FWD_TRAINING, _DIRECT, _SCRATCHPAD_USER = 64, 1, 1
_Q_IMPL_INFO, _Q_EXEC_ARG_MD = 8, 255
SRC, DST, WEIGHTS, BIAS, WORKSPACE, SCRATCHPAD = 1, 17, 33, 41, 64, 80
DIFF_SRC, DIFF_DST, DIFF_WEIGHTS = 129, 145, 161
ALIGN = 64
_Dims = ctypes.c_int64 * 12


class _ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", ctypes.c_void_p)]


_lib = _gomp = _omp_max = _engine = _point = None
_tried = False
_local = threading.local()          # a stream per thread: oneDNN's CPU stream is not shared


def _candidates():
    dirs = [os.path.join(sys.prefix, "lib"), os.path.join(sys.base_prefix, "lib"),
            os.path.join(sysconfig.get_path("data"), "lib")]
    dirs += [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    found = [p for d in dict.fromkeys(dirs) for p in sorted(glob.glob(os.path.join(d, LIBRARY)))]
    return found + [LIBRARY]            # last: the loader's own search path


def _load():
    global _lib, _gomp, _omp_max, _engine, _tried, _point
    _tried = True
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        _declare(lib)
        engine = ctypes.c_void_p()
        _check(lib.dnnl_engine_create(ctypes.byref(engine), _CPU, 0), "engine_create")
        _lib, _engine = lib, engine
        # pointing a memory object at an array takes nanoseconds: called with the GIL held (the
        # same library, loaded as a PyDLL), where each ctypes call would let it go and queue for
        # it again behind the other locations' workers
        _point = ctypes.PyDLL(path).dnnl_memory_set_data_handle
        _point.argtypes, _point.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
        # the libgomp libdnnl links: its thread count is per calling thread
        _gomp = ctypes.CDLL("libgomp.so.1")
        _omp_max = ctypes.PyDLL("libgomp.so.1").omp_get_max_threads
        _omp_max.argtypes, _omp_max.restype = [], ctypes.c_int
        return lib
    return None


def preload():
    """Load oneDNN (and the libgomp it links) before the BLAS loads: MKL then takes its GNU
    OpenMP layer, and oneDNN's and MKL's threads are one team, never two spinning at once."""
    try:
        native = setting() == "native"
    except ValueError:          # a layer reports it, naming itself
        native = False
    if not _tried and not native:
        _load()


def setting(env=None) -> str:
    """``SNCAFFE_CONV`` (config.settings.conv, or ``env``'s), the one switch between the two CPU
    convolution engines: ``onednn`` (an error if the library is absent), ``native`` (ConvPlan),
    or "" (oneDNN where it loads)."""
    value = config.settings.conv if env is None else env.get("SNCAFFE_CONV", "").strip().lower()
    if value not in ("", "onednn", "native"):
        raise ValueError(f"SNCAFFE_CONV={value!r}: give 'onednn' or 'native'")
    return value


def choice(env=None) -> str:
    """``onednn`` or ``native``: ``SNCAFFE_CONV`` (``setting``), else oneDNN where it loads."""
    value = setting(env)
    if value == "native":
        return "native"
    if not _tried:
        _load()
    if _lib is None and value == "onednn":
        raise RuntimeError(f"SNCAFFE_CONV=onednn, but oneDNN's {LIBRARY} was not found "
                           f"(looked in {', '.join(_candidates()[:-1])} and the loader's path): {INSTALL}")
    return "onednn" if _lib is not None else "native"


def version() -> str | None:
    if not _tried:
        _load()
    if _lib is None:
        return None
    v = _lib.dnnl_version().contents
    return f"{v.major}.{v.minor}.{v.patch}"


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint), ("gpu_runtime", ctypes.c_uint)]


def _declare(lib):
    P, I, p = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER
    sigs = {
        "dnnl_engine_create": [p(P), I, ctypes.c_size_t],
        "dnnl_stream_create": [p(P), P, ctypes.c_uint],
        "dnnl_memory_desc_create_with_tag": [p(P), I, _Dims, I, I],
        "dnnl_memory_desc_destroy": [P],
        "dnnl_memory_desc_equal": [P, P],
        "dnnl_memory_desc_get_size": [P],
        "dnnl_memory_create": [p(P), P, P, P],
        "dnnl_memory_set_data_handle": [P, P],
        "dnnl_memory_destroy": [P],
        "dnnl_primitive_attr_create": [p(P)],
        "dnnl_primitive_attr_destroy": [P],
        "dnnl_primitive_attr_set_scratchpad_mode": [P, I],
        "dnnl_convolution_forward_primitive_desc_create":
            [p(P), P, I, I, P, P, P, P, _Dims, _Dims, _Dims, _Dims, P],
        "dnnl_convolution_backward_data_primitive_desc_create":
            [p(P), P, I, P, P, P, _Dims, _Dims, _Dims, _Dims, P, P],
        "dnnl_binary_primitive_desc_create": [p(P), P, I, P, P, P, P],
        "dnnl_post_ops_create": [p(P)],
        "dnnl_post_ops_destroy": [P],
        "dnnl_post_ops_append_binary": [P, I, P],
        "dnnl_post_ops_append_sum": [P, ctypes.c_float, ctypes.c_int32, I],
        "dnnl_primitive_attr_set_post_ops": [P, P],
        "dnnl_eltwise_forward_primitive_desc_create": [p(P), P, I, I, P, P, ctypes.c_float, ctypes.c_float, P],
        "dnnl_pooling_forward_primitive_desc_create": [p(P), P, I, I, P, P, _Dims, _Dims, _Dims, _Dims, _Dims, P],
        "dnnl_pooling_backward_primitive_desc_create": [p(P), P, I, P, P, _Dims, _Dims, _Dims, _Dims, _Dims, P, P],
        "dnnl_eltwise_backward_primitive_desc_create":
            [p(P), P, I, P, P, P, ctypes.c_float, ctypes.c_float, P, P],
        "dnnl_convolution_backward_weights_primitive_desc_create":
            [p(P), P, I, P, P, P, P, _Dims, _Dims, _Dims, _Dims, P, P],
        "dnnl_reorder_primitive_desc_create": [p(P), P, P, P, P, P],
        "dnnl_primitive_desc_query": [P, I, I, P],
        "dnnl_primitive_desc_query_md": [P, I, I],
        "dnnl_primitive_desc_destroy": [P],
        "dnnl_primitive_create": [p(P), P],
        "dnnl_primitive_execute": [P, P, I, P],
        "dnnl_primitive_destroy": [P],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int
    lib.dnnl_memory_desc_equal.restype = ctypes.c_int
    lib.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
    lib.dnnl_primitive_desc_query_md.restype = ctypes.c_void_p
    lib.dnnl_version.restype = ctypes.POINTER(_Version)


def _check(status, what):
    if status != 0:
        raise RuntimeError(f"oneDNN {what} failed (dnnl_status_t {status})")


def _dims(values):
    return _Dims(*values)


def _set_threads():
    """oneDNN's OpenMP team on this thread: sncaffe's budget. Read back each time, not
    remembered: another user of the same libgomp (numba's OpenMP pool, once it starts) sets this
    thread's count to its own, and oneDNN then ran a budget of one on two threads."""
    n = _threads.current().threads
    if _omp_max() != n:
        _gomp.omp_set_num_threads(n)
    return n


def _stream():
    s = getattr(_local, "stream", None)
    if s is None:
        s = ctypes.c_void_p()
        _check(_lib.dnnl_stream_create(ctypes.byref(s), _engine, 1), "stream_create")
        _local.stream = s
    return s


class _Desc:
    """A memory descriptor we own."""

    def __init__(self, dims, tag):
        self.ptr = ctypes.c_void_p()
        _check(_lib.dnnl_memory_desc_create_with_tag(ctypes.byref(self.ptr), len(dims), _dims(dims), _F32, tag),
               "memory_desc_create")

    def __del__(self):
        if _lib is not None and self.ptr:
            _lib.dnnl_memory_desc_destroy(self.ptr)


_create_lock = threading.RLock()     # primitives are created once, whichever thread asks first


class _Step:
    """One primitive and how its arguments reach it: per argument the user's descriptor, and,
    where the kernel wants another layout, a reorder into (or out of) a workspace slot."""

    def __init__(self, pd, user, outputs, accumulate=()):
        self.pd = pd
        self.prim = None
        self._local = threading.local()     # this thread's kept executes (``_calls``)
        self.impl = _impl(pd)
        self.args = {}              # arg -> (user md, kernel md, reorder pd, slot offset)
        self.sizes = {}             # arg -> bytes of the user's array
        offset = 0
        for arg, md in user.items():
            want = _lib.dnnl_primitive_desc_query_md(pd, _Q_EXEC_ARG_MD, arg)
            self.sizes[arg] = _lib.dnnl_memory_desc_get_size(md.ptr)
            if _lib.dnnl_memory_desc_equal(want, md.ptr):
                self.args[arg] = (md.ptr, want, None, None)
                continue
            src, dst = (want, md.ptr) if arg in outputs else (md.ptr, want)
            reorder = _reorder_pd(src, dst, accumulate=arg in accumulate)
            self.args[arg] = (md.ptr, want, reorder, offset)
            offset += _round(_lib.dnnl_memory_desc_get_size(want))
        self.scratch_offset = offset
        self.pad_md = _lib.dnnl_primitive_desc_query_md(pd, _Q_EXEC_ARG_MD, SCRATCHPAD)
        self.reorder_pad = {a: _lib.dnnl_primitive_desc_query_md(r, _Q_EXEC_ARG_MD, SCRATCHPAD)
                            for a, (_, _, r, _) in self.args.items() if r}
        sizes = [_lib.dnnl_memory_desc_get_size(m) for m in [self.pad_md, *self.reorder_pad.values()]]
        self.nbytes = offset + _round(max(sizes))
        self.outputs = outputs

    def adds(self, arg) -> bool:
        """Whether output ``arg`` is added into the user's array (its reorder out sums, made with
        ``accumulate``), not written over it: only where the kernel's layout is not the user's."""
        return self.args[arg][2] is not None and arg in self.outputs

    def slot(self, arg):
        """(kernel md, workspace offset) of ``arg``'s reordered copy, or None where it has none."""
        _, want, reorder, off = self.args[arg]
        return None if reorder is None else (want, off)

    def reorder_in(self, arg, a, ws):
        """Reorder the input ``a`` of ``arg`` into its workspace slot (for ``run(..., ready=)``)."""
        _, reorders = self._calls()
        base = ws.ctypes.data
        reorders[arg](_stream(), (self._checked(arg, a).ctypes.data, base + self.args[arg][3]),
                            base + self.scratch_offset)

    def _create(self):
        if self.prim is None:
            # two locations of one process (their own threads) may run the same geometry's
            # first step at once: one creates, and the primitive is published last
            with _create_lock:
                if self.prim is None:
                    self.reorders = {a: _primitive(r) for a, (_, _, r, _) in self.args.items() if r}
                    self.prim = _primitive(self.pd)

    def _calls(self):
        """This thread's kept executes (``_Call``): (the primitive's, {arg: its reorder's})."""
        calls = getattr(self._local, "calls", None)
        if calls is None:
            self._create()
            calls = self._local.calls = (
                _Call(self.prim, [(arg, want) for arg, (_, want, _, _) in self.args.items()], self.pad_md),
                {arg: _Call(self.reorders[arg], [(SRC, want if arg in self.outputs else user),
                                                 (DST, user if arg in self.outputs else want)],
                            self.reorder_pad[arg])
                 for arg, (user, want, reorder, _) in self.args.items() if reorder})
        return calls

    def _checked(self, arg, a):
        if a.dtype != (np.uint8 if arg == WORKSPACE else np.float32) or not a.flags.c_contiguous \
                or a.nbytes != self.sizes[arg]:
            # oneDNN reads raw memory: a strided view or a wrong shape would be read wrongly, silently
            kind = "uint8" if arg == WORKSPACE else "float32"
            raise ValueError(f"oneDNN argument {arg}: needs a C-contiguous {kind} array of "
                             f"{self.sizes[arg]} bytes, got {a.dtype} {a.shape} strides {a.strides}")
        return a

    def run(self, arrays, ws, ready=()):
        """Execute on ``arrays`` {arg: ndarray} with ``ws`` (a uint8 array of ``nbytes``). The
        inputs in ``ready`` are already in their slots (``reorder_in``): not reordered again."""
        main, reorders = self._calls()
        base = ws.ctypes.data if self.nbytes else None
        pad = base + self.scratch_offset if self.nbytes else None
        stream = _stream()
        ptrs = []
        for arg, (_, _, reorder, off) in self.args.items():
            if reorder is None:
                ptrs.append(self._checked(arg, arrays[arg]).ctypes.data)
                continue
            ptrs.append(base + off)
            if arg not in self.outputs and arg not in ready:
                reorders[arg](stream, (self._checked(arg, arrays[arg]).ctypes.data, base + off), pad)
        main(stream, ptrs, pad)
        for arg in self.outputs:
            _, _, reorder, off = self.args[arg]
            if reorder is not None:
                reorders[arg](stream, (base + off, self._checked(arg, arrays[arg]).ctypes.data), pad)


class _Call:
    """One primitive's execute with its memory objects made once, for one thread (a memory object
    is pointed at each call's arrays with ``dnnl_memory_set_data_handle``; making and destroying
    them on every call was most of a small call's Python time, which holds the GIL)."""

    def __init__(self, prim, mds, pad_md):
        self.prim = prim
        self.padded = bool(pad_md is not None and _lib.dnnl_memory_desc_get_size(pad_md))
        if self.padded:
            mds = list(mds) + [(SCRATCHPAD, pad_md)]
        self.mems = [_memory(md, 0) for _, md in mds]          # no buffer until a call gives one
        self.n = len(self.mems)
        self.args = (_ExecArg * self.n)(*[_ExecArg(a, m) for (a, _), m in zip(mds, self.mems)])

    def __call__(self, stream, ptrs, pad):
        point = _point
        failed = 0
        for m, p in zip(self.mems, ptrs):
            failed |= point(m, p)
        if self.padded:
            failed |= point(self.mems[-1], pad)
        _check(failed, "memory_set_data_handle")
        _check(_lib.dnnl_primitive_execute(self.prim, stream, self.n, self.args), "primitive_execute")


def _round(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _impl(pd):
    s = ctypes.c_char_p()
    _lib.dnnl_primitive_desc_query(pd, _Q_IMPL_INFO, 0, ctypes.byref(s))
    return s.value.decode()


def _attr():
    attr = ctypes.c_void_p()
    _check(_lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "attr_create")
    _check(_lib.dnnl_primitive_attr_set_scratchpad_mode(attr, _SCRATCHPAD_USER), "set_scratchpad_mode")
    return attr


def _reorder_pd(src, dst, accumulate=False):
    """A reorder from ``src`` to ``dst``; ``accumulate``: dst += the reordered src (a sum post-op,
    scale 1: each value is dst + src rounded once, as NumPy's ``dst += src``)."""
    pd, attr = ctypes.c_void_p(), _attr()
    try:
        if accumulate:
            po = ctypes.c_void_p()
            _check(_lib.dnnl_post_ops_create(ctypes.byref(po)), "post_ops_create")
            try:
                _check(_lib.dnnl_post_ops_append_sum(po, 1.0, 0, 0), "post_ops_append_sum")   # dnnl_data_type_undef
                _check(_lib.dnnl_primitive_attr_set_post_ops(attr, po), "set_post_ops")
            finally:
                _lib.dnnl_post_ops_destroy(po)
        _check(_lib.dnnl_reorder_primitive_desc_create(ctypes.byref(pd), src, _engine, dst, _engine, attr), "reorder")
    finally:
        _lib.dnnl_primitive_attr_destroy(attr)
    return pd


def _primitive(pd):
    prim = ctypes.c_void_p()
    _check(_lib.dnnl_primitive_create(ctypes.byref(prim), pd), "primitive_create")
    return prim


class _Memory(ctypes.c_void_p):
    def __del__(self):
        if _lib is not None and self:
            _lib.dnnl_memory_destroy(self)


def _memory(md, ptr):
    mem = _Memory()
    _check(_lib.dnnl_memory_create(ctypes.byref(mem), md, _engine, ctypes.c_void_p(ptr)), "memory_create")
    return mem


class Conv:
    """One 2-D convolution (Caffe's conv view: image x (n, C, H, W) -> grid y (n, M, Ho, Wo),
    weight (M, C/group, kh, kw)) at one batch size: its forward, backward-data and
    backward-weights primitives on NCHW arrays. oneDNN chooses the kernels' layouts of x, y and
    the weights (``format_tag::any``), or takes x and y in the ``layout`` "nchw" (as given) or
    "nhwc"; where the kernels' layouts are not the arrays', the arguments are reordered in and out
    through the workspace."""

    def __init__(self, n, channels, num_output, group, size, kernel, stride, pad, dilation, layout="any"):
        self.threads = _set_threads()
        out = [(s + 2 * p - d * (k - 1) - 1) // st + 1 for s, k, st, p, d in zip(size, kernel, stride, pad, dilation)]
        self.geometry = dict(strides=_dims(stride), dilates=_dims([d - 1 for d in dilation]), padding_l=_dims(pad),
                             padding_r=_dims([(o - 1) * st + d * (k - 1) + 1 - s - p for o, st, d, k, s, p in
                                              zip(out, stride, dilation, kernel, size, pad)]))
        cg = channels // group
        wdims = (num_output, cg) + tuple(kernel) if group == 1 else (group, num_output // group, cg) + tuple(kernel)
        self.user = {"x": _Desc((n, channels) + tuple(size), _NCHW),
                     "y": _Desc((n, num_output) + tuple(out), _NCHW),
                     "w": _Desc(wdims, _OIHW if group == 1 else _GOIHW),
                     "b": _Desc((num_output,), _A)}
        data = {"any": _ANY, "nchw": _NCHW, "nhwc": _NHWC}[layout]
        self._kern = {"x": _Desc((n, channels) + tuple(size), data), "y": _Desc((n, num_output) + tuple(out), data),
                      "w": _Desc(wdims, _ANY)}
        self.attr = _attr()
        self.fwd_pd = self._pd_forward(self._kern, with_bias=False)
        self.fwd_bias_pd = self._pd_forward(self._kern, with_bias=True)
        self._steps = {}
        self._pairs = {}

    def _pd_forward(self, kern, with_bias):
        pd = ctypes.c_void_p()
        g = self.geometry
        _check(_lib.dnnl_convolution_forward_primitive_desc_create(
            ctypes.byref(pd), _engine, _FWD_TRAINING, _DIRECT, kern["x"].ptr, kern["w"].ptr,
            self.user["b"].ptr if with_bias else None, kern["y"].ptr, g["strides"], g["dilates"],
            g["padding_l"], g["padding_r"], self.attr), "convolution forward")
        return pd

    _NAMES = {"forward": {SRC: "x", WEIGHTS: "w", DST: "y"},
              "forward_bias": {SRC: "x", WEIGHTS: "w", BIAS: "b", DST: "y"},
              "data": {DIFF_SRC: "x", WEIGHTS: "w", DIFF_DST: "y"},
              "weights": {SRC: "x", DIFF_WEIGHTS: "w", DIFF_DST: "y"}}

    def step(self, kind, first=None, accumulate=False):
        """The _Step of ``kind``: forward, forward_bias, data, weights; ``first``: the argument
        name ("x", "y") whose reordered copy takes the workspace's first slot (``run_two``);
        ``accumulate`` (weights): the weight gradient is added into ``w`` where it is reordered out
        of the kernels' layout (``adds``), not written over it."""
        key = (kind, first, accumulate and kind == "weights")
        s = self._steps.get(key)
        if s is not None:
            return s
        with _create_lock:
            return self._steps.get(key) or self._new_step(*key)

    def adds(self, first=None) -> bool:
        """Whether the weights pass run with ``accumulate`` adds its gradient into ``w`` (oneDNN's
        layout for it is not OIHW: a reorder out, which sums), rather than writing it."""
        return self.step("weights", first, True).adds(DIFF_WEIGHTS)

    def _new_step(self, kind, first, accumulate=False):
        u, k, g = self.user, self._kern, self.geometry
        names = self._NAMES[kind]
        order = sorted(names, key=lambda arg: names[arg] != first)      # stable: ``first`` leads
        descs = {arg: u[names[arg]] for arg in order}
        pd = ctypes.c_void_p()
        if kind == "forward":
            s = _Step(self.fwd_pd, descs, (DST,))
        elif kind == "forward_bias":
            s = _Step(self.fwd_bias_pd, descs, (DST,))
        elif kind == "data":
            _check(_lib.dnnl_convolution_backward_data_primitive_desc_create(
                ctypes.byref(pd), _engine, _DIRECT, k["x"].ptr, k["w"].ptr, k["y"].ptr, g["strides"],
                g["dilates"], g["padding_l"], g["padding_r"], self.fwd_pd, self.attr), "convolution backward data")
            s = _Step(pd, descs, (DIFF_SRC,))
        else:
            _check(_lib.dnnl_convolution_backward_weights_primitive_desc_create(
                ctypes.byref(pd), _engine, _DIRECT, k["x"].ptr, k["w"].ptr, None, k["y"].ptr, g["strides"],
                g["dilates"], g["padding_l"], g["padding_r"], self.fwd_pd, self.attr),
                "convolution backward weights")
            s = _Step(pd, descs, (DIFF_WEIGHTS,), (DIFF_WEIGHTS,) if accumulate else ())
        self._steps[(kind, first, accumulate)] = s
        return s

    def nbytes(self, kind, first=None, accumulate=False):
        return self.step(kind, first, accumulate).nbytes

    def impl(self, kind):
        return self.step(kind).impl

    def run(self, kind, ws, first=None, accumulate=False, **arrays):
        """Run ``kind`` on x, y, w (and b) (C-contiguous float32 arrays); ws: uint8 workspace
        (``nbytes(kind, first, accumulate)``); ``first``, ``accumulate``: which step (``step``)."""
        _set_threads()
        self.step(kind, first, accumulate).run({arg: arrays[n] for arg, n in self._NAMES[kind].items()}, ws)

    def shares(self, first_kind, second_kind, name, accumulate=False) -> bool:
        """Whether ``run_two`` reorders input ``name`` once for both passes: each pass wants it
        reordered, into the same layout."""
        return self._pair(first_kind, second_kind, name, accumulate) is not None

    def _pair(self, first_kind, second_kind, name, accumulate=False):
        """((step, its arg for ``name``, its other args by name) of each pass), or None where the
        passes cannot share ``name``'s reordered copy; worked out once."""
        key = (first_kind, second_kind, name, accumulate)
        if key not in self._pairs:
            passes = []
            for kind in key[:2]:
                step, names = self.step(kind, name, accumulate), self._NAMES[kind]
                arg = next(a for a, n in names.items() if n == name)
                passes.append((step, arg, {a: n for a, n in names.items() if n != name}))
            (a, arg_a, _), (b, arg_b, _) = passes
            sa, sb = a.slot(arg_a), b.slot(arg_b)
            same = (sa is not None and sb is not None and sa[1] == sb[1] == 0
                    and bool(_lib.dnnl_memory_desc_equal(sa[0], sb[0])))
            self._pairs[key] = passes if same else None
        return self._pairs[key]

    def run_two(self, ws, first, second, name, shared, accumulate=False):
        """Two passes that read the same input ``name`` ("x" or "y") = ``shared``: ``first`` and
        ``second`` are (kind, {other name: array}). Where ``shares``, ``shared`` is reordered into
        the kernels' layout once (the first slot of both passes' workspace, ``nbytes(kind, name)``),
        else each pass reorders its own copy. The same bytes either way. ``accumulate``: the
        weights pass's (``step``)."""
        _set_threads()
        pair = self._pair(first[0], second[0], name, accumulate)
        if pair is None:            # the same steps, each reordering its own copy
            for kind, arrays in (first, second):
                self.run(kind, ws, name, accumulate, **{name: shared}, **arrays)
            return
        pair[0][0].reorder_in(pair[0][1], shared, ws)
        for (step, arg, others), (_, arrays) in zip(pair, (first, second)):
            step.run({a: arrays[n] for a, n in others.items()}, ws, ready=(arg,))


_cache: dict = {}


def conv(n, channels, num_output, group, size, kernel, stride, pad, dilation, layout="any") -> Conv:
    """The Conv of this geometry and batch size (primitive creation is slow: kept per process)."""
    key = (n, channels, num_output, group, tuple(size), tuple(kernel), tuple(stride), tuple(pad), tuple(dilation),
           layout, _threads.current().threads)
    return _kept(_cache, key, lambda: Conv(*key[:-1]))


def _kept(cache, key, make):
    """``cache[key]``, made by ``make()`` the first time, once whichever thread asks first."""
    c = cache.get(key)
    if c is None:
        with _create_lock:
            c = cache.get(key) or cache.setdefault(key, make())
    return c


_RELU_USE_DST = 0x100       # dnnl_eltwise_relu_use_dst_for_bwd: backward reads y, as Caffe's in place


class Relu:
    """Caffe's ReLU with ``negative_slope`` >= 0 on ``n`` contiguous float32 values: forward
    y = x > 0 ? x : slope * x, backward dx = y > 0 ? dy : slope * dy (reading y, so it may run in
    place). The same values as NumPy's max(x, 0) + slope * min(x, 0) and dy * (y > 0 or slope),
    byte for byte without a slope (with one, -0 where NumPy's sum gives +0;
    tests/layers/test_onednn.py); JIT-vectorized and on the OpenMP team, where NumPy runs on one
    thread (``tools/bench_elementwise.py``: 128x16x1024 from memory, forward 1.22x NumPy's speed
    on one thread, 1.34x on two; backward 0.96x and 2.35x)."""

    def __init__(self, n, slope):
        _set_threads()
        md = self.md = _Desc((n,), _A)
        self.attr = _attr()
        fwd, bwd = ctypes.c_void_p(), ctypes.c_void_p()
        _check(_lib.dnnl_eltwise_forward_primitive_desc_create(
            ctypes.byref(fwd), _engine, _FWD_TRAINING, _RELU_USE_DST, md.ptr, md.ptr, slope, 0.0, self.attr),
            "eltwise forward")
        _check(_lib.dnnl_eltwise_backward_primitive_desc_create(
            ctypes.byref(bwd), _engine, _RELU_USE_DST, md.ptr, md.ptr, md.ptr, slope, 0.0, fwd, self.attr),
            "eltwise backward")
        self.forward_step = _Step(fwd, {SRC: md, DST: md}, (DST,))
        self.backward_step = _Step(bwd, {DST: md, DIFF_DST: md, DIFF_SRC: md}, (DIFF_SRC,))
        # element-wise kernels need no scratchpad; if one ever did, it would need a planned workspace
        self.usable = self.forward_step.nbytes == 0 and self.backward_step.nbytes == 0

    def forward(self, x, y):
        _set_threads()
        self.forward_step.run({SRC: x, DST: y}, _NO_WORKSPACE)

    def backward(self, y, dy, dx):
        _set_threads()
        self.backward_step.run({DST: y, DIFF_DST: dy, DIFF_SRC: dx}, _NO_WORKSPACE)


_NO_WORKSPACE = np.empty(0, np.uint8)
_relus: dict = {}


def relu(n, slope) -> Relu | None:
    """The Relu of ``n`` values and this slope (kept per process), or None where oneDNN is not
    in use (``SNCAFFE_CONV=native``, not installed) or its kernels would need a scratchpad."""
    if choice() != "onednn":
        return None
    r = _kept(_relus, (n, float(slope), _threads.current().threads), lambda: Relu(n, slope))
    return r if r.usable else None


class _Queried:
    """A memory descriptor a primitive descriptor owns (queried, not destroyed by us)."""

    def __init__(self, ptr):
        self.ptr = ptr


POOL_MAX, POOL_AVG = 0x1ff, 0x2ff      # dnnl_pooling_max, dnnl_pooling_avg_include_padding


class _PoolKernels:
    """oneDNN's forward and backward pooling primitives for one shape, their x and y (dy and dx)
    in NCHW, the kernels' own layout NCHW or, ``blocked``, nChw8c (reordered through the
    workspace)."""

    def __init__(self, shape, pooled, kernel, stride, pad, alg, blocked):
        N, C, H, W = shape
        right = [max(0, (p - 1) * s + k - n - q) for p, s, k, n, q in zip(pooled, stride, kernel, (H, W), pad)]
        self.src, self.dst = _Desc(shape, _NCHW), _Desc((N, C) + tuple(pooled), _NCHW)
        tag = _NCHW8C if blocked else _NCHW
        self.kernel_src, self.kernel_dst = _Desc(shape, tag), _Desc((N, C) + tuple(pooled), tag)
        self.attr = _attr()
        dims = (_dims(stride), _dims(kernel), _dims((0, 0)), _dims(pad), _dims(right))
        fwd, bwd = ctypes.c_void_p(), ctypes.c_void_p()
        _check(_lib.dnnl_pooling_forward_primitive_desc_create(
            ctypes.byref(fwd), _engine, _FWD_TRAINING, alg, self.kernel_src.ptr, self.kernel_dst.ptr, *dims,
            self.attr), "pooling forward")
        _check(_lib.dnnl_pooling_backward_primitive_desc_create(
            ctypes.byref(bwd), _engine, alg, self.kernel_src.ptr, self.kernel_dst.ptr, *dims, fwd, self.attr),
            "pooling backward")
        fu, bu = {SRC: self.src, DST: self.dst}, {DIFF_DST: self.dst, DIFF_SRC: self.src}
        self.ws = None
        if alg == POOL_MAX:
            self.ws = _Queried(_lib.dnnl_primitive_desc_query_md(fwd, _Q_EXEC_ARG_MD, WORKSPACE))
            fu[WORKSPACE] = bu[WORKSPACE] = self.ws
        self.forward_step = _Step(fwd, fu, (DST, WORKSPACE) if self.ws else (DST,))
        self.backward_step = _Step(bwd, bu, (DIFF_SRC,))
        self.ws_bytes = _lib.dnnl_memory_desc_get_size(self.ws.ptr) if self.ws else 0
        self.nbytes = max(self.forward_step.nbytes, self.backward_step.nbytes)
        self.jit = all(step.impl.startswith("jit") for step in (self.forward_step, self.backward_step))


# Blocked pooling runs on blocks of images whose reordered copies (x and y, channels padded to
# blocks of 8) hold at most this many bytes: its workspace. Larger blocks gain little and cost
# workspace (tools/bench_kernels.py).
POOL_BLOCK_BYTES = 2 << 20


class Pool:
    """Caffe's MAX or AVE pooling of a contiguous float32 (N, C, H, W) tensor into (N, C, PH, PW):
    oneDNN's JIT kernel (one pass, on the OpenMP team) where NumPy takes a pass or more per tap.
    MAX keeps each window's argmax in ``argmax`` (``ws_bytes`` of oneDNN's workspace: its own
    encoding, read only by its backward) and takes the first maximum of a window, as Caffe's
    strict > does; padding never wins. AVE divides by the window's cells, padding included,
    which is Caffe's divisor wherever no window runs past the padding (``pool`` offers it only
    there). ``blocked``: the kernels run on channels in blocks of 8 (nChw8c), x and y (dy and
    dx) reordered in and out through the workspace, ``block`` images at a time (at most
    POOL_BLOCK_BYTES of copies; the batch cut into equal blocks, the last one smaller); NCHW runs
    the whole batch at once. ``nbytes``: the workspace both passes need (scratchpad and
    reordered copies, a planned workspace); ``jit``: whether every pass has JIT kernels."""

    def __init__(self, shape, pooled, kernel, stride, pad, alg, blocked=False):
        _set_threads()
        N, C, H, W = shape
        self.block = N
        if blocked:
            copies = -(-C // 8) * 8 * (H * W + pooled[0] * pooled[1]) * 4      # bytes an image
            blocks = -(-N * copies // POOL_BLOCK_BYTES)
            self.block = max(1, -(-N // blocks))
        sizes = sorted({self.block, N % self.block} - {0}, reverse=True)
        self.kernels = {n: _PoolKernels((n, C, H, W), pooled, kernel, stride, pad, alg, blocked) for n in sizes}
        first = self.kernels[self.block]
        self.ws = first.ws
        self.image_ws = first.ws_bytes // self.block        # oneDNN's workspace is per image
        self.ws_bytes = self.image_ws * N
        self.nbytes = max(k.nbytes for k in self.kernels.values())
        self.blocked = blocked
        self.jit = all(k.jit for k in self.kernels.values())

    def forward(self, x, y, argmax, ws):
        self._run("forward_step", SRC, DST, x, y, argmax, ws)

    def backward(self, dy, dx, argmax, ws):
        self._run("backward_step", DIFF_DST, DIFF_SRC, dy, dx, argmax, ws)

    def _run(self, step, a, b, src, dst, argmax, ws):
        """``step`` block by block on ``src`` and ``dst``, MAX's argmax as oneDNN's workspace, its
        scratchpad and copies in ``ws``."""
        _set_threads()
        argmax = argmax.reshape(-1).view(np.uint8) if self.ws is not None else None
        N, per = src.shape[0], self.image_ws
        for i in range(0, N, self.block):
            n = min(self.block, N - i)
            st = getattr(self.kernels[n], step)
            args = {a: src[i:i + n], b: dst[i:i + n]}
            if argmax is not None:
                args[WORKSPACE] = argmax[i * per:(i + n) * per]
            st.run(args, ws[:st.nbytes])


_pools: dict = {}


def pool(shape, pooled, kernel, stride, pad, alg) -> Pool | None:
    """The Pool of this geometry (kept per process), or None where oneDNN is not in use or has no
    JIT kernel for it. NCHW where oneDNN has JIT kernels for it, else blocked (reorders in and
    out) where it has them there: on CPUs where oneDNN 3.2 has only its reference kernel for
    NCHW pooling (AVX2), the blocked kernel and NumPy's taps (``pooling.py``) both beat it
    (tools/bench_kernels.py)."""
    if choice() != "onednn":
        return None
    key = (tuple(shape), tuple(pooled), tuple(kernel), tuple(stride), tuple(pad), alg, _threads.current().threads)

    def make():
        for blocked in (False, True):
            try:
                p = Pool(shape, pooled, kernel, stride, pad, alg, blocked)
            except (ValueError, RuntimeError):
                continue
            if p.jit:
                return p
        return False
    return _kept(_pools, key, make) or None


ADD, MUL, DIV, SUB = 0x1fff0, 0x1fff1, 0x1fff4, 0x1fff5      # dnnl_binary_*
_ABC = 4                    # dnnl_abc: a plain 3-D tensor


def _post_op_src(k):
    """DNNL_ARG_ATTR_MULTIPLE_POST_OP(k) | DNNL_ARG_SRC_1 (oneDNN 3.x)."""
    return 32768 * (k + 1) | 2


class Binary:
    """dst = ((src0 op src1) op1 a1) op2 a2 ... on a contiguous float32 (outer, C, inner) view, one
    pass on the OpenMP team, each operation rounded to float32 in this order, as NumPy's separate
    calls round (the same bytes: tests/layers/test_onednn.py). ``src1`` is per channel (a (C,)
    array) or, where ``full``, a whole tensor; so is each post-operand ``a``, by its own ``full``.
    Caffe's Scale (x * scale + bias), its dx (dy * scale), BatchNorm's steps, and Eltwise's and
    Split's sums (``sum_for``) run on it (``tools/bench_elementwise.py``,
    128x16x1024 from memory: x * s + b 2.15x NumPy's speed on one thread, 1.70x on two; BatchNorm's
    gradient 1.61x and 1.85x)."""

    def __init__(self, view, op, posts=(), full=False):
        _set_threads()
        outer, dim, inner = view
        self.md, self.cmd = _Desc((outer, dim, inner), _ABC), _Desc((1, dim, 1), _ABC)
        self.attr = _attr()
        if posts:
            po = ctypes.c_void_p()
            _check(_lib.dnnl_post_ops_create(ctypes.byref(po)), "post_ops_create")
            try:
                for alg, whole in posts:
                    _check(_lib.dnnl_post_ops_append_binary(po, alg, (self.md if whole else self.cmd).ptr),
                           "post_ops_append_binary")
                _check(_lib.dnnl_primitive_attr_set_post_ops(self.attr, po), "set_post_ops")
            finally:
                _lib.dnnl_post_ops_destroy(po)
        pd = ctypes.c_void_p()
        src1 = self.md if full else self.cmd
        _check(_lib.dnnl_binary_primitive_desc_create(ctypes.byref(pd), _engine, op, self.md.ptr,
                                                      src1.ptr, self.md.ptr, self.attr), "binary")
        user = {SRC: self.md, 2: src1, DST: self.md}
        for k, (_, whole) in enumerate(posts):
            user[_post_op_src(k)] = self.md if whole else self.cmd
        self.step = _Step(pd, user, (DST,))
        self.usable = self.step.nbytes == 0

    def run(self, src0, src1, dst, *operands):
        _set_threads()
        args = {SRC: src0, 2: src1, DST: dst}
        for k, a in enumerate(operands):
            args[_post_op_src(k)] = a
        self.step.run(args, _NO_WORKSPACE)


_binaries: dict = {}


def binary(view, op, posts=(), full=False) -> Binary | None:
    """The Binary of this (outer, C, inner) view and chain of operations (kept per process), or None
    where oneDNN is not in use or would need a scratchpad."""
    if choice() != "onednn":
        return None
    b = _kept(_binaries, (tuple(view), op, tuple(posts), full, _threads.current().threads),
              lambda: Binary(view, op, tuple(posts), full))
    return b if b.usable else None


# Where the element-wise kernels start to pay: a call's setup is ~8-15 us (medians of warm calls,
# one thread, NumPy against oneDNN: ReLU at 16 Ki values 5.7 against 8.8 us, 32 Ki 10.7 against
# 9.6, 64 Ki 20.7 against 11.4; x * s + b at 128 Ki 14.7 against 25.6, 256 Ki 33 against 39,
# 512 Ki 100 against 61; BatchNorm's gradient chain at 256 Ki 61 against 49).
RELU_MIN, BINARY_MIN = 1 << 15, 1 << 18
# On a team of two or more from half that: the team's share of a 128-256 Ki tensor pays for its
# wake-up (ResNet-50 at batch 2, two threads, by turns over 12 iterations: 1.032x and 1.003x the
# step at 256 Ki; MobileNet-v2 at batch 8 1.018x; at one thread 128 Ki gave 0.998x, so it stays)
BINARY_MIN_TEAM = 1 << 17


def _fits(arrays, least) -> bool:
    """Float32 C-contiguous NumPy arrays (None skipped), the first of ``least`` values or more."""
    arrays = [a for a in arrays if a is not None]
    return (arrays[0].size >= least and all(type(a) is np.ndarray and a.dtype == np.float32
                                             and a.flags.c_contiguous for a in arrays))


def flat(n) -> tuple:
    """An (outer, 1, inner) view of ``n`` values for a Binary whose operands are whole tensors or
    one scalar: oneDNN's binary kernel splits a plain tensor over its threads by the outer rows,
    so (1, 1, n) runs on one thread whatever the team (tools/bench_elementwise.py). The rows: the most of 64, 32, ... dividing ``n`` that
    leave 4 Ki values or more each; element by element, the view changes no bit."""
    k = 64
    while k > 1 and (n % k or n // k < 4096):
        k //= 2
    return (k, 1, n // k)


def sum_for(arrays) -> Binary | None:
    """``arrays[0] + arrays[1] + ...`` into ``out`` (``arrays[-1]``), added left to right as NumPy's
    ``np.add(a, b, out); out += c ...`` adds (Eltwise's SUM, Split's backward), or None where NumPy
    runs it (``binary_for``'s rule)."""
    return binary_for(flat(arrays[0].size), arrays, ADD, ((ADD, True),) * (len(arrays) - 3), full=True)


_ONE = np.ones(1, np.float32)


def copy_on_team(src, dst) -> bool:
    """Copy ``src`` into ``dst`` as ``src * 1`` on oneDNN's team (every bit kept: signed zeros,
    subnormals, infinities, NaN; tests/layers/test_onednn.py) and return True, or return False
    and copy nothing where np.copyto is the caller's to run: one thread (there a memcpy is as fast
    or faster; tools/bench_elementwise.py), or ``binary_for``'s rule."""
    if _threads.current().threads < 2:
        return False
    mul = binary_for(flat(src.size), (src, dst), MUL)
    if mul is None:
        return False
    mul.run(src, _ONE, dst)
    return True


def relu_for(slope, *arrays) -> Relu | None:
    """A layer's ReLU on ``arrays`` (x and y, or y, dy and dx) on oneDNN, or None where NumPy runs
    it: a negative slope (backward then needs x), arrays that are not float32 C-contiguous NumPy
    or have fewer than ``RELU_MIN`` values, oneDNN not in use (a misspelt ``SNCAFFE_CONV``
    included: the convolutions report it)."""
    if slope < 0 or not _fits(arrays, RELU_MIN):
        return None
    try:
        return relu(arrays[0].size, slope)
    except (ValueError, RuntimeError):
        return None


def binary_for(view, arrays, op, posts=(), full=False) -> Binary | None:
    """A layer's ``Binary`` of ``op`` and ``posts`` on ``view`` for ``arrays`` (every array the call
    reads and writes), or None where NumPy runs it (as ``relu_for``, from ``BINARY_MIN`` values,
    ``BINARY_MIN_TEAM`` on a team of two or more)."""
    if not _fits(arrays, BINARY_MIN if _threads.current().threads < 2 else BINARY_MIN_TEAM):
        return None
    try:
        return binary(view, op, posts, full)
    except (ValueError, RuntimeError):
        return None
