"""The expstream error hierarchy.

Modelled on kafka-python's ``kafka.errors``: every class says, through its ``retriable`` class
attribute, whether doing the same thing again later can succeed. The shared stage runner relies on
that single bit:

* ``retriable = True``  -> back off and try again (broker or Redis briefly unreachable);
* ``retriable = False`` -> retrying cannot help: a bad record goes to the dead-letter topic, a bad
  configuration stops the process with a message that names the field and the fix.

An instance may override ``retriable`` when its cause says otherwise (for example a
``ProduceError`` caused by a record that is too large for the broker).

The process exit codes live here too, so the command line, ``expstream run`` and the supervisor
(which must not restart a configuration error) read them from one place.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "ExpstreamError",
    "ConfigError",
    "AuthError",
    "PoisonRecordError",
    "InfraError",
    "BrokerUnavailableError",
    "StateUnavailableError",
    "ProduceError",
    "ShutdownRequested",
    "unknown_key_error",
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_CONFIG",
    "EXIT_INTERRUPTED",
    "EXIT_BROKEN_PIPE",
]

# --- exit codes of `expstream ...` and of every stage process -----------------------------------
EXIT_OK = 0
#: The run failed (a stage could not be kept alive, or a timeout), or a stage process gave up.
EXIT_FAILED = 1
#: A configuration error: the message names the field and the fix. Restarting cannot help.
EXIT_CONFIG = 2
#: Interrupted by Ctrl-C (128 + SIGINT, the shell's convention) after a clean shutdown.
EXIT_INTERRUPTED = 130
#: The reader of standard output went away (``expstream ... | head``): 128 + SIGPIPE, as the shell
#: reports a program that SIGPIPE ended; the command stops quietly, without a traceback.
EXIT_BROKEN_PIPE = 141


class ExpstreamError(Exception):
    """Base class of every error raised on purpose by expstream."""

    #: Whether the same operation may succeed when tried again later.
    retriable: bool = False


class ConfigError(ExpstreamError):
    """A configuration value is missing, unknown or out of range. Not retriable.

    The message names the offending field and says how to fix it::

        raise ConfigError("unknown kafka setting 'sesion_timeout_ms'", field="kafka.sesion_timeout_ms",
                          fix="did you mean 'session_timeout_ms'?")
    """

    retriable = False

    def __init__(self, message: str, *, field: str | None = None, fix: str | None = None) -> None:
        self.message = message  # without the field and the fix, for callers that phrase their own
        self.field = field
        self.fix = fix
        text = message
        if field and field not in message:
            text = f"{field}: {text}"
        if fix:
            text = f"{text} (fix: {fix})"
        super().__init__(text)


class AuthError(ConfigError):
    """A service refused our credentials (a wrong Redis password, NOAUTH/WRONGPASS; a Kafka SASL
    failure). Not retriable: the same password fails again however long one waits, so it is
    reported at once, as a configuration error (exit code 2, never restarted by the supervisor)."""

    retriable = False


class PoisonRecordError(ExpstreamError):
    """A record that can never be processed (bad payload, inconsistent ids, non-finite values).

    Not retriable: the runner sends the original bytes to the ``<topic>.dlq`` twin and moves on.
    """

    retriable = False


class InfraError(ExpstreamError):
    """The broker or Redis is unreachable or misbehaving. Retriable: back off and try again."""

    retriable = True


class BrokerUnavailableError(InfraError):
    """No Kafka broker answered (bootstrap failed, connection refused, request timed out)."""


class StateUnavailableError(InfraError):
    """Redis did not answer within the reconnect budget of :class:`expstream.state.RedisState`."""


class ProduceError(InfraError):
    """A record was not acknowledged by the broker.

    Retriable by default (a timeout, a leader change). When the underlying kafka-python error is
    not retriable (for example ``MessageSizeTooLargeError``), or ``refused`` says the broker refused
    the record (the confluent-kafka producer's reports, expstream/kafka/rdkafka.py), the instance's
    ``retriable`` is False.
    """

    def __init__(self, message: str, *, cause: BaseException | None = None, refused: bool = False) -> None:
        super().__init__(message)
        self.cause = cause
        if refused or _broker_refused(cause):
            self.retriable = False


class ShutdownRequested(ExpstreamError):
    """Raised inside a stage loop when SIGTERM/SIGINT asked the process to stop. Not retriable."""

    retriable = False


def _broker_refused(exc: BaseException | None) -> bool:
    """True for a kafka-python ``BrokerResponseError`` that kafka-python itself marks not retriable
    (record too large, authorization failed, ...). Generic client errors stay retriable."""
    if exc is None:
        return False
    try:
        from kafka.errors import BrokerResponseError
    except ImportError:  # pragma: no cover - kafka-python is a hard dependency
        return False
    return isinstance(exc, BrokerResponseError) and not exc.retriable


def unknown_key_error(block: str, key: object, allowed: Iterable[str], *, what: str = "key",
                      origin: str | None = None) -> ConfigError:
    """The ConfigError for a key that ``block`` does not have, naming the closest valid one.

    One helper for every configuration block (the topology's blocks, stages and ``--set`` paths,
    and ``KafkaConfig``), so a typo reads the same everywhere::

        algo.advantage_estimatr: unknown key. Did you mean algo.advantage_estimator? (valid keys: ...)

    ``block`` is the dotted path of the enclosing block ("" at the top level); ``what`` names the
    kind of key (key, block, stage); ``origin`` says where it was written (e.g. ``--set``).
    The suggestion is given only when one is close enough (difflib's ratio >= 0.6), since a far
    guess misleads more than the list of valid keys does.
    """
    choices = [str(c) for c in allowed]
    where = f"{block}.{key}" if block else str(key)
    head = f"{where} (from {origin})" if origin else where
    if not choices:
        return ConfigError(f"{head}: unknown {what} ({block} has no keys below it)", field=where)
    close = difflib.get_close_matches(str(key), choices, n=1, cutoff=0.6)
    hint = f". Did you mean {block + '.' if block else ''}{close[0]}?" if close else ""
    return ConfigError(f"{head}: unknown {what}{hint} (valid {what}s: {', '.join(choices)})", field=where)
