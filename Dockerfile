# GRACE serving image. Today it carries the index tools (`grace synth`, `grace
# build-index`, `grace builder`); the multi-stage CUDA server image comes with issue #6.
# Build: docker build -t grace-serving .   Run the sidecar:
#   docker run -v $PWD/data:/data grace-serving builder --catalog /data/catalog.parquet --out /data/index
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY service ./service
COPY kernels ./kernels
COPY index_builder ./index_builder
# TORCH_PIP_ARGS: e.g. "--index-url <your CPU wheel index>" for a small CPU-only image
ARG TORCH_PIP_ARGS=""
RUN pip install $TORCH_PIP_ARGS "torch>=2.11" && pip install .
RUN useradd --create-home --uid 10001 grace
USER grace
ENTRYPOINT ["grace"]
CMD ["--help"]
