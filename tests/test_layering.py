"""The package's structure, checked from the source (no imports executed).

* Floors: a module of `specjax` imports only from its own floor or floors below it
  (`specjax/__init__.py` lists them; `../shared/DESIGN.md` sketches them).
* No private name (a leading underscore) of one package is used by another package, the
  experiments or the tests, except the package's own modules.

Run as a script to print the import graph between specjax's packages, or between the modules
of one package:

    python tests/test_layering.py            # units (floors)
    python tests/test_layering.py models     # modules of specjax.models
"""

from __future__ import annotations

import ast
import collections
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specjax"

# Lower number = lower floor. A unit is a top-level module or sub-package of specjax.
FLOORS = {
    "sampling": 0, "analysis": 0, "calibration": 0, "checkpoint": 0, "files": 0, "kernels": 0, "specbench": 0, "trees": 0,
    "reporting": 0, "settings": 0,
    "distributed": 0, "constraints": 0,
    "models": 1,
    "verify": 2, "drafters": 2, "sharding": 2,
    "decoding": 3,
    "build": 4,
    "distill": 5, "bench": 5, "serving": 5, "aot": 5, "generate": 5, "serve": 5, "tools": 5,
    "cli": 6, "config_files": 6,
}


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "specjax" and len(parts) > 1 else None


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: pathlib.Path):
    """(imported module, imported name or None, line) for every import in a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[:len(up) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                yield base, a.name, node.lineno


def unit_graph() -> dict[str, set[str]]:
    """Imports between units. A package's ``__main__.py`` is a program (``python -m
    specjax.distill`` runs the `specjax distill` command), not part of its floor: nothing
    imports it, so it may call the CLI on the top floor."""
    graph = collections.defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__main__.py":
            continue
        src = _unit(_module_name(path))
        for module, name, _ in imports(path):
            dst = _unit(module if name is None or module != "specjax" else f"specjax.{name}")
            if src and dst and dst != src:
                graph[src].add(dst)
    return graph


def _private_uses(paths):
    """(file, line, what) for every import of a private specjax name from outside its package."""
    out = []
    for path in paths:
        here = _module_name(path)
        for module, name, line in imports(path):
            if not module.startswith("specjax"):
                continue
            mod_parts = module.split(".")
            names = mod_parts[1:] + ([name] if name else [])
            private_at = next((i for i, n in enumerate(names) if n.startswith("_") and n != "__future__"), None)
            if private_at is None:
                continue
            owner = ".".join(["specjax"] + names[:private_at])
            if (ROOT / (owner.replace(".", "/") + ".py")).is_file():   # a private name of a module:
                owner = owner.rpartition(".")[0]                       # its package owns it
            if not (here == owner or here.startswith(owner + ".")):
                out.append((str(path.relative_to(ROOT)), line, ".".join(["specjax"] + names)))
    return out


def test_every_specjax_unit_has_a_floor():
    units = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())}
    assert units <= set(FLOORS), f"add these to FLOORS: {sorted(units - set(FLOORS))}"


def test_modules_import_only_from_their_floor_or_below():
    bad = [(src, dst) for src, dsts in unit_graph().items() for dst in dsts if FLOORS[dst] > FLOORS[src]]
    assert not bad, f"imports from a higher floor: {bad}"


def test_no_private_names_used_across_packages():
    paths = [*PACKAGE.rglob("*.py"), *(ROOT / "experiments").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    assert not _private_uses(paths)


def test_the_checker_sees_a_private_import(tmp_path, monkeypatch):
    """Negative control: a test file importing a private module is reported."""
    f = ROOT / "tests" / "_layering_probe_tmp.py"
    try:
        f.write_text("from specjax.decoding._engine import Engine\nfrom specjax.decoding import _adaptive\n")
        found = _private_uses([f])
        assert [w for _, _, w in found] == ["specjax.decoding._engine.Engine", "specjax.decoding._adaptive"]
    finally:
        f.unlink()


def module_graph(package: str) -> dict[str, set[str]]:
    """Imports between the modules of one specjax package (names relative to it)."""
    prefix = f"specjax.{package}."
    graph = collections.defaultdict(set)
    for path in sorted((PACKAGE / package).rglob("*.py")):
        src = _module_name(path)
        for module, name, _ in imports(path):
            full = f"{module}.{name}" if name else module
            dst = full if (ROOT / (full.replace(".", "/") + ".py")).is_file() else module
            if src.startswith(prefix) and dst.startswith(prefix) and dst != src:
                graph[src[len(prefix):]].add(dst[len(prefix):])
    return graph


def test_no_import_circles_inside_packages():
    for package in ("models", "decoding", "drafters", "verify", "distill"):
        graph = module_graph(package)

        def reaches(a, b, seen=()):
            return any(n == b or (n not in seen and reaches(n, b, seen + (n,))) for n in graph.get(a, ()))

        circles = [m for m in graph if reaches(m, m)]
        assert not circles, f"specjax.{package}: import circle through {circles}"


if __name__ == "__main__" and len(sys.argv) > 1:
    for module, deps in sorted(module_graph(sys.argv[1]).items()):
        print(f"{module:15s} -> {', '.join(sorted(deps))}")
elif __name__ == "__main__":
    graph = unit_graph()
    for unit in sorted(FLOORS, key=lambda u: (-FLOORS[u], u)):
        print(f"{FLOORS[unit]} {unit:10s} -> {', '.join(sorted(graph.get(unit, ()), key=lambda u: -FLOORS[u])) or '-'}")
    sys.exit(1 if _private_uses([*PACKAGE.rglob("*.py")]) else 0)


def _cross_study_imports(root: pathlib.Path):
    """(file, line, imported module) for every import in a study folder ``experiments/<study>/``
    of another study's module (`experiments.lib` and the study's own modules are fine)."""
    out = []
    for path in sorted((root / "experiments").glob("*/*.py")):
        study = path.parent.name
        if study == "lib":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "experiments" and len(parts) > 1 and parts[1] not in ("lib", study) \
                        and (root / "experiments" / parts[1]).is_dir():
                    out.append((str(path.relative_to(root)), node.lineno, name))
                    break
    return out


def test_no_study_imports_another_study():
    assert not _cross_study_imports(ROOT), _cross_study_imports(ROOT)


def test_the_study_checker_sees_a_cross_import(tmp_path):
    """Negative control: a study importing another study's module is reported."""
    for name, text in (("a", "from experiments.b import run\n"), ("b", "from experiments.lib import toolkit\n")):
        (tmp_path / "experiments" / name).mkdir(parents=True)
        (tmp_path / "experiments" / name / "run.py").write_text(text)
    assert _cross_study_imports(tmp_path) == [("experiments/a/run.py", 1, "experiments.b")]
