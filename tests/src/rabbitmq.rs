//! RabbitMQ for the tests (`OUTBOX_TEST_RABBITMQ_URL`, default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`): each test declares an exchange and a queue
//! of its own, and deletes them at the end.

use std::sync::atomic::{AtomicU64, Ordering};
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
    /// The body, as text (bytes that are not UTF-8 replaced).
    pub body: String,
    /// The body, the bytes as they came.
    pub bytes: Vec<u8>,
    /// The `content_type` property.
    pub content_type: Option<String>,
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
            bytes: d.data.clone(),
            content_type: p.content_type().as_ref().map(|s| s.to_string()),
        }
    }
}

/// A [`Rewrite`](crate::proxy::Rewrite) of what RabbitMQ sends its client: the publisher
/// confirms (`basic.ack`) of each channel are held and go out together at each tick of
/// the proxy, as one `multiple` ack, while everything else, returned messages first of
/// all, goes on at once. A broker that returns several messages and then confirms them
/// with one ack, as RabbitMQ does when it coalesces confirms under load, every time.
#[derive(Debug, Default)]
pub struct CoalesceConfirms {
    /// Bytes of a frame not complete yet.
    partial: Vec<u8>,
    /// Held confirms per channel.
    channels: std::collections::HashMap<u16, HeldConfirms>,
    /// Not AMQP frames (a protocol header): passed on as they come.
    raw: bool,
    counts: std::sync::Arc<Coalesced>,
}

/// What [`CoalesceConfirms`] did, over all its connections.
#[derive(Debug, Default)]
pub struct Coalesced {
    /// `multiple` acks sent.
    pub acks: AtomicU64,
    /// The broker's confirms they stood for.
    pub confirms: AtomicU64,
}

impl Coalesced {
    /// `"A acks for C confirms"`, for a test's failure message.
    pub fn summary(&self) -> String {
        format!(
            "{} multiple acks for {} confirms",
            self.acks.load(Ordering::Relaxed),
            self.confirms.load(Ordering::Relaxed)
        )
    }
}

#[derive(Debug, Default)]
struct HeldConfirms {
    /// Every delivery tag up to this one was confirmed to the client.
    done: u64,
    /// Acked by the broker, not passed on yet.
    held: std::collections::BTreeSet<u64>,
    /// Passed on (a nack) above `done`.
    passed: std::collections::BTreeSet<u64>,
}

impl CoalesceConfirms {
    /// Counting what it does into `counts`.
    pub fn new(counts: std::sync::Arc<Coalesced>) -> CoalesceConfirms {
        CoalesceConfirms {
            counts,
            ..CoalesceConfirms::default()
        }
    }

    /// The `basic.ack` frames for what is held: one `multiple` ack per channel for its
    /// confirms without a gap below them.
    fn flush(&mut self, out: &mut Vec<u8>) {
        for (channel, c) in &mut self.channels {
            let mut upto = c.done;
            let mut count = 0;
            while c.held.contains(&(upto + 1)) || c.passed.contains(&(upto + 1)) {
                upto += 1;
                if c.held.remove(&upto) {
                    count += 1;
                }
                c.passed.remove(&upto);
            }
            c.done = upto;
            if count == 0 {
                continue;
            }
            self.counts.acks.fetch_add(1, Ordering::Relaxed);
            self.counts.confirms.fetch_add(count, Ordering::Relaxed);
            let mut payload = Vec::with_capacity(13);
            payload.extend_from_slice(&60u16.to_be_bytes());
            payload.extend_from_slice(&80u16.to_be_bytes());
            payload.extend_from_slice(&upto.to_be_bytes());
            payload.push(1); // multiple
            out.push(1);
            out.extend_from_slice(&channel.to_be_bytes());
            out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
            out.extend_from_slice(&payload);
            out.push(0xCE);
        }
    }
}

impl crate::proxy::Rewrite for CoalesceConfirms {
    fn feed(&mut self, bytes: &[u8]) -> Vec<u8> {
        if self.raw || (self.partial.is_empty() && !matches!(bytes.first(), Some(1..=3 | 8))) {
            self.raw = true;
            return bytes.to_vec();
        }
        let mut partial = std::mem::take(&mut self.partial);
        partial.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut at = 0;
        while partial.len() >= at + 7 {
            let header = &partial[at..at + 7];
            let channel = u16::from_be_bytes([header[1], header[2]]);
            let size = u32::from_be_bytes([header[3], header[4], header[5], header[6]]) as usize;
            let end = at + 7 + size + 1;
            if partial.len() < end {
                break;
            }
            let frame = &partial[at..end];
            let payload = &frame[7..7 + size];
            let method = (header[0] == 1 && size >= 4).then(|| {
                (
                    u16::from_be_bytes([payload[0], payload[1]]),
                    u16::from_be_bytes([payload[2], payload[3]]),
                )
            });
            match method {
                // basic.ack: held.
                Some((60, 80)) if size >= 13 => {
                    let tag = u64::from_be_bytes(payload[4..12].try_into().expect("8 bytes"));
                    let multiple = payload[12] & 1 == 1;
                    let c = self.channels.entry(channel).or_default();
                    if multiple {
                        c.held
                            .extend((c.done + 1..=tag).filter(|t| !c.passed.contains(t)));
                    } else {
                        c.held.insert(tag);
                    }
                }
                // basic.nack: what is held goes first, then the nack as it is.
                Some((60, 120)) if size >= 13 => {
                    let tag = u64::from_be_bytes(payload[4..12].try_into().expect("8 bytes"));
                    let multiple = payload[12] & 1 == 1;
                    self.flush(&mut out);
                    let c = self.channels.entry(channel).or_default();
                    if multiple {
                        c.passed.extend(c.done + 1..=tag);
                    } else {
                        c.passed.insert(tag);
                    }
                    out.extend_from_slice(frame);
                }
                // channel.open-ok, channel.close, channel.close-ok: its tags start again.
                Some((20, 11 | 40 | 41)) => {
                    self.channels.remove(&channel);
                    out.extend_from_slice(frame);
                }
                _ => out.extend_from_slice(frame),
            }
            at = end;
        }
        partial.drain(..at);
        self.partial = partial;
        out
    }

    fn tick(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        self.flush(&mut out);
        out
    }
}
