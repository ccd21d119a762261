//! Prefill/decode disaggregation between two simulated pods, driven as vLLM's NIXL proxy
//! drives real ones: a 1-token prefill leg with `do_remote_decode`, then the original request
//! with the prefill's `kv_transfer_params` to the decode pod.

use kvgate_test_harness::{Sim, sized};
use serde_json::{Value, json};

fn prefill_leg(prompt: &str) -> Value {
    json!({
        "prompt": prompt, "max_tokens": 1, "stream": false,
        "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                               "remote_block_ids": null, "remote_host": null, "remote_port": null},
    })
}

#[tokio::test]
async fn decode_pod_pulls_the_prompt_prefilled_elsewhere() {
    let prefill = Sim::start("pod-p", &["--role", "prefill", "--time-scale", "0.01"]).await;
    // Decode side at a slower clock, so that model times dwarf HTTP overheads.
    let decode = Sim::start("pod-d", &["--role", "decode", "--time-scale", "0.2"]).await;
    let prompt = sized("pd", 4000);

    let leg = prefill.post_json("/v1/completions", &prefill_leg(&prompt)).await;
    assert_eq!(leg["usage"]["completion_tokens"], 1);
    let params = leg["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(params["remote_engine_id"], "pod-p-engine");
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert_eq!(params["remote_port"], prefill.port);
    assert_eq!(params["remote_block_ids"].as_array().unwrap().len(), 4000usize.div_ceil(16));
    assert_eq!(prefill.metric("kvgate_sim:prefill_tokens_computed_total").await, 4000.0);

    // The decode leg streams the full answer without computing the prompt.
    let body = json!({"prompt": prompt, "max_tokens": 20, "stream": true,
                      "stream_options": {"include_usage": true}, "kv_transfer_params": params});
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", decode.url))
        .header("x-request-id", "req-42")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"));
    assert!(text.contains(r#""completion_tokens":20"#));
    assert_eq!(decode.metric("kvgate_sim:prefill_tokens_computed_total").await, 1.0, "only the last prompt token");
    assert_eq!(decode.metric("kvgate_sim:kv_transferred_tokens_total").await, 3999.0);
    assert!(decode.metric("kvgate_sim:cached_blocks").await >= 249.0, "pulled blocks are cached (BlockStored)");
    let log = decode.requests().await;
    assert_eq!(log[0]["request_id"], "req-42");
    assert_eq!(log[0]["kv_transfer"], "remote_prefill");
    assert_eq!(log[0]["kv_transfer_params"], params, "received unchanged");

    // Paying the transfer instead of the prefill: the decode leg's first token comes much
    // sooner than a local prefill of the same prompt on a fresh pod (model: ≈ 21 ms vs
    // ≈ 176 ms, × 0.2).
    let local = Sim::start("pod-l", &["--time-scale", "0.2"]).await;
    local.post_json("/v1/completions", &json!({"prompt": prompt, "max_tokens": 1})).await;
    let local_ttft = local.requests().await[0]["ttft_ms"].as_f64().unwrap();
    let remote_ttft = log[0]["ttft_ms"].as_f64().unwrap();
    assert!(remote_ttft * 3.0 < local_ttft, "remote {remote_ttft} ms vs local {local_ttft} ms");
}

#[tokio::test]
async fn roles_and_transfer_params_are_checked() {
    let prefill = Sim::start("pod-p2", &["--role", "prefill", "--time-scale", "0.01"]).await;
    let decode = Sim::start("pod-d2", &["--role", "decode", "--time-scale", "0.01"]).await;
    let prompt = sized("roles", 100);
    let expect_400 = |sim: &Sim, body: Value, needle: &'static str| {
        let url = format!("{}/v1/completions", sim.url);
        async move {
            let r = reqwest::Client::new().post(url).json(&body).send().await.unwrap();
            assert_eq!(r.status(), 400);
            let err: Value = r.json().await.unwrap();
            assert!(err["error"]["message"].as_str().unwrap().contains(needle), "{err}");
        }
    };
    expect_400(&decode, prefill_leg(&prompt), "decode pod").await;
    let remote = json!({"prompt": prompt, "kv_transfer_params": {"do_remote_prefill": true}});
    expect_400(&prefill, remote.clone(), "prefill pod").await;
    expect_400(&decode, remote, "missing remote_engine_id").await;
    // Parameters for another prompt (wrong block count) are refused, not silently used.
    let leg = prefill.post_json("/v1/completions", &prefill_leg(&prompt)).await;
    let other = json!({"prompt": sized("other", 300), "kv_transfer_params": leg["kv_transfer_params"]});
    expect_400(&decode, other, "remote_block_ids must list the 19 blocks").await;
    // Both roles serve ordinary requests.
    for sim in [&prefill, &decode] {
        sim.post_json("/v1/completions", &json!({"prompt": prompt, "max_tokens": 2})).await;
    }
}
