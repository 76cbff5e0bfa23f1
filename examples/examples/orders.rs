//! The orders scenario of the source article, with real parts: PostgreSQL and a
//! Kafka-protocol broker (`scripts/services.sh` starts both).
//!
//! `eval "$(scripts/services.sh)" && cargo run -p outbox-examples --example orders`
//! (`DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`; `KAFKA_BROKERS`,
//! default `127.0.0.1:9092`).
//!
//! `cargo run -p outbox-examples --example orders -- --asyncapi orders.asyncapi.yaml`
//! writes the service's event contract (AsyncAPI 3.0; JSON unless the file ends in
//! `.yaml`) and exits.

use outbox_examples::orders::{Config, run, write_contract};

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [] => {}
        [flag, path] if flag == "--asyncapi" => {
            if let Err(e) = write_contract(std::path::Path::new(path)) {
                eprintln!("cannot write the contract to {path}: {e}");
                std::process::exit(1);
            }
            println!("wrote the event contract (AsyncAPI 3.0) to {path}");
            return;
        }
        _ => {
            eprintln!("usage: orders [--asyncapi <file.json|file.yaml>]");
            std::process::exit(2);
        }
    }
    let config = Config {
        database_url: std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned()),
        brokers: std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned()),
        orders: 100,
    };
    match run(&config, |step| println!("- {step}")).await {
        Ok(s) => {
            println!(
                "summary: confirmed {}, refused {}, published {}, reserved {}, duplicates skipped {}, BOOK-1 left {}",
                s.confirmed, s.refused, s.published, s.reserved, s.duplicates_skipped, s.stock_left
            );
            // What the numbers say, since they need not match one for one.
            println!(
                "  published: the {} confirmed orders' events and the one replayed; more \
                 would be a publish repeated after a retry (at-least-once)",
                s.confirmed
            );
            println!(
                "  duplicates skipped: the replayed event, and any message the broker \
                 delivered again (after a rebalance, say): the inbox recognised its id, so \
                 each order reserved stock once ({} reserved)",
                s.reserved
            );
        }
        Err(e) => {
            eprintln!("orders example failed: {e}\n(is everything up? run scripts/services.sh)");
            std::process::exit(1);
        }
    }
}
