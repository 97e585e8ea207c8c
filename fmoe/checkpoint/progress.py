"""Progress of a checkpoint's save, load or export on stderr: a ``tqdm`` bar over its parts.

A training checkpoint is written and read by ``torch.distributed.checkpoint`` in one call, so its
bar counts the stages around it (write / checksums / commit; checksums / read / check); a Hugging
Face export counts the files it writes. The job turns it on for rank 0 without ``--quiet``; off,
it costs nothing (tqdm's ``disable``).

Example:
    >>> with bar("saving runs/a/step-2", ["write", "commit"], enabled=False) as next_part:
    ...     next_part()
    ...     next_part()
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator, Sequence

__all__ = ["bar"]


@contextlib.contextmanager
def bar(desc: str, parts: Sequence[str], enabled: bool) -> Iterator[Callable[[], None]]:
    """A bar of ``len(parts)`` steps named ``desc``; yields ``next_part()``, called as each part is done.

    Args:
        desc: what is done (``"saving OUT/step-4"``), the bar's label.
        parts: the parts' names in order (the bar shows the one in progress).
        enabled: draw it (rank 0 without ``--quiet``).
    Yields:
        a function marking the current part done.
    """
    from tqdm.auto import tqdm

    with tqdm(total=len(parts), desc=desc, unit="part", disable=not enabled, file=sys.stderr, leave=False,
              dynamic_ncols=True, mininterval=0.0) as b:
        if parts:
            b.set_postfix_str(parts[0], refresh=False)

        def next_part() -> None:
            b.update(1)
            if b.n < len(parts):
                b.set_postfix_str(parts[b.n])

        yield next_part
