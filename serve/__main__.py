"""`python -m serve [--config runtime.toml]`: the server's command line, what `tl serve` hands over to.

Owns only this command line: serve.launch's serve_main (the process becomes granian), a bad
or missing config reported in one line with exit status 2, as the `tl` command reports its
errors. tl/entry/cli.py execs this in its own place because tl imports no serve.
Tested by tests/entry/test_cli.py.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from serve.launch import serve_main


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tl serve", description="serve the OpenAI-compatible API with granian")
    p.add_argument("--config", default="configs/runtime.toml")
    args = p.parse_args(argv)
    try:
        serve_main(args.config)
    except (ValueError, OSError) as e:  # ConfigError names the file or the key
        print(f"tl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
