//! The HTTP face of a simulated vLLM pod: vLLM's OpenAI-compatible API (with `/v1/responses`)
//! and its Anthropic Messages API (`/v1/messages`), `/tokenize`,
//! `/metrics` in vLLM's Prometheus names, `/health`, `/v1/models`, `/reset_prefix_cache`,
//! plus `GET /sim/requests` (the last requests served, without prompts) for tests.

use crate::api::{ApiError, ChatRequest, Common, CompletionRequest, Prompt, TokenizeRequest, parse_body};
use crate::driver::{Emission, EngineHandle};
use crate::publisher::PublisherStats;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use futures::{Stream, StreamExt};
use kvgate_sim::cache::HashKeys;
use kvgate_sim::engine::{KvTransfer, NewRequest, Usage};
use kvgate_tokenize::{ChatOptions, MessagesRequest, ResponsesRequest, Tokenizer};
use serde::Serialize;
use serde_json::{Map, Value, json};
use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio_stream::wrappers::UnboundedReceiverStream;

mod messages;
mod responses;

/// Which side of prefill/decode disaggregation the pod serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Serves ordinary requests and both P/D legs.
    Both,
    /// Serves ordinary requests and `do_remote_decode` prefill legs.
    Prefill,
    /// Serves ordinary requests and `do_remote_prefill` decode legs.
    Decode,
}

/// Identity and limits of the pod, fixed at start-up.
pub struct PodInfo {
    pub pod_id: String,
    pub model: String,
    /// LoRA adapters served beside the base model (requests name them in `model`).
    pub lora_modules: Vec<String>,
    /// Adapters one batch may hold (0: no limit).
    pub max_loras: usize,
    pub role: Role,
    pub listen: SocketAddr,
    pub engine_id: String,
    pub block_size: usize,
    pub num_blocks: usize,
    pub max_model_len: usize,
    pub default_max_tokens: u32,
    /// Unix time the process started: `process_start_time_seconds`, as vLLM's Prometheus
    /// client exposes it (a restart changes it).
    pub started_at: f64,
}

impl PodInfo {
    /// The LoRA adapter a request's `model` names and its id (1, 2, … in the order of
    /// `--lora-module`, as vLLM numbers adapters it loads; `None` for the base model or no
    /// `model`); an unknown name is a 404, as in vLLM.
    fn resolve_model(&self, model: Option<&str>) -> Result<Option<(String, u32)>, ApiError> {
        match model {
            None => Ok(None),
            Some(m) if m == self.model => Ok(None),
            Some(m) => match self.lora_modules.iter().position(|l| l == m) {
                Some(i) => Ok(Some((m.to_string(), i as u32 + 1))),
                None => Err(ApiError::new(StatusCode::NOT_FOUND, format!("The model `{m}` does not exist."))),
            },
        }
    }
}

/// What one served request looked like, for `GET /sim/requests` (no prompt text).
#[derive(Clone, Debug, Serialize)]
pub struct RequestRecord {
    pub request_id: String,
    pub endpoint: &'static str,
    pub stream: bool,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub max_tokens: u32,
    /// `local`, `remote_decode` (prefill leg) or `remote_prefill` (decode leg).
    pub kv_transfer: &'static str,
    /// The `kv_transfer_params` the request carried, as received.
    pub kv_transfer_params: Option<Map<String, Value>>,
    /// `x-prefiller-host-port` (llm-d's header naming the prefill pod), if sent.
    pub prefiller: Option<String>,
    /// Wall-clock milliseconds from arrival to the first token and to the last.
    pub ttft_ms: f64,
    pub total_ms: f64,
}

const REQUEST_LOG: usize = 4096;

pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub pod: PodInfo,
    /// Text of each filler token the engine generates.
    pub filler_text: HashMap<u32, String>,
    pub publisher: Option<Arc<PublisherStats>>,
    /// Puts this many malformed messages on the event socket (`POST /sim/kv_events/garbage`).
    pub kv_garbage: Option<tokio::sync::mpsc::UnboundedSender<usize>>,
    pub log: Mutex<VecDeque<RequestRecord>>,
    pub http_errors: AtomicU64,
    pub next_id: AtomicU64,
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/messages", post(anthropic_messages))
        .route("/v1/responses", post(openai_responses))
        .route("/tokenize", post(tokenize))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", get(metrics))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/sim/requests", get(request_log))
        .route("/sim/kv_events/garbage", post(kv_garbage))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such endpoint") })
        .layer(axum::middleware::from_fn_with_state(state.clone(), pod_header))
        .with_state(state)
}

/// Every response names the pod that produced it (`x-kvgate-pod`), so tests and demos can
/// see where a router sent each request.
async fn pod_header(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    if response.status().is_client_error() || response.status().is_server_error() {
        state.http_errors.fetch_add(1, Ordering::Relaxed);
    }
    if let Ok(value) = HeaderValue::from_str(&state.pod.pod_id) {
        response.headers_mut().insert("x-kvgate-pod", value);
    }
    response
}

/// One engine request per prompt, ready to submit.
struct Job {
    endpoint: &'static str,
    request_id: String,
    prompts: Vec<Vec<u32>>,
    max_tokens: u32,
    stream: bool,
    include_usage: bool,
    keys: HashKeys,
    kv_transfer: KvTransfer,
    kv_transfer_params: Option<Map<String, Value>>,
    prefiller: Option<String>,
}

async fn completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(&body)?;
    let prompts = match req.prompt {
        None => return Err(ApiError::bad_request("'prompt' is required")),
        Some(Prompt::Text(text)) => vec![encode(&state.tokenizer, &text, req.add_special_tokens)?],
        Some(Prompt::Texts(texts)) => {
            texts.iter().map(|t| encode(&state.tokenizer, t, req.add_special_tokens)).collect::<Result<_, _>>()?
        }
        Some(Prompt::Tokens(ids)) => vec![ids],
        Some(Prompt::TokenLists(lists)) => lists,
    };
    if prompts.is_empty() {
        return Err(ApiError::bad_request("'prompt' must not be empty"));
    }
    let job = job(&state, &headers, "completions", prompts, &req.common, None)?;
    Ok(run_job(state.clone(), job).await)
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: ChatRequest = parse_body(&body)?;
    let messages = req.messages.ok_or_else(|| ApiError::bad_request("'messages' is required"))?;
    let options = ChatOptions {
        add_generation_prompt: req.add_generation_prompt,
        continue_final_message: req.continue_final_message,
        tools: req.tools,
        template_kwargs: req.chat_template_kwargs,
        reasoning_effort: req.reasoning_effort,
    };
    let text = state.tokenizer.render_chat(&messages, &options).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let prompt = encode(&state.tokenizer, &text, req.add_special_tokens)?;
    let job = job(&state, &headers, "chat.completions", vec![prompt], &req.common, req.max_completion_tokens)?;
    Ok(run_job(state.clone(), job).await)
}

/// `POST /v1/messages`: the request rendered as vLLM renders it (see `kvgate_tokenize::anthropic`).
async fn anthropic_messages(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: MessagesRequest = parse_body(&body)?;
    let common: Common = parse_body(&body)?;
    let prompt = state.tokenizer.encode_messages_request(&req).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let job = job(&state, &headers, "messages", vec![prompt], &common, None)?;
    Ok(run_job(state.clone(), job).await)
}

/// `POST /v1/responses`: the request rendered as vLLM renders it (see
/// `kvgate_tokenize::responses`).
async fn openai_responses(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: ResponsesRequest = parse_body(&body)?;
    let common: Common = parse_body(&body)?;
    let prompt = state.tokenizer.encode_responses_request(&req).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let job = job(&state, &headers, "responses", vec![prompt], &common, req.max_output_tokens)?;
    Ok(run_job(state.clone(), job).await)
}

fn encode(tokenizer: &Tokenizer, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, ApiError> {
    tokenizer.encode(text, add_special_tokens).map_err(|e| ApiError::bad_request(e.to_string()))
}

/// Validates what both endpoints share and decides the request's P/D role.
fn job(
    state: &AppState,
    headers: &HeaderMap,
    endpoint: &'static str,
    prompts: Vec<Vec<u32>>,
    common: &Common,
    max_completion_tokens: Option<u32>,
) -> Result<Job, ApiError> {
    let (lora_name, lora_id) = state.pod.resolve_model(common.model.as_deref())?.unzip();
    if common.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_request("kvgate-sim supports only n = 1"));
    }
    let max_tokens = max_completion_tokens.or(common.max_tokens).unwrap_or(state.pod.default_max_tokens);
    let params = common.kv_transfer_params.clone();
    let flag = |name: &str| params.as_ref().and_then(|p| p.get(name)).and_then(Value::as_bool).unwrap_or(false);
    let kv_transfer = match (flag("do_remote_decode"), flag("do_remote_prefill")) {
        (true, true) => return Err(ApiError::bad_request("do_remote_decode and do_remote_prefill are exclusive")),
        (true, false) if state.pod.role == Role::Decode => {
            return Err(ApiError::bad_request(format!(
                "{} is a decode pod: it does not serve prefill legs (do_remote_decode)",
                state.pod.pod_id
            )));
        }
        (false, true) if state.pod.role == Role::Prefill => {
            return Err(ApiError::bad_request(format!(
                "{} is a prefill pod: it does not serve decode legs (do_remote_prefill)",
                state.pod.pod_id
            )));
        }
        (true, false) => KvTransfer::RemoteDecode,
        (false, true) => {
            check_remote_prefill(params.as_ref().expect("flag implies params"), &prompts, state.pod.block_size)?;
            KvTransfer::RemotePrefill
        }
        (false, false) => KvTransfer::Local,
    };
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .unwrap_or_else(|| format!("{}-{}", state.pod.pod_id, state.next_id.fetch_add(1, Ordering::Relaxed)));
    Ok(Job {
        endpoint,
        request_id,
        prompts,
        max_tokens,
        stream: common.stream,
        include_usage: common.stream_options.as_ref().is_some_and(|o| o.include_usage),
        keys: HashKeys { lora_name, lora_id, cache_salt: common.cache_salt.clone() },
        kv_transfer,
        kv_transfer_params: params,
        prefiller: headers.get("x-prefiller-host-port").and_then(|v| v.to_str().ok()).map(str::to_owned),
    })
}

/// A decode leg must carry what a prefill pod answered: its engine, host, port and the
/// blocks holding this very prompt.
fn check_remote_prefill(params: &Map<String, Value>, prompts: &[Vec<u32>], block_size: usize) -> Result<(), ApiError> {
    let missing: Vec<&str> = ["remote_engine_id", "remote_block_ids", "remote_host", "remote_port"]
        .into_iter()
        .filter(|k| params.get(*k).is_none_or(Value::is_null))
        .collect();
    if !missing.is_empty() {
        return Err(ApiError::bad_request(format!(
            "do_remote_prefill needs the prefill pod's kv_transfer_params; missing {}",
            missing.join(", ")
        )));
    }
    let [prompt] = prompts else {
        return Err(ApiError::bad_request("do_remote_prefill takes exactly one prompt"));
    };
    let blocks = params["remote_block_ids"].as_array().map(Vec::len);
    let expected = prompt.len().div_ceil(block_size);
    if blocks != Some(expected) {
        return Err(ApiError::bad_request(format!(
            "remote_block_ids must list the {expected} blocks of this {}-token prompt (got {})",
            prompt.len(),
            blocks.map_or("no list".to_string(), |n| n.to_string())
        )));
    }
    Ok(())
}

/// Per-prompt progress while a job runs.
#[derive(Default, Clone)]
struct ChoiceState {
    text: String,
    usage: Usage,
    finish_reason: Option<&'static str>,
    kv_blocks: Option<Vec<u32>>,
    first_token: Option<Instant>,
}

async fn run_job(state: Arc<AppState>, job: Job) -> Response {
    let started = Instant::now();
    let mut receivers = Vec::with_capacity(job.prompts.len());
    for prompt in &job.prompts {
        let request = NewRequest {
            prompt: prompt.clone(),
            max_tokens: job.max_tokens as usize,
            keys: job.keys.clone(),
            kv_transfer: job.kv_transfer.clone(),
        };
        match state.engine.submit(request).await {
            Ok(Ok(rx)) => receivers.push(rx),
            Ok(Err(e)) => return ApiError::bad_request(e.to_string()).into_response(),
            Err(e) => return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
        }
    }
    let created = unix_now() as u64;
    let merged = futures::stream::select_all(
        receivers.into_iter().enumerate().map(|(i, rx)| UnboundedReceiverStream::new(rx).map(move |e| (i, e))),
    );
    let job = Arc::new(job);
    if job.stream && job.endpoint == "messages" {
        Sse::new(framed_events(state, job, merged, started, messages::frame)).into_response()
    } else if job.stream && job.endpoint == "responses" {
        let mut sequence = 0;
        let frame = move |state: &AppState, job: &Job, choice: &ChoiceState, frame: Frame| {
            responses::frame(state, job, choice, frame, &mut sequence)
        };
        Sse::new(framed_events(state, job, merged, started, frame)).into_response()
    } else if job.stream {
        let events = sse_events(state, job, merged, created, started);
        Sse::new(events).into_response()
    } else {
        let mut choices = vec![ChoiceState::default(); job.prompts.len()];
        let mut merged = std::pin::pin!(merged);
        while let Some((i, emission)) = merged.next().await {
            let piece = state.filler_text.get(&emission.token).map_or("", String::as_str);
            apply(&mut choices[i], piece, emission);
        }
        if choices.iter().any(|c| c.finish_reason.is_none()) {
            return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine stopped").into_response();
        }
        record(&state, &job, &choices, started);
        let body = match job.endpoint {
            "messages" => messages::body(&state, &job, &choices[0]),
            "responses" => responses::body(&state, &job, &choices[0]),
            _ => final_body(&state, &job, &choices, created),
        };
        Json(body).into_response()
    }
}

fn apply(choice: &mut ChoiceState, piece: &str, emission: Emission) {
    choice.first_token.get_or_insert_with(Instant::now);
    choice.text.push_str(piece);
    if let Some(finished) = emission.finished {
        choice.finish_reason = Some(finished.reason.as_str());
        choice.usage = finished.usage;
        choice.kv_blocks = finished.kv_blocks;
    }
}

fn sse_events(
    state: Arc<AppState>,
    job: Arc<Job>,
    merged: impl Stream<Item = (usize, Emission)> + Send + 'static,
    created: u64,
    started: Instant,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    let chat = job.endpoint == "chat.completions";
    let mut choices = vec![ChoiceState::default(); job.prompts.len()];
    let head = chat.then(|| {
        // vLLM's first chat chunk announces the role with empty content.
        let delta = json!({"role": "assistant", "content": ""});
        chunk(&state, &job, created, json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": null}]))
    });
    let body = merged.map(move |(i, emission)| {
        let piece = state.filler_text.get(&emission.token).cloned().unwrap_or_default();
        apply(&mut choices[i], &piece, emission);
        let done = choices.iter().all(|c| c.finish_reason.is_some());
        let reason = choices[i].finish_reason;
        let choice = if chat {
            let delta = if piece.is_empty() { json!({}) } else { json!({"content": piece}) };
            json!({"index": i, "delta": delta, "logprobs": null, "finish_reason": reason, "stop_reason": null})
        } else {
            json!({"index": i, "text": piece, "logprobs": null, "finish_reason": reason, "stop_reason": null})
        };
        let mut events = vec![chunk(&state, &job, created, json!([choice]))];
        if done {
            record(&state, &job, &choices, started);
            if job.include_usage {
                let mut usage_chunk = chunk_body(&state, &job, created, json!([]));
                usage_chunk["usage"] = usage_json(&choices);
                events.push(Event::default().data(usage_chunk.to_string()));
            }
            events.push(Event::default().data("[DONE]"));
        }
        futures::stream::iter(events.into_iter().map(Ok))
    });
    futures::stream::iter(head.into_iter().map(Ok)).chain(body.flatten())
}

/// A point of a one-prompt answer that a framed stream (Messages, Responses) marks.
enum Frame<'a> {
    /// The first token came: the stream opens.
    Start,
    /// A piece of text.
    Delta(&'a str),
    /// The last token came.
    End,
}

/// A one-prompt answer streamed as events of a framing API, `frame` choosing the events at each
/// point. The stream opens with the first token (as vLLM's answers do).
fn framed_events(
    state: Arc<AppState>,
    job: Arc<Job>,
    emissions: impl Stream<Item = (usize, Emission)> + Send + 'static,
    started: Instant,
    mut frame: impl FnMut(&AppState, &Job, &ChoiceState, Frame) -> Vec<Event> + Send + 'static,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    let mut choice = ChoiceState::default();
    emissions
        .map(move |(_, emission)| {
            let piece = state.filler_text.get(&emission.token).cloned().unwrap_or_default();
            let first = choice.first_token.is_none();
            apply(&mut choice, &piece, emission);
            let mut events = Vec::new();
            if first {
                events.extend(frame(&state, &job, &choice, Frame::Start));
            }
            if !piece.is_empty() {
                events.extend(frame(&state, &job, &choice, Frame::Delta(&piece)));
            }
            if choice.finish_reason.is_some() {
                record(&state, &job, std::slice::from_ref(&choice), started);
                events.extend(frame(&state, &job, &choice, Frame::End));
            }
            futures::stream::iter(events.into_iter().map(Ok))
        })
        .flatten()
}

/// An SSE event with its name (`event:`) and JSON data.
fn named_event(name: &str, data: Value) -> Event {
    Event::default().event(name).data(data.to_string())
}

fn object_kind(job: &Job, streaming: bool) -> &'static str {
    match (job.endpoint, streaming) {
        ("chat.completions", true) => "chat.completion.chunk",
        ("chat.completions", false) => "chat.completion",
        _ => "text_completion",
    }
}

fn response_id(job: &Job) -> String {
    let prefix = if job.endpoint == "chat.completions" { "chatcmpl" } else { "cmpl" };
    format!("{prefix}-{}", job.request_id)
}

fn chunk_body(state: &AppState, job: &Job, created: u64, choices: Value) -> Value {
    json!({"id": response_id(job), "object": object_kind(job, true), "created": created, "model": state.pod.model, "choices": choices})
}

fn chunk(state: &AppState, job: &Job, created: u64, choices: Value) -> Event {
    Event::default().data(chunk_body(state, job, created, choices).to_string())
}

fn usage_json(choices: &[ChoiceState]) -> Value {
    let (prompt, completion, cached) = choices.iter().fold((0, 0, 0), |(p, c, k), s| {
        (p + s.usage.prompt_tokens, c + s.usage.completion_tokens, k + s.usage.cached_tokens)
    });
    json!({
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

fn final_body(state: &AppState, job: &Job, choices: &[ChoiceState], created: u64) -> Value {
    let chat = job.endpoint == "chat.completions";
    let items: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            if chat {
                json!({"index": i, "message": {"role": "assistant", "content": c.text, "tool_calls": []},
                       "logprobs": null, "finish_reason": c.finish_reason, "stop_reason": null})
            } else {
                json!({"index": i, "text": c.text, "logprobs": null, "finish_reason": c.finish_reason,
                       "stop_reason": null, "prompt_logprobs": null})
            }
        })
        .collect();
    let kv_transfer_params = match (&job.kv_transfer, choices.first().and_then(|c| c.kv_blocks.as_ref())) {
        (KvTransfer::RemoteDecode, Some(blocks)) => json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_block_ids": blocks,
            "remote_engine_id": state.pod.engine_id,
            "remote_host": state.pod.listen.ip().to_string(),
            "remote_port": state.pod.listen.port(),
            "tp_size": 1,
        }),
        _ => Value::Null,
    };
    json!({
        "id": response_id(job),
        "object": object_kind(job, false),
        "created": created,
        "model": state.pod.model,
        "choices": items,
        "usage": usage_json(choices),
        "kv_transfer_params": kv_transfer_params,
    })
}

fn record(state: &AppState, job: &Job, choices: &[ChoiceState], started: Instant) {
    let first = choices.iter().filter_map(|c| c.first_token).min();
    let ms = |t: Instant| t.duration_since(started).as_secs_f64() * 1000.0;
    let entry = RequestRecord {
        request_id: job.request_id.clone(),
        endpoint: job.endpoint,
        stream: job.stream,
        prompt_tokens: choices.iter().map(|c| c.usage.prompt_tokens).sum(),
        cached_tokens: choices.iter().map(|c| c.usage.cached_tokens).sum(),
        completion_tokens: choices.iter().map(|c| c.usage.completion_tokens).sum(),
        max_tokens: job.max_tokens,
        kv_transfer: match job.kv_transfer {
            KvTransfer::Local => "local",
            KvTransfer::RemoteDecode => "remote_decode",
            KvTransfer::RemotePrefill => "remote_prefill",
        },
        kv_transfer_params: job.kv_transfer_params.clone(),
        prefiller: job.prefiller.clone(),
        ttft_ms: first.map(ms).unwrap_or_default(),
        total_ms: ms(Instant::now()),
    };
    let mut log = state.log.lock().expect("request log lock");
    if log.len() == REQUEST_LOG {
        log.pop_front();
    }
    log.push_back(entry);
}

async fn request_log(State(state): State<Arc<AppState>>) -> Json<Vec<RequestRecord>> {
    Json(state.log.lock().expect("request log lock").iter().cloned().collect())
}

#[derive(serde::Deserialize)]
struct GarbageRequest {
    messages: usize,
}

/// A fault drill: malformed messages on the KV-event socket, between real batches.
async fn kv_garbage(State(state): State<Arc<AppState>>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let req: GarbageRequest = parse_body(&body)?;
    let sender = state
        .kv_garbage
        .as_ref()
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, "this pod publishes no KV events"))?;
    sender
        .send(req.messages)
        .map_err(|_| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the event publisher has stopped"))?;
    Ok(Json(serde_json::json!({"messages": req.messages})))
}

async fn tokenize(State(state): State<Arc<AppState>>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let req: TokenizeRequest = parse_body(&body)?;
    state.pod.resolve_model(req.model.as_deref())?;
    let tokens = match (req.prompt, req.messages) {
        (Some(prompt), None) => encode(&state.tokenizer, &prompt, req.add_special_tokens.unwrap_or(true))?,
        (None, Some(messages)) => {
            let options = ChatOptions {
                add_generation_prompt: req.add_generation_prompt,
                continue_final_message: req.continue_final_message,
                tools: req.tools,
                template_kwargs: req.chat_template_kwargs,
                reasoning_effort: req.reasoning_effort,
            };
            let text =
                state.tokenizer.render_chat(&messages, &options).map_err(|e| ApiError::bad_request(e.to_string()))?;
            encode(&state.tokenizer, &text, req.add_special_tokens.unwrap_or(false))?
        }
        _ => return Err(ApiError::bad_request("give exactly one of 'prompt' or 'messages'")),
    };
    let token_strs =
        req.return_token_strs.then(|| tokens.iter().map(|&t| state.tokenizer.id_to_token(t)).collect::<Vec<_>>());
    Ok(Json(json!({
        "count": tokens.len(),
        "max_model_len": state.pod.max_model_len,
        "tokens": tokens,
        "token_strs": token_strs,
    })))
}

async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    let pod = &state.pod;
    let created = unix_now() as u64;
    let entry = |id: &str, parent: Option<&str>| {
        json!({"id": id, "object": "model", "created": created, "owned_by": "vllm", "root": id,
               "parent": parent, "max_model_len": pod.max_model_len, "permission": []})
    };
    let mut data = vec![entry(&pod.model, None)];
    data.extend(pod.lora_modules.iter().map(|l| entry(l, Some(&pod.model))));
    Json(json!({"object": "list", "data": data}))
}

async fn reset_prefix_cache(State(state): State<Arc<AppState>>) -> Result<StatusCode, ApiError> {
    match state.engine.reset_prefix_cache().await {
        Ok(Ok(())) => Ok(StatusCode::OK),
        Ok(Err(held)) => Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("cannot reset the prefix cache: {held} blocks are held by running requests"),
        )),
        Err(e) => Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())),
    }
}

/// vLLM's Prometheus names and labels, plus a few `kvgate_sim:` extras.
async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    use std::fmt::Write;
    let s = state.engine.snapshot();
    let c = s.counters;
    let pod = &state.pod;
    let labels = format!("engine=\"0\",model_name=\"{}\"", pod.model);
    let mut out = String::with_capacity(4096);
    let mut metric = |name: &str, kind: &str, help: &str, extra: &str, value: f64| {
        let sep = if extra.is_empty() { "" } else { "," };
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}{sep}{extra}}} {value:?}");
    };
    metric(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        "",
        s.running as f64,
    );
    metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", "", s.waiting as f64);
    metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", "", s.kv_cache_usage);
    let info = format!(
        "block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"sha256\"",
        pod.block_size, pod.num_blocks
    );
    metric("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", &info, 1.0);
    let counter = |name: &str, help: &str, value: u64| (name.to_string(), help.to_string(), value);
    let counters = [
        counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            c.prefix_cache_queries,
        ),
        counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            c.prefix_cache_hits,
        ),
        counter("vllm:prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens),
        counter("vllm:generation_tokens", "Number of generation tokens processed.", c.generation_tokens),
        counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", c.preemptions),
        counter(
            "kvgate_sim:prefill_tokens_computed",
            "Prompt tokens this engine computed (not cached, not transferred).",
            c.prefill_tokens_computed,
        ),
        counter(
            "kvgate_sim:kv_transferred_tokens",
            "Prompt tokens whose KV was pulled from a prefill pod.",
            c.transferred_tokens,
        ),
        counter("kvgate_sim:engine_steps", "Engine steps run.", c.steps),
        counter(
            "kvgate_sim:http_errors",
            "HTTP responses with a 4xx or 5xx status.",
            state.http_errors.load(Ordering::Relaxed),
        ),
        counter(
            "kvgate_sim:kv_event_batches",
            "KV event batches published.",
            state.publisher.as_ref().map_or(0, |p| p.batches.load(Ordering::Relaxed)),
        ),
        counter(
            "kvgate_sim:kv_replay_requests",
            "Replay requests served.",
            state.publisher.as_ref().map_or(0, |p| p.replay_requests.load(Ordering::Relaxed)),
        ),
        counter(
            "kvgate_sim:kv_event_garbage",
            "Malformed messages put on the event socket on request (a fault drill).",
            state.publisher.as_ref().map_or(0, |p| p.garbage.load(Ordering::Relaxed)),
        ),
    ];
    for (name, help, value) in counters {
        metric(&format!("{name}_total"), "counter", &help, "", value as f64);
    }
    metric(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        "finished_reason=\"length\"",
        c.finished_requests as f64,
    );
    metric(
        "kvgate_sim:cached_blocks",
        "gauge",
        "Distinct block hashes in the prefix cache.",
        "",
        s.cached_blocks as f64,
    );
    let role = format!(
        "role=\"{}\",pod=\"{}\"",
        serde_json::to_value(pod.role).unwrap_or_default().as_str().unwrap_or(""),
        pod.pod_id
    );
    metric("kvgate_sim:pod_info", "gauge", "Simulated pod identity.", &role, 1.0);
    // Unlabelled, as the Prometheus client's process collector writes it.
    let _ = writeln!(
        out,
        "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {:?}",
        pod.started_at
    );
    if !pod.lora_modules.is_empty() {
        // As vLLM's logger writes it (no engine or model label, valued at the time it was
        // set); without a limit the simulator holds every adapter at once.
        let (running, waiting) = &s.adapters;
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let _ = writeln!(
            out,
            "# HELP vllm:lora_requests_info Running stats on lora requests.\n# TYPE vllm:lora_requests_info gauge\n\
             vllm:lora_requests_info{{max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} {now:?}",
            if pod.max_loras > 0 { pod.max_loras } else { pod.lora_modules.len() },
            running.join(","),
            waiting.join(",")
        );
    }
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], out)
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or_default()
}
