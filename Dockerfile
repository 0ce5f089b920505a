# tl in a container: CPU by default, the JAX GPU wheels behind a build argument.
#   docker build -t ghcr.io/example/tl:0.1.0 .
#   docker build --build-arg JAX_EXTRA='jax[cuda12]' -t ghcr.io/example/tl:0.1.0-gpu .
# The default model is baked in (MODEL=""  leaves /models empty for a mounted volume). The
# compile caches live under /cache: mount a persistent volume there, or every start recompiles.
FROM python:3.11-slim

ARG JAX_EXTRA=""
ARG MODEL=smol-135m

# g++ builds the native CPU kernels for this CPU on first start (kernels/cpu_build.py)
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 tl \
    && mkdir -p /models /cache && chown tl:tl /models /cache

WORKDIR /app
COPY pyproject.toml README.md ./
COPY tl tl
COPY kernels kernels
COPY serve serve
COPY bench bench
COPY configs configs
RUN pip install --no-cache-dir ".[tracing]" \
    && if [ -n "$JAX_EXTRA" ]; then pip install --no-cache-dir "$JAX_EXTRA"; fi

USER tl
RUN if [ -n "$MODEL" ]; then tl pull "$MODEL" --root /models; fi

ENV TL_ENGINE__MODEL_DIR=/models/smol-135m \
    TL_ENGINE__HTTP_LISTEN=0.0.0.0:8000 \
    TL_ENGINE__HEALTH_LISTEN=0.0.0.0:9464 \
    TL_ENGINE__COMPILE_CACHE_DIR=/cache/jax \
    TL_ENGINE__NATIVE_CACHE_DIR=/cache/native
EXPOSE 8000 9464
CMD ["tl", "serve", "--config", "/app/configs/runtime.toml"]
