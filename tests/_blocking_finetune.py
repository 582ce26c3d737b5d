"""Run in a subprocess by tests/test_finetune_dcp.py (not collected by pytest): ``python _blocking_finetune.py N
ARGV...`` runs ``fox-jax ARGV`` with a training-data iterator that blocks forever instead of returning batch
N + 1, so the test can SIGKILL the process at a known point between two checkpoints."""

import sys
import time

from _stopping_iterator import StoppingIterator

from fox_jax.train import cli, data as data_lib


if __name__ == "__main__":
    real = data_lib.make_train_iterator
    data_lib.make_train_iterator = lambda *a, **kw: StoppingIterator(real(*a, **kw), int(sys.argv[1]),
                                                                     lambda: time.sleep(3600))
    sys.exit(cli.main(sys.argv[2:]))
