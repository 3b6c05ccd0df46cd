"""Prototxt text to NetParameter / SolverParameter, and the net preparation Caffe does on load.

``load_net`` is the one place that parses a net: it reads the text (errors name
file, line, layer and field), upgrades the legacy net-level inputs to an Input
layer, keeps the layers whose NetStateRules match the phase/stage/level, and
inserts Split layers where a blob feeds several layers (Caffe's names).
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path

from google.protobuf import text_format

from . import blobproto
from .proto import sncaffe_pb2 as pb
from .upgrade import upgrade_net, upgrade_solver
from .validate import PrototxtError, located

TRAIN, TEST = pb.TRAIN, pb.TEST


def _phase(phase) -> int:
    if isinstance(phase, str):
        try:
            return {"TRAIN": TRAIN, "TEST": TEST}[phase.upper()]
        except KeyError:
            raise ValueError(f"phase must be TRAIN or TEST, not {phase!r}") from None
    return int(phase)


def _enclosing_layer(text: str, line: int) -> str | None:
    """Name of the top-level ``layer { }`` block that contains 1-based ``line``."""
    depth, layer_start, name = 0, None, None
    for lineno, raw in enumerate(text.splitlines()[:line], 1):
        code = re.sub(r'"(?:\\.|[^"\\])*"', '""', raw).split("#")[0]
        if depth == 0 and re.match(r"\s*layers?\s*:?\s*\{", code):
            layer_start, name = lineno, None
            m = re.search(r'\{\s*name\s*:\s*"([^"]*)"', raw)
            name = m.group(1) if m else None
        elif layer_start is not None and depth == 1 and name is None:
            m = re.match(r'\s*name\s*:\s*"([^"]*)"', raw)
            if m:
                name = m.group(1)
        depth += code.count("{") - code.count("}")
        if depth == 0 and lineno != line:
            layer_start = None
    if layer_start is None:
        return None
    if name is None:  # name may come after the error line
        rest = text.splitlines()[line:]
        for raw in rest:
            m = re.search(r'^\s*name\s*:\s*"([^"]*)"', raw)
            if m:
                return m.group(1)
            if raw.strip().startswith("}"):
                break
    return name


def _enum_values(full_name: str) -> list:
    try:
        return [v.name for v in pb.DESCRIPTOR.pool.FindEnumTypeByName(full_name).values]
    except KeyError:
        return []


def _field_before(text: str, line: int | None, column: int | None) -> str | None:
    """The field name written just before 1-based ``column`` of ``line``."""
    if not line or not column:
        return None
    rows = text.split("\n")
    m = re.search(r"(\w+)\s*:?\s*\S*$", rows[line - 1][:column - 1]) if line <= len(rows) else None
    return m.group(1) if m else None


def _explain(msg: str, text: str = "", line: int | None = None, column: int | None = None) -> str:
    msg = re.sub(r"^'.*?': (?=[A-Z])", "", msg, flags=re.S)        # protobuf quotes the whole line first
    m = re.match(r"Value out of range: (\S+)", msg)
    if m:
        name = _field_before(text, line, column)
        return (f'field "{name}": ' if name else "") + f"{m.group(1)} is out of range for its type"
    m = re.search(r'Message type "[\w.]*?(\w+)" has no field named "(\w+)"', msg)
    if m:
        if m.group(2) in ("layer", "layers") and m.group(1) != "NetParameter":
            opened = _open_block(text, line)
            where = f" (the block opened at line {opened} is not closed)" if opened else ""
            return f'a missing "}}" before this "{m.group(2)}"{where}'
        return f'unknown field "{m.group(2)}" (in {m.group(1)})'
    m = re.search(r'Enum type "([\w.]*?(\w+))" has no value named (\w+)(?: for field "(\w+)")?', msg)
    if m:
        valid = _enum_values(m.group(1))
        name = m.group(4) or _field_before(text, line, column)
        return ((f'field "{name}": ' if name else "") + f"{m.group(3)} is not a value of {m.group(2)}"
                + (f" (valid: {', '.join(valid)})" if valid else ""))
    m = re.search(r'Message type "[\w.]*?(\w+)" should not have multiple "(\w+)" fields', msg)
    if m:
        return f'field "{m.group(2)}" given more than once (in {m.group(1)})'
    return msg


def _code(raw: str) -> str:
    """A line without its strings and comment."""
    return re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', '""', raw).split("#")[0]


def _open_block(text: str, line: int | None) -> int | None:
    """The line of the outermost block still open before 1-based ``line`` (a missing "}")."""
    depth, start = 0, None
    for lineno, raw in enumerate(text.split("\n")[:(line or 1) - 1], 1):
        code = _code(raw)
        if depth == 0 and "{" in code:
            start = lineno
        depth += code.count("{") - code.count("}")
    return start if depth > 0 else None


_STRING = r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\''
_TOKENS = re.compile(rf'{_STRING}|#[^\n]*|[{{}}<>]|\blayers?\b|\b(name|type)\s*:\s*({_STRING})')


def layer_blocks(text: str, field: str = "layer") -> list:
    """[line, name, type] of each top-level ``field`` block (``layer``, or V1's ``layers``), in
    order: its 1-based line, and its quoted name and type where given (strings and comments
    skipped; several layers on one line, and ``<>`` blocks, counted right)."""
    out, depth, line, pos = [], 0, 1, 0
    for m in _TOKENS.finditer(text):
        tok = m.group()
        if tok == "{" or tok == "<":
            depth += 1
        elif tok == "}" or tok == ">":
            depth -= 1
        elif tok == field and depth == 0:
            line += text.count("\n", pos, m.start())
            pos = m.start()
            out.append([line, None, None])
        elif m.group(1) and depth == 1 and out:
            k = 2 if m.group(1) == "type" else 1
            if out[-1][k] is None:
                out[-1][k] = m.group(2)[1:-1]
    return out


def layer_lines(text: str, field: str = "layer") -> list:
    """The 1-based line of each top-level ``layer`` (or ``layers``) field, in order."""
    return [b[0] for b in layer_blocks(text, field)]


def _unsupported_at(text: str, line: int, filename: str) -> str | None:
    """The unsupported-types error where the parse error at ``line`` lies in a layer of a type
    sncaffe lacks (a fork's own parameter block): that type, not the field, is what to report."""
    from .layers import REGISTRY, unsupported
    blocks = layer_blocks(text)
    inside = [b for b in blocks if b[0] <= line]
    kind = inside[-1][2] if inside else None
    if kind is None or kind in REGISTRY:
        return None
    return unsupported.message(unsupported.missing((f"{filename}:{n}", name or "", t)
                                                   for n, name, t in blocks if t is not None))


def parse_text(text: str, message, filename: str = "<string>", upgrade: bool = False):
    """Parse prototxt ``text`` into ``message``; errors say file:line: layer "x": what.
    A NetParameter's layers remember their file:line (``defined_at``); ``upgrade``: a V0/V1 net
    is upgraded (as Caffe does on reading a file), its layers keeping their lines."""
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as e:
        line = getattr(e, "_line", None) or getattr(e, "line", None)
        msg = str(e)
        m = re.match(r"(\d+):(\d+) : (.*)", msg, re.S)
        column = None
        if m:
            line, column, msg = int(m.group(1)), int(m.group(2)), m.group(3)
        lacking = _unsupported_at(text, line, filename) if line and isinstance(message, pb.NetParameter) else None
        if lacking:
            raise PrototxtError(lacking) from None
        where = f"{filename}:{line}" if line else filename
        layer = _enclosing_layer(text, line) if line else None
        who = f' layer "{layer}":' if layer else ""
        raise PrototxtError(f"{where}:{who} {_explain(msg, text, line, column)}") from None
    except (ValueError, RecursionError) as e:      # protobuf's own checks (e.g. a message nested too deep)
        raise PrototxtError(f"{filename}: {' '.join(str(e).split()) or type(e).__name__}") from None
    if upgrade and isinstance(message, pb.NetParameter) and message.layers:
        from .upgrade import upgrade_net        # as Caffe, a V0/V1 net is upgraded as it is read,
        lines = layer_lines(text, "layers")     # here where its layers' lines are known
        message.CopyFrom(upgrade_net(message, filename))
    else:
        lines = layer_lines(text) if isinstance(message, pb.NetParameter) and message.layer else []
    if lines and len(lines) == len(message.layer):
        for lp, n in zip(message.layer, lines):
            lp.defined_at = f"{filename}:{n}"
    return message


def decode(data: bytes, path) -> str:
    """UTF-8 text of a prototxt; a bad byte is an error naming the file, line and byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise PrototxtError(f"{path}:{line}: byte 0x{data[e.start]:02x} is not UTF-8 text "
                            f"(a prototxt is UTF-8; was it saved in another encoding?)") from None


def read_text(path, message):
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PrototxtError(f"{path}: cannot read: {e.strerror}") from None
    return parse_text(decode(data, path), message, str(path), upgrade=True)


def read_solver(path) -> "pb.SolverParameter":
    return upgrade_solver(read_text(path, pb.SolverParameter()), str(path))


# -- net preparation (Caffe's Net::FilterNet, UpgradeNetInput, InsertSplits) --

def state_meets_rule(state, rule) -> bool:
    if rule.HasField("phase") and rule.phase != state.phase:
        return False
    if rule.HasField("min_level") and state.level < rule.min_level:
        return False
    if rule.HasField("max_level") and state.level > rule.max_level:
        return False
    stages = set(state.stage)
    return all(s in stages for s in rule.stage) and not any(s in stages for s in rule.not_stage)


def filter_net(param, phase=TRAIN, stages=(), level=None):
    """A copy of ``param`` with only the layers whose include/exclude rules match."""
    state = pb.NetState()
    state.CopyFrom(param.state)
    state.phase = _phase(phase)
    state.stage.extend(s for s in stages if s not in state.stage)
    if level is not None:
        state.level = level
    out = pb.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    for layer in param.layer:
        if layer.include and layer.exclude:
            raise PrototxtError(f'{located(layer)}layer "{layer.name}": specify include or exclude rules, not both')
        if layer.include:
            keep = any(state_meets_rule(state, r) for r in layer.include)
        else:
            keep = not any(state_meets_rule(state, r) for r in layer.exclude)
        if keep:
            out.layer.add().CopyFrom(layer)
    out.state.CopyFrom(state)
    return out


def _net_where(param) -> str:
    """ "file:" of a net read from a prototxt (its layers know it), else "net:"."""
    at = next((lp.defined_at for lp in param.layer if lp.defined_at), "")
    return at.rpartition(":")[0] + ":" if at else "net:"


def upgrade_inputs(param):
    """Net-level ``input``/``input_shape``/``input_dim`` become one Input layer named "input"."""
    if not param.input:
        return param
    if param.input_dim and param.input_shape:
        raise PrototxtError(f"{_net_where(param)} give input_shape or input_dim, not both")
    layer = pb.LayerParameter(name="input", type="Input")
    layer.top.extend(param.input)
    if param.input_shape:
        if len(param.input_shape) not in (1, len(param.input)):
            raise PrototxtError(f"{_net_where(param)} {len(param.input)} inputs but {len(param.input_shape)} input_shape")
        layer.input_param.shape.extend(param.input_shape)
    elif param.input_dim:
        if len(param.input_dim) != 4 * len(param.input):
            raise PrototxtError(f"{_net_where(param)} input_dim must give 4 values per input "
                                f"({len(param.input)} inputs, {len(param.input_dim)} values)")
        for i in range(len(param.input)):
            layer.input_param.shape.add().dim.extend(param.input_dim[4 * i:4 * i + 4])
    else:
        raise PrototxtError(f"{_net_where(param)} `input` given without input_shape or input_dim")
    out = pb.NetParameter()
    out.CopyFrom(param)
    del out.input[:], out.input_shape[:], out.input_dim[:], out.layer[:]
    out.layer.add().CopyFrom(layer)
    out.layer.extend(param.layer)
    return out


def split_layer_name(layer, blob, idx):
    return f"{blob}_{layer}_{idx}_split"


def split_blob_name(layer, blob, idx, k):
    return f"{blob}_{layer}_{idx}_split_{k}"


def insert_splits(param):
    """Caffe's InsertSplits: a Split layer after each top consumed more than once."""
    last_top: dict[str, tuple[int, int]] = {}
    source: dict[tuple[int, int], tuple[int, int]] = {}
    uses: dict[tuple[int, int], int] = defaultdict(int)
    loss_weight: dict[tuple[int, int], float] = {}
    for i, layer in enumerate(param.layer):
        for j, blob in enumerate(layer.bottom):
            if blob not in last_top:
                raise PrototxtError(f'{located(layer)}layer "{layer.name}" ({layer.type}): unknown bottom blob "{blob}"')
            source[i, j] = last_top[blob]
            uses[last_top[blob]] += 1
        for j, blob in enumerate(layer.top):
            last_top[blob] = (i, j)
        for j, w in enumerate(layer.loss_weight):
            if not math.isfinite(w):        # checked here: a Split would carry it on
                raise PrototxtError(f'{located(layer)}layer "{layer.name}" ({layer.type}): loss_weight[{j}] is '
                                    f"{w}; it must be a finite number")
            if w:
                loss_weight[i, j] = w
                uses[i, j] += 1
    out = pb.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    next_split: dict[tuple[int, int], int] = defaultdict(int)
    for i, layer in enumerate(param.layer):
        new = out.layer.add()
        new.CopyFrom(layer)
        for j, blob in enumerate(layer.bottom):
            src = source[i, j]
            if uses[src] > 1:
                new.bottom[j] = split_blob_name(param.layer[src[0]].name, blob, src[1], next_split[src])
                next_split[src] += 1
        for j, blob in enumerate(layer.top):
            n = uses[i, j]
            if n <= 1:
                continue
            split = out.layer.add(name=split_layer_name(layer.name, blob, j), type="Split",
                                  location=layer.location, defined_at=layer.defined_at)
            split.bottom.append(blob)
            split.top.extend(split_blob_name(layer.name, blob, j, k) for k in range(n))
            w = loss_weight.get((i, j), 0.0)
            if w:
                del new.loss_weight[:]
                split.loss_weight.extend([w] + [0.0] * (n - 1))
                next_split[i, j] += 1     # the split's first top carries the loss
    return out


def copy_layer_name(blob, location):
    return f"{blob}_to_{location}"


def insert_copies(param):
    """A Copy layer wherever a layer reads a blob produced at another location (Purine's
    model parallelism: the copy is an operator like any other, placed at the reader)."""
    where: dict[str, str] = {}
    made: dict[tuple, str] = {}        # (blob, location) -> its copy there, until the blob changes
    out = pb.NetParameter()
    out.CopyFrom(param)
    del out.layer[:]
    for layer in param.layer:
        new = pb.LayerParameter()
        new.CopyFrom(layer)
        for j, blob in enumerate(layer.bottom):
            src = where.get(blob, "")
            if src == layer.location:
                continue
            if blob in layer.top:
                raise PrototxtError(f'layer "{layer.name}" ({layer.type}) runs in place on "{blob}", which '
                                    f'is made at location "{src or "default"}", not at its own location '
                                    f'"{layer.location or "default"}"')
            name = made.get((blob, layer.location))
            if name is None:           # one copy per blob and location, however many readers
                name = made[blob, layer.location] = copy_layer_name(blob, layer.location or "default")
                copy = out.layer.add(name=name, type="Copy", location=layer.location)
                copy.bottom.append(blob)
                copy.top.append(name)
            new.bottom[j] = name
        out.layer.add().CopyFrom(new)
        for blob in layer.top:
            where[blob] = layer.location
            for key in [k for k in made if k[0] == blob]:
                del made[key]
    return out


def place(param, placement: dict):
    """A copy of ``param`` with ``placement[layer name]`` as each named layer's location."""
    out = pb.NetParameter()
    out.CopyFrom(param)
    names = {layer.name for layer in out.layer}
    unknown = sorted(set(placement) - names)
    if unknown:
        raise PrototxtError(f'placement names unknown layer "{unknown[0]}"')
    for layer in out.layer:
        if layer.name in placement:
            layer.location = placement[layer.name]
    return out


def prepare_net(param, phase=TRAIN, stages=(), level=None):
    """What Caffe's Net::Init does to a NetParameter before building it, and the Copy
    layers where a blob crosses locations."""
    net = filter_net(upgrade_inputs(upgrade_net(param)), phase, stages, level)
    if any(layer.location for layer in net.layer):
        net = insert_copies(net)
    return insert_splits(net)


def load_net(path, phase=TRAIN, stages=(), level=None):
    """Read a net prototxt and prepare it for ``phase`` (filter, inputs, splits)."""
    return prepare_net(upgrade_net(read_text(path, pb.NetParameter()), str(path)), phase, stages, level)


DATA_LAYERS = ("Data", "ImageData", "HDF5Data", "MemoryData", "WindowData")


def replace_data_layers(param, shapes: dict):
    """A copy of ``param`` whose data layers are Input layers giving ``shapes[top]``.

    How a user times or tests a train_val net without its dataset, as ``caffe
    time`` would need one; tops missing from ``shapes`` are an error.
    """
    out = pb.NetParameter()
    out.CopyFrom(param)
    for layer in out.layer:
        if layer.type not in DATA_LAYERS:
            continue
        missing = [t for t in layer.top if t not in shapes]
        if missing:
            raise PrototxtError(f'layer "{layer.name}" ({layer.type}): no input shape given for top "{missing[0]}"')
        new = pb.LayerParameter(name=layer.name, type="Input", top=layer.top)
        new.include.extend(layer.include)
        new.exclude.extend(layer.exclude)
        for t in layer.top:
            new.input_param.shape.add().dim.extend(int(d) for d in shapes[t])
        layer.CopyFrom(new)
    return out


def set_batch(param, n: int):
    """A copy of ``param`` with batch size ``n`` in every Input, DummyData and data layer."""
    out = pb.NetParameter()
    out.CopyFrom(upgrade_inputs(upgrade_net(param)))
    for layer in out.layer:
        if layer.type == "Input":
            for s in layer.input_param.shape:
                if s.dim:
                    s.dim[0] = n
        elif layer.type == "DummyData":
            for s in layer.dummy_data_param.shape:
                if s.dim:
                    s.dim[0] = n
            for i in range(len(layer.dummy_data_param.num)):
                layer.dummy_data_param.num[i] = n
        else:
            for field in ("data_param", "image_data_param", "hdf5_data_param", "memory_data_param",
                          "window_data_param"):
                if layer.HasField(field):
                    getattr(layer, field).batch_size = n
    return out


# -- `sncaffe upgrade` (Caffe's upgrade_net_proto_text and upgrade_net_proto_binary) ------------

def upgrade_file(path):
    """(the upgraded NetParameter with net-level inputs as an Input layer, whether ``path`` is binary).
    A .caffemodel (or any file that is not UTF-8 text) is read as binary."""
    path = Path(path)
    binary = path.suffix in (".caffemodel", ".binaryproto")
    if not binary:
        try:
            path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            binary = True
        except OSError as e:
            raise PrototxtError(f"{path}: cannot read: {e.strerror}") from None
    param = blobproto.read_caffemodel(path) if binary else upgrade_net(read_text(path, pb.NetParameter()), str(path))
    return upgrade_inputs(param), binary


def write_upgraded(param, out, binary) -> None:
    """Write ``param`` to ``out`` as Caffe's upgrade tools do: binary for a caffemodel, else text."""
    blobproto.write_atomic(out, param.SerializeToString() if binary else
                           text_format.MessageToString(param).encode())
