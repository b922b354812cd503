"""Settings of the distillation experiment (`python -m experiments.distill.run --config=<this file>`).

Training settings are in configs/distill_compare.py (the divergence comparison) and
configs/distill.py (the shipped recipe); this file picks stages, directories and the
held-out evaluation.
"""

import pathlib

import ml_collections

REPO = pathlib.Path(__file__).resolve().parents[2]


def get_config():
    c = ml_collections.ConfigDict()
    c.stage = "all"                 # all (= compare, recipe, evaluate) | compare | recipe | evaluate | report
    c.runs = str(pathlib.Path.home() / ".cache" / "specjax" / "distill_runs")   # training workdirs (resumable)
    c.drafts = str(REPO / "experiments" / "distill" / "drafts")                 # the comparison's drafts
    c.out = str(REPO / "experiments" / "distill" / "results")
    c.divergences = ("fkl", "rkl", "jsd", "tvd")
    c.num_prompts = 13              # engine runs: held-out prompts, round-robin over the categories
    c.max_new_tokens = 128
    c.repeats = 1
    c.gamma = 4                     # the fixed gamma of the tokens/pass comparison
    c.max_gamma = 4                 # the engine runs each draft at its best predicted gamma in 1..max_gamma
    c.pad_multiple = 256
    c.cost_iters = 20
    return c


STAGES = {"all": ("compare", "recipe", "evaluate", "report"), "compare": ("compare",), "recipe": ("recipe",),
          "evaluate": ("evaluate", "report"), "report": ("report",)}


def stages(c) -> tuple[str, ...]:
    """The stages ``c.stage`` runs; ValueError naming the setting for an unknown one."""
    if c.stage not in STAGES:
        raise ValueError(f"config.stage: {c.stage!r} is not a stage; choose from {list(STAGES)}")
    return STAGES[c.stage]
