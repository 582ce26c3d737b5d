"""The installed package claims no generic top-level name: kernels/ and train/ install as fox_jax.kernels and
fox_jax.train, and the console script points into fox_jax."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import importlib.util, json
out = {}
for name in ("kernels", "train", "fox_jax.kernels", "fox_jax.train", "fox_jax.train.cli"):
    spec = importlib.util.find_spec(name)
    out[name] = None if spec is None else spec.origin
print(json.dumps(out))
"""


def test_no_generic_top_level_names(tmp_path):
    # Run outside the checkout, so the current directory does not put kernels/ or train/ on the path.
    res = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, check=True)
    found = json.loads(res.stdout)
    for generic in ("kernels", "train"):
        # Another distribution may own the name; ours must not resolve there.
        assert found[generic] is None or not found[generic].startswith(str(REPO)), (generic, found[generic])
    assert found["fox_jax.kernels"] == str(REPO / "kernels" / "__init__.py")
    assert found["fox_jax.train"] == str(REPO / "train" / "__init__.py")
    assert found["fox_jax.train.cli"] == str(REPO / "train" / "cli.py")


def test_console_script_targets_the_package():
    text = (REPO / "pyproject.toml").read_text()
    assert 'fox-jax = "fox_jax.train.cli:main"' in text
    assert (REPO / "fox_jax" / "py.typed").exists() and (REPO / "LICENSE").exists()
