"""``fmoe data prepare --tokenizer T --out DIR FILES...``: write token shards (:func:`fmoe.data.prepare`).

Example:
    fmoe data prepare --tokenizer my_tok/tokenizer.json --out data/shards corpus/*.txt
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from ..data import load_tokenizer, prepare


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``fmoe data``; returns the exit code (2: bad input, 1: an OS error such as a full disk)."""
    ap = argparse.ArgumentParser(prog="fmoe data", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="tokenize text files into memmap shards",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Tokenize text files into a new shard directory, atomically: a failed run "
                                   "leaves nothing behind.")
    p.add_argument("files", nargs="+", help=".txt / .jsonl files or directories of them")
    p.add_argument("--tokenizer", default="bytes", help="'bytes', a tokenizer.json, or a directory with one")
    p.add_argument("--out", required=True, help="new or empty output directory (written all or nothing)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="token ids per shard file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    try:
        tok = load_tokenizer(args.tokenizer)
        header = prepare(args.files, tok, args.out, shard_tokens=args.shard_tokens, progress=not args.quiet)
    except ValueError as e:
        print(f"fmoe data: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:                  # a full disk, permissions: one line, nothing left behind
        print(f"fmoe data: error: {e.strerror or e}{': ' + str(e.filename) if e.filename else ''}", file=sys.stderr)
        return 1
    print(json.dumps({k: header[k] for k in ("tokens", "dtype", "vocab_size", "eos_id")} |
                     {"shards": len(header["shards"]), "out": args.out}))
    return 0

