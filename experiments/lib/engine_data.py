"""Where the data engine's committed corpus lives and how the studies that train on it batch it
(shared by experiments/learning_curve and experiments/heads/train.py)."""

CORPUS = "experiments/data_engine/corpus"       # `specjax data --workdir` of the committed corpus

# Length buckets of the answer shards' batches: finer than configs/distill_head.py's, so a step
# spends more of its positions on loss tokens (measured in experiments/learning_curve/README.md).
WIDTHS = (128, 256, 384, 512, 640, 768, 1024)
WINDOW = 8                                       # shards shuffled together


def stage_dirs(*stages: str) -> tuple[str, ...]:
    """The shard directories of the corpus's named stages (e.g. 'responses_greedy')."""
    return tuple(f"{CORPUS}/{s}" for s in stages)
