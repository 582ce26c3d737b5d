# Record of the probe run on the 2-GPU machine (jax 0.11.2) to find what crashes XLA when the Pallas
# kernels run inside shard_map; results in h200x2_shardmap_segfault_probe.log and benchmarks/NOTES.md.
# Usage (2 GPUs): python benchmarks/results/h200x2_shardmap_probe.py MODE
import faulthandler, sys
faulthandler.enable()
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from fox_jax.sharding import make_mesh, under_mesh
from fox_jax.ops import forgetting_attention
from fox_jax.ops import sharded_attention

mode = sys.argv[1]
mesh = make_mesh("data=2")
B, T, H, D = 4, 1024, 8, 64
r = np.random.default_rng(0)
sh = NamedSharding(mesh, P("data"))
q, k, v = (jax.device_put(jnp.asarray(r.standard_normal((B, T, H, D)), jnp.bfloat16), sh) for _ in range(3))
lf = jax.device_put(jnp.asarray(-r.uniform(0, 0.1, (B, T, H)), jnp.float32), sh)
print("start", mode, jax.devices(), flush=True)
if mode == "explicit":
    fn = sharded_attention(mesh, batch_axis="data", head_axis="tensor")
    g = jax.jit(jax.grad(lambda q, k, v, lf: jnp.sum(fn(q, k, v, lf).astype(jnp.float32)), argnums=(0, 3)))
elif mode == "explicit_fwd":
    fn = sharded_attention(mesh, batch_axis="data", head_axis="tensor")
    g = jax.jit(fn)
elif mode == "vjp_inside":
    from fox_jax.sharding import shard_map as _shard_map
    spec, gspec = P("data", None, None, None), P("data", None, None)

    def local(q, k, v, lf, do):
        f = lambda q, k, v, lf: forgetting_attention(q, k, v, lf, implementation="pallas")
        return jax.vjp(f, q, k, v, lf)[1](do)
    sm = jax.jit(_shard_map(local, mesh, (spec, spec, spec, gspec, spec), (spec, spec, spec, gspec)))
    g = lambda q, k, v, lf: sm(q, k, v, lf, q)
elif mode in ("dq_only", "dkv_only"):
    import kernels.forgetting_attention as fa
    if mode == "dq_only":
        fa.flash_backward_dkv = lambda qp, kp, vp, dop, lam_q, lam_k, *a, **kw: (
            jnp.zeros(kp.shape[:2] + (qp.shape[2], kp.shape[3]), jnp.float32),
            jnp.zeros(kp.shape[:2] + (qp.shape[2], kp.shape[3]), jnp.float32), jnp.zeros(lam_k.shape, jnp.float32))
    else:
        fa.flash_backward_dq = lambda qp, kp, vp, dop, lam_q, lam_k, *a, **kw: (
            jnp.zeros(qp.shape, jnp.float32), jnp.zeros(lam_q.shape, jnp.float32))
    fn = sharded_attention(mesh, batch_axis="data", head_axis="tensor")
    g = jax.jit(jax.grad(lambda q, k, v, lf: jnp.sum(fn(q, k, v, lf).astype(jnp.float32)), argnums=(0, 3)))
elif mode in ("fwd_twice", "fwd_separate"):
    from fox_jax.sharding import shard_map as _shard_map
    from kernels.forgetting_attention import KernelConfig, TileConfig, default_config
    import dataclasses
    spec, gspec = P("data", None, None, None), P("data", None, None)
    c1 = default_config(D)
    c2 = dataclasses.replace(c1, fwd=dataclasses.replace(c1.fwd, block_k=32))
    f1 = lambda q, k, v, lf: forgetting_attention(q, k, v, lf, implementation="pallas", kernel_config=c1)
    f2 = lambda q, k, v, lf: forgetting_attention(q, k, v, lf, implementation="pallas", kernel_config=c2)
    if mode == "fwd_twice":
        g = jax.jit(_shard_map(lambda *a: f1(*a) + f2(*a), mesh, (spec, spec, spec, gspec), spec))
    else:
        s1 = _shard_map(f1, mesh, (spec, spec, spec, gspec), spec)
        s2 = _shard_map(f2, mesh, (spec, spec, spec, gspec), spec)
        g = jax.jit(lambda *a: s1(*a) + s2(*a))
elif mode == "ambient":
    g = under_mesh(mesh, jax.jit(jax.grad(lambda q, k, v, lf: jnp.sum(
        forgetting_attention(q, k, v, lf, implementation="pallas").astype(jnp.float32)), argnums=(0, 3))))
elif mode == "ambient_fwd":
    g = under_mesh(mesh, jax.jit(lambda q, k, v, lf: forgetting_attention(q, k, v, lf, implementation="pallas")))
elif mode == "setmesh_xla":
    g = under_mesh(mesh, jax.jit(jax.grad(lambda q, k, v, lf: jnp.sum(
        forgetting_attention(q, k, v, lf, implementation="xla").astype(jnp.float32)), argnums=(0, 3))))
print("lowering", flush=True)
out = g(q, k, v, lf)
jax.block_until_ready(out)
print("OK", mode, flush=True)
