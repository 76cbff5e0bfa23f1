//! The consumer layer with each inbox database (PostgreSQL, MariaDB/MySQL, SQLite)
//! behind each broker's transport: messages handled and committed by a consumer that
//! stopped before acknowledging them come again, and the inbox of that database skips
//! every one.

use std::time::Duration;

use outbox_core::Outbox;
use outbox_core::consumer::{Consumer, ConsumerBuilder, Transport};
use outbox_core::inbox::Inbox;
use outbox_tests::backends::TestBackend;
use outbox_tests::consumers::{Broker, NeverAck, job};
use outbox_tests::kafka::Job;
use outbox_tests::wait_until;

const WAIT: Duration = Duration::from_secs(60);

/// A consumer of `Job`s recording each in `effects`.
fn consumer<DB: TestBackend, T: Transport>(
    transport: T,
    outbox: &Outbox<DB>,
) -> ConsumerBuilder<T, DB> {
    Consumer::builder(transport, Inbox::new(outbox, "jobs"))
        .concurrency(2)
        .on_event_type::<Job, _>("Job", |tx, msg| {
            Box::pin(async move {
                let sql = format!("INSERT INTO effects (n) VALUES ({})", msg.event.n);
                DB::exec_on(&mut **tx, &sql).await;
                Ok(())
            })
        })
}

async fn redeliveries_are_skipped<DB: TestBackend, B: Broker>() {
    let fixture = DB::fixture().await;
    let outbox = fixture.outbox.clone();
    DB::exec(&fixture, "CREATE TABLE effects (n INTEGER NOT NULL)").await;
    let place = B::place().await;
    let group = outbox_tests::kafka::unique("db-group").replace('.', "-");
    let jobs: Vec<_> = (0..5).map(|n| job(&place.destination, "k", n)).collect();
    B::publish(&place, &jobs).await;

    // Handled and committed, never acknowledged.
    let first = consumer(NeverAck(B::transport(&place, &group).await), &outbox)
        .build()
        .expect("consumer")
        .spawn();
    wait_until("five handled", WAIT, || async {
        first.stats().handled >= 5
    })
    .await;
    first.shutdown().await.expect("consumer");

    let again = consumer(B::transport(&place, &group).await, &outbox)
        .build()
        .expect("consumer")
        .spawn();
    wait_until("five skipped as duplicates", WAIT, || async {
        again.stats().duplicates >= 5
    })
    .await;
    let stats = again.stats();
    again.shutdown().await.expect("consumer");
    assert_eq!((stats.handled, stats.duplicates), (0, 5), "{stats:?}");
    assert_eq!(DB::int(&fixture, "SELECT count(*) FROM effects").await, 5);
    B::remove(place).await;
    DB::cleanup(fixture).await;
}

macro_rules! matrix {
    ($($name:ident: $db:ty, $broker:ty;)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                redeliveries_are_skipped::<$db, $broker>().await;
            }
        )*
    };
}

use outbox_core::sqlx::{MySql, Postgres, Sqlite};
use outbox_tests::consumers::{Kafka, Nats, Rabbit};

matrix! {
    postgres_inbox_behind_kafka: Postgres, Kafka;
    postgres_inbox_behind_nats: Postgres, Nats;
    postgres_inbox_behind_rabbitmq: Postgres, Rabbit;
    mysql_inbox_behind_kafka: MySql, Kafka;
    mysql_inbox_behind_nats: MySql, Nats;
    mysql_inbox_behind_rabbitmq: MySql, Rabbit;
    sqlite_inbox_behind_kafka: Sqlite, Kafka;
    sqlite_inbox_behind_nats: Sqlite, Nats;
    sqlite_inbox_behind_rabbitmq: Sqlite, Rabbit;
}
