//! Serving the HTTP API (and the route stream on it) with each connection on one thread.
//!
//! Envoy keeps one route stream per worker open to the scorer, and every route call of that
//! worker is a message on it. On a shared multi-threaded runtime a call is read by the
//! connection's task on one thread, answered by a task that may run on another and written
//! back by the first: wake-ups across threads for every request. Here each accepted
//! connection goes to one of `listen_threads` threads, each running a single-threaded
//! runtime, and everything the connection does — its HTTP/2 streams, the route calls and
//! their answers — runs on that thread (measured: a quarter to a third less of the
//! scorer's CPU per short request). New connections go to the thread serving fewest.
//! A connection that opens with the route socket's preface
//! ([`kvgate_route_api::ROUTE_SOCKET_PREFACE`]) is served as one
//! ([`crate::transport::route_socket`]), on its thread likewise. Requests with large bodies are
//! prepared off the thread (see [`Scorer::prepare_owned`]), so a long tokenization does not
//! hold up the other calls of the connection.
//!
//! The HTTP app is composed here: the picking transports on `listen` ([`api_router`]) and the
//! admin endpoints beside them or on `admin.listen` ([`admin_router`]).

use crate::admin;
use crate::picking::Picker;
use crate::scorer::Scorer;
use crate::transport::{http, route_socket, route_stream};
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

/// Largest HTTP/2 frame the scorer accepts: a route call's body (tens of kB for long
/// prompts) comes in one DATA frame instead of 16 kB pieces.
const MAX_FRAME_BYTES: u32 = 1 << 20;

/// The app on `listen`: the HTTP API's picking calls, the route stream (same port, HTTP/2),
/// and the admin endpoints unless `admin.listen` moves them (the probes stay).
pub fn api_router(scorer: Arc<Scorer>, picker: Picker) -> Router {
    let probes_only = scorer.config.admin.listen.is_some();
    http::routes(picker.clone())
        .route_service(kvgate_route_api::ROUTE_STREAM_PATH, route_stream::service(picker))
        .route(kvgate_route_api::ROUTE_STREAM_V1_PATH, axum::routing::post(route_stream::refuse_v1))
        .merge(admin::routes(scorer, probes_only))
        .fallback(|| async { admin::not_found() })
        .layer(axum::extract::DefaultBodyLimit::max(kvgate_route_api::MAX_BODY_BYTES))
}

/// The app on `admin.listen`.
pub fn admin_router(scorer: Arc<Scorer>) -> Router {
    admin::routes(scorer, false).fallback(|| async { admin::not_found() })
}

/// How long connections may take to finish after a shutdown signal (Envoy's route streams
/// stay open until Envoy closes them).
const DRAIN: Duration = Duration::from_secs(5);

/// One serving thread: the connections it is given and how many it serves.
struct Worker {
    connections: mpsc::UnboundedSender<Accepted>,
    serving: Arc<AtomicUsize>,
}

/// A connection handed to a serving thread.
enum Accepted {
    /// On the API port: HTTP, or a route socket.
    Tcp(std::net::TcpStream, Watcher),
    /// On the route socket path: route sockets only.
    Unix(std::os::unix::net::UnixStream),
}

/// How long a new connection may take to send its first bytes before it is handed to HTTP
/// (which then times it out as it does any connection).
const FIRST_BYTES: Duration = Duration::from_secs(10);

/// Serves `router` (and route sockets, for `picker`) on `listener` — and route sockets on
/// `unix` — with `threads` connection threads until `shutdown` completes, then lets open
/// connections finish for up to [`DRAIN`].
pub async fn serve(
    listener: TcpListener,
    unix: Option<UnixListener>,
    router: Router,
    picker: Picker,
    threads: usize,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let mut workers = Vec::with_capacity(threads);
    for i in 0..threads.max(1) {
        let (connections, incoming) = mpsc::unbounded_channel();
        let serving = Arc::new(AtomicUsize::new(0));
        let (router, picker, count) = (router.clone(), picker.clone(), serving.clone());
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        std::thread::Builder::new()
            .name(format!("kvgate-api-{i}"))
            .spawn(move || runtime.block_on(run_worker(router, picker, incoming, count)))?;
        workers.push(Worker { connections, serving });
    }
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            accepted = accept_unix(unix.as_ref()) => {
                match accepted.and_then(|(socket, _)| socket.into_std()) {
                    Ok(socket) => hand_over(&workers, Accepted::Unix(socket))?,
                    Err(e) => tracing::warn!("accepting a route socket: {e}"),
                }
                continue;
            }
            () = &mut shutdown => break,
        };
        let tcp = match accepted {
            Ok((tcp, _)) => tcp,
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                // Out of file descriptors and the like: wait rather than spin.
                tracing::error!("accepting a connection: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!("TCP_NODELAY: {e}");
        }
        hand_over(&workers, Accepted::Tcp(tcp.into_std()?, graceful.watcher()))?;
    }
    drop(workers);
    if tokio::time::timeout(DRAIN, graceful.shutdown()).await.is_err() {
        tracing::info!("connections still open after {} s; closing them", DRAIN.as_secs());
    }
    Ok(())
}

/// Gives a connection to the thread serving fewest.
fn hand_over(workers: &[Worker], connection: Accepted) -> anyhow::Result<()> {
    let worker = workers.iter().min_by_key(|w| w.serving.load(Ordering::Relaxed)).expect("at least one thread");
    worker.serving.fetch_add(1, Ordering::Relaxed);
    if worker.connections.send(connection).is_err() {
        anyhow::bail!("a connection thread of the HTTP API has stopped");
    }
    Ok(())
}

/// The next connection to the route socket path; never, without one.
async fn accept_unix(
    unix: Option<&UnixListener>,
) -> std::io::Result<(tokio::net::UnixStream, tokio::net::unix::SocketAddr)> {
    match unix {
        Some(listener) => listener.accept().await,
        None => std::future::pending().await,
    }
}

/// A connection thread: serves the connections it is given until the acceptor is gone and
/// they have all finished.
async fn run_worker(
    router: Router,
    picker: Picker,
    mut incoming: mpsc::UnboundedReceiver<Accepted>,
    serving: Arc<AtomicUsize>,
) {
    let mut builder = Builder::new(TokioExecutor::new());
    builder.http2().max_frame_size(MAX_FRAME_BYTES);
    let builder = Arc::new(builder);
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            next = incoming.recv() => {
                let Some(accepted) = next else { break };
                let (builder, router, picker, serving) = (builder.clone(), router.clone(), picker.clone(), serving.clone());
                let (tcp, watcher) = match accepted {
                    Accepted::Tcp(tcp, watcher) => (tcp, watcher),
                    Accepted::Unix(socket) => {
                        connections.spawn(async move {
                            match tokio::net::UnixStream::from_std(socket) {
                                Ok(socket) => route_socket::serve(picker, socket).await,
                                Err(e) => tracing::warn!("registering an accepted route socket: {e}"),
                            }
                            serving.fetch_sub(1, Ordering::Relaxed);
                        });
                        continue;
                    }
                };
                connections.spawn(async move {
                    match tokio::net::TcpStream::from_std(tcp) {
                        Ok(tcp) if opens_route_socket(&tcp).await => {
                            route_socket::serve(picker, tcp).await;
                        }
                        Ok(tcp) => {
                            let service = TowerToHyperService::new(router);
                            let connection = builder.serve_connection_with_upgrades(TokioIo::new(tcp), service);
                            if let Err(e) = watcher.watch(connection).await {
                                tracing::debug!("connection ended: {e}");
                            }
                        }
                        Err(e) => tracing::warn!("registering an accepted connection: {e}"),
                    }
                    serving.fetch_sub(1, Ordering::Relaxed);
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    while connections.join_next().await.is_some() {}
}

/// Whether a new connection's first bytes are a route socket's preface.
async fn opens_route_socket(tcp: &tokio::net::TcpStream) -> bool {
    let mut first = [0u8; kvgate_route_api::ROUTE_SOCKET_PREFACE.len()];
    match tokio::time::timeout(FIRST_BYTES, tcp.peek(&mut first)).await {
        Ok(Ok(n)) => route_socket::may_be_preface(&first[..n]),
        _ => false,
    }
}

/// Errors of one connection (the client gave up while it was being accepted), not of the
/// listener.
fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    matches!(e.kind(), ConnectionRefused | ConnectionAborted | ConnectionReset)
}
