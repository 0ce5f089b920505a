"""tl: an LLM serving engine; this package is everything but the HTTP server (serve/) and the
kernels (kernels/). Its layers, one subpackage each, in import order (a layer imports only
those before it; tests/test_layering.py checks it):

- tl/core: the engine core (requests, scheduler, KV block manager, engine loop, the asyncio
  handle); pure Python, no jax or numpy.
- tl/model: what a model is: its config, its files, its weight encodings and families (the
  pure forward), converting GGUF.
- tl/runtime: the device side: the execution plan, placement, compiling, running and sampling
  the step.
- tl/text: the text side: tokenizer, chat template, tool-call formats, reasoning (thinking)
  markers, structured-output grammars.
- tl/entry: the operational entry points: building a served engine, the CLI, pulling models,
  the multi-host group.
"""
