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
    assert (s.dtype, s.scan_layers, s.cpu_kernel) == ("bfloat16", True, "off")
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
