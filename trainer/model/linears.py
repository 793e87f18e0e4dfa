"""A projection whose kernel is created in its full shape, with a logical axis name per dimension.

Why not nn.DenseGeneral: it initialises a flat 2-D kernel and then names it with one logical axis per dimension
of the full shape, which breaks logical sharding under jax.set_mesh (flax #3676). This is MaxText's linears.py
idea: the kernel [*in_shape, *out_shape] is created as it is stored, so each dimension shards by its own name.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import flax.linen as nn

Array = jax.Array


class Linear(nn.Module):
    """x [..., *in] -> [..., *features]: the last `len(in_axes)` dims of x contracted with kernel [*in, *features].

    `axes` names the kernel's dimensions (in, then out); the optional bias [*features] takes the out names.
    """

    features: tuple[int, ...]
    axes: tuple[str | None, ...]
    init_std: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        n_in = len(self.axes) - len(self.features)
        in_shape = x.shape[x.ndim - n_in:]
        init = nn.with_logical_partitioning(nn.initializers.normal(self.init_std), self.axes)
        kernel = self.param("kernel", init, (*in_shape, *self.features), self.param_dtype)
        y = contract(x.astype(self.dtype), kernel.astype(self.dtype), n_in)
        if self.use_bias:
            bias_init = nn.with_logical_partitioning(nn.initializers.zeros, self.axes[n_in:])
            y = y + self.param("bias", bias_init, self.features, self.param_dtype).astype(self.dtype)
        return y


def contract(x: Array, kernel: Array, n_in: int) -> Array:
    """x [..., *in] times kernel [*in, *out] -> [..., *out], the last `n_in` dims of x contracted.

    As one 2-D matmul over all leading dims: on CPU, XLA computes a weight gradient that contracts two dims (batch
    and seq) through a slow path, and the flat form made the demo model's step ~1.6x faster. Not where the mesh
    splits sequences over `context`: a flat [batch * seq] cannot keep that split, and XLA would gather them.
    lax.dot_general, not jnp.dot: jnp.dot is a cached jit, whose trace Qwix's interception (quantization.py) would
    then share between quantized and float models.
    """
    lead = x.shape[: x.ndim - n_in]
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.shape.get("context", 1) > 1:
        dims = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
        return jax.lax.dot_general(x, kernel, (dims, ((), ())))
    flat, matrix = x.reshape(-1, math.prod(kernel.shape[:n_in])), kernel.reshape(math.prod(kernel.shape[:n_in]), -1)
    return jax.lax.dot_general(flat, matrix, (((1,), (0,)), ((), ()))).reshape(*lead, *kernel.shape[n_in:])
