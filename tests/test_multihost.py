"""Multi-host start as far as one machine allows: two processes join one jax.distributed job
through tl.backend.init_distributed (coordinator on localhost, 2 CPU devices each) and see one
4-device job from which make_mesh builds the tensor-parallel mesh; plus how the keywords are
read from config and the standard JAX_* variables.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tl.config import EngineConfig

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import sys
from tl.backend import init_distributed, make_mesh
from tl.config import EngineConfig
import jax
cfg = EngineConfig(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
assert init_distributed(cfg, {})
mesh = make_mesh("cpu", 4)
print(jax.process_index(), jax.process_count(), jax.device_count(), jax.local_device_count(),
      sorted({d.process_index for d in mesh.devices.flat}), flush=True)
jax.distributed.shutdown()
"""


def test_two_processes_form_one_job() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, f"127.0.0.1:{port}", str(i)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert sorted(o.split(maxsplit=1)[0] for o, _ in outs) == ["0", "1"]
    for out, _ in outs:
        assert out.split()[1:4] == ["2", "4", "2"] and out.strip().endswith("[0, 1]")


def test_distributed_args_from_config_then_environment() -> None:
    from tl.backend import distributed_args

    assert distributed_args(EngineConfig(), {}) is None
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"}
    assert distributed_args(EngineConfig(), env) == {
        "coordinator_address": "10.0.0.1:1234",
        "num_processes": 4,
        "process_id": 2,
    }
    cfg = EngineConfig(coordinator_address="h:1", num_processes=2, process_id=0)
    assert distributed_args(cfg, env) == {"coordinator_address": "h:1", "num_processes": 2, "process_id": 0}
    assert distributed_args(EngineConfig(num_processes=8), {}) == {"num_processes": 8}  # the rest auto-detected
