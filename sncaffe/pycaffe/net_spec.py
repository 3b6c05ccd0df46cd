"""pycaffe's NetSpec: nets written as Python (``L.Convolution(n.data, num_output=20, ...)``).

``n = NetSpec(); n.data, n.label = L.Data(ntop=2, ...); n.conv1 = L.Convolution(n.data, ...)``
then ``n.to_proto()`` is a NetParameter, whose text (``str(...)``) Caffe and
sncaffe both read. Keyword arguments go to the layer's own ``<type>_param``
when that message has the field, else to LayerParameter (``param=[...]``,
``include=dict(phase=...)``, ``loss_weight``, ``propagate_down``); ``*_param``
keywords go to LayerParameter as given; dicts fill messages, lists of dicts
fill repeated messages. ``ntop`` sets the number of tops (0: none), ``in_place``
writes the top over the bottom. ``P.Pooling.MAX`` and the like are the enums.
"""
from __future__ import annotations

from collections import Counter, OrderedDict

from ..proto import sncaffe_pb2 as caffe_pb2


def param_name_dict():
    """Layer type -> the stem of its parameter field ("InnerProduct" -> "inner_product")."""
    out = {}
    for f in caffe_pb2.LayerParameter.DESCRIPTOR.fields:
        if f.name.endswith("_param") and f.message_type is not None and f.message_type.name.endswith("Parameter"):
            out[f.message_type.name[:-len("Parameter")]] = f.name[:-len("_param")]
    return out


_param_names = param_name_dict()


def to_proto(*tops):
    """The NetParameter of every layer the given tops depend on."""
    layers, autonames = OrderedDict(), Counter()
    for top in tops:
        top.fn._to_proto(layers, {}, autonames)
    net = caffe_pb2.NetParameter()
    net.layer.extend(layers.values())
    return net


def assign_proto(proto, name, val):
    """Set field ``name`` of ``proto`` from a value, list, dict or list of dicts."""
    field = getattr(proto, name)
    if hasattr(field, "extend") and not isinstance(val, (list, tuple)):
        val = [val]
    if isinstance(val, (list, tuple)):
        if val and isinstance(val[0], dict):
            for item in val:
                sub = field.add()
                for k, v in item.items():
                    assign_proto(sub, k, v)
        else:
            field.extend(val)
    elif isinstance(val, dict):
        for k, v in val.items():
            assign_proto(field, k, v)
    else:
        setattr(proto, name, val)


class Top:
    """One output of a layer function; its name comes from the NetSpec attribute it is assigned to."""

    def __init__(self, fn, n):
        self.fn, self.n = fn, n

    def to_proto(self):
        return to_proto(self)

    def _to_proto(self, layers, names, autonames):
        return self.fn._to_proto(layers, names, autonames)


class Function:
    """A layer: its type, bottoms (Tops) and parameters."""

    def __init__(self, type_name, inputs, params):
        self.type_name = type_name
        for i, inp in enumerate(inputs):
            if not isinstance(inp, Top):
                raise TypeError(f"{type_name} input {i} is not a Top (type is {type(inp)})")
        self.inputs = inputs
        self.params = dict(params)
        self.ntop = self.params.pop("ntop", 1)
        self.in_place = self.params.pop("in_place", False)
        self.tops = tuple(Top(self, n) for n in range(self.ntop))

    def _get_name(self, names, autonames):
        if self not in names and self.ntop > 0:
            names[self] = self._get_top_name(self.tops[0], names, autonames)
        elif self not in names:
            autonames[self.type_name] += 1
            names[self] = self.type_name + str(autonames[self.type_name])
        return names[self]

    def _get_top_name(self, top, names, autonames):
        if top not in names:
            autonames[top.fn.type_name] += 1
            names[top] = top.fn.type_name + str(autonames[top.fn.type_name])
        return names[top]

    def _to_proto(self, layers, names, autonames):
        if self in layers:
            return
        bottom_names = []
        for inp in self.inputs:
            inp._to_proto(layers, names, autonames)
            bottom_names.append(layers[inp.fn].top[inp.n])
        layer = caffe_pb2.LayerParameter(type=self.type_name)
        layer.bottom.extend(bottom_names)
        if self.in_place:
            layer.top.extend(layer.bottom)
        else:
            for top in self.tops:
                layer.top.append(self._get_top_name(top, names, autonames))
        layer.name = self._get_name(names, autonames)
        for k, v in self.params.items():
            stem = _param_names.get(self.type_name)
            if k.endswith("param") or stem is None:
                assign_proto(layer, k, v)
                continue
            own = getattr(layer, stem + "_param")
            if k in own.DESCRIPTOR.fields_by_name:
                assign_proto(own, k, v)
            elif k in layer.DESCRIPTOR.fields_by_name:
                assign_proto(layer, k, v)
            else:
                raise AttributeError(f'{self.type_name}: "{k}" is neither a field of {stem}_param '
                                     f"nor of LayerParameter")
        layers[self] = layer


class NetSpec:
    """Tops by name: ``n.conv1 = L.Convolution(...)`` names the layer and its top "conv1"."""

    def __init__(self):
        super().__setattr__("tops", OrderedDict())

    def __setattr__(self, name, value):
        self.tops[name] = value

    def __getattr__(self, name):
        try:
            return self.tops[name]
        except KeyError:
            raise AttributeError(name) from None

    __setitem__ = __setattr__

    def __getitem__(self, name):
        return self.tops[name]

    def __delitem__(self, name):
        del self.tops[name]

    def keys(self):
        return list(self.tops)

    def vals(self):
        return list(self.tops.values())

    def to_proto(self):
        names = {v: k for k, v in self.tops.items()}
        autonames, layers = Counter(), OrderedDict()
        for top in self.tops.values():
            top._to_proto(layers, names, autonames)
        net = caffe_pb2.NetParameter()
        net.layer.extend(layers.values())
        return net


class Layers:
    """``L.<Type>(*bottoms, **params)``: a Top, a tuple of Tops (ntop > 1) or the Function (ntop 0)."""

    def __getattr__(self, name):
        def layer_fn(*args, **kwargs):
            fn = Function(name, args, kwargs)
            if fn.ntop == 0:
                return fn
            return fn.tops[0] if fn.ntop == 1 else fn.tops
        return layer_fn


class Parameters:
    """``P.<Type>.<ENUM>``: the enum values of <Type>Parameter (``P.Pooling.MAX``)."""

    def __getattr__(self, name):
        message = getattr(caffe_pb2, name + "Parameter")

        class Param:
            def __getattr__(self, param_name):
                return getattr(message, param_name)
        return Param()


layers = Layers()
params = Parameters()
