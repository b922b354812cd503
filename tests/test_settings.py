"""Typed settings (`specjax.build.GenerateSettings`, `specjax.distill.DistillSettings`): what a
command makes of its ConfigDict, once."""
import dataclasses
import pathlib

import pytest

from configs import bench as bench_config
from configs import generate, generate_tpu
from specjax import build, drafters
from specjax.build import FIELDS, GenerateSettings, generate_settings


def _main_config():
    from specjax import config_files
    return config_files.with_drafter_keys(generate.get_config())


def test_defaults_are_the_main_commands():
    """GenerateSettings() equals configs/generate.py's settings, key for key, and every field is
    a key of that config (so the defaults in the library cannot drift from the config); the
    drafter's block is its kind's defaults, and the command adds every kind's keys to the config
    with its settings class's defaults."""
    c = generate.get_config()
    assert set(FIELDS) <= set(c.keys())
    assert generate_settings(c) == GenerateSettings()
    assert GenerateSettings().draft == drafters.HybridSettings()
    want = {k: (c[k].to_dict() if k == "mesh" else tuple(c[k]) if isinstance(c[k], (tuple, list)) else c[k])
            for k in FIELDS}
    assert {k: v for k, v in GenerateSettings().to_dict().items() if k != "draft"} == want
    full = _main_config()
    assert {k: full[k] for k in drafters.settings_keys()} == drafters.settings_keys()
    assert drafters.settings_keys()["max_ngram"] == drafters.NGramSettings().max_ngram == \
        drafters.HybridSettings().max_ngram


def test_a_config_is_typed_once_and_settings_are_not_retyped():
    c = generate_tpu.get_config()
    s = generate_settings(c)
    assert (s.dtype, s.scan_layers, s.fuse_projections, s.cpu_kernel, s.block_tokens) == ("bfloat16", False, False,
                                                                                          "off", -1)
    with pytest.raises(TypeError, match="typed once"):
        generate_settings(s)                                    # typed settings are not re-read
    assert s.mesh_axes == {k: int(v) for k, v in c.mesh.items()}
    c.adaptive_gammas = [0, 2]                                  # sequences become tuples
    assert generate_settings(c).adaptive_gammas == (0, 2)
    assert s.replace(gamma=2).gamma == 2 and hash(generate_settings(generate.get_config()))
    # A command's own keys (the bench's drafters, prompts, ...) are not settings: left to it.
    assert generate_settings(bench_config.get_config()).drafter == "hybrid"


@pytest.mark.parametrize("key,value,message", [
    ("dtype", 32, "dtype=32: expected a string"),
    ("scan_layers", "yes", "scan_layers='yes': expected true or false"),
    ("adaptive_gammas", "0,1", "adaptive_gammas='0,1': expected a tuple of integers"),
    ("adaptive_trees", 3, "adaptive_trees=3: expected a tuple of tree strings"),
    ("adaptive_budgets", "2", "adaptive_budgets='2': expected a tuple of numbers > 1"),
    ("mesh", {"data": "x"}, "mesh=.*expected axis sizes"),
    ("max_ngram", "3", "max_ngram='3': expected an integer"),            # the drafter's block, typed too
    ("draft_model", 3, "draft_model=3: expected a string"),
    ("drafter", "bogus", "drafter='bogus': expected one of"),
])
def test_a_setting_of_the_wrong_type_is_named(key, value, message):
    """(A ConfigDict refuses most of these itself, keeping its keys' types; a mapping made in
    code or read from a file does not.)"""
    values = {**_main_config().to_dict(), key: value}
    with pytest.raises(ValueError, match=message):
        generate_settings(values)


def test_the_drafter_block_is_the_kinds_own_settings():
    """``draft`` holds the chosen kind's settings, typed from the config's keys of the same
    names; a new drafter in ``replace`` starts from that kind's defaults; a block of another
    kind is refused."""
    c = _main_config()
    c.drafter, c.max_ngram, c.min_match = "hybrid", 4, 2
    s = generate_settings(c)
    assert s.draft == drafters.HybridSettings(hybrid_model="head", min_match=2, max_ngram=4, min_ngram=1,
                                              draft_model="")
    assert generate_settings(c, drafter="ngram").draft == drafters.NGramSettings(max_ngram=4, min_ngram=1)
    assert s.replace(drafter="ngram").draft == drafters.NGramSettings()
    with pytest.raises(ValueError, match="reads NGramSettings, got draft settings HybridSettings"):
        GenerateSettings(drafter="ngram", draft=drafters.HybridSettings())


def test_below_the_edge_nothing_takes_a_configdict():
    """The build functions take settings only: a ConfigDict is a TypeError that says where it
    is typed; they give the same objects as before for the typed settings."""
    c = generate.get_config()
    c.drafter, c.gamma, c.temperature, c.top_k = "ngram", 5, 0.7, 20
    s = generate_settings(c)
    assert build.generation_config(s, (2,)).gamma == 5 and build.sampling_config(s).top_k == 20
    for fn in (lambda x: build.generation_config(x, ()), build.sampling_config, build.check_config,
               build.check_generation_settings, build.load_generator, build.use_cpu_kernel):
        with pytest.raises(TypeError, match="takes GenerateSettings"):
            fn(c)
    with pytest.raises(ValueError, match="gamma=-1"):
        build.check_generation_settings(s.replace(gamma=-1))
    with pytest.raises(TypeError, match="ConfigDict or a mapping"):
        generate_settings(["drafter"])


def test_only_the_commands_edges_type_a_generation_config():
    """`generate_settings` is called where a command's config enters (the CLI and the commands'
    own typing functions), nowhere below: the source says so."""
    import re

    import specjax
    root = pathlib.Path(specjax.__file__).parent
    callers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if re.search(r"\bgenerate_settings\(", p.read_text()) and p.name != "_settings.py")
    assert callers == ["bench.py", "generate.py", "serve.py", "tools.py"], callers


# ----------------------------------------------------------------------------- distillation

def test_distill_defaults_are_the_configs():
    """DistillSettings() is configs/distill.py, block by block (its draft block included, whose
    defaults differ from a bare DraftChoice's); configs/distill_head.py's head block is read
    as it sets it, and a config without one keeps the kind's defaults (None)."""
    from configs import distill as distill_config
    from configs import distill_head
    from specjax.distill import DistillSettings, distill_settings
    c = distill_config.get_config()
    s = distill_settings(c)
    assert s == DistillSettings()
    flat = distill_settings(c).to_dict()
    for block in ("data", "draft", "loss", "optim", "eval"):
        want = {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in c[block].to_dict().items()
                if not isinstance(v, dict)}
        assert {k: flat[block][k] for k in want} == want, block
    assert flat["data"]["shards"] == {**c.data.shards.to_dict(), "dirs": tuple(c.data.shards.dirs)}
    assert (s.head.ttt_steps, s.head.feature_weight) == (None, None)
    h = distill_head.get_config()
    hs = distill_settings(h).head
    assert dataclasses.asdict(hs) == {k: tuple(v) if isinstance(v, (list, tuple)) else v
                                      for k, v in h.head.to_dict().items()}
    assert distill_settings(h).is_head and not s.is_head
    assert distill_settings(s) is s and hash(s)


def test_distill_settings_round_trip_through_a_workdirs_config_json():
    import json
    from configs import distill_head
    from specjax.distill import distill_settings
    s = distill_settings(distill_head.get_config())
    assert distill_settings(json.loads(json.dumps(s.to_dict()))) == s


@pytest.mark.parametrize("values,message", [
    ({"data": {"tokens_per_bach": 2048}}, r"unknown distillation setting\(s\) data.tokens_per_bach"),
    ({"optim": {"accumulate": "2"}}, "optim.accumulate='2': expected an integer"),
    ({"optim": {"learning_rate": "1e-3"}}, "optim.learning_rate='1e-3': expected a number"),
    ({"head": {"input_norm": "yes"}}, "head.input_norm='yes': expected true or false"),
    ({"data": {"shards": {"dirs": 3}}}, "data.shards.dirs=3: expected a sequence"),
    ({"eval": 5}, "eval=5: expected a block of settings"),
    ({"mesh": {"data": "x"}}, "mesh=.*expected axis sizes"),
])
def test_a_distill_setting_of_the_wrong_type_or_name_is_named(values, message):
    from specjax.distill import distill_settings
    with pytest.raises(ValueError, match=message):
        distill_settings(values)


def test_train_reads_no_configdict():
    """Below `train`, the distillation modules read typed settings only: no `.get(key, default)`
    on a config (the public entry points that accept a ConfigDict type it first)."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[1] / "specjax" / "distill"
    for name in ("_loop.py", "_setup.py", "_prepare.py", "_heads.py"):
        text = (root / name).read_text()
        assert not re.search(r"\b(c|s|d|e|h|o|sh)\.(\w+\.)*get\(", text), name


def test_a_commands_own_keys_are_left_out_when_it_asks():
    """`specjax eval`'s config is a distillation config with keys of its own: typed with
    extra='ignore' (its own keys left to it), refused by the trainer's strict reading; tuple
    elements are typed too."""
    from configs import eval as eval_config
    from specjax.distill import distill_settings
    c = eval_config.get_config()
    assert distill_settings(c, extra="ignore").eval.per_category == c.eval.per_category
    with pytest.raises(ValueError, match="unknown distillation setting.*draft_model"):
        distill_settings(c)
    with pytest.raises(ValueError, match=r"draft.layers\[1\]='2': expected an integer"):
        distill_settings({"draft": {"layers": (0, "2")}})


def test_a_workdirs_config_json_is_read_through_the_settings(tmp_path):
    """The resume check reads a workdir's stored config.json as settings: a key absent there
    means its default (no difference), a changed state key is named, and a stored config that is
    not JSON or holds a key the trainer does not know is refused naming the file, before
    anything is written."""
    import json
    from configs import distill_head
    from specjax.distill import check_resume_config, distill_settings
    s = distill_settings(distill_head.get_config())
    (tmp_path / "checkpoints" / "100").mkdir(parents=True)
    stored = s.to_dict()
    del stored["head"]["input_norm"], stored["metrics_lag"]
    (tmp_path / "config.json").write_text(json.dumps(stored))
    check_resume_config(s.replace(head=dataclasses.replace(s.head, input_norm=False)), tmp_path)
    with pytest.raises(ValueError, match=r"head.input_norm: false -> true"):
        check_resume_config(s, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**stored, "lerning_rate": 1.0}))
    with pytest.raises(ValueError, match="config.json: unreadable or not a distillation config.*lerning_rate"):
        check_resume_config(s, tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: unreadable"):
        check_resume_config(s, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "config.json"]
