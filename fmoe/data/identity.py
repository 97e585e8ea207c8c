"""What a corpus *is*: a content digest of ``--data``, so a resumed run trains on the same tokens.

A path says where data was, not what it was: resuming from another working directory can find a
same-named file holding another corpus, and a corpus edited in place keeps its name. So the job
records ``--data`` as an absolute path together with :func:`data_digest`, and a resume compares
digests (:mod:`fmoe.training.resume`): a moved corpus is the same data, an edited one is refused.

- a shard directory (``fmoe data prepare``): the SHA-256 of its ``header.json``, which lists every
  shard file with its token count and its own SHA-256 (written while the shards are written), so
  the digest costs one small read;
- text (a ``.txt`` / ``.jsonl`` file or a directory of them): the SHA-256 over the files the job
  reads, in its order, each as its path relative to a ``--data`` directory, its size and its
  bytes (one sequential read: the job reads them all again to tokenize); a lone file's name is
  not part of it (a renamed file is the same data).

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "a.txt").write_text("hi")
    >>> before = data_digest(str(d))
    >>> _ = (d / "a.txt").write_text("ho")
    >>> data_digest(str(d)) == before, len(before)
    (False, 64)
"""

from __future__ import annotations

import hashlib
import os

from .shards import HEADER, is_shard_dir
from .sources import list_files

__all__ = ["data_digest"]

_BLOCK = 1 << 20


def data_digest(path: str) -> str:
    """SHA-256 (hex) of the corpus at ``path`` (module docstring).

    Args:
        path: ``--data``: a shard directory, a text file or a directory of text files.
    Returns:
        64 hex digits, equal for equal content wherever it lies.
    Raises:
        ValueError: not a corpus :func:`fmoe.data.open_data` reads (naming the path).
        OSError: a file cannot be read.
    """
    h = hashlib.sha256()
    if os.path.isdir(path) and is_shard_dir(path):
        with open(os.path.join(path, HEADER), "rb") as f:
            h.update(b"shards\0" + f.read())
        return h.hexdigest()
    for name in list_files(path):                      # a lone file is its bytes, whatever its name
        inside = os.path.relpath(name, path) if os.path.isdir(path) else ""
        h.update(f"{inside}\0{os.path.getsize(name)}\0".encode("utf-8", "surrogateescape"))
        with open(name, "rb") as f:
            while block := f.read(_BLOCK):
                h.update(block)
    return h.hexdigest()
