"""docs/PYTHON.md's worked example runs as written, against a real kvpoold."""

from __future__ import annotations

import re

from conftest import REPO, require_module


def test_worked_example(kvpoold):
    require_module("numpy", "pip install numpy")
    doc = (REPO / "docs" / "PYTHON.md").read_text()
    section = doc[doc.index("## Worked example") :]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    assert "tcp://127.0.0.1:7370" in code
    example = compile(
        code.replace("tcp://127.0.0.1:7370", kvpoold.url), "PYTHON.md", "exec"
    )
    exec(example, {})  # noqa: S102 (the doc's own example, run as written)
