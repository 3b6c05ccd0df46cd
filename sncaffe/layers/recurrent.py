"""Recurrent layers: RNN, LSTM and LSTMUnit, with Caffe's semantics (recurrent_layer.cpp and friends).

Caffe builds RNN and LSTM as an unrolled internal net (InnerProduct, Scale by
``cont``, Eltwise, TanH / LSTMUnit, Concat); here the same arithmetic runs as a
time loop, with the parameters in the order and shapes the unrolled net owns
them, so .caffemodel files load:

- RNN:  W_xh (H, D), b_h (H), [W_xh_static (H, Ds)], W_hh (H, H), W_ho (H, H), b_o (H)
          h_t = tanh(W_xh x_t + b_h [+ W_xh_static x_static] + W_hh (cont_t h_{t-1}))
          o_t = tanh(W_ho h_t + b_o)
- LSTM: W_xc (4H, D), b_c (4H), [W_xc_static (4H, Ds)], W_hc (4H, H)
          gates_t = W_xc x_t + b_c [+ W_xc_static x_static] + W_hc (cont_t h_{t-1}),
          blocks i, f, o, g, through LSTMUnit (where cont_t also gates f).

Bottoms: x (T, N, ...), cont (T, N), [x_static (N, ...)], then with
``expose_hidden`` h_0 [, c_0] (1, N, H). Tops: the output (T, N, H), then with
``expose_hidden`` h_T [, c_T] (1, N, H).

Hidden state across batches, as Caffe: without ``expose_hidden`` a forward
starts from the state the previous forward ended in (zero at first; ``reset()``
zeroes it). That state is the layer's own small (N, H) array, outside the
device pool like a data layer's prefetch buffers. With ``expose_hidden`` the
state comes from the bottoms and goes to the tops, but no gradient crosses
them: Caffe shares only their data with the unrolled net, so it ignores the
diffs of h_T/c_T and writes none to h_0/c_0 (sncaffe writes zeros there).
There is no backward into ``cont`` (Caffe exempts it from force_backward, and
refuses a net that needs it). ``debug_info`` logs, as Caffe's unrolled net
does, the mean absolute value of the hidden state after forward and of each
parameter diff after backward (logger ``sncaffe``, level INFO).
"""
from __future__ import annotations

import logging

import numpy as np

from ..backend.blas import gemm
from ..fillers import fill
from .base import Layer, array_module, count, register


log = logging.getLogger("sncaffe")


def _asum_mean(a) -> float:
    return float(abs(a).mean()) if a.size else 0.0


def _no_cont_backward(layer, propagate_down, index):
    if propagate_down[index]:
        raise layer.error(f"cannot backpropagate to the sequence indicators (bottom[{index}], cont), as in "
                          "Caffe: cont must not need a gradient (no propagate_down: true, no learnable layer below)")


def _sigmoid(xp, x):
    return 1.0 / (1.0 + xp.exp(-x))


class _Recurrent(Layer):
    """What RNN and LSTM share: bottom/top layout, parameters around the recurrence, the carry."""
    n_state = 1                 # hidden state blobs: h (RNN) or h, c (LSTM)

    def __init__(self, param, phase):
        super().__init__(param, phase)
        n = 2 + self.n_state * param.recurrent_param.expose_hidden
        self.min_bottoms, self.max_bottoms = n, n + 1
        self.exact_tops = 1 + self.n_state * param.recurrent_param.expose_hidden
        self._carry = self._used = None

    def allow_force_backward(self, bottom_index):
        return bottom_index != 1        # cont: sequence indicators get no gradient

    def setup(self, bottom_shapes):
        p = self.param.recurrent_param
        if p.num_output <= 0:
            raise self.error("recurrent_param.num_output must be positive")
        x, cont = (tuple(s) for s in bottom_shapes[:2])
        if len(x) < 2:
            raise self.error(f"bottom[0] must have at least 2 axes -- (#timesteps, #streams, ...), got {x}")
        self.T, self.N, self.H = x[0], x[1], p.num_output
        if cont != (self.T, self.N):
            raise self.error(f"bottom[1] (cont) must have shape (#timesteps, #streams) = {(self.T, self.N)}, "
                             f"got {cont}")
        self.expose = p.expose_hidden
        self.static = len(bottom_shapes) > 2 + self.n_state * self.expose
        self.D, self.Ds = count(x, 2), 0
        state = (1, self.N, self.H)
        if self.static:
            xs = tuple(bottom_shapes[2])
            if len(xs) < 1 or xs[0] != self.N:
                raise self.error(f"bottom[2] (x_static) must have #streams = {self.N} as its first axis, got {xs}")
            self.Ds = count(xs, 1)
        first = 2 + self.static
        for i, s in enumerate(bottom_shapes[first:], first):
            if tuple(s) != state:
                raise self.error(f"bottom[{i}] shape must match hidden state input shape {state}, got {tuple(s)}")
        self.param_shapes = self._param_shapes()
        return [(self.T, self.N, self.H)] + [state] * (self.n_state * self.expose)

    def init_params(self, rng):
        p = self.param.recurrent_param
        for blob in self.blobs:         # every 1-D blob is a bias
            fill(p.bias_filler if blob.data.ndim == 1 else p.weight_filler, blob.data, rng)

    def reset(self):
        """Zero the hidden state carried between forwards (Caffe's RecurrentLayer::Reset)."""
        self._carry = None

    def _start(self, bottom, xp, dtype):
        """The state the first step reads: the exposed bottoms, or what the last forward left."""
        if self.expose:
            first = 2 + self.static
            return [b.data.reshape(self.N, self.H) for b in bottom[first:first + self.n_state]]
        if self._carry is None:
            self._carry = [xp.zeros((self.N, self.H), dtype) for _ in range(self.n_state)]
        return self._carry

    def forward(self, bottom, top):
        self._used = self._start(bottom, array_module(bottom[0].data), self.scratch["h"].dtype)
        ends = self._forward(bottom, top, self._used)
        if not self.expose:
            self._carry = ends          # a new list: self._used still holds this forward's start
        if self.param.recurrent_param.debug_info:
            for key, a in self.scratch.items():
                a = a if key == "gates" else a[1:]          # h_1.. and c_1.., as the unrolled net's blobs
                log.info("    [Forward] Layer %s, %s data: %.6g", self.name, key, _asum_mean(a))

    def _debug_backward(self, bottom):
        if self.param.recurrent_param.debug_info:
            if bottom[0].diff is not None:
                log.info("    [Backward] Layer %s, bottom blob %s diff: %.6g", self.name, bottom[0].name,
                         _asum_mean(bottom[0].diff))
            for i, b in enumerate(self.blobs):
                log.info("    [Backward] Layer %s, param blob %d diff: %.6g", self.name, i, _asum_mean(b.diff))

    def recompute(self, bottom, top):
        self._forward(bottom, top, self._used)     # the same start, the carry not advanced

    # Parameters 0, 1 and (with x_static) 2 are W_x, b and W_static in both layers.
    def _x_terms(self, bottom, pre):
        """pre (T, N, G) = W_x x_t + b [+ W_static x_static], every step at once."""
        w = self.blobs
        x = bottom[0].data.reshape(self.T * self.N, self.D)
        gemm(x, w[0].data.T, pre.reshape(self.T * self.N, -1))
        pre += w[1].data
        if self.static:
            xs = bottom[2].data.reshape(self.N, self.Ds)
            pre += (xs @ w[2].data.T)[None]

    def _x_backward(self, bottom, propagate_down, dpre):
        """Gradients of the x terms from dpre (T, N, G): into x, x_static and their parameters."""
        w = self.blobs
        x = bottom[0].data.reshape(self.T * self.N, self.D)
        d2 = dpre.reshape(self.T * self.N, -1)
        gemm(d2.T, x, w[0].diff, beta=1.0)
        w[1].diff += d2.sum(axis=0)
        if propagate_down[0]:
            gemm(d2, w[0].data, bottom[0].diff.reshape(self.T * self.N, self.D))
        if self.static:
            ds = dpre.sum(axis=0)
            xs = bottom[2].data.reshape(self.N, self.Ds)
            gemm(ds.T, xs, w[2].diff, beta=1.0)
            if propagate_down[2]:
                gemm(ds, w[2].data, bottom[2].diff.reshape(self.N, self.Ds))
        first = 2 + self.static
        for j in range(first, len(bottom)):
            if propagate_down[j]:
                bottom[j].diff[...] = 0      # Caffe passes no gradient to the exposed initial state


@register
class RNN(_Recurrent):
    type = "RNN"
    backward_needs = ("bottom", "top")

    def _param_shapes(self):
        H = self.H
        return [(H, self.D), (H,)] + [(H, self.Ds)] * self.static + [(H, H), (H, H), (H,)]

    def setup(self, bottom_shapes):
        tops = super().setup(bottom_shapes)
        self.scratch_specs = {"h": ((self.T + 1, self.N, self.H), None)}      # h_0 .. h_T
        self.backward_workspace_specs = {"dh": ((self.T, self.N, self.H), None)}
        k = 2 + self.static
        self.i_hh, self.i_ho, self.i_bo = k, k + 1, k + 2
        return tops

    def _forward(self, bottom, top, start):
        xp = array_module(bottom[0].data)
        w = [b.data for b in self.blobs]
        h = self.scratch["h"]
        h[0] = start[0]
        self._x_terms(bottom, h[1:])
        cont = bottom[1].data
        w_hh = w[self.i_hh]
        for t in range(self.T):
            h[t + 1] += (cont[t][:, None] * h[t]) @ w_hh.T
            xp.tanh(h[t + 1], out=h[t + 1])
        o = top[0].data.reshape(self.T * self.N, self.H)
        gemm(h[1:].reshape(self.T * self.N, self.H), w[self.i_ho].T, o)
        o += w[self.i_bo]
        xp.tanh(o, out=o)
        if self.expose:
            top[1].data[...] = h[self.T]
        return [h[self.T].copy()]

    def backward(self, top, propagate_down, bottom):
        _no_cont_backward(self, propagate_down, 1)
        w = [b.data for b in self.blobs]
        h, cont = self.scratch["h"], bottom[1].data
        TN = self.T * self.N
        o = top[0].data.reshape(TN, self.H)
        dz = self.workspace["dh"]
        dz2 = dz.reshape(TN, self.H)
        dz2[...] = top[0].diff.reshape(TN, self.H) * (1 - o * o)            # through o's tanh
        h_out = h[1:].reshape(TN, self.H)
        gemm(dz2.T, h_out, self.blobs[self.i_ho].diff, beta=1.0)
        self.blobs[self.i_bo].diff += dz2.sum(axis=0)
        dh = dz2 @ w[self.i_ho]                                              # dL/dh_t from o_t
        dz2[...] = dh
        w_hh = w[self.i_hh]
        carry = None
        for t in range(self.T - 1, -1, -1):
            if carry is not None:
                dz[t] += carry
            dz[t] *= 1 - h[t + 1] * h[t + 1]                                # through h's tanh
            gemm(dz[t].T, cont[t][:, None] * h[t], self.blobs[self.i_hh].diff, beta=1.0)
            carry = cont[t][:, None] * (dz[t] @ w_hh)
        self._x_backward(bottom, propagate_down, dz)
        self._debug_backward(bottom)


@register
class LSTM(_Recurrent):
    type = "LSTM"
    n_state = 2
    backward_needs = ("bottom",)        # every state it reads back is in its scratch

    def _param_shapes(self):
        G = 4 * self.H
        return [(G, self.D), (G,)] + [(G, self.Ds)] * self.static + [(G, self.H)]

    def setup(self, bottom_shapes):
        tops = super().setup(bottom_shapes)
        T, N, H = self.T, self.N, self.H
        # h_0..h_T, c_0..c_T and the activated gates i, f (times cont), o, g of every step
        self.scratch_specs = {"h": ((T + 1, N, H), None), "c": ((T + 1, N, H), None),
                              "gates": ((T, N, 4 * H), None)}
        self.backward_workspace_specs = {"dgates": ((T, N, 4 * H), None)}
        self.i_hc = 2 + self.static
        return tops

    def _forward(self, bottom, top, start):
        xp = array_module(bottom[0].data)
        w = [b.data for b in self.blobs]
        h, c, gates = self.scratch["h"], self.scratch["c"], self.scratch["gates"]
        h[0], c[0] = start
        self._x_terms(bottom, gates)
        cont = bottom[1].data
        w_hc = w[self.i_hc]
        for t in range(self.T):
            g = gates[t]
            g += (cont[t][:, None] * h[t]) @ w_hc.T
            lstm_unit_forward(xp, c[t], g, cont[t], c[t + 1], h[t + 1])
        top[0].data[...] = h[1:]
        if self.expose:
            top[1].data[...] = h[self.T]
            top[2].data[...] = c[self.T]
        return [h[self.T].copy(), c[self.T].copy()]

    def backward(self, top, propagate_down, bottom):
        _no_cont_backward(self, propagate_down, 1)
        xp = array_module(bottom[0].data)
        w = [b.data for b in self.blobs]
        h, c, gates = self.scratch["h"], self.scratch["c"], self.scratch["gates"]
        cont, dy = bottom[1].data, top[0].diff
        dgates = self.workspace["dgates"]
        w_hc = w[self.i_hc]
        dh_next = dc_next = None
        for t in range(self.T - 1, -1, -1):
            dh = dy[t] if dh_next is None else dy[t] + dh_next
            dc = xp.zeros_like(dh) if dc_next is None else dc_next
            dc_next = lstm_unit_backward(xp, c[t], gates[t], c[t + 1], dc, dh, dgates[t])
            gemm(dgates[t].T, cont[t][:, None] * h[t], self.blobs[self.i_hc].diff, beta=1.0)
            dh_next = cont[t][:, None] * (dgates[t] @ w_hc)
        self._x_backward(bottom, propagate_down, dgates)
        self._debug_backward(bottom)


def lstm_unit_forward(xp, c_prev, x, cont, c, h):
    """Caffe's LSTMUnit on one step: x (N, 4H) pre-activations i, f, o, g become the
    activations in place (f already times cont); c and h are written."""
    H = c_prev.shape[-1]
    i, f, o, g = (x[:, k * H:(k + 1) * H] for k in range(4))
    x[:, :3 * H] = _sigmoid(xp, x[:, :3 * H])
    f *= cont[:, None]                  # Caffe: f = cont == 0 ? 0 : cont * sigmoid(f')
    xp.tanh(g, out=g)
    c[...] = f * c_prev + i * g
    h[...] = o * xp.tanh(c)


def lstm_unit_backward(xp, c_prev, acts, c, dc, dh, dx):
    """Caffe's LSTMUnit backward from the activations ``acts`` (N, 4H): writes dx (N, 4H), returns dc_prev.

    As in Caffe, f's derivative is taken as f (1 - f) of the cont-scaled f, exact for cont in {0, 1}.
    """
    H = c_prev.shape[-1]
    i, f, o, g = (acts[:, k * H:(k + 1) * H] for k in range(4))
    tanh_c = xp.tanh(c)
    c_term = dc + dh * o * (1 - tanh_c * tanh_c)
    dx[:, :H] = c_term * g * i * (1 - i)
    dx[:, H:2 * H] = c_term * c_prev * f * (1 - f)
    dx[:, 2 * H:3 * H] = dh * tanh_c * o * (1 - o)
    dx[:, 3 * H:] = c_term * i * (1 - g * g)
    return c_term * f


@register
class LSTMUnit(Layer):
    """One LSTM step (Caffe's LSTMUnitLayer): bottoms c_prev (1, N, H), x (1, N, 4H), cont (1, N);
    tops c, h (1, N, H). No gradient to cont."""
    type = "LSTMUnit"
    exact_bottoms, exact_tops = 3, 2

    def allow_force_backward(self, bottom_index):
        return bottom_index != 2

    def setup(self, bottom_shapes):
        shapes = [tuple(s) for s in bottom_shapes]
        N = shapes[0][1] if len(shapes[0]) > 1 else None
        for i, s in enumerate(shapes):
            axes = 2 if i == 2 else 3
            if len(s) != axes or s[0] != 1 or s[1] != N:
                want = "(1, N)" if i == 2 else "(1, N, ...)"
                raise self.error(f"bottom[{i}] must have shape {want} with N = bottom[0].shape[1], got {s}")
        self.N, self.H = N, shapes[0][2]
        if shapes[1][2] != 4 * self.H:
            raise self.error(f"bottom[1] (gate inputs) must have 4 * {self.H} = {4 * self.H} channels, "
                             f"got {shapes[1][2]}")
        self.workspace_specs = {"acts": ((self.N, 4 * self.H), None)}
        return [shapes[0], shapes[0]]

    def forward(self, bottom, top):
        xp = array_module(bottom[0].data)
        acts = self.workspace["acts"]
        acts[...] = bottom[1].data.reshape(self.N, 4 * self.H)
        lstm_unit_forward(xp, bottom[0].data.reshape(self.N, self.H), acts, bottom[2].data.reshape(self.N),
                          top[0].data.reshape(self.N, self.H), top[1].data.reshape(self.N, self.H))

    def backward(self, top, propagate_down, bottom):
        _no_cont_backward(self, propagate_down, 2)
        if not (propagate_down[0] or propagate_down[1]):
            return
        xp = array_module(bottom[0].data)
        N, H = self.N, self.H
        acts = self.workspace["acts"]           # recomputed from x, as Caffe does
        acts[...] = bottom[1].data.reshape(N, 4 * H)
        c_prev = bottom[0].data.reshape(N, H)
        acts[:, :3 * H] = _sigmoid(xp, acts[:, :3 * H])
        acts[:, H:2 * H] *= bottom[2].data.reshape(N)[:, None]
        xp.tanh(acts[:, 3 * H:], out=acts[:, 3 * H:])
        dx = bottom[1].diff.reshape(N, 4 * H) if propagate_down[1] else xp.empty((N, 4 * H), acts.dtype)
        dc_prev = lstm_unit_backward(xp, c_prev, acts, top[0].data.reshape(N, H), top[0].diff.reshape(N, H),
                                     top[1].diff.reshape(N, H), dx)
        if propagate_down[0]:
            bottom[0].diff.reshape(N, H)[...] = dc_prev
