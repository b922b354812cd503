"""The CPU kernel's build: compiled with the warnings that are bugs as errors, and a failed
build reported once at run time with the reason setup.py recorded."""
import pathlib
import re

from specjax import kernels

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_compile_flags_keep_real_errors():
    flags = re.search(r"extra_compile_args=\[(.*?)\]", (REPO / "setup.py").read_text(), re.S).group(1)
    assert "-Werror=return-type" in flags and "-Wall" in flags
    assert "-Wno-return-type" not in flags


def test_a_failed_build_is_reported_once_with_its_reason(tmp_path, monkeypatch, capsys):
    (tmp_path / "_build_failed.txt").write_text("g++: command not found\n")
    monkeypatch.setattr(kernels, "_PACKAGE_DIR", tmp_path)
    monkeypatch.setattr(kernels, "_inspect", lambda: (None, None))
    kernels._library.cache_clear()
    try:
        assert kernels.build_failure() == "g++: command not found"
        assert not kernels.built() and not kernels.built()
        err = capsys.readouterr().err
        assert err.count("[specjax] note:") == 1 and "did not build at install time (g++: command not found)" in err
    finally:
        kernels._library.cache_clear()
    (tmp_path / "_build_failed.txt").unlink()
    assert kernels.build_failure() is None
