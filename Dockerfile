# GRACE serving image (CPU): `grace serve`, `grace builder` and the index tools from one
# image. The multi-stage CUDA image, compose stack and Kubernetes manifests come with #6.
# Build: docker build -t grace-serving .   Run the sidecar:
#   docker run -v $PWD/data:/data grace-serving builder --catalog /data/catalog.parquet --out /data/index
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
# g++ builds the C++ post stage (service/post) during `pip install .`
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml setup.py README.md ./
COPY proto ./proto
COPY service ./service
COPY kernels ./kernels
COPY index_builder ./index_builder
# TORCH_PIP_ARGS: e.g. "--index-url <your CPU wheel index>" for a small CPU-only image
ARG TORCH_PIP_ARGS=""
RUN pip install $TORCH_PIP_ARGS "torch>=2.11" && pip install .
RUN useradd --create-home --uid 10001 grace
USER grace
ENTRYPOINT ["grace"]
EXPOSE 50051 9464
CMD ["serve", "--data-dir", "/data"]
