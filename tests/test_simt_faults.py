"""scripts/simt_faults.py's table against the sources: every fault finds its `// FAULT(site)` marker once and its text
in the lines just below it, and every marker in csrc/ is some fault's site (no build: the faults themselves run in
scripts/simt_faults.py)."""
import importlib.util
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("simt_faults", ROOT / "scripts" / "simt_faults.py")
simt_faults = importlib.util.module_from_spec(_spec)
sys.modules["simt_faults"] = simt_faults
_spec.loader.exec_module(simt_faults)


@pytest.mark.parametrize("fault", simt_faults.FAULTS, ids=lambda f: f.name)
def test_fault_applies_at_its_marker(fault, tmp_path):
    src = tmp_path / "csrc"
    path = src / fault.file
    path.parent.mkdir(parents=True)
    text = (ROOT / "csrc" / fault.file).read_text()
    path.write_text(text)
    simt_faults._apply(fault)(str(src))
    faulted = path.read_text()
    assert faulted != text
    i = simt_faults._site(text, fault)
    assert faulted == text[:i] + fault.replace + text[i + len(fault.find):]


def test_every_marker_is_a_site():
    markers = {m for p in (ROOT / "csrc").rglob("*") if p.is_file()
               for m in re.findall(r"^[ \t]*// FAULT\((\w+)\)", p.read_text(errors="replace"), re.M)}
    assert markers == {f.site for f in simt_faults.FAULTS}


def test_a_missing_marker_is_refused():
    fault = simt_faults.FAULTS[0]
    with pytest.raises(ValueError, match="occurs 0 times"):
        simt_faults._site("no marker here\n" + fault.find, fault)
