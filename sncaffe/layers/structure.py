"""Layers that combine, cut, copy or reshape blobs: Eltwise, Concat, Slice, Split,
Flatten, Reshape, Silence (Caffe's eltwise, concat, slice, split, flatten,
reshape and silence layers).

Where Caffe shares memory between top and bottom (Split's data, Flatten's and
Reshape's data and diff, a one-bottom Concat or one-top Slice) the executor may
bind both to the same memory; then the copy is skipped, else it is made.
"""
from __future__ import annotations

from itertools import accumulate

import numpy as np

from ..backend import fused, is_gpu, onednn, workers
from . import structure_gpu
from .base import Layer, array_module, canonical_axis, count, register


def same_memory(a, b) -> bool:
    """True when a and b are the same memory (views of one buffer, maybe reshaped)."""
    xp = array_module(a)
    # CuPy's exact test sorts every element's address; its bounds test is exact here, where the
    # executor aliases whole blocks or none
    overlap = xp.shares_memory if xp is np else xp.may_share_memory
    return a.size == b.size and bool(overlap(a, b))


def assign(dst, src) -> None:
    """dst[...] = src (reshaped to dst's shape), skipped when the executor aliased them."""
    if same_memory(dst, src):
        return
    if dst.flags.c_contiguous:          # one strided copy, never a reshaped copy of a strided src
        dst.reshape(src.shape)[...] = src
    else:
        dst[...] = src.reshape(dst.shape)


def bottom_name(layer, i) -> str:
    return layer.param.bottom[i] if i < len(layer.param.bottom) else f"bottom[{i}]"


def check_not_inplace(layer) -> None:
    if set(layer.param.top) & set(layer.param.bottom):
        raise layer.error("does not allow in-place computation")


def cut_axis(layer, p, legacy: str, num_axes: int) -> int:
    """Concat's/Slice's axis: ``axis``, or the legacy ``concat_dim``/``slice_dim``."""
    if num_axes == 0:
        raise layer.error("needs a bottom with at least one axis")
    if p.HasField("axis") and p.HasField(legacy):
        raise layer.error(f"Either axis or {legacy} should be specified; not both.")
    if p.HasField(legacy):
        axis = getattr(p, legacy)
        if axis >= num_axes:
            raise layer.error(f"{legacy} {axis} out of range for a {num_axes}-axis bottom")
        return axis
    return canonical_axis(layer, p.axis, num_axes)


def pieces(a, outer, sizes, inner):
    """Views of ``a`` cut along one axis: a as (outer, sum(sizes), inner), cut into sizes."""
    a3 = a.reshape(outer, sum(sizes), inner)
    return [a3[:, o:o + n] for o, n in zip(accumulate(sizes, initial=0), sizes)]


@register
class Eltwise(Layer):
    """Elementwise PROD, SUM (with one coeff per bottom) or MAX of same-shape bottoms."""
    type = "Eltwise"
    min_bottoms, exact_tops = 2, 1

    def setup(self, bottom_shapes):
        p = self.param.eltwise_param
        n = len(bottom_shapes)
        self.op = p.EltwiseOp.Name(p.operation)
        if p.coeff and self.op == "PROD":
            raise self.error("Eltwise layer only takes coefficients for summation.")
        if p.coeff and len(p.coeff) != n:
            raise self.error(f"takes one coeff per bottom: {len(p.coeff)} coeff(s) for {n} bottoms")
        self.coeffs = list(p.coeff) or [1.0] * n
        self.stable_prod_grad = p.stable_prod_grad
        shape = tuple(bottom_shapes[0])
        for i, s in enumerate(bottom_shapes[1:], 1):
            if tuple(s) != shape:
                raise self.error(f'bottom "{bottom_name(self, i)}" shape {tuple(s)} differs from '
                                 f'bottom "{bottom_name(self, 0)}" shape {shape}')
        if self.op == "MAX":
            self.scratch_specs = {"argmax": (shape, np.int32)}     # which bottom won, per element
            if not is_gpu(self.target):                    # the GPU kernels need no mask
                self.workspace_specs = {"mask": (shape, np.bool_)}
        elif self.op == "SUM" and any(c != 1 for c in self.coeffs):
            self.workspace_specs = {"scaled": (shape, None)}
        if self.op == "PROD":
            self.backward_needs = ("bottom",) if self.stable_prod_grad else ("bottom", "top")
        else:
            self.backward_needs = ()
        return [shape]

    # Element by element: on NumPy the arrays run in pieces over threads (backend/workers).
    def forward(self, bottom, top):
        xp = array_module(bottom[0].data)
        y, x = top[0].data, [b.data for b in bottom]
        if self.fused("forward"):           # with the in-place ReLU after it (graph.EltwiseReLU)
            return self._forward_relu(xp, x, y)
        if xp is not np and self.op == "MAX":
            return structure_gpu.eltwise_max_forward(x, y, self.scratch["argmax"])
        if self.op == "SUM" and all(c == 1 for c in self.coeffs):
            add = onednn.sum_for((*x, y))       # one pass on oneDNN's kernel: the same bytes
            if add is not None:
                return add.run(x[0], x[1], y, *x[2:])
        named = (self.scratch.get("argmax"), self.workspace.get("mask"), self.workspace.get("scaled"))
        workers.elementwise(lambda y, argmax, mask, scaled, *x: self._forward(xp, y, x, argmax, mask, scaled),
                            y, *named, *x)

    def _forward(self, xp, y, x, argmax, mask, scaled):
        if self.op == "PROD":
            xp.multiply(x[0], x[1], out=y)
            for xi in x[2:]:
                y *= xi
        elif self.op == "SUM":
            xp.multiply(x[0], self.coeffs[0], out=y)
            for xi, c in zip(x[1:], self.coeffs[1:]):
                if c == 1:
                    y += xi
                else:
                    y += xp.multiply(xi, c, out=scaled)
        else:
            # Caffe's order: ties between bottoms 0 and 1 go to 1, later ties keep the earlier
            xp.greater(x[0], x[1], out=mask)
            xp.copyto(y, x[1])
            xp.copyto(y, x[0], where=mask)
            argmax.fill(1)
            xp.copyto(argmax, 0, where=mask)
            for i, xi in enumerate(x[2:], 2):
                xp.greater(xi, y, out=mask)
                xp.copyto(y, xi, where=mask)
                xp.copyto(argmax, i, where=mask)

    def _forward_relu(self, xp, x, y):
        """y = max(x0 + x1, 0): the sum's and then the ReLU's bits, in one pass where compiled."""
        if fused.usable(*x, y):
            return fused.kernels().add_relu(x[0], x[1], y)
        xp.add(x[0], x[1], out=y)
        xp.maximum(y, 0, out=y)

    def _backward_relu(self, xp, top, propagate_down, bottom):
        """The ReLU's in-place backward, dy * (y > 0) into the top's diff, and this layer's:
        that into each bottom's diff (coefficients of 1)."""
        y, dy = top[0].data, top[0].diff
        dx = [b.diff for b, p in zip(bottom, propagate_down) if p]
        if dx and fused.usable(y, dy, *dx):
            return fused.kernels().relu_grad_copy(y, dy, *dx)
        xp.multiply(dy, y > 0, out=dy)
        for d in dx:
            xp.copyto(d, dy)

    def backward(self, top, propagate_down, bottom):
        xp = array_module(top[0].diff)
        if self.fused("backward"):
            return self._backward_relu(xp, top, propagate_down, bottom)
        n = len(bottom)
        prod = self.op == "PROD"
        data = [b.data if prod else None for b in bottom]
        diffs = [b.diff if p else None for b, p in zip(bottom, propagate_down)]
        y = top[0].data if prod and not self.stable_prod_grad else None
        if self.op == "SUM" and xp is np:     # coefficients of 1: dx = dy, a copy on the team each
            for i, (dx, c) in enumerate(zip(diffs, self.coeffs)):
                if dx is not None and c == 1 and onednn.copy_on_team(top[0].diff, dx):
                    diffs[i] = None
        workers.elementwise(lambda dy, y, argmax, mask, *rest: self._backward(xp, dy, y, argmax, mask, rest[:n], rest[n:]),
                            top[0].diff, y, self.scratch.get("argmax"), self.workspace.get("mask"), *data, *diffs)

    def _backward(self, xp, dy, y, argmax, mask, data, diffs):
        for i, dx in enumerate(diffs):
            if dx is None:
                continue
            if self.op == "PROD":
                if self.stable_prod_grad:      # the product of the other bottoms
                    others = [o for j, o in enumerate(data) if j != i]
                    xp.copyto(dx, others[0])
                    for o in others[1:]:
                        dx *= o
                else:
                    xp.divide(y, data[i], out=dx)
                dx *= dy
            elif self.op == "SUM" and self.coeffs[i] == 1:
                xp.copyto(dx, dy)           # dy * 1, bit for bit
            elif self.op == "SUM":
                xp.multiply(dy, self.coeffs[i], out=dx)
            elif xp is not np:
                structure_gpu.eltwise_max_backward(dy, argmax, dx, i)
            else:
                xp.equal(argmax, i, out=mask)
                dx.fill(0)
                xp.copyto(dx, dy, where=mask)


@register
class Concat(Layer):
    """Join bottoms along ``axis``; all other dims must agree."""
    type = "Concat"
    min_bottoms, exact_tops = 1, 1
    backward_needs = ()

    def setup(self, bottom_shapes):
        first = tuple(bottom_shapes[0])
        axis = cut_axis(self, self.param.concat_param, "concat_dim", len(first))
        for i, s in enumerate(bottom_shapes[1:], 1):
            s = tuple(s)
            if len(s) != len(first) or s[:axis] != first[:axis] or s[axis + 1:] != first[axis + 1:]:
                raise self.error(f'bottom "{bottom_name(self, i)}" shape {s} and bottom '
                                 f'"{bottom_name(self, 0)}" shape {first} differ outside '
                                 f'concat axis {axis}')
        self.outer, self.inner = count(first, 0, axis), count(first, axis + 1)
        self.sizes = [s[axis] for s in bottom_shapes]
        return [first[:axis] + (sum(self.sizes),) + first[axis + 1:]]

    def forward(self, bottom, top):
        tops = pieces(top[0].data, self.outer, self.sizes, self.inner)
        if array_module(top[0].data) is not np:
            for piece, b in zip(tops, bottom):
                assign(piece, b.data)
            return
        # the outer rows (images, where the axis is 1) copied on threads (backend/workers)
        copies = [(piece, b.data.reshape(piece.shape)) for piece, b in zip(tops, bottom)
                  if not same_memory(piece, b.data)]
        workers.split(self.outer, 2 * top[0].data.size,
                      lambda rows: [np.copyto(piece[rows], b[rows]) for piece, b in copies])

    def backward(self, top, propagate_down, bottom):
        for i, piece in enumerate(pieces(top[0].diff, self.outer, self.sizes, self.inner)):
            if propagate_down[i]:
                assign(bottom[i].diff, piece)


@register
class Slice(Layer):
    """Cut the bottom along ``axis`` at ``slice_point``s, or into equal parts per top."""
    type = "Slice"
    exact_bottoms, min_tops = 1, 1
    backward_needs = ()

    def setup(self, bottom_shapes):
        p = self.param.slice_param
        shape = tuple(bottom_shapes[0])
        axis = cut_axis(self, p, "slice_dim", len(shape))
        n_tops, dim = len(self.param.top), shape[axis]
        points = list(p.slice_point)
        if points:
            if len(points) != n_tops - 1:
                raise self.error(f"{len(points)} slice_point(s) need {len(points) + 1} tops, "
                                 f"got {n_tops}")
            bounds = [0] + points + [dim]
            sizes = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
            if n_tops > dim or min(sizes[:-1]) <= 0 or sizes[-1] < 0:
                raise self.error(f"slice_point {points} must rise strictly inside axis {axis} "
                                 f"of size {dim} (bottom shape {shape})")
        else:
            if dim % n_tops:
                raise self.error(f"{n_tops} tops do not evenly divide axis {axis} of size {dim} "
                                 f"(bottom shape {shape})")
            sizes = [dim // n_tops] * n_tops
        self.outer, self.inner, self.sizes = count(shape, 0, axis), count(shape, axis + 1), sizes
        return [shape[:axis] + (n,) + shape[axis + 1:] for n in sizes]

    def forward(self, bottom, top):
        for piece, t in zip(pieces(bottom[0].data, self.outer, self.sizes, self.inner), top):
            assign(t.data, piece)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            for piece, t in zip(pieces(bottom[0].diff, self.outer, self.sizes, self.inner), top):
                assign(piece, t.diff)


@register
class Split(Layer):
    """Copy one bottom to N tops (data may be shared); backward sums the top diffs."""
    type = "Split"
    exact_bottoms, min_tops = 1, 1
    backward_needs = ()

    def setup(self, bottom_shapes):
        check_not_inplace(self)
        return [tuple(bottom_shapes[0])] * len(self.param.top)

    def forward(self, bottom, top):
        for t in top:
            assign(t.data, bottom[0].data)

    def backward(self, top, propagate_down, bottom):
        if not propagate_down[0]:
            return
        dx = bottom[0].diff
        if len(top) == 1:
            assign(dx, top[0].diff)
            return
        diffs = [t.diff for t in top]
        fast = onednn.sum_for((*diffs, dx))      # one pass on oneDNN's kernel: the same bytes
        if fast is not None:
            return fast.run(diffs[0], diffs[1], dx, *diffs[2:])

        def add(dx, *diffs):
            array_module(dx).add(diffs[0], diffs[1], out=dx)
            for d in diffs[2:]:
                dx += d
        workers.elementwise(add, dx, *(t.diff for t in top))    # in pieces over threads


class _View(Layer):
    """A top that is the bottom under another shape (Caffe shares data and diff)."""
    exact_bottoms = exact_tops = 1
    backward_needs = ()

    def forward(self, bottom, top):
        assign(top[0].data, bottom[0].data)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            assign(bottom[0].diff, top[0].diff)


@register
class Flatten(_View):
    """Merge axes ``axis`` .. ``end_axis`` (inclusive) into one."""
    type = "Flatten"

    def setup(self, bottom_shapes):
        check_not_inplace(self)
        p, shape = self.param.flatten_param, tuple(bottom_shapes[0])
        start = canonical_axis(self, p.axis, len(shape))
        end = canonical_axis(self, p.end_axis, len(shape))
        if end + 1 < start:
            raise self.error(f"end_axis {p.end_axis} comes before axis {p.axis} "
                             f"for bottom shape {shape}")
        return [shape[:start] + (count(shape, start, end + 1),) + shape[end + 1:]]


@register
class Reshape(_View):
    """Replace axes [axis, axis + num_axes) by ``shape``: 0 copies a bottom dim, -1 is inferred."""
    type = "Reshape"

    def setup(self, bottom_shapes):
        check_not_inplace(self)
        p, shape = self.param.reshape_param, tuple(bottom_shapes[0])
        dims, n = list(p.shape.dim), len(shape)
        if dims.count(-1) > 1:
            raise self.error(f"shape {dims} has more than one -1 (at most one dim is inferred)")
        if any(d < -1 for d in dims):
            raise self.error(f"shape {dims} has a dim below -1")
        start = p.axis if p.axis >= 0 else n + p.axis + 1
        if not 0 <= start <= n:
            raise self.error(f"axis {p.axis} out of range for a {n}-axis bottom {shape}")
        if p.num_axes < -1:
            raise self.error(f"num_axes {p.num_axes} must be >= 0, or -1 for all")
        end = n if p.num_axes == -1 else start + p.num_axes
        if end > n:
            raise self.error(f"axis {p.axis} + num_axes {p.num_axes} out of range for bottom {shape}")
        new = list(dims)
        for i, d in enumerate(dims):
            if d == 0:
                if start + i >= n:
                    raise self.error(f"shape {dims} has a 0 at {i} but bottom {shape} has no "
                                     f"axis {start + i} to copy")
                new[i] = shape[start + i]
        if -1 in new:
            known = count(shape, 0, start) * count(shape, end) * count([d for d in new if d != -1])
            if known == 0 or count(shape) % known:
                raise self.error(f"bottom count {count(shape)} (shape {shape}) is not divisible "
                                 f"by the product of the specified dims {known}")
            new[new.index(-1)] = count(shape) // known
        top_shape = shape[:start] + tuple(new) + shape[end:]
        if count(top_shape) != count(shape):
            raise self.error(f"output count {count(top_shape)} (shape {top_shape}) must match "
                             f"input count {count(shape)} (shape {shape})")
        return [top_shape]


@register
class Silence(Layer):
    """Consume bottoms so they count as used; backward writes zero diffs, as Caffe does."""
    type = "Silence"
    min_bottoms, exact_tops = 1, 0
    backward_needs = ()

    def setup(self, bottom_shapes):
        return []

    def forward(self, bottom, top):
        pass

    def backward(self, top, propagate_down, bottom):
        for b, down in zip(bottom, propagate_down):
            if down:
                b.diff.fill(0)


def transfer(dst, src):
    """Copy between arrays that may live on different devices (NumPy, CuPy, or one of each)."""
    if type(dst) is type(src):
        array_module(dst).copyto(dst, src)   # CuPy copies between its devices itself
    elif hasattr(dst, "set"):
        dst.set(src)                         # host -> GPU
    else:
        src.get(out=dst)                     # GPU -> host


@register
class Copy(Layer):
    """The operator that moves a blob between locations (inserted by the loader, never written
    by hand): its top lives where it runs, its bottom where the blob was made."""
    type = "Copy"
    exact_bottoms = exact_tops = 1
    backward_needs = ()

    def setup(self, bottom_shapes):
        return [tuple(bottom_shapes[0])]

    def forward(self, bottom, top):
        transfer(top[0].data, bottom[0].data)

    def backward(self, top, propagate_down, bottom):
        if propagate_down[0]:
            transfer(bottom[0].diff, top[0].diff)
