//! The broker `outbox relay` publishes to, chosen at run time: one type over the broker
//! crates this build has (the `kafka`, `nats` and `rabbitmq` features).

use outbox_core::publisher::cloudevents::CloudEvents;
use outbox_core::{OutboxRecord, PublishError, Publisher};

use crate::failure::Failure;
#[cfg(any(feature = "kafka", feature = "nats", feature = "rabbitmq"))]
use crate::settings::BrokerKind;
use crate::settings::Settings;

/// One of the broker crates' publishers. (NATS's is large; boxed, so that the enum is
/// not as large for the others.)
#[derive(Clone)]
pub enum AnyPublisher {
    /// None: a build without any broker feature has no publisher to run.
    #[allow(dead_code)]
    None(std::convert::Infallible),
    #[cfg(feature = "kafka")]
    Kafka(outbox_kafka::KafkaPublisher),
    #[cfg(feature = "nats")]
    Nats(Box<outbox_nats::NatsPublisher>),
    #[cfg(feature = "rabbitmq")]
    Rabbitmq(outbox_rabbitmq::RabbitPublisher),
}

/// `$body` with `$p` bound to the publisher, whichever it is.
macro_rules! each {
    ($self:expr, $p:ident => $body:expr) => {
        match $self {
            AnyPublisher::None(never) => match *never {},
            #[cfg(feature = "kafka")]
            AnyPublisher::Kafka($p) => $body,
            #[cfg(feature = "nats")]
            AnyPublisher::Nats($p) => $body,
            #[cfg(feature = "rabbitmq")]
            AnyPublisher::Rabbitmq($p) => $body,
        }
    };
}

impl Publisher for AnyPublisher {
    async fn publish(&self, batch: &[OutboxRecord]) -> Vec<Result<(), PublishError>> {
        each!(self, p => p.publish(batch).await)
    }

    fn max_publish_time(&self) -> Option<std::time::Duration> {
        each!(self, p => p.max_publish_time())
    }

    fn max_batches_in_flight(&self) -> usize {
        each!(self, p => p.max_batches_in_flight())
    }

    fn messaging_system(&self) -> &'static str {
        each!(self, p => p.messaging_system())
    }

    fn server(&self) -> Option<(&str, Option<u16>)> {
        each!(self, p => p.server())
    }
}

/// Connects to the broker `settings` name (its own startup checks included: the
/// destinations named exist).
pub async fn connect(settings: &Settings) -> Result<AnyPublisher, Failure> {
    let url = settings.broker_url.as_str();
    let cloudevents = settings.cloudevents.clone();
    let broker = settings
        .broker
        .map(|b| format!("{b:?}").to_lowercase())
        .unwrap_or_default();
    let unknown = |name: &str, allowed: &str| {
        Failure::Message(format!(
            "the broker setting {name:?} is not one of {allowed} for {broker}; check \
             --broker-setting and `broker_settings` in the config file"
        ))
    };
    let kind = settings
        .broker
        .ok_or_else(|| Failure::Message("no broker given".to_owned()))?;
    match kind {
        #[cfg(feature = "kafka")]
        BrokerKind::Kafka => {
            let mut builder = outbox_kafka::KafkaPublisher::builder(url).skip_catalog_check();
            for (name, value) in &settings.broker_settings {
                builder = builder.set(name, value);
            }
            for destination in &settings.destinations {
                builder = builder.destination(destination);
            }
            if let Some(ce) = cloudevents {
                builder = builder.cloudevents(ce);
            }
            Ok(AnyPublisher::Kafka(builder.build().await.map_err(|e| {
                broker_error("Kafka", &outbox_core::ErrorChain(&e).to_string())
            })?))
        }
        #[cfg(feature = "nats")]
        BrokerKind::Nats => {
            if let Some((name, _)) = settings.broker_settings.first() {
                return Err(unknown(name, "none (NATS credentials go in the URL)"));
            }
            let mut builder = outbox_nats::NatsPublisher::builder(url).skip_catalog_check();
            for destination in &settings.destinations {
                builder = builder.destination(destination);
            }
            if let Some(ce) = cloudevents {
                builder = builder.cloudevents(ce);
            }
            Ok(AnyPublisher::Nats(Box::new(
                builder
                    .build()
                    .await
                    .map_err(|e| broker_error("NATS", &outbox_core::ErrorChain(&e).to_string()))?,
            )))
        }
        #[cfg(feature = "rabbitmq")]
        BrokerKind::Rabbitmq => {
            let mut builder = outbox_rabbitmq::RabbitPublisher::builder(url).skip_catalog_check();
            for (name, value) in &settings.broker_settings {
                match name.as_str() {
                    "tls_ca_file" => builder = builder.tls_root_certificates(value),
                    _ => return Err(unknown(name, "tls_ca_file")),
                }
            }
            for destination in &settings.destinations {
                builder = builder.destination(destination);
            }
            if let Some(ce) = cloudevents {
                builder = builder.cloudevents(ce);
            }
            Ok(AnyPublisher::Rabbitmq(builder.build().await.map_err(
                |e| broker_error("RabbitMQ", &outbox_core::ErrorChain(&e).to_string()),
            )?))
        }
        #[allow(unreachable_patterns)]
        kind => Err(Failure::Message(format!(
            "this build of `outbox` has no {kind:?} publisher; build it with the feature \
             `{}` (cargo install outbox-cli --features {0})",
            format!("{kind:?}").to_lowercase()
        ))),
    }
}

/// A broker that could not be reached or refused the setup, as one line.
fn broker_error(broker: &str, error: &str) -> Failure {
    Failure::Message(format!(
        "cannot start the {broker} publisher: {error}; check --broker-url (OUTBOX_BROKER_URL) \
         and the broker settings"
    ))
}

/// CloudEvents with `source`, or a clear error.
pub fn cloudevents(source: &str) -> Result<CloudEvents, Failure> {
    CloudEvents::new(source).map_err(|e| {
        Failure::Message(format!(
            "the CloudEvents source is not valid: {e}; check --cloudevents-source \
             (OUTBOX_CLOUDEVENTS_SOURCE)"
        ))
    })
}
