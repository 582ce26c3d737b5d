"""Run in a subprocess with 8 simulated CPU devices by tests/test_sharding.py (not collected by pytest)."""

import json
import sys

import jax
from _stopping_iterator import StoppingIterator

from fox_jax.train import config as config_lib, data as data_lib, loop


class _Died(Exception):
    pass


def _die():
    raise _Died()


def main(corpus_dir: str, workroot: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    base = config_lib.apply_overrides(config_lib.preset("tiny"), [
        f"data.train={corpus_dir}", "data.seq_len=32", "model.n_layers=2", "model.d_model=64", "model.n_heads=4",
        "model.attention_block=16", "steps=6", "batch_size=8", "log_every=1", "eval_every=0", "ckpt_every=3",
        "optim.warmup_steps=2", "async_checkpoints=false", "data.val_fraction=0.3", "eval_batches=1",
    ])
    out = {}
    for name, mesh in [("dp8", "data=8"), ("fsdp", "data=2,fsdp=4"), ("tp", "data=2,fsdp=2,tensor=2")]:
        cfg = config_lib.apply_overrides(base, [f"mesh={mesh}"])
        res = loop.train(cfg, f"{workroot}/{name}", progress=False)
        out[name] = res.losses
        out[name + "_sharded_params"] = {"n": sum(not x.sharding.is_fully_replicated
                                                  for x in jax.tree_util.tree_leaves(res.state.params))}

    # a checkpoint saved on one mesh restores onto another: the run dies after step 4 (checkpoint at 3)
    # on data=2,fsdp=4 and is resumed on data=2,fsdp=2,tensor=2
    real = data_lib.make_train_iterator

    def dying(*a, **kw):
        return StoppingIterator(real(*a, **kw), 4, _die)

    data_lib.make_train_iterator = dying
    try:
        loop.train(config_lib.apply_overrides(base, ["mesh=data=2,fsdp=4"]), f"{workroot}/remesh", progress=False)
    except _Died:
        pass
    data_lib.make_train_iterator = real
    res = loop.train(config_lib.apply_overrides(base, ["mesh=data=2,fsdp=2,tensor=2"]), f"{workroot}/remesh",
                        resume=True, progress=False)
    out["remesh"] = res.losses
    print("RESULT " + json.dumps({k: {str(s): v for s, v in d.items()} for k, d in out.items()}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
