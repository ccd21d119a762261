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

use crate::config::SyncSection;
use crate::scorer::{Pod, Scorer};
use ahash::AHashMap;
use anyhow::Context;
use async_nats::connection::State;
use bytes::Bytes;
use futures::StreamExt;
use kvgate_routing::adapters::AdapterId;
use kvgate_routing::hash::SequenceHash;
use kvgate_routing::load::{BookingUpdate, Leg, Lifecycle, Origin};
use kvgate_routing::pod_set::PodId;
use prost::Message;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

/// A NATS message carries at most this many bytes of updates (servers accept 1 MiB by
/// default); more go in several numbered batches.
const MAX_MESSAGE_BYTES: usize = 256 * 1024;
/// A snapshot asked for and not received is asked for again after this long.
const SNAPSHOT_RETRY: Duration = Duration::from_secs(1);
/// Longest wait to hand a message to the NATS client (its buffer is full when the server
/// is away): then the message is counted as dropped.
const PUBLISH_TIMEOUT: Duration = Duration::from_millis(200);

/// One message of the booking sync.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Batch {
    /// The sending replica's `replica_id`.
    #[prost(string, tag = "1")]
    pub replica: String,
    /// Number of the sender's batch on `<prefix>.bookings` (1, 2, …); on snapshot parts,
    /// the last number the snapshot accounts for.
    #[prost(uint64, tag = "2")]
    pub seq: u64,
    /// When it was sent (Unix seconds), for the lag metric.
    #[prost(double, tag = "3")]
    pub sent_at: f64,
    #[prost(message, repeated, tag = "4")]
    pub updates: Vec<Update>,
    /// Set on the parts of a snapshot: the first replaces every booking the sender had
    /// shared before.
    #[prost(message, optional, tag = "5")]
    pub snapshot: Option<SnapshotPart>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SnapshotPart {
    #[prost(uint32, tag = "1")]
    pub part: u32,
    #[prost(bool, tag = "2")]
    pub last: bool,
}

/// One booking change ([`BookingUpdate`]), the pod named by the address the proxy routes to.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Update {
    #[prost(string, tag = "1")]
    pub request: String,
    #[prost(bool, tag = "2")]
    pub prefill_leg: bool,
    #[prost(enumeration = "Kind", tag = "3")]
    pub kind: i32,
    /// `ip:port` (booked and moved).
    #[prost(string, tag = "4")]
    pub pod: String,
    #[prost(uint32, tag = "5")]
    pub prompt_tokens: u32,
    #[prost(uint32, tag = "6")]
    pub cached_tokens: u32,
    /// The prompt's block chain (booked).
    #[prost(fixed64, repeated, tag = "7")]
    pub chain: Vec<u64>,
    #[prost(uint32, optional, tag = "8")]
    pub max_output_tokens: Option<u32>,
    /// The LoRA adapter's [`AdapterId`] (booked).
    #[prost(fixed64, optional, tag = "9")]
    pub adapter: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, prost::Enumeration)]
#[repr(i32)]
pub enum Kind {
    Booked = 0,
    FirstToken = 1,
    Done = 2,
    Cancelled = 3,
    Moved = 4,
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// The wire form of an update (`pods`: the scorer's pod table, by id).
pub fn encode_update(update: &BookingUpdate, pods: &[Arc<Pod>]) -> Update {
    let address = |pod: PodId| pods.get(pod.index()).map(|p| p.address.clone()).unwrap_or_default();
    let leg = |leg: &Leg| *leg == Leg::Prefill;
    match update {
        BookingUpdate::Booked {
            request,
            leg: l,
            pod,
            prompt_tokens,
            cached_tokens,
            chain,
            max_output_tokens,
            adapter,
        } => Update {
            request: request.to_string(),
            prefill_leg: leg(l),
            kind: Kind::Booked as i32,
            pod: address(*pod),
            prompt_tokens: *prompt_tokens,
            cached_tokens: *cached_tokens,
            chain: chain.iter().map(|h| h.0).collect(),
            max_output_tokens: *max_output_tokens,
            adapter: adapter.map(|a| a.0),
        },
        BookingUpdate::Reported { request, leg: l, event } => Update {
            request: request.to_string(),
            prefill_leg: leg(l),
            kind: match event {
                Lifecycle::FirstToken => Kind::FirstToken,
                Lifecycle::Done => Kind::Done,
                Lifecycle::Cancelled => Kind::Cancelled,
            } as i32,
            ..Update::default()
        },
        BookingUpdate::Moved { request, leg: l, pod, cached_tokens } => Update {
            request: request.to_string(),
            prefill_leg: leg(l),
            kind: Kind::Moved as i32,
            pod: address(*pod),
            cached_tokens: *cached_tokens,
            ..Update::default()
        },
    }
}

/// Why an update from another replica cannot be applied here.
#[derive(Debug, PartialEq, Eq)]
pub enum Unusable {
    /// It names a pod this replica does not route to (not discovered yet, or gone).
    UnknownPod,
    /// An unknown kind (a newer replica's).
    UnknownKind,
}

/// An update from the wire, its pod resolved by address (`pods`: this replica's).
pub fn decode_update(update: Update, pods: &AHashMap<SocketAddr, PodId>) -> Result<BookingUpdate, Unusable> {
    let pod = || update.pod.parse::<SocketAddr>().ok().and_then(|a| pods.get(&a).copied()).ok_or(Unusable::UnknownPod);
    let leg = if update.prefill_leg { Leg::Prefill } else { Leg::Serve };
    let request: Box<str> = update.request.as_str().into();
    let reported = |event| BookingUpdate::Reported { request: request.clone(), leg, event };
    Ok(match Kind::try_from(update.kind).map_err(|_| Unusable::UnknownKind)? {
        Kind::Booked => BookingUpdate::Booked {
            pod: pod()?,
            request,
            leg,
            prompt_tokens: update.prompt_tokens,
            cached_tokens: update.cached_tokens,
            chain: update.chain.into_iter().map(SequenceHash).collect(),
            max_output_tokens: update.max_output_tokens,
            adapter: update.adapter.map(AdapterId),
        },
        Kind::FirstToken => reported(Lifecycle::FirstToken),
        Kind::Done => reported(Lifecycle::Done),
        Kind::Cancelled => reported(Lifecycle::Cancelled),
        Kind::Moved => BookingUpdate::Moved { pod: pod()?, request, leg, cached_tokens: update.cached_tokens },
    })
}

/// Splits updates into messages of at most [`MAX_MESSAGE_BYTES`] (at least one update each).
fn split(updates: Vec<Update>) -> Vec<Vec<Update>> {
    let mut out: Vec<Vec<Update>> = Vec::new();
    let mut size = 0;
    for u in updates {
        let len = u.encoded_len() + 4;
        match out.last_mut() {
            Some(last) if size + len <= MAX_MESSAGE_BYTES => last.push(u),
            _ => {
                out.push(vec![u]);
                size = 0;
            }
        }
        size += len;
    }
    out
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
    let urls: Vec<&str> = config.nats.split(',').map(str::trim).collect();
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

/// Another replica, as heard.
struct Peer {
    origin: Origin,
    last_heard: Instant,
    /// The batch number expected next.
    next_seq: u64,
    /// Its snapshot has been applied since we last lost track of it.
    synced: bool,
    /// When we last asked for its snapshot (while not synced).
    asked_at: Option<Instant>,
}

impl Peer {
    /// Whether to ask for its snapshot now: we have lost track of it and not asked lately.
    fn due(&self) -> bool {
        !self.synced && self.asked_at.is_none_or(|t| t.elapsed() >= SNAPSHOT_RETRY)
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
    let started = Instant::now();
    let heartbeat = Duration::from_millis(config.heartbeat_ms);
    let timeout = Duration::from_millis(config.replica_timeout_ms);
    let join_wait = Duration::from_millis(config.join_wait_ms);
    let mut peers: AHashMap<String, Peer> = AHashMap::new();
    let mut last_error: Option<String> = None;
    let mut next_origin = 1u32;
    let mut sweep = tokio::time::interval(heartbeat / 2);
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
                if batch.replica == me {
                    continue;
                }
                let peer = peers.entry(batch.replica.clone()).or_insert_with(|| {
                    tracing::info!(replica = %batch.replica, "sync: another replica joined");
                    let origin = Origin(next_origin);
                    next_origin += 1;
                    Peer { origin, last_heard: Instant::now(), next_seq: 0, synced: false, asked_at: None }
                });
                peer.last_heard = Instant::now();
                if peer.synced && peer.next_seq != batch.seq {
                    metrics.gaps.inc();
                    tracing::info!(replica = %batch.replica, expected = peer.next_seq, got = batch.seq, "sync: messages lost; asking for a snapshot");
                    peer.synced = false;
                    peer.asked_at = None;
                }
                if peer.due() {
                    peer.asked_at = Some(Instant::now());
                    ask(&batch.replica).await;
                }
                peer.next_seq = batch.seq + 1;
                let origin = peer.origin;
                metrics.lag_seconds.observe((unix_now() - batch.sent_at).max(0.0));
                apply(&scorer, origin, batch.updates);
                metrics.replicas.set(peers.len() as i64);
            }
            Some(message) = replies.next() => {
                metrics.messages.with_label_values(&["received"]).inc();
                let Ok(batch) = Batch::decode(message.payload) else {
                    metrics.updates.with_label_values(&["malformed"]).inc();
                    continue;
                };
                let (Some(part), Some(peer)) = (batch.snapshot.clone(), peers.get_mut(&batch.replica)) else { continue };
                if part.part == 0 {
                    scorer.clear_origin(peer.origin);
                }
                peer.last_heard = Instant::now();
                let origin = peer.origin;
                if part.last {
                    peer.synced = true;
                    peer.next_seq = batch.seq + 1;
                    metrics.snapshots.with_label_values(&["applied"]).inc();
                }
                apply(&scorer, origin, batch.updates);
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
                        // What we missed while away: every known replica's state again.
                        for (name, peer) in &mut peers {
                            peer.synced = false;
                            peer.asked_at = Some(Instant::now());
                            ask(name).await;
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
                let gone: Vec<String> = peers.iter().filter(|(_, p)| p.last_heard.elapsed() >= timeout).map(|(n, _)| n.clone()).collect();
                for name in gone {
                    let peer = peers.remove(&name).expect("listed");
                    let dropped = scorer.clear_origin(peer.origin);
                    metrics.replicas_lost.inc();
                    tracing::warn!(replica = %name, bookings = dropped, "sync: replica silent; its bookings dropped");
                }
                for (name, peer) in peers.iter_mut().filter(|(_, p)| p.due()) {
                    peer.asked_at = Some(Instant::now());
                    ask(name).await;
                }
                metrics.replicas.set(peers.len() as i64);
                let sync = scorer.sync_state();
                if !sync.joined.load(Ordering::Relaxed) {
                    // Ready once a heartbeat had time to name every replica and each one's
                    // snapshot is in — or after `join_wait_ms` whatever happened.
                    let heard_all = started.elapsed() >= heartbeat * 3 / 2 && peers.values().all(|p| p.synced);
                    if heard_all || started.elapsed() >= join_wait {
                        sync.joined.store(true, Ordering::Relaxed);
                        tracing::info!(replicas = peers.len(), "sync: joined the fleet's bookings");
                    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Role;

    #[test]
    fn updates_cross_the_wire_by_pod_address() {
        let pod = |id: u32, address: &str| {
            Arc::new(Pod {
                id: PodId(id),
                name: format!("pod-{id}"),
                address: address.into(),
                role: Role::Both,
                precise: true,
                scraped: true,
            })
        };
        // The sender knows the pods in one order, the receiver in another.
        let sender = vec![pod(0, "10.0.0.1:8000"), pod(1, "10.0.0.2:8000")];
        let receiver: AHashMap<SocketAddr, PodId> =
            [("10.0.0.2:8000".parse().unwrap(), PodId(0)), ("10.0.0.1:8000".parse().unwrap(), PodId(1))].into();
        let booked = BookingUpdate::Booked {
            request: "r1".into(),
            leg: Leg::Prefill,
            pod: PodId(1),
            prompt_tokens: 40,
            cached_tokens: 16,
            chain: vec![SequenceHash(7), SequenceHash(u64::MAX)].into(),
            max_output_tokens: Some(0),
            adapter: Some(AdapterId::of("sql")),
        };
        let moved = BookingUpdate::Moved { request: "r2".into(), leg: Leg::Serve, pod: PodId(0), cached_tokens: 3 };
        let done = BookingUpdate::Reported { request: "r1".into(), leg: Leg::Serve, event: Lifecycle::Cancelled };
        let batch = Batch {
            replica: "a".into(),
            seq: 9,
            sent_at: 1.5,
            updates: [&booked, &moved, &done].iter().map(|u| encode_update(u, &sender)).collect(),
            snapshot: None,
        };
        let back = Batch::decode(batch.encode_to_vec().as_slice()).unwrap();
        assert_eq!(back, batch);
        let decoded: Vec<BookingUpdate> =
            back.updates.into_iter().map(|u| decode_update(u, &receiver).unwrap()).collect();
        let on = |pod| match &decoded[0] {
            BookingUpdate::Booked { pod: p, .. } => *p == pod,
            _ => false,
        };
        assert!(on(PodId(0)), "10.0.0.2 is the receiver's pod 0");
        assert!(matches!(&decoded[0], BookingUpdate::Booked { adapter: Some(a), .. } if *a == AdapterId::of("sql")));
        assert_eq!(
            decoded[1],
            BookingUpdate::Moved { request: "r2".into(), leg: Leg::Serve, pod: PodId(1), cached_tokens: 3 }
        );
        assert_eq!(decoded[2], done);

        let elsewhere = Update { pod: "10.9.9.9:1".into(), ..encode_update(&booked, &sender) };
        assert_eq!(decode_update(elsewhere, &receiver), Err(Unusable::UnknownPod));
        assert_eq!(decode_update(Update { kind: 99, ..Update::default() }, &receiver), Err(Unusable::UnknownKind));
    }

    #[test]
    fn large_updates_are_split_under_the_message_limit() {
        let big = Update { chain: vec![1; 10_000], ..Update::default() }; // ≈ 80 kB each
        let parts = split(vec![big; 7]);
        assert!(parts.len() >= 3, "{}", parts.len());
        assert_eq!(parts.iter().map(Vec::len).sum::<usize>(), 7);
        for p in &parts {
            assert!(p.iter().map(|u| u.encoded_len()).sum::<usize>() <= MAX_MESSAGE_BYTES);
        }
        assert!(split(Vec::new()).is_empty());
    }
}
