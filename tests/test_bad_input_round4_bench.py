"""Bad input, round 4 (issue 53, item 16 and the bench's part of 11): bench entries.

Before: ``ngram@gamma=4;gamma=5`` ran with gamma 5 (the last value won); ``ngram@draft_model=x``
ran the n-gram drafter as if nothing were said (it reads no model); a directory holding ``@`` or
``;`` could not be named (the entry was split inside the path); ``('ngram', 'ngram')`` ran one
method without a word; ``--config.out=`` a file failed with a FileExistsError traceback.
"""
from __future__ import annotations

import pytest

from specjax import bench


def test_item16_a_setting_given_twice_is_refused():
    with pytest.raises(ValueError, match=r"'ngram@gamma=4;gamma=5': sets gamma twice"):
        bench.entry_changes("ngram@gamma=4;gamma=5")
    assert bench.entry_changes("ngram@gamma=4") == ("ngram", {"drafter": "ngram", "gamma": 4})


def test_item16_a_setting_the_drafter_does_not_read_is_refused():
    with pytest.raises(ValueError, match=r"'draft_model=experiments/heads/eagle-norm' is not KEY=VALUE of a drafting "
                                         r"setting of drafter 'ngram' \(gamma, .*, verifier, max_ngram, min_ngram;"):
        bench.entry_changes("ngram@draft_model=experiments/heads/eagle-norm")
    with pytest.raises(ValueError, match=r"of drafter 'early_exit' \(.*early_exit_layers;"):
        bench.entry_changes("early_exit@max_ngram=2")
    # settings every drafter reads, and a drafter's own, still pass, typed with the bench's other keys
    from experiments.lib import toolkit
    c = toolkit.load_config("configs/bench.py")
    c.drafters = ("hybrid@max_ngram=2;gamma=2;draft_model=d",)
    (_, s), = bench.bench_settings(c).methods
    assert (s.draft.max_ngram, s.gamma, s.draft.draft_model, s.draft.hybrid_model) == (2, 2, "d", "head")


def test_item16_paths_with_at_and_semicolon_can_be_quoted():
    assert bench.entry_changes('head:"runs/a@b;c"@gamma=2') == (
        "head", {"drafter": "head", "draft_model": "runs/a@b;c", "gamma": 2})
    assert bench.entry_changes('hybrid@draft_model="x;y@z";gamma=3')[1] == {
        "drafter": "hybrid", "draft_model": "x;y@z", "gamma": 3}
    with pytest.raises(ValueError, match="double quote is not closed"):
        bench.entry_changes('head:"runs/a@b')


def test_item16_a_repeated_entry_is_refused(tmp_path):
    from experiments.lib import toolkit
    c = toolkit.load_config("configs/bench.py")
    c.drafters = ("ngram", "ngram")
    c.out = str(tmp_path / "out")
    with pytest.raises(ValueError, match=r"'ngram' listed more than once"):
        bench.run(bench.bench_settings(c))
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
        bench.run(bench.bench_settings(c))
    assert target.read_text() == "keep me\n"
