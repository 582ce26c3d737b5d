"""Suite-wide setup: XLA:CPU at -O0, one XLA compilation cache per session, and a filter for orbax's
abandoned-read noise.

-O0: the suite's time is mostly XLA:CPU compiling small programs, and LLVM's optimisation passes are the
larger part of each compile. ``--xla_backend_optimization_level=0`` (XLA_FLAGS, inherited by the xdist
workers and the subprocesses, which append their device counts to it) halved the CPU time of
test_model/test_ops/test_pallas (555 -> 291 s, 2 cores, 2026-12-03). Every comparison of the suite is
against a reference computed under the same flags, with tolerances for a change of float32 summation
order. To run it as XLA compiles by default, set XLA_FLAGS yourself (e.g.
``XLA_FLAGS=--xla_backend_optimization_level=2``, LLVM's default): conftest leaves a set XLA_FLAGS alone.

Compilation cache: most of the suite's CPU time is XLA compiling small programs, many of them again and again
(every ``loop.train`` jits a fresh step function; each pytest-xdist worker and each subprocess of a test
compiles the same tiny models). JAX's persistent compilation cache turns the repeats into reads of the compiled
executable. The session gets a fresh temporary directory (so a run costs what CI pays, and no stale entry
survives), shared by the xdist workers and the subprocesses through ``JAX_COMPILATION_CACHE_DIR``; set that
variable yourself to keep a cache between runs. Executables are keyed by the HLO, the compile options, the
XLA flags and the backend, so a hit runs exactly what a compilation would have produced.
"""

import os
import shutil
import tempfile
import warnings

import pytest

if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_backend_optimization_level=0"

_OWN_CACHE = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _OWN_CACHE = tempfile.mkdtemp(prefix="fox_jax_test_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE  # inherited by xdist workers and subprocesses
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # small programs are the bulk here

import jax  # noqa: E402 (after the environment it reads)

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))

# orbax (0.12) reading a checkpoint whose arrays are damaged: the first failed read aborts the restore, and
# the other read tasks are abandoned on an event loop that orbax then closes. Their orbax wrapper turns the
# GeneratorExit of that teardown into an Exception and tensorstore's threads call back into the closed
# loop, so Python reports each abandoned task as an "Exception ignored in ..." traceback whenever it is
# collected (often long after the test that damaged the checkpoint, ~50 lines each). The tests that read
# damaged checkpoints assert the error fox_jax raises; these reports are orbax's teardown, not a result.
_ORBAX_NOISE = (r"Exception ignored in. <coroutine object _read_array_index_and_device_put",
                r"(?s)Exception ignored in. None.*in call_soon_threadsafe.*Event loop is closed")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # as ini filters: pytest applies them inside every warnings-catching context it opens (per test and for
    # the session); a warnings.filterwarnings call at import time is undone when the context that imported
    # this file closes. No ':' in the patterns: the ini syntax splits on it.
    for pattern in _ORBAX_NOISE:
        config.addinivalue_line("filterwarnings", f"ignore:{pattern}:pytest.PytestUnraisableExceptionWarning")


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config):
    # pytest collects the last unraisable reports in its own pytest_unconfigure, outside any of its
    # warnings-catching contexts: the process-wide filters apply there
    for pattern in _ORBAX_NOISE:
        warnings.filterwarnings("ignore", message=pattern, category=pytest.PytestUnraisableExceptionWarning)
    if _OWN_CACHE is not None:  # this process made it (the xdist controller, or a run without xdist)
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# The quick subset (-m "not slow"): besides the tests marked in the code, the measured slow ones of tests/slow.txt
_SLOW_LIST = os.path.join(os.path.dirname(__file__), "slow.txt")


# The heaviest files first (worker-seconds of the 2-core -O0 suite, 2026-12-03, largest first): with
# ``--dist loadfile`` each file runs on one worker, in collection order, so a heavy file dealt last (test_train,
# alphabetically near the end) keeps one worker busy while the other idles. Longest first, the tail is a small
# file. Files not listed keep their order after these.
_HEAVY_FIRST = ("test_decoding.py", "test_finetune_dcp.py", "test_pallas.py", "test_train.py", "test_sharding.py",
                "test_sharded_decoding.py", "test_ops.py", "test_dcp_pallas.py", "test_dcp_eval.py", "test_model.py",
                "test_dcp_lm.py", "test_zeroshot.py")


def pytest_collection_modifyitems(config, items):
    with open(_SLOW_LIST) as f:
        listed = {line.strip() for line in f if line.strip() and not line.startswith("#")}
    for item in items:
        if item.nodeid.removeprefix("tests/") in listed:
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(_HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the order within a file is kept
