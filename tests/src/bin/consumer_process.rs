//! A consumer process for `tests/consumers.rs`, which SIGKILLs it. Its transport never
//! acknowledges ([`NeverAck`]), so every message it handled was committed to the
//! database and not acknowledged to the broker when it dies.
//!
//! Arguments: `<kafka|nats|rabbitmq> <database url> <schema> <source> <destination>
//! <dead letters> <group>`.

use std::str::FromStr;

use outbox_core::Outbox;
use outbox_core::consumer::Consumer;
use outbox_core::inbox::Inbox;
use outbox_core::sqlx;
use outbox_tests::consumers::{Broker, Kafka, Nats, NeverAck, Place, Rabbit};
use outbox_tests::kafka::Job;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

async fn run<B: Broker>(outbox: Outbox, place: Place, group: &str) {
    let transport = NeverAck(B::transport(&place, group).await);
    let consumer = Consumer::builder(transport, Inbox::new(&outbox, "jobs"))
        .on_event_type::<Job, _>("Job", |tx, msg| {
            Box::pin(async move {
                sqlx::query("INSERT INTO effects (key, n, run) VALUES ($1, $2, 'child')")
                    .bind(msg.key.unwrap_or_default())
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

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [broker, url, schema, place @ .., group] = args.as_slice() else {
        panic!(
            "usage: consumer_process <kafka|nats|rabbitmq> <database url> <schema> <source> <destination> <dead letters> <group>"
        );
    };
    outbox_tests::init_tracing();
    let options = PgConnectOptions::from_str(url)
        .expect("database url")
        .options([("search_path", schema.as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .expect("connect");
    let outbox = Outbox::new(pool);
    let place = Place::from_args(place);
    match broker.as_str() {
        "kafka" => run::<Kafka>(outbox, place, group).await,
        "nats" => run::<Nats>(outbox, place, group).await,
        "rabbitmq" => run::<Rabbit>(outbox, place, group).await,
        other => panic!("unknown broker {other}"),
    }
}
