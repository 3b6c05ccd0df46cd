"""The documentation: the benchmarks page matches its data, the MkDocs site builds with every link
checked, and the tree speaks of the project only (no process words, no timings in comments)."""
import ast
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tokenize

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import render_benchmarks  # noqa: E402

# Words of the project's own making: "stop N", issue numbers, times of day.
PROCESS = re.compile(r"\bstops? [0-9]+|\bissues? [0-9]+|\b[0-9]{2}:[0-9]{2} UTC", re.IGNORECASE)
# A commit hash in prose: 7 to 12 hex digits with a letter and a digit, not part of a number.
HASH = re.compile(r"(?<![\w.+-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}(?![\w+-])")
MILLISECONDS = re.compile(r"[0-9](\.[0-9]+)?\s?ms\b")
SKIP_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", "site", "build", "dist", "out", ".whl"}
# Real Caffe's files: their READMEs name the BVLC Caffe commit they were computed with (a source's
# identity, not the project's history), so hashes are allowed there and nowhere else.
EXTERNAL = ROOT / "tests" / "data" / "shared"


def text_files():
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if not path.is_file() or SKIP_DIRS & set(rel.parts) or rel.parts[0].endswith(".egg-info"):
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue
        try:
            yield rel, data.decode("utf-8")
        except UnicodeDecodeError:
            continue


def comments_and_docstrings(text):
    """(line, text) of every comment and docstring of a Python module."""
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body:
                yield node.body[0].lineno, doc


def process_words():
    found = []
    for rel, text in text_files():
        for n, line in enumerate(text.splitlines(), 1):
            if PROCESS.search(line) or (HASH.search(line) and EXTERNAL not in (ROOT / rel).parents):
                found.append(f"{rel}:{n}: {line.strip()[:100]}")
    return found


def timings_in_comments():
    found = []
    for rel, text in text_files():
        if rel.suffix == ".py" and MILLISECONDS.search(text):     # parse only where a figure may be
            for n, chunk in comments_and_docstrings(text):
                if MILLISECONDS.search(chunk):
                    found.append(f"{rel}:{n}: {chunk.strip().splitlines()[0][:100]}")
    return found


def test_benchmarks_page_is_rendered_from_its_data():
    assert (ROOT / "docs" / "benchmarks.md").read_text() == render_benchmarks.render(), \
        "docs/benchmarks.md is out of date: run python tools/render_benchmarks.py"


def test_benchmark_result_files_name_command_and_machine(tmp_path):
    (tmp_path / "bad.json").write_text('{"title": "t", "question": "q", "columns": ["a"], "rows": [["1"]]}')
    with pytest.raises(SystemExit, match=r"bad\.json: missing field\(s\) command, machine, threads"):
        render_benchmarks.render(tmp_path)


def test_a_benchmark_run_writes_a_result_file_the_page_renders(tmp_path):
    """tools/tables.py records what a benchmark prints, with its command and machine."""
    out = tmp_path / "run.json"
    script = tmp_path / "bench_toy.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(ROOT / 'tools')!r})\n"
                      "from tables import table\n"
                      "table([['lenet', 1.5], ['resnet', 2]], ['net', 's'])\n")
    env = {**os.environ, "SNCAFFE_BENCH_RESULTS": str(out), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(script), "--fast"], env=env, check=True, capture_output=True, timeout=60)
    data = json.loads(out.read_text())
    assert data["command"] == "python tools/bench_toy.py --fast" and "OMP_NUM_THREADS=1" in data["threads"]
    assert data["tables"] == [{"columns": ["net", "s"], "rows": [["lenet", "1.5"], ["resnet", "2"]]}]
    page = render_benchmarks.render(tmp_path)
    assert "`python tools/bench_toy.py --fast` (machine: " in page and "| lenet | 1.5 |" in page


def test_mkdocs_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="MkDocs is not installed (pip install -e '.[test]')")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                        "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_mkdocs_strict_fails_on_a_broken_link(tmp_path):
    pytest.importorskip("mkdocs", reason="MkDocs is not installed (pip install -e '.[test]')")
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    (docs / "index.md").write_text((docs / "index.md").read_text() + "\n[gone](no-such-page.md)\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text((ROOT / "mkdocs.yml").read_text())
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                        "--site-dir", str(tmp_path / "site")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no-such-page.md" in r.stdout + r.stderr


def test_the_tree_speaks_of_the_project_only():
    found = process_words()
    assert not found, "\n".join(found)


def test_no_comment_quotes_milliseconds():
    """A comment says why; figures live in benchmarks/results/ and the comment names the tool."""
    found = timings_in_comments()
    assert not found, "\n".join(found)


def test_the_command_line_page_says_what_help_says():
    """docs/cli.md's usage and argument tables are the parser's (tools/render_cli_docs.py)."""
    import render_cli_docs
    assert render_cli_docs.render() == (ROOT / "docs" / "cli.md").read_text(), \
        "docs/cli.md differs from --help: run python tools/render_cli_docs.py"
