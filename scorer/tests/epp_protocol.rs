//! The Endpoint Picker protocol message by message, against the real scorer over gRPC (h2c):
//! what a gateway sends in each body mode and what it must get back — the pick in header and
//! metadata, the body unchanged in bounded chunks, errors as immediate responses, the
//! response phase moving and releasing bookings, abandoned streams, many streams at once, and
//! gRPC health. (Through a real Envoy: `tests/e2e/tests/epp_path.rs`.)

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, ProtocolConfiguration, body_mutation,
};
use envoy_types::pb::google::protobuf::{ListValue, Struct, Value, value::Kind};
use kvgate_test_harness::{EPP_PORT, ScorerProcess, free_port};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// A scorer whose Endpoint Picker serves plaintext gRPC, with three pods nobody scrapes
/// (always eligible, indexed by what was routed there).
async fn picker(extra: &str) -> (ScorerProcess, [String; 3]) {
    let pods = [0, 1, 2].map(|_| format!("127.0.0.1:{}", free_port()));
    let config = format!(
        "fallback_endpoints: 1\nepp: {{listen: '127.0.0.1:{EPP_PORT}', tls: {{mode: plaintext}}{extra}}}\npods:\n{}",
        pods.iter().enumerate().map(|(i, a)| format!("  - {{name: p{i}, address: '{a}'}}\n")).collect::<String>()
    );
    (ScorerProcess::start(&config).await, pods)
}

async fn channel(scorer: &ScorerProcess) -> tonic::transport::Channel {
    let url = format!("http://127.0.0.1:{}", scorer.epp_port.unwrap());
    tonic::transport::Channel::from_shared(url).unwrap().connect().await.unwrap()
}

async fn client(scorer: &ScorerProcess) -> ExternalProcessorClient<tonic::transport::Channel> {
    ExternalProcessorClient::new(channel(scorer).await)
}

/// One open ext_proc stream, driven message by message.
struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
}

impl Stream {
    async fn open(scorer: &ScorerProcess) -> Stream {
        let (tx, requests) = mpsc::channel(64);
        let rx = client(scorer).await.process(ReceiverStream::new(requests)).await.unwrap().into_inner();
        Stream { tx, rx }
    }

    async fn send(&self, request: Message, config: Option<ProtocolConfiguration>, context: Option<Metadata>) {
        let message = ProcessingRequest {
            request: Some(request),
            protocol_config: config,
            metadata_context: context,
            ..Default::default()
        };
        self.tx.send(message).await.unwrap();
    }

    async fn next(&mut self) -> ProcessingResponse {
        tokio::time::timeout(Duration::from_secs(5), self.rx.message())
            .await
            .expect("an answer in time")
            .unwrap()
            .unwrap()
    }
}

fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> Message {
    let headers = pairs
        .iter()
        .map(|(k, v)| HeaderValue { key: k.to_string(), raw_value: v.as_bytes().to_vec(), ..Default::default() })
        .collect();
    Message::RequestHeaders(HttpHeaders { headers: Some(HeaderMap { headers }), end_of_stream, ..Default::default() })
}

fn post(path: &str) -> Message {
    headers(&[(":method", "POST"), (":path", path), ("x-request-id", "client-id")], false)
}

fn body(bytes: &[u8], end_of_stream: bool) -> Message {
    Message::RequestBody(HttpBody { body: bytes.to_vec(), end_of_stream, ..Default::default() })
}

fn mode(request: BodySendMode, response: BodySendMode, without_waiting: bool) -> Option<ProtocolConfiguration> {
    Some(ProtocolConfiguration {
        request_body_mode: request as i32,
        response_body_mode: response as i32,
        send_body_without_waiting_for_header_response: without_waiting,
    })
}

fn string(s: &str) -> Value {
    Value { kind: Some(Kind::StringValue(s.into())) }
}

fn metadata(namespace: &str, key: &str, value: Value) -> Metadata {
    let inner = Struct { fields: [(key.to_string(), value)].into() };
    Metadata { filter_metadata: [(namespace.to_string(), inner)].into(), ..Default::default() }
}

/// The value the answer sets for `name`.
fn set_header(answer: &ProcessingResponse, name: &str) -> Option<String> {
    let common = match answer.response.as_ref()? {
        Answer::RequestHeaders(h) => h.response.as_ref()?,
        Answer::RequestBody(b) => b.response.as_ref()?,
        _ => return None,
    };
    let set = &common.header_mutation.as_ref()?.set_headers;
    set.iter()
        .filter_map(|h| h.header.as_ref())
        .find(|h| h.key == name)
        .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
}

/// `envoy.lb` / `x-gateway-destination-endpoint` in the answer's dynamic metadata.
fn lb_metadata(answer: &ProcessingResponse) -> Option<String> {
    let lb = answer.dynamic_metadata.as_ref()?.fields.get("envoy.lb")?;
    let Some(Kind::StructValue(lb)) = &lb.kind else { return None };
    match &lb.fields.get("x-gateway-destination-endpoint")?.kind {
        Some(Kind::StringValue(s)) => Some(s.clone()),
        _ => None,
    }
}

/// The streamed body chunk of a full-duplex body answer: (bytes, end_of_stream).
fn streamed(answer: &ProcessingResponse) -> (Vec<u8>, bool) {
    let Some(Answer::RequestBody(b)) = &answer.response else { panic!("not a body answer: {answer:?}") };
    let mutation = b.response.as_ref().and_then(|c| c.body_mutation.as_ref()).and_then(|m| m.mutation.as_ref());
    match mutation {
        Some(body_mutation::Mutation::StreamedResponse(s)) => (s.body.clone(), s.end_of_stream),
        other => panic!("not a streamed body: {other:?}"),
    }
}

/// The immediate response's status and JSON body.
fn immediate(answer: &ProcessingResponse) -> (i32, serde_json::Value) {
    let Some(Answer::ImmediateResponse(r)) = &answer.response else { panic!("not an immediate response: {answer:?}") };
    (r.status.as_ref().unwrap().code, serde_json::from_slice(&r.body).expect("JSON error body"))
}

fn completion(prompt: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"prompt": prompt, "max_tokens": 4})).unwrap()
}

async fn inflight(scorer: &ScorerProcess) -> u64 {
    scorer.pods().await.iter().map(|p| p["inflight_requests"].as_u64().unwrap()).sum()
}

#[tokio::test]
async fn full_duplex_the_pick_then_the_body_back_in_bounded_chunks() {
    let (scorer, pods) = picker("").await;
    let mut s = Stream::open(&scorer).await;
    let payload = completion(&"word ".repeat(30_000)); // 150 kB
    // No protocol_config: the Endpoint Picker protocol's full duplex.
    s.send(post("/v1/completions"), None, None).await;
    for piece in payload.chunks(40_000) {
        s.send(body(piece, false), None, None).await;
    }
    s.send(body(b"", true), None, None).await;
    let answer = s.next().await;
    let Some(Answer::RequestHeaders(h)) = &answer.response else { panic!("headers first: {answer:?}") };
    assert!(h.response.as_ref().unwrap().clear_route_cache);
    let destinations = set_header(&answer, "x-gateway-destination-endpoint").expect("the pick");
    assert_eq!(lb_metadata(&answer).as_deref(), Some(destinations.as_str()), "header and metadata agree");
    let listed: Vec<&str> = destinations.split(',').collect();
    assert_eq!(listed.len(), 2, "the pick and one fallback: {destinations}");
    assert!(listed.iter().all(|a| pods.contains(&a.to_string())) && listed[0] != listed[1]);
    let mut back = Vec::new();
    loop {
        let (chunk, end) = streamed(&s.next().await);
        assert!(chunk.len() <= 62_000, "{}", chunk.len());
        back.extend(chunk);
        if end {
            break;
        }
    }
    assert_eq!(back, payload, "the body comes back unchanged");
    assert_eq!(inflight(&scorer).await, 1, "booked");
    // The stream ends without a response (the client went away): the booking is released.
    drop(s);
    tokio::time::timeout(Duration::from_secs(5), async {
        while inflight(&scorer).await > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("an abandoned stream frees its booking");
}

#[tokio::test]
async fn buffered_answers_the_headers_at_once_and_picks_with_the_body() {
    let (scorer, _pods) = picker("").await;
    let mut s = Stream::open(&scorer).await;
    s.send(post("/v1/chat/completions"), mode(BodySendMode::Buffered, BodySendMode::Streamed, false), None).await;
    let first = s.next().await;
    assert!(matches!(first.response, Some(Answer::RequestHeaders(_))));
    assert_eq!(set_header(&first, "x-gateway-destination-endpoint"), None, "no pick before the body");
    let chat = serde_json::to_vec(&serde_json::json!({"messages": [{"role": "user", "content": "hi"}]})).unwrap();
    s.send(body(&chat, true), None, None).await;
    let answer = s.next().await;
    assert!(matches!(answer.response, Some(Answer::RequestBody(_))));
    let pick = set_header(&answer, "x-gateway-destination-endpoint").expect("the pick in the body answer");
    assert_eq!(lb_metadata(&answer), Some(pick));
}

#[tokio::test]
async fn streamed_answers_headers_then_one_continue_per_chunk() {
    let (scorer, _pods) = picker("").await;
    let mut s = Stream::open(&scorer).await;
    s.send(post("/v1/completions"), mode(BodySendMode::Streamed, BodySendMode::Streamed, true), None).await;
    let payload = completion("three chunks of a prompt");
    let thirds: Vec<&[u8]> = payload.chunks(payload.len() / 3 + 1).collect();
    for (i, piece) in thirds.iter().enumerate() {
        s.send(body(piece, i == thirds.len() - 1), None, None).await;
    }
    assert!(set_header(&s.next().await, "x-gateway-destination-endpoint").is_some());
    for _ in &thirds {
        let answer = s.next().await;
        let Some(Answer::RequestBody(b)) = answer.response else { panic!("a body answer") };
        assert!(b.response.unwrap().body_mutation.is_none(), "the gateway keeps the body");
    }
    // Without send_body_without_waiting_for_header_response the picker cannot route: refused.
    let mut refused = Stream::open(&scorer).await;
    refused.send(post("/v1/completions"), mode(BodySendMode::Streamed, BodySendMode::None, false), None).await;
    let status = tokio::time::timeout(Duration::from_secs(5), refused.rx.message()).await.unwrap().unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert!(status.message().contains("send_body_without_waiting_for_header_response"), "{status}");
}

#[tokio::test]
async fn errors_are_immediate_responses_and_other_requests_pass_through() {
    let (scorer, pods) = picker(", body_limit_bytes: 2000").await;
    // Malformed JSON: 400 with the OpenAI error shape.
    let mut s = Stream::open(&scorer).await;
    s.send(post("/v1/completions"), None, None).await;
    s.send(body(b"{\"prompt\": ", true), None, None).await;
    let (status, err) = immediate(&s.next().await);
    assert_eq!((status, err["error"]["type"].as_str()), (400, Some("BadRequestError")));
    // Over the body limit: 413 before the body is complete.
    let mut s = Stream::open(&scorer).await;
    s.send(post("/v1/completions"), None, None).await;
    s.send(body(&[b' '; 1500], false), None, None).await;
    s.send(body(&[b' '; 1500], false), None, None).await;
    assert_eq!(immediate(&s.next().await).0, 413);
    // A subset hint names where the proxy can send: only there; nothing eligible → 503.
    let hint = |entries: Vec<&str>| {
        let list = ListValue { values: entries.into_iter().map(string).collect() };
        Some(metadata(
            "envoy.lb.subset_hint",
            "x-gateway-destination-endpoint-subset",
            Value { kind: Some(Kind::ListValue(list)) },
        ))
    };
    for _ in 0..4 {
        let mut s = Stream::open(&scorer).await;
        s.send(post("/v1/completions"), None, hint(vec![&pods[2]])).await;
        s.send(body(&completion("limited"), true), None, None).await;
        assert_eq!(
            set_header(&s.next().await, "x-gateway-destination-endpoint"),
            Some(pods[2].clone()),
            "no fallback outside it"
        );
    }
    let mut s = Stream::open(&scorer).await;
    s.send(post("/v1/completions"), None, hint(vec!["10.9.9.9:1"])).await;
    s.send(body(&completion("nowhere"), true), None, None).await;
    let (status, err) = immediate(&s.next().await);
    assert_eq!((status, err["error"]["type"].as_str()), (503, Some("ServiceUnavailable")));
    // A GET (no body) and another path: answered at once, a client's destination removed.
    for request in [headers(&[(":method", "GET"), (":path", "/v1/models")], true), post("/v1/embeddings")] {
        let mut s = Stream::open(&scorer).await;
        s.send(request, None, None).await;
        let answer = s.next().await;
        let Some(Answer::RequestHeaders(h)) = &answer.response else { panic!("{answer:?}") };
        let mutation = h.response.as_ref().unwrap().header_mutation.as_ref().unwrap();
        assert_eq!(mutation.remove_headers, vec!["x-gateway-destination-endpoint".to_string()]);
    }
}

#[tokio::test]
async fn the_response_phase_moves_and_releases_bookings() {
    let (scorer, pods) = picker("").await;
    let mut s = Stream::open(&scorer).await;
    s.send(post("/v1/completions"), None, None).await;
    s.send(body(&completion("served elsewhere"), true), None, None).await;
    let pick = set_header(&s.next().await, "x-gateway-destination-endpoint").unwrap();
    let _ = s.next().await; // the body back
    let picked = pick.split(',').next().unwrap().to_string();
    let served = pods.iter().find(|p| **p != picked).unwrap().clone();
    // The proxy retried: the served endpoint is another pod.
    let status = headers(&[(":status", "200")], false);
    let Message::RequestHeaders(status) = status else { unreachable!() };
    s.send(
        Message::ResponseHeaders(status),
        None,
        Some(metadata("envoy.lb", "x-gateway-destination-endpoint-served", string(&served))),
    )
    .await;
    assert!(matches!(s.next().await.response, Some(Answer::ResponseHeaders(_))));
    let on = |name: &str| {
        let name = name.to_string();
        let scorer = &scorer;
        async move { scorer.pods().await.into_iter().find(|p| p["address"] == name.as_str()).unwrap() }
    };
    assert_eq!(on(&served).await["inflight_requests"], 1, "the booking moved to the pod that served");
    assert_eq!(on(&picked).await["inflight_requests"], 0);
    let prefill = on(&served).await["queued_prefill_tokens"].as_u64().unwrap();
    assert!(prefill > 0);
    // The first body bytes: prefill is over. The end with usage: done.
    s.send(Message::ResponseBody(HttpBody { body: b"{\"choices\":[".to_vec(), ..Default::default() }), None, None)
        .await;
    let (chunk, _) = match s.next().await.response {
        Some(Answer::ResponseBody(b)) => match b.response.unwrap().body_mutation.unwrap().mutation.unwrap() {
            body_mutation::Mutation::StreamedResponse(r) => (r.body, r.end_of_stream),
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    };
    assert_eq!(chunk, b"{\"choices\":[", "relayed unchanged");
    assert_eq!(on(&served).await["queued_prefill_tokens"], 0);
    let end = b"],".iter().chain(b"\"usage\":{\"completion_tokens\":4}}").copied().collect::<Vec<u8>>();
    s.send(Message::ResponseBody(HttpBody { body: end, end_of_stream: true, ..Default::default() }), None, None).await;
    let _ = s.next().await;
    assert_eq!(on(&served).await["inflight_requests"], 0, "done");
    let metrics = reqwest::get(format!("{}/metrics", scorer.url)).await.unwrap().text().await.unwrap();
    for line in [
        "kvgate_bookings_moved_total 1",
        "kvgate_output_tokens_total 4",
        "kvgate_lifecycle_reports_total{event=\"done\"} 1",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }
}

#[tokio::test]
async fn many_streams_at_once() {
    let (scorer, pods) = picker("").await;
    let streams: Vec<_> = (0..64)
        .map(|i| {
            let (url, pods) = (scorer.epp_port.unwrap(), pods.clone());
            tokio::spawn(async move {
                let (tx, requests) = mpsc::channel(8);
                let mut client = ExternalProcessorClient::connect(format!("http://127.0.0.1:{url}")).await.unwrap();
                let mut rx = client.process(ReceiverStream::new(requests)).await.unwrap().into_inner();
                let send = |m| ProcessingRequest { request: Some(m), ..Default::default() };
                tx.send(send(post("/v1/completions"))).await.unwrap();
                tx.send(send(body(&completion(&format!("request {i} of many")), true))).await.unwrap();
                let answer = rx.message().await.unwrap().unwrap();
                let pick = set_header(&answer, "x-gateway-destination-endpoint").unwrap();
                assert!(pods.contains(&pick.split(',').next().unwrap().to_string()));
                let _ = rx.message().await.unwrap().unwrap(); // the body back
                let Message::RequestHeaders(status) = headers(&[(":status", "200")], true) else { unreachable!() };
                tx.send(send(Message::ResponseHeaders(status))).await.unwrap();
                let _ = rx.message().await.unwrap().unwrap();
            })
        })
        .collect();
    for s in streams {
        s.await.unwrap();
    }
    assert_eq!(inflight(&scorer).await, 0, "every response ended its booking");
    let metrics = reqwest::get(format!("{}/metrics", scorer.url)).await.unwrap().text().await.unwrap();
    assert!(metrics.lines().any(|l| l == "kvgate_lifecycle_reports_total{event=\"done\"} 64"), "{metrics}");
}

#[tokio::test]
async fn grpc_health_follows_the_fleet() {
    // One pod whose metrics never answer: unhealthy after two failed scrapes.
    let port = free_port();
    let config = format!(
        "epp: {{listen: '127.0.0.1:{EPP_PORT}', tls: {{mode: plaintext}}}}\nhealth: {{scrape_interval_ms: 100, unhealthy_after: 2}}\npods:\n  - {{name: gone, address: '127.0.0.1:{port}', metrics: 'http://127.0.0.1:{port}/metrics'}}\n"
    );
    let scorer = ScorerProcess::start(&config).await;
    let mut health = HealthClient::new(channel(&scorer).await);
    let mut status = async |service: &str| {
        let request = HealthCheckRequest { service: service.into() };
        ServingStatus::try_from(health.check(request).await.unwrap().into_inner().status).unwrap()
    };
    assert_eq!(status("liveness").await, ServingStatus::Serving);
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(status("liveness").await, ServingStatus::Serving, "the process answers");
    assert_eq!(status("readiness").await, ServingStatus::NotServing, "no healthy pod to pick");
    assert_eq!(status("envoy.service.ext_proc.v3.ExternalProcessor").await, ServingStatus::NotServing);

    let (ready, _pods) = picker("").await;
    let mut health = HealthClient::new(channel(&ready).await);
    tokio::time::sleep(Duration::from_millis(400)).await;
    for service in ["liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"] {
        let request = HealthCheckRequest { service: service.into() };
        assert_eq!(
            health.check(request).await.unwrap().into_inner().status,
            ServingStatus::Serving as i32,
            "{service}"
        );
    }
}

#[tokio::test]
async fn an_observing_stream_reports_for_the_booking_the_routing_stream_made() {
    let (scorer, _pods) = picker("").await;
    // The routing stream: the gateway sends it no response (response_body_mode NONE).
    let mut routing = Stream::open(&scorer).await;
    routing.send(post("/v1/completions"), mode(BodySendMode::Streamed, BodySendMode::None, true), None).await;
    routing.send(body(&completion("observed elsewhere"), true), None, None).await;
    let decision = routing.next().await;
    let booking = match &decision.dynamic_metadata.as_ref().unwrap().fields["kvgate"].kind {
        Some(Kind::StructValue(k)) => k.fields["booking"].clone(),
        other => panic!("the decision names its booking: {other:?}"),
    };
    let _ = routing.next().await; // the body chunk's continue
    drop(routing); // its stream ends: the booking is not its to end
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(inflight(&scorer).await, 1, "handed to whoever reports the response");

    // An observing stream (observability mode: nothing is answered) names the booking in
    // the kvgate metadata the decision set, and reports the response.
    let mut observer = Stream::open(&scorer).await;
    let send_observed = async |s: &Stream, m: Message, context: Option<Metadata>| {
        let message = ProcessingRequest {
            request: Some(m),
            observability_mode: true,
            metadata_context: context,
            ..Default::default()
        };
        s.tx.send(message).await.unwrap();
    };
    let context = Some(metadata("kvgate", "booking", booking));
    send_observed(&observer, headers(&[(":method", "POST"), (":path", "/v1/completions")], false), context.clone())
        .await;
    let Message::RequestHeaders(status) = headers(&[(":status", "200")], false) else { unreachable!() };
    send_observed(&observer, Message::ResponseHeaders(status), context.clone()).await;
    let end =
        HttpBody { body: b"{\"usage\":{\"completion_tokens\":4}}".to_vec(), end_of_stream: true, ..Default::default() };
    send_observed(&observer, Message::ResponseBody(end), context).await;
    // No answer comes; the picker ends the stream once the response is over.
    let closed = tokio::time::timeout(Duration::from_secs(5), observer.rx.message()).await.expect("closed in time");
    assert!(matches!(closed, Ok(None)), "{closed:?}");
    assert_eq!(inflight(&scorer).await, 0, "done");
}

#[tokio::test]
async fn sigterm_stops_readiness_at_once_answers_while_draining_and_lets_open_exchanges_finish() {
    let pods: Vec<String> = (0..2).map(|_| format!("127.0.0.1:{}", free_port())).collect();
    let config = format!(
        "epp: {{listen: '127.0.0.1:{EPP_PORT}', tls: {{mode: plaintext}}}}\nshutdown: {{drain_seconds: 1.5, finish_seconds: 20}}\npods:\n{}",
        pods.iter().enumerate().map(|(i, a)| format!("  - {{name: p{i}, address: '{a}'}}\n")).collect::<String>()
    );
    let mut scorer = ScorerProcess::start(&config).await;
    let mut health = HealthClient::new(channel(&scorer).await);
    let mut status = async |service: &str| {
        let request = HealthCheckRequest { service: service.into() };
        ServingStatus::try_from(health.check(request).await.unwrap().into_inner().status).unwrap()
    };
    let readyz = async |scorer: &ScorerProcess| {
        let r = reqwest::get(format!("{}/readyz", scorer.url)).await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    };
    assert_eq!(status("envoy.service.ext_proc.v3.ExternalProcessor").await, ServingStatus::Serving);
    assert_eq!(readyz(&scorer).await.0, 200);

    // An exchange under way when SIGTERM comes: picked, its response not yet relayed.
    let mut open = Stream::open(&scorer).await;
    open.send(post("/v1/completions"), None, None).await;
    open.send(body(&completion("a long generation"), true), None, None).await;
    assert!(set_header(&open.next().await, "x-gateway-destination-endpoint").is_some());
    let _ = open.next().await; // the body back

    scorer.terminate();
    let signalled = std::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(
        status("envoy.service.ext_proc.v3.ExternalProcessor").await,
        ServingStatus::NotServing,
        "not serving at once"
    );
    assert_eq!(status("readiness").await, ServingStatus::NotServing);
    assert_eq!(status("liveness").await, ServingStatus::Serving, "alive while draining");
    let (code, why) = readyz(&scorer).await;
    assert!(code == 503 && why.contains("draining"), "{code} {why}");

    // Draining: a gateway that has not noticed yet is still answered, on a new connection too.
    let mut late = Stream::open(&scorer).await;
    late.send(post("/v1/completions"), None, None).await;
    late.send(body(&completion("sent while draining"), true), None, None).await;
    assert!(set_header(&late.next().await, "x-gateway-destination-endpoint").is_some(), "answered while draining");
    let _ = late.next().await;
    drop(late);

    // After the drain the listener is closed; the open exchange still goes on.
    tokio::time::sleep(Duration::from_millis(1500).saturating_sub(signalled.elapsed()) + Duration::from_millis(700))
        .await;
    let port = scorer.epp_port.unwrap();
    assert!(tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err(), "no new connection after the drain");
    assert!(scorer.wait_exit(Duration::from_millis(300)).await.is_none(), "the open exchange holds the exit");
    let ok = headers(&[(":status", "200")], false);
    let Message::RequestHeaders(ok) = ok else { unreachable!() };
    open.send(Message::ResponseHeaders(ok), None, None).await;
    assert!(matches!(open.next().await.response, Some(Answer::ResponseHeaders(_))), "answered after the drain");
    let end = b"{\"choices\":[],\"usage\":{\"completion_tokens\":2}}".to_vec();
    open.send(Message::ResponseBody(HttpBody { body: end, end_of_stream: true, ..Default::default() }), None, None)
        .await;
    let relayed = match open.next().await.response {
        Some(Answer::ResponseBody(b)) => match b.response.unwrap().body_mutation.unwrap().mutation.unwrap() {
            body_mutation::Mutation::StreamedResponse(r) => r.end_of_stream && r.body.ends_with(b"}}"),
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    };
    assert!(relayed, "the response's end relayed");
    drop(open);
    let exited = scorer.wait_exit(Duration::from_secs(5)).await.expect("exits once the open exchange ended");
    assert!(exited.success(), "{exited}");
}

#[tokio::test]
async fn readiness_waits_for_each_pods_index_to_catch_up_from_its_replay_buffer() {
    use kvgate_test_harness::Sim;
    let tokenizer = kvgate_test_harness::qwen3_tokenizer();
    let tok = tokenizer.to_str().unwrap();
    let pod = Sim::start("warm", &["--tokenizer", tok]).await;
    // The engine ran before this scorer: blocks stored, then nothing published for a while.
    let prompt = kvgate_test_harness::text("an engine that was busy before the picker started", 200);
    let served = pod.post("/v1/completions", &serde_json::json!({"prompt": prompt, "max_tokens": 2})).await;
    assert!(served.status().is_success());
    let engine_blocks = pod.metric("kvgate_sim:cached_blocks").await;
    assert!(engine_blocks > 0.0);
    let config = format!(
        "tokenizer: {tok}\nepp: {{listen: '127.0.0.1:{EPP_PORT}', tls: {{mode: plaintext}}}}\npods:\n  - {{name: warm, address: '127.0.0.1:{}', kv_events: '{}', kv_events_replay: '{}'}}\n",
        pod.port, pod.events, pod.replay
    );
    let scorer = ScorerProcess::start(&config).await;
    // Ready (polled as a probe would) only with the blocks of the replay buffer indexed (the
    // engine publishes nothing more).
    scorer.wait_ready(Duration::from_secs(10)).await;
    let indexed = scorer.pod("warm").await["cached_blocks"].as_f64().unwrap();
    assert_eq!(indexed, engine_blocks, "ready with the engine's cache known, no new event needed");
    let metrics = reqwest::get(format!("{}/metrics", scorer.url)).await.unwrap().text().await.unwrap();
    assert!(metrics.contains("kvgate_kv_replays_total{outcome=\"caught_up\",pod=\"warm\"} 1"), "{metrics}");
}
