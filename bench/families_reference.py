"""Golden logits of the model families from an independent implementation: transformers + torch.

Owns: running Hugging Face transformers (with torch; neither is a dependency of tl, so this
script needs them installed beside it, e.g. `pip install --target DIR torch==2.13.0+cpu
sympy networkx filelock fsspec mpmath` and `PYTHONPATH=DIR`) on the tiny random-weight model
of each family that tests/helpers/models.py builds (`make_family`), teacher-forced over
`family_token_ids()`, and writing their float32 logits to tests/golden/families/<family>.npz
with the versions that computed them. tests/model/test_families.py loads the same directories into
tl and compares, so CI checks every family without torch. transformers shares no code with tl:
its own config classes, rotary embeddings, norms, attention masks (sliding windows included)
and MoE blocks.

    PYTHONPATH=/tmp/torchlib python -m bench.families_reference [--out tests/golden/families]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from models import FAMILIES, family_token_ids, make_family  # noqa: E402


def reference_logits(model_dir: Path, ids: np.ndarray) -> np.ndarray:
    """transformers' float32 logits [T, V] of one sequence (eager attention: the plain masks)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        out = model(torch.as_tensor(ids[None, :].astype(np.int64)))
    return out.logits[0].float().numpy()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "tests/golden/families"))
    ap.add_argument("--families", nargs="*", default=list(FAMILIES))
    args = ap.parse_args(argv)
    import torch
    import transformers

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ids = family_token_ids()
    for name in args.families:
        with tempfile.TemporaryDirectory() as d:
            logits = reference_logits(make_family(Path(d), name), ids)
        meta = {"transformers": transformers.__version__, "torch": torch.__version__, "token_ids": ids.tolist()}
        np.savez_compressed(out / f"{name}.npz", logits=logits.astype(np.float32), meta=json.dumps(meta))
        print(f"{name}: logits {logits.shape}, std {logits.std():.3f}, argmax {logits.argmax(-1)[:8].tolist()}")


if __name__ == "__main__":
    main()
