//! Active-active gateway replicas (`sync:`): each replica publishes the changes to its
//! in-flight bookings on NATS and applies the other replicas' beside its own, so every
//! replica decides on the whole fleet's requests in flight (queued prefill, decode load,
//! prefixes being computed, where pods without KV events were sent requests).
//!
//! The protocol, on core NATS publish/subscribe with prost messages ([`Batch`]):
//! - `<prefix>.bookings`: every replica's batches of updates, numbered 1, 2, … per replica
//!   (a batch it could not publish still takes its number); an empty batch every
//!   `heartbeat_ms` at the least says it is alive. A decision only wakes the publisher:
//!   updates made while it publishes go out together in the next batch.
//! - `<prefix>.snapshot.<replica>`: asks that replica for its bookings. It answers on the
//!   reply subject with batches marked as snapshot parts, after its pending updates and on
//!   the same connection (NATS keeps one publisher's order), so the snapshot is its state as
//!   of the numbered batches it published before.
//!
//! A replica asks another for a snapshot when it first hears it (either of them joined),
//! when its numbering skips (messages lost), and after reconnecting to NATS itself. A
//! replica silent for `replica_timeout_ms` has left: its bookings are dropped. While NATS is
//! away, each replica routes on what it knows, and counts what it could not share.

mod peers;
mod wire;

pub use wire::{Batch, SnapshotPart, Unusable, Update, decode_update, encode_update};

use crate::config::SyncSection;
use crate::scorer::{Pod, Scorer};
use anyhow::Context;
use async_nats::connection::State;
use bytes::Bytes;
use futures::StreamExt;
use kvgate_routing::load::{BookingUpdate, Origin};
use peers::{PeerTimings, Peers};
use prost::Message;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;
use wire::split;

/// Longest wait to hand a message to the NATS client (its buffer is full when the server
/// is away): then the message is counted as dropped.
const PUBLISH_TIMEOUT: Duration = Duration::from_millis(200);

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

struct Subjects {
    bookings: String,
    /// Requests for our snapshot.
    our_snapshot: String,
    /// Where others' snapshots come to us.
    replies: String,
    prefix: String,
}

impl Subjects {
    fn new(prefix: &str, me: &str) -> Self {
        Self {
            bookings: format!("{prefix}.bookings"),
            our_snapshot: format!("{prefix}.snapshot.{me}"),
            replies: format!("{prefix}.snapshot-reply.{me}"),
            prefix: prefix.to_string(),
        }
    }

    fn snapshot_of(&self, replica: &str) -> String {
        format!("{}.snapshot.{replica}", self.prefix)
    }
}

/// The secrets `sync` names, read at start so that a missing or empty one stops start-up
/// instead of leaving the replica unsynced.
pub struct NatsCredentials {
    token: Option<String>,
    user: Option<(String, String)>,
}

impl NatsCredentials {
    pub fn read(config: &SyncSection) -> anyhow::Result<NatsCredentials> {
        let secret = |field: &str, path: &std::path::Path| -> anyhow::Result<String> {
            let text = std::fs::read_to_string(path).with_context(|| format!("sync.{field}: {}", path.display()))?;
            let text = text.trim().to_string();
            anyhow::ensure!(!text.is_empty(), "sync.{field}: {} is empty", path.display());
            Ok(text)
        };
        let token = config.token_file.as_deref().map(|p| secret("token_file", p)).transpose()?;
        let user = match (&config.user, &config.password_file) {
            (Some(user), Some(path)) => Some((user.clone(), secret("password_file", path)?)),
            _ => None,
        };
        Ok(NatsCredentials { token, user })
    }

    fn apply(self, mut options: async_nats::ConnectOptions, config: &SyncSection) -> async_nats::ConnectOptions {
        if let Some(token) = self.token {
            options = options.token(token);
        }
        if let Some((user, password)) = self.user {
            options = options.user_and_password(user, password);
        }
        if let Some(tls) = &config.tls {
            options = options.require_tls(true);
            if let Some(ca) = &tls.ca_file {
                options = options.add_root_certificates(ca.clone());
            }
            if let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) {
                options = options.add_client_certificate(cert.clone(), key.clone());
            }
        }
        options
    }
}

/// Connects to NATS and runs the publisher and the receiver for good (the client
/// reconnects by itself). Call with `scorer.sync_state()` present.
pub async fn run(scorer: Arc<Scorer>, config: SyncSection, credentials: NatsCredentials) {
    let me = config.replica();
    let subjects = Arc::new(Subjects::new(&config.subject_prefix, &me));
    let (events_tx, events) = mpsc::unbounded_channel();
    let options = async_nats::ConnectOptions::new()
        .name(format!("kvgate-scorer {me}"))
        .no_echo()
        .retry_on_initial_connect()
        .max_reconnects(None)
        .ping_interval(Duration::from_secs(5))
        .reconnect_delay_callback(|attempts| Duration::from_millis((100 * attempts as u64).min(2000)))
        .event_callback(move |event| {
            let tx = events_tx.clone();
            async move {
                let _ = tx.send(event);
            }
        });
    let options = credentials.apply(options, &config);
    let urls: Vec<&str> = config.nats.urls().collect();
    let client = match options.connect(urls.as_slice()).await {
        Ok(client) => client,
        Err(e) => {
            // Only a malformed address gets here (connecting is retried in the background).
            tracing::error!("sync: cannot use NATS at {}: {e}; routing on this replica's bookings only", config.nats);
            scorer.sync_state().joined.store(true, Ordering::Relaxed);
            return;
        }
    };
    tracing::info!(replica = %me, nats = %config.nats, prefix = %config.subject_prefix, "sharing bookings over NATS");
    let (snapshot_tx, snapshot_rx) = mpsc::unbounded_channel();
    let publisher = Publisher {
        scorer: scorer.clone(),
        client: client.clone(),
        me: me.clone(),
        subjects: subjects.clone(),
        seq: 0,
        heartbeat: Duration::from_millis(config.heartbeat_ms),
    };
    tokio::spawn(publisher.run(snapshot_rx));
    receive(scorer, client, me, subjects, config, snapshot_tx, events).await;
}

/// Sends this replica's booking changes, heartbeats and snapshots, in one order.
struct Publisher {
    scorer: Arc<Scorer>,
    client: async_nats::Client,
    me: String,
    subjects: Arc<Subjects>,
    /// Number of the last batch (published or dropped).
    seq: u64,
    heartbeat: Duration,
}

impl Publisher {
    async fn run(mut self, mut snapshot_requests: mpsc::UnboundedReceiver<async_nats::Subject>) {
        let mut tick = tokio::time::interval(self.heartbeat);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_sent = Instant::now();
        let scorer = self.scorer.clone();
        loop {
            tokio::select! {
                _ = scorer.sync_state().wake.notified() => {
                    let (updates, pods) = self.scorer.take_shared();
                    if !updates.is_empty() {
                        self.send_updates(&updates, &pods).await;
                        last_sent = Instant::now();
                    }
                }
                _ = tick.tick() => {
                    if last_sent.elapsed() >= self.heartbeat {
                        self.send_updates(&[], &[]).await;
                        last_sent = Instant::now();
                    }
                }
                Some(reply) = snapshot_requests.recv() => {
                    let (pending, snapshot, pods) = self.scorer.snapshot_shared();
                    if !pending.is_empty() {
                        self.send_updates(&pending, &pods).await;
                    }
                    self.send_snapshot(reply, &snapshot, &pods).await;
                    last_sent = Instant::now();
                }
            }
        }
    }

    fn batch(&self, seq: u64, updates: Vec<Update>, snapshot: Option<SnapshotPart>) -> Bytes {
        Batch { replica: self.me.clone(), seq, sent_at: unix_now(), updates, snapshot }.encode_to_vec().into()
    }

    /// Publishes updates (none: a heartbeat) as numbered batches.
    async fn send_updates(&mut self, updates: &[BookingUpdate], pods: &[Arc<Pod>]) {
        let metrics = &self.scorer.metrics.sync;
        let wire: Vec<Update> = updates.iter().map(|u| encode_update(u, pods)).collect();
        let parts = if wire.is_empty() { vec![Vec::new()] } else { split(wire) };
        for part in parts {
            self.seq += 1;
            let n = part.len() as u64;
            let payload = self.batch(self.seq, part, None);
            if self.publish(self.subjects.bookings.clone(), payload).await {
                metrics.updates.with_label_values(&["sent"]).inc_by(n);
            } else {
                // Its number is taken: the others see the gap and ask for a snapshot.
                metrics.updates.with_label_values(&["dropped_bus_down"]).inc_by(n);
            }
        }
    }

    async fn send_snapshot(&mut self, reply: async_nats::Subject, updates: &[BookingUpdate], pods: &[Arc<Pod>]) {
        let wire: Vec<Update> = updates.iter().map(|u| encode_update(u, pods)).collect();
        let mut parts = split(wire);
        if parts.is_empty() {
            parts.push(Vec::new());
        }
        let last = parts.len() - 1;
        let mut complete = true;
        for (i, part) in parts.into_iter().enumerate() {
            let payload = self.batch(self.seq, part, Some(SnapshotPart { part: i as u32, last: i == last }));
            complete &= self.publish(reply.to_string(), payload).await;
        }
        if complete {
            self.scorer.metrics.sync.snapshots.with_label_values(&["sent"]).inc();
        }
    }

    /// Hands a message to the NATS client; false when not connected (or its buffer stays
    /// full): the message is dropped.
    async fn publish(&self, subject: String, payload: Bytes) -> bool {
        if self.client.connection_state() != State::Connected {
            return false;
        }
        let sent =
            matches!(tokio::time::timeout(PUBLISH_TIMEOUT, self.client.publish(subject, payload)).await, Ok(Ok(())));
        if sent {
            self.scorer.metrics.sync.messages.with_label_values(&["sent"]).inc();
        }
        sent
    }
}

/// The receiving side: other replicas' batches, snapshot requests, their snapshots, the
/// connection's events, and the sweep for silent replicas.
async fn receive(
    scorer: Arc<Scorer>,
    client: async_nats::Client,
    me: String,
    subjects: Arc<Subjects>,
    config: SyncSection,
    snapshot_requests: mpsc::UnboundedSender<async_nats::Subject>,
    mut events: mpsc::UnboundedReceiver<async_nats::Event>,
) {
    let subscribe = |subject: String| {
        let client = client.clone();
        async move {
            loop {
                match client.subscribe(subject.clone()).await {
                    Ok(s) => return s,
                    Err(e) => {
                        tracing::warn!("sync: subscribing to {subject}: {e}; retrying");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
        }
    };
    let mut bookings = subscribe(subjects.bookings.clone()).await;
    let mut requests = subscribe(subjects.our_snapshot.clone()).await;
    let mut replies = subscribe(subjects.replies.clone()).await;
    let metrics = &scorer.metrics.sync;
    let timings = PeerTimings {
        heartbeat: Duration::from_millis(config.heartbeat_ms),
        replica_timeout: Duration::from_millis(config.replica_timeout_ms),
        join_wait: Duration::from_millis(config.join_wait_ms),
    };
    let mut peers = Peers::new(&me, timings, Instant::now());
    let mut last_error: Option<String> = None;
    let mut sweep = tokio::time::interval(timings.heartbeat / 2);
    let ask = |replica: &str| {
        let client = client.clone();
        let (subject, reply) = (subjects.snapshot_of(replica), subjects.replies.clone());
        let me = me.clone();
        async move {
            if let Err(e) = client.publish_with_reply(subject, reply, me.into()).await {
                tracing::debug!("sync: asking for a snapshot: {e}");
            }
        }
    };
    loop {
        tokio::select! {
            Some(message) = bookings.next() => {
                metrics.messages.with_label_values(&["received"]).inc();
                let Ok(batch) = Batch::decode(message.payload) else {
                    metrics.updates.with_label_values(&["malformed"]).inc();
                    continue;
                };
                let heard = peers.batch(&batch, Instant::now());
                let Some(origin) = heard.origin else { continue };
                if heard.new_replica {
                    tracing::info!(replica = %batch.replica, "sync: another replica joined");
                }
                if let Some((expected, got)) = heard.gap {
                    metrics.gaps.inc();
                    tracing::info!(replica = %batch.replica, expected, got, "sync: messages lost; asking for a snapshot");
                }
                if heard.ask {
                    ask(&batch.replica).await;
                }
                metrics.lag_seconds.observe((unix_now() - batch.sent_at).max(0.0));
                apply(&scorer, origin, batch.updates);
                metrics.replicas.set(peers.count() as i64);
            }
            Some(message) = replies.next() => {
                metrics.messages.with_label_values(&["received"]).inc();
                let Ok(batch) = Batch::decode(message.payload) else {
                    metrics.updates.with_label_values(&["malformed"]).inc();
                    continue;
                };
                let Some(step) = peers.snapshot_part(&batch, Instant::now()) else { continue };
                if step.clear_first {
                    scorer.clear_origin(step.origin);
                }
                if step.complete {
                    metrics.snapshots.with_label_values(&["applied"]).inc();
                }
                apply(&scorer, step.origin, batch.updates);
            }
            Some(message) = requests.next() => {
                metrics.messages.with_label_values(&["received"]).inc();
                if let Some(reply) = message.reply {
                    let _ = snapshot_requests.send(reply);
                }
            }
            Some(event) = events.recv() => {
                match event {
                    async_nats::Event::Connected => {
                        metrics.connected.set(1);
                        last_error = None;
                        tracing::info!("sync: connected to NATS");
                        for name in peers.reconnected(Instant::now()) {
                            ask(&name).await;
                        }
                    }
                    async_nats::Event::Disconnected => {
                        metrics.connected.set(0);
                        tracing::warn!("sync: disconnected from NATS; routing on what this replica knows");
                    }
                    async_nats::Event::ServerError(e) => report_error(metrics, &mut last_error, "server", e.to_string()),
                    async_nats::Event::ClientError(e) => report_error(metrics, &mut last_error, "client", e.to_string()),
                    other => tracing::debug!("sync: NATS {other}"),
                }
            }
            _ = sweep.tick() => {
                let tick = peers.tick(Instant::now());
                for (name, origin) in tick.gone {
                    let dropped = scorer.clear_origin(origin);
                    metrics.replicas_lost.inc();
                    tracing::warn!(replica = %name, bookings = dropped, "sync: replica silent; its bookings dropped");
                }
                for name in tick.ask {
                    ask(&name).await;
                }
                metrics.replicas.set(peers.count() as i64);
                if tick.joined {
                    scorer.sync_state().joined.store(true, Ordering::Relaxed);
                    tracing::info!(replicas = peers.count(), "sync: joined the fleet's bookings");
                }
            }
        }
    }
}

/// Applies another replica's updates, counting what could not be.
fn apply(scorer: &Scorer, origin: Origin, updates: Vec<Update>) {
    if updates.is_empty() {
        return;
    }
    let metrics = &scorer.metrics.sync;
    let pods = scorer.addresses();
    let mut decoded = Vec::with_capacity(updates.len());
    for u in updates {
        match decode_update(u, &pods) {
            Ok(u) => decoded.push(u),
            Err(Unusable::UnknownPod) => metrics.updates.with_label_values(&["unknown_pod"]).inc(),
            Err(Unusable::UnknownKind) => metrics.updates.with_label_values(&["malformed"]).inc(),
        }
    }
    let unknown = scorer.apply_shared(origin, &decoded);
    metrics.updates.with_label_values(&["applied"]).inc_by((decoded.len() - unknown) as u64);
    metrics.updates.with_label_values(&["unknown_booking"]).inc_by(unknown as u64);
}

/// Counts an error NATS reported and logs it — at error level the first time in a row (a
/// refused credential repeats at every reconnect attempt), then at debug level.
fn report_error(metrics: &crate::metrics::SyncMetrics, last: &mut Option<String>, source: &str, error: String) {
    let refused = error.contains("authorization violation") || error.contains("authentication");
    metrics.errors.with_label_values(&[if refused { "authorization" } else { source }]).inc();
    if last.as_deref() == Some(error.as_str()) {
        tracing::debug!("sync: NATS {source} error again: {error}");
    } else if refused {
        tracing::error!(
            "sync: NATS refused this replica's credentials ({error}): check sync.token_file or sync.user; not sharing bookings until it accepts them"
        );
    } else {
        tracing::warn!("sync: NATS {source} error: {error}");
    }
    *last = Some(error);
}
