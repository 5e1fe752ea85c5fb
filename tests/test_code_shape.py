"""Unit sizes of the package (issue 32): a file holds one mechanism, a function reads on one screen.

Limits: no Python file under arkernels/ over MAX_FILE_LINES lines, no function or method over MAX_FUNCTION_LINES
lines of body (its docstring excluded). Each limit is checked by a test that must see a violation in a synthetic
module first, so a parser that measured nothing could not pass.
"""
import ast
import pathlib

import arkernels

PKG = pathlib.Path(arkernels.__file__).parent
MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 100


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the function's last line."""
    body = fn.body
    doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
        body[0].value.value, str)
    if doc and len(body) == 1:
        return 0
    return fn.end_lineno - body[1 if doc else 0].lineno + 1


def long_functions(source: str, name: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(node) > limit:
            out.append(f"{name}:{node.lineno} {node.name} ({_body_lines(node)} lines)")
    return out


def long_files(paths, limit: int = MAX_FILE_LINES) -> list[str]:
    return [f"{p} ({n} lines)" for p in paths if (n := len(p.read_text().splitlines())) > limit]


def test_the_measures_see_a_violation(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    fn = f'def f():\n    """doc\n    more doc"""\n{body}\n'
    assert long_functions(fn, "m") == []  # exactly the limit, docstring not counted
    assert long_functions(fn + "    return x0\n", "m") == [f"m:1 f ({MAX_FUNCTION_LINES + 1} lines)"]
    f = tmp_path / "big.py"
    f.write_text("x = 0\n" * MAX_FILE_LINES)
    assert long_files([f]) == []
    f.write_text("x = 0\n" * (MAX_FILE_LINES + 1))
    assert long_files([f]) == [f"{f} ({MAX_FILE_LINES + 1} lines)"]


def test_no_file_over_the_limit():
    assert long_files(sorted(PKG.rglob("*.py"))) == []


def test_no_function_over_the_limit():
    found = []
    for path in sorted(PKG.rglob("*.py")):
        found += long_functions(path.read_text(), str(path.relative_to(PKG.parent)))
    assert found == []
