"""README.md and docs/: every relative link names a file that exists, and every #anchor a heading of that file; the
family table sits between the markers scripts/families_table.py writes to."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _anchors(path: pathlib.Path) -> set:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_resolve(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        assert path.exists(), f"{doc.name}: link to {link}: no such file"
        if anchor:
            assert anchor in _anchors(path), f"{doc.name}: link to {link}: no such heading"


def test_family_table_has_its_markers():
    import importlib.util

    spec = importlib.util.spec_from_file_location("families_table", ROOT / "scripts" / "families_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    text = (ROOT / "docs" / "model-families.md").read_text()
    assert text.count(mod.START) == 1 and text.count(mod.END) == 1
    table = text[text.index(mod.START):text.index(mod.END)]
    assert "| model type | status | class / reason |" in table and "| `llama` | works |" in table
    assert mod.START not in (ROOT / "README.md").read_text()
