"""What the heads' cost diagnostics (`step_parts`, `origins_cost`) share."""

from __future__ import annotations


def fresh_head(model, tp, kind: str, opts: dict, ids):
    """A freshly initialized head of `kind` (``opts``: its ttt_steps / num_heads) over the reduced
    vocabulary ``ids``, with AdamW: (head config, objective, optimizer, train state, frozen inputs)."""
    import jax

    from specjax import distill, drafters
    hc = drafters.HeadConfig.make(kind, model.config, head_size=len(ids), input_norm=True,
                                  num_heads=opts.get("num_heads", 4))
    obj = distill.HeadObjective(hc, model, ttt_steps=opts.get("ttt_steps", 1))
    own = drafters.init_head_params(hc, jax.random.key(0), head_ids=ids)
    opt, _ = distill.make_optimizer(learning_rate=1e-3, warmup_steps=30, total_updates=1000)
    state, frozen = distill.init_state(own, obj.trainable, opt, jax.random.key(1))
    return hc, obj, opt, state, {**frozen, "target": tp}
