"""Run in a subprocess with 8 simulated CPU devices by tests/test_sharding.py (not collected by pytest)."""

import json
import shutil
import sys

import jax

from fox_jax.train import config as config_lib, loop


def main(corpus_dir: str, workroot: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    base = config_lib.apply_overrides(config_lib.preset("tiny"), [
        f"data.train={corpus_dir}", "data.seq_len=32", "model.n_layers=1", "model.d_model=32", "model.n_heads=4",
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

    # a checkpoint saved on one mesh restores onto another: a copy of the data=2,fsdp=4 run (checkpoints at
    # steps 3 and 6) continues from step 3 on data=2,fsdp=2,tensor=2
    shutil.copytree(f"{workroot}/fsdp", f"{workroot}/remesh")
    res = loop.train(config_lib.apply_overrides(base, ["mesh=data=2,fsdp=2,tensor=2"]), f"{workroot}/remesh",
                     resume=True, resume_step=3, progress=False)
    out["remesh"] = res.losses
    print("RESULT " + json.dumps({k: {str(s): v for s, v in d.items()} for k, d in out.items()}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
