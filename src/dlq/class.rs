//! Failure classes, and the one function that decides what the runtime
//! does with a failure: retry it, quarantine the message, or stop.
//!
//! Guarantee: every failure the materializer or the connector meets goes
//! through [`classify`], so "retry or dead-letter" is decided in one place
//! and a message is classified when it arrives, never later.

use std::fmt;

/// Why a message was quarantined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    /// Not Confluent-framed Avro, or a body its writer schema cannot decode.
    Deserialization,
    /// A schema id the registry does not know.
    UnknownSchema,
    /// The writer schema cannot be read as what the reader needs.
    SchemaIncompatible,
    /// The target database stayed unavailable through every retry.
    SinkUnavailable,
    /// The target refused the change (a constraint).
    ConstraintViolation,
    /// A value the target or the encoder cannot take.
    UnsupportedValue,
    /// Larger than the broker accepts.
    Oversized,
}

impl Class {
    pub const ALL: [Class; 7] = [
        Class::Deserialization,
        Class::UnknownSchema,
        Class::SchemaIncompatible,
        Class::SinkUnavailable,
        Class::ConstraintViolation,
        Class::UnsupportedValue,
        Class::Oversized,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Class::Deserialization => "deserialization",
            Class::UnknownSchema => "unknown_schema",
            Class::SchemaIncompatible => "schema_incompatible",
            Class::SinkUnavailable => "sink_unavailable",
            Class::ConstraintViolation => "constraint_violation",
            Class::UnsupportedValue => "unsupported_value",
            Class::Oversized => "oversized",
        }
    }

    pub fn parse(text: &str) -> Option<Class> {
        Class::ALL.into_iter().find(|c| c.as_str() == text)
    }
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What went wrong, as the code that met it saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault<'a> {
    /// No payload to decode, a wrong magic byte, or too short for a frame.
    Framing,
    /// The registry's answer to a schema look-up: an HTTP status, or
    /// `None` when it could not be reached.
    SchemaLookup { status: Option<u16> },
    /// The body does not decode with its writer schema, or the envelope
    /// lacks a part every changelog record has.
    Body,
    /// The writer's field cannot become the mirror's column.
    ReaderMismatch,
    /// A value the mirror's type cannot hold.
    Value,
    /// An error of the target database: its SQLSTATE (`None` when the
    /// connection failed), and how many attempts the batch has had.
    Target {
        sqlstate: Option<&'a str>,
        attempts: u32,
        max_attempts: u32,
    },
    /// A column value the connector cannot encode.
    Encode,
    /// An encoded record over the broker's size limit.
    TooLarge,
    /// The source database failed the connector: its SQLSTATE, `None` when
    /// the connection failed or closed.
    Source { sqlstate: Option<&'a str> },
    /// TLS to the source was refused: its certificate failed verification,
    /// or the CA file could not be used.
    Untrusted,
    /// The broker failed a request; `refused` when a retry cannot change
    /// the answer (authentication, authorization, a fenced producer, a bad
    /// client setting).
    Broker { refused: bool },
    /// Registering a schema failed: the registry's HTTP status, `None`
    /// when it could not be reached.
    Register { status: Option<u16> },
}

/// What the runtime does with a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Quarantine the message with this class; its partition moves on.
    Quarantine(Class),
    /// Not the message's fault: retry with backoff (`cause` labels the
    /// retry metric); nothing moves meanwhile.
    Retry(&'static str),
    /// A retry cannot fix it and no message is to blame (a read model's SQL
    /// no longer valid): stop with the error.
    Stop,
}

/// The one place that decides.
pub fn classify(fault: &Fault<'_>) -> Verdict {
    match *fault {
        Fault::Framing | Fault::Body => Verdict::Quarantine(Class::Deserialization),
        Fault::SchemaLookup { status: Some(404) } => Verdict::Quarantine(Class::UnknownSchema),
        // Unreachable, failing or refusing us: the registry's fault.
        Fault::SchemaLookup { .. } => Verdict::Retry("registry"),
        Fault::ReaderMismatch => Verdict::Quarantine(Class::SchemaIncompatible),
        Fault::Value | Fault::Encode => Verdict::Quarantine(Class::UnsupportedValue),
        Fault::TooLarge => Verdict::Quarantine(Class::Oversized),
        Fault::Target {
            sqlstate,
            attempts,
            max_attempts,
        } => {
            let outage = Verdict::Retry("target");
            let Some(code) = sqlstate else {
                // No SQLSTATE: the connection (refused, closed, timed out).
                return bounded(outage, attempts, max_attempts);
            };
            match code.get(..2).unwrap_or_default() {
                "23" => Verdict::Quarantine(Class::ConstraintViolation),
                "22" => Verdict::Quarantine(Class::UnsupportedValue),
                // Conflicts with another transaction: redo, never an outage.
                "40" => outage,
                // Connection, resources, shutdown, system errors.
                "08" | "53" | "57" | "58" => bounded(outage, attempts, max_attempts),
                _ if code == "55P03" => outage, // lock not available
                _ => Verdict::Stop,
            }
        }
        // A retry meets the same certificate: the operator must act.
        Fault::Untrusted => Verdict::Stop,
        Fault::Source { sqlstate } => match sqlstate.and_then(|c| c.get(..2)) {
            // Closed, refused, shutting down, starting up, out of resources,
            // or a conflict with another transaction.
            None | Some("08" | "40" | "53" | "57" | "58") => Verdict::Retry("source"),
            // Authentication, a dropped slot, an invalidated slot, ...
            Some(_) => Verdict::Stop,
        },
        Fault::Broker { refused: false } => Verdict::Retry("broker"),
        Fault::Broker { refused: true } => Verdict::Stop,
        Fault::Register { status } => match status {
            None | Some(408 | 429 | 500..=599) => Verdict::Retry("registry"),
            // Refused credentials or a refused schema: no retry changes it.
            Some(_) => Verdict::Stop,
        },
    }
}

/// An outage is retried `max_attempts` times (0: for ever), then the
/// messages are quarantined so the partitions move on.
fn bounded(retry: Verdict, attempts: u32, max_attempts: u32) -> Verdict {
    if max_attempts > 0 && attempts >= max_attempts {
        Verdict::Quarantine(Class::SinkUnavailable)
    } else {
        retry
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(code: Option<&str>, attempts: u32) -> Verdict {
        classify(&Fault::Target {
            sqlstate: code,
            attempts,
            max_attempts: 3,
        })
    }

    #[test]
    fn every_class_has_a_name_that_parses_back() {
        for c in Class::ALL {
            assert_eq!(Class::parse(c.as_str()), Some(c));
        }
        assert_eq!(Class::parse("Oversized"), None);
    }

    #[test]
    fn records_that_cannot_be_read_are_deserialization_or_unknown_schema() {
        use Verdict::*;
        assert_eq!(
            classify(&Fault::Framing),
            Quarantine(Class::Deserialization)
        );
        assert_eq!(classify(&Fault::Body), Quarantine(Class::Deserialization));
        assert_eq!(
            classify(&Fault::SchemaLookup { status: Some(404) }),
            Quarantine(Class::UnknownSchema)
        );
        // The registry's own trouble is never the record's fault.
        for status in [None, Some(500), Some(503), Some(401)] {
            assert_eq!(classify(&Fault::SchemaLookup { status }), Retry("registry"));
        }
        assert_eq!(
            classify(&Fault::ReaderMismatch),
            Quarantine(Class::SchemaIncompatible)
        );
    }

    #[test]
    fn the_target_refusing_data_quarantines_at_once() {
        use Verdict::*;
        assert_eq!(
            target(Some("23505"), 1),
            Quarantine(Class::ConstraintViolation)
        );
        assert_eq!(
            target(Some("23514"), 1),
            Quarantine(Class::ConstraintViolation)
        );
        assert_eq!(
            target(Some("22P02"), 1),
            Quarantine(Class::UnsupportedValue)
        );
        assert_eq!(
            target(Some("22012"), 1),
            Quarantine(Class::UnsupportedValue)
        );
        assert_eq!(classify(&Fault::Value), Quarantine(Class::UnsupportedValue));
        assert_eq!(
            classify(&Fault::Encode),
            Quarantine(Class::UnsupportedValue)
        );
        assert_eq!(classify(&Fault::TooLarge), Quarantine(Class::Oversized));
    }

    #[test]
    fn an_outage_is_retried_until_the_attempts_run_out() {
        use Verdict::*;
        for code in [
            None,
            Some("08006"),
            Some("57P01"),
            Some("53300"),
            Some("58030"),
        ] {
            assert_eq!(target(code, 1), Retry("target"), "{code:?}");
            assert_eq!(target(code, 2), Retry("target"), "{code:?}");
            assert_eq!(
                target(code, 3),
                Quarantine(Class::SinkUnavailable),
                "{code:?}"
            );
        }
        // max_attempts = 0: retried for ever.
        let forever = Fault::Target {
            sqlstate: None,
            attempts: 1_000,
            max_attempts: 0,
        };
        assert_eq!(classify(&forever), Retry("target"));
    }

    #[test]
    fn outages_of_the_connectors_services_are_retried_and_refusals_stop() {
        use Verdict::*;
        for code in [
            None,
            Some("08006"),
            Some("57P01"),
            Some("57P03"),
            Some("53300"),
        ] {
            assert_eq!(classify(&Fault::Source { sqlstate: code }), Retry("source"));
        }
        // Bad credentials, a missing slot, an invalidated slot.
        for code in ["28P01", "42704", "55000"] {
            let fault = Fault::Source {
                sqlstate: Some(code),
            };
            assert_eq!(classify(&fault), Stop, "{code}");
        }
        assert_eq!(classify(&Fault::Untrusted), Stop);
        assert_eq!(classify(&Fault::Broker { refused: false }), Retry("broker"));
        assert_eq!(classify(&Fault::Broker { refused: true }), Stop);
        for status in [None, Some(500), Some(503), Some(429)] {
            assert_eq!(classify(&Fault::Register { status }), Retry("registry"));
        }
        for status in [401, 403, 409, 422] {
            let fault = Fault::Register {
                status: Some(status),
            };
            assert_eq!(classify(&fault), Stop, "{status}");
        }
    }

    #[test]
    fn conflicts_retry_for_ever_and_broken_sql_stops() {
        use Verdict::*;
        // A serialization failure is no outage, however often it happens.
        assert_eq!(target(Some("40001"), 99), Retry("target"));
        assert_eq!(target(Some("40P01"), 99), Retry("target"));
        assert_eq!(target(Some("55P03"), 99), Retry("target"));
        // A view's SQL referring to a column that is gone.
        assert_eq!(target(Some("42703"), 1), Stop);
        assert_eq!(target(Some("42P01"), 1), Stop);
    }
}
