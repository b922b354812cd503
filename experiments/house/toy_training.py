"""Toy distillation runs whose records and exported tensors must not change in a refactor (issue 54).

    python experiments/house/toy_training.py --tree=TREE --label=LABEL
    python experiments/house/toy_training.py --compare=A.jsonl,B.jsonl

For a source tree, runs five small distillations on CPU in one child process (cwd and
PYTHONPATH the tree, so the tree's specjax and configs are imported; each line records
``specjax_file``), on a tiny random target, token data and data-engine shards that the child
writes itself with the tree's public API (their sha256 is in ``inputs``):

* ``draft_onpolicy``: a standalone draft (``target_layers``, layer 0, full vocabulary) on fixed
  data mixed with its own generations, refreshed every 4 steps; JSD; evaluated; exported;
* ``draft_reduced``: a ``fresh`` 1-layer draft with a trained 40-token head (``head_vocab``,
  ``train_head``), reverse KL, 2 micro-batches per update; exported;
* ``eagle_shards``: an EAGLE head (feature regression, feature noise) over a 40-token vocabulary
  on two streamed shard stages (``data.shards``), features cached; exported;
* ``eagle3`` and ``medusa``: heads on fixed data (EAGLE-3 unrolls 2 steps and is evaluated);
  exported.

Configs are configs/distill.py (drafts) and configs/distill_head.py (heads) of the tree, with
the same overrides on every tree (each line also records the tree's HEAD and how many files under
specjax/ and configs/ differ from it). All work happens under one fixed directory (``--work``,
emptied first), so paths inside the records are the same on every tree.

Each run gives one JSON line (printed, and written to experiments/house/results/
toy_training_LABEL.jsonl): ``metrics_sha256`` is the sha256 of metrics.jsonl with the timing
fields removed (`strip_timing`: every key, at any depth, containing "time", "elapsed", "wall",
"per_s", "timestamp", "second" or ending in "_s"; each record re-serialized with sorted keys, one per
line); ``tensors`` the sha256 of each exported tensor (name, dtype, shape and bytes), sorted by
name, and ``tensors_sha256`` one hash over them; ``export_files`` the sha256 of each exported file (the
tensors file as written; its JSON description with timing fields removed, re-serialized with
sorted keys); ``final_loss`` the last training record's loss.
The stripped records stay under WORK/records/LABEL/ for ``--compare``, which prints every field
that differs and the first differing record of a run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve()
RESULTS = HERE.parent / "results"
RUNS = ("draft_onpolicy", "draft_reduced", "eagle_shards", "eagle3", "medusa")
VOCAB = 64
TIMING_PARTS = ("time", "elapsed", "wall", "per_s", "timestamp", "second")


def is_timing(key: str) -> bool:
    k = key.lower()
    return any(p in k for p in TIMING_PARTS) or k.endswith("_s")


def strip_timing(obj):
    """`obj` without timing keys, at any depth; returns (stripped, set of keys removed)."""
    removed = set()

    def go(x):
        if isinstance(x, dict):
            out = {}
            for k, v in x.items():
                if is_timing(k):
                    removed.add(k)
                else:
                    out[k] = go(v)
            return out
        if isinstance(x, list):
            return [go(v) for v in x]
        return x
    return go(obj), removed


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- child: runs inside the tree ------------------------------------------------------------

def write_inputs(root: pathlib.Path) -> dict:
    """A tiny random target (vocabulary 64, 3 layers; tests/_distill_toy.py's shapes), fixed token
    data, an evaluation set and two shard stages of the data engine's format."""
    import jax
    import numpy as np

    from specjax import models
    from specjax.distill import shards
    cfg = models.ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                             head_dim=8, ffn_size=64, max_position=256)
    model = models.Llama(cfg)
    params = jax.tree.map(lambda x: x * 8.0 if x.ndim >= 2 else x, model.init_params(jax.random.key(0)))
    models.export_hf(model, params, root / "target")

    def tokens(path, n, seed):
        rng = np.random.default_rng(seed)
        recs = []
        for _ in range(n):
            toks = rng.integers(0, VOCAB, int(rng.integers(12, 60))).tolist()
            recs.append({"tokens": toks, "prompt_length": int(rng.integers(1, 8))})
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
        return recs

    recs = tokens(root / "data.jsonl", 48, 0)
    tokens(root / "eval.jsonl", 8, 1)
    for d, part in enumerate((recs[0::2], recs[1::2])):
        sd = shards.ShardDir(root / "corpus" / f"stage{d}", {"stage": d}, vocab_size=VOCAB, sources=["toy"])
        for k in range(0, len(part), 6):
            chunk = part[k:k + 6]
            sd.write(k // 6, shards.Sequences(
                [np.asarray(r["tokens"]) for r in chunk],
                [np.arange(len(r["tokens"])) >= r["prompt_length"] for r in chunk], ["toy"] * len(chunk),
                list(range(k, k + len(chunk)))))
    return {str(p.relative_to(root)): sha(p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()}


def run_config(name: str, root: pathlib.Path):
    import ml_collections

    from configs import distill, distill_head
    c = (distill if name.startswith("draft") else distill_head).get_config()
    c.target, c.data_root, c.seed = str(root / "target"), str(root / "cache"), 0
    c.data.update(target_weight=0.0, fixed_weight=1.0, draft_weight=0.0, fixed_jsonl=str(root / "data.jsonl"),
                  widths=(32, 64), tokens_per_batch=256, sampled_samples=0, second_turns=False)
    c.draft.update(layers=(0,), head_vocab=0)
    c.loss.divergence = "fkl"
    c.optim.update(learning_rate=3e-3, warmup_steps=3)
    c.update(budget_tokens=3000, checkpoint_every=5, progress=False, export_dir=str(root / "export" / name),
             export_dtype="float32")
    c.eval.update(every=0, gamma=2, data_jsonl=str(root / "eval.jsonl"), max_new_tokens=16)
    if name == "draft_onpolicy":
        c.draft.kind = "target_layers"
        c.data.update(draft_weight=1.0, draft_refresh_every=4, draft_prompts=6, draft_max_new_tokens=10,
                      gen_batch_size=4, max_prompt_tokens=4)
        c.loss.divergence = "jsd"
        c.eval.every = 6
    elif name == "draft_reduced":
        c.draft.update(kind="fresh", num_layers=1, ffn_size=48, head_vocab=40, train_head=True)
        c.loss.divergence = "rkl"
        c.optim.accumulate = 2
    elif name == "eagle_shards":
        c.draft.update(kind="eagle", head_vocab=40)
        c.data.fixed_weight = 0.0
        c.data.shards.update(dirs=(str(root / "corpus" / "stage0"), str(root / "corpus" / "stage1")),
                             weight=1.0, window=2)
        c.head = ml_collections.ConfigDict({"ttt_steps": 1, "feature_weight": 1.0, "feature_noise": 0.1,
                                            "num_heads": 3, "input_norm": True, "feature_layers": (),
                                            "feature_cache": "float32"})
        c.budget_tokens = 4000
    elif name == "eagle3":
        c.draft.update(kind="eagle3", head_vocab=40)
        c.head.update(ttt_steps=2, num_heads=3, feature_cache="float32")
        c.eval.every = 5
    elif name == "medusa":
        c.draft.kind = "medusa"
        c.head.update(ttt_steps=1, num_heads=3, feature_cache="")
    return c


def tensor_hashes(export: pathlib.Path) -> dict:
    from safetensors.numpy import load_file
    out = {}
    for f in sorted(export.glob("*.safetensors")):
        for k, v in sorted(load_file(str(f)).items()):
            out[f"{f.name}:{k}"] = sha(f"{v.dtype.str}{v.shape}".encode() + v.tobytes())
    return out


def child(args) -> None:
    import specjax
    from specjax import distill
    work = pathlib.Path(args.work)
    shutil.rmtree(work / "run", ignore_errors=True)
    root = work / "run"
    root.mkdir(parents=True)
    inputs = write_inputs(root)
    keep = work / "records" / args.label
    shutil.rmtree(keep, ignore_errors=True)
    keep.mkdir(parents=True)
    for name in args.runs.split(","):
        t0 = time.time()
        summary = distill.train(run_config(name, root), root / "wd" / name, log=lambda m: None)
        records, removed, kept = [], set(), set()
        for line in (root / "wd" / name / "metrics.jsonl").read_text().splitlines():
            rec, gone = strip_timing(json.loads(line))
            records.append(json.dumps(rec, sort_keys=True))
            removed |= gone
            kept |= set(rec)
        (keep / f"{name}.jsonl").write_text("".join(r + "\n" for r in records))
        tensors = tensor_hashes(root / "export" / name)
        files = {}
        for f in sorted((root / "export" / name).iterdir()):
            data = f.read_bytes()
            if f.suffix == ".json":     # the description: its eval record holds eval_s
                data = json.dumps(strip_timing(json.loads(data))[0], sort_keys=True).encode()
                (keep / f"{name}.{f.name}").write_bytes(data)
            files[f.name] = sha(data)
        train = [json.loads(r) for r in records if json.loads(r).get("kind") == "train"]
        line = {"label": args.label, "run": name, "specjax_file": specjax.__file__,
                "final_loss": train[-1]["loss"] if train else None, "steps": summary.get("steps"),
                "tokens": summary.get("tokens"), "metrics_records": len(records),
                "metrics_sha256": sha("".join(r + "\n" for r in records).encode()),
                "timing_keys_removed": sorted(removed), "keys_kept": sorted(kept),
                "tensors_sha256": sha(json.dumps(tensors).encode()),
                "tensors": tensors, "export_files": files, "inputs_sha256": sha(json.dumps(inputs, sort_keys=True).encode()),
                "inputs": inputs, "wall_s_not_compared": round(time.time() - t0, 1)}
        print("TOY " + json.dumps(line), flush=True)


# ---- parent ----------------------------------------------------------------------------------

COMPARED = ("final_loss", "steps", "tokens", "metrics_records", "metrics_sha256", "tensors_sha256", "inputs_sha256",
            "export_files")


def compare(a_path: str, b_path: str, work: str) -> bool:
    a = {r["run"]: r for r in map(json.loads, open(a_path))}
    b = {r["run"]: r for r in map(json.loads, open(b_path))}
    same = True
    for run in sorted(set(a) | set(b)):
        if run not in a or run not in b:
            print(f"{run}: only in {'A' if run in a else 'B'}")
            same = False
            continue
        diff = [f for f in COMPARED if a[run].get(f) != b[run].get(f)]
        diff += [f"tensor {k}" for k in sorted(set(a[run]["tensors"]) | set(b[run]["tensors"]))
                 if a[run]["tensors"].get(k) != b[run]["tensors"].get(k)]
        print(f"{run}: {'identical' if not diff else 'DIFFERS: ' + ', '.join(diff)}"
              f"  (metrics {a[run]['metrics_sha256'][:16]}, tensors {a[run]['tensors_sha256'][:16]})")
        same &= not diff
        kept = [f"{run}.jsonl"] * ("metrics_sha256" in diff) + [
            f"{run}.{f}" for f, h in a[run]["export_files"].items()
            if f.endswith(".json") and h != b[run]["export_files"].get(f)]
        for name in kept:
            ra = pathlib.Path(work, "records", a[run]["label"], name)
            rb = pathlib.Path(work, "records", b[run]["label"], name)
            if ra.exists() and rb.exists():
                la, lb = ra.read_text().splitlines(), rb.read_text().splitlines()
                i = next((i for i, (x, y) in enumerate(zip(la, lb)) if x != y), min(len(la), len(lb)))
                print(f"  {name}: first differing line #{i}:\n  A: {la[i] if i < len(la) else '-'}\n"
                      f"  B: {lb[i] if i < len(lb) else '-'}")
    print("ALL IDENTICAL" if same else "NOT IDENTICAL")
    return same


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", help="source tree whose specjax runs (its repository root)")
    p.add_argument("--label", help="names the results file (toy_training_LABEL.jsonl)")
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--work", default="/tmp/specjax_toy_training", help="emptied and reused; fixed so paths match")
    p.add_argument("--out", default="", help="results file (default experiments/house/results/toy_training_LABEL.jsonl)")
    p.add_argument("--compare", default="", help="A.jsonl,B.jsonl: compare two results files")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.compare:
        sys.exit(0 if compare(*args.compare.split(","), args.work) else 1)
    if args.child:
        return child(args)
    tree = pathlib.Path(args.tree).resolve()
    env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(HERE), "--child", f"--tree={tree}", f"--label={args.label}", f"--runs={args.runs}",
           f"--work={args.work}"]
    proc = subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [json.loads(l[4:]) for l in proc.stdout.splitlines() if l.startswith("TOY ")]
    if proc.returncode != 0:
        sys.exit(f"child failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
    for line in lines:
        if not line["specjax_file"].startswith(str(tree) + os.sep):
            sys.exit(f"imported {line['specjax_file']}, not the tree {tree}")
    git = lambda *a: subprocess.run(["git", "-C", str(tree), *a], capture_output=True, text=True).stdout.strip()
    where = {"tree": str(tree), "tree_head": git("rev-parse", "HEAD"),
             "tree_changed_files": len(git("status", "--porcelain", "--untracked-files=all", "--", "specjax", "configs")
                                       .splitlines())}
    out = pathlib.Path(args.out or RESULTS / f"toy_training_{args.label}.jsonl")
    out.write_text("".join(json.dumps(dict(l, **where)) + "\n" for l in lines))
    for l in lines:
        print(json.dumps({k: l[k] for k in ("run", "final_loss", "metrics_sha256", "tensors_sha256")}))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
