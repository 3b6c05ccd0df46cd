"""Where the GPU code lives: the backend holds devices, streams, the kernel cache and launcher and
the cuDNN plumbing, and imports nothing from layers/; each layer family's GPU code sits beside its
CPU code (layers/*_gpu.py), which imports it, never the other way round (no import loop)."""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "sncaffe"


def imports(path):
    """Modules a file imports, relative ones resolved against the sncaffe package."""
    tree = ast.parse(path.read_text())
    parts = path.relative_to(PKG.parent).with_suffix("").parts[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(parts[:len(parts) - node.level + 1]) if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


@pytest.mark.parametrize("path", sorted((PKG / "backend").glob("*.py")), ids=lambda p: p.name)
def test_backend_imports_no_layer(path):
    assert not [m for m in imports(path) if m.startswith("sncaffe.layers")], path.name


@pytest.mark.parametrize("path", sorted((PKG / "layers").glob("*_gpu.py")), ids=lambda p: p.name)
def test_gpu_modules_do_not_import_their_cpu_layers(path):
    cpu_modules = {f"sncaffe.layers.{p.stem}" for p in (PKG / "layers").glob("*.py")
                   if not p.stem.endswith("_gpu") and p.stem != "base"}
    assert not imports(path) & cpu_modules, path.name


def test_no_module_named_cuda_ops_is_left():
    assert not (PKG / "backend" / "cuda_ops.py").exists()
    for path in PKG.rglob("*.py"):
        assert "cuda_ops" not in path.read_text(), path
