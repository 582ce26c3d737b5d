"""``fox_jax.call_site``: a warning raised deep inside a library names the user's line, through the library's
frames and through a jax trace (a stand-in library in a temporary directory plays fox_jax's part; the
warnings of fox_jax itself: test_generate_cli.py)."""

import importlib.util
import os
import sys
import warnings

import pytest

from fox_jax.call_site import caller_stacklevel, skipped_prefixes

LIBRARY = '''
import warnings

import jax

from fox_jax.call_site import caller_stacklevel, warn_at_caller


class LibWarning(UserWarning):
    pass


def check(skip):
    warnings.warn("deep", LibWarning, stacklevel=caller_stacklevel(skip))


def middle(skip):
    return [check(skip) for _ in range(1)]  # a comprehension: one more frame (before Python 3.12)


def entry(skip):
    return middle(skip)


def through_jit(skip):
    return jax.jit(lambda x: (middle(skip), x + 1)[1])(1)  # warns while jax traces


def helper(skip):
    warn_at_caller("deep", LibWarning, skip=skip)
'''


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake_library")
    path = root / "fake_library.py"
    path.write_text(LIBRARY)
    spec = importlib.util.spec_from_file_location("fake_library", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, skipped_prefixes() + (str(root) + os.sep,)


def _one(record, category):
    hits = [w for w in record if issubclass(w.category, category)]
    assert len(hits) == 1, [str(w.message) for w in record]
    return hits[0]


def test_the_warning_names_the_callers_line(lib):
    module, skip = lib
    for call in (module.entry, module.through_jit, module.helper):
        with pytest.warns(module.LibWarning) as record:
            line = sys._getframe().f_lineno + 1
            call(skip)
        w = _one(record, module.LibWarning)
        assert (w.filename, w.lineno) == (__file__, line), call.__name__
    with pytest.warns(module.LibWarning) as record:  # the library not skipped: its own line, as stacklevel=1
        module.entry(skipped_prefixes())
    assert _one(record, module.LibWarning).filename == module.__file__


def test_skipped_prefixes_hold_fox_jax_and_jax():
    import jax

    import fox_jax

    prefixes = skipped_prefixes()
    assert os.path.dirname(os.path.abspath(fox_jax.__file__)) + os.sep in prefixes
    assert os.path.dirname(os.path.abspath(jax.__file__)) + os.sep in prefixes
    assert not __file__.startswith(prefixes)


def test_past_the_stack_names_sys():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        warnings.warn("x", UserWarning, stacklevel=caller_stacklevel(("",)))  # every frame skipped
    assert record[0].filename == "sys"
