//! The Kafka side: client configuration shared by every Kafka client pgcdc
//! opens.
//!
//! Guarantee: user properties pass through to librdkafka unchanged, except
//! the few that the delivery guarantee depends on
//! ([`crate::config::MANAGED_KAFKA_PROPERTIES`]), which validation refuses
//! and which are set here.

use rdkafka::ClientConfig;

use crate::config::KafkaConfig;

/// A librdkafka config with the brokers and the user's pass-through
/// properties (SASL, SSL, compression, ...).
pub fn client_config(kafka: &KafkaConfig) -> ClientConfig {
    let mut cc = ClientConfig::new();
    cc.set("bootstrap.servers", &kafka.brokers);
    for (k, v) in kafka.properties.iter() {
        cc.set(k, v);
    }
    // Keep librdkafka's own log lines (which can echo config) off stderr;
    // they go through `tracing` instead.
    cc.set_log_level(rdkafka::config::RDKafkaLogLevel::Warning);
    cc
}
