"""The README's Python API snippet runs as written (with the tiny model instead of 125M, for speed)."""

from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_readme_python_snippet_runs():
    text = README.read_text()
    block = text.split("## Python API")[1].split("```python")[1].split("```")[0]
    assert 'preset("125M", "fox-llama", dtype="bfloat16")' in block
    namespace = {}
    exec(block.replace('preset("125M"', 'preset("tiny"'), namespace)
    assert namespace["logits"].shape == (2, 512, 50257)
    assert namespace["o"].shape == namespace["q"].shape
