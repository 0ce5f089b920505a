"""`python -m bench <name> [args]` (also `tl bench ...`).

Names: runner | engine | mixed | http | structured | quant | kl | kernels | qgemm | qlayout | soak | multihost |
wire | synth | fleet.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    name, rest = argv[0], argv[1:]
    if name == "runner":
        from bench.runner_bench import run
    elif name == "engine":
        from bench.engine_bench import run
    elif name == "mixed":
        from bench.mixed_step import run
    elif name == "http":
        from bench.http_bench import run
    elif name == "structured":
        from bench.structured_bench import run
    elif name == "quant":
        from bench.quant_bench import run
    elif name == "kl":
        from bench.kl_bench import run
    elif name == "kernels":
        from bench.kernels_bench import run
    elif name == "qgemm":
        from bench.qgemm_bench import run
    elif name == "qlayout":
        from bench.qlayout_bench import run
    elif name == "soak":
        from bench.soak import run
    elif name == "multihost":
        from bench.multihost_bench import run
    elif name == "wire":
        from bench.wire_record import run
    elif name == "synth":
        from bench.synth import run
    elif name == "fleet":
        from bench.fleet_bench import run
    else:
        names = "runner, engine, mixed, http, structured, quant, kl, kernels, qgemm, qlayout, soak, multihost, wire"
        names += ", synth or fleet"
        print(f"unknown benchmark {name!r}; choose {names}", file=sys.stderr)
        return 2
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
