"""Device meshes and the mapping from logical axis names to mesh axes.

Model code never names mesh axes. The mesh has three axes, ``data``, ``fsdp`` and ``tensor``; by
default every device sits on ``data`` (pure data parallelism, replicated parameters). Batches are
split over ``data`` and ``fsdp`` together.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical name -> mesh axis (None = replicated)
LOGICAL_AXIS_RULES = {
    "batch": ("data", "fsdp"),
    "seq": None,
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "vocab": "tensor",
}


def parse_mesh(spec: str | None, n: int | None = None) -> dict[str, int]:
    """``"data=2,fsdp=2,tensor=2"`` → {"data": 2, "fsdp": 2, "tensor": 2}; missing axes are 1 and
    one axis may be -1 (all remaining devices). None/"" = all devices on ``data``. ``n``: the devices the mesh
    spans (default all).

    Raises:
      ValueError: unknown axis, bad number, or sizes that do not multiply to the device count.
    """
    n = jax.device_count() if n is None else n
    sizes = {"data": -1, "fsdp": 1, "tensor": 1} if not spec else {"data": 1, "fsdp": 1, "tensor": 1}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in MESH_AXES:
            raise ValueError(f"--mesh: unknown axis {name!r}; expected some of {MESH_AXES} (e.g. data=2,fsdp=2)")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"--mesh: {part!r} is not axis=integer") from None
    auto = [k for k, v in sizes.items() if v == -1]
    if len(auto) > 1:
        raise ValueError("--mesh: at most one axis may be -1")
    known = int(np.prod([v for v in sizes.values() if v != -1]))
    if auto:
        if n % known:
            raise ValueError(f"--mesh: {spec!r} does not divide the {n} devices")
        sizes[auto[0]] = n // known
    if int(np.prod(list(sizes.values()))) != n:
        mesh = ",".join(f"{k}={v}" for k, v in sizes.items())
        raise ValueError(f"--mesh: {mesh} needs {int(np.prod(list(sizes.values())))} devices, have {n} (on CPU, "
                         f"simulate them with XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    return sizes


def make_mesh(spec: str | None = None, devices=None) -> Mesh:
    """A ``Mesh`` with axes (data, fsdp, tensor) over all devices, or over ``devices`` (a sequence of devices,
    e.g. ``jax.devices()[:1]`` for a one-device baseline beside a run on all of them; see ``parse_mesh``).

    Built by ``jax.make_mesh``, which orders the devices by the physical topology (so ``tensor``, the
    innermost axis, stays on neighbouring devices), with ``Auto`` axis types: arrays are partitioned by
    the shardings the trainer gives, not by explicit-sharding types.
    """
    sizes = parse_mesh(spec, None if devices is None else len(devices))
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=auto, devices=devices)


def logical_to_spec(names: tuple[str | None, ...]) -> P:
    """Logical axis names → a ``PartitionSpec`` over the mesh axes (LOGICAL_AXIS_RULES)."""
    return P(*[None if n is None else LOGICAL_AXIS_RULES[n] for n in names])


# Parameter path suffix -> logical axes, one rule for every parameter of two or more dimensions of every
# model family (FoX/Transformer LMs, GPT-2, the DCP interaction weights). The longest matching suffix
# wins. A parameter of ndim >= 2 without a rule is an error (``param_logical_axes``): a renamed module
# cannot silently fall back to replicated. 0-D and 1-D leaves (norm scales, biases, beta, optimizer
# counters) are replicated.
PARAM_RULES: dict[tuple[str, ...], tuple[str | None, ...]] = {
    # FoX / Transformer (fox_jax.models.lm)
    ("embed", "embedding"): ("vocab", "embed"),                 # [V, d]
    ("lm_head", "kernel"): ("embed", "vocab"),                  # [d, V]
    ("q_proj", "kernel"): ("embed", "heads"),                   # [d, H*D]
    ("k_proj", "kernel"): ("embed", "kv_heads"),                # [d, Hkv*D]
    ("v_proj", "kernel"): ("embed", "kv_heads"),                # [d, Hkv*D]
    ("ogate_proj", "kernel"): ("embed", "heads"),               # [d, H*D]
    ("o_proj", "kernel"): ("heads", "embed"),                   # [H*D, d]
    ("fgate_proj", "kernel"): ("embed", None),                  # [d, H]
    ("k_shift_proj", "kernel"): ("embed", None),                # [d, Hkv]
    ("v_shift_proj", "kernel"): ("embed", None),                # [d, Hkv]
    ("q_norm", "scale"): ("heads", None),                       # [H, D] (QK-norm per head)
    ("k_norm", "scale"): ("kv_heads", None),                    # [Hkv, D]
    ("o_norm", "scale"): ("heads", None),                       # [H, D]
    ("gate_proj", "kernel"): ("embed", "mlp"),                  # [d, 2I] (SwiGLU gate | up)
    ("down_proj", "kernel"): ("mlp", "embed"),                  # [I, d]
    # GPT-2 (fox_jax.models.gpt2; Hugging Face module names)
    ("wte", "embedding"): ("vocab", "embed"),                   # [V, d]
    ("wpe", "embedding"): (None, "embed"),                      # [n_positions, d]
    ("attn", "c_attn", "kernel"): ("embed", None),              # [d, 3d]: fused q|k|v columns are not
                                                                # split (a split would cut across q/k/v)
    ("attn", "c_proj", "kernel"): ("heads", "embed"),           # [d, d]
    ("mlp", "c_fc", "kernel"): ("embed", "mlp"),                # [d, 4d]
    ("mlp", "c_proj", "kernel"): ("mlp", "embed"),              # [4d, d]
    # DCP interaction weights (fox_jax.ops.context_pruning.with_interaction_params), both families
    ("q_int", "kernel"): ("embed", None),                       # [d, r]
    ("k_int", "kernel"): ("embed", None),                       # [d, r]
}
_LONGEST_RULE = max(len(k) for k in PARAM_RULES)


def _path_keys(path: tuple) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def param_logical_axes(path: tuple, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of a parameter (or of an optimizer-state leaf that mirrors one) from its pytree path.

    Args:
      path: the leaf's pytree key path (``jax.tree_util.tree_flatten_with_path``).
      ndim: the leaf's number of dimensions.
    Returns:
      ``ndim`` logical names (None = replicated); all None for 0-D and 1-D leaves.
    Raises:
      ValueError: a leaf of ``ndim >= 2`` that no ``PARAM_RULES`` suffix matches, or whose rule has
        another number of dimensions (the message names the path and the table).
    """
    if ndim < 2:
        return (None,) * ndim
    keys = _path_keys(path)
    for n in range(min(_LONGEST_RULE, len(keys)), 1, -1):
        axes = PARAM_RULES.get(tuple(keys[-n:]))
        if axes is not None:
            if len(axes) != ndim:
                raise ValueError(f"sharding rule {tuple(keys[-n:])} -> {axes} has {len(axes)} axes but "
                                 f"parameter {'/'.join(keys)} has {ndim} dimensions")
            return axes
    raise ValueError(f"no sharding rule for the {ndim}-D parameter {'/'.join(keys)}: add its path suffix "
                     "to fox_jax.sharding.PARAM_RULES")


def logical_sharding(mesh: Mesh, names: tuple[str | None, ...] | None, shape: tuple[int, ...]) -> NamedSharding:
    """Sharding of an array of ``shape`` whose dimensions carry the logical ``names`` (None: replicated),
    mapped by ``LOGICAL_AXIS_RULES``; a dimension that its mesh axes do not divide evenly is replicated
    instead.

    Raises:
      ValueError: ``names`` given with another length than ``shape``.
    """
    return NamedSharding(mesh, _logical_spec(mesh, names, shape))


def _logical_spec(mesh, names: tuple[str | None, ...] | None, shape: tuple[int, ...]) -> P:
    """``logical_sharding``'s ``PartitionSpec`` (``mesh``: a ``Mesh`` or an ``AbstractMesh``)."""
    names = (None,) * len(shape) if names is None else tuple(names)
    if len(names) != len(shape):
        raise ValueError(f"logical axes {names} do not match an array of shape {tuple(shape)}")
    spec = []
    for dim, name in zip(shape, names):
        axis = LOGICAL_AXIS_RULES.get(name) if name else None
        axes = (axis,) if isinstance(axis, str) else (axis or ())
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        spec.append(axis if axes and size > 1 and dim % size == 0 else None)
    return P(*spec)


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """``x`` with its dimensions laid out by their logical ``names`` over the ambient mesh (the one set with
    ``jax.set_mesh``, as ``under_mesh`` does for the jitted steps): a ``with_sharding_constraint`` mapped by
    ``LOGICAL_AXIS_RULES`` (a dimension its mesh axes do not divide stays replicated). Model code names
    logical axes only; this is where they meet the mesh. Without a mesh of several devices, or inside a
    ``shard_map`` (manual axes), ``x`` is returned as it is.

    Raises:
      ValueError: ``names`` of another length than ``x.ndim``.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size <= 1:
        return x
    if any(t == jax.sharding.AxisType.Manual for t in mesh.axis_types):
        return x
    return jax.lax.with_sharding_constraint(x, _logical_spec(mesh, names, x.shape))


def param_sharding(mesh: Mesh, path: tuple, shape: tuple[int, ...]) -> NamedSharding:
    """Sharding of one parameter: its logical axes (``param_logical_axes``) mapped by ``logical_sharding``
    (a dimension that the mesh axis does not divide evenly is replicated)."""
    return logical_sharding(mesh, param_logical_axes(path, len(shape)), shape)


def state_shardings(mesh: Mesh, tree):
    """Shardings for a pytree of parameters / train state (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: param_sharding(mesh, path, tuple(x.shape)), tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over data × fsdp, the rest replicated."""
    return NamedSharding(mesh, logical_to_spec(("batch",)))


def cache_shardings(mesh: Mesh, caches):
    """Shardings of KV caches (one cache or a pytree of them, e.g. the per-layer tuple of
    ``fox_jax.cache.slots.SlotKVCache``): each cache's ``logical_axes()`` (the cache's structure with a
    tuple of logical names, or None, per array) mapped by ``logical_sharding``, so batch goes over
    ``data`` × ``fsdp`` and key/value heads over ``tensor`` where those divide; the rest is replicated.

    Returns:
      a pytree of ``NamedSharding`` with the structure of ``caches``.
    """
    is_cache = lambda x: hasattr(x, "logical_axes")
    axes = jax.tree_util.tree_map(lambda c: c.logical_axes() if is_cache(c) else None, caches, is_leaf=is_cache)
    return jax.tree_util.tree_map(lambda x, names: logical_sharding(mesh, names, x.shape), caches, axes)


def data_parallel_size(mesh: Mesh) -> int:
    """Devices a batch is split over: the product of the mesh axes of logical ``batch`` (data × fsdp)."""
    return int(np.prod([mesh.shape[a] for a in LOGICAL_AXIS_RULES["batch"] if a in mesh.shape]))


def place_for_decoding(mesh: Mesh, params, tokens, caches, *, flag: str = "mesh"):
    """(params, tokens, caches) placed on ``mesh`` for decoding (``fox_jax.decoding.generate``,
    ``token_losses_under_policy``): params by ``state_shardings`` (the training rules), tokens [B, T] with
    B over ``data`` × ``fsdp``, caches by ``cache_shardings``.

    Raises:
      ValueError: B not a multiple of the mesh's data × fsdp size (one line naming ``flag``; pad the batch,
        as the ``fox-jax`` commands do, or choose a smaller data axis).
    """
    n = data_parallel_size(mesh)
    if tokens.shape[0] % n:
        raise ValueError(f"{flag}: the batch of {tokens.shape[0]} rows does not split over the mesh's data x fsdp "
                         f"= {n} devices; pad the batch to a multiple of {n} or use a smaller data axis")
    params = jax.device_put(params, state_shardings(mesh, params))
    tokens = jax.device_put(tokens, NamedSharding(mesh, logical_to_spec(("batch", None))))
    return params, tokens, jax.device_put(caches, cache_shardings(mesh, caches))


PARTITIONERS = ("auto", "shardy", "gspmd")


def select_partitioner(mesh: Mesh, partitioner: str = "auto") -> str:
    """Choose XLA's SPMD partitioner for the steps traced under ``mesh`` (a process-wide JAX setting,
    ``jax_use_shardy_partitioner``; call it before tracing them).

    Args:
      mesh: the training mesh.
      partitioner: ``"shardy"`` or ``"gspmd"`` to force one; ``"auto"``: GSPMD when the mesh spans
        several GPU devices and the attention kernels run per shard
        (``FOX_JAX_SHARD_KERNELS`` not 0), else JAX's default. Reason: with jax 0.11.2, Shardy
        segfaults partitioning the backward of the Pallas kernels' ``shard_map`` on GPUs
        (``kernel_sharding_enabled``); GSPMD compiles it.
    Returns:
      ``"shardy"`` or ``"gspmd"``: the partitioner now in effect.
    Raises:
      ValueError: an unknown ``partitioner``.
    """
    if partitioner not in PARTITIONERS:
        raise ValueError(f"partitioner must be one of {PARTITIONERS}, got {partitioner!r}")
    current = "shardy" if getattr(jax.config, "jax_use_shardy_partitioner", False) else "gspmd"
    if partitioner == "auto":
        wants_kernels = os.environ.get(SHARD_KERNELS_ENV, "").strip() != "0"
        partitioner = "gspmd" if (mesh.size > 1 and jax.default_backend() == "gpu" and wants_kernels) else current
    if partitioner != current:
        try:
            jax.config.update("jax_use_shardy_partitioner", partitioner == "shardy")
        except (AttributeError, KeyError, ValueError) as e:  # a JAX without the switch (GSPMD removed)
            import warnings

            warnings.warn(f"cannot select the {partitioner} partitioner ({e}); keeping {current}: the "
                          "attention kernels then run replicated on GPUs", stacklevel=2)
            return current
    return partitioner


def under_mesh(mesh: Mesh, fn):
    """``fn`` called (and so traced) under ``jax.set_mesh(mesh)``.

    The attention op reads the ambient mesh: with several devices, its Pallas kernels (opaque to the SPMD
    partitioner, which would otherwise all-gather q/k/v and compute every shard on every device) run in
    a ``shard_map`` with the batch over ``data``/``fsdp`` and heads over ``tensor``. Wrap jitted steps
    with this so their trace sees the mesh.
    """
    if mesh.size <= 1:
        return fn

    def wrapped(*args, **kwargs):
        with jax.set_mesh(mesh):
            return fn(*args, **kwargs)

    return wrapped


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# ---------------------------------------------------------------------------------------------------
# Kernel sharding
# ---------------------------------------------------------------------------------------------------
# A ``pallas_call`` is opaque to the SPMD partitioner (docs/design/pallas_gpu.md §3): it would
# all-gather the kernels' inputs and compute every shard on every device. Under a mesh the attention
# op (fox_jax.ops.forgetting_attention) therefore runs its kernels in a ``shard_map``, with the arrays
# split along their logical axes (``per_shard``). This section is the only place that knows the mesh.

SHARD_KERNELS_ENV = "FOX_JAX_SHARD_KERNELS"

if hasattr(jax, "shard_map"):  # jax >= 0.6.1
    _experimental_shard_map = None
else:  # jax 0.6.0 has only the experimental one
    from jax.experimental.shard_map import shard_map as _experimental_shard_map


def kernel_sharding_enabled() -> bool:
    """Whether the Pallas kernels run per shard under an ambient mesh (``kernel_mesh``).

    ``FOX_JAX_SHARD_KERNELS=1`` / ``0`` forces it on / off. Default: on, except on GPU backends while
    JAX's Shardy partitioner is selected: with jax 0.11.2 it segfaults (in its ``shardy-xla`` pass)
    partitioning the *backward* of the kernels' ``shard_map`` on 2 H200s — also with both backward kernels
    replaced by zeros, so the glue, not the Triton compile — while the GSPMD partitioner compiles and
    runs it (benchmarks/NOTES.md, "Multi-GPU"). ``select_partitioner`` picks GSPMD for multi-GPU
    meshes. Off, a multi-device step is still correct: XLA all-gathers around the kernels and every
    device computes all rows (760M FoX (Pro) at 16k: 64 % weak-scaling efficiency on 2 H200s).

    Raises:
      ValueError: ``FOX_JAX_SHARD_KERNELS`` set to something other than 0 or 1.
    """
    flag = os.environ.get(SHARD_KERNELS_ENV)
    if flag is not None and flag.strip() != "":
        if flag.strip() not in ("0", "1"):
            raise ValueError(f"{SHARD_KERNELS_ENV} must be 0 or 1, got {flag!r}")
        return flag.strip() == "1"
    return jax.default_backend() != "gpu" or not getattr(jax.config, "jax_use_shardy_partitioner", False)


def kernel_mesh():
    """The mesh the kernels run per shard on: the one set with ``jax.set_mesh`` (``under_mesh``) when it
    spans several devices, kernel sharding is enabled and we are not already inside a ``shard_map``
    (manual axes); else None."""
    if not kernel_sharding_enabled():
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size <= 1:
        return None
    if any(t == jax.sharding.AxisType.Manual for t in mesh.axis_types):
        return None
    return mesh


def shard_map(f, mesh, in_specs, out_specs):
    """``jax.shard_map(f, mesh=mesh, in_specs=..., out_specs=...)`` without the replication check
    (``pallas_call`` has no replication rule)."""
    if _experimental_shard_map is not None:
        return _experimental_shard_map(f, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _dividing_axes(mesh, axes, dims) -> tuple[str, ...] | None:
    """The mesh axes of ``axes`` present in ``mesh`` with size > 1, if their product divides every dim."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    axes = tuple(a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1)
    size = int(np.prod([mesh.shape[a] for a in axes]))
    if not axes or any(n % size for n in dims):
        return None
    return axes


def _is_axes(x) -> bool:
    """A tuple of logical axis names (str or None per dimension; () for a scalar): one leaf of an axes pytree."""
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def shard_plan(mesh, args: dict, *, rules: dict | None = None) -> dict[str, tuple[str, ...] | None]:
    """The mesh axes ``per_shard`` splits each logical axis of ``args`` over (None: replicated).

    A logical axis is split over its mesh axes (``rules``) that ``mesh`` has with size > 1, if their product
    divides every dimension carrying that name; otherwise it is replicated.

    Args:
      mesh, args, rules: as ``per_shard``.
    Returns:
      {logical name: mesh axes or None} for every name that ``args`` carries.
    """
    rules = LOGICAL_AXIS_RULES if rules is None else rules
    dims: dict[str, list[int]] = {}
    for x, axes in args.values():
        leaves, tree = jax.tree_util.tree_flatten(x)
        for leaf, names in zip(leaves, tree.flatten_up_to(axes)):
            for size, name in zip(leaf.shape, names):
                if name is not None:
                    dims.setdefault(name, []).append(size)
    return {name: _dividing_axes(mesh, rules.get(name), sizes) for name, sizes in dims.items()}


def shard_count(mesh, axes: tuple[str, ...] | None) -> int:
    """Shards along mesh ``axes`` (a ``shard_plan`` entry): the product of their sizes, 1 for None."""
    return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


def per_shard(fn, mesh, args: dict, out_axes, *, rules: dict | None = None):
    """``fn(**arrays)`` run per shard: in a ``shard_map`` over ``mesh``, every array split along its
    logical axes, nothing communicated.

    A logical axis is split as ``shard_plan`` says (over its mesh axes ``rules`` where they divide every
    dimension carrying it, else replicated). When no axis is split, ``fn`` is called directly (XLA
    replicates the call).

    Args:
      fn: called with the arrays (local shards) as keyword arguments; returns an array or a pytree of them.
      mesh: a ``Mesh`` or the ambient ``AbstractMesh`` (``kernel_mesh``).
      args: {name: (array or pytree of arrays, logical axes)}: one logical name or None per dimension (a
        tuple), or for a pytree the same pytree of such tuples. The kernels' batch and head dimensions are
        ``"batch"`` and ``"heads"``; k/v heads carry ``"heads"`` too, so that H and Hkv are split together
        and grouped-query heads stay on one device.
      out_axes: logical axes of fn's output: a tuple for one array, or a pytree of tuples matching it (None
        where the output has None).
      rules: logical name → mesh axis name(s); default ``LOGICAL_AXIS_RULES``.
    Returns:
      fn's output, sharded along ``out_axes``.
    """
    split = shard_plan(mesh, args, rules=rules)
    if all(axes is None for axes in split.values()):
        return fn(**{name: x for name, (x, _) in args.items()})

    def spec(names):
        return P(*(None if n is None else split.get(n) for n in names))

    def specs_like(x, axes):  # x's pytree with a PartitionSpec per array
        tree = jax.tree_util.tree_structure(x)
        return tree.unflatten([spec(names) for names in tree.flatten_up_to(axes)])

    names = tuple(args)

    def local(*arrays):
        return fn(**dict(zip(names, arrays)))

    in_specs = tuple(specs_like(x, axes) for x, axes in args.values())
    out_specs = jax.tree_util.tree_map(spec, out_axes, is_leaf=_is_axes)
    return shard_map(local, mesh, in_specs, out_specs)(*(x for x, _ in args.values()))
