"""What tests share, and no tests: model builders (models: the one tiny config TINY, SmolLM2's
shape SMOLLM2, model directories), fake runners and engines (fake_runner, fake_engine, fake_think),
granian targets (fake_app, gap_app, chat_page_app) and the server harness (granian_server,
asgi_client, serve_app), differential drivers (differential, engine_cases, runner), independent
references (numpy_llama, numpy_gguf_reference, spm_reference, attention_cases, bounds),
structured-output cases (structured) and file writers (gguf_writer). Imported as
`from tests.helpers.x import y`.
"""
