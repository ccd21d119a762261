//! KV events over ZMQ, as vLLM's `ZmqEventPublisher` sends them.
//!
//! Every engine step with cache changes becomes one message of three frames: the topic
//! (default empty), the sequence number (u64 big-endian, from 0, +1 per batch) and the
//! msgpack batch. The last `buffer_steps` batches are kept for the replay socket: a ROUTER
//! that answers a DEALER's `["", start_seq]` with every buffered batch whose sequence is
//! `>= start_seq`, then an end marker whose sequence frame is `ff × 8`. Replies carry the
//! topic frame as in vLLM ≥ 0.26 with `--event-format map`, and omit it as in vLLM ≤ 0.25
//! with `--event-format array`.

use bytes::Bytes;
use kvgate_sim::cache::CacheChange;
use kvgate_sim::events::{EventEncoder, EventFormat};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// Where and how to publish.
pub struct PublisherConfig {
    pub endpoint: String,
    /// Connect the PUB socket (subscriber binds) instead of binding it.
    pub connect: bool,
    pub replay_endpoint: Option<String>,
    pub topic: String,
    pub buffer_steps: usize,
    pub encoder: EventEncoder,
}

/// Counters shown in `/metrics`.
#[derive(Default)]
pub struct PublisherStats {
    pub batches: AtomicU64,
    pub replay_requests: AtomicU64,
    /// Malformed messages sent on request (`POST /sim/kv_events/garbage`).
    pub garbage: AtomicU64,
}

/// The running publisher: cache changes in, and a way to put garbage on the wire.
pub struct Publisher {
    pub batches: mpsc::UnboundedSender<Vec<CacheChange>>,
    /// Sends this many malformed messages, interleaved with the real stream (a fault drill:
    /// a subscriber must count and drop them, its index unchanged).
    pub garbage: mpsc::UnboundedSender<usize>,
    pub stats: Arc<PublisherStats>,
    /// Where the PUB socket is bound (its port resolved; `None` when it connects).
    pub bound: Option<String>,
    /// Where the replay socket is bound.
    pub replay_bound: Option<String>,
}

const END_SEQ: [u8; 8] = [0xff; 8];

/// Binds (or connects) the sockets, then publishes every batch received on the returned
/// channel until it closes. Binding errors are returned at once so a wrong endpoint stops
/// the simulator at start-up.
pub async fn start(config: PublisherConfig) -> anyhow::Result<Publisher> {
    let mut publisher = PubSocket::new();
    let mut bound = None;
    if !config.connect {
        let endpoint = publisher
            .bind(&config.endpoint)
            .await
            .map_err(|e| anyhow::anyhow!("kv events: cannot bind PUB socket on {}: {e}", config.endpoint))?;
        bound = Some(endpoint.to_string());
    }
    let (replay, replay_bound) = match &config.replay_endpoint {
        Some(endpoint) => {
            let mut router = RouterSocket::new();
            let bound = router
                .bind(endpoint)
                .await
                .map_err(|e| anyhow::anyhow!("kv events: cannot bind replay on {endpoint}: {e}"))?;
            (Some(router), Some(bound.to_string()))
        }
        None => (None, None),
    };
    let (batches, rx) = mpsc::unbounded_channel();
    let (garbage, garbage_rx) = mpsc::unbounded_channel();
    let stats = Arc::new(PublisherStats::default());
    tokio::spawn(run(config, publisher, replay, rx, garbage_rx, stats.clone()));
    Ok(Publisher { batches, garbage, stats, bound, replay_bound })
}

async fn run(
    config: PublisherConfig,
    mut publisher: PubSocket,
    mut replay: Option<RouterSocket>,
    mut batches: mpsc::UnboundedReceiver<Vec<CacheChange>>,
    mut garbage: mpsc::UnboundedReceiver<usize>,
    stats: Arc<PublisherStats>,
) {
    if config.connect {
        // vLLM connects its PUB socket for non-wildcard tcp endpoints; the subscriber may
        // come up later, so keep trying. Batches wait in the channel meanwhile, as libzmq
        // queues them until the connection is up.
        let mut attempt = 0u32;
        while let Err(e) = publisher.connect(&config.endpoint).await {
            if attempt.is_multiple_of(50) {
                tracing::warn!(endpoint = %config.endpoint, "kv events: connect failed ({e}); retrying");
            }
            attempt += 1;
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
    let topic = Bytes::from(config.topic.clone().into_bytes());
    let mut buffer: VecDeque<(u64, Bytes)> = VecDeque::with_capacity(config.buffer_steps.min(1 << 16));
    let mut seq: u64 = 0;
    loop {
        tokio::select! {
            batch = batches.recv() => {
                let Some(changes) = batch else { return };
                let ts = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs_f64())
                    .unwrap_or_default();
                let payload = Bytes::from(config.encoder.encode_batch(ts, &changes));
                let message = frames(vec![topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()]);
                if let Err(e) = publisher.send(message).await {
                    tracing::warn!("kv events: publish failed: {e}");
                }
                keep_for_replay(&mut buffer, config.buffer_steps, seq, payload);
                seq += 1;
                stats.batches.fetch_add(1, Ordering::Relaxed);
            }
            Some(count) = garbage.recv() => {
                for i in 0..count {
                    let (message, payload) = garbage_message(i, &topic, seq);
                    if let Err(e) = publisher.send(message).await {
                        tracing::warn!("kv events: publish failed: {e}");
                    }
                    if let Some(payload) = payload {
                        // It took a sequence number: replay serves it as it was sent.
                        keep_for_replay(&mut buffer, config.buffer_steps, seq, payload);
                        seq += 1;
                    }
                    stats.garbage.fetch_add(1, Ordering::Relaxed);
                    tokio::task::yield_now().await; // a drill, not a flood
                }
            }
            request = recv_replay(&mut replay) => {
                let router = replay.as_mut().expect("replay socket present when it yields");
                match request {
                    Ok(request) => {
                        stats.replay_requests.fetch_add(1, Ordering::Relaxed);
                        serve_replay(router, request, &buffer, &topic, config.encoder.format).await;
                    }
                    Err(e) => tracing::warn!("kv events: replay receive failed: {e}"),
                }
            }
        }
    }
}

/// Keeps batch `seq` for the replay socket: the last `buffer_steps` batches.
fn keep_for_replay(buffer: &mut VecDeque<(u64, Bytes)>, buffer_steps: usize, seq: u64, payload: Bytes) {
    if buffer_steps > 0 {
        if buffer.len() == buffer_steps {
            buffer.pop_front();
        }
        buffer.push_back((seq, payload));
    }
}

async fn recv_replay(replay: &mut Option<RouterSocket>) -> zeromq::ZmqResult<ZmqMessage> {
    match replay {
        Some(router) => router.recv().await,
        None => std::future::pending().await,
    }
}

async fn serve_replay(
    router: &mut RouterSocket,
    request: ZmqMessage,
    buffer: &VecDeque<(u64, Bytes)>,
    topic: &Bytes,
    format: EventFormat,
) {
    // [identity, "", start_seq (8 bytes BE)] — anything else is ignored, as vLLM does.
    let frames_in = request.into_vec();
    let [identity, delimiter, start] = frames_in.as_slice() else {
        tracing::warn!("kv events: invalid replay request with {} frames", frames_in.len());
        return;
    };
    let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
        tracing::warn!("kv events: replay start sequence is not 8 bytes");
        return;
    };
    let start = u64::from_be_bytes(start);
    let with_topic = format == EventFormat::Map;
    for (seq, payload) in buffer.iter().filter(|(s, _)| *s >= start) {
        let mut reply = vec![identity.clone(), delimiter.clone()];
        if with_topic {
            reply.push(topic.clone());
        }
        reply.push(Bytes::copy_from_slice(&seq.to_be_bytes()));
        reply.push(payload.clone());
        if let Err(e) = router.send(frames(reply)).await {
            tracing::warn!("kv events: replay send failed: {e}");
            return;
        }
    }
    let mut end = vec![identity.clone(), delimiter.clone()];
    if with_topic {
        end.push(Bytes::new());
    }
    end.push(Bytes::from_static(&END_SEQ));
    end.push(Bytes::new());
    if let Err(e) = router.send(frames(end)).await {
        tracing::warn!("kv events: replay end marker failed: {e}");
    }
}

/// The `i`-th of a round of malformed messages: wrong frame counts, a sequence frame that is
/// not 8 bytes, and payloads that are not event batches (random bytes, msgpack of another
/// shape) under the next sequence number — which they take, returning the payload — so a
/// subscriber must decode them to find out. None of it may change what it believes the pod
/// caches: these messages carry no events.
fn garbage_message(i: usize, topic: &Bytes, seq: u64) -> (ZmqMessage, Option<Bytes>) {
    let seq = Bytes::copy_from_slice(&seq.to_be_bytes());
    let noise: Bytes = (0..64u8).map(|b| b.wrapping_mul(37).wrapping_add(i as u8)).collect::<Vec<_>>().into();
    // msgpack {"hello": [1, 2]}: well-formed, not a batch.
    let other_shape = Bytes::from_static(b"\x81\xa5hello\x92\x01\x02");
    match i % 4 {
        0 => (frames(vec![noise]), None),
        1 => (frames(vec![topic.clone(), Bytes::from_static(b"seq"), noise]), None),
        2 => (frames(vec![topic.clone(), seq, noise.clone()]), Some(noise)),
        _ => (frames(vec![topic.clone(), seq, other_shape.clone()]), Some(other_shape)),
    }
}

fn frames(frames: Vec<Bytes>) -> ZmqMessage {
    ZmqMessage::try_from(frames).expect("at least one frame")
}
