"""The text side: the tokenizer (tokenizer.json), chat templates rendered as transformers does,
tool-call formats and their parser, and structured output's grammars (llguidance).

May import: tl.core (the request records and protocols), tl.model.config and tl.model.files
(reading a model directory); never jax, the runtime or ops.
"""
