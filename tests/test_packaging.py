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
    # fox_jax/kernels and fox_jax/train are links to the top-level folders (so a checkout that is not
    # installed imports them too); either way the files are the top-level ones.
    assert Path(found["fox_jax.kernels"]).resolve() == REPO / "kernels" / "__init__.py"
    assert Path(found["fox_jax.train"]).resolve() == REPO / "train" / "__init__.py"
    assert Path(found["fox_jax.train.cli"]).resolve() == REPO / "train" / "cli.py"


def test_checkout_imports_without_install(tmp_path):
    # PYTHONPATH=<checkout> alone (no install, e.g. a GPU machine that gets the source tree): the package's
    # kernels and programs import through the links fox_jax/kernels and fox_jax/train.
    code = "import fox_jax.kernels.forgetting_attention, fox_jax.train.commands; print(fox_jax.kernels.__file__)"
    # -S: no site processing, so no editable-install finder; the dependencies' folders are added as plain paths.
    site_dirs = [p for p in sys.path if p.endswith("site-packages")]
    setup = f"import sys; sys.path[:0] = [{str(REPO)!r}]; sys.path += {site_dirs!r}; "
    res = subprocess.run([sys.executable, "-S", "-c", setup + code], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()).resolve() == REPO / "kernels" / "__init__.py"


def test_console_script_targets_the_package():
    text = (REPO / "pyproject.toml").read_text()
    assert 'fox-jax = "fox_jax.train.cli:main"' in text
    assert (REPO / "fox_jax" / "py.typed").exists() and (REPO / "LICENSE").exists()
