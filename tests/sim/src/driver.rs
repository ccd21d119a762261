//! Runs the engine model in real time: one task owns the [`Engine`], takes requests from a
//! channel, sleeps each step's model duration (× `--time-scale`), then delivers the step's
//! tokens to the waiting HTTP handlers and its cache changes to the event publisher. At time
//! scale 0 nothing is slept: steps run back to back and the model clock moves by their
//! durations alone (an instant engine, for measuring what sits in front of it).

use kvgate_sim::cache::CacheChange;
use kvgate_sim::engine::{Counters, Engine, EngineError, Finished, NewRequest, RequestId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

/// What a request's handler receives per sampled token; the last carries `finished`.
#[derive(Debug)]
pub struct Emission {
    pub token: u32,
    pub finished: Option<Finished>,
}

/// Engine state for `/metrics`, refreshed after every step.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub running: usize,
    pub waiting: usize,
    /// The LoRA adapters of the running and of the waiting requests.
    pub adapters: (Vec<String>, Vec<String>),
    pub kv_cache_usage: f64,
    pub cached_blocks: usize,
    pub counters: Counters,
}

enum Command {
    Submit {
        request: NewRequest,
        emissions: mpsc::UnboundedSender<Emission>,
        accepted: oneshot::Sender<Result<RequestId, EngineError>>,
    },
    Reset(oneshot::Sender<Result<(), usize>>),
}

/// Handle to the engine task, cloned into every HTTP handler.
#[derive(Clone)]
pub struct EngineHandle {
    commands: mpsc::UnboundedSender<Command>,
    snapshot: Arc<Mutex<Snapshot>>,
}

/// The engine task is gone (shutting down).
#[derive(Debug, thiserror::Error)]
#[error("the engine has stopped")]
pub struct EngineStopped;

impl EngineHandle {
    /// Starts the engine task. `time_scale` is wall seconds per model second (0.01 runs
    /// 100× faster than the modelled GPU; 0 never waits). Cache changes go to `events`, one batch per step.
    pub fn spawn(engine: Engine, time_scale: f64, events: Option<mpsc::UnboundedSender<Vec<CacheChange>>>) -> Self {
        let (commands, rx) = mpsc::unbounded_channel();
        let snapshot = Arc::new(Mutex::new(Snapshot::default()));
        tokio::spawn(run(engine, time_scale, rx, events, snapshot.clone()));
        Self { commands, snapshot }
    }

    /// Queues a request. The receiver yields its tokens and then `Finished`; dropping it
    /// aborts the request (a client that went away frees its blocks).
    pub async fn submit(
        &self,
        request: NewRequest,
    ) -> Result<Result<mpsc::UnboundedReceiver<Emission>, EngineError>, EngineStopped> {
        let (emissions, rx) = mpsc::unbounded_channel();
        let (accepted, accepted_rx) = oneshot::channel();
        self.commands.send(Command::Submit { request, emissions, accepted }).map_err(|_| EngineStopped)?;
        Ok(accepted_rx.await.map_err(|_| EngineStopped)?.map(|_| rx))
    }

    /// `reset_prefix_cache`; `Err(n)` when `n` blocks are still held by requests.
    pub async fn reset_prefix_cache(&self) -> Result<Result<(), usize>, EngineStopped> {
        let (tx, rx) = oneshot::channel();
        self.commands.send(Command::Reset(tx)).map_err(|_| EngineStopped)?;
        rx.await.map_err(|_| EngineStopped)
    }

    pub fn snapshot(&self) -> Snapshot {
        self.snapshot.lock().expect("snapshot lock").clone()
    }
}

async fn run(
    mut engine: Engine,
    time_scale: f64,
    mut commands: mpsc::UnboundedReceiver<Command>,
    events: Option<mpsc::UnboundedSender<Vec<CacheChange>>>,
    snapshot: Arc<Mutex<Snapshot>>,
) {
    let start = Instant::now();
    let paced = time_scale > 0.0;
    let model_now = || start.elapsed().as_secs_f64() / time_scale;
    let wall_at = |model: f64| start + Duration::from_secs_f64(model * time_scale);
    let mut streams: HashMap<RequestId, mpsc::UnboundedSender<Emission>> = HashMap::new();
    let publish = |changes: Vec<CacheChange>| {
        if let (Some(tx), false) = (&events, changes.is_empty()) {
            let _ = tx.send(changes);
        }
    };

    loop {
        while let Ok(cmd) = commands.try_recv() {
            handle(&mut engine, &mut streams, cmd, &publish);
        }
        // Idle time passes in model time too; a busy engine runs ahead by its step durations.
        if paced {
            engine.advance_to(model_now());
        }
        if let Some(step) = engine.step() {
            if paced {
                tokio::time::sleep_until(wall_at(engine.now())).await;
            } else {
                tokio::task::yield_now().await; // let the HTTP handlers run between steps
            }
            // Before the outputs go: a client that reads /metrics on its answer sees its step.
            *snapshot.lock().expect("snapshot lock") = take_snapshot(&engine);
            for output in step.outputs {
                let id = output.id;
                let finished = output.finished.is_some();
                let emission = Emission { token: output.token, finished: output.finished };
                let delivered = streams.get(&id).is_some_and(|tx| tx.send(emission).is_ok());
                if finished || !delivered {
                    streams.remove(&id);
                    if !delivered && !finished {
                        engine.abort(id); // the client went away
                    }
                }
            }
            publish(step.cache_changes);
        } else {
            publish(engine.take_cache_changes());
            *snapshot.lock().expect("snapshot lock") = take_snapshot(&engine);
            let cmd = match engine.next_wakeup() {
                Some(t) if !paced => {
                    engine.advance_to(t);
                    continue;
                }
                Some(t) => tokio::select! {
                    cmd = commands.recv() => cmd,
                    _ = tokio::time::sleep_until(wall_at(t)) => continue,
                },
                None => commands.recv().await,
            };
            match cmd {
                Some(cmd) => handle(&mut engine, &mut streams, cmd, &publish),
                None => return, // every handle dropped: shutting down
            }
            continue;
        }
    }
}

fn handle(
    engine: &mut Engine,
    streams: &mut HashMap<RequestId, mpsc::UnboundedSender<Emission>>,
    cmd: Command,
    publish: &impl Fn(Vec<CacheChange>),
) {
    match cmd {
        Command::Submit { request, emissions, accepted } => {
            let result = engine.add_request(request);
            if let Ok(id) = result {
                streams.insert(id, emissions);
            }
            let _ = accepted.send(result);
        }
        Command::Reset(reply) => {
            let result = engine.reset_prefix_cache().map(publish);
            let _ = reply.send(result);
        }
    }
}

fn take_snapshot(engine: &Engine) -> Snapshot {
    Snapshot {
        running: engine.num_running(),
        waiting: engine.num_waiting(),
        adapters: engine.adapters(),
        kv_cache_usage: engine.kv_cache_usage(),
        cached_blocks: engine.cached_blocks(),
        counters: engine.counters(),
    }
}

/// Logs throughput and occupancy every `period` while the engine is busy, as vLLM's
/// periodic stats line does, so a long run shows progress.
pub async fn log_stats(handle: EngineHandle, period: Duration) {
    let mut last = handle.snapshot();
    let mut interval = tokio::time::interval(period);
    interval.tick().await;
    loop {
        interval.tick().await;
        let now = handle.snapshot();
        let (c, p) = (now.counters, last.counters);
        if c.steps == p.steps {
            continue;
        }
        let secs = period.as_secs_f64();
        let queries = c.prefix_cache_queries - p.prefix_cache_queries;
        let hits = c.prefix_cache_hits - p.prefix_cache_hits;
        tracing::info!(
            "prompt {:.1} tok/s, generation {:.1} tok/s, running {}, waiting {}, KV usage {:.1}%, prefix hit rate {:.1}%",
            (c.prompt_tokens - p.prompt_tokens) as f64 / secs,
            (c.generation_tokens - p.generation_tokens) as f64 / secs,
            now.running,
            now.waiting,
            now.kv_cache_usage * 100.0,
            if queries == 0 { 0.0 } else { hits as f64 * 100.0 / queries as f64 },
        );
        last = now;
    }
}
