//! RabbitMQ for the tests (`OUTBOX_TEST_RABBITMQ_URL`, default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`): each test declares an exchange and a queue
//! of its own, and deletes them at the end.

use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};

/// The broker the tests use.
pub fn rabbitmq_url() -> String {
    std::env::var("OUTBOX_TEST_RABBITMQ_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// The broker's address in [`rabbitmq_url`], for a proxy in front of it.
pub fn rabbitmq_address() -> std::net::SocketAddr {
    let url = rabbitmq_url();
    url.split_once('@')
        .map_or(url.as_str(), |(_, rest)| rest)
        .split('/')
        .next()
        .unwrap_or_default()
        .parse()
        .expect("OUTBOX_TEST_RABBITMQ_URL is amqp://user:password@ip:port/vhost")
}

/// A topic exchange and a queue bound to it with `binding`, both named for this test.
#[derive(Debug)]
pub struct Topology {
    /// Kept open for the reader and the clean-up.
    pub connection: Connection,
    /// The exchange's name.
    pub exchange: String,
    /// The queue's name.
    pub queue: String,
}

impl Topology {
    /// Declares them (durable, so a broker restart keeps them).
    pub async fn declare(binding: &str) -> Topology {
        let connection = Connection::connect(&rabbitmq_url(), ConnectionProperties::default())
            .await
            .expect("connect to RabbitMQ");
        let channel = connection.create_channel().await.expect("channel");
        let id = uuid::Uuid::now_v7().simple().to_string();
        let (exchange, queue) = (format!("outbox-test-{id}"), format!("outbox-test-{id}"));
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declare exchange");
        channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declare queue");
        channel
            .queue_bind(
                queue.as_str().into(),
                exchange.as_str().into(),
                binding.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("bind queue");
        Topology {
            connection,
            exchange,
            queue,
        }
    }

    /// Reads `count` messages from the queue (acknowledging them), or fails after
    /// `timeout` naming how many came.
    pub async fn read(&self, count: usize, timeout: Duration) -> Vec<Read> {
        let channel = self.connection.create_channel().await.expect("channel");
        let mut consumer = channel
            .basic_consume(
                self.queue.as_str().into(),
                "outbox-test-reader".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("consume");
        let mut read = Vec::new();
        let deadline = tokio::time::Instant::now() + timeout;
        while read.len() < count {
            let next = tokio::time::timeout_at(deadline, consumer.next()).await;
            let Ok(Some(delivery)) = next else {
                panic!(
                    "read {} of {count} messages from {}",
                    read.len(),
                    self.queue
                );
            };
            let delivery = delivery.expect("delivery");
            delivery.ack(BasicAckOptions::default()).await.expect("ack");
            read.push(Read::from(&delivery));
        }
        let _ = channel.close(200, "read".into()).await;
        read
    }

    /// Deletes the queue and the exchange.
    pub async fn delete(self) {
        let channel: Channel = self.connection.create_channel().await.expect("channel");
        let _ = channel
            .queue_delete(self.queue.as_str().into(), QueueDeleteOptions::default())
            .await;
        let _ = channel
            .exchange_delete(
                self.exchange.as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await;
        let _ = self.connection.close(200, "done".into()).await;
    }
}

/// One message as a consumer sees it.
#[derive(Debug, Clone)]
pub struct Read {
    /// The `message_id` property.
    pub message_id: Option<String>,
    /// The `type` property.
    pub kind: Option<String>,
    /// `delivery_mode` (2: persistent).
    pub delivery_mode: Option<u8>,
    /// The routing key it was published with.
    pub routing_key: String,
    /// The headers, as text.
    pub headers: std::collections::BTreeMap<String, String>,
    /// The body.
    pub body: String,
}

impl From<&lapin::message::Delivery> for Read {
    fn from(d: &lapin::message::Delivery) -> Read {
        let p = &d.properties;
        let headers = p
            .headers()
            .as_ref()
            .map(|t| {
                t.inner()
                    .iter()
                    .filter_map(|(k, v)| match v {
                        AMQPValue::LongString(s) => Some((
                            k.to_string(),
                            String::from_utf8_lossy(s.as_bytes()).into_owned(),
                        )),
                        _ => None,
                    })
                    .collect()
            })
            .unwrap_or_default();
        Read {
            message_id: p.message_id().as_ref().map(|s| s.to_string()),
            kind: p.kind().as_ref().map(|s| s.to_string()),
            delivery_mode: *p.delivery_mode(),
            routing_key: d.routing_key.to_string(),
            headers,
            body: String::from_utf8_lossy(&d.data).into_owned(),
        }
    }
}
