"""The package's shape: imports run one way (no cycle between modules or between folders), and
the planner is pure (it imports nothing of the runtime, the devices or threads)."""
import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "sncaffe"


def _modules():
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


MODULES = _modules()


# Imported inside a method, as an optional extra: Net.to_onnx and to_torch reach the exporters,
# which need onnx or torch, only when called.
OPTIONAL = ("sncaffe.export",)


def _imports(name, path):
    """The sncaffe modules ``name`` imports, anywhere in its file (a function's imports too, but
    an optional extra's)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f)}
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "sncaffe")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "sncaffe":
                continue
            if id(node) in inner and module.startswith(OPTIONAL) and not name.startswith(OPTIONAL):
                continue
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                out.add(sub if sub in MODULES else module)
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(graph):
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def _folder(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else module


def _package_parents(module):
    """A module's own package __init__s, which Python runs first: not an edge of the design."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_no_import_cycle_between_modules():
    assert _cycles(GRAPH) == []


def test_no_import_cycle_between_folders():
    folders = {}
    for a, targets in GRAPH.items():
        for b in targets - _package_parents(a):
            fa, fb = _folder(a), _folder(b)
            if fa != fb and fa != "sncaffe" and fb != "sncaffe":
                folders.setdefault(fa, set()).add(fb)
    assert _cycles(folders) == []


def test_the_planner_imports_nothing_of_the_runtime():
    allowed = {"sncaffe.sizes", "sncaffe.tensor", "sncaffe"}
    for name, targets in GRAPH.items():
        if name.startswith("sncaffe.plan"):
            foreign = {t for t in targets if not t.startswith("sncaffe.plan") and t not in allowed}
            assert not foreign, f"{name} imports {sorted(foreign)}"
            source = MODULES[name].read_text()
            assert "import threading" not in source and "_thread" not in source, name


def test_the_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
