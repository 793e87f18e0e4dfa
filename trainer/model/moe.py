"""The Mixture-of-Experts layer: a router picks each token's k experts, which run dropless or with a capacity
(routing.py), weighted and summed. Dropless on a mesh with an expert axis moves the tokens to their experts by
all-to-all (expert_parallel.py).

Routers (model.router): `softmax` (Mixtral, Qwen3-MoE, GPT-OSS with model.router_bias) scores the tokens as
they come; `gemma4` scores them RMS-normalised without weight, times a learned scale and hidden**-0.5, and
multiplies each chosen weight by a learned per-expert scale. Both run in float32: top-k is a discrete choice
that bfloat16 rounding would flip.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import flax.linen as nn

from configs import ModelConfig
from trainer.model import expert_parallel, routing
from trainer.model.linears import Linear
from trainer.model.mlp import gated
from trainer.model.norms import RMSNorm
from trainer.model.sharding import BATCH_AXES

Array = jax.Array


class MoE(nn.Module):
    """x [batch, seq, embed] -> (the experts' weighted sum, the layer's router statistics over `valid` tokens)."""

    cfg: ModelConfig
    mesh: jax.sharding.Mesh | None = None  # whose devices the grouped matmul is compiled for (else JAX's default)

    @nn.compact
    def __call__(self, x: Array, valid: Array, router_input: Array | None = None) -> tuple[Array, dict[str, Array]]:
        """`router_input` (default x) is what the router scores: Gemma 4 routes the un-normed residual."""
        cfg = self.cfg
        dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        n, d, f = cfg.num_experts, cfg.emb_dim, cfg.expert_width
        weights, experts, probs = self._route((x if router_input is None else router_input).reshape(-1, d))
        init = lambda axes: nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std), axes)  # noqa: E731
        zeros = lambda axes: nn.with_logical_partitioning(nn.initializers.zeros, axes)  # noqa: E731
        param = lambda name, make, shape, axes: self.param(name, make(axes), shape, pdtype).astype(dtype)  # noqa: E731
        params = (
            param("gate_proj", init, (n, d, f), ("experts", "embed", "mlp")),
            param("up_proj", init, (n, d, f), ("experts", "embed", "mlp")),
            param("down_proj", init, (n, f, d), ("experts", "mlp", "embed")),
        )
        biases = None
        if cfg.expert_bias:
            biases = (
                param("gate_bias", zeros, (n, f), ("experts", "mlp")),
                param("up_bias", zeros, (n, f), ("experts", "mlp")),
                param("down_bias", zeros, (n, d), ("experts", "embed")),
            )
        glu, kept = gated(cfg), None
        if cfg.capacity_factor:
            def constrain(a: Array, by_expert: bool) -> Array:  # see routing.with_capacity
                axes = ("batch", "experts") if by_expert else ("batch",)
                return nn.with_logical_constraint(a, axes + (None,) * (a.ndim - len(axes)))

            split = lambda a: a.reshape(*x.shape[:2], -1)  # noqa: E731
            out, kept = routing.with_capacity(x, split(experts), split(weights), params, None, cfg.capacity_factor,
                                              constrain, glu=glu, biases=biases)
        elif self._expert_parallel(x):
            out, kept = expert_parallel.dropless_ep(x, experts, weights, params, self.mesh, glu, biases,
                                                    buffer_factor=cfg.expert_buffer_factor)
        else:
            platform = self.mesh.devices.flat[0].platform if self.mesh is not None else ""
            out = routing.dropless(x.reshape(-1, d), experts, weights, params, None, platform, glu=glu, biases=biases)
            out = out.reshape(x.shape)
        return out.astype(dtype), routing.router_stats(experts, probs, valid, kept)

    def _expert_parallel(self, x: Array) -> bool:
        """Whether dropless runs by all-to-all over the mesh's expert axis: it has one whose shards split x evenly."""
        mesh = self.mesh
        if mesh is None or mesh.shape["expert"] == 1:
            return False
        batch_shards = math.prod(mesh.shape[axis] for axis in BATCH_AXES)
        return x.shape[0] % batch_shards == 0 and x.shape[1] % mesh.shape.get("context", 1) == 0

    def _route(self, tokens: Array) -> tuple[Array, Array, Array]:
        """tokens [T, embed] -> (float32 weights [T, k], expert ids [T, k], float32 probabilities [T, E])."""
        cfg = self.cfg
        pdtype = jnp.dtype(cfg.param_dtype)
        router = Linear((cfg.num_experts,), ("embed", None), cfg.init_std, jnp.float32, pdtype, cfg.router_bias,
                        name="router")
        if cfg.router == "softmax":
            return routing.route(router(tokens), cfg.experts_per_token, cfg.router_renormalize)
        # gemma4: a weightless RMSNorm, a learned scale and hidden**-0.5 before the projection
        h = RMSNorm(cfg.norm_eps, jnp.float32, pdtype, use_scale=False)(tokens)
        scale = self.param("router_scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                           (cfg.emb_dim,), pdtype)
        weights, experts, probs = routing.route(router(h * scale.astype(jnp.float32) * cfg.emb_dim**-0.5),
                                                cfg.experts_per_token, cfg.router_renormalize)
        per_expert = self.param("per_expert_scale", nn.with_logical_partitioning(nn.initializers.ones, (None,)),
                                (cfg.num_experts,), pdtype)
        return weights * jnp.take(per_expert.astype(jnp.float32), experts), experts, probs
