//! The route socket (what the filter's native module speaks) against the real scorer: on the
//! API port beside HTTP and on the Unix socket path, calls answered by id, reports applied and
//! not answered, notices of the admission queue, a caller that breaks the framing cut off
//! without harm to anyone else, and a caller of another protocol version refused.

use kvgate_route_api::{
    Frames, LifecycleEvent, LifecycleReport, Outcome, ROUTE_SOCKET_PREFACE, Refused, RouteAnswer, RouteCall, RoutePick,
    StreamReport, frame,
};
use kvgate_test_harness::{ScorerProcess, free_port};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// A scorer with two pods nobody scrapes (always eligible), and a Unix route socket.
async fn scorer() -> (ScorerProcess, std::path::PathBuf) {
    let path = std::env::temp_dir().join(format!("kvgate-route-socket-{}.sock", free_port()));
    let config = format!(
        "route_socket_path: {}\npods:\n  - {{name: a, address: '127.0.0.1:{}'}}\n  - {{name: b, address: '127.0.0.1:{}'}}\n",
        path.display(),
        free_port(),
        free_port()
    );
    (ScorerProcess::start(&config).await, path)
}

/// A route socket on the scorer's API port (its preface written).
async fn on_api_port(scorer: &ScorerProcess) -> tokio::net::TcpStream {
    let mut socket = tokio::net::TcpStream::connect(scorer.url.trim_start_matches("http://")).await.unwrap();
    socket.write_all(ROUTE_SOCKET_PREFACE).await.unwrap();
    socket
}

/// A route socket on the scorer's route socket path (its preface written).
async fn on_path(path: &std::path::Path) -> tokio::net::UnixStream {
    let mut socket = tokio::net::UnixStream::connect(path).await.unwrap();
    socket.write_all(ROUTE_SOCKET_PREFACE).await.unwrap();
    socket
}

fn call(id: u64, prompt: &str) -> RouteCall {
    RouteCall {
        call: id,
        request_id: format!("req-{id}"),
        api_path: "/v1/completions".into(),
        body: format!(r#"{{"model": "m", "prompt": "{prompt}", "max_tokens": 4}}"#).into_bytes(),
        ..Default::default()
    }
}

/// The report of request `id`'s end (4 tokens out).
fn done(id: &str) -> StreamReport {
    StreamReport::from(LifecycleReport { output_tokens: Some(4), ..LifecycleReport::new(id, LifecycleEvent::Done) })
}

async fn send(socket: &mut (impl AsyncWrite + Unpin), calls: &[RouteCall]) {
    let mut out = Vec::new();
    for c in calls {
        frame(c, &mut out);
    }
    socket.write_all(&out).await.unwrap();
}

/// The HTTP status an answer stands for: 200 for a pick, its refusal's status, 0 for a notice.
fn status(answer: &RouteAnswer) -> u16 {
    match &answer.outcome {
        Some(Outcome::Pick(_)) => 200,
        Some(Outcome::Refusal(refusal)) => refusal.refused().status(),
        None => 0,
    }
}

/// The next `n` answers (within 5 s).
async fn answers(socket: &mut (impl AsyncRead + Unpin), frames: &mut Frames, n: usize) -> Vec<RouteAnswer> {
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), async {
        while got.len() < n {
            while let Some(answer) = frames.message::<RouteAnswer>().unwrap() {
                got.push(answer);
            }
            if got.len() < n {
                assert!(socket.read_buf(frames.spare(4096)).await.unwrap() > 0, "the scorer closed the socket");
            }
        }
    })
    .await
    .expect("answers within 5 s");
    got
}

/// True if the scorer closes the socket (within 5 s) without answering anything.
async fn closed(socket: &mut (impl AsyncRead + Unpin)) -> bool {
    let mut buf = [0u8; 64];
    matches!(tokio::time::timeout(Duration::from_secs(5), socket.read(&mut buf)).await, Ok(Ok(0) | Err(_)))
}

#[tokio::test]
async fn calls_are_answered_by_id_on_the_api_port_beside_http() {
    let (scorer, _) = scorer().await;
    let mut socket = on_api_port(&scorer).await;
    // Three calls in one write, each answered with the decision POST /v1/route would give.
    send(&mut socket, &[call(7, "one"), call(8, "two"), call(9, "three")]).await;
    let mut frames = Frames::default();
    let mut got = answers(&mut socket, &mut frames, 3).await;
    got.sort_by_key(|a| a.call);
    assert_eq!(got.iter().map(|a| a.call).collect::<Vec<_>>(), [7, 8, 9]);
    for answer in &got {
        let Some(Outcome::Pick(RoutePick { pod, decode, .. })) = &answer.outcome else { panic!("{answer:?}") };
        assert!(["a", "b"].contains(&pod.as_str()) && decode.starts_with("127.0.0.1:"), "{answer:?}");
    }
    // A bad body: refused as a bad request, on the same socket.
    let mut bad = call(10, "x");
    bad.body = b"{\"prompt\": ".to_vec();
    send(&mut socket, &[bad]).await;
    let got = answers(&mut socket, &mut frames, 1).await;
    assert_eq!((got[0].call, status(&got[0])), (10, 400));
    let Some(Outcome::Refusal(refusal)) = &got[0].outcome else { unreachable!() };
    assert_eq!(refusal.refused(), Refused::BadRequest);
    assert!(refusal.message.contains("not valid JSON"), "{refusal:?}");
    // Reports alone are applied and not answered; the next call still is.
    let reports = ["req-7", "req-8", "req-9"].map(done);
    send(&mut socket, &[RouteCall { reports: reports.to_vec(), ..Default::default() }, call(11, "four")]).await;
    let got = answers(&mut socket, &mut frames, 1).await;
    assert_eq!((got[0].call, status(&got[0])), (11, 200));
    assert_eq!(scorer.metric("kvgate_lifecycle_reports_total{event=\"done\"}").await, 3.0);
    assert_eq!(scorer.metric("kvgate_route_streams").await, 1.0);
    // HTTP on the same port is untouched.
    let health = reqwest::get(format!("{}/healthz", scorer.url)).await.unwrap();
    assert_eq!(health.status(), 200);
    drop(socket);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(scorer.metric("kvgate_route_streams").await, 0.0, "closed sockets are not counted");
}

#[tokio::test]
async fn the_unix_socket_path_serves_route_sockets() {
    let (_scorer, path) = scorer().await;
    let mut socket = on_path(&path).await;
    send(&mut socket, &[call(1, "over a unix socket")]).await;
    let got = answers(&mut socket, &mut Frames::default(), 1).await;
    assert_eq!((got[0].call, status(&got[0])), (1, 200));
    // Nothing but route sockets there: anything else is closed unanswered.
    let mut http = tokio::net::UnixStream::connect(&path).await.unwrap();
    http.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    assert!(closed(&mut http).await);
}

#[tokio::test]
async fn a_caller_that_breaks_the_framing_is_cut_off_and_nobody_else_is() {
    let (scorer, path) = scorer().await;
    let mut good = on_path(&path).await;
    let mut frames = Frames::default();
    for garbage in [
        // A frame longer than any body the scorer accepts.
        u32::MAX.to_be_bytes().to_vec(),
        // A frame that is no route call.
        [&[0, 0, 0, 3][..], &[0xff, 0xff, 0xff]].concat(),
    ] {
        let mut bad = on_api_port(&scorer).await;
        bad.write_all(&garbage).await.unwrap();
        assert!(closed(&mut bad).await, "cut off");
        // The well-behaved socket is still served.
        send(&mut good, &[call(2, "still here")]).await;
        let got = answers(&mut good, &mut frames, 1).await;
        assert_eq!((got[0].call, status(&got[0])), (2, 200));
    }
    assert_eq!(reqwest::get(format!("{}/healthz", scorer.url)).await.unwrap().status(), 200);
}

#[tokio::test]
async fn sockets_are_told_when_requests_wait_for_admission_and_answers_say_how_many() {
    // One request at a time per pod: two calls fill the fleet, the next ones wait.
    let config = format!(
        "admission: {{max_inflight_requests: 1, max_wait_ms: 5000}}\npods:\n  - {{name: a, address: '127.0.0.1:{}'}}\n  - {{name: b, address: '127.0.0.1:{}'}}\n",
        free_port(),
        free_port()
    );
    let scorer = ScorerProcess::start(&config).await;
    let mut socket = on_api_port(&scorer).await;
    let mut frames = Frames::default();
    send(&mut socket, &[call(1, "one"), call(2, "two")]).await;
    let got = answers(&mut socket, &mut frames, 2).await;
    assert!(got.iter().all(|a| (status(a), a.admission_waiting) == (200, 0)), "{got:?}");
    // The queue forms: a notice (an answer to no call), to every socket.
    send(&mut socket, &[call(3, "three"), call(4, "four")]).await;
    let notice = answers(&mut socket, &mut frames, 1).await;
    assert_eq!(notice[0].call, 0, "{notice:?}");
    assert!(notice[0].admission_waiting >= 1);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(scorer.metric("kvgate_admission_waiting").await, 2.0);
    // A socket opened while requests wait is told at once.
    let mut late = on_api_port(&scorer).await;
    let notice = answers(&mut late, &mut Frames::default(), 1).await;
    assert_eq!((notice[0].call, notice[0].admission_waiting), (0, 2));
    // Each end frees a pod for the first waiter; its answer counts those still waiting.
    send(&mut socket, &[RouteCall { reports: vec![done("req-1")], ..Default::default() }]).await;
    let got = answers(&mut socket, &mut frames, 1).await;
    assert_eq!((got[0].call, status(&got[0]), got[0].admission_waiting), (3, 200, 1));
    // The last waiter answered: the queue is gone, and the socket is told so.
    send(&mut socket, &[RouteCall { reports: vec![done("req-2")], ..Default::default() }]).await;
    let mut got = answers(&mut socket, &mut frames, 2).await;
    got.sort_by_key(|a| a.call);
    assert_eq!(
        got.iter().map(|a| (a.call, status(a), a.admission_waiting)).collect::<Vec<_>>(),
        [(0, 0, 0), (4, 200, 0)]
    );
}

#[tokio::test]
async fn a_caller_of_another_protocol_version_is_refused() {
    let (scorer, path) = scorer().await;
    // A native module of the protocol's first version, on either address: closed unanswered.
    let mut old = tokio::net::TcpStream::connect(scorer.url.trim_start_matches("http://")).await.unwrap();
    old.write_all(b"KVGATE-ROUTE/1\r\n\r\n").await.unwrap();
    send(&mut old, &[call(1, "from an older filter")]).await;
    assert!(closed(&mut old).await);
    let mut old = tokio::net::UnixStream::connect(&path).await.unwrap();
    old.write_all(b"KVGATE-ROUTE/1\r\n\r\n").await.unwrap();
    assert!(closed(&mut old).await);
    // A wasm filter of the first version: its gRPC stream fails at once, saying why.
    let channel = tonic::transport::Endpoint::from_shared(scorer.url.clone()).unwrap().connect().await.unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let calls = tokio_stream::iter(vec![call(1, "from an older filter")]);
    let refused = grpc
        .streaming(
            tonic::Request::new(calls),
            tonic::codegen::http::uri::PathAndQuery::from_static(kvgate_route_api::ROUTE_STREAM_V1_PATH),
            tonic_prost::ProstCodec::<RouteCall, RouteAnswer>::default(),
        )
        .await
        .expect_err("refused");
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused}");
    assert!(refused.message().contains("route protocol 1"), "{refused}");
    // This version's callers are served meanwhile.
    let mut socket = on_path(&path).await;
    send(&mut socket, &[call(2, "current")]).await;
    assert_eq!(status(&answers(&mut socket, &mut Frames::default(), 1).await[0]), 200);
    assert_eq!(scorer.metric("kvgate_route_streams").await, 1.0, "refused callers are not counted");
}
