# The project's Python services outside Flink: the LLM simulator replicas and the event producer.
#
#   docker build -f docker/app.Dockerfile -t shopper-understanding-app .
FROM python:3.11-slim

WORKDIR /opt/app
COPY pyproject.toml README.md* ./
COPY prompt_assembly ./prompt_assembly
COPY llm_client ./llm_client
COPY sinks ./sinks
COPY pipeline ./pipeline
COPY runner ./runner
COPY capacity ./capacity
COPY gateway ./gateway
COPY serving ./serving
COPY flink_jobs ./flink_jobs
COPY shopper ./shopper
COPY devstack ./devstack
COPY batch ./batch
COPY realtime ./realtime
RUN pip install --no-cache-dir . && useradd --create-home app
USER app
