# Flink 2.3 with PyFlink, this project's package and the Kafka connector jar: one image for the job
# manager, the task managers and the one-shot job submitter (see docker-compose.yml).
#
#   docker build -f docker/flink.Dockerfile -t shopper-understanding-flink .
#
# The connector jar comes from scripts/fetch-flink-connectors (pinned version, SHA-256 checked). A build
# machine that cannot reach Maven Central can pre-fetch it into flink_jobs/lib/ (or set MAVEN_MIRROR):
# a jar already there is verified and used as is.
FROM flink:2.3.0-scala_2.12-java17

USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential curl \
    && rm -rf /var/lib/apt/lists/*

# PyFlink is the Python half of the runtime: its version must equal the cluster's (2.3.0).
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
    && /opt/venv/bin/pip install --no-cache-dir "apache-flink==2.3.0"
ENV PATH="/opt/venv/bin:${PATH}"

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
COPY scripts ./scripts
COPY docker/flink-job.yaml ./docker/flink-job.yaml
COPY deploy/kubernetes/flink-job.yaml ./deploy/kubernetes/flink-job.yaml
RUN /opt/venv/bin/pip install --no-cache-dir ".[flink]"

ARG MAVEN_MIRROR=https://repo.maven.apache.org/maven2
RUN MAVEN_MIRROR="$MAVEN_MIRROR" scripts/fetch-flink-connectors \
    && cp flink_jobs/lib/flink-sql-connector-kafka-*.jar /opt/flink/lib/ \
    && cp /opt/flink/opt/flink-python-*.jar /opt/flink/lib/ \
    && chown -R flink:flink /opt/app /opt/flink/lib

# The Python workers and `flink run -py` use the venv's interpreter. The job's session stage runs in
# PyFlink's thread mode (PEMJA, in the TaskManager's JVM): flink-python in lib/ and pemja loaded
# parent-first, so libpython is loaded once per JVM (docs/flink.md, "Latency").
ENV FLINK_PROPERTIES="python.executable: /opt/venv/bin/python
python.client.executable: /opt/venv/bin/python
classloader.parent-first-patterns.additional: pemja."
USER flink
