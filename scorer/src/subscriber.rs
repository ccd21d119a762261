//! One task per pod with a KV-event stream: subscribe, judge each batch's sequence number,
//! replay lost batches when the pod has a replay socket, decode and apply.
//!
//! Gaps: with a replay endpoint, the missing batches are requested from a DEALER
//! (`["", start_seq]`; replies until the `ff×8` end marker, in vLLM's 3- or 4-frame form) and
//! applied in order before the batch that revealed the gap. Without one — or if the replay
//! does not return every missing batch — the pod's index is cleared and rebuilt from the
//! events that follow: kvgate would rather forget blocks a pod still holds (costing some
//! affinity) than believe in blocks it evicted (sending requests where the cache is cold).
//! A sequence restarting at 0 means the engine restarted: its index is cleared too, as when
//! the publisher disconnects and the subscription resumes (see [`run`]).
//!
//! Joining: once subscribed, a pod with a replay endpoint has its index rebuilt from the
//! replay buffer at once (the scorer is not ready at start until it has: see
//! `Scorer::readiness`); a subscription whose first batch is still past what that replay held
//! catches up from the replay buffer first ([`catch_up`]); so does the stream of an engine
//! the scorer found changed.
//!
//! No queue sits between the socket and the index: the SUB socket reads only as fast as
//! batches are applied, so a flood backs up into the publisher's bounded queue, which drops
//! the excess; the drops come back here as gaps and are counted (`event_batches_missed`).

use crate::config::ZmqEndpoint;
use crate::scorer::Scorer;
use bytes::Bytes;
use futures::StreamExt;
use kvgate_routing::events::decode_batch;
use kvgate_routing::pod_set::PodId;
use kvgate_routing::sequence::{SequenceTracker, Sequencing};
use std::sync::Arc;
use std::time::Duration;
use zeromq::{DealerSocket, Socket, SocketEvent, SocketRecv, SocketSend, SubSocket, ZmqMessage};

const END_SEQ: [u8; 8] = [0xff; 8];
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// One connection attempt to a publisher.
const CONNECT_ATTEMPT: Duration = Duration::from_millis(300);

/// Runs until the process stops, reconnecting after errors.
///
/// The socket is watched: when the publisher disconnects (its engine stopped, or the network
/// broke) the pod is taken out at once and the subscriber reconnects itself, every
/// 100 ms to 1 s, rather than leaving it to the socket's own retry. The stream it then
/// finds may be another engine's — a restart whose first batches were missed looks like a
/// continuation — so the pod's index is cleared and rebuilt from it, and its sequence
/// numbers are judged afresh.
pub async fn run(scorer: Arc<Scorer>, pod: PodId, endpoint: ZmqEndpoint, replay: Option<ZmqEndpoint>) {
    let replay = replay.as_deref();
    let name = scorer.pod(pod).name.clone();
    let mut backoff = Duration::from_millis(100);
    let mut tracker = SequenceTracker::default();
    let mut engine_changes;
    let mut resumed = false;
    // Since when nothing has listened at the endpoint (warned once past `SILENT_WARNING`).
    let mut refused_since: Option<(tokio::time::Instant, bool)> = None;
    loop {
        let mut socket = SubSocket::new();
        let mut monitor = socket.monitor();
        let connected = async {
            socket.connect(&endpoint).await?;
            socket.subscribe("").await
        };
        // The socket library retries a refused connection itself, backing off up to 30 s:
        // each attempt here is cut short so the pace stays this loop's (≤ 1 s apart).
        let connected = match tokio::time::timeout(CONNECT_ATTEMPT, connected).await {
            Ok(result) => result,
            Err(_) => Err(zeromq::ZmqError::Other("connection attempt timed out")),
        };
        if let Err(e) = connected {
            tracing::debug!(pod = %name, %endpoint, "kv events: cannot connect ({e}); retrying in {backoff:?}");
            let (since, warned) = refused_since.get_or_insert((tokio::time::Instant::now(), false));
            // Only a publisher never heard: one heard before is a stopped engine (down).
            if !resumed && !*warned && since.elapsed() >= SILENT_WARNING {
                *warned = true;
                tracing::warn!(
                    pod = %name,
                    %endpoint,
                    "kv events: nothing has listened at {endpoint} for {SILENT_WARNING:?} ({e}). vLLM's publisher binds \
                     only when its --kv-events-config endpoint is `tcp://*:PORT` (or ipc://); given \
                     `tcp://HOST:PORT` it connects out instead and no subscriber hears it. Until the pod's events \
                     are heard, nothing it caches is credited."
                );
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(1));
            continue;
        }
        refused_since = None;
        if resumed {
            tracing::info!(pod = %name, %endpoint, "kv events: subscribed again; index rebuilt from this stream");
            scorer.resync(pod);
            tracker = SequenceTracker::default();
        } else {
            tracing::info!(pod = %name, %endpoint, "kv events: subscribed");
        }
        // What the engine holds already (it ran before this scorer listened, or published
        // while no one listened: a restarted engine's first batches) is in its replay buffer:
        // rebuild from it now, not when the next batch arrives — an engine left idle may
        // publish none for long, and at start the scorer is not ready until it has.
        if let Some(replay) = replay {
            rebuild(&scorer, pod, replay, &mut tracker).await;
        }
        scorer.caught_up(pod);
        engine_changes = scorer.engine_changes(pod);
        backoff = Duration::from_millis(100);
        let mut engine_check = tokio::time::interval(ENGINE_CHECK);
        engine_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = engine_check.tick() => {
                    // A restart seen by the scrape (a new process start time) cleared the index,
                    // maybe after this stream's batches were applied: rebuild it from the
                    // replay buffer now — an idle engine may publish nothing more for long.
                    let changes = scorer.engine_changes(pod);
                    if changes != engine_changes {
                        engine_changes = changes;
                        tracker = SequenceTracker::default();
                        if let Some(replay) = replay {
                            rebuild(&scorer, pod, replay, &mut tracker).await;
                        }
                    }
                }
                message = socket.recv() => match message {
                    Ok(message) => {
                        let changes = scorer.engine_changes(pod);
                        if changes != engine_changes {
                            // The index was cleared for a new engine: this stream is judged
                            // afresh, its history caught up from the replay buffer.
                            engine_changes = changes;
                            tracker = SequenceTracker::default();
                        }
                        handle(&scorer, pod, &mut tracker, replay, message).await
                    }
                    Err(e) => {
                        tracing::warn!(pod = %name, "kv events: receive failed ({e}); reconnecting");
                        break;
                    }
                },
                event = monitor.next() => match event {
                    Some(SocketEvent::Disconnected(_)) | None => {
                        tracing::warn!(pod = %name, %endpoint, "kv events: publisher disconnected; reconnecting");
                        scorer.events_disconnected(pod);
                        break;
                    }
                    Some(_) => {}
                },
            }
        }
        resumed = true;
        tokio::time::sleep(backoff).await;
    }
}

/// A publisher nobody listens at for this long is warned of (the bind/connect trap).
const SILENT_WARNING: Duration = Duration::from_secs(10);

/// How often a subscriber looks whether its pod's engine was found changed elsewhere.
const ENGINE_CHECK: Duration = Duration::from_millis(250);

/// `[topic, seq, payload]` → (seq, payload).
fn frames(message: ZmqMessage) -> Option<(u64, Bytes)> {
    let mut frames = message.into_vec();
    if frames.len() != 3 {
        return None;
    }
    let payload = frames.pop()?;
    let seq = u64::from_be_bytes(frames.pop()?.as_ref().try_into().ok()?);
    Some((seq, payload))
}

async fn handle(scorer: &Scorer, pod: PodId, tracker: &mut SequenceTracker, replay: Option<&str>, message: ZmqMessage) {
    let Some((seq, payload)) = frames(message) else {
        scorer.event_decode_error(pod);
        return;
    };
    let joining = tracker.expected().is_none();
    match tracker.observe(seq) {
        Sequencing::InOrder if joining && seq > 0 => {
            if let Some(endpoint) = replay {
                catch_up(scorer, pod, endpoint, seq).await;
            }
        }
        Sequencing::InOrder => {}
        Sequencing::Stale => {
            scorer.event_stale(pod);
            return;
        }
        Sequencing::Restart => {
            tracing::info!(pod = %scorer.pod(pod).name, "kv events: sequence restarted at 0 (engine restart): index rebuilt");
            scorer.resync(pod);
        }
        Sequencing::Gap { missing_from, seq } => {
            scorer.event_gap(pod, seq - missing_from);
            let name = &scorer.pod(pod).name;
            let recovered = match replay {
                Some(endpoint) => match fetch_replay(endpoint, missing_from).await {
                    Ok(batches) => apply_replayed(scorer, pod, missing_from, seq, batches),
                    Err(e) => {
                        tracing::warn!(pod = %name, "kv events: replay failed: {e}");
                        false
                    }
                },
                None => false,
            };
            let outcome = match (replay.is_some(), recovered) {
                (_, true) => "recovered",
                (true, false) => "failed",
                (false, false) => "unavailable",
            };
            scorer.metrics.kv_replays.with_label_values(&[name, outcome]).inc();
            if !recovered {
                tracing::warn!(pod = %name, missing_from, seq, "kv events: batches lost; index cleared and rebuilt from here");
                scorer.resync(pod);
            }
        }
    }
    apply(scorer, pod, &payload);
}

fn apply(scorer: &Scorer, pod: PodId, payload: &[u8]) {
    match decode_batch(payload) {
        Ok(batch) => scorer.apply_events(pod, &batch),
        Err(e) => {
            tracing::debug!(pod = %scorer.pod(pod).name, "kv events: undecodable batch dropped: {e}");
            scorer.event_decode_error(pod);
        }
    }
}

/// The first batch of a subscription is `seq` > 0: the engine ran before kvgate listened
/// (the scorer restarted, or the engine published before the subscription was up). Its
/// replay buffer holds what was published before; the longest unbroken run of batches
/// ending just before `seq` is applied, so the pod's cache is known at once. A buffer that
/// no longer reaches back to the engine's start gives a part of it — blocks stored since,
/// minus those removed since: never a block the pod does not hold.
async fn catch_up(scorer: &Scorer, pod: PodId, endpoint: &str, seq: u64) {
    let name = &scorer.pod(pod).name;
    let outcome = match fetch_replay(endpoint, 0).await {
        Ok(mut batches) => {
            batches.retain(|(s, _)| *s < seq);
            let from = unbroken_run(&batches, seq);
            for (_, payload) in &batches[from..] {
                apply(scorer, pod, payload);
            }
            tracing::info!(pod = %name, batches = batches.len() - from, "kv events: joined at {seq}; caught up from the replay buffer");
            if from == 0 && batches.first().is_some_and(|(s, _)| *s == 0) { "caught_up" } else { "caught_up_partly" }
        }
        Err(e) => {
            tracing::warn!(pod = %name, "kv events: replay on joining failed: {e}");
            "failed"
        }
    };
    scorer.metrics.kv_replays.with_label_values(&[name, outcome]).inc();
}

/// Rebuilds a pod's index from its whole replay buffer once subscribed: the unbroken run of
/// batches that ends at the newest, which `tracker` then continues from (live copies of
/// batches applied here — the subscription was up before the buffer was read — arrive as
/// duplicates and are dropped, a batch 0 among them too).
async fn rebuild(scorer: &Scorer, pod: PodId, endpoint: &str, tracker: &mut SequenceTracker) {
    let name = &scorer.pod(pod).name;
    let outcome = match fetch_replay(endpoint, 0).await {
        Ok(batches) => {
            let from = batches.last().map_or(0, |(newest, _)| unbroken_run(&batches, newest + 1));
            for (seq, payload) in &batches[from..] {
                tracker.replayed(*seq);
                apply(scorer, pod, payload);
            }
            tracing::info!(pod = %name, batches = batches.len() - from, "kv events: rebuilt from the replay buffer");
            if batches.get(from).is_none_or(|(s, _)| *s == 0) { "caught_up" } else { "caught_up_partly" }
        }
        Err(e) => {
            tracing::warn!(pod = %name, "kv events: replay on resubscribing failed: {e}");
            "failed"
        }
    };
    scorer.metrics.kv_replays.with_label_values(&[name, outcome]).inc();
}

/// Where the unbroken run of `batches` (sorted, distinct) that ends at `end − 1` starts;
/// `batches.len()` when the last one is not `end − 1`.
fn unbroken_run(batches: &[(u64, Bytes)], end: u64) -> usize {
    let mut from = batches.len();
    while from > 0 && batches[from - 1].0 + (batches.len() - from) as u64 + 1 == end {
        from -= 1;
    }
    from
}

/// Applies replayed batches `missing_from..until` in order; true if none was missing.
fn apply_replayed(scorer: &Scorer, pod: PodId, missing_from: u64, until: u64, batches: Vec<(u64, Bytes)>) -> bool {
    let mut want = missing_from;
    for (seq, payload) in batches.into_iter().filter(|(s, _)| (missing_from..until).contains(s)) {
        if seq != want {
            return false;
        }
        apply(scorer, pod, &payload);
        want += 1;
    }
    want == until
}

/// vLLM's replay protocol: every buffered batch with sequence ≥ `start`, in order, each once.
async fn fetch_replay(endpoint: &str, start: u64) -> anyhow::Result<Vec<(u64, Bytes)>> {
    let mut dealer = DealerSocket::new();
    tokio::time::timeout(REPLAY_TIMEOUT, dealer.connect(endpoint)).await??;
    let request = ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&start.to_be_bytes())])
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    dealer.send(request).await?;
    let mut out = Vec::new();
    loop {
        let reply = tokio::time::timeout(REPLAY_TIMEOUT, dealer.recv()).await??.into_vec();
        // ["", seq, payload] (vLLM ≤ 0.25) or ["", topic, seq, payload] (≥ 0.26)
        let (seq, payload) = match reply.as_slice() {
            [_, seq, payload] | [_, _, seq, payload] => (seq.clone(), payload.clone()),
            other => anyhow::bail!("replay reply with {} frames", other.len()),
        };
        if seq.as_ref() == END_SEQ {
            out.sort_by_key(|(s, _)| *s);
            out.dedup_by_key(|(s, _)| *s);
            return Ok(out);
        }
        let seq: [u8; 8] = seq.as_ref().try_into().map_err(|_| anyhow::anyhow!("replay sequence is not 8 bytes"))?;
        out.push((u64::from_be_bytes(seq), payload));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_unbroken_run_before_a_sequence_number() {
        let batches: Vec<(u64, Bytes)> = [0, 1, 4, 5, 6].iter().map(|&s| (s, Bytes::new())).collect();
        assert_eq!(unbroken_run(&batches, 7), 2, "4, 5, 6");
        assert_eq!(unbroken_run(&batches[..2], 2), 0, "0, 1");
        assert_eq!(unbroken_run(&batches, 8), 5, "6 is not 7: nothing");
        assert_eq!(unbroken_run(&[], 3), 0);
    }
}
