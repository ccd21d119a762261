//! The native module's link to the scorer: a route socket per Envoy worker (the route stream's
//! messages, framed on a plain connection: see [`kvgate_route_api::ROUTE_SOCKET_PREFACE`]) to
//! the scorer, and a thread of the module's own (a single-threaded tokio runtime) that opens
//! them, reads the answers and hands each to its call's [`Slot`], waking the request on its
//! worker with the request's Envoy scheduler.
//!
//! Envoy's workers write their calls on the socket themselves (non-blocking: a call the
//! socket cannot take at once waits in `pending`, which the link's thread writes as the
//! socket drains), so a call costs no wake-up of another thread; lifecycle reports wait in a
//! queue and ride on the next call or the next flush — or go at once while the scorer says
//! requests wait for admission (the room they free is owed now). A call unanswered within the
//! timeout fails; a socket that answered nothing since such a call went out is replaced
//! ([`CallsInFlight`]: the wasm filter's rule for its route stream).

use kvgate_route_api::lifecycle::{CallsInFlight, ReportQueue};
use kvgate_route_api::{Frames, LifecycleReport, ROUTE_SOCKET_PREFACE, RouteAnswer, RouteCall, frame};
use socket2::{SockRef, Socket as WorkerSocket};
use std::io::{ErrorKind, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::{Notify, watch};

/// What a request's call came back with: the scorer's answer, or why there is none.
pub enum Outcome {
    Answer(RouteAnswer),
    Unavailable(String),
}

/// How a request waiting on its call is woken on its own worker (Envoy's scheduler of the
/// filter, in the module).
pub trait Wake: Send + 'static {
    fn wake(&self);
}

/// Where a call's outcome waits for its request, and how to wake it.
pub struct Slot<W: Wake> {
    inner: Mutex<SlotState<W>>,
}

struct SlotState<W> {
    outcome: Option<Outcome>,
    /// `None` once the request is gone (nothing to wake).
    waker: Option<W>,
}

impl<W: Wake> Slot<W> {
    pub fn new(waker: W) -> Arc<Slot<W>> {
        Arc::new(Slot { inner: Mutex::new(SlotState { outcome: None, waker: Some(waker) }) })
    }

    /// Stores the outcome and wakes the request (if it is still there).
    fn deliver(&self, outcome: Outcome) {
        let mut state = lock(&self.inner);
        state.outcome = Some(outcome);
        if let Some(waker) = &state.waker {
            waker.wake();
        }
    }

    /// The outcome, once delivered (on the request's worker, woken by it).
    pub fn take(&self) -> Option<Outcome> {
        lock(&self.inner).outcome.take()
    }

    /// The request is gone: nobody is woken any more. Returns the waker so that it is
    /// dropped on the worker that made it.
    pub fn close(&self) -> Option<W> {
        lock(&self.inner).waker.take()
    }
}

/// How important a line of the link's log is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Info,
    Warn,
}

/// Bytes read from the socket at a time.
const READ_BYTES: usize = 16 << 10;

/// The route socket's send buffer (the kernel caps it at `net.core.wmem_max`).
const SEND_BUFFER_BYTES: usize = 4 << 20;

/// Calls the socket has not taken yet beyond which new calls fail at once.
const MAX_PENDING_BYTES: usize = 64 << 20;

/// How the link reaches and waits for the scorer.
#[derive(Clone)]
pub struct LinkConfig {
    /// `ip:port` (or `host:port`) of the scorer's API.
    pub scorer: String,
    pub timeout: Duration,
    pub flush: Duration,
    pub batch_max: usize,
    /// Where the link's log lines go (Envoy's log, in the module).
    pub log: fn(Level, &str),
}

/// The workers' end of the link: a route socket per Envoy worker (as the wasm filter keeps a
/// route stream per worker), so that no worker waits for another's write and the scorer
/// serves each worker's calls on one of its threads.
pub struct Link<W: Wake> {
    sockets: Arc<[Arc<Shared<W>>]>,
    /// Dropped with the link (Envoy replaced or removed the filter's configuration): the
    /// link's thread then closes the sockets and ends.
    _running: watch::Sender<()>,
}

/// One route socket: what its worker and the link's thread share.
struct Shared<W: Wake> {
    config: LinkConfig,
    /// Calls sent and not answered yet, by call id.
    waiting: Mutex<CallsInFlight<u64, Arc<Slot<W>>, Instant>>,
    writer: Mutex<Writer>,
    reports: Mutex<ReportQueue>,
    /// Wakes the link's thread: `pending` has bytes to write, or reports are due.
    wake: Notify,
}

/// The sending side of the socket.
#[derive(Default)]
struct Writer {
    /// The workers' handle on the socket; `None` while it is down (calls then fail at once).
    socket: Option<WorkerSocket>,
    /// Bytes the socket has not taken yet, in order; written before anything else.
    pending: Vec<u8>,
    /// A call's frame, reused.
    scratch: Vec<u8>,
}

impl<W: Wake> Link<W> {
    /// Starts the link's thread, which opens a socket for each of `workers`.
    pub fn start(config: LinkConfig, workers: usize) -> std::io::Result<Link<W>> {
        let sockets: Arc<[Arc<Shared<W>>]> = (0..workers.max(1))
            .map(|_| {
                Arc::new(Shared {
                    config: config.clone(),
                    waiting: Mutex::new(CallsInFlight::default()),
                    writer: Mutex::new(Writer::default()),
                    reports: Mutex::new(ReportQueue::new(config.batch_max)),
                    wake: Notify::new(),
                })
            })
            .collect();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let link = sockets.clone();
        let (running, stopped) = watch::channel(());
        std::thread::Builder::new().name("kvgate-link".into()).spawn(move || {
            runtime.block_on(async move {
                let tasks: Vec<_> =
                    link.iter().map(|socket| tokio::spawn(run(socket.clone(), stopped.clone()))).collect();
                for task in tasks {
                    let _ = task.await;
                }
            })
        })?;
        Ok(Link { sockets, _running: running })
    }

    /// The socket of Envoy worker `worker`.
    fn socket(&self, worker: usize) -> &Shared<W> {
        &self.sockets[worker % self.sockets.len()]
    }

    /// Sends a route call from worker `worker`; its outcome comes to `slot`.
    pub fn call(&self, worker: usize, mut call: RouteCall, slot: Arc<Slot<W>>) {
        let shared = self.socket(worker);
        let mut writer = lock(&shared.writer);
        if writer.socket.is_none() {
            drop(writer);
            return slot.deliver(Outcome::Unavailable("the route socket to the scorer is down".into()));
        }
        if writer.pending.len() >= MAX_PENDING_BYTES {
            // The scorer has stopped reading (frozen, or far behind): waiting for it would
            // only pile up bodies in Envoy's memory.
            drop(writer);
            return slot.deliver(Outcome::Unavailable("the scorer is not reading its route socket".into()));
        }
        call.reports = lock(&shared.reports).take_for_call(SystemTime::now);
        let sent = Instant::now();
        lock(&shared.waiting).sent(call.call, slot, sent);
        let Writer { socket, pending, scratch } = &mut *writer;
        scratch.clear();
        frame(&call, scratch);
        if !pending.is_empty() {
            // Behind others: the link's thread writes it after them.
            pending.extend_from_slice(scratch);
            return;
        }
        let written = match socket.as_ref().map(|mut s| s.write(scratch)) {
            Some(Ok(n)) => n,
            Some(Err(e)) if e.kind() == ErrorKind::WouldBlock => 0,
            // Broken: the link's thread sees it on its side too, reopens, and fails the calls.
            _ => scratch.len(),
        };
        if written < scratch.len() {
            pending.extend_from_slice(&scratch[written..]);
            shared.wake.notify_one();
        }
    }

    /// Queues a lifecycle report: it goes with the next call, at the next flush, or at once
    /// when `batch_max` are waiting or the scorer has requests waiting for room.
    pub fn report(&self, worker: usize, report: LifecycleReport) {
        let shared = self.socket(worker);
        let due = lock(&shared.reports).push(report, SystemTime::now());
        if due {
            shared.wake.notify_one();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// The link's thread: opens the socket (again after any failure), reads answers, writes what
/// workers could not, flushes reports and fails calls unanswered in time.
async fn run<W: Wake>(shared: Arc<Shared<W>>, mut stopped: watch::Receiver<()>) {
    let config = &shared.config;
    let mut tick = tokio::time::interval(config.flush.min(config.timeout / 4).max(Duration::from_millis(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_flush = Instant::now();
    // Since when the socket could not be opened, and when that was last said.
    let mut down: Option<(Instant, Instant)> = None;
    loop {
        let socket = match open(&shared).await {
            Ok(socket) => {
                if let Some((since, _)) = down.take() {
                    (config.log)(
                        Level::Info,
                        &format!(
                            "kvgate: route socket to {} open again after {:.1} s",
                            config.scorer,
                            since.elapsed().as_secs_f64()
                        ),
                    );
                }
                socket
            }
            Err(why) => {
                // Said once, then every 30 s while it lasts (calls fail meanwhile, each logged).
                let now = Instant::now();
                match &mut down {
                    None => down = Some((now, now)),
                    Some((_, said)) if now.duration_since(*said) >= Duration::from_secs(30) => *said = now,
                    Some(_) => {
                        if pause(&mut stopped, Duration::from_millis(200)).await.is_err() {
                            return;
                        }
                        continue;
                    }
                }
                (config.log)(
                    Level::Warn,
                    &format!("kvgate: cannot open the route socket to {}: {why}; retrying every 200 ms", config.scorer),
                );
                if pause(&mut stopped, Duration::from_millis(200)).await.is_err() {
                    return;
                }
                continue;
            }
        };
        let mut frames = Frames::default();
        let opened = Instant::now();
        let mut stuck = false;
        let why = loop {
            tokio::select! {
                _ = stopped.changed() => return fail_waiting(&shared, "the filter's configuration was removed"),
                ready = socket.readable() => {
                    if let Err(e) = ready {
                        break format!("route socket failed: {e}");
                    }
                    match read_answers(&socket, &mut frames, &shared) {
                        Ok(true) => {}
                        Ok(false) => break "the scorer closed the route socket".to_string(),
                        Err(e) => break e,
                    }
                }
                () = shared.wake.notified() => {
                    if lock(&shared.reports).due() {
                        queue_reports(&shared);
                    }
                    if let Err(e) = write_pending(&socket, &shared).await {
                        break e;
                    }
                }
                _ = tick.tick() => {
                    if expire(&shared) {
                        stuck = true;
                        break format!("the route socket answered nothing for {} ms", config.timeout.as_millis());
                    }
                    let now = Instant::now();
                    if now.duration_since(last_flush) >= config.flush {
                        last_flush = now;
                        queue_reports(&shared);
                        if let Err(e) = write_pending(&socket, &shared).await {
                            break e;
                        }
                    }
                }
            }
        };
        (config.log)(Level::Warn, &format!("kvgate: {why}; reopening"));
        fail_waiting(&shared, &why);
        // Something that accepts and then breaks every connection is not hammered (a stuck
        // socket has had a whole timeout already; its replacement is due at once).
        if !stuck
            && opened.elapsed() < Duration::from_secs(1)
            && pause(&mut stopped, Duration::from_millis(200)).await.is_err()
        {
            return;
        }
    }
}

/// The socket is down: calls fail at once until it is open again, and those waiting fail now.
fn fail_waiting<W: Wake>(shared: &Shared<W>, why: &str) {
    {
        let mut writer = lock(&shared.writer);
        writer.socket = None;
        writer.pending.clear();
    }
    let failed = lock(&shared.waiting).reset();
    for (_, slot) in failed {
        slot.deliver(Outcome::Unavailable(why.to_string()));
    }
}

/// Waits `duration`; `Err` if the link was dropped meanwhile.
async fn pause(stopped: &mut watch::Receiver<()>, duration: Duration) -> Result<(), ()> {
    tokio::select! {
        () = tokio::time::sleep(duration) => Ok(()),
        changed = stopped.changed() => changed.map_err(|_| ()),
    }
}

/// Reads what the socket has and hands every whole answer to its call; `false` when the
/// scorer closed the socket.
fn read_answers<W: Wake>(socket: &Socket, frames: &mut Frames, shared: &Shared<W>) -> Result<bool, String> {
    loop {
        match socket.try_read_buf(frames.spare(READ_BYTES)) {
            Ok(0) => return Ok(false),
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) => return Err(format!("route socket failed: {e}")),
        }
    }
    // One clock read for the answers of this read, outside the lock.
    let now = Instant::now();
    while let Some(answer) = frames.message::<RouteAnswer>()? {
        lock(&shared.reports).heard(&answer);
        // Not waiting: timed out already (a notice answers no call).
        let call = lock(&shared.waiting).answered(&answer.call, now);
        if let Some((slot, _)) = call {
            slot.deliver(Outcome::Answer(answer));
        }
    }
    Ok(true)
}

/// Writes `pending` as the socket takes it.
async fn write_pending<W: Wake>(socket: &Socket, shared: &Shared<W>) -> Result<(), String> {
    loop {
        {
            let mut writer = lock(&shared.writer);
            if writer.pending.is_empty() {
                return Ok(());
            }
            match socket.try_write(&writer.pending) {
                Ok(n) => {
                    writer.pending.drain(..n);
                    continue;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Err(format!("cannot send on the route socket: {e}")),
            }
        }
        socket.writable().await.map_err(|e| format!("route socket failed: {e}"))?;
    }
}

/// Queues the waiting reports as one message (none while the socket is down: they wait).
fn queue_reports<W: Wake>(shared: &Shared<W>) {
    let mut writer = lock(&shared.writer);
    if writer.socket.is_none() {
        return;
    }
    let reports = lock(&shared.reports).take_for_call(SystemTime::now);
    if !reports.is_empty() {
        frame(&RouteCall { reports, ..Default::default() }, &mut writer.pending);
    }
}

/// Calls unanswered past the timeout fail; true if the socket answered nothing since one of
/// them was sent (stuck: it is replaced, as the wasm filter replaces its route stream).
fn expire<W: Wake>(shared: &Shared<W>) -> bool {
    let Some(sent_by) = Instant::now().checked_sub(shared.config.timeout) else { return false };
    let expired = lock(&shared.waiting).expire(sent_by);
    let why = format!("no answer within {} ms", shared.config.timeout.as_millis());
    for (_, slot) in expired.calls {
        slot.deliver(Outcome::Unavailable(why.clone()));
    }
    expired.stuck
}

/// Opens a route socket to the scorer (`scorer` is `ip:port`, `host:port` or `unix:<path>`)
/// and gives the workers their handle on it.
async fn open<W: Wake>(shared: &Shared<W>) -> Result<Socket, String> {
    let address = &shared.config.scorer;
    let connect = async {
        match address.strip_prefix("unix:") {
            Some(path) => UnixStream::connect(path).await.map(Socket::Unix),
            None => {
                let socket = TcpStream::connect(address).await?;
                socket.set_nodelay(true)?;
                Ok(Socket::Tcp(socket))
            }
        }
    };
    let socket = match tokio::time::timeout(Duration::from_secs(1), connect).await {
        Ok(Ok(socket)) => socket,
        Ok(Err(e)) => return Err(e.to_string()),
        Err(_) => return Err("connecting timed out".into()),
    };
    // Room for a few long prompts' calls: a worker's write then takes a whole call at once
    // instead of leaving most of it to this thread (a Unix socket's default is ≈ 200 kB).
    if let Err(e) = socket.sock().set_send_buffer_size(SEND_BUFFER_BYTES) {
        (shared.config.log)(Level::Warn, &format!("kvgate: the route socket's send buffer stays at its default: {e}"));
    }
    let mut preface = ROUTE_SOCKET_PREFACE;
    while !preface.is_empty() {
        socket.writable().await.map_err(|e| e.to_string())?;
        match socket.try_write(preface) {
            Ok(n) => preface = &preface[n..],
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    // The same connection, for the workers' non-blocking writes.
    let workers = socket.sock().try_clone().map_err(|e| e.to_string())?;
    let mut writer = lock(&shared.writer);
    writer.socket = Some(workers);
    writer.pending.clear();
    Ok(socket)
}

/// The link thread's side of a route socket.
enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Socket {
    async fn readable(&self) -> std::io::Result<()> {
        match self {
            Socket::Tcp(s) => s.readable().await,
            Socket::Unix(s) => s.readable().await,
        }
    }

    fn try_read_buf(&self, buf: &mut Vec<u8>) -> std::io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.try_read_buf(buf),
            Socket::Unix(s) => s.try_read_buf(buf),
        }
    }

    async fn writable(&self) -> std::io::Result<()> {
        match self {
            Socket::Tcp(s) => s.writable().await,
            Socket::Unix(s) => s.writable().await,
        }
    }

    fn try_write(&self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Socket::Tcp(s) => s.try_write(buf),
            Socket::Unix(s) => s.try_write(buf),
        }
    }

    /// Its socket options, and another handle on it for the workers (the same file: non-blocking).
    fn sock(&self) -> SockRef<'_> {
        match self {
            Socket::Tcp(s) => SockRef::from(s),
            Socket::Unix(s) => SockRef::from(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_route_api::{LifecycleEvent, ROUTE_SOCKET_PREFACE};
    use std::sync::atomic::{AtomicBool, AtomicUsize};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Counts the times its request was woken.
    #[derive(Clone, Default)]
    struct Woken(Arc<AtomicUsize>);

    impl Wake for Woken {
        fn wake(&self) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn quiet(_: Level, _: &str) {}

    /// How the scorer of the test's treats the calls it reads.
    #[derive(Clone, Copy)]
    enum Mode {
        Answer,
        /// Closes the connection after the first call it reads.
        HangUp,
        /// Never answers this call.
        Ignore(u64),
    }

    /// A scorer of the test's on a Unix socket: it treats the calls on the connections it
    /// accepts as its [`Mode`] says, except those accepted while `stuck` (read, never
    /// answered, never closed).
    struct FakeScorer {
        path: std::path::PathBuf,
        accepted: Arc<AtomicUsize>,
        stuck: Arc<AtomicBool>,
        calls: Arc<Mutex<Vec<RouteCall>>>,
    }

    impl Drop for FakeScorer {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    impl FakeScorer {
        fn start(name: &str, mode: Mode) -> FakeScorer {
            let path = std::env::temp_dir().join(format!("kvgate-link-{}-{name}.sock", std::process::id()));
            let _ = std::fs::remove_file(&path);
            let listener = tokio::net::UnixListener::bind(&path).expect("bind the fake scorer");
            let scorer = FakeScorer { path, accepted: Arc::default(), stuck: Arc::default(), calls: Arc::default() };
            let (accepted, stuck, calls) = (scorer.accepted.clone(), scorer.stuck.clone(), scorer.calls.clone());
            tokio::spawn(async move {
                while let Ok((socket, _)) = listener.accept().await {
                    accepted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let stuck = stuck.load(std::sync::atomic::Ordering::Relaxed);
                    tokio::spawn(serve(socket, stuck, mode, calls.clone()));
                }
            });
            scorer
        }

        /// Calls time out after 200 ms.
        fn config(&self) -> LinkConfig {
            LinkConfig { timeout: Duration::from_millis(200), ..self.patient() }
        }

        /// Calls time out after 3 s: what fails sooner did not wait for the timeout.
        fn patient(&self) -> LinkConfig {
            patient(&self.path)
        }

        fn accepted(&self) -> usize {
            self.accepted.load(std::sync::atomic::Ordering::Relaxed)
        }
    }

    /// A link to the Unix socket at `path` whose calls time out after 3 s.
    fn patient(path: &std::path::Path) -> LinkConfig {
        LinkConfig {
            scorer: format!("unix:{}", path.display()),
            timeout: Duration::from_secs(3),
            flush: Duration::from_millis(20),
            batch_max: 64,
            log: quiet,
        }
    }

    async fn serve(mut socket: tokio::net::UnixStream, stuck: bool, mode: Mode, calls: Arc<Mutex<Vec<RouteCall>>>) {
        let mut preface = vec![0; ROUTE_SOCKET_PREFACE.len()];
        if socket.read_exact(&mut preface).await.is_err() || preface != ROUTE_SOCKET_PREFACE {
            return;
        }
        let mut frames = Frames::default();
        loop {
            match socket.read_buf(frames.spare(READ_BYTES)).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            while let Ok(Some(call)) = frames.message::<RouteCall>() {
                let id = call.call;
                lock(&calls).push(call);
                match mode {
                    Mode::HangUp => return,
                    Mode::Ignore(ignored) if ignored == id => continue,
                    _ => {}
                }
                if stuck || id == 0 {
                    continue; // a batch of reports alone is not answered
                }
                let mut answer = Vec::new();
                frame(&RouteAnswer { call: id, ..Default::default() }, &mut answer);
                if socket.write_all(&answer).await.is_err() {
                    return;
                }
            }
        }
    }

    /// Waits (bounded) until `ready` holds.
    async fn until(what: &str, ready: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !ready() {
            assert!(Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Sends call `id` on worker 0 and waits for its outcome; with how long it took.
    async fn ask(link: &Link<Woken>, id: u64) -> (Outcome, Duration, usize) {
        let woken = Woken::default();
        let slot = Slot::new(woken.clone());
        let sent = Instant::now();
        link.call(0, RouteCall { call: id, ..Default::default() }, slot.clone());
        let deadline = sent + Duration::from_secs(5);
        let outcome = loop {
            if let Some(outcome) = slot.take() {
                break outcome;
            }
            assert!(Instant::now() < deadline, "call {id} never came back");
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        (outcome, sent.elapsed(), woken.0.load(std::sync::atomic::Ordering::Relaxed))
    }

    #[tokio::test]
    async fn a_call_is_answered_and_its_request_woken_once() {
        let scorer = FakeScorer::start("answered", Mode::Answer);
        let link = Link::start(scorer.config(), 1).unwrap();
        until("the route socket open", || scorer.accepted() == 1).await;
        let (outcome, _, woken) = ask(&link, 7).await;
        assert!(matches!(outcome, Outcome::Answer(RouteAnswer { call: 7, .. })));
        assert_eq!(woken, 1);
    }

    #[tokio::test]
    async fn a_socket_that_answers_nothing_fails_its_call_in_time_and_is_replaced() {
        let scorer = FakeScorer::start("stuck", Mode::Answer);
        scorer.stuck.store(true, std::sync::atomic::Ordering::Relaxed);
        let link = Link::start(scorer.config(), 1).unwrap();
        until("the route socket open", || scorer.accepted() == 1).await;
        scorer.stuck.store(false, std::sync::atomic::Ordering::Relaxed);
        let (outcome, took, woken) = ask(&link, 1).await;
        let Outcome::Unavailable(why) = outcome else { panic!("a stuck socket answered") };
        assert!(why.contains("no answer within 200 ms"), "{why}");
        assert!(took >= Duration::from_millis(200) && took < Duration::from_secs(2), "{took:?}");
        assert_eq!(woken, 1);
        // Replaced: the next call goes on a new connection, which answers.
        until("another route socket", || scorer.accepted() == 2).await;
        let (outcome, _, _) = ask(&link, 2).await;
        assert!(matches!(outcome, Outcome::Answer(RouteAnswer { call: 2, .. })));
    }

    #[tokio::test]
    async fn a_call_left_unanswered_fails_and_a_socket_answering_others_is_kept() {
        // The scorer never answers call 1, and answers call 2 sent after it: call 1 times
        // out, and the socket, which answered since call 1 went out, is kept.
        let scorer = FakeScorer::start("kept", Mode::Ignore(1));
        let link = Link::start(scorer.config(), 1).unwrap();
        until("the route socket open", || scorer.accepted() == 1).await;
        let first = Slot::new(Woken::default());
        link.call(0, RouteCall { call: 1, ..Default::default() }, first.clone());
        tokio::time::sleep(Duration::from_millis(20)).await;
        let (second, _, _) = ask(&link, 2).await;
        assert!(matches!(second, Outcome::Answer(RouteAnswer { call: 2, .. })));
        until("call 1 failed", || matches!(first.take(), Some(Outcome::Unavailable(_)))).await;
        let (third, _, _) = ask(&link, 3).await;
        assert!(matches!(third, Outcome::Answer(RouteAnswer { call: 3, .. })));
        assert_eq!(scorer.accepted(), 1, "the socket was kept");
    }

    #[tokio::test]
    async fn a_scorer_away_fails_calls_at_once() {
        let path = std::env::temp_dir().join(format!("kvgate-link-{}-nobody.sock", std::process::id()));
        let link = Link::start(patient(&path), 1).unwrap();
        let (outcome, took, _) = ask(&link, 1).await;
        let Outcome::Unavailable(why) = outcome else { panic!("answered by nobody") };
        assert!(why.contains("down"), "{why}");
        assert!(took < Duration::from_secs(3), "at once, not after the timeout: {took:?}");
    }

    #[tokio::test]
    async fn a_scorer_closing_the_socket_fails_the_waiting_call_and_is_dialled_again() {
        let scorer = FakeScorer::start("hangs-up", Mode::HangUp);
        let link = Link::start(scorer.patient(), 1).unwrap();
        until("the route socket open", || scorer.accepted() == 1).await;
        let (outcome, took, _) = ask(&link, 1).await;
        let Outcome::Unavailable(why) = outcome else { panic!("answered") };
        assert!(why.contains("closed"), "{why}");
        assert!(took < Duration::from_secs(3), "at once, not after the timeout: {took:?}");
        until("dialled again", || scorer.accepted() == 2).await;
    }

    #[tokio::test]
    async fn reports_ride_on_the_next_call_or_go_at_the_flush() {
        let scorer = FakeScorer::start("reports", Mode::Answer);
        let link = Link::start(scorer.config(), 1).unwrap();
        until("the route socket open", || scorer.accepted() == 1).await;
        link.report(0, LifecycleReport::new("r-1", LifecycleEvent::FirstToken));
        let (outcome, _, _) = ask(&link, 5).await;
        assert!(matches!(outcome, Outcome::Answer(_)));
        let calls = lock(&scorer.calls).clone();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].reports.len(), 1, "rode on call 5");
        // Alone: at the next flush, in a message of no call.
        link.report(0, LifecycleReport::new("r-1", LifecycleEvent::Done));
        until("the flush", || lock(&scorer.calls).len() == 2).await;
        let flushed = lock(&scorer.calls)[1].clone();
        assert_eq!((flushed.call, flushed.reports.len()), (0, 1));
    }
}
