"""A command's config file: ``get_config()`` of a configs/*.py file, with every registered drafter
kind's keys in a generation config (`with_drafter_keys`), as the CLI and the experiments read it."""

from __future__ import annotations

import sys


class UsageError(ValueError):
    """A bad command line: unknown command, flag or config key, missing --config, a config file
    that is missing, does not run or defines no working ``get_config()``."""


def load_config_file(path: str):
    """``get_config()`` of a config file. A file in a ``configs`` package directory may import
    its siblings (``from configs import generate``): that directory's parent goes on sys.path."""
    import importlib.util
    import pathlib
    p = pathlib.Path(path).expanduser()
    if not p.is_file():
        raise UsageError(f"--config={path}: no such file")
    if p.parent.name == "configs" and (p.parent / "__init__.py").is_file():
        root = str(p.resolve().parent.parent)
        if root not in sys.path:
            sys.path.insert(0, root)
    spec = importlib.util.spec_from_file_location(f"_specjax_config_{p.stem}", p)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:            # a broken config file: one line naming it, not a traceback
        raise UsageError(f"--config={path}: the file does not run ({type(e).__name__}: {e})") from e
    if not hasattr(module, "get_config"):
        raise UsageError(f"--config={path}: the file defines no get_config()")
    try:
        return module.get_config()
    except Exception as e:
        raise UsageError(f"--config={path}: get_config() failed ({type(e).__name__}: {e})") from e


def with_drafter_keys(c):
    """``c`` with every registered drafter kind's settings keys (`drafters.settings_keys`, their
    defaults) added to each generation block that lacks them: the config itself, or a nested
    block, when it names a ``drafter`` or ``drafters``. A kind registered anywhere (a user's own
    module) is then set from the command line like a built-in one."""
    from specjax import drafters
    blocks = [c] + [v for v in c.values() if hasattr(v, "items")]
    for block in blocks:
        if "drafter" in block or "drafters" in block:
            for key, default in drafters.settings_keys().items():
                if key not in block:
                    block[key] = default
    return c


def load_config(path: str):
    """A command's config file, with the drafter keys (`with_drafter_keys`)."""
    return with_drafter_keys(load_config_file(path))


def keys(c, prefix="") -> list[str]:
    out = []
    for k, v in c.items():
        out.append(prefix + k)
        if hasattr(v, "items"):
            out += keys(v, prefix + k + ".")
    return out
