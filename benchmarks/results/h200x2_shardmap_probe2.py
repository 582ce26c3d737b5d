# Round-2 probes of the shard_map segfault (2 x H200, jax 0.11.2; log: h200x2_shardmap_probe2.log):
# the crash is in the Shardy partitioner (last HLO pass dumped: spmd-partitioner before shardy-xla), also
# with both backward kernels stubbed; JAX_USE_SHARDY_PARTITIONER=false (GSPMD) compiles and runs it.
# Second round of shard_map segfault probes (2 x H200, jax 0.11.2). Usage: python probe2.py MODE
import faulthandler, os, sys
faulthandler.enable()
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from fox_jax.sharding import make_mesh
from fox_jax.ops import forgetting_attention
from fox_jax.ops import sharded_attention
from fox_jax.sharding import shard_map as _shard_map
import kernels.forgetting_attention as fa

mode = sys.argv[1]
n = int(os.environ.get("PROBE_MESH", "2"))
mesh = make_mesh(f"data={n}")
B, T, H, D = 4, int(os.environ.get("PROBE_T", "1024")), 8, 64
r = np.random.default_rng(0)
sh = NamedSharding(mesh, P("data"))
q, k, v = (jax.device_put(jnp.asarray(r.standard_normal((B, T, H, D)), jnp.bfloat16), sh) for _ in range(3))
lf = jax.device_put(jnp.asarray(-r.uniform(0, 0.1, (B, T, H)), jnp.float32), sh)
spec, gspec = P("data", None, None, None), P("data", None, None)
print("start", mode, n, jax.devices(), "shardy", jax.config.jax_use_shardy_partitioner, flush=True)


def grad_of(fn):
    return jax.jit(jax.grad(lambda q, k, v, lf: jnp.sum(fn(q, k, v, lf).astype(jnp.float32)), argnums=(0, 3)))


if mode == "explicit":
    g = grad_of(sharded_attention(mesh, batch_axis="data", head_axis="tensor"))
elif mode == "fwd_lse":  # forward kernel with both outputs (o, lse) leaving the shard_map
    cfg = fa.resolve_tiles(fa.default_config(D), T, T)

    def f(q, k, v, lf):
        lam = jnp.cumsum(lf, axis=1)
        return fa.attention_forward(q, k, v, lam, jnp.zeros((q.shape[0],), jnp.int32), None, None,
                                    scale=D ** -0.5, config=cfg, interpret=jax.default_backend() != "gpu")
    g = jax.jit(_shard_map(f, mesh, (spec, spec, spec, gspec), (spec, gspec)))
elif mode == "fwd_lse_used":  # lse consumed inside the body
    cfg = fa.resolve_tiles(fa.default_config(D), T, T)

    def f(q, k, v, lf):
        lam = jnp.cumsum(lf, axis=1)
        o, lse = fa.attention_forward(q, k, v, lam, jnp.zeros((q.shape[0],), jnp.int32), None, None,
                                      scale=D ** -0.5, config=cfg, interpret=jax.default_backend() != "gpu")
        return o.astype(jnp.float32) + lse.transpose(0, 2, 1)[..., None]
    g = jax.jit(_shard_map(f, mesh, (spec, spec, spec, gspec), spec))
elif mode == "both_stub":
    fa.flash_backward_dkv = lambda qp, kp, vp, dop, lam_q, lam_k, lse2, delta, *a, **kw: (
        jnp.zeros(kp.shape[:2] + (qp.shape[2], kp.shape[3]), jnp.float32) + delta.sum(),
        jnp.zeros(kp.shape[:2] + (qp.shape[2], kp.shape[3]), jnp.float32) + lse2.sum(),
        jnp.zeros(lam_k.shape, jnp.float32))
    fa.flash_backward_dq = lambda qp, kp, vp, dop, lam_q, lam_k, *a, **kw: (
        jnp.zeros(qp.shape, jnp.float32), jnp.zeros(lam_q.shape, jnp.float32))
    g = grad_of(sharded_attention(mesh, batch_axis="data", head_axis="tensor"))
elif mode == "small_tiles":
    small = fa.TileConfig(32, 32, 4, 1)
    cfg = fa.KernelConfig(fwd=fa.TileConfig(64, 32, 4, 1), dq=small, dkv=small)
    g = grad_of(sharded_attention(mesh, batch_axis="data", head_axis="tensor", kernel_config=cfg))
elif mode == "check":  # sharded (current partitioner) vs one-device Pallas, values and gradients
    fn = sharded_attention(mesh, batch_axis="data", head_axis="tensor")
    loss = lambda f: (lambda q, k, v, lf: jnp.sum(jnp.cos(f(q, k, v, lf).astype(jnp.float32))))
    gs = jax.jit(jax.value_and_grad(loss(fn), argnums=(0, 1, 2, 3)))(q, k, v, lf)
    one = lambda q, k, v, lf: forgetting_attention(q, k, v, lf, implementation="pallas")
    dev0 = jax.devices()[0]
    g1 = jax.jit(jax.value_and_grad(loss(one), argnums=(0, 1, 2, 3)))(*(jax.device_put(x, dev0) for x in (q, k, v, lf)))
    la, lb = jax.tree_util.tree_leaves(gs), jax.tree_util.tree_leaves(g1)
    errs = [float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jax.device_put(jnp.asarray(b, jnp.float32), a.sharding if hasattr(a, "sharding") else None)))) for a, b in zip(la, lb)]
    print("CHECK max_abs_err (loss, dq, dk, dv, dlf):", errs, "bitwise:", [bool(jnp.array_equal(jnp.asarray(a), jax.device_put(jnp.asarray(b), a.sharding))) for a, b in zip(la, lb)], flush=True)
    raise SystemExit(0)
print("lowering", flush=True)
out = g(q, k, v, lf)
jax.block_until_ready(out)
print("OK", mode, flush=True)
