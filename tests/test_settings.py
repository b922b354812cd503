"""Typed generation settings (`specjax.settings`): what the CLI makes of a ConfigDict once."""
import dataclasses

import pytest

from configs import bench as bench_config
from configs import generate, generate_tpu
from specjax import build, drafters
from specjax.settings import FIELDS, GenerateSettings, generate_settings


def test_defaults_are_the_main_commands():
    """GenerateSettings() equals configs/generate.py's settings, key for key, and every field is
    a key of that config (so the defaults in the library cannot drift from the config)."""
    c = generate.get_config()
    assert set(FIELDS) <= set(c.keys())
    assert generate_settings(c) == GenerateSettings()
    assert GenerateSettings().to_dict() == {k: (c[k].to_dict() if k == "mesh" else
                                                tuple(c[k]) if isinstance(c[k], (tuple, list)) else c[k])
                                            for k in FIELDS}


def test_a_config_is_typed_once_and_settings_pass_through():
    c = generate_tpu.get_config()
    s = generate_settings(c)
    assert (s.dtype, s.scan_layers, s.fuse_projections, s.cpu_kernel, s.block_tokens) == ("bfloat16", False, False,
                                                                                          "off", -1)
    assert generate_settings(s) is s                          # typed settings are not re-read
    assert s.mesh_axes == {k: int(v) for k, v in c.mesh.items()}
    c.adaptive_gammas = [0, 2]                                  # sequences become tuples
    assert generate_settings(c).adaptive_gammas == (0, 2)
    assert dataclasses.replace(s, gamma=2).gamma == 2 and hash(generate_settings(generate.get_config()))
    # A command's own keys (the bench's drafters, prompts, ...) are not settings: left to it.
    assert generate_settings(bench_config.get_config()).drafter == "hybrid"


@pytest.mark.parametrize("key,value,message", [
    ("dtype", 32, "dtype=32: expected a string"),
    ("scan_layers", "yes", "scan_layers='yes': expected true or false"),
    ("adaptive_gammas", "0,1", "adaptive_gammas='0,1': expected a tuple of integers"),
    ("adaptive_trees", 3, "adaptive_trees=3: expected a tuple of tree strings"),
    ("mesh", {"data": "x"}, "mesh=.*expected axis sizes"),
])
def test_a_setting_of_the_wrong_type_is_named(key, value, message):
    """(A ConfigDict refuses most of these itself, keeping its keys' types; a mapping made in
    code or read from a file does not.)"""
    values = {**generate.get_config().to_dict(), key: value}
    with pytest.raises(ValueError, match=message):
        generate_settings(values)


def test_the_library_reads_the_typed_settings():
    """The build functions take settings (or a ConfigDict, typed on entry) and give the same
    objects; a drafter kind's settings come from the typed attributes."""
    c = generate.get_config()
    c.drafter, c.gamma, c.temperature, c.top_k = "ngram", 5, 0.7, 20
    s = generate_settings(c)
    assert build.generation_config(s, (2,)) == build.generation_config(c, (2,))
    assert build.sampling_config(s) == build.sampling_config(c)
    kind = drafters.drafter_kind("hybrid")
    assert kind.settings_from(s.replace(min_match=2, max_ngram=4)) == \
        kind.settings(hybrid_model="head", min_match=2, max_ngram=4, min_ngram=1, draft_model="")
    with pytest.raises(ValueError, match="gamma=-1"):
        build.check_generation_settings(s.replace(gamma=-1))
    with pytest.raises(TypeError, match="ConfigDict, a mapping or GenerateSettings"):
        generate_settings(["drafter"])


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
