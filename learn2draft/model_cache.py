"""A cache of GGUF models converted once to a plain Hugging Face folder (safetensors, config, tokenizer), so that a
command loads the embedded target in about a second instead of de-quantising the GGUF file every time.

Where: ``$LEARN2DRAFT_CACHE``, else ``$XDG_CACHE_HOME/learn2draft``, else ``~/.cache/learn2draft``
(:func:`cache_root`); ``LEARN2DRAFT_CACHE=off`` turns the cache off. An entry is
``models/<sha256 of the GGUF file>-<dtype>/`` (:func:`entry_dir`); the file's hash is remembered by (path, size,
modification time) in ``hashes.json``, so an unchanged file is hashed once.

An entry is written whole or not at all: into a temporary folder beside it, with ``manifest.json`` (every file's
size and sha256) written last, then renamed into place. :func:`entry_is_whole` checks the manifest and the sizes
(cheap, at every load); an entry that fails it (a copy cut short, a file removed) is rebuilt with one line on
standard error. Nothing here imports torch or transformers: the caller passes the conversion (:func:`cached_dir`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

#: The environment variable naming the cache folder (``off``: no cache).
CACHE_ENV = "LEARN2DRAFT_CACHE"

#: The file of an entry written last, listing its other files: ``{"files": {name: {"size", "sha256"}}, "source"}``.
MANIFEST = "manifest.json"

#: Bump when the layout of an entry changes: older entries are then rebuilt.
FORMAT = 1


def cache_root() -> Path | None:
    """The cache folder: ``$LEARN2DRAFT_CACHE``, else ``$XDG_CACHE_HOME/learn2draft``, else ``~/.cache/learn2draft``;
    None when ``$LEARN2DRAFT_CACHE`` is ``off`` (or ``0``, ``none``). Not created here."""
    given = os.environ.get(CACHE_ENV, "").strip()
    if given.lower() in ("off", "0", "none", "false"):
        return None
    if given:
        return Path(given).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "learn2draft"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _write_json_atomically(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def file_hash(path: str | Path, root: Path | None = None) -> str:
    """The sha256 (hex) of the file at ``path``, remembered in ``<root>/hashes.json`` by (absolute path, size,
    modification time in ns): a file changed in any of them is hashed again. ``root`` None: :func:`cache_root`
    (no memo when the cache is off or cannot be written).

    Raises:
        OSError: ``path`` cannot be read.
    """
    path = Path(path).resolve()
    st = path.stat()
    key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    root = cache_root() if root is None else root
    memo_file = root / "hashes.json" if root is not None else None
    memo: dict = {}
    if memo_file is not None:
        try:
            memo = json.loads(memo_file.read_text())
            if not isinstance(memo, dict):
                memo = {}
        except (OSError, ValueError):
            memo = {}
        known = memo.get(str(path))
        if isinstance(known, dict) and all(known.get(k) == v for k, v in key.items()) and known.get("sha256"):
            return str(known["sha256"])
    digest = _sha256(path)
    if memo_file is not None:
        memo[str(path)] = {**key, "sha256": digest}
        try:
            _write_json_atomically(memo_file, memo)
        except OSError:
            pass  # a read-only cache: hash again next time
    return digest


def entry_dir(root: Path, source_hash: str, dtype: str = "float32") -> Path:
    """The folder of the converted model of the GGUF file of sha256 ``source_hash`` in ``dtype`` (the precision its
    weights are saved in; a load may cast them to another)."""
    return root / "models" / f"{source_hash}-{dtype}"


def entry_is_whole(directory: Path, deep: bool = False) -> bool:
    """Whether ``directory`` is a whole cache entry: its manifest reads, has this :data:`FORMAT`, and every file it
    lists exists with the listed size (``deep``: and the listed sha256, which reads every byte)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict) or not files:
            return False
        for name, meta in files.items():
            f = directory / name
            if f.stat().st_size != int(meta["size"]):
                return False
            if deep and _sha256(f) != meta["sha256"]:
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def write_manifest(directory: Path, source: dict) -> None:
    """Write ``directory``'s :data:`MANIFEST` (every other file's size and sha256, and ``source``: what it was
    converted from): the last file of an entry."""
    files = {}
    for f in sorted(directory.rglob("*")):
        if f.is_file() and f.name != MANIFEST:
            files[f.relative_to(directory).as_posix()] = {"size": f.stat().st_size, "sha256": _sha256(f)}
    (directory / MANIFEST).write_text(json.dumps({"format": FORMAT, "source": source, "files": files}, indent=1))


def discard(path: Path) -> None:
    """Remove the cache entry ``path`` (a damaged one): renamed aside first, so that no reader sees it half removed,
    then deleted. A missing entry is left alone."""
    aside = path.with_name(f".{path.name}.old-{os.getpid()}")
    try:
        os.replace(path, aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def cached_dir(gguf_path: str | Path, convert: Callable[[Path], None], dtype: str = "float32",
               say: Callable[[str], None] | None = None) -> Path | None:
    """The cache entry of the GGUF file ``gguf_path`` (a folder ``from_pretrained`` loads), converted now with
    ``convert(folder)`` (which writes the model and tokenizer there with ``save_pretrained``) when it is missing or
    damaged, with one line on ``say`` (default: standard error) saying which.

    Returns:
        the entry's folder; None when the cache is off (:func:`cache_root`) or cannot be written here (one line on
        ``say``): the caller then loads the GGUF file itself.

    Raises:
        whatever ``convert`` raises (nothing is left in the cache then), and OSError when ``gguf_path`` is unreadable.
    """
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    root = cache_root()
    if root is None:
        return None
    gguf_path = Path(gguf_path).resolve()
    digest = file_hash(gguf_path, root)
    final = entry_dir(root, digest, dtype)
    if entry_is_whole(final):
        return final
    damaged = final.exists()
    if damaged:
        discard(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}-tmp-"))
    except OSError as e:
        say(f"learn2draft: cannot write the model cache {root} ({e.strerror or e}); loading {gguf_path.name} "
            f"directly (set ${CACHE_ENV} to a writable folder to load faster).")
        return None
    if damaged:
        say(f"learn2draft: the converted model in {final} is damaged or incomplete; converting {gguf_path.name} again.")
    else:
        say(f"learn2draft: converting {gguf_path.name} once into {final.parent} (a minute at most; later runs load it "
            "in seconds) …")
    try:
        convert(tmp)
        write_manifest(tmp, {"gguf": str(gguf_path), "sha256": digest, "dtype": dtype})
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished the same entry first: keep theirs if it is whole
            if not entry_is_whole(final):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


__all__ = ["CACHE_ENV", "FORMAT", "MANIFEST", "cache_root", "cached_dir", "discard", "entry_dir", "entry_is_whole", "file_hash",
           "write_manifest"]
