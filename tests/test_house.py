"""The measurement of experiments/house (how a command's config and settings travel, issue 54)
on a made-up package whose call chain and floors are known: the tracer's stops, the counts,
the floors table, the size report."""

import pathlib
import sys
import textwrap

import ml_collections
import pytest

from experiments.house import run as house_run
from experiments.house import trace

PKG = "house_probe_pkg"

FILES = {
    "__init__.py": "",
    "low.py": """
        import dataclasses

        @dataclasses.dataclass(frozen=True)
        class RunSettings:
            width: int = 1

            def describe(self):
                return str(self.width)

        @dataclasses.dataclass
        class LooseSettings:
            width: int = 1

        def run_settings(c):
            return RunSettings(width=int(c.width))

        def check_settings(s):
            return s
    """,
    "mid.py": """
        from house_probe_pkg import low

        def prepare(s):
            low.check_settings(s)
            squares = [x * x for x in (1, 2)]
            return sum(steps(s)) + len(squares)

        def steps(s):
            yield 1
            yield 2
            yield 3

        def plain(n):
            return n
    """,
    "top.py": """
        from house_probe_pkg import low, mid
        from house_probe_outside import other

        def main(c):
            s = low.run_settings(c)
            mid.prepare(s)
            mid.plain(3)
            low.check_settings(5)
            s.describe()
            other.elsewhere(s)
            unused(low.LooseSettings())
            finish(s=s)
            spread(1, s)
            return s

        def finish(**kw):
            return kw

        def spread(*args):
            return args

        def unused(x):
            return x
    """,
}


@pytest.fixture
def probe(tmp_path, monkeypatch):
    for name, text in FILES.items():
        (tmp_path / PKG).mkdir(exist_ok=True)
        (tmp_path / PKG / name).write_text(textwrap.dedent(text))
    (tmp_path / "house_probe_outside").mkdir()
    (tmp_path / "house_probe_outside" / "__init__.py").write_text("")
    (tmp_path / "house_probe_outside" / "other.py").write_text("def elsewhere(s):\n    return s\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for m in [m for m in sys.modules if m.startswith((PKG, "house_probe_outside"))]:
        del sys.modules[m]


def test_the_tracer_finds_every_stop_in_order_and_counts_them(probe):
    import importlib
    top = importlib.import_module(f"{PKG}.top")
    c = ml_collections.FrozenConfigDict({"width": 4})
    result, calls = trace.trace_calls(top.main, c, root=probe, dirs=(PKG,), packages=(PKG,))
    assert result.width == 4
    stops = [f"{pathlib.PurePath(c.file).name}:{c.function}" for c in calls if c.stop]
    # not stops: mid.plain (an int), check_settings(5), the settings' own method (self),
    # a list comprehension, the generator's resumptions, a non-frozen *Settings, a file outside
    assert stops == ["top.py:main", "low.py:run_settings", "mid.py:prepare", "low.py:check_settings",
                     "mid.py:steps", "top.py:finish", "top.py:spread"]
    table = {"top": 2, "mid": 1, "low": 0}
    s = trace.summary(calls, table)
    assert {k: s[k] for k in ("stops", "files", "calls_back_up", "returns")} == {
        "stops": 7, "files": 3, "calls_back_up": 3, "returns": 3}
    assert s["settings_functions"] == {f"{PKG}/low.py:check_settings": 2, f"{PKG}/low.py:run_settings": 1}
    assert s["file_floors"] == {f"{PKG}/low.py": 0, f"{PKG}/mid.py": 1, f"{PKG}/top.py": 2}
    assert s["other_threads"] == []
    assert house_run.from_main([f"{PKG}/x.py:a", "specjax/cli.py:bench_main", f"{PKG}/x.py:b"], "bench", table) == {
        "stops": 2, "files": 2, "calls_back_up": 0, "returns": 0}


def test_counts_of_a_hand_made_sequence():
    floor = {"specjax/cli.py": 6, "specjax/build.py": 4, "specjax/settings.py": 0}.get
    stops = ["specjax/cli.py:main", "specjax/build.py:a", "specjax/settings.py:s", "specjax/build.py:b",
             "specjax/build.py:c", "specjax/settings.py:s", "specjax/cli.py:d"]
    # up: settings -> build, settings -> cli; returns: build, settings, cli
    assert trace.counts(stops, floor) == {"stops": 7, "files": 3, "calls_back_up": 2, "returns": 3}
    assert trace.counts([], floor) == {"stops": 0, "files": 0, "calls_back_up": 0, "returns": 0}


def test_the_floors_are_the_layering_tests_table():
    root = pathlib.Path(__file__).resolve().parents[1]
    table = trace.floors(root)
    assert table["cli"] > table["build"] > table["settings"]
    assert trace.floor_of("specjax/distill/_loop.py", table) == table["distill"]
    assert trace.floor_of("specjax/build.py", table) == table["build"]
    assert trace.floor_of("configs/generate.py", table) == table["cli"]
    assert trace.floor_of("specjax/__init__.py", table) is None


def test_the_size_report_counts_lines_and_nested_functions(tmp_path):
    (tmp_path / "specjax").mkdir()
    (tmp_path / "specjax" / "a.py").write_text(
        "def f():\n    def g():\n        return 1\n    return g\n\n\nclass K:\n    def m(self):\n        pass\n")
    size = house_run.code_size(tmp_path, top=3)
    assert size["modules"] == {"specjax/a.py": 9} and size["total_lines"] == 9
    assert size["largest_functions"] == [{"function": "specjax/a.py:f", "lines": 4},
                                         {"function": "specjax/a.py:K.m", "lines": 2},
                                         {"function": "specjax/a.py:f.<locals>.g", "lines": 2}]
