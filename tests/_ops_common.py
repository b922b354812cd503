"""Shared by the attention-op tests: whole models that differ only in their attention op."""
import jax
import jax.numpy as jnp
import numpy as np

from specjax import trees
from specjax.models import Llama, TreeBlock


def assert_models_agree(base, ops, atol=1e-4):
    """Models of ``base`` with each attention op of ``ops`` (the first the reference), weights
    scaled by 4: the same logits, within ``atol`` (and as much relative), for a ragged prefill of
    two rows, a decode step and a token-tree block (branching 2, 2) over the cache. Each model's
    three calls run as one program (and the weights are made in one)."""
    models = [Llama(base.replace(attention_op=op)) for op in ops]
    params = jax.jit(lambda k: jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, models[0].init_params(k)))(
        jax.random.key(2))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, base.vocab_size, (2, 9)), jnp.int32)
    lengths = jnp.asarray([9, 6], jnp.int32)
    shape = trees.TreeShape.from_branching((2, 2))
    parents = jnp.broadcast_to(jnp.asarray(shape.parents, jnp.int32), (2, shape.num_nodes))
    tree = TreeBlock(rel_positions_BT=jnp.broadcast_to(jnp.asarray((0,) + shape.depths, jnp.int32),
                                                       (2, shape.num_nodes + 1)),
                     visible_BTW=trees.ancestor_mask(parents, jnp.ones((2, shape.num_nodes), bool), shape.max_depth))
    outs = []
    for model in models:
        @jax.jit
        def three(params, tokens, lengths, tree):
            lg, cache = model.apply(params, tokens, model.init_cache(2, 24), lengths)
            lg2, cache = model.apply(params, tokens[:, :1], cache)
            lg3, _ = model.apply(params, tokens[:, :shape.num_nodes + 1], cache, None, tree)
            return lg, lg2, lg3
        outs.append([np.asarray(x) for x in three(params, tokens, lengths, tree)])
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_allclose(b, a, atol=atol, rtol=atol)
