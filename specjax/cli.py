"""The `specjax` command: ``specjax <command> --config=FILE [--config.KEY=VALUE ...]``.

    specjax generate --config=configs/generate.py --config.prompt="..."
    specjax serve    --config=configs/serve.py                 # an OpenAI-compatible server
    specjax bench    --config=configs/bench.py                 # drafters x Spec-Bench categories
    specjax distill  --config=configs/distill.py --workdir=DIR  # run or resume a distillation
    specjax eval     --config=configs/eval.py                  # teacher-forced alpha of a draft
    specjax export   --config=configs/export.py --config.out=DIR

``python -m specjax.cli`` is the same program. This module reads the command line and each
command's ConfigDict, types it once into the command's frozen settings (`generate.generate_job`,
`bench.bench_settings`, `distill.distill_settings`, `tools.eval_job`, ...) and runs the command
on them; nothing below reads a ConfigDict. Every flag and config key is checked before anything
loads: an unknown one is an error that lists the allowed ones; a bad value is an error naming the
key and what it accepts. A generation config accepts the keys of every registered drafter kind
(`specjax.drafters.settings_keys`), with their defaults, besides its own.
"""

from __future__ import annotations

import dataclasses
import errno
import sys
import traceback
from typing import Any, Callable

from ml_collections import config_flags

from specjax import config_files


UsageError = config_files.UsageError


def check_workdir(path) -> None:
    """``--workdir`` of distill and data, before anything runs: not empty or blank (an empty
    value would mean the current directory), and a directory it can create and write into
    (`files.dir_problem`). UsageError naming the flag."""
    from specjax import files
    if path is None or not str(path).strip():
        raise UsageError(f"--workdir={'' if path is None else path!r}: empty; name the run directory "
                         f"(an empty value would mean the current directory)")
    problem = files.dir_problem(path)
    if problem:
        raise UsageError(f"--workdir={path}: {problem}; nothing was run")


# ----------------------------------------------------------------------------- subcommands

def main(c) -> dict:
    """`specjax generate` on a config: typed once (`generate.generate_job`), then run."""
    from specjax import generate
    return generate.main(generate.generate_job(c))


def serve_main(c) -> None:
    """`specjax serve`: the OpenAI-compatible server (`specjax.serve`), typed once, then run."""
    import importlib.util
    missing = [m for m in ("starlette", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"specjax serve needs {' and '.join(missing)}: pip install -e '.[serve]'")
    from specjax import serve
    serve.main(serve.serve_job(c))


def bench_main(c, command: str = "specjax bench") -> list[dict]:
    """`specjax bench`: drafters against target-only decoding per category (`specjax.bench`)."""
    from specjax import bench
    return bench.main(bench.bench_settings(c), command)


def distill_main(c, workdir: str) -> dict:
    """`specjax distill`: run or resume (same command) a distillation in `workdir`."""
    from specjax.distill import train
    return train(c, workdir)


def data_main(c, workdir: str) -> dict:
    """`specjax data` (`tools.data_main`)."""
    from specjax import tools
    return tools.data_main(c, workdir)


def eval_main(c) -> dict:
    """`specjax eval` (`tools.eval_main`)."""
    from specjax import tools
    return tools.eval_main(tools.eval_job(c))


def export_main(c):
    """`specjax export` (`tools.export_main`)."""
    from specjax import tools
    return tools.export_main(tools.export_job(c))


def aot_main(c) -> list[dict]:
    """`specjax aot`: its config and the generation profile it names, typed once here."""
    import pathlib
    from specjax import aot
    if not pathlib.Path(str(c.profile)).expanduser().is_file():
        raise ValueError(f"config.profile: {c.profile!r} is not a file (a configs/generate_*.py profile)")
    profile = config_files.load_config_file(str(c.profile))
    return aot.main(aot.aot_settings(c, profile))


@dataclasses.dataclass(frozen=True)
class Command:
    """One subcommand: what it does, the config file that shows its keys, whether it takes
    --workdir, and ``run(config, workdir, command_line)``."""
    name: str
    summary: str
    config: str
    run: Callable[[Any, str | None, str], Any]
    workdir: bool = False


COMMANDS = {c.name: c for c in (
    Command("generate", "speculative generation on one chat prompt: the text streamed, then one line of stats "
            "(tokens/s, speedup over target-only, mean accepted tokens)", "configs/generate.py",
            lambda c, w, line: main(c)),
    Command("serve", "an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, streaming, "
            "/metrics) over the slot scheduler", "configs/serve.py", lambda c, w, line: serve_main(c)),
    Command("bench", "drafters against target-only decoding over a prompt set (default: held-out Spec-Bench), "
            "per category: speedup, mean accepted tokens, acceptance per position (Markdown + JSONL)",
            "configs/bench.py", lambda c, w, line: bench_main(c, line)),
    Command("distill", "train a draft (DistillSpec) or a feature head into --workdir; the same command resumes",
            "configs/distill.py", lambda c, w, line: distill_main(c, w), workdir=True),
    Command("data", "the data engine: prompts the target writes itself (Magpie), cleaned, and its greedy and "
            "sampled answers, as resumable sha256'd shards in --workdir; the same command resumes",
            "configs/data.py", lambda c, w, line: data_main(c, w), workdir=True),
    Command("eval", "teacher-forced alpha, greedy agreement and tokens per target pass of a draft/target pair "
            "(no wall-clock)", "configs/eval.py", lambda c, w, line: eval_main(c)),
    Command("export", "a model or a draft as a Hugging Face checkpoint directory", "configs/export.py",
            lambda c, w, line: export_main(c)),
    Command("aot", "compile every program (prefill, decode, verification, speculative rounds, training steps) "
            "for a TPU topology without a TPU: memory, bytes per call against the ideal, HLO lint (JSON lines)",
            "configs/aot.py", lambda c, w, line: aot_main(c)),
)}


def usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: specjax <command> --config=FILE [--config.KEY=VALUE ...] [--verbose]", "",
             "commands:"]
    lines += [f"  {c.name:<{width}}  {c.summary} (e.g. --config={c.config})" for c in COMMANDS.values()]
    lines += ["", "specjax <command> --help lists that command's config keys. --config.KEY=VALUE overrides one key "
              "(nested keys with dots: --config.eval.per_category=2); --verbose prints tracebacks of errors.",
              "distill and data also take --workdir=DIR."]
    return "\n".join(lines)


def _config_path(args: list[str]) -> tuple[str, list[str]]:
    """(the --config file, the other arguments): `check_command_line` made sure there is one."""
    for i, a in enumerate(args):
        if a.startswith("--config="):
            return a.split("=", 1)[1], args[:i] + args[i + 1:]
        if a == "--config" and i + 1 < len(args):
            return args[i + 1], args[:i] + args[i + 2:]
    raise UsageError("--config is required")


def _generation_failed():
    from specjax.generate import GenerationFailed
    return GenerationFailed


def check_command_line(cmd: Command, args: list[str]) -> None:
    """Every flag and ``--config.KEY`` of a command line is known, before any parsing or loading:
    a UsageError names the unknown one and lists what is allowed."""
    import difflib
    known = {"config", "verbose", "noverbose"} | ({"workdir"} if cmd.workdir else set())
    config_path, overrides = None, []
    for i, a in enumerate(args):
        if not a.startswith("-") or a == "-":
            continue
        name = a.lstrip("-").split("=", 1)[0]
        if name == "config":
            config_path = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else None)
        elif name.startswith("config."):
            overrides.append(name[len("config."):])
        elif name not in known:
            allowed = ", ".join(f"--{k}" for k in sorted(known - {"noverbose"})) + ", --config.KEY=VALUE"
            raise UsageError(f"specjax {cmd.name}: unknown flag --{name}; expected {allowed}")
    if config_path is None:
        raise UsageError(f"specjax {cmd.name}: --config is required, e.g. --config={cmd.config}")
    if cmd.workdir and not any(a.lstrip("-").split("=", 1)[0] == "workdir" for a in args if a.startswith("-")):
        raise UsageError(f"specjax {cmd.name}: --workdir is required (checkpoints, metrics.jsonl, final.json)")
    c = config_files.load_config(config_path)
    keys = config_files.keys(c)
    for key in overrides:
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UsageError(f"specjax {cmd.name}: unknown config key {key!r} in {config_path}{hint}; its keys: "
                             + ", ".join(keys))


def _expected(args: list[str], error: Exception) -> str:
    """For a ``--config.KEY=VALUE`` that did not parse: the type and default the key has."""
    import re
    m = re.search(r"--config\.([\w.]+)=", str(error))
    path = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), None)
    if m is None or path is None:
        return ""
    value = config_files.load_config(path)
    for part in m.group(1).split("."):
        if not hasattr(value, "items") or part not in value:
            return ""
        value = value[part]
    return f" (expected type {type(value).__name__}, e.g. the default {value!r})"


def describe_config(cmd: Command, path: str) -> str:
    """`specjax <command> --help`: the command, then each key of its config with its default."""
    c = config_files.load_config(path)
    flat = []

    def walk(d, prefix=""):
        for k, v in d.items():
            if hasattr(v, "items"):
                walk(v, prefix + k + ".")
            else:
                flat.append(f"  --config.{prefix}{k}={v!r}")
    walk(c)
    extra = "  --workdir=DIR  (required) checkpoints, metrics.jsonl, final.json\n" if cmd.workdir else ""
    return (f"usage: specjax {cmd.name} --config={path} [--config.KEY=VALUE ...] [--verbose]\n\n{cmd.summary}.\n\n"
            f"{extra}config keys (defaults from {path}):\n" + "\n".join(flat))


def user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that are a user's mistake (a bad setting, a missing or broken file, a
    prompt too long for the cache): shown as one line, not a traceback."""
    from specjax import files, models
    from specjax.models.export import ExportError
    from specjax.models.registry import ModelFetchError
    # OSError: a full disk (ENOSPC), a file size limit (EFBIG), a read-only file system (EROFS),
    # a path that is a file or a symlink loop: one line naming the path (`error_line`).
    return (ValueError, OSError, models.CheckpointError, models.CacheCapacityError, ModelFetchError,
            ExportError, files.WorkdirBusy)


# OS errors of a write that a later run of the same command gets past once the cause is fixed
# (distill and data keep what they finished: checkpoints, shards).
_WRITE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EROFS, errno.EDQUOT, errno.EACCES, errno.EIO)


def error_line(e: BaseException) -> str:
    """The one line of a user error: its message on one line; an OS error as ``PATH: errno
    text`` (``[Errno 28] No space left on device: 'x'`` reads as ``x: No space left on device
    (ENOSPC)``), the second path of a rename or link after an arrow."""
    if isinstance(e, OSError) and e.strerror and e.errno is not None:
        name = errno.errorcode.get(e.errno, str(e.errno))
        paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
        return f"{paths}: {e.strerror} ({name})" if paths else f"{e.strerror} ({name})"
    return " ".join(str(e).split()) or type(e).__name__


def _quiet_backend_probe() -> None:
    """JAX logs at INFO that it could not start a TPU backend on a machine without one; absl's
    handler shows INFO, so on CPU every run starts with that line. Raise only that logger's
    level (one module's logger, nothing else changes)."""
    import logging
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


def dispatch(argv: list[str]) -> int:
    """Run ``specjax <command> ...`` (argv[0] is the program). Returns the exit status: 0, or 2
    for a bad command line or a user error (one line ``specjax: error: ...`` on stderr;
    --verbose adds the traceback)."""
    from absl import flags

    args = list(argv[1:])
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    verbose = any(a in ("--verbose", "--verbose=true", "--verbose=True") for a in rest)
    try:
        if name.startswith("-"):
            raise UsageError(f"name a command before the flags, e.g. specjax generate {' '.join(args)} "
                             f"(commands: {', '.join(COMMANDS)})")
        if name not in COMMANDS:
            raise UsageError(f"unknown command {name!r}: expected one of {', '.join(COMMANDS)} (specjax --help)")
        cmd = COMMANDS[name]
        if any(a in ("-h", "--help", "--helpfull", "--helpshort") for a in rest):
            path = next((a.split("=", 1)[1] for a in rest if a.startswith("--config=")), cmd.config)
            print(describe_config(cmd, path))
            return 0
        check_command_line(cmd, rest)
        fv = flags.FlagValues()       # this call's own flags: dispatch can run twice in one process
        path, rest = _config_path(rest)
        argv_ = [f"specjax {name}", *rest]
        config = config_flags.DEFINE_config_dict("config", config_files.load_config(path), "the command's config",
                                                 flag_values=fv, lock_config=True, sys_argv=argv_)
        flags.DEFINE_boolean("verbose", False, "print the full traceback of an error", flag_values=fv)
        workdir = flags.DEFINE_string("workdir", None, "run directory", flag_values=fv) if cmd.workdir else None
        try:
            extra = fv(argv_)[1:]
        except flags.Error as e:
            raise UsageError(f"specjax {name}: {e}{_expected(rest, e)}") from None
        if extra:
            raise UsageError(f"specjax {name}: unexpected arguments {extra}")
        if cmd.workdir:
            check_workdir(workdir.value)
        _quiet_backend_probe()
        from specjax import build, distributed
        build.tune_xla_cpu()                  # before any backend starts (and no TPU backend without a TPU)
        c = config.value
        build.strict_precision(bool(c.get("strict_precision", False)))   # before any backend starts
        if c.get("distributed", False):       # multi-host: every process runs the command; see launch/
            distributed.initialize()
        cmd.run(c, workdir.value if workdir is not None else None, " ".join(["specjax", name, *rest]))
    except _generation_failed() as e:
        if verbose:
            traceback.print_exc()
        print(f"specjax: error: {error_line(e)}", file=sys.stderr, flush=True)
        return 1
    except user_errors() as e:
        if verbose:
            traceback.print_exc()
        text = error_line(e)
        if isinstance(e, OSError) and e.errno in _WRITE_ERRNOS and name in ("distill", "data"):
            text += "; what was finished is kept: the same command resumes once this is fixed"
        hint = "" if verbose or isinstance(e, UsageError) else " (--verbose for the traceback)"
        print(f"specjax: error: {text}{hint}", file=sys.stderr, flush=True)
        return 2
    return 0


def run(argv: list[str] | None = None):
    """Console entry point (``specjax``, ``python -m specjax.cli``): `dispatch`, then exit with its status."""
    sys.exit(dispatch(sys.argv if argv is None else argv))


if __name__ == "__main__":
    run()
