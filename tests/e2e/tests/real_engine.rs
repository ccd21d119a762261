//! The real-engine leg: two real vLLM engines (vLLM 0.32 built for CPU, a tiny Qwen3 with
//! random weights and a LoRA adapter, all from `make setup`) behind a real Envoy and kvgate,
//! on each way in — the wasm filter, the native module, the Endpoint Picker. First, on the
//! engine with a small cache: the simulator beside it agrees request by request, and a running
//! adapter keeps its one slot from another adapter that waited longer than the running one's
//! next request (the order kvgate predicts slots in).
//!
//! Every request's answer says how many prompt tokens its engine served from its prefix cache
//! (`usage`, with `--enable-prompt-tokens-details`); the proxy reports it with the request's
//! end and the scorer holds it against what it credited the pod that served
//! (`kvgate_prefix_predictions_total{outcome}`). The leg sends its requests one at a time
//! wherever it checks them one by one, so that each request's outcome is its own: `exact`, on
//! every request of every API, through conversations, a LoRA adapter the scorer learns from
//! the engines, block-aligned prompts, retries and regenerations, evictions, a scorer restart
//! (the index rebuilt from the engines' replay buffers) and an engine restart. Then, under
//! load (clients at once), every request `exact` or `evicted` (the engine evicted a credited
//! block while it waited), none failing open and no engine marked down; an engine's own
//! refusals (404, 400) counted as error statuses; an engine stopped as a rolling update stops
//! it finishing its streams. Then two models behind one gateway: the Qwen3 engine and one
//! serving a tiny Llama, each model's requests tokenized by its own tokenizer and credited
//! exactly, a rewritten name reaching the Llama. Last, prefill/decode: a prefill and a decode
//! engine with vLLM's NIXL connector, the KV moved between them.
//!
//! No block size and no adapter is configured: the scorer learns both from the engines.
//!
//! Envoy and the scorer trace every request to a test OTLP receiver: each request judged
//! `exact` has its trace, kvgate's decision under the gateway's span, crediting the cached
//! tokens its engine then reported in the response's span.

use kvgate_e2e::collector::{Collector, ReceivedSpan};
use kvgate_e2e::path::Path;
use kvgate_e2e::sim_check::{BATCH_PREFIX_TOKENS, compare, send_shared_batch, simulator_beside, table, trace};
use kvgate_e2e::{Measured, name_the_upstream, send};
use kvgate_test_harness::{
    ENGINE_ADAPTER, ENGINE_BLOCK_SIZE, ENGINE_LLAMA_MODEL, ENGINE_MODEL, ENGINE_SECOND_ADAPTER, Engine, EngineOptions,
    EnvoyProcess, ScorerProcess, TinyModel, llama3_tokenizer, qwen3_tokenizer,
};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The scorer's counts of finished requests by how its credit compared with the engine's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Predictions {
    exact: u64,
    /// Credited more than served, the engine having evicted a credited block meanwhile.
    evicted: u64,
    over: u64,
    under: u64,
}

impl Predictions {
    fn total(&self) -> u64 {
        self.exact + self.evicted + self.over + self.under
    }

    fn since(&self, before: &Predictions) -> Predictions {
        Predictions {
            exact: self.exact - before.exact,
            evicted: self.evicted - before.evicted,
            over: self.over - before.over,
            under: self.under - before.under,
        }
    }
}

/// One way in, in front of the engines.
struct Stack {
    path: Path,
    scorer: ScorerProcess,
    envoy: EnvoyProcess,
    collector: Collector,
    client: reqwest::Client,
    /// Engine names by the address Envoy reaches them at.
    names: HashMap<String, String>,
    /// Follow-up turns sent.
    follow_ups: u32,
    /// Those not served where their conversation's previous turn was: where from, where to,
    /// what was cached there.
    moved: Vec<String>,
    checked: u64,
}

impl Stack {
    async fn start(path: Path, engines: &[Engine]) -> Stack {
        let pods: Vec<_> = engines.iter().map(|e| (e, "both")).collect();
        Stack::start_with(path, &pods, "").await
    }

    /// A stack in front of `pods` (an engine and its role), `config` added to the scorer's.
    async fn start_with(path: Path, pods: &[(&Engine, &str)], config: &str) -> Stack {
        let collector = Collector::start().await;
        let mut config = format!(
            "tokenizer: {}\nhealth: {{scrape_interval_ms: 200}}\ntraces: {{otlp_endpoint: '{}'}}\n{}{config}pods:\n",
            qwen3_tokenizer().display(),
            collector.endpoint,
            path.scorer_config(&[])
        );
        for (e, role) in pods {
            config.push_str(&format!(
                "  - {{name: {}, role: {role}, address: '127.0.0.1:{}', kv_events: '{}', kv_events_replay: '{}', metrics: '{}/metrics'}}\n",
                e.name, e.port, e.events, e.replay, e.url
            ));
        }
        let scorer = ScorerProcess::start(&config).await;
        scorer.wait_ready(Duration::from_secs(30)).await;
        let envoy = EnvoyProcess::start_patched(&scorer.config_path, &path.envoy_flags(&[]), name_the_upstream).await;
        let names = pods.iter().map(|(e, _)| (format!("127.0.0.1:{}", e.port), e.name.clone())).collect();
        let client = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
        Stack { path, scorer, envoy, collector, client, names, follow_ups: 0, moved: Vec::new(), checked: 0 }
    }

    /// Every request judged `exact` so far has its trace: kvgate's decision under the
    /// gateway's span, crediting the cached tokens its engine reported (the response's span).
    async fn traces_agree(&self) {
        let done = |s: &&ReceivedSpan| s.name == "kvgate.response" && s.attribute("kvgate.outcome") == "done";
        let whole = |spans: &[ReceivedSpan]| {
            let responses = spans.iter().filter(done).count() as u64;
            let joined = (spans.iter().filter(|s| s.name == "kvgate.pick"))
                .all(|p| spans.iter().any(|s| s.span_id == p.parent_span_id && s.service == "kvgate-gateway"));
            responses >= self.checked && joined
        };
        let spans = self.collector.wait(Duration::from_secs(20), whole).await;
        assert!(
            whole(&spans),
            "{:?}: {} traced responses for {} requests, or an unjoined decision",
            self.path,
            spans.iter().filter(done).count(),
            self.checked
        );
        for response in spans.iter().filter(done) {
            let pick = (spans.iter())
                .find(|s| s.name == "kvgate.pick" && s.trace_id == response.trace_id)
                .unwrap_or_else(|| panic!("{:?}: no decision in the trace of {response:?}", self.path));
            assert_eq!(
                pick.attribute("kvgate.cached_tokens"),
                response.attribute("kvgate.engine_cached_tokens"),
                "{:?}: the decision's credit against what its engine reused: {pick:?} {response:?}",
                self.path
            );
        }
    }

    async fn predictions(&self) -> Predictions {
        let text = self.scorer.metrics_text().await;
        let count = |outcome: &str| -> u64 {
            let label = format!("outcome=\"{outcome}\"");
            text.lines()
                .filter(|l| l.starts_with("kvgate_prefix_predictions_total{") && l.contains(&label))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>() as u64
        };
        Predictions { exact: count("exact"), evicted: count("evicted"), over: count("over"), under: count("under") }
    }

    /// Sends one request and waits for the scorer's verdict on it; panics unless the engine
    /// served exactly the cached tokens kvgate credited. Returns the answer and the engine.
    async fn exact(&mut self, what: &str, api: &str, body: &Value) -> (Measured, String) {
        let before = self.predictions().await;
        let answer = send(&self.client, &format!("{}{api}", self.envoy.url), body).await;
        assert_eq!(answer.status, 200, "{:?} {what}: {api} answered {:?}", self.path, answer.error);
        let upstream = answer.pod.clone().unwrap_or_else(|| panic!("{what}: no x-kvgate-upstream"));
        let engine = self.names.get(&upstream).cloned().unwrap_or_else(|| panic!("{what}: upstream {upstream}"));
        let deadline = Instant::now() + Duration::from_secs(5);
        let verdict = loop {
            let now = self.predictions().await.since(&before);
            if now.total() > 0 {
                break now;
            }
            assert!(Instant::now() < deadline, "{:?} {what}: the scorer never compared its credit", self.path);
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert_eq!(
            verdict,
            Predictions { exact: 1, ..Predictions::default() },
            "{:?} {what} ({api} on {engine}): the engine served {} cached tokens of {}; kvgate credited otherwise",
            self.path,
            answer.cached_tokens,
            answer.prompt_tokens
        );
        self.checked += 1;
        (answer, engine)
    }

    /// A turn of a conversation whose previous turn `last` served: counted as a follow-up.
    async fn turn(&mut self, what: &str, api: &str, body: &Value, last: Option<&str>) -> (Measured, String) {
        let (answer, engine) = self.exact(what, api, body).await;
        if let Some(last) = last {
            self.follow_ups += 1;
            if last != engine {
                let pods = self.pods_known().await;
                self.moved.push(format!(
                    "{what}: {last} -> {engine}, {} of {} prompt tokens cached there; {pods}",
                    answer.cached_tokens, answer.prompt_tokens
                ));
            }
        }
        (answer, engine)
    }

    /// What the scorer knows of the pods now, to tell a move by design from a loss.
    async fn pods_known(&self) -> String {
        let pods: Vec<String> = (self.scorer.pods().await.iter())
            .map(|p| {
                format!(
                    "{} healthy {} blocks {} slowness {:.2} in flight {}",
                    p["name"],
                    p["healthy"],
                    p["cached_blocks"],
                    p["slowness"].as_f64().unwrap_or(f64::NAN),
                    p["inflight_requests"]
                )
            })
            .collect();
        format!("the scorer's pods: {pods:?}")
    }

    async fn scorer_counter(&self, name: &str) -> u64 {
        self.scorer.metric(name).await as u64
    }
}

/// A distinctive text of `words` words.
fn words(seed: &str, words: usize) -> String {
    (0..words).map(|i| format!("{seed}{}", i % 89)).collect::<Vec<_>>().join(" ")
}

/// A conversation on one API: its history as that API writes it.
struct Conversation {
    api: &'static str,
    model: &'static str,
    system: String,
    /// (user, assistant) turns so far.
    turns: Vec<(String, String)>,
    engine: Option<String>,
}

impl Conversation {
    fn new(api: &'static str, model: &'static str, system: String) -> Self {
        Conversation { api, model, system, turns: Vec::new(), engine: None }
    }

    /// The next request, asking `question`; streamed or not.
    fn request(&self, question: &str, stream: bool) -> Value {
        let history = self.turns.iter().flat_map(|(u, a)| [("user", u.as_str()), ("assistant", a.as_str())]);
        match self.api {
            "/v1/chat/completions" => {
                let mut messages = vec![json!({"role": "system", "content": self.system})];
                messages.extend(history.map(|(role, text)| json!({"role": role, "content": text})));
                messages.push(json!({"role": "user", "content": question}));
                with_usage(json!({"model": self.model, "max_tokens": 12, "messages": messages}), stream)
            }
            "/v1/completions" => {
                let mut prompt = self.system.clone();
                for (role, text) in history {
                    prompt.push_str(&format!("\n{role}: {text}"));
                }
                prompt.push_str(&format!("\nuser: {question}\nassistant:"));
                with_usage(json!({"model": self.model, "max_tokens": 12, "prompt": prompt}), stream)
            }
            "/v1/messages" => {
                let mut messages: Vec<Value> =
                    history.map(|(role, text)| json!({"role": role, "content": text})).collect();
                messages.push(json!({"role": "user", "content": [{"type": "text", "text": question}]}));
                json!({"model": self.model, "max_tokens": 12, "system": self.system, "messages": messages, "stream": stream})
            }
            "/v1/responses" => {
                let mut input: Vec<Value> =
                    history.map(|(role, text)| json!({"role": role, "content": text})).collect();
                input.push(json!({"role": "user", "content": [{"type": "input_text", "text": question}]}));
                json!({"model": self.model, "max_output_tokens": 12, "instructions": self.system, "input": input,
                       "stream": stream})
            }
            other => panic!("no such API {other}"),
        }
    }

    /// Sends turn `n` and keeps the answer in the history.
    async fn next(&mut self, s: &mut Stack, what: &str, n: usize) {
        let question = words(&format!("q{n}{what}"), 24);
        let body = self.request(&question, n % 2 == 1);
        let (answer, engine) = s.turn(&format!("{what} turn {n}"), self.api, &body, self.engine.as_deref()).await;
        self.turns.push((question, answer.text));
        self.engine = Some(engine);
    }
}

/// An OpenAI request streamed or not; streamed, it asks for its usage (vLLM refuses
/// `stream_options` without `stream`).
fn with_usage(mut body: Value, stream: bool) -> Value {
    body["stream"] = json!(stream);
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

/// Completions with a prompt of exactly `tokens` token ids (block-aligned when a multiple of
/// the block size).
fn token_prompt(seed: u32, tokens: u32) -> Value {
    let ids: Vec<u32> = (0..tokens).map(|i| 1000 + (seed * 7919 + i * 13) % 50_000).collect();
    json!({"model": ENGINE_MODEL, "max_tokens": 2, "prompt": ids})
}

async fn wait_healthy(s: &Stack, engine: &str, healthy: bool) {
    s.scorer.wait_pod(engine, Duration::from_secs(120), |p| p["healthy"] == healthy).await;
}

/// A Qwen3 and a Llama engine behind one gateway, each model tokenized by its own tokenizer:
/// every turn of each model's conversations lands on its engine and is credited exactly the
/// cached tokens that engine reports (in its own tokens); a name a rule rewrites reaches the
/// Llama engine under the Llama's name; a model no engine serves is answered 404.
async fn two_models_leg(path: Path, qwen: &Engine, llama: &Engine) {
    let config = format!(
        "models: [{{name: {ENGINE_LLAMA_MODEL}, tokenizer: '{}'}}]\n\
         model_rewrites: [{{matches: [llama], targets: [{{model: {ENGINE_LLAMA_MODEL}}}]}}]\n",
        llama3_tokenizer().display()
    );
    let mut s = Stack::start_with(path, &[(qwen, "both"), (llama, "both")], &config).await;
    for e in [qwen, llama] {
        s.scorer.wait_pod(&e.name, Duration::from_secs(10), |p| !p["models"].is_null()).await;
    }
    let engine_of = |model: &str| if model == ENGINE_MODEL { &qwen.name } else { &llama.name };
    for (c, (api, model)) in [
        ("/v1/chat/completions", ENGINE_MODEL),
        ("/v1/chat/completions", ENGINE_LLAMA_MODEL),
        ("/v1/completions", ENGINE_LLAMA_MODEL),
        ("/v1/chat/completions", "llama"),
    ]
    .into_iter()
    .enumerate()
    {
        let mut conversation = Conversation::new(api, model, words(&format!("two models {c} {path:?}"), 120));
        for n in 0..3 {
            conversation.next(&mut s, &format!("{model} conversation {c}"), n).await;
            let served = conversation.engine.as_deref().unwrap();
            let serving = engine_of(if model == "llama" { ENGINE_LLAMA_MODEL } else { model });
            assert_eq!(served, serving, "{path:?}: {model} turn {n}");
        }
    }
    let rewritten =
        s.scorer_counter(&format!("kvgate_model_rewrites_total{{from=\"llama\",to=\"{ENGINE_LLAMA_MODEL}\"}}")).await;
    assert_eq!(rewritten, 3, "{path:?}: each turn asking for `llama`");
    let unknown = send(
        &s.client,
        &format!("{}/v1/chat/completions", s.envoy.url),
        &json!({"model": "mistral",
        "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(unknown.status, 404, "{path:?}: {:?}", unknown.error);
    s.traces_agree().await;
    println!("{path:?}: two models, {} requests exact", s.checked);
}

/// How a leg stops the second engine, beyond what every leg checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stop {
    /// SIGKILL while conversations go on, then started again ([`engine_restart`]).
    KillAndRestart,
    /// At the end, SIGTERM (a rolling update's) while streams are in flight on it: it drains
    /// them (`--shutdown-timeout`, [`streams_drained_by_a_stopping_engine`]).
    Terminate,
}

/// Everything the leg checks of one way in, and `stop`.
async fn leg(path: Path, engines: &mut [Engine], stop: Option<Stop>) {
    let mut s = Stack::start(path, engines).await;
    let started = Instant::now();
    println!("{path:?}: scorer ready, rebuilt from the engines' replay buffers");
    // Learned from the engines, configured nowhere.
    for e in engines.iter() {
        let pod = s.scorer.wait_pod(&e.name, Duration::from_secs(10), |p| !p["block_size"].is_null()).await;
        assert_eq!(pod["block_size"], ENGINE_BLOCK_SIZE, "{}", e.name);
    }

    // Conversations on every API, two each, four turns, streamed and not; their system
    // prompts are the same on every way in (the engines may hold them from the last one).
    let mut conversations = Vec::new();
    for api in ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"] {
        for k in 0..2 {
            conversations.push(Conversation::new(api, ENGINE_MODEL, words(&format!("system{k}{}", &api[4..8]), 260)));
        }
    }
    for n in 0..4 {
        for (c, conversation) in conversations.iter_mut().enumerate() {
            conversation.next(&mut s, &format!("{path:?}c{c}"), n).await;
        }
    }
    // The adapter: named by no configuration; the engines' /v1/models say what it is.
    let mut adapted: Vec<Conversation> = (0..2)
        .map(|k| Conversation::new("/v1/chat/completions", ENGINE_ADAPTER, words(&format!("sqlsystem{k}"), 200)))
        .collect();
    for n in 0..3 {
        for (c, conversation) in adapted.iter_mut().enumerate() {
            conversation.next(&mut s, &format!("{path:?}lora{c}"), n).await;
        }
    }
    // Block-aligned prompts (held whole, served one block short), each retried as a client
    // would; a chat answer regenerated (the same request again). A retry may go elsewhere:
    // this fleet is light, where an idle engine is charged no miss (`light_fleet_requests`);
    // the follow-ups that moved are bounded below.
    let mut held = 0;
    for (k, tokens) in [128, 256, 100].into_iter().enumerate() {
        let body = token_prompt(k as u32 + 17 * path as u32, tokens);
        let (_, first) = s.exact(&format!("{tokens} token ids"), "/v1/completions", &body).await;
        let (again, engine) =
            s.turn(&format!("{tokens} token ids again"), "/v1/completions", &body, Some(&first)).await;
        let expected = (tokens - 1) / ENGINE_BLOCK_SIZE as u32 * ENGINE_BLOCK_SIZE as u32;
        if engine != first {
            continue;
        }
        held += 1;
        if again.cached_tokens != u64::from(expected) {
            let pods = s.pods_known().await;
            panic!(
                "{path:?}: {tokens} token ids again on {engine}, {} cached (expected {expected}); {pods}",
                again.cached_tokens
            );
        }
    }
    assert!(held > 0, "{path:?}: no block-aligned prompt was retried where it was held: {:?}", s.moved);
    let regenerated = conversations[0].request("regenerate this", false);
    let (_, first) = s.exact("regeneration", "/v1/chat/completions", &regenerated).await;
    s.turn("regeneration again", "/v1/chat/completions", &regenerated, Some(&first)).await;
    println!("{path:?}: {} requests exact in {:.0?}", s.checked, started.elapsed());
    s.traces_agree().await;

    // Documents past both caches: evictions, each request still exact.
    let documents: Vec<String> = (0..12).map(|d| words(&format!("document{d}x"), 300)).collect();
    for round in 0..2 {
        for (d, document) in documents.iter().enumerate() {
            let body =
                json!({"model": ENGINE_MODEL, "max_tokens": 2, "prompt": format!("{document}\nquestion {round}:")});
            s.exact(&format!("document {d} round {round}"), "/v1/completions", &body).await;
        }
    }
    let removed = samples(&s, "kvgate_kv_events_total", "type=\"block_removed\"").await;
    assert!(removed > 0.0, "{path:?}: the documents evicted blocks");

    // The scorer restarts: it rebuilds both indexes from the engines' replay buffers, the
    // same blocks as before, and the conversations go on where they were.
    let before_restart = s.scorer.pods().await;
    s.scorer.kill();
    s.scorer.restart().await;
    s.scorer.wait_ready(Duration::from_secs(30)).await;
    for pod in &before_restart {
        let name = pod["name"].as_str().expect("pod name");
        s.scorer.wait_pod(name, Duration::from_secs(10), |p| p["cached_blocks"] == pod["cached_blocks"]).await;
    }
    if path != Path::Epp {
        // The proxy's route stream or socket is back (until then requests fail open).
        let deadline = Instant::now() + Duration::from_secs(10);
        while s.scorer_counter("kvgate_route_streams").await == 0 {
            assert!(Instant::now() < deadline, "{path:?}: the proxy never reconnected to the restarted scorer");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    for (c, conversation) in conversations.iter_mut().enumerate().take(4) {
        conversation.next(&mut s, &format!("{path:?}c{c}"), 4).await;
    }

    if stop == Some(Stop::KillAndRestart) {
        engine_restart(&mut s, engines, &mut conversations).await;
    }

    // Load: clients at once, each its own conversation, every request judged after. Past
    // what the caches hold, an engine may evict blocks a request was credited with while it
    // waits its turn behind others: the scorer sees the engine's BlockRemoved for a block of
    // the request's credit and counts it apart (`evicted`). Never a credit the engine did not
    // hold (`over`). Less than it served (`under`) only rarely: these clients send a turn the
    // moment the last one ends, and the engine's events for that turn's last blocks can reach
    // the scorer after the next turn was decided — kvgate credits only what events said, so
    // that request is under-credited, the safe side (seen on the native path, the quickest,
    // in 2 of 5 runs: 2 of 48).
    //
    // The autoscaling signals are read as Prometheus would while the load runs. The predicted
    // wait needs the engines' prefill speed, learned from first tokens of prefills that had
    // an engine to themselves (a restarted scorer learns it anew): one at a time until then.
    let learned = |text: String| text.contains("kvgate_pool_predicted_wait_seconds{at=\"mean\"}");
    for i in 0..40 {
        if learned(s.scorer.metrics_text().await) {
            break;
        }
        let body = json!({"model": ENGINE_MODEL, "max_tokens": 2, "prompt": words(&format!("{path:?}warm{i}"), 120)});
        s.exact(&format!("warm-up {i}"), "/v1/completions", &body).await;
    }
    assert!(learned(s.scorer.metrics_text().await), "{path:?}: the engines' prefill speed was learned");
    let before =
        (s.predictions().await, path.failed_open(&s.envoy).await, s.scorer_counter("kvgate_pods_down_total").await);
    let scrape_failures = s.scorer_counter("kvgate_scrape_failures_total").await;
    let running = std::sync::atomic::AtomicBool::new(true);
    let highest = async {
        let mut highest = (0.0_f64, 0.0_f64);
        while running.load(std::sync::atomic::Ordering::Relaxed) {
            let wait = samples(&s, "kvgate_pool_predicted_wait_seconds", "at=\"mean\"").await;
            let usage = samples(&s, "kvgate_pool_kv_cache_usage", "stat=\"max\"").await;
            highest = (highest.0.max(wait), highest.1.max(usage));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        highest
    };
    let load = async {
        let sent = loaded(&s, 8, 6).await;
        running.store(false, std::sync::atomic::Ordering::Relaxed);
        sent
    };
    let (sent, (wait, usage)) = tokio::join!(load, highest);
    println!(
        "{path:?}: under load, the pool's predicted wait rose to {:.0} ms, its KV-cache usage to {usage:.2}",
        wait * 1e3
    );
    assert!(wait > 0.0, "{path:?}: the predicted wait (from the engines' learned prefill speed) rose under load");
    assert!(usage > 0.0, "{path:?}: the engines' KV-cache usage (vllm:kv_cache_usage_perc) reached the pool gauge");
    assert_eq!(s.scorer_counter("kvgate_pool_healthy_pods").await, 2, "{path:?}");
    let verdicts = settled(&s, &before.0, sent).await;
    let scrape_failures = s.scorer_counter("kvgate_scrape_failures_total").await - scrape_failures;
    println!("{path:?}: under load {verdicts:?}, {scrape_failures} scrapes failed");
    assert_eq!(verdicts.total(), sent, "{path:?}: every request judged");
    assert_eq!(verdicts.over, 0, "{path:?} under load: {verdicts:?}");
    assert!(verdicts.under * 12 <= sent, "{path:?} under load, under-credited beyond the events' lag: {verdicts:?}");
    assert_eq!(path.failed_open(&s.envoy).await, before.1, "{path:?}: no request failed open under load");
    assert_eq!(
        s.scorer_counter("kvgate_pods_down_total").await,
        before.2,
        "{path:?}: no engine marked down under load"
    );

    // A model no engine lists (their /v1/models): kvgate answers 404 naming it, as vLLM words
    // it, and no engine sees the request. The engine's own refusal of a prompt past the
    // model's length (400): counted as an error status, never as a first token.
    let engines_listed = s.scorer.pods().await.iter().all(|p| p["models"].as_array().is_some_and(|m| !m.is_empty()));
    assert!(engines_listed, "{path:?}: the engines' models were read");
    let reports = |event: &'static str| samples(&s, "kvgate_lifecycle_reports_total", event);
    let (errors, first_tokens) = (reports("error_status").await, reports("first_token").await);
    let refused_4xx = samples(&s, "kvgate_error_responses_total", "class=\"4xx\"").await;
    let unknown = json!({"model": "no-such-model", "max_tokens": 2, "prompt": "hello"});
    let answer = send(&s.client, &format!("{}/v1/completions", s.envoy.url), &unknown).await;
    assert_eq!(answer.status, 404, "{path:?}: an unknown model");
    assert!(answer.error.as_deref().is_some_and(|e| e.contains("`no-such-model`")), "{path:?}: {:?}", answer.error);
    let too_long =
        json!({"model": ENGINE_MODEL, "max_tokens": 2, "prompt": (0..5000).map(|i| 1000 + i).collect::<Vec<u32>>()});
    let answer = send(&s.client, &format!("{}/v1/completions", s.envoy.url), &too_long).await;
    assert_eq!(answer.status, 400, "{path:?}: a prompt past the model's length");
    let deadline = Instant::now() + Duration::from_secs(5);
    while reports("error_status").await < errors + 1.0 {
        assert!(Instant::now() < deadline, "{path:?}: the engine's refusal was not reported as an error status");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(samples(&s, "kvgate_error_responses_total", "class=\"4xx\"").await, refused_4xx + 1.0);
    assert_eq!(reports("error_status").await, errors + 1.0, "{path:?}: the unknown model reached no engine");
    assert_eq!(reports("first_token").await, first_tokens, "{path:?}: a refusal is no first token");
    s.scorer.wait_idle(Duration::from_secs(10)).await;

    let follow_ups = s.follow_ups;
    let home = follow_ups - s.moved.len() as u32;
    println!(
        "{path:?}: {} requests exact one by one, {sent} under load; {home} of {follow_ups} follow-ups on their \
         conversation's engine; {:.0?}",
        s.checked,
        started.elapsed()
    );
    assert!(
        f64::from(home) >= 0.95 * f64::from(follow_ups),
        "{path:?}: {home} of {follow_ups} follow-ups stayed; moved: {:?}",
        s.moved
    );
    if stop == Some(Stop::Terminate) {
        streams_drained_by_a_stopping_engine(&s, &engines[1]).await;
        wait_healthy(&s, &engines[1].name, false).await;
    }
    assert_eq!(s.scorer_counter("kvgate_lifecycle_unknown_total").await, 0, "{path:?}: every report named a request");
    // One Envoy worker: one route stream or socket, whatever happened on the way (the wasm
    // filter's VM on Envoy's main thread keeps one too); the picker needs none.
    let route_streams = match path {
        Path::Wasm => 2,
        Path::Native => 1,
        Path::Epp => 0,
    };
    assert_eq!(s.scorer_counter("kvgate_route_streams").await, route_streams, "{path:?}: route streams");
}

/// The sum of the scorer's samples of `name` whose labels include `label`.
async fn samples(s: &Stack, name: &str, label: &str) -> f64 {
    let text = s.scorer.metrics_text().await;
    text.lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with('{')) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The second engine is killed while conversations go on (theirs move to the first), then
/// started again: the scorer indexes the new engine from its events.
async fn engine_restart(s: &mut Stack, engines: &mut [Engine], conversations: &mut [Conversation]) {
    let victim = engines[1].name.clone();
    engines[1].kill();
    wait_healthy(s, &victim, false).await;
    for (c, conversation) in conversations.iter_mut().enumerate().skip(4) {
        let moved = conversation.engine.as_deref() == Some(victim.as_str());
        if moved {
            conversation.engine = None; // not a follow-up where its engine died
        }
        conversation.next(s, &format!("{:?}c{c}", s.path), 5).await;
    }
    engines[1].respawn();
    engines[1].wait_ready().await;
    wait_healthy(s, &victim, true).await;
    // New prompts until one lands on the restarted engine: its (empty) cache exactly known.
    for k in 0..16 {
        let body = json!({"model": ENGINE_MODEL, "max_tokens": 2, "prompt": words(&format!("fresh{k}"), 400)});
        let (_, engine) = s.exact(&format!("after the restart {k}"), "/v1/completions", &body).await;
        if engine == victim {
            let again = s.exact(&format!("after the restart {k} again"), "/v1/completions", &body).await;
            assert_eq!(again.1, victim, "its prefix is known there");
            return;
        }
    }
    panic!("nothing was sent to the restarted engine {victim}");
}

/// Long streams on both engines, then SIGTERM to `engine` (a rolling update's): it drains —
/// every stream ends whole, none cut or left hanging — and their bookings end.
async fn streams_drained_by_a_stopping_engine(s: &Stack, engine: &Engine) {
    let url = format!("{}/v1/completions", s.envoy.url);
    let streams: Vec<_> = (0..4)
        .map(|k| {
            let (client, url) = (s.client.clone(), url.clone());
            let body = json!({"model": ENGINE_MODEL, "prompt": words(&format!("longstream{k}"), 200), "max_tokens": 300,
                              "ignore_eos": true, "stream": true});
            tokio::spawn(async move {
                let started = Instant::now();
                let answer = client.post(url).json(&body).send().await;
                let whole = match answer {
                    Ok(r) => r.text().await.is_ok_and(|t| t.trim_end().ends_with("data: [DONE]")),
                    Err(_) => false,
                };
                (whole, started.elapsed())
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    engine.terminate();
    for stream in streams {
        let (whole, took) = stream.await.expect("stream task");
        assert!(whole, "{:?}: a stream was cut by its engine's SIGTERM (after {took:?})", s.path);
    }
    println!("{:?}: SIGTERM to {} with 4 streams in flight: all ended whole", s.path, engine.name);
    s.scorer.wait_idle(Duration::from_secs(10)).await;
}

/// Prefill/decode on real engines, through the wasm filter (it sends the prefill leg itself
/// and hands the prefill engine's `kv_transfer_params` to the decode engine, whose NIXL
/// connector pulls the KV): long prompts take the P/D path and their KV moves; the decode
/// engine then holds the prompt, and the conversation's next turn goes to it directly, its
/// cached tokens as predicted.
async fn pd_leg(prefill: &Engine, decode: &Engine) {
    let path = Path::Wasm;
    let mut s =
        Stack::start_with(path, &[(prefill, "prefill"), (decode, "decode")], "pd: {threshold_tokens: 256}\n").await;
    let transfers = decode.metric("vllm:nixl_xfer_time_seconds_count").await;
    let prefilled = prefill.metric("vllm:prompt_tokens_total").await;
    let url = format!("{}/v1/completions", s.envoy.url);
    let n = 4;
    for k in 0..n {
        let prompt = words(&format!("handover{k}"), 400);
        let body = match k % 2 {
            0 => json!({"model": ENGINE_MODEL, "prompt": prompt, "max_tokens": 8}),
            _ => json!({"model": ENGINE_MODEL, "prompt": prompt, "max_tokens": 8, "stream": true,
                        "stream_options": {"include_usage": true}}),
        };
        let answer = send(&s.client, &url, &body).await;
        assert_eq!(answer.status, 200, "P/D {k}: {:?}", answer.error);
        assert_eq!(answer.pod.as_deref().and_then(|p| s.names.get(p)), Some(&decode.name), "P/D {k}: decoded there");
        let next = json!({"model": ENGINE_MODEL, "prompt": format!("{prompt} and then"), "max_tokens": 2});
        let (answer, engine) = s.exact(&format!("P/D {k}, next turn"), "/v1/completions", &next).await;
        assert_eq!(engine, decode.name, "P/D {k}: the next turn went where the KV was moved");
        assert!(answer.cached_tokens > 0, "P/D {k}: the decode engine holds the moved prompt");
    }
    s.scorer.wait_idle(Duration::from_secs(10)).await;
    assert_eq!(decode.metric("vllm:nixl_xfer_time_seconds_count").await - transfers, f64::from(n), "KV transfers");
    assert!(prefill.metric("vllm:prompt_tokens_total").await - prefilled >= f64::from(n * 400), "prefill legs");
    assert_eq!(s.envoy.stat("wasmcustom.kvgate_pd_prefill_ok").await, u64::from(n), "prefill legs handed over");
    assert_eq!(s.scorer.metric("kvgate_decisions_by_path_total{path=\"pd\"}").await as u32, n);
    assert_eq!(path.failed_open(&s.envoy).await, 0);
    println!(
        "P/D: {n} prompts prefilled on {}, their KV moved by NIXL to {}, next turns exact there",
        prefill.name, decode.name
    );
}

/// Waits until the scorer has judged `sent` requests since `before` (their last reports may
/// trail the answers); what it judged.
async fn settled(s: &Stack, before: &Predictions, sent: u64) -> Predictions {
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.predictions().await.since(before).total() < sent && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    s.predictions().await.since(before)
}

/// `clients` at once, each a conversation of `turns` turns on the chat API (streamed): how
/// many requests were sent. Every answer must be a 200.
async fn loaded(s: &Stack, clients: usize, turns: usize) -> u64 {
    let url = format!("{}/v1/chat/completions", s.envoy.url);
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (client, url) = (s.client.clone(), url.clone());
            tokio::spawn(async move {
                let mut conversation =
                    Conversation::new("/v1/chat/completions", ENGINE_MODEL, words(&format!("load{c}"), 300));
                for n in 0..turns {
                    let question = words(&format!("lq{c}{n}"), 20);
                    let answer = send(&client, &url, &conversation.request(&question, true)).await;
                    assert_eq!(answer.status, 200, "client {c} turn {n}");
                    conversation.turns.push((question, answer.text));
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("client");
    }
    (clients * turns) as u64
}

/// The simulator against `engine` (fresh: nothing cached), configured alike: one trace of
/// `requests`, one request at a time to each.
async fn simulator_agrees(engine: &Engine, options: &EngineOptions, requests: usize) {
    let (sim, counters) = simulator_beside(engine, options).await.expect("the simulator beside the engine");
    let steps = trace(ENGINE_MODEL, ENGINE_ADAPTER, requests, 46);
    let compared =
        compare(&engine.url, &sim.url, (&counters[0], &counters[1]), &steps, |_, _| {}).await.expect("trace");
    println!("simulator against {} ({} blocks):\n{}", engine.name, options.kv_blocks, table(&compared));
    let (equal, all) = compared.equal(None);
    assert!(equal * 100 >= all * 99, "cached tokens equal on {equal} of {all} requests");
    assert_eq!(compared.engine_evicted, compared.sim_evicted, "blocks evicted");
    for kind in ["conversation", "document", "adapter"] {
        assert!(compared.equal(Some(kind)).1 > 0, "the trace has {kind} requests");
    }
    assert!(compared.engine_evicted > 0 && compared.sim_evicted > 0, "the trace evicts: {compared:?}");
    // Requests scheduled together share the prefix the first of them computes.
    let hits = "vllm:prefix_cache_hits_total";
    let before = (engine.metric(hits).await, sim.metric(hits).await);
    send_shared_batch(&engine.url, ENGINE_MODEL).await.expect("engine batch");
    send_shared_batch(&sim.url, ENGINE_MODEL).await.expect("simulator batch");
    let served = (engine.metric(hits).await - before.0, sim.metric(hits).await - before.1);
    let shared = (3 * BATCH_PREFIX_TOKENS) as f64;
    assert_eq!(served, (shared, shared), "a prefix shared in one batch, cached tokens (engine, simulator)");
}

/// vLLM keeps a running adapter's slot while its requests last (kvgate's `PodAdapters::fit`
/// orders slots so): with one slot, a request of the running adapter sent after one of
/// another adapter runs first, and the other waits until the running adapter's requests are
/// done. An order by each adapter's oldest request in flight would have it the other way.
async fn a_running_adapter_keeps_its_slot(engine: &Engine) {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();
    let url = format!("{}/v1/completions", engine.url);
    let post = |model: &str, prompt: &str, max_tokens: u32, stream: bool| {
        let body =
            json!({"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true, "stream": stream});
        client.post(&url).json(&body).send()
    };
    // The first adapter decodes: its first token is out.
    let mut long = post(ENGINE_ADAPTER, "the running adapter decodes for a while", 600, true).await.expect("sent");
    assert!(long.status().is_success(), "{}", long.status());
    assert!(long.chunk().await.expect("streamed").is_some(), "a first chunk");
    let long = tokio::spawn(async move {
        while long.chunk().await.expect("streamed").is_some() {}
        Instant::now()
    });
    let other = {
        let request = post(ENGINE_SECOND_ADAPTER, "another adapter waits for the slot", 1, false);
        tokio::spawn(async move {
            let response = request.await.expect("sent");
            assert!(response.status().is_success(), "{}", response.status());
            Instant::now()
        })
    };
    // The engine holds it waiting (its one slot is the first adapter's).
    let deadline = Instant::now() + Duration::from_secs(60);
    while engine.metric("vllm:num_requests_waiting").await < 1.0 {
        assert!(Instant::now() < deadline, "{}: the second adapter's request never waited", engine.name);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let joined = post(ENGINE_ADAPTER, "the running adapter's next request", 1, false).await.expect("sent");
    assert!(joined.status().is_success(), "{}", joined.status());
    let joined = Instant::now();
    assert!(!long.is_finished(), "the first request decodes past the later ones: give it more tokens");
    assert!(!other.is_finished(), "{}: the waiting adapter ran before the running one's next request", engine.name);
    let (long, other) = (long.await.unwrap(), other.await.unwrap());
    assert!(long <= other, "{}: the waiting adapter ran before the running one's requests were done", engine.name);
    println!("{}: a running adapter kept its slot ({:?} before the waiting one)", engine.name, other - joined);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_engines_under_kvgate_on_every_way_in() {
    // One roomy engine and one with a small cache (evictions), each on its own core, both
    // able to run the adapter, both draining on SIGTERM as deploy/base/vllm.yaml's do.
    let options = |kv_blocks, cpu| EngineOptions {
        kv_blocks,
        cpu,
        max_loras: 1,
        extra: vec!["--shutdown-timeout".into(), "30".into()],
        ..EngineOptions::default()
    };
    let small = options(192, 1);
    let mut engines = [Engine::spawn("engine-a", &options(512, 0)), Engine::spawn("engine-b", &small)];
    for e in engines.iter_mut() {
        e.wait_ready().await;
    }
    simulator_agrees(&engines[1], &small, 300).await;
    a_running_adapter_keeps_its_slot(&engines[1]).await;
    for (path, stop) in
        [(Path::Wasm, Some(Stop::KillAndRestart)), (Path::Native, None), (Path::Epp, Some(Stop::Terminate))]
    {
        leg(path, &mut engines, stop).await;
    }
    // Two models behind one gateway: the first engine's Qwen3 and a Llama on the second core.
    let [qwen, small] = engines;
    drop(small);
    let llama = EngineOptions { model: TinyModel::Llama3, kv_blocks: 512, cpu: 1, ..EngineOptions::default() };
    let llama = Engine::start("engine-llama", &llama).await;
    for path in [Path::Wasm, Path::Native, Path::Epp] {
        two_models_leg(path, &qwen, &llama).await;
    }
    drop((qwen, llama));
    // A prefill and a decode engine with vLLM's NIXL connector, once the others are gone
    // (its worker polls a core even while idle).
    let pd = |cpu| EngineOptions { kv_blocks: 512, cpu, kv_transfer: true, ..EngineOptions::default() };
    let mut pd_engines = [Engine::spawn("prefill-a", &pd(0)), Engine::spawn("decode-b", &pd(1))];
    for e in pd_engines.iter_mut() {
        e.wait_ready().await;
    }
    pd_leg(&pd_engines[0], &pd_engines[1]).await;
}
