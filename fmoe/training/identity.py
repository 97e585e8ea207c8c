"""What a run trained on, by content: ``--data`` and the tokenizer.

A path says where data was, not what it was. A new run records ``--data`` as an absolute path
with its content digest (:func:`fmoe.data.data_digest`: shard headers, or the bytes of the text
files), and ``meta.json`` the tokenizer's digest. A resume (:mod:`fmoe.training.resume`) takes
them when not given and compares digests either way: a moved or renamed corpus is the same data,
a same-named file elsewhere or a corpus edited in place is refused naming the file (unless
``--data-changed``: then said on stderr, and the new digest recorded), and so is another tokenizer. A run whose tokenizer came from its ``--init-hf`` directory resumes with that
tokenizer file.

Example:
    >>> import types
    >>> job = types.SimpleNamespace(data=None)
    >>> record(job, print)
    >>> job.data_digest is None
    True
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from ..data import data_digest, is_shard_dir

__all__ = ["record", "restore"]


def record(job: Any, error: Callable[[str], Any]) -> None:
    """A new run's ``--data`` as an absolute path with its content digest (``job.data_digest``),
    which ``meta.json``'s settings record."""
    job.data_digest = None
    if job.data is not None:
        job.data = os.path.abspath(job.data)
        try:
            job.data_digest = data_digest(job.data)
        except (OSError, ValueError) as e:
            error(f"--data {job.data!r}: {e}")


def restore(job: Any, saved: dict, meta: dict, where: str, error: Callable[[str], Any]) -> None:
    """A resume's ``--data`` and ``--tokenizer``: the checkpoint's when not given, and either way
    the same content as the checkpoint recorded (by digest), wherever it lies.

    Args:
        job: the resolved job (``job.explicit``: the settings given).
        saved: the checkpoint's recorded settings; meta: its ``meta.json`` (the tokenizer's digest).
        where: the checkpoint (for messages).
        error: called with the message of a mismatch; raises (a usage error).
    """
    path = job.data if "data" in job.explicit else saved.get("data")
    if path is not None:
        if not os.path.exists(path):
            error(f"--resume {where}: the run's --data {path!r} is not there any more; pass --data PATH (the same "
                  "corpus)" if "data" not in job.explicit else f"--data {path!r} does not exist")
        path = os.path.abspath(path)
        digest = data_digest(path)
        if digest != saved.get("data_digest"):
            was = f"{saved.get('data')!r} (digest {saved.get('data_digest')})" if saved.get("data") else \
                "the built-in corpus (no --data)"
            what = f"--data {path!r} (digest {digest}) is not the data the run trained on, {was}"
            if not job.data_changed:
                error(f"--resume {where}: {what}; a resumed run trains on the same corpus (restore the file, pass "
                      "--data-changed to continue on this one, or start a new run)")
            print(f"fmoe train: note: --data-changed: {what}; continuing on it", file=sys.stderr)
        job.data, job.data_digest = path, digest
    elif "data" not in job.explicit:
        job.data, job.data_digest = None, None
    if "tokenizer" not in job.explicit:
        tokenizer = saved.get("tokenizer")
        shards = job.data is not None and os.path.isdir(job.data) and is_shard_dir(job.data)   # (theirs)
        if tokenizer is None and meta.get("tokenizer") not in (None, "bytes") and not shards:
            tokenizer = meta.get("tokenizer")              # found by the run (in its --init-hf directory)
        job.tokenizer = tokenizer
    want = meta.get("tokenizer_digest")
    if job.tokenizer is not None and want is not None:
        from ..data import find_tokenizer_file, load_tokenizer

        if job.tokenizer != "bytes" and find_tokenizer_file(job.tokenizer) is None:
            error(f"--resume {where}: the run's tokenizer {job.tokenizer!r} is not there any more; pass "
                  "--tokenizer T (the same tokenizer.json)")
        got = load_tokenizer(job.tokenizer).digest
        if got != want:
            error(f"--resume {where}: --tokenizer {job.tokenizer!r} (digest {got}) is not the tokenizer the run "
                  f"trained with ({meta.get('tokenizer')!r}, digest {want})")
