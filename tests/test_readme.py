"""README.md's Python code blocks run as a reader pastes them: in order, in
one namespace (a block may use what an earlier one made), from outside the
source tree.  A block that imports torch, transformers or ray runs where they are
installed."""
import importlib.util
import os
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
if not README.exists():  # a copy of the tests without the source tree
    pytest.skip("README.md is not beside tests/", allow_module_level=True)
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 1


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what a block writes lands here
    namespace = {"__name__": "readme"}
    for i, block in enumerate(BLOCKS):
        needs = [m for m in ("torch", "transformers", "ray") if re.search(rf"\bimport {m}\b", block)]
        if any(importlib.util.find_spec(m) is None for m in needs):
            continue
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as e:  # the block's text in the failure, to find it
            pytest.fail(f"README.md python block {i + 1} raised {type(e).__name__}: {e}\n{block}")
    assert "fastattn" in namespace and os.getcwd() == str(tmp_path)
