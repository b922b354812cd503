"""How a command's config and settings travel through a tree of specjax (issue 54), and its size.

    python -m experiments.house.run --tree=TREE --label=LABEL [--commands=generate,bench,distill]

Writes experiments/house/results/LABEL.jsonl: one line per command (``kind: command``) and one
line on the size of the tree's specjax (``kind: code``). Each command runs in its own process
(`experiments/house/trace.py` as a script, cwd and PYTHONPATH the tree, so that the tree's
specjax is the one imported and no cache of an earlier command hides a call), on tiny
checkpoints written once by another such process (`experiments/house/tiny.py`). The stop rule
and the counts are `trace`'s; README.md says them in words.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

from experiments.house import trace

HERE = pathlib.Path(__file__).resolve().parent
MAIN_OF = {"generate": "generate_main", "bench": "bench_main", "distill": "distill_main"}


def _log(msg: str):
    print(f"[house {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _child(tree: pathlib.Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.setdefault("JAX_PLATFORMS", "cpu")
    return subprocess.Popen([sys.executable, str(HERE / "trace.py"), f"--tree={tree}", *args], cwd=tree, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(p: subprocess.Popen, what: str) -> None:
    out, _ = p.communicate()
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {p.returncode}):\n{out[-4000:]}")


def from_main(stops: list[str], command: str, table: dict) -> dict | None:
    """`trace.counts` of the stops from the first call of the command's ``cli.<command>_main``
    on (None when it was not called)."""
    start = f"specjax/cli.py:{MAIN_OF[command]}"
    if start not in stops:
        return None
    return trace.counts(stops[stops.index(start):], lambda f: trace.floor_of(f, table))


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, lines from the def to the last line) of every function, nested ones too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node.end_lineno - node.lineno + 1
            yield from _functions(node, prefix + node.name + ".<locals>.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def code_size(tree, top: int = 10) -> dict:
    """Lines per module of the tree's specjax, and its `top` largest functions by lines (via ast)."""
    root = pathlib.Path(tree)
    modules, functions = {}, []
    for path in sorted((root / "specjax").rglob("*.py")):
        rel = str(path.relative_to(root))
        text = path.read_text()
        modules[rel] = len(text.splitlines())
        functions += [(n, f"{rel}:{name}") for name, n in _functions(ast.parse(text, filename=rel))]
    functions.sort(key=lambda x: (-x[0], x[1]))
    return {"total_lines": sum(modules.values()), "modules": modules,
            "largest_functions": [{"function": f, "lines": n} for n, f in functions[:top]]}


def source_digest(tree) -> str:
    """sha256 over the tree's specjax/ and configs/ sources (path and bytes of each .py file)."""
    h = hashlib.sha256()
    root = pathlib.Path(tree)
    for path in sorted([*(root / "specjax").rglob("*.py"), *(root / "configs").glob("*.py")]):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _placeholders(argv: list[str], paths: dict[str, str]) -> list[str]:
    out = []
    for a in argv:
        for name, p in paths.items():
            a = a.replace(p, f"<{name}>")
        out.append(a)
    return out


def main(tree, label: str, commands=trace.COMMANDS, out_dir=HERE / "results") -> pathlib.Path:
    tree = pathlib.Path(tree).resolve()
    table = trace.floors(tree)
    common = {"label": label, "tree": str(tree), "source_sha256": source_digest(tree),
              "cpu_kernel_library": any((tree / "specjax" / "kernels").glob("_panel_matmul*.so")),
              "python": platform.python_version()}
    lines = []
    with tempfile.TemporaryDirectory(prefix="house-") as tmp:
        fixtures, work = pathlib.Path(tmp) / "fixtures", pathlib.Path(tmp) / "traces"
        work.mkdir()
        _log(f"tiny checkpoints in {fixtures}")
        _finish(_child(tree, f"--fixtures={fixtures}", "--command=fixtures"), "writing the fixtures")
        started = {c: _child(tree, f"--fixtures={fixtures}", f"--command={c}", f"--out={work / c}.json")
                   for c in commands}
        for command, p in started.items():
            _finish(p, f"tracing {command}")
            rec = json.loads((work / f"{command}.json").read_text())
            s = trace.summary([trace.Call(**c) for c in rec["calls"]], table)
            _log(f"{command}: {s['stops']} stops in {s['files']} files, {s['calls_back_up']} calls back up a floor, "
                 f"{s['returns']} returns to a file already left")
            lines.append({"kind": "command", "command": command, **common,
                          "argv": _placeholders(rec["argv"], {"fixtures": str(fixtures), "work": rec["workdir"],
                                                              "tree": str(tree)}),
                          "exit_status": rec["exit_status"], "specjax_imported_from": rec["specjax"],
                          **{k: s[k] for k in ("stops", "files", "calls_back_up", "returns")},
                          "from_main": from_main(s["stop_list"], command, table),
                          **{k: v for k, v in s.items() if k not in ("stops", "files", "calls_back_up", "returns")}})
    lines.append({"kind": "code", **common, **code_size(tree)})
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{label}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    _log(f"wrote {path}")
    return path


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", default=".", help="the tree whose specjax is traced (default: the current directory)")
    p.add_argument("--label", required=True, help="results/<label>.jsonl")
    p.add_argument("--commands", default=",".join(trace.COMMANDS))
    a = p.parse_args()
    main(a.tree, a.label, tuple(c for c in a.commands.split(",") if c))
