"""The device runtime: the execution plan (every choice explained), the backend and mesh, placing
weights and the KV cache, measuring native kernels against XLA, compiling the step's variants
(all of start-up one pipeline, tl/runtime/startup.py), and the runner that packs, runs and
unpacks each step, with in-step sampling.

May import: tl.core, tl.model, kernels, jax, numpy. The text side (a constraint's token
bitmask) and the multi-host channel reach it only through protocols declared beside the step
(tl/runtime/step_io.py's MaskFiller, tl/runtime/frame.py's StepPeers), their objects handed in by
tl/entry/build.py, never by import.
"""
