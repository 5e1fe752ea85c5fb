"""The package's import graph and its op table.

Import cycles inside arkernels/ are found by parsing every module with ``ast``: module-level and function-level
imports both count (a lazy import inside a function is still a dependency, only a later one). ``_library.OPS``
must name exactly the ``arkernels::`` ops the extension registers.
"""
import ast
import pathlib
import re

import pytest
import torch

import arkernels
from arkernels import _library

PKG = pathlib.Path(arkernels.__file__).parent
BINDINGS = PKG.parent / "csrc" / "torch_bindings.cpp"

def _modules() -> dict:
    """{dotted name: path} of every module under arkernels/ (a compiled one, _C, with no path: it imports nothing)."""
    out = {"arkernels._C": None}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict) -> set:
    """The arkernels modules `name` imports anywhere in its file (a package's parents, which Python runs first, are
    not counted: every module would otherwise close a circle through arkernels/__init__.py)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            found.update(subs)
            if len(subs) < len(node.names):  # a name defined by the module `base` itself
                found.add(base)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict:
    modules = _modules()
    return {name: _imports(name, path, modules) if path else set() for name, path in modules.items()}


def _cycles(graph: dict) -> list:
    """The strongly connected components with more than one module (Tarjan), each a sorted list."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_import_graph_sees_the_package():
    graph = _graph()
    # a parser that resolves nothing finds no cycles either: pin a few edges it must see
    assert "arkernels._library" in graph["arkernels.ops.paged_kv"]
    assert "arkernels.ops" in graph["arkernels"]  # from arkernels.ops import kernels_report
    assert "arkernels._library" in graph["arkernels.ops"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_no_private_name_crosses_a_module():
    """A name with a leading underscore is its module's own: another module that needs it gets a public name. Private
    modules (``_library``, ``_C``: loaded for their side effect) and aliases (``as _tk``) are not names."""
    found = set()
    for name, path in _modules().items():
        if path is None:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("arkernels"):
                for a in node.names:
                    if a.name.startswith("_") and f"{node.module}.{a.name}" not in _modules():
                        found.add((name, a.name))
    assert found == set()  # (importing module, name): none (issue 32: no private name crosses a file)


def test_library_ops_are_the_registered_schemas():
    registered = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("arkernels::")}
    defined = re.findall(r'm\.def\(\s*"(\w+)\(', BINDINGS.read_text())
    assert len(defined) == len(set(defined))
    assert set(_library.OPS) == set(defined) == registered
    assert len(_library.OPS) == len(set(_library.OPS))


def test_kernels_report_covers_every_op():
    report = arkernels.kernels_report()
    assert list(report) == list(_library.OPS)
    assert all("CPU" in keys for keys in report.values()), report
