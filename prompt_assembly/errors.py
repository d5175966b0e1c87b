"""The project's one error hierarchy: every error that crosses a package boundary is a ``ShopperError``.

It lives in the bottom layer so that every package can subclass it; each package keeps its own errors
in its own ``errors.py`` (or next to the one gate that raises them), and this docstring draws the whole
tree, the way ``httpx/_exceptions.py`` does::

    ShopperError                                  prompt_assembly.errors (this module)
    ├── MalformedEvent                            prompt_assembly.events: bytes that are no shopper event
    ├── ConfigurationError                        a setting that cannot work; raised at start, not later
    │   ├── InsecureConfiguration                 pipeline.kafka_security: a secret on a plaintext protocol
    │   └── CalibrationError                      serving.simulator.cost_model: no table for the model
    ├── LLMError                                  llm_client.errors: a call to a replica failed
    │   ├── TransportError  (retryable)           the replica could not be reached or broke off
    │   │   ├── EndpointUnavailable               a 5xx or 429, an error inside a stream
    │   │   │   └── ConnectionFailed              refused, reset, cut off: ejected at once
    │   │   └── AttemptTimeout                    one attempt ran past its share of the deadline
    │   ├── InvalidAnswer   (retried once)        a 2xx that is no usable answer (shape, types, schema)
    │   │   ├── AnswerTooLarge                    ... over ``AnswerLimits``
    │   │   └── InvalidRanking                    realtime.ranking: no usable ranking
    │   ├── NoHealthyEndpoint (retryable)         every replica is ejected, drained or quarantined
    │   ├── DeadlineExceeded                      the whole call ran past its deadline, slot wait included
    │   ├── RetryBudgetExhausted                  retries are capped so an outage does not multiply load
    │   ├── KvCacheGone                           P/D: the context server's blocks are gone (prefill again)
    │   └── BadRequest                            a 4xx: the request itself is wrong
    ├── RunnerError                               runner.errors: the embedded runner stopped
    │   ├── ConsumerFailed                        Kafka said the topic, login or TLS cannot work
    │   └── DeadLettersUndelivered                the DLQ took no delivery within the sink bound
    ├── StackError                                devstack.errors: a local service did not start
    │   ├── FlinkJobFailed                        a job failed, or could not be submitted or stopped
    │   ├── LlamaServerError                      devstack.llama: no llama-server binary or no answer
    │   └── JarChecksumMismatch                   devstack.flink_jars: a jar is not the pinned one
    ├── MissingConnectorJar                       flink_jobs.flink_connectors: no Kafka connector jar
    ├── SimulatorStartFailed                      serving.errors: a simulator replica did not start
    ├── KvCacheGone, KvTransferFailed             serving.simulator.disagg: a replica's side of a P/D pull
    ├── BatchError                                batch.errors (JobNotFound, InputChanged, BadRecord, ...)
    ├── MatchClientError                          realtime.client (MatchRejected, MatchUnavailable)
    ├── InvalidRequest                            gateway.route: a body the gateway cannot route (400)
    └── EventsUndelivered                         shopper.producer: ``shopper produce`` lost events

Built-in exceptions (``ValueError``, ``RuntimeError``, ``TypeError``) stay inside the package that
raised them: a package boundary translates them into one of the classes above, with what a person needs
to act (which replica, which setting, which record). Subclasses that used to be a ``ValueError`` keep it
as a second base, so existing ``except ValueError`` callers keep working.
"""

from __future__ import annotations


class ShopperError(Exception):
    """Base of every error this project raises across a package boundary."""


class ConfigurationError(ShopperError, ValueError):
    """A setting that cannot work (an empty endpoint list, a secret on a plaintext protocol, ...).

    Raised when the settings are read, so that a wrong deployment fails at start with the setting's
    name, instead of later with a symptom."""
