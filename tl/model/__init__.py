"""What a model is: its config and tensor shapes (tl/model/config.py), its files on disk
(tl/model/files.py), its parameter types and the registry of weight encodings
(tl/model/weights.py; one module per encoding under tl/model/encodings/), the step layout and
pure forward of its family (tl/model/llama.py; tl/model/moe.py's experts), loading weights
into that layout (tl/model/loader.py), the dense embedding reference, a GGUF read and served as
it is (tl/model/gguf_model.py) and GGUF conversion (tl/model/convert_gguf.py).

May import: tl.core, tl.model, kernels (the attention interface; the native kernels an
encoding runs on and its packing), jax, flax, numpy; never the runtime, the text side or ops.
"""
