"""How both engines talk to Kafka securely: one typed model, turned into the two clients' properties.

``KafkaSecurity`` is the one place TLS and SASL are configured; ``librdkafka_properties`` gives the
embedded runner's confluent-kafka Consumer/Producer their keys, ``java_kafka_properties`` gives the Flink
Kafka connector (the Java client) the equivalent ones. Both are pure: they map settings to properties and
do no I/O, so a test can check that what an operator sets reaches each client unchanged.

Supported: ``SSL`` (server verified against ``ssl_ca_file``, optional client certificate for mTLS),
``SASL_SSL`` / ``SASL_PLAINTEXT`` with ``PLAIN``, ``SCRAM-SHA-256`` or ``SCRAM-SHA-512``. Amazon MSK's
IAM authentication needs a token-signing plug-in on each client (``aws-msk-iam-auth`` jar for Java,
an OAUTHBEARER callback for librdkafka); it is documented in docs/security.md, not built in.

Settings that cannot work fail when they are read, with the setting's name: ``InsecureConfiguration``
for a secret or a TLS file given to a protocol that would not use it (an ``ssl_key_password`` or a
``sasl_password`` on ``PLAINTEXT``: the operator believes the connection is protected and it is not),
``ConfigurationError`` for the other contradictions. ``configuration_error`` turns pydantic's
``ValidationError`` of a component's settings (which wraps them) back into that error.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, FilePath, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsError

from prompt_assembly.errors import ConfigurationError

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]

SHADED_PREFIX = "org.apache.flink.kafka.shaded."
"""The Flink SQL Kafka connector jar relocates ``org.apache.kafka`` under this package, and JAAS names
the login module by class name, so the name must carry the prefix when that jar is used, and must not
when the thin connector jar and the plain ``kafka-clients`` jar are (``flink_jobs.flink_connectors.
connector_kafka_properties`` looks at the jars to decide)."""

_LOGIN_MODULES: dict[SaslMechanism, str] = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}


def login_module(mechanism: SaslMechanism, *, shaded: bool) -> str:
    """The JAAS login module class for ``mechanism``, relocated under ``SHADED_PREFIX`` if ``shaded``."""
    return (SHADED_PREFIX if shaded else "") + _LOGIN_MODULES[mechanism]


class InsecureConfiguration(ConfigurationError):
    """A secret or a TLS setting given to a Kafka protocol that would not use it: the operator believes
    the connection is encrypted or authenticated, and it would be neither."""


class KafkaSecurity(BaseModel):
    """TLS and SASL settings of a Kafka client (env, nested: ``RUNNER_KAFKA_SECURITY__PROTOCOL=SSL``,
    ``FLINK_JOB_KAFKA__SECURITY__SASL_PASSWORD=...``). Invalid combinations fail at start-up: built
    directly, with ``InsecureConfiguration`` / ``ConfigurationError``; nested in a component's settings,
    inside pydantic's ``ValidationError`` (``configuration_error`` unwraps it)."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

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

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as error:
            raise configuration_error(error) from None  # the input may hold secrets

    @model_validator(mode="after")
    def _consistent(self) -> KafkaSecurity:
        tls = self.protocol in ("SSL", "SASL_SSL")
        sasl = self.protocol.startswith("SASL_")
        if not tls:
            unused = [name for name in _TLS_SETTINGS if getattr(self, name) is not None]
            if unused:
                raise InsecureConfiguration(
                    f"{', '.join(unused)} set but protocol is {self.protocol}: nothing would be "
                    "encrypted; use SSL or SASL_SSL"
                )
        if not sasl:
            unused = [name for name in _SASL_SETTINGS if getattr(self, name) is not None]
            if unused and self.protocol == "PLAINTEXT":
                raise InsecureConfiguration(
                    f"{', '.join(unused)} set but protocol is PLAINTEXT: the client would neither "
                    "authenticate nor encrypt; use SASL_SSL"
                )
            if unused:
                raise ConfigurationError(
                    f"{', '.join(unused)} set but protocol is {self.protocol}: SASL is never used; "
                    "use SASL_SSL"
                )
        if (self.ssl_cert_file is None) != (self.ssl_key_file is None):
            raise ConfigurationError("mutual TLS needs both ssl_cert_file and ssl_key_file")
        if sasl and (self.sasl_mechanism is None or self.sasl_username is None or self.sasl_password is None):
            missing = [name for name in _SASL_SETTINGS if getattr(self, name) is None]
            raise ConfigurationError(
                f"{self.protocol} needs sasl_mechanism, sasl_username and sasl_password "
                f"({', '.join(missing)} missing)"
            )
        return self


_TLS_SETTINGS = ("ssl_ca_file", "ssl_cert_file", "ssl_key_file", "ssl_key_password")
_SASL_SETTINGS = ("sasl_mechanism", "sasl_username", "sasl_password")


def configuration_error(error: ValidationError, settings: str | None = None) -> ConfigurationError:
    """``error``, pydantic's account of why ``settings`` (a name to start the message with: ``RUNNER_*``,
    ``the Flink job's settings``) could not be read, as the project's ``ConfigurationError``: of the class a
    validator raised (``InsecureConfiguration`` first), one line per problem with the setting's dotted
    name, and never the values given (they may be secrets). Raise it ``from None``: the
    ``ValidationError`` it replaces prints the input."""
    causes = [e.get("ctx", {}).get("error") for e in error.errors()]
    raised = [c for c in causes if isinstance(c, ConfigurationError)]
    kinds = {type(c) for c in raised}
    kind: type[ConfigurationError] = (
        kinds.pop()
        if len(kinds) == 1
        else InsecureConfiguration
        if any(isinstance(c, InsecureConfiguration) for c in raised)
        else ConfigurationError
    )
    lines = []
    for item, cause in zip(error.errors(), causes, strict=True):
        where = ".".join(str(part) for part in item["loc"])
        what = str(cause) if isinstance(cause, ConfigurationError) else item["msg"]
        lines.append(f"{where}: {what}" if where else what)
    return kind((f"{settings}: " if settings else "") + "; ".join(lines))


def unparsable_setting(error: SettingsError, env_prefix: str) -> ConfigurationError:
    """pydantic-settings' ``SettingsError`` (a variable of a list or a section holds no valid JSON) as a
    ``ConfigurationError`` that names the variables to check, never their values."""
    field = re.search(r'field "(\w+)"', str(error))
    section = f"{env_prefix}{field.group(1).upper()}" if field else f"{env_prefix}*"
    return ConfigurationError(
        f"{section} (or, for a section, one of its {section}__* variables) is not valid JSON where a "
        """list or a section is expected (a list is written as JSON: '["http://host:8000"]')"""
    )


SettingsT = TypeVar("SettingsT", bound=BaseSettings)


def settings_from_environment(settings_class: type[SettingsT], **given: Any) -> SettingsT:
    """``settings_class(**given)``, the rest read from its environment variables (what is ``given``
    wins over them); a value it refuses is one line (``configuration_error``, ``unparsable_setting``)
    naming the setting after the class's prefix (``SINK_* settings: ...``), never pydantic's dump of
    the input."""
    prefix = str(settings_class.model_config.get("env_prefix", ""))
    try:
        return settings_class(**given)
    except ValidationError as error:
        raise configuration_error(error, f"{prefix}* settings") from None
    except SettingsError as error:
        raise unparsable_setting(error, prefix) from None


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


def java_kafka_properties(security: KafkaSecurity, *, shaded: bool) -> dict[str, str]:
    """Kafka Java client properties for ``security`` (the Flink connector's ``set_property``): PEM
    trust and key stores (Kafka 2.7+, KIP-651) and a JAAS line for SASL. ``shaded``: the login module
    lives under ``SHADED_PREFIX`` (the ``flink-sql-connector-kafka`` jar); False for the thin connector
    with the plain ``kafka-clients`` jar. No default: naming a class that is not on the classpath fails
    the job's first connection (``flink_jobs.flink_connectors.connector_kafka_properties`` decides)."""
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
        module = login_module(security.sasl_mechanism, shaded=shaded)
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
