"""Training data (kept for compatibility): the corpus now lives in :mod:`fmoe.data`.

``Corpus`` is :class:`fmoe.data.TokenStream`; ``Corpus.stdlib()`` is the standard library's
source as byte tokens, and ``corpus.batch(step, batch_index, batch, seq, seed, num_batches)`` a
pure function of its arguments.
"""

from ..data import TokenStream as Corpus

__all__ = ["Corpus"]
