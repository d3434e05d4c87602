"""Turn text files or folders into a token file that ``data=tokens`` trains on.

    python scripts/prepare_data.py ~/corpus/ notes.txt --out data/tokens.bin
    python scripts/train.py data=tokens data.path=data/tokens.bin

By default every byte is one token (vocabulary 256), so no tokenizer is needed. To fine-tune a pretrained
model, tokenize with its own tokenizer (a Hugging Face model directory): ``--tokenizer /ckpt/Llama-3.2-1B``
writes uint32 token ids and a ``<out>.json`` beside them. Folders are searched for ``--pattern`` files
(default: *.py *.txt *.md *.rst); files are read in sorted order.
"""

from __future__ import annotations

import argparse
import sys

from cuboid.data import DEFAULT_PATTERNS, DataError, prepare_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="+", help="text files or folders")
    parser.add_argument("--out", required=True, help="token file to write")
    parser.add_argument("--max-bytes", type=int, default=None, help="stop after this many tokens")
    parser.add_argument("--pattern", action="append", default=None, help="file glob inside folders (repeatable)")
    parser.add_argument("--tokenizer", default=None, help="a Hugging Face model/tokenizer directory (default: bytes)")
    args = parser.parse_args()
    try:
        patterns = args.pattern or DEFAULT_PATTERNS
        path, n = prepare_tokens(args.sources, args.out, args.max_bytes, patterns, args.tokenizer)
    except DataError as err:
        sys.exit(f"prepare_data: {err}")
    print(f"wrote {n:,} tokens to {path}")


if __name__ == "__main__":
    main()
