"""Where a command's config and settings travel: every call that receives them, in order.

`trace_calls` runs a function under `sys.setprofile` (and `threading.setprofile` for threads it
starts) and records, in call order, each call of a function defined in a file under the traced
tree's ``specjax/`` or ``configs/`` that

* is a *stop*: one of its arguments is a config or settings (`is_settings`), or
* is a settings-typing or settings-checking function (`is_settings_function`), stop or not.

The rule for a stop: a call is one when any of its arguments, positional or keyword, is (a) an
ml_collections ``ConfigDict`` (``FrozenConfigDict`` included), or (b) an instance of a frozen
dataclass whose class is defined in a module of a package in `packages` (``specjax``) and whose
name ends in ``Settings`` or ``Job`` (a command's settings, e.g. ``GenerateJob``). The elements of ``*args`` and the values of ``**kwargs`` are
arguments; the contents of other containers are not, nor are attributes of arguments. The first
parameter of a method, when it is named ``self`` or ``cls``, is not an argument (a method called
on a settings object is not a stop for that reason alone). The resumption of a generator is not
a call; its start is.

`counts` turns the ordered stops into the measures of issue 54 (see its docstring); `run_command`
runs one ``specjax`` command in-process under the tracer on the tiny checkpoints of
`experiments/house/tiny.py`. Run as a script (what experiments/house/run.py does, one process
per command, so that no cache of an earlier command hides a call), it writes one command's trace
as JSON:

    cd TREE && PYTHONPATH=TREE python /work/main/experiments/house/trace.py \
        --tree=TREE --fixtures=DIR --command=generate --out=FILE.json
"""

from __future__ import annotations

import ast
import dataclasses
import dis
import os
import pathlib
import sys
import threading

TRACED_DIRS = ("specjax", "configs")
SETTINGS_CHECKS = ("check_config",)          # settings functions whose name does not end in `_settings`
_GENERATOR_FLAGS = 0x20 | 0x80 | 0x200       # CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR
_VARARGS, _VARKEYWORDS = 0x04, 0x08


@dataclasses.dataclass(frozen=True)
class Call:
    file: str          # relative to the traced tree, e.g. specjax/build.py
    function: str      # qualified name within the file
    line: int          # first line of the function
    stop: bool         # an argument is a config or settings
    thread: str        # the thread it ran in

    @property
    def where(self) -> str:
        return f"{self.file}:{self.function}"


def is_settings(value, packages=("specjax",)) -> bool:
    """A config (ConfigDict, FrozenConfigDict) or a settings object (a frozen dataclass of a
    module under `packages` whose class name ends in ``Settings`` or ``Job``)."""
    cls = type(value)
    if cls.__name__.endswith(("Settings", "Job")):
        params = getattr(cls, "__dataclass_params__", None)
        return (params is not None and params.frozen
                and (cls.__module__ or "").split(".")[0] in packages)
    if "ConfigDict" in cls.__name__:
        import ml_collections
        return isinstance(value, ml_collections.ConfigDict)
    return False


def is_settings_function(name: str) -> bool:
    """A function that types or checks settings: ``*_settings``, ``*_job`` or `SETTINGS_CHECKS`."""
    return name.endswith(("_settings", "_job")) or name in SETTINGS_CHECKS


def _arguments(frame):
    """The values of a call's arguments (``*args`` elements and ``**kwargs`` values spread; a
    leading ``self``/``cls`` left out)."""
    code = frame.f_code
    n = code.co_argcount + code.co_kwonlyargcount
    names = code.co_varnames[:n]
    local = frame.f_locals
    out = [local[a] for i, a in enumerate(names) if a in local and not (i == 0 and a in ("self", "cls"))]
    if code.co_flags & _VARARGS:
        out.extend(local.get(code.co_varnames[n], ()))
        n += 1
    if code.co_flags & _VARKEYWORDS:
        out.extend(local.get(code.co_varnames[n], {}).values())
    return out


def _first_resume(code) -> int | None:
    """Byte offset of a code object's first RESUME (where a generator's frame stands when it
    starts), None where there is none (before Python 3.11)."""
    return next((i.offset for i in dis.get_instructions(code) if i.opname == "RESUME"), None)


def trace_calls(fn, *args, root, dirs=TRACED_DIRS, packages=("specjax",), **kwargs):
    """(fn(*args, **kwargs), [Call]): the calls of functions in files under ``root/<dirs>`` that
    are stops or settings functions, in the order they started."""
    root = pathlib.Path(root).resolve()
    where: dict[str, str | None] = {}
    resume: dict = {}
    calls: list[Call] = []

    def relative(filename: str) -> str | None:
        rel = where.get(filename, ...)
        if rel is ...:
            try:
                p = pathlib.Path(filename).resolve().relative_to(root)
                rel = str(p) if p.parts and p.parts[0] in dirs and p.suffix == ".py" else None
            except (ValueError, OSError):
                rel = None
            where[filename] = rel
        return rel

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        rel = relative(code.co_filename)
        if rel is None:
            return
        if code.co_flags & _GENERATOR_FLAGS:
            if code not in resume:
                resume[code] = _first_resume(code)
            if resume[code] is not None and frame.f_lasti != resume[code]:
                return                              # a generator resumed, not started
        stop = any(is_settings(v, packages) for v in _arguments(frame))
        if stop or is_settings_function(code.co_name):
            calls.append(Call(rel, getattr(code, "co_qualname", code.co_name), code.co_firstlineno, stop,
                              threading.current_thread().name))

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        result = fn(*args, **kwargs)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return result, calls


# ----------------------------------------------------------------------------- floors and counts

def floors(tree) -> dict[str, int]:
    """The floor of each unit of specjax (a top-level module or sub-package), read from the tree's
    tests/test_layering.py (its ``FLOORS`` table, parsed, not run)."""
    path = pathlib.Path(tree) / "tests" / "test_layering.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FLOORS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"{path}: no FLOORS table")


def floor_of(file: str, table: dict[str, int]) -> int | None:
    """The floor of a file of the tree: its unit's (``specjax/<unit>.py``, ``specjax/<unit>/...``);
    a file under configs/ is on the CLI's floor (the config files the CLI reads); None for a
    unit the table lacks (``specjax/__init__.py``)."""
    parts = pathlib.PurePath(file).parts
    if parts[0] == "configs":
        return table.get("cli", max(table.values()))
    return table.get(pathlib.PurePath(parts[1]).stem) if len(parts) > 1 else None


def counts(stops: list[str], floor) -> dict:
    """The measures of an ordered list of stops (``file:function``), `floor` mapping a file to
    its floor (or None):

    * ``stops``, ``files``: how many stops, in how many distinct files;
    * ``calls_back_up``: stops whose file's floor is higher than the previous stop's file's floor;
    * ``returns``: stops in a file visited earlier in the sequence but not by the stop just before.
    """
    seen, ups, returns, prev = set(), 0, 0, None
    for s in stops:
        f = s.rpartition(":")[0] if ":" in s else s
        if prev is not None:
            a, b = floor(prev), floor(f)
            ups += a is not None and b is not None and b > a
            returns += f in seen and f != prev
        seen.add(f)
        prev = f
    return {"stops": len(stops), "files": len(seen), "calls_back_up": ups, "returns": returns}


def summary(calls: list[Call], table: dict[str, int]) -> dict:
    """`counts` of the stops among `calls`, the stops as ``file:function`` (in order), the
    files with their floors, and how many times each settings function ran."""
    stops = [c.where for c in calls if c.stop]
    runs: dict[str, int] = {}
    for c in calls:
        if is_settings_function(c.function.rpartition(".")[2]):
            runs[c.where] = runs.get(c.where, 0) + 1
    files = sorted({s.rpartition(":")[0] for s in stops})
    return {**counts(stops, lambda f: floor_of(f, table)),
            "settings_functions": dict(sorted(runs.items(), key=lambda kv: (-kv[1], kv[0]))),
            "file_floors": {f: floor_of(f, table) for f in files},
            "other_threads": sorted({c.thread for c in calls if c.stop and c.thread != "MainThread"}),
            "stop_list": stops}


# ----------------------------------------------------------------------------- the commands

COMMANDS = ("generate", "bench", "distill")


def command_line(command: str, tree, fx: dict, workdir) -> list[str]:
    """``specjax <command> ...`` on the tiny checkpoints `fx` (`tiny.write_all`): the shipped
    config file with the keys a tiny model needs changed, nothing else. generate and bench keep
    the default drafter (the hybrid), over the tiny draft model (``hybrid_model=model``); bench
    adds prompt lookup and an entry with a setting of its own; distill is the toy recipe of
    tests/_distill_toy.py (fixed data, no target generation)."""
    tree, workdir = pathlib.Path(tree), pathlib.Path(workdir)
    tiny_gen = [f"--config.target={fx['target']}", "--config.hybrid_model=model", f"--config.draft_model={fx['draft']}",
                "--config.max_new_tokens=8", "--config.compilation_cache_dir=", "--config.calibration_cache="]
    if command == "generate":
        return ["generate", f"--config={tree / 'configs/generate.py'}", *tiny_gen]
    if command == "bench":
        return ["bench", f"--config={tree / 'configs/bench.py'}", *tiny_gen,
                "--config.drafters=('hybrid','ngram','model@gamma=1')", f"--config.prompts={fx['prompts']}",
                "--config.per_category=0", "--config.num_prompts=2", f"--config.out={workdir / 'bench'}",
                "--config.progress=False"]
    if command == "distill":
        toy = {"target": fx["toy_target"], "data_root": workdir / "distill_root",
               "data.target_weight": 0.0, "data.fixed_weight": 1.0, "data.fixed_jsonl": fx["toy_data"],
               "data.widths": (32, 64), "data.tokens_per_batch": 256, "draft.layers": (0,), "draft.head_vocab": 0,
               "loss.divergence": "fkl", "optim.learning_rate": 3e-3, "optim.warmup_steps": 3,
               "budget_tokens": 2000, "checkpoint_every": 5, "eval.every": 0, "progress": False,
               "export_dtype": "float32"}
        return ["distill", f"--config={tree / 'configs/distill.py'}", f"--workdir={workdir / 'distill'}",
                *(f"--config.{k}={v}" for k, v in toy.items())]
    raise ValueError(f"command={command!r}: expected one of {', '.join(COMMANDS)}")


def run_command(argv: list[str], tree) -> tuple[int, list[Call]]:
    """(exit status, calls) of ``specjax <argv>`` run in this process (`specjax.cli.dispatch`)
    under `trace_calls`, with the tree's specjax (put first on sys.path by the caller)."""
    from specjax import cli
    return trace_calls(cli.dispatch, ["specjax", *argv], root=tree)


def _main(args: list[str]) -> int:
    import argparse
    import json
    import tempfile
    p = argparse.ArgumentParser(description="one command's trace as JSON (experiments/house/run.py runs this)")
    p.add_argument("--tree", required=True)
    p.add_argument("--fixtures", required=True, help="a directory: written when --command=fixtures, read otherwise")
    p.add_argument("--command", required=True, choices=("fixtures", *COMMANDS))
    p.add_argument("--out", default="")
    a = p.parse_args(args)
    tree = str(pathlib.Path(a.tree).resolve())
    sys.path.insert(0, tree)
    import specjax
    if not pathlib.Path(specjax.__file__).resolve().is_relative_to(tree):
        raise SystemExit(f"specjax was imported from {specjax.__file__}, not from {tree}")
    import importlib.util
    spec = importlib.util.spec_from_file_location("house_tiny", pathlib.Path(__file__).with_name("tiny.py"))
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    fixtures = pathlib.Path(a.fixtures)
    if a.command == "fixtures":
        fixtures.mkdir(parents=True, exist_ok=True)
        (fixtures / "fixtures.json").write_text(json.dumps(tiny.write_all(fixtures)))
        return 0
    fx = json.loads((fixtures / "fixtures.json").read_text())
    with tempfile.TemporaryDirectory(prefix="house-") as work:
        argv = command_line(a.command, tree, fx, work)
        rc, calls = run_command(argv, tree)
    record = {"command": a.command, "argv": ["specjax", *argv], "workdir": work, "exit_status": rc,
              "specjax": specjax.__file__,
              "calls": [dataclasses.asdict(c) for c in calls]}
    pathlib.Path(a.out).write_text(json.dumps(record))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    # Run as a script, this file's directory is sys.path[0], where `trace` would shadow the
    # standard library's module of that name: the traced tree takes its place.
    sys.path.pop(0)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(_main(sys.argv[1:]))
