//! The accept loop: HTTP/1.1 connections served by hyper with a cap on how many are open,
//! timeouts, each request carrying the client's address (`ConnectInfo`), and a graceful stop.
//!
//! `axum::serve` sets no timer, so a client that never finishes its request head holds its
//! connection forever. Here the head must arrive within `--header-timeout` or `--timeout`,
//! whichever is shorter (hyper's
//! header-read timer, which also runs while a keep-alive connection sits idle between
//! requests, so it is the idle timeout too); the body must arrive within `--timeout`
//! ([`super::Body`]) and each write complete within it (a client that stops reading is
//! dropped), as llama-server's read/write timeouts. Past `--max-connections` new connections
//! wait in the kernel's listen backlog until one closes. HTTP/1.1 only, like llama-server.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt;

/// The connection bounds.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// The request head must arrive within this; an idle keep-alive connection closes after it.
    pub header: Duration,
    /// Each write must complete within this (`--timeout`).
    pub write: Duration,
    /// Open connections at most.
    pub connections: usize,
}

/// Serves `app` on `listener` until `stop` resolves, then stops accepting, asks every
/// connection to close after its request in flight, and returns once they have all closed.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    bounds: Bounds,
    stop: impl Future<Output = ()> + Send,
) {
    // Dropping the receiver tells the connections to finish; the sender's receivers count
    // the connections still open.
    let (stop_tx, stop_rx) = watch::channel(());
    let (open_tx, open_rx) = watch::channel(());
    let mut stop = pin!(stop);
    let slots = Arc::new(Semaphore::new(bounds.connections.max(1)));
    let mut warned: Option<std::time::Instant> = None;
    loop {
        let quiet = warned.is_some_and(|t| t.elapsed() < Duration::from_secs(10));
        if slots.available_permits() == 0 && !quiet {
            warned = Some(std::time::Instant::now());
            tracing::warn!(
                target: "tern::server",
                "{} connections open (--max-connections): new ones wait until one closes",
                bounds.connections
            );
        }
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = &mut stop => break,
        };
        let (tcp, remote) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors and the like: wait rather than spin.
                    tracing::warn!(target: "tern::server", "accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut stop => break,
        };
        let _ = tcp.set_nodelay(true);
        let mut io = tokio_io_timeout::TimeoutStream::new(tcp);
        io.set_write_timeout(Some(bounds.write));
        let io = TokioIo::new(Box::pin(io));
        let svc = app
            .clone()
            .map_request(move |mut req: axum::http::Request<Incoming>| {
                req.extensions_mut().insert(ConnectInfo(remote));
                req.map(axum::body::Body::new)
            });
        let svc = TowerToHyperService::new(svc);
        let mut stopped = stop_rx.clone();
        let open = open_rx.clone();
        tokio::spawn(async move {
            let mut b = hyper::server::conn::http1::Builder::new();
            b.timer(TokioTimer::new())
                .header_read_timeout(bounds.header)
                .keep_alive(true);
            let conn = b.serve_connection(io, svc).with_upgrades();
            let mut conn = pin!(conn);
            let mut closing = false;
            loop {
                tokio::select! {
                    r = conn.as_mut() => {
                        if let Err(e) = r {
                            tracing::trace!(target: "tern::server", "connection {remote}: {e}");
                        }
                        break;
                    }
                    _ = stopped.changed(), if !closing => {
                        closing = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
            drop(open);
            drop(permit);
        });
    }
    drop(listener);
    drop(stop_rx);
    let _ = stop_tx.send(());
    drop(open_rx);
    open_tx.closed().await;
}
