"""Checkpoint file manifests: the size and CRC-32 of every file of a step, recorded just
before orbax commits the step and re-checked before a restore reads it.

``<step>/rljax_manifest.json`` holds ``{"version": 1, "hash": "crc32", "files": {relative
path: [size, crc32 hex]}}``; ``<checkpoints>/rljax_manifests_since.json`` records the first
step written with one (see ``checkpoint`` for how a missing manifest is judged). CRC-32 runs
at ~2 GB/s per core here, and files are hashed in parallel threads (zlib releases the GIL).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import zlib

from etils import epath

MANIFEST_FILE = "rljax_manifest.json"
# In the checkpoint directory: the first step written with a manifest. A later step without
# one had it deleted (an error); an earlier one is an older rljax's (a warning).
MANIFESTS_SINCE_FILE = "rljax_manifests_since.json"
# Written or rewritten by orbax after our manifest (commit time stamp, commit marker).
_UNHASHED = {MANIFEST_FILE, "_CHECKPOINT_METADATA", "commit_success.txt"}
_CHUNK = 16 << 20


def _file_crc(path: epath.Path) -> tuple[int, str]:
    crc, size = 0, 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)  # releases the GIL: files hash in parallel
            size += len(chunk)
    return size, f"{crc:08x}"


def _step_files(step_dir: epath.Path) -> list[str]:
    """Relative paths of the files of a step directory that the manifest covers."""
    out = []
    for root, _, files in _walk(step_dir):
        for name in files:
            rel = str(epath.Path(root) / name)[len(str(step_dir)) + 1:]
            if rel not in _UNHASHED:
                out.append(rel)
    return sorted(out)


def _walk(directory: epath.Path):
    dirs, files = [], []
    for p in directory.iterdir():
        (dirs if p.is_dir() else files).append(p.name)
    yield str(directory), dirs, files
    for d in dirs:
        yield from _walk(directory / d)


def file_manifest(step_dir: str | os.PathLike) -> dict:
    """``{relative path: [size, crc32 hex]}`` of every data file under ``step_dir``."""
    step_dir = epath.Path(os.fspath(step_dir))
    names = _step_files(step_dir)
    with concurrent.futures.ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        sums = list(pool.map(lambda n: _file_crc(step_dir / n), names))
    return {n: [size, crc] for n, (size, crc) in zip(names, sums)}


def write_manifest(step_dir: str | os.PathLike) -> None:
    step_dir = epath.Path(os.fspath(step_dir))
    record = {"version": 1, "hash": "crc32", "files": file_manifest(step_dir)}
    (step_dir / MANIFEST_FILE).write_text(json.dumps(record, indent=0, sort_keys=True))


def manifests_since(directory: str | os.PathLike) -> int | None:
    """The first step of checkpoint ``directory`` written with a manifest (None: none was, or
    an older rljax wrote them all)."""
    marker = epath.Path(os.fspath(directory)) / MANIFESTS_SINCE_FILE
    try:
        return int(json.loads(marker.read_text())["since_step"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return 0  # unreadable: every step must have its manifest


def _mark_manifests_since(step_dir: epath.Path) -> None:
    """Records ``step_dir``'s step as the first with a manifest, unless one is recorded."""
    marker = step_dir.parent / MANIFESTS_SINCE_FILE
    if not marker.exists():
        marker.write_text(json.dumps({"since_step": int(step_dir.name)}) + "\n")


def first_manifested_step(directory: str | os.PathLike) -> int | None:
    """The earliest step of ``directory`` that holds a manifest (None: none does). Steps from
    it on were written by an rljax that writes manifests, so one of them without its
    manifest had it deleted, whether or not the marker file is still there."""
    try:
        steps = [int(p.name) for p in epath.Path(os.fspath(directory)).iterdir()
                 if p.name.isdigit() and (p / MANIFEST_FILE).exists()]
    except OSError:
        return None
    return min(steps) if steps else None


def verify_step_dir(step_dir: str | os.PathLike, required: bool = False) -> str | None:
    """None if every file recorded in the manifest is there with its size and CRC, else the
    first problem found (one line, naming the file). No manifest: the problem if ``required``,
    else None (unverified)."""
    step_dir = epath.Path(os.fspath(step_dir))
    manifest = step_dir / MANIFEST_FILE
    if not manifest.exists():
        return (f"{MANIFEST_FILE} is missing (deleted? this workdir's checkpoints are written "
                "with one), so its files cannot be verified") if required else None
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST_FILE} is unreadable ({e})"
    for name, (size, _) in sorted(files.items()):
        path = step_dir / name
        if not path.exists():
            return f"{name} is missing"
        actual = path.stat().length
        if actual != size:
            return f"{name} has {actual} bytes, {size} were written (truncated or overwritten)"
    names = sorted(files)
    with concurrent.futures.ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        sums = list(pool.map(lambda n: _file_crc(step_dir / n), names))
    for name, (_, crc) in zip(names, sums):
        if crc != files[name][1]:
            return f"{name} does not match its checksum (crc32 {crc}, written {files[name][1]})"
    return None


def with_manifest(base: type) -> type:
    """``base`` (an orbax TemporaryPath class) that writes our manifest into a step's tmp
    directory just before orbax commits it (rename / commit file)."""

    class WithManifest(base):
        async def finalize(self, *args, **kwargs):
            if self.get_final().name.isdigit():  # the step directory, not an item inside it
                await asyncio.to_thread(write_manifest, self.get())
                await asyncio.to_thread(_mark_manifests_since, self.get_final())
            return await super().finalize(*args, **kwargs)

    WithManifest.__name__ = f"Manifest{base.__name__}"
    return WithManifest
