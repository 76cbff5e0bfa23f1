//! A consumer process for `tests/kafka_consumer_crash.rs`, which SIGKILLs it after its
//! database commits and before it commits any Kafka offset (offsets are committed only at
//! shutdown: `auto.commit.interval.ms` is ten minutes).
//!
//! Arguments: `<database url> <schema> <brokers> <topic> <group>`.

use std::str::FromStr;

use outbox_core::Outbox;
use outbox_core::consumer::Consumer;
use outbox_core::inbox::Inbox;
use outbox_core::sqlx;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[derive(serde::Deserialize)]
struct Job {
    n: i32,
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, schema, brokers, topic, group] = args.as_slice() else {
        panic!("usage: kafka_test_consumer <database url> <schema> <brokers> <topic> <group>");
    };
    outbox_tests::init_tracing();
    let options = PgConnectOptions::from_str(url)
        .expect("database url")
        .options([("search_path", schema.as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options)
        .await
        .expect("connect");
    let outbox = Outbox::new(pool);
    let transport = outbox_tests::kafka::transport(brokers, group.as_str(), topic)
        .set("auto.commit.interval.ms", "600000")
        .build()
        .await
        .expect("kafka transport");
    let consumer = Consumer::builder(transport, Inbox::new(&outbox, "jobs"))
        .on_event_type::<Job, _>("Job", |tx, msg| {
            Box::pin(async move {
                sqlx::query("INSERT INTO effects (n, run) VALUES ($1, 'child')")
                    .bind(msg.event.n)
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            })
        })
        .build()
        .expect("consumer");
    let (_keep_running, shutdown) = tokio::sync::watch::channel(false);
    consumer.run(shutdown).await.expect("consume");
}
