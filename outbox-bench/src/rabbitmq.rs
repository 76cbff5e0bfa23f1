//! `rabbitmq`: drain throughput to RabbitMQ. Our relay with `outbox-rabbitmq` against
//! the raw ceiling of the same client (lapin): the same messages, persistent and
//! mandatory, with the same headers, published on one confirm-mode channel with 4,096
//! unconfirmed at a time, every confirm awaited. Both go to a fresh durable topic
//! exchange and queue. The target is judged against the lower of that ceiling and the
//! database's claim+mark ceiling (d), both measured in the same run.

use std::time::Instant;

use futures_util::StreamExt;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Confirmation, Connection, ConnectionProperties, ExchangeKind};
use outbox_rabbitmq::RabbitPublisher;

use crate::BoxError;
use crate::report::{Report, Target};
use crate::setup::{Args, BenchDb};

const IN_FLIGHT: usize = 4096;

fn url() -> String {
    std::env::var("OUTBOX_BENCH_RABBITMQ")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// A fresh exchange with a queue bound to it; returns the exchange's name (the queue has
/// the same name).
async fn fresh(connection: &Connection) -> Result<String, BoxError> {
    let channel = connection.create_channel().await?;
    let name = format!("outbox-bench-{}", uuid::Uuid::now_v7().simple());
    channel
        .exchange_declare(
            name.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_declare(
            name.as_str().into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_bind(
            name.as_str().into(),
            name.as_str().into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok(name)
}

async fn delete(connection: &Connection, name: &str) -> Result<(), BoxError> {
    let channel = connection.create_channel().await?;
    channel
        .queue_delete(name.into(), QueueDeleteOptions::default())
        .await?;
    channel
        .exchange_delete(name.into(), ExchangeDeleteOptions::default())
        .await?;
    Ok(())
}

pub async fn drain(args: &Args, report: &mut Report) -> Result<(), BoxError> {
    let (db_ceiling, _) = crate::scenarios::pg_ceiling(args).await?;
    let connection = Connection::connect(&url(), ConnectionProperties::default()).await?;

    // The relay.
    let name = fresh(&connection).await?;
    let destination = format!("{name}/events");
    let mut db = BenchDb::new(args).await?;
    db.destination = destination.clone();
    db.fill(args.events, args.keys, args.payload).await?;
    let publisher = RabbitPublisher::builder(url())
        .skip_catalog_check()
        .destination(&destination)
        .build()
        .await?;
    let relay_rate = crate::scenarios::timed_drain(args, &db, publisher).await?;
    db.drop().await?;
    delete(&connection, &name).await?;

    // The ceiling: the same client, the same kind of messages, no database.
    let name = fresh(&connection).await?;
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    let body = format!(
        r#"{{"filler":"{}"}}"#,
        "x".repeat(args.payload.saturating_sub(14))
    );
    let started = Instant::now();
    let confirmed = futures_util::stream::iter(0..args.events)
        .map(|i| {
            let (channel, name, body) = (&channel, &name, &body);
            async move {
                let id = uuid::Uuid::now_v7().to_string();
                let text = |s: &str| AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()));
                let mut headers = FieldTable::default();
                headers.insert("message-id".into(), text(&id));
                headers.insert("event-type".into(), text("BenchEvent"));
                headers.insert("content-type".into(), text("application/json"));
                headers.insert(
                    "partition-key".into(),
                    text(&format!("k{}", i % args.keys.max(1))),
                );
                let properties = BasicProperties::default()
                    .with_message_id(id.as_str().into())
                    .with_type("BenchEvent".into())
                    .with_content_type("application/json".into())
                    .with_delivery_mode(2)
                    .with_headers(headers);
                let confirm = channel
                    .basic_publish(
                        name.as_str().into(),
                        "events".into(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..Default::default()
                        },
                        body.as_bytes(),
                        properties,
                    )
                    .await?
                    .await?;
                Ok::<_, lapin::Error>(matches!(confirm, Confirmation::Ack(None)))
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .filter(|r| std::future::ready(matches!(r, Ok(true))))
        .count()
        .await;
    let ceiling = confirmed as f64 / started.elapsed().as_secs_f64();
    delete(&connection, &name).await?;
    if confirmed as u64 != args.events {
        return Err(format!(
            "the ceiling run had {confirmed} of {} confirmed",
            args.events
        )
        .into());
    }

    report.add(
        "rabbitmq",
        "(n) raw publish with confirms ceiling: lapin, persistent, mandatory, 4,096 unconfirmed (no database)",
        ceiling,
        "events/s",
    );
    report.add(
        "rabbitmq",
        "(d) PostgreSQL claim+mark ceiling (no broker)",
        db_ceiling,
        "events/s",
    );
    report.add(
        "rabbitmq",
        "(r) outbox relay -> RabbitMQ",
        relay_rate,
        "events/s",
    );
    report.target(
        "rabbitmq",
        "(r) / min(n, d)",
        relay_rate / ceiling.min(db_ceiling),
        Target::AtLeast(0.7),
    );
    let _ = connection.close(200, "done".into()).await;
    Ok(())
}
