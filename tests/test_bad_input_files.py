"""Bad files and file systems (issue 39, round 3, items 1-5): a model cache that cannot be
written, a full disk during `specjax export`, a foreign kernel library, a metrics file in a
missing directory, and the export dtypes the config lists. Each must be one line naming the
path and the problem, never a traceback, and never leave a partial result behind."""

import errno
import hashlib
import os
import pathlib
import re
import types

import pytest

import _cli_tiny
from configs import generate
from specjax import build, cli, files, kernels, models, tools
from specjax.models import export as hf_export
from specjax.models import registry

REPO = pathlib.Path(__file__).resolve().parent.parent


def _dispatch(*args):
    return cli.dispatch(["specjax", *args])


def _one_error_line(err: str) -> str:
    """The stderr of a user error: exactly one line ``specjax: error: ...``; returns it."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("specjax: error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def _no_load(*a, **k):
    raise AssertionError("a model was loaded before the bad setting was refused")


def _no_model_load(monkeypatch):
    """Make any model load fail the test: the error must come before it."""
    monkeypatch.setattr(models, "load_with_tokenizer", _no_load)
    monkeypatch.setattr(build, "load_generator", _no_load)


_QUICK = ("--config.compilation_cache_dir=", "--config.calibration_cache=", "--config.compare_target_only=False")


# ------------------------------------------------------------- item 1: an unwritable SPECJAX_CACHE

@pytest.fixture
def fake_model(monkeypatch):
    """A registry entry that is not cached and must never be downloaded."""
    monkeypatch.delenv("SPECJAX_VERIFY_MODELS", raising=False)
    spec = registry.PipGGUF(name="fake-tiny", requirement="specjax-no-such-package==0",
                            module="specjax_no_such_module", member="pkg/fake-tiny.gguf",
                            sha256=hashlib.sha256(b"x").hexdigest())
    monkeypatch.setitem(registry.KNOWN, spec.name, spec)

    def no_download(*a, **k):
        raise AssertionError("resolve tried to download into a cache it cannot write")
    monkeypatch.setattr(registry.subprocess, "run", no_download)
    return spec


def test_item1_cache_under_a_regular_file_is_one_error_naming_it(fake_model, tmp_path, monkeypatch, capsys):
    """SPECJAX_CACHE under a regular file (fails even for root) used to be a NotADirectoryError
    traceback from mkdir; now a ModelFetchError naming the setting and the file in the way, before
    any download, and one line from the command line."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    for root in (blocker / "cache", blocker):
        monkeypatch.setenv("SPECJAX_CACHE", str(root))
        with pytest.raises(registry.ModelFetchError) as e:
            registry.resolve(fake_model.name)
        msg = str(e.value)
        assert "\n" not in msg and f"SPECJAX_CACHE={str(root)!r}" in msg, msg
        assert f"{blocker} is a file, not a directory" in msg, msg
    assert blocker.read_text() == "not a directory\n"

    # the command line: one line, exit 2 (the default target is fetched into the cache)
    monkeypatch.setenv("SPECJAX_CACHE", str(blocker / "cache"))
    monkeypatch.chdir(REPO)
    assert _dispatch("generate", "--config=configs/generate.py", "--config.target=smollm2-135m-instruct",
                     "--config.drafter=ngram", *_QUICK) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "SPECJAX_CACHE=" in line and f"{blocker} is a file, not a directory" in line, line


def test_item1_read_only_cache_is_one_error_naming_it(fake_model, tmp_path, monkeypatch):
    """A cache on a read-only file system (EROFS injected into mkdir: root ignores chmod 0o500)
    used to be an OSError traceback; now a ModelFetchError naming the path and the problem."""
    root = tmp_path / "ro-cache"
    monkeypatch.setenv("SPECJAX_CACHE", str(root))
    real_mkdir = pathlib.Path.mkdir

    def read_only_mkdir(self, *a, **k):
        if str(self).startswith(str(root)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *a, **k)
    monkeypatch.setattr(pathlib.Path, "mkdir", read_only_mkdir)
    with pytest.raises(registry.ModelFetchError) as e:
        registry.resolve(fake_model.name)
    msg = str(e.value)
    assert "\n" not in msg and f"SPECJAX_CACHE={str(root)!r}" in msg, msg
    assert str(root / fake_model.name) in msg and os.strerror(errno.EROFS) in msg, msg


# ------------------------------------------------------------------ item 2: export on a full disk

@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    target, _ = _cli_tiny.write_pair(tmp_path_factory.mktemp("pair"))
    return target


def _full_disk(monkeypatch, after_bytes: int = 4096):
    """The tensor writer writes a little, then fails with ENOSPC (a disk that fills up)."""
    def write_tensors(tensors, path):
        with open(path, "wb") as f:
            f.write(b"\0" * after_bytes)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(hf_export, "write_tensors", write_tensors)


@pytest.mark.parametrize("existing", ["absent", "empty_dir"])
def test_item2_export_on_a_full_disk_leaves_nothing_behind(tiny_target, tmp_path, monkeypatch, capsys, existing):
    """ENOSPC while the tensors are written used to leave ``out`` with a partial
    model.safetensors (and a traceback); now the checkpoint is written beside ``out`` and renamed
    into place at the end: on failure ``out`` is as it was (absent, or the empty directory it
    was), the temporary directory is gone, and the error is one line naming ``out``."""
    monkeypatch.chdir(REPO)
    parent = tmp_path / "exports"
    parent.mkdir()
    out = parent / "model"
    if existing == "empty_dir":
        out.mkdir()
    _full_disk(monkeypatch)
    assert _dispatch("export", "--config=configs/export.py", f"--config.source={tiny_target}",
                     f"--config.out={out}") == 2
    line = _one_error_line(capsys.readouterr().err)
    assert str(out) in line and os.strerror(errno.ENOSPC) in line, line
    assert sorted(p.name for p in parent.iterdir()) == ([] if existing == "absent" else ["model"])
    if existing == "empty_dir":
        assert out.is_dir() and not any(out.iterdir())


def test_item2_export_writes_the_whole_directory_at_once(tiny_target, tmp_path, monkeypatch):
    """Without a fault: the directory appears complete under its name, nothing else beside it,
    and loads again (bfloat16, the other dtype export writes)."""
    monkeypatch.chdir(REPO)
    parent = tmp_path / "exports"
    parent.mkdir()
    out = parent / "model"
    renamed = []
    real_replace = hf_export.os.replace

    def replace(src, dst):
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in pathlib.Path(src).iterdir()}
        assert not pathlib.Path(dst).exists()             # nothing at the destination until the rename
        renamed.append(pathlib.Path(dst))
        return real_replace(src, dst)
    monkeypatch.setattr(hf_export.os, "replace", replace)
    assert _dispatch("export", "--config=configs/export.py", f"--config.source={tiny_target}",
                     f"--config.out={out}", "--config.dtype=bfloat16") == 0
    assert renamed == [out]
    assert [p.name for p in parent.iterdir()] == ["model"]
    model, _ = models.load(str(out))
    assert model.config.num_layers == 2


def test_item2_write_directory_keeps_other_errors_and_cleans_up(tmp_path):
    """A failure that is not the file system's (a bad draft, say) is raised as it is, and the
    temporary directory is removed all the same."""
    out = tmp_path / "out"

    def bad(d):
        (d / "half.json").write_text("{")
        raise ValueError("draft.json: broken")
    with pytest.raises(ValueError, match="draft.json: broken"):
        hf_export.write_directory(out, bad)
    assert list(tmp_path.iterdir()) == []


# -------------------------------------------------------------- item 3: a foreign kernel library

@pytest.fixture
def foreign_library(monkeypatch):
    """Make `specjax.kernels` load something that is not its library (the real .so is never
    touched): yields a function that installs a fake loader; the caches are reset before and
    after, so the real library is loaded again afterwards."""
    def install(loader):
        monkeypatch.setattr(kernels, "_load", loader)
        kernels._inspect.cache_clear()
        kernels._library.cache_clear()
    yield install
    monkeypatch.undo()
    kernels._inspect.cache_clear()
    kernels._library.cache_clear()


def _not_an_elf(path):
    raise OSError(f"{path}: invalid ELF header")


@pytest.mark.parametrize("loader", [lambda path: types.SimpleNamespace(), _not_an_elf],
                         ids=["so_without_symbols", "not_a_shared_object"])
def test_item3_foreign_kernel_library(foreign_library, monkeypatch, capsys, tmp_path, loader):
    """A file where the kernel library belongs that loads without specjax's symbols (or does not
    load) used to be an AttributeError for cpu_kernel='auto' and 'on' alike (or, unloadable, a
    silent fallback and a misleading 'not built' for 'on'); now 'auto' falls back to XLA's matmul
    with one note naming the file, and 'on' refuses with one line naming it."""
    # A stand-in file where the library belongs (the fake loaders never read it; the real .so,
    # built or not, is never touched).
    path = tmp_path / "_panel_matmul.so"
    path.write_bytes(b"not specjax's kernel library")
    monkeypatch.setattr(kernels, "_library_path", lambda: path)
    foreign_library(loader)
    c = build.generate_settings(generate.get_config())
    assert c.cpu_kernel == "auto" and not c.scan_layers and c.dtype == "float32"
    assert build.use_cpu_kernel(c, backend="cpu") is False
    assert not kernels.attention_built() and not kernels.attention_fast_on_this_cpu()
    assert kernels.isa() == "none"
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(notes) == 1 and notes[0].startswith("[specjax] note: ") and str(path) in notes[0], notes
    assert "XLA's matmul" in notes[0]

    on = build.generate_settings(generate.get_config(), cpu_kernel="on")
    with pytest.raises(ValueError) as e:
        build.use_cpu_kernel(on, backend="cpu")
    assert str(path) in str(e.value) and "\n" not in str(e.value), str(e.value)

    # the command line: 'on' is one line, before any model loads
    monkeypatch.setattr(models, "load_with_tokenizer", _no_load)
    monkeypatch.chdir(REPO)
    capsys.readouterr()
    assert _dispatch("generate", "--config=configs/generate.py", "--config.cpu_kernel=on",
                     "--config.drafter=ngram", *_QUICK) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert str(path) in line and "cpu_kernel='on'" in line, line



# ------------------------------------------------------- item 4: metrics_jsonl in a missing directory

@pytest.mark.parametrize("where", ["missing_dir", "under_a_file", "a_directory"])
def test_item4_metrics_jsonl_checked_before_the_model_loads(tmp_path, monkeypatch, capsys, where):
    """metrics_jsonl in a directory that does not exist used to fail only after the whole
    generation (FileNotFoundError from open at the end); now it is one line naming the setting
    and the directory before anything loads."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    path = {"missing_dir": tmp_path / "no" / "such" / "m.jsonl", "under_a_file": blocker / "m.jsonl",
            "a_directory": tmp_path}[where]
    _no_model_load(monkeypatch)
    monkeypatch.chdir(REPO)
    assert _dispatch("generate", "--config=configs/generate.py", "--config.drafter=ngram",
                     f"--config.metrics_jsonl={path}", *_QUICK) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"metrics_jsonl={str(path)!r}" in line, line
    assert str(path if where == "a_directory" else path.parent) in line, line


def test_item4_a_writable_metrics_path_passes_the_check(tmp_path):
    files.check_output_file("metrics_jsonl", "")                          # off
    files.check_output_file("metrics_jsonl", str(tmp_path / "m.jsonl"))    # new file in an existing directory
    (tmp_path / "m.jsonl").write_text("{}\n")
    files.check_output_file("metrics_jsonl", str(tmp_path / "m.jsonl"))    # appended to
    assert (tmp_path / "m.jsonl").read_text() == "{}\n"


# ------------------------------------------------------------------ item 5: the export dtypes

def test_item5_export_config_lists_only_the_dtypes_export_writes(monkeypatch, capsys):
    """configs/export.py listed float16, which `export` refuses (specjax's ModelConfig holds
    float32 and bfloat16 only); the comment must list exactly what export accepts, and float16
    is refused naming the setting before anything loads."""
    text = (REPO / "configs" / "export.py").read_text()
    m = re.search(r"c\.dtype = .*# dtype of the written tensors: ([\w |]+)", text)
    assert m, "configs/export.py: the dtype comment is gone"
    listed = tuple(x.strip() for x in m.group(1).split("|") if x.strip())
    assert listed == tools.EXPORT_DTYPES == models.config.SUPPORTED_DTYPES, listed
    _no_model_load(monkeypatch)
    monkeypatch.chdir(REPO)
    assert _dispatch("export", "--config=configs/export.py", "--config.dtype=float16", "--config.out=/tmp/x") == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "dtype='float16': expected one of float32, bfloat16" in line, line


def test_append_records_checks_the_path_before_measuring_and_keeps_earlier_runs(tmp_path, monkeypatch):
    """`toolkit.append_records` (the diagnostic scripts' main): an empty path, a directory, or a
    folder that cannot be made is one OutputError naming the setting, before the measurement
    runs; a good path gets each run's records appended with the provenance; a write that fails
    (a full disk) is one OutputError and the file keeps its earlier run."""
    from experiments.lib import toolkit
    calls = []

    def measure():
        calls.append(1)
        return [{"x": len(calls)}]
    (tmp_path / "plain").write_text("")
    for bad in ("", str(tmp_path), str(tmp_path / "plain" / "out.jsonl")):
        with pytest.raises(toolkit.OutputError, match="--out="):
            toolkit.append_records("m", measure, bad)
    assert calls == []
    out = tmp_path / "new" / "r.jsonl"
    toolkit.append_records("m", measure, out)
    toolkit.append_records("m", measure, out)
    recs = toolkit.read_jsonl(out)
    assert [r["x"] for r in recs] == [1, 2] and all(r["provenance"]["command"].startswith("python -m m") for r in recs)
    before = out.read_text()
    real_open = open

    def full(path, mode="r", *a, **k):
        if str(path) == str(out) and "a" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *a, **k)
    monkeypatch.setattr("builtins.open", full)
    with pytest.raises(toolkit.OutputError, match="No space left.*earlier runs"):
        toolkit.append_records("m", measure, out)
    monkeypatch.undo()
    assert out.read_text() == before
