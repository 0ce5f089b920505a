"""`tl generate` end to end on the succ model (hand-checkable), the CLI's error path, and `tl serve`
handing over to `python -m serve` (tl imports no serve)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tl.entry.cli import main


def test_generate_streams_the_succ_continuation(succ_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(succ_dir), "--prompt", "a", "--max-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert out == "bcd\n"
    assert "prompt 1 tokens, generated 3 tokens, finish length" in err


def test_generate_chat_renders_the_template(succ_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # succ's template is the bare message content, so --chat changes nothing visible here.
    assert main(["generate", "--model", str(succ_dir), "--prompt", "x", "--chat", "--max-tokens", "2"]) == 0
    assert capsys.readouterr().out == "yz\n"


def test_missing_model_dir_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "a"]) == 2
    err = capsys.readouterr().err
    assert "tl: error:" in err and "nope" in err


def test_serve_hands_over_to_python_m_serve_which_names_a_bad_key(tmp_path: Path) -> None:
    """The process execs `python -m serve`, which checks the config before granian starts."""
    bad = tmp_path / "rt.toml"
    bad.write_text("[engine]\nprefill_chunkz = 3\n")
    code = f"from tl.entry.cli import main; main(['serve', '--config', {str(bad)!r}])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2, r.stderr
    assert "tl: error:" in r.stderr and "prefill_chunkz" in r.stderr and "Traceback" not in r.stderr
