"""What a model is: its config (tl/model/config.py), its files on disk (tl/model/files.py), its
weight encodings (tl/model/weights.py), the step layout and pure forward of its family
(tl/model/llama.py), the dense embedding reference, and GGUF conversion.

May import: tl.core, tl.model, kernels (the attention interface), jax, flax, numpy; never the
runtime, the text side or ops.
"""
