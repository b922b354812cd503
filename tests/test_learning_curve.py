"""The heads' learning curve (experiments/learning_curve, issue 38 item 4) on the toy target:
nested data sizes, equal budgets per size, one evaluated record per (kind, size), a rerun that
skips finished points, and the report's table, fit and plot from the JSONL alone."""
import json
import pathlib

import pytest

from experiments.lib import toolkit
from experiments.learning_curve import report, run

import _distill_toy as toy


@pytest.fixture(scope="module")
def curve(tmp_path_factory):
    root = tmp_path_factory.mktemp("curve")
    target_dir = toy.write_target(root / "target")
    data = toy.write_data(root / "data.jsonl", n=64)
    dirs = toy.write_shards(root / "corpus", data)
    c = toolkit.load_config("experiments/learning_curve/config.py", "tiny")
    c.shard_dirs = tuple(dirs)
    c.out = str(root / "results" / "learning_curve.jsonl")
    c.workdir = str(root / "work")
    # one sequence width (64: every toy sequence fits): one train-step program per point, not two
    c.set.update({"target": str(target_dir), "data_root": str(root / "cache"), "checkpoint_every": 5,
                  "data": {"widths": (64,), "tokens_per_batch": 256}, "draft": {"head_vocab": 40},
                  "head": {"feature_cache": ""}, "optim": {"learning_rate": 3e-3, "warmup_steps": 3},
                  "eval": {"data_jsonl": str(toy.write_data(root / "eval.jsonl", n=8, seed=1))}})
    recs = run.run(c, log=lambda m: None)
    return c, recs


def test_points_are_nested_sizes_at_equal_budgets(curve):
    c, recs = curve
    assert [(r["kind_of_head"], r["size"]) for r in recs] == [("eagle", 300), ("eagle3", 300),
                                                              ("eagle", 900), ("eagle3", 900)]
    for size in (300, 900):
        pts = [r for r in recs if r["size"] == size]
        assert len({r["budget_tokens"] for r in pts}) == 1 == len({r["data_loss_tokens"] for r in pts})
        assert pts[0]["budget_tokens"] == run.budget(c, size) == min(max(2 * size, 600), 2000)
        assert pts[0]["data_loss_tokens"] >= size
        assert all(r["train_tokens"] >= r["budget_tokens"] for r in pts)
    small, large = recs[0]["data_loss_tokens"], recs[2]["data_loss_tokens"]
    assert small < large
    for r in recs:
        assert {"greedy_agreement_step1", "greedy_agreement_step2", "alpha_t1",
                "greedy_tokens_per_pass_g2"} <= set(r["eval"])
    assert recs[1]["head"]["ttt_steps"] == 2 and recs[0]["head"]["ttt_steps"] == 1


def test_a_rerun_skips_finished_points_and_the_report_reads_the_jsonl(curve, tmp_path):
    c, recs = curve
    assert run.run(c, log=lambda m: None) == []
    lines = [json.loads(l) for l in open(c.out)]
    assert len(lines) == 4
    md = report.write(c.out)
    text = md.read_text()
    assert text.count("| eagle") == 4 and "per doubling" in text
    se = max((x * (1 - x) / m) ** 0.5 for x, m in [(r["eval"]["greedy_agreement_step1"], r["eval"]["eval_tokens"])
                                                     for r in lines])
    assert f"standard error of agreement k=1 is at most {se:.3f}" in text
    assert md.with_name("learning_curve.png").stat().st_size > 0
    f = report.fit([r for r in lines if r["kind_of_head"] == "eagle"])
    assert f is not None and set(f) == {"a", "b_per_doubling", "tokens_for_aim"}


def test_a_series_of_its_own_is_kept_apart(curve, tmp_path):
    """Points of a named series (another budget rule, e.g. the 'fixed' variant) get their own
    workdirs, are not taken for the main curve's points (nor those for theirs), and have their own
    rows, fit and command in the report."""
    c, _ = curve
    fixed = toolkit.load_config("experiments/learning_curve/config.py", "fixed")
    assert fixed.kinds == ("eagle",) and fixed.min_budget == fixed.max_budget and fixed.series
    c2 = type(c)(c.to_dict())
    c2.kinds, c2.series, c2.min_budget, c2.max_budget = ("eagle",), "fixed-test", 700, 700
    recs = run.run(c2, log=lambda m: None)
    assert [(r["size"], r["series"], r["budget_tokens"]) for r in recs] == [(300, "fixed-test", 700),
                                                                           (900, "fixed-test", 700)]
    assert (pathlib.Path(c.workdir) / "eagle-300-fixed-test").is_dir()
    assert run.run(c2, log=lambda m: None) == [] and run.run(c, log=lambda m: None) == []
    text = report.write(c.out).read_text()
    assert text.count("| eagle (fixed-test) |") == 2 and "- eagle (fixed-test): a = " in text


def test_a_finished_point_exports_its_head_with_its_data_and_evaluation(curve, tmp_path):
    """`run.export_point` writes a finished point's head (to ship it): head.json records the
    point's data tokens, training tokens and its recorded held-out evaluation; nothing trains
    and the point's config.json, final.json and metrics.jsonl are left byte for byte; an
    existing head is not overwritten; a point that has not run, or that ran under another
    config than the curve's, is refused by name."""
    c, recs = curve
    rec = next(r for r in recs if (r["kind_of_head"], r["size"]) == ("eagle3", 900))
    wd = pathlib.Path(c.workdir) / "eagle3-900"
    before = {n: (wd / n).read_bytes() for n in ("config.json", "final.json", "metrics.jsonl")}
    out = run.export_point(c, "eagle3", 900, tmp_path / "head", log=lambda m: None)
    info = json.loads((tmp_path / "head" / "head.json").read_text())["info"]
    assert out["bytes"] > 0 and (tmp_path / "head" / "head.safetensors").is_file()
    assert info["data"]["loss_tokens"]["shards"] == rec["data_loss_tokens"]
    assert info["tokens"] == rec["train_tokens"] and info["steps"] == rec["steps"] and info["ttt_steps"] == 2
    assert info["eval"]["step"] == rec["steps"]
    for k in ("greedy_agreement_step1", "greedy_agreement_step2", "alpha_t1"):
        assert info["eval"][k] == pytest.approx(rec["eval"][k], rel=1e-6), k
    assert {n: (wd / n).read_bytes() for n in before} == before
    with pytest.raises(ValueError, match="already holds a head"):
        run.export_point(c, "eagle3", 900, tmp_path / "head", log=lambda m: None)
    with pytest.raises(ValueError, match="no finished eagle point at 5,000"):
        run.export_point(c, "eagle", 5000, tmp_path / "none", log=lambda m: None)
    other = type(c)(c.to_dict())
    other.epochs = 3.0                       # a larger budget than the point trained for (2,000 > 1,800)
    with pytest.raises(ValueError, match="budget_tokens"):
        run.export_point(other, "eagle3", 900, tmp_path / "other", log=lambda m: None)
    assert not (tmp_path / "other").exists()
    # a damaged record is named, and nothing is written
    final = wd / "final.json"
    kept = final.read_bytes()
    final.write_text("{not json")
    try:
        with pytest.raises(ValueError, match="final.json: unreadable"):
            run.export_point(c, "eagle3", 900, tmp_path / "damaged", log=lambda m: None)
    finally:
        final.write_bytes(kept)
    assert not (tmp_path / "damaged").exists()


def test_an_exported_point_gets_a_training_summary_and_its_row_in_the_heads_table(curve, tmp_path):
    """`run.write_summary` writes a finished point's summary as experiments.heads.train does:
    the heads' training table gives it a row with its shards, data tokens and evaluation, and
    the curve's report does not mistake it for a Spec-Bench-split reference head; an existing
    summary is not overwritten, a point without a record is refused by name."""
    from experiments.heads import training_report
    c, recs = curve
    rec = next(r for r in recs if (r["kind_of_head"], r["size"]) == ("eagle", 900))
    export = {"dir": "heads/eagle-curve", "bytes": 123, "sha256": "ab" * 32}
    path = run.write_summary(c, "eagle", 900, export, tmp_path, "eagle-curve", command="python -m x --size=900")
    s = json.loads(path.read_text())
    assert s["summary"]["export"] == export and s["summary"]["steps"] == rec["steps"]
    assert s["provenance"]["exported_by"] == "python -m x --size=900"
    assert s["provenance"]["config"]["data"]["shards"]["max_loss_tokens"] == 900
    assert (tmp_path / "train-eagle-curve.jsonl").read_bytes() == \
        (pathlib.Path(c.workdir) / "eagle-900" / "metrics.jsonl").read_bytes()
    row = next(line for line in training_report.render(tmp_path).splitlines() if line.startswith("| eagle-curve |"))
    cells = [x.strip() for x in row.strip("|").split("|")]
    assert cells[4] == "shards: stage0, stage1" and cells[5] == str(rec["data_loss_tokens"])
    assert cells[6] == str(rec["train_tokens"]) and cells[9] == toolkit.fmt(rec["eval"]["greedy_agreement_step1"])
    assert report.reference_runs(tmp_path) == []
    with pytest.raises(ValueError, match="exists"):
        run.write_summary(c, "eagle", 900, export, tmp_path, "eagle-curve")
    # experiments.heads.train's rerun of a name replaces its summary, in one rename
    from experiments.lib import head_runs
    head_runs.write_summary(tmp_path, "eagle-curve", {"steps": 1}, {"command": "y"}, tmp_path / "train-eagle-curve.jsonl")
    assert head_runs.read_summary(path)["summary"] == {"steps": 1} and not list(tmp_path.glob("*.partial"))
    with pytest.raises(ValueError, match="holds no record of the eagle point at 5,000"):
        run.write_summary(c, "eagle", 5000, export, tmp_path, "none")
    assert not (tmp_path / "train-none.json").exists()


def _summary(kind, input_norm, tokens, agreement, data=None, shards=0.0, noise=0.0, greedy=1):
    ev = {"greedy_agreement_step1": agreement, "greedy_agreement_step2": agreement / 2,
          "greedy_agreement_step3": agreement / 3, "alpha_t1": agreement, "eval_tokens": 100,
          "greedy_tokens_per_pass_g1": 1 + agreement, "greedy_tokens_per_pass_g2": 1 + agreement / 2}
    s = {"tokens": tokens, "eval": ev, "draft": {"kind": kind, "input_norm": input_norm}}
    if data is not None:
        s["data_loss_tokens"] = {"target": data}
    cfg = {"target": "t", "dtype": "float32", "seed": 0, "head": {"feature_noise": noise},
           "data": {"greedy_samples": greedy, "sampled_samples": 2, "temperature": 1.0, "max_new_tokens": 8,
                    "widths": [32], "shards": {"weight": shards, "dirs": ["a"]}}}
    return {"summary": s, "provenance": {"config": cfg, "command": "x"}}


def test_the_report_sets_the_spec_bench_split_heads_beside_the_curve(tmp_path):
    """The report's scale section lists the EAGLE heads with input norms trained on the Spec-Bench
    split alone (data tokens taken from a run of the same data settings when a summary predates
    that record), ordered by (data, training tokens); other kinds, heads without input norms and
    heads trained on shards are left out."""
    ev = {"greedy_agreement_step1": 0.3, "greedy_agreement_step2": 0.2, "greedy_agreement_step3": 0.1,
          "alpha_t1": 0.3, "eval_tokens": 100, "greedy_tokens_per_pass_g1": 1.3}
    rec = {"kind": "point", "kind_of_head": "eagle", "size": 1000, "series": "", "data_loss_tokens": 1000,
           "train_tokens": 1000, "wall_s": 60.0, "train_tokens_per_s": 16.7, "eval": ev,
           "provenance": {"command": "c", "git_commit": "abc"}}
    rec2 = dict(rec, size=400, data_loss_tokens=400, provenance={"command": "c --sizes=(400,)", "git_commit": "abc"})
    (tmp_path / "learning_curve.jsonl").write_text(json.dumps(rec) + "\n" + json.dumps(rec2) + "\n")
    runs = {"norm-big": _summary("eagle", True, 9000, 0.38),                 # data from "norm-rec" (same settings)
            "norm-rec": _summary("eagle", True, 2000, 0.29, data=500),
            "norm-small": _summary("eagle", True, 9000, 0.32, data=200, greedy=2, noise=0.5),
            "plain": _summary("eagle", False, 9000, 0.28, data=500),
            "three": _summary("eagle3", True, 9000, 0.27, data=500),
            "shards": _summary("eagle", True, 9000, 0.5, data=5000, shards=1.0),
            "no-eval": _summary("eagle", True, 9000, 0.4, data=500)}
    runs["no-eval"]["summary"]["eval"] = {"eval_tokens": 100}        # stopped before its evaluation
    for name, run_ in runs.items():
        (tmp_path / f"train-{name}.json").write_text(json.dumps(run_))
    refs = report.reference_runs(tmp_path)
    assert [(r["name"], r["data_loss_tokens"], r["train_tokens"]) for r in refs] == [
        ("norm-small", 200, 9000), ("norm-rec", 500, 2000), ("norm-big", 500, 9000)]
    text = report.write(tmp_path / "learning_curve.jsonl").read_text()
    section = text.split("## For scale")[1]
    assert "| norm-big | 500 | 9,000 | 0.380 |" in section
    assert "| norm-small (feature noise 0.5) | 200 | 9,000 | 0.320 |" in section
    assert "plain" not in section and "three" not in section and "| shards" not in section and "no-eval" not in section
    # each point's own command, with the sizes it made
    assert "- eagle (400): `c --sizes=(400,)`" in text and "- eagle (1,000): `c`" in text


def test_the_fit_gives_the_slope_error_and_the_aims_data_either_side():
    """On an exact line the slope's standard error is 0 and the data for 0.6 is where the line
    crosses it (2^20 tokens here), on both sides; on noisy points the error is scipy's linregress
    stderr, and a steeper slope needs less data."""
    from scipy import stats

    def pts(ys):
        return [{"data_loss_tokens": 2 ** (10 + i), "eval": {"greedy_agreement_step1": y}} for i, y in enumerate(ys)]

    exact = report.fit(pts([0.10, 0.15, 0.20, 0.25]))
    assert exact["b_per_doubling"] == pytest.approx(0.05) and exact["b_se"] == pytest.approx(0.0, abs=1e-12)
    assert exact["tokens_for_aim"] == pytest.approx(2 ** 20, rel=1e-6)
    assert exact["tokens_for_aim_range"] == pytest.approx((2 ** 20, 2 ** 20), rel=1e-6)
    ys = [0.245, 0.270, 0.270, 0.322]
    noisy = report.fit(pts(ys))
    ref = stats.linregress(range(10, 14), ys)
    assert noisy["b_per_doubling"] == pytest.approx(ref.slope) and noisy["b_se"] == pytest.approx(ref.stderr)
    lo, hi = noisy["tokens_for_aim_range"]
    assert lo < noisy["tokens_for_aim"] < hi
    assert report.fit(pts([0.3, 0.2, 0.1]))["tokens_for_aim"] is None       # falling: never
    assert "b_se" not in report.fit(pts([0.1, 0.2]))                          # two points: no error


def test_step_rate_measures_one_straight_stretch_and_refuses_a_resumed_one(tmp_path):
    """Tokens/s between two steps (the last record of a step counts: a resumed run logs again the
    steps after its checkpoint); a stretch whose elapsed time goes back, or a step with no
    record, is refused with the file named."""
    from experiments.learning_curve import step_rate
    recs = [dict(step=1, tokens=100, elapsed_s=10.0), dict(step=2, tokens=200, elapsed_s=20.0),
            dict(step=3, tokens=300, elapsed_s=99.0), dict(step=3, tokens=300, elapsed_s=30.0),   # rewound, logged again
            dict(step=4, tokens=400, elapsed_s=35.0), dict(step=5, tokens=500, elapsed_s=5.0)]   # 5: a fresh run's clock
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"kind": "train", **r}) + "\n" for r in recs)
                    + json.dumps({"kind": "eval", "step": 4}) + "\n")
    assert step_rate.step_rate(str(path), 1, 3) == pytest.approx(200 / 20.0)
    assert step_rate.step_rate(str(path), 2, 4) == pytest.approx(200 / 15.0)
    with pytest.raises(ValueError, match="not one run"):
        step_rate.step_rate(str(path), 4, 5)
    with pytest.raises(ValueError, match="metrics.jsonl: needs train records at steps 1 and 9"):
        step_rate.step_rate(str(path), 1, 9)
    path.write_text(path.read_text() + "{cut off\n")
    with pytest.raises(ValueError, match="metrics.jsonl: line 8 is not a JSON record"):
        step_rate.step_rate(str(path), 1, 3)
