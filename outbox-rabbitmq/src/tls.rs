//! `amqps://`: the CA certificates to trust beside the system's, and telling a failed TLS
//! handshake from an unreachable broker.

use std::path::Path;

use lapin::tcp::OwnedTLSConfig;
use lapin::{Connection, ConnectionProperties};

/// Opens a connection to `url`. With `ca_file` (a PEM file, read at every connect so a
/// rotated file is picked up), `amqps://` also trusts the CA certificates in it.
pub(crate) async fn connect(
    url: &str,
    properties: ConnectionProperties,
    ca_file: Option<&Path>,
) -> lapin::Result<Connection> {
    let Some(path) = ca_file else {
        return Connection::connect(url, properties).await;
    };
    let pem = tokio::fs::read_to_string(path).await.map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("cannot read the CA file {}: {e}", path.display()),
        )
    })?;
    let config = OwnedTLSConfig {
        identity: None,
        cert_chain: Some(pem),
    };
    Connection::connect_with_config(url, properties, config, lapin::runtime::default_runtime()?)
        .await
}

/// Whether `e` is a failed TLS handshake: an I/O error that carries rustls' error (a
/// certificate no trusted CA signed, a host name it does not name).
pub(crate) fn is_tls_failure(e: &lapin::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if cause.is::<rustls::Error>()
            || cause
                .downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .is_some_and(|inner| inner.is::<rustls::Error>())
        {
            return true;
        }
        source = cause.source();
    }
    false
}
