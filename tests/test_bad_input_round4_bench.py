"""Bad input, round 4 (issue 53, item 16 and the bench's part of 11): bench entries.

Before: ``ngram@gamma=4;gamma=5`` ran with gamma 5 (the last value won); ``ngram@draft_model=x``
ran the n-gram drafter as if nothing were said (it reads no model); a directory holding ``@`` or
``;`` could not be named (the entry was split inside the path); ``('ngram', 'ngram')`` ran one
method without a word; ``--config.out=`` a file failed with a FileExistsError traceback.
"""
from __future__ import annotations

import pytest

from specjax import bench


@pytest.fixture(scope="module")
def base():
    from experiments.lib import toolkit
    return bench.generate_settings(toolkit.load_config("configs/bench.py"))


def test_item16_a_setting_given_twice_is_refused(base):
    with pytest.raises(ValueError, match=r"'ngram@gamma=4;gamma=5': sets gamma twice"):
        bench.drafter_settings(base, "ngram@gamma=4;gamma=5")
    assert bench.drafter_settings(base, "ngram@gamma=4").gamma == 4


def test_item16_a_setting_the_drafter_does_not_read_is_refused(base):
    with pytest.raises(ValueError, match=r"drafter 'ngram' does not read draft_model \(its own settings: "
                                         r"max_ngram, min_ngram\)"):
        bench.drafter_settings(base, "ngram@draft_model=experiments/heads/eagle-norm")
    with pytest.raises(ValueError, match=r"drafter 'early_exit' does not read max_ngram"):
        bench.drafter_settings(base, "early_exit@max_ngram=2")
    # settings every drafter reads, and a drafter's own, still pass
    s = bench.drafter_settings(base, "hybrid@max_ngram=2;gamma=2;draft_model=d")
    assert (s.max_ngram, s.gamma, s.draft_model) == (2, 2, "d")


def test_item16_paths_with_at_and_semicolon_can_be_quoted(base):
    s = bench.drafter_settings(base, 'head:"runs/a@b;c"@gamma=2')
    assert (s.drafter, s.draft_model, s.gamma) == ("head", "runs/a@b;c", 2)
    s = bench.drafter_settings(base, 'hybrid@draft_model="x;y@z";gamma=3')
    assert (s.draft_model, s.gamma) == ("x;y@z", 3)
    with pytest.raises(ValueError, match="double quote is not closed"):
        bench.drafter_settings(base, 'head:"runs/a@b')


def test_item16_a_repeated_entry_is_refused(tmp_path):
    from experiments.lib import toolkit
    c = toolkit.load_config("configs/bench.py")
    c.drafters = ("ngram", "ngram")
    c.out = str(tmp_path / "out")
    with pytest.raises(ValueError, match=r"'ngram' listed more than once"):
        bench.run(c)
    assert not (tmp_path / "out").exists()


def test_item11_bench_out_a_file_is_one_error_before_loading(tmp_path):
    from experiments.lib import toolkit
    c = toolkit.load_config("configs/bench.py")
    c.drafters = ("ngram",)
    target = tmp_path / "a-file"
    target.write_text("keep me\n")
    c.out = str(target)
    c.num_prompts = 1
    with pytest.raises(ValueError, match=r"out=.*a-file.*is a file"):
        bench.run(c)
    assert target.read_text() == "keep me\n"
