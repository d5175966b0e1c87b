"""How both engines talk to Kafka securely: one typed model, turned into the two clients' properties.

``KafkaSecurity`` is the one place TLS and SASL are configured; ``librdkafka_properties`` gives the
embedded runner's confluent-kafka Consumer/Producer their keys, ``java_kafka_properties`` gives the Flink
Kafka connector (the Java client) the equivalent ones. Both are pure: they map settings to properties and
do no I/O, so a test can check that what an operator sets reaches each client unchanged.

Supported: ``SSL`` (server verified against ``ssl_ca_file``, optional client certificate for mTLS),
``SASL_SSL`` / ``SASL_PLAINTEXT`` with ``PLAIN``, ``SCRAM-SHA-256`` or ``SCRAM-SHA-512``. Amazon MSK's
IAM authentication needs a token-signing plug-in on each client (``aws-msk-iam-auth`` jar for Java,
an OAUTHBEARER callback for librdkafka); it is documented in docs/security.md, not built in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, FilePath, SecretStr, model_validator

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]

SHADED_PREFIX = "org.apache.flink.kafka.shaded."
"""The Flink SQL Kafka connector jar relocates ``org.apache.kafka`` under this package, and JAAS names
the login module by class name, so the name must carry the prefix when that jar is used."""

_LOGIN_MODULES: dict[SaslMechanism, str] = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}


class KafkaSecurity(BaseModel):
    """TLS and SASL settings of a Kafka client (env, nested: ``RUNNER_KAFKA_SECURITY__PROTOCOL=SSL``,
    ``FLINK_JOB_KAFKA__SECURITY__SASL_PASSWORD=...``). Invalid combinations fail at start-up."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    protocol: SecurityProtocol = Field("PLAINTEXT", description="security.protocol")
    ssl_ca_file: FilePath | None = Field(
        None, description="PEM CA bundle that signed the brokers' certificates; None = system CAs"
    )
    ssl_cert_file: FilePath | None = Field(None, description="client certificate (PEM), for mutual TLS")
    ssl_key_file: FilePath | None = Field(None, description="the client certificate's private key (PEM)")
    ssl_key_password: SecretStr | None = Field(None, description="if that key is encrypted")
    ssl_verify_hostname: bool = Field(
        True, description="check the broker's name against its certificate (off only for IP-only test setups)"
    )
    sasl_mechanism: SaslMechanism | None = Field(None, description="sasl.mechanism(s)")
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None

    @model_validator(mode="after")
    def _consistent(self) -> KafkaSecurity:
        tls = self.protocol in ("SSL", "SASL_SSL")
        sasl = self.protocol.startswith("SASL_")
        if not tls and any(v is not None for v in (self.ssl_ca_file, self.ssl_cert_file, self.ssl_key_file)):
            raise ValueError(f"ssl_* files are set but protocol is {self.protocol}; use SSL or SASL_SSL")
        if (self.ssl_cert_file is None) != (self.ssl_key_file is None):
            raise ValueError("mutual TLS needs both ssl_cert_file and ssl_key_file")
        if sasl and (self.sasl_mechanism is None or self.sasl_username is None or self.sasl_password is None):
            raise ValueError(f"{self.protocol} needs sasl_mechanism, sasl_username and sasl_password")
        if not sasl and self.sasl_mechanism is not None:
            raise ValueError(f"sasl_mechanism is set but protocol is {self.protocol}; use SASL_SSL")
        return self


def librdkafka_properties(security: KafkaSecurity) -> dict[str, str]:
    """confluent-kafka (librdkafka) configuration keys for ``security``; merge them into every
    Consumer, Producer and AdminClient config. Empty for ``PLAINTEXT``."""
    if security.protocol == "PLAINTEXT":
        return {}
    props: dict[str, str] = {"security.protocol": security.protocol.lower()}
    if security.protocol in ("SSL", "SASL_SSL"):
        if security.ssl_ca_file is not None:
            props["ssl.ca.location"] = _absolute(security.ssl_ca_file)
        if security.ssl_cert_file is not None and security.ssl_key_file is not None:
            props["ssl.certificate.location"] = _absolute(security.ssl_cert_file)
            props["ssl.key.location"] = _absolute(security.ssl_key_file)
        if security.ssl_key_password is not None:
            props["ssl.key.password"] = security.ssl_key_password.get_secret_value()
        props["ssl.endpoint.identification.algorithm"] = "https" if security.ssl_verify_hostname else "none"
    if security.sasl_mechanism is not None:
        assert security.sasl_username is not None and security.sasl_password is not None
        props["sasl.mechanism"] = security.sasl_mechanism
        props["sasl.username"] = security.sasl_username
        props["sasl.password"] = security.sasl_password.get_secret_value()
    return props


def java_kafka_properties(security: KafkaSecurity, *, shaded: bool = True) -> dict[str, str]:
    """Kafka Java client properties for ``security`` (the Flink connector's ``set_property``): PEM
    trust and key stores (Kafka 2.7+, KIP-651) and a JAAS line for SASL. ``shaded``: the login module
    lives under ``SHADED_PREFIX`` (the ``flink-sql-connector-kafka`` jar); False for the plain client."""
    if security.protocol == "PLAINTEXT":
        return {}
    props: dict[str, str] = {"security.protocol": security.protocol}
    if security.protocol in ("SSL", "SASL_SSL"):
        if security.ssl_ca_file is not None:
            props["ssl.truststore.type"] = "PEM"
            props["ssl.truststore.location"] = _absolute(security.ssl_ca_file)
        if security.ssl_cert_file is not None and security.ssl_key_file is not None:
            # A PEM key store given by location is ONE file with the private key and the certificate
            # chain (KIP-651); for Flink, ``ssl_key_file`` must be that combined file (docs/security.md).
            props["ssl.keystore.type"] = "PEM"
            props["ssl.keystore.location"] = _absolute(security.ssl_key_file)
        if security.ssl_key_password is not None:
            props["ssl.key.password"] = security.ssl_key_password.get_secret_value()
        props["ssl.endpoint.identification.algorithm"] = "https" if security.ssl_verify_hostname else ""
    if security.sasl_mechanism is not None:
        assert security.sasl_username is not None and security.sasl_password is not None
        module = (SHADED_PREFIX if shaded else "") + _LOGIN_MODULES[security.sasl_mechanism]
        props["sasl.mechanism"] = security.sasl_mechanism
        props["sasl.jaas.config"] = (
            f"{module} required username={_jaas_quote(security.sasl_username)} "
            f"password={_jaas_quote(security.sasl_password.get_secret_value())};"
        )
    return props


def _absolute(path: Path) -> str:
    """Clients resolve relative paths against their own working directory (a Flink task manager's is
    not ours), and redis-py/librdkafka failed with relative CA paths here: always pass absolute ones."""
    return str(Path(path).resolve())


def _jaas_quote(value: str) -> str:
    """A JAAS option value in double quotes, with backslashes and quotes escaped."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
