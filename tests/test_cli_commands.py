"""The `specjax` command: every subcommand end to end on a tiny random target/draft pair (SmolLM2's
tokenizer, 2-layer target, 1-layer draft), the help texts, and bad command lines."""

import contextlib
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import _cli_tiny
import _distill_toy
from specjax import bench, cli, config_files

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return _cli_tiny.write_pair(tmp_path_factory.mktemp("pair"))


def _dispatch(*args):
    return cli.dispatch(["specjax", *args])


def _quick(target, draft):
    """Overrides that keep a generation on the tiny pair to seconds: fixed gamma (one compiled
    round instead of adaptive gamma's branches), nothing cached on disk."""
    return [f"--config.target={target}", "--config.drafter=model", f"--config.draft_model={draft}",
            "--config.adaptive_gamma=False", "--config.gamma=2", "--config.compilation_cache_dir=",
            "--config.calibration_cache="]


# ----------------------------------------------------------------------------- help and bad lines

def test_help_lists_every_command(capsys):
    """`specjax --help`, in this process (`python -m specjax.cli`, the console entry point, runs
    as a user would in the 2-device test below)."""
    assert _dispatch("--help") == 0
    out = capsys.readouterr().out
    listed = [ln.split()[0] for ln in out.split("commands:")[1].strip().splitlines()[:len(cli.COMMANDS)]]
    assert listed == ["generate", "serve", "bench", "distill", "data", "eval", "export", "aot"]
    for c in cli.COMMANDS.values():
        assert f"--config={c.config}" in out and os.path.isfile(os.path.join(REPO, c.config))


def test_command_help_lists_the_config_keys(capsys):
    assert _dispatch("bench", "--help") == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: specjax bench --config=configs/bench.py")
    assert "--config.drafters=('ngram', 'distilled')" in out and "--config.per_category=1" in out
    assert "--config.drafter=" not in out          # bench replaces generate's single drafter
    assert _dispatch("distill", "--help") == 0
    assert "--workdir=DIR" in capsys.readouterr().out
    assert _dispatch("eval", "--help") == 0
    out = capsys.readouterr().out
    assert "--config.eval.per_category=4" in out and "--config.optim." not in out


@pytest.mark.parametrize("args,message", [
    ((), "usage: specjax <command>"),
    (("gen",), "unknown command 'gen': expected one of generate, serve, bench, distill, data, eval, export, aot"),
    (("--config=configs/generate.py",), "name a command before the flags, e.g. specjax generate --config="),
    (("generate",), "--config is required, e.g. --config=configs/generate.py"),
    (("generate", "--config=configs/nope.py"), "--config=configs/nope.py: no such file"),
    (("generate", "--config=configs/generate.py", "--bogus=1"),
     "unknown flag --bogus; expected --config, --verbose, --config.KEY=VALUE"),
    (("generate", "--config=configs/generate.py", "--workdir=/tmp/x"), "unknown flag --workdir"),
    (("bench", "--config=configs/bench.py", "--config.drafter=ngram"),
     "unknown config key 'drafter' in configs/bench.py (did you mean drafters"),
    (("eval", "--config=configs/eval.py", "--config.eval.per_categori=2"), "(did you mean eval.per_category?)"),
    (("generate", "--config=configs/generate.py", "--config.max_new_tokens=many"), "max_new_tokens"),
    (("generate", "--config=configs/generate.py", "--config.drafter=bogus"),
     "drafter='bogus': expected one of distilled, early_exit, early_exit_own_cache, model, head, parallel, ngram, suffix, "
     "hybrid, none"),
    (("generate", "--config=configs/generate.py", "--config.cpu_kernel=fast"),
     "cpu_kernel='fast': expected one of auto, on, off"),
    (("bench", "--config=configs/bench.py", "--config.drafters=('none',)"), "drafters: 'none' is the target-only"),
    (("bench", "--config=configs/bench.py", "--config.drafters=('head@gama=4',)"),
     "drafters entry 'head@gama=4': 'gama=4' is not KEY=VALUE of a drafting setting"),
    (("bench", "--config=configs/bench.py", "--config.drafters=('head@temperature=1',)"),
     "'temperature=1' is not KEY=VALUE of a drafting setting"),
    (("bench", "--config=configs/bench.py", "--config.drafters=('head@gamma=four',)"),
     "drafters entry 'head@gamma=four': gamma='four' is not a JSON value"),
    (("bench", "--config=configs/bench.py", "--config.drafters=('head@adaptive_gamma=3',)"),
     "drafters entry 'head@adaptive_gamma=3': adaptive_gamma=3: expected true or false"),
    (("bench", "--config=configs/bench.py", "--config.drafters=('head@tree=dynamic:0,4,20',)"), "tree"),
    (("distill", "--config=configs/distill.py"), "--workdir is required"),
    (("eval", "--config=configs/eval.py", "--config.drafter=ngram"),
     "drafter='ngram': expected one of distilled, early_exit, early_exit_own_cache, model"),
    (("export", "--config=configs/export.py"), "out='': name the directory"),
    (("export", "--config=configs/export.py", "--config.what=tokenizer", "--config.out=/tmp/x"),
     "what='tokenizer': expected one of model, draft"),
])
def test_bad_command_lines_exit_2_with_one_line_naming_the_problem(capsys, monkeypatch, args, message):
    from specjax import models

    def no_load(*a, **k):
        raise AssertionError("a model was loaded for a bad command line")

    monkeypatch.chdir(REPO)
    for name in ("load", "load_with_tokenizer"):
        monkeypatch.setattr(models, name, no_load)
    assert _dispatch(*args) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- the commands

@pytest.fixture(scope="module")
def one_device_generate(pair, tmp_path_factory):
    """(stdout, stats record) of `specjax generate` on the tiny pair in this process (one CPU
    device), 10 new tokens: checked below and the one-device answer the 2-device process must print."""
    target, draft = pair
    stats = tmp_path_factory.mktemp("generate") / "stats.jsonl"
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.chdir(REPO)
        rc = _dispatch("generate", "--config=configs/generate.py", *_quick(target, draft), "--config.max_new_tokens=10",
                       f"--config.metrics_jsonl={stats}")
    assert rc == 0
    return out.getvalue(), json.loads(stats.read_text())


def test_generate_on_a_tiny_pair_matches_target_only_greedy(one_device_generate):
    out, rec = one_device_generate
    assert "tokens/s" in out and "speedup" in out and "mean accepted tokens" in out
    assert rec["new_tokens"] == 10 and rec["drafter"] == "model" and rec["same_tokens_as_target_only"] is True
    assert rec["proposed"] > 0 and rec["target_passes"] <= 10


def test_a_bench_entry_may_draft_with_a_model_of_its_own():
    """``hybrid@draft_model=<dir>``: the hybrid drafter with another head beside the default's,
    in one bench run (the other settings as the bench's)."""
    from experiments.lib import toolkit
    c = toolkit.load_config("configs/bench.py")
    c.drafters = ("hybrid@draft_model=experiments/heads/eagle-norm;gamma=2", "hybrid")
    s = bench.bench_settings(c)
    (_, own), (_, plain) = s.methods
    assert (own.drafter, own.draft.draft_model, own.gamma) == ("hybrid", "experiments/heads/eagle-norm", 2)
    assert own.replace(draft=plain.draft, gamma=plain.gamma) == plain
    assert plain.draft.draft_model == "" and plain == s.baseline.replace(drafter="hybrid")
    assert bench.entry_changes("head:dir@gamma=2") == ("head", {"drafter": "head", "draft_model": "dir", "gamma": 2})
    with pytest.raises(ValueError, match="sets draft_model twice"):
        bench.entry_changes("head:experiments/heads/eagle-engine@draft_model=experiments/heads/eagle-norm")


def test_bench_on_a_tiny_pair_writes_the_per_category_table(pair, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    target, draft = pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(d) for d in [
        {"question_id": 7, "category": "alpha", "turns": ["Count from one to ten.", "ignored second turn"]},
        {"prompt": "Name three colours.", "category": "beta"},
        {"prompt": "A third prompt, cut by num_prompts."}]) + "\n")
    out = tmp_path / "out"
    assert _dispatch("bench", "--config=configs/bench.py", *_quick(target, draft)[:1], *_quick(target, draft)[2:],
                     "--config.drafters=('model','ngram','model@gamma=1')", f"--config.prompts={prompts}",
                     "--config.per_category=0",
                     "--config.num_prompts=2", "--config.max_new_tokens=8", f"--config.out={out}",
                     "--config.progress=False") == 0
    assert "model:" in capsys.readouterr().out
    recs = [json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in recs].count("setup") == 1 and recs[0]["machine"]["cpu"]
    runs = [r for r in recs if r["kind"] == "run"]
    assert sorted((r["method"], r["id"]) for r in runs) == sorted(
        (m, i) for m in ("target_only", "model", "ngram", "model@gamma=1") for i in (7, 2))
    # the entry with its own gamma drafts one token a round (its acceptance is tested at one position)
    assert all(len(r["tested_at"]) == 1 for r in runs if r["method"] == "model@gamma=1")
    assert any(len(r["tested_at"]) > 1 for r in runs if r["method"] == "model")
    assert {r["category"] for r in runs} == {"alpha", "beta"}
    for r in runs:
        assert r["new_tokens"] == 8 and r["committed"] == 8 and r["rounds"] >= 1
        assert r["same_as_target_only"] is (None if r["method"] == "target_only" else True)    # greedy
    sums = {(r["method"], r["category"]): r for r in recs if r["kind"] == "summary"}
    assert set(sums) == {(m, c) for m in ("target_only", "model", "ngram", "model@gamma=1")
                         for c in ("alpha", "beta", "all")}
    model_all = sums["model", "all"]
    rs = [r for r in runs if r["method"] == "model"]
    assert model_all["mean_accepted_tokens"] == pytest.approx(sum(r["committed"] for r in rs) / sum(r["rounds"] for r in rs))
    tested = np.sum([r["tested_at"] for r in rs], axis=0)
    assert model_all["acceptance_at"][0] == pytest.approx(np.sum([r["accepted_at"] for r in rs], axis=0)[0] / tested[0])
    base = [r for r in runs if r["method"] == "target_only"]
    rate = lambda xs: sum(r["decode_tokens"] for r in xs) / sum(r["decode_s"] for r in xs)   # noqa: E731
    assert model_all["speedup"] == pytest.approx(rate(rs) / rate(base))
    assert sums["target_only", "all"]["speedup"] == pytest.approx(1.0)
    assert model_all["same_as_target_only"] == "2/2"
    md = (out / "results.md").read_text()
    assert "| method | alpha | beta | all |" in md and "## Mean accepted tokens per target pass" in md
    assert bench.markdown(recs) == md                       # the table is rebuilt from the JSONL alone
    # experiments/spec_bench (the same command with its config) draws its plot from this JSONL alone
    from experiments.lib import toolkit
    from experiments.spec_bench import plot as spec_plot
    assert spec_plot.plot(out / "results.jsonl")[0].stat().st_size > 10_000
    for variant in ("", "tiny"):
        assert toolkit.load_config("experiments/spec_bench/config.py", variant).drafters


def test_a_broken_config_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("def get_config(:\n")
    assert _dispatch("generate", f"--config={bad}") == 2
    err = capsys.readouterr().err
    assert f"--config={bad}: the file does not run (SyntaxError" in err and "Traceback" not in err
    bad.write_text("def get_config():\n    raise KeyError('x')\n")
    assert _dispatch("generate", f"--config={bad}") == 2
    assert "get_config() failed (KeyError" in capsys.readouterr().err


def test_bench_prompt_file_errors_name_the_line(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"turns": []}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: expected 'turns'"):
        bench.load_prompts(str(bad))
    bad.write_text('{"prompt": "fine"}\nnot json\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: not JSON"):
        bench.load_prompts(str(bad))
    held = bench.load_prompts("", per_category=1)
    assert len(held) == 13 and all(p["id"] % 4 == 0 for p in held)      # the held-out split, one per category


def test_eval_gives_the_same_numbers_for_one_draft_named_two_ways(pair, tmp_path, capsys, monkeypatch):
    """The target's first layer as `early_exit` and the same layer written as a checkpoint
    (`model`) are one draft: identical teacher-forced figures. (The 6 sequences, at most 60 tokens,
    in one batch of 8 rows x 64 positions instead of configs/distill.py's 16 x 256: the figures
    cover the full 49,152-token vocabulary at every position.)"""
    monkeypatch.chdir(REPO)
    target, draft = pair
    data = _distill_toy.write_data(tmp_path / "data.jsonl", n=6)
    common = ["--config=configs/eval.py", f"--config.target={target}", f"--config.eval.data_jsonl={data}",
              f"--config.data_root={tmp_path / 'root'}", "--config.gammas=(1,3)", f"--config.out={tmp_path / 'e.jsonl'}",
              "--config.data.widths=(64,)", "--config.data.tokens_per_batch=512"]
    assert _dispatch("eval", *common, "--config.drafter=early_exit", "--config.early_exit_layers=1") == 0
    assert _dispatch("eval", *common, "--config.drafter=model", f"--config.draft_model={draft}") == 0
    a, b = [json.loads(ln) for ln in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert (a["drafter"], b["drafter"]) == ("early_exit", "model")
    for key in ("alpha_t1", "greedy_agreement", "greedy_tokens_per_pass_g1", "greedy_tokens_per_pass_g3"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    assert 0 < a["alpha_t1"] <= 1 and a["eval_tokens"] > 0
    assert 1 <= a["greedy_tokens_per_pass_g1"] <= 2 and 1 <= a["greedy_tokens_per_pass_g3"] <= 4
    assert _dispatch("eval", *common, "--config.drafter=early_exit", "--config.early_exit_layers=3") == 2
    assert "early_exit_layers=3: expected 1..2" in capsys.readouterr().err


def test_export_a_model_and_a_reduced_draft(pair, tmp_path, capsys, monkeypatch):
    import jax

    from specjax import models
    from specjax.models import draft_artifact, reduced_head
    monkeypatch.chdir(REPO)
    target, _ = pair
    out = tmp_path / "model"
    assert _dispatch("export", "--config=configs/export.py", f"--config.source={target}", f"--config.out={out}") == 0
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    m0, p0, tok0 = models.load_with_tokenizer(str(target))
    m1, p1, tok1 = models.load_with_tokenizer(str(out))
    assert m1.config == m0.config and tok1.encode("Hello there") == tok0.encode("Hello there")
    for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # nothing already written is lost: a second export into the same directory is refused
    assert _dispatch("export", "--config=configs/export.py", f"--config.source={target}", f"--config.out={out}") == 2
    assert "exists and is not an empty directory; nothing was written" in capsys.readouterr().err

    # a reduced-vocabulary draft becomes a full-vocabulary checkpoint, its tokens listed beside it
    tm, tp = models.load(str(target))
    dp, dcfg = models.truncate_layers(models.canonical_params(tp, tm.config), tm.config.replace(scan_layers=True), 1)
    ids = np.arange(0, 2000, 7)
    rm, rp = reduced_head.reduce_head(models.Llama(dcfg), dp, ids)
    draft_artifact.save_draft(tmp_path / "d", rm, rp, shared=("embed", "head_from_embed"), dtype="float32")
    hf = tmp_path / "hf"
    assert _dispatch("export", "--config=configs/export.py", "--config.what=draft", f"--config.source={tmp_path / 'd'}",
                     f"--config.target={target}", f"--config.out={hf}") == 0
    assert json.loads((hf / "head_ids.json").read_text())["head_ids"] == ids.tolist()
    em, ep = models.load(str(hf))
    assert em.config.num_layers == 1 and em.vocab_size == _cli_tiny.VOCAB


def test_an_interrupted_bench_keeps_the_earlier_results(pair, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    target, _ = pair
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.jsonl").write_text('{"kind": "setup", "earlier": true}\n')
    calls = []

    def failing(*args):
        calls.append(1)
        raise RuntimeError("interrupted")

    monkeypatch.setattr(bench, "_run_one", failing)
    with pytest.raises(RuntimeError, match="interrupted"):
        cli.bench_main(_bench_config(target, out))
    assert calls and (out / "results.jsonl").read_text() == '{"kind": "setup", "earlier": true}\n'
    assert (out / "results.jsonl.partial").is_file()      # what the interrupted run had written


def _bench_config(target, out):
    c = config_files.load_config_file("configs/bench.py")
    c.update({"target": str(target), "drafters": ("ngram",), "num_prompts": 1, "max_new_tokens": 4,
              "out": str(out), "progress": False, "adaptive_gamma": False, "gamma": 2, "compilation_cache_dir": ""})
    return c


def test_generate_on_two_host_devices_uses_the_mesh_and_prints_the_same_answer(pair, one_device_generate, tmp_path):
    """`specjax generate` in a process with 2 CPU devices (`--xla_force_host_platform_device_count=2`)
    runs on the generation config's mesh (model=-1: tensor parallel over both) and streams the
    same greedy answer as the one-device run (`one_device_generate`, in this process),
    speculative equal to target-only. (The subprocess inherits this process's XLA options,
    tests/conftest.py: both compile with XLA's backend code generation turned down, the same
    optimized HLO up to a few fusion decisions, compiled faster.)"""
    target, draft = pair
    stats = tmp_path / "stats2.jsonl"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip(),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "specjax.cli", "generate", "--config=configs/generate.py",
                        *_quick(target, draft), "--config.max_new_tokens=10", f"--config.metrics_jsonl={stats}"],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    one_out, one_rec = one_device_generate
    two_out, two_rec = r.stdout.split("[specjax]")[0], json.loads(stats.read_text())
    assert one_rec["mesh"] is None
    assert two_rec["mesh"] == {"data": 1, "fsdp": 1, "model": 2}
    assert two_out == one_out.split("[specjax]")[0] and two_out.strip()
    assert two_rec["same_tokens_as_target_only"] is True and two_rec["new_tokens"] == 10


def test_data_command_writes_resumable_shards(pair, tmp_path, capsys):
    """`specjax data` end to end (13 Spec-Bench prompts, 2 Magpie requests, 2-token answers); run
    again, it finds every stage complete and generates nothing."""
    target, _ = pair
    args = ["data", "--config=configs/data.py", f"--workdir={tmp_path}", f"--config.generate.target={target}",
            "--config.generate.cpu_kernel=off", "--config.spec_bench_per_category=1", "--config.magpie.requests=2",
            "--config.magpie.max_new_tokens=3", "--config.responses.max_new_tokens=2", "--config.responses.sampled=False",
            "--config.followup.requests=0", "--config.batch_size=8"]
    assert _dispatch(*args) == 0
    out = capsys.readouterr().out
    kept = json.loads((tmp_path / "corpus_report.json").read_text())["total"]["kept"]
    assert kept >= 12 and f"responses_greedy {kept} seqs" in out and "instructions 2 seqs" in out
    manifest = json.loads((tmp_path / "responses_greedy" / "manifest.json").read_text())
    assert sum(e["sequences"] for e in manifest["shards"].values()) == kept
    before = (tmp_path / "responses_greedy" / "manifest.json").read_bytes()
    assert _dispatch(*args) == 0
    assert (tmp_path / "responses_greedy" / "manifest.json").read_bytes() == before
    assert _dispatch("data", "--config=configs/data.py") == 2          # --workdir is required
    assert "--workdir is required" in capsys.readouterr().err


def test_accelerator_profiles_run_on_eight_host_devices(pair, tmp_path):
    """`specjax generate --config=configs/generate_{tpu,gpu}.py`, both in one process with 8 CPU
    devices (`cli.dispatch` of each command line in turn, each call with its own flags, as
    `python -m specjax.cli` dispatches one): each profile's layout (bfloat16, no CPU kernel,
    unrolled layers; fused projections on GPU) on a mesh of all 8 on the model axis; speculative
    output equal to target-only's in the same run. (XLA options as this process's,
    tests/conftest.py.)"""
    target, draft = pair
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip(),
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    runs = [["generate", f"--config=configs/generate_{p}.py", *_quick(target, draft), "--config.max_new_tokens=8",
             f"--config.metrics_jsonl={tmp_path / p}.jsonl"] for p in ("tpu", "gpu")]
    script = ("import json, sys\nfrom specjax import cli\n"
              "sys.exit(max(cli.dispatch(['specjax', *a]) for a in json.loads(sys.argv[1])))")
    r = subprocess.run([sys.executable, "-c", script, json.dumps(runs)], capture_output=True, text=True, cwd=REPO,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for p in ("tpu", "gpu"):
        row = json.loads((tmp_path / f"{p}.jsonl").read_text())
        assert row["mesh"] == {"data": 1, "fsdp": 1, "model": 8}, p
        assert row["same_tokens_as_target_only"] is True and row["new_tokens"] == 8, p
