//! What a vLLM engine's pages say: its `/metrics` (load, KV block size, LoRA adapters, the
//! process's start time) and its `/v1/models` (the adapters it serves). Text in, figures out;
//! the scrape loop ([`crate::scrape`]) fetches the pages and the scorer keeps the figures.

use kvgate_routing::policy::ReportedLoad;
use serde::Serialize;

/// What an OpenAI `/v1/models` answer, as vLLM gives it, says a pod serves.
#[derive(Debug, PartialEq)]
pub struct ModelsServed {
    /// Every model a request may name there: its base models and the adapters loaded.
    pub models: Vec<String>,
    /// Of those, the LoRA adapters: the models with a `parent`, the base model they adapt
    /// (adapter, base).
    pub adapters: Vec<(String, String)>,
}

/// The models of a `/v1/models` answer; `None` when the page is not one.
pub fn models_served(text: &str) -> Option<ModelsServed> {
    #[derive(serde::Deserialize)]
    struct Models {
        data: Vec<Model>,
    }
    #[derive(serde::Deserialize)]
    struct Model {
        id: String,
        #[serde(default)]
        parent: Option<String>,
    }
    let listed = serde_json::from_str::<Models>(text).ok()?.data;
    let adapters = listed.iter().filter_map(|m| Some((m.id.clone(), m.parent.clone()?))).collect();
    Some(ModelsServed { models: listed.into_iter().map(|m| m.id).collect(), adapters })
}

/// The load figures of a vLLM metrics page (summed over data-parallel engines; KV usage is
/// the fullest engine's). `None` if the page has none of them.
pub fn parse(text: &str) -> Option<ReportedLoad> {
    let mut load = ReportedLoad::default();
    let mut seen = false;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((name_labels, value)) = line.rsplit_once(' ') else { continue };
        let name = name_labels.split('{').next().unwrap_or_default();
        let Ok(value) = value.parse::<f64>() else { continue };
        match name {
            "vllm:num_requests_running" => load.running += value,
            "vllm:num_requests_waiting" => load.waiting += value,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                load.kv_cache_usage = load.kv_cache_usage.max(value)
            }
            // An info metric: the figure is a label. The smallest engine's (data parallel).
            "vllm:cache_config_info" => {
                if let Some(blocks) = label(name_labels, "num_gpu_blocks").and_then(|v| v.parse::<f64>().ok()) {
                    load.num_gpu_blocks =
                        if load.num_gpu_blocks > 0.0 { load.num_gpu_blocks.min(blocks) } else { blocks };
                }
                continue;
            }
            _ => continue,
        }
        seen = true;
    }
    seen.then_some(load)
}

/// The LoRA adapters a pod's engine is running and has waiting, and how many it holds at once.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PodAdapters {
    pub running: Vec<String>,
    pub waiting: Vec<String>,
    pub max_lora: u32,
}

/// `vllm:lora_requests_info` (engines serving adapters): the newest of its series — vLLM
/// sets a series per label set to the time it was last true, and keeps the older ones.
pub fn adapters(text: &str) -> Option<PodAdapters> {
    let names =
        |list: Option<&str>| list.unwrap_or_default().split(',').filter(|a| !a.is_empty()).map(String::from).collect();
    text.lines()
        .filter(|l| l.starts_with("vllm:lora_requests_info{"))
        .filter_map(|l| {
            let (name_labels, value) = l.rsplit_once(' ')?;
            Some((value.parse::<f64>().ok()?, name_labels))
        })
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, labels)| PodAdapters {
            running: names(label(labels, "running_lora_adapters")),
            waiting: names(label(labels, "waiting_lora_adapters")),
            max_lora: label(labels, "max_lora").and_then(|m| m.parse().ok()).unwrap_or(0),
        })
}

/// Tokens per KV block, as `vllm:cache_config_info`'s `block_size` label states it.
pub fn block_size(text: &str) -> Option<usize> {
    text.lines()
        .filter(|l| l.starts_with("vllm:cache_config_info{"))
        .find_map(|l| label(l.rsplit_once(' ')?.0, "block_size")?.parse().ok())
        .filter(|&n| n > 0)
}

/// `process_start_time_seconds` (the Prometheus client's process collector, which vLLM
/// exposes): a restarted engine has a new one.
pub fn process_start_time(text: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix("process_start_time_seconds ")?.trim().parse().ok())
}

/// The value of label `key` in `name{k="v",...}`.
fn label<'a>(name_labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = name_labels.split_once('{')?.1;
    loop {
        let (name, value) = rest.split_once("=\"")?;
        // Values may hold commas (vLLM's adapter lists); a quote inside one is escaped.
        let end = value.char_indices().find(|&(i, c)| c == '"' && !value[..i].ends_with('\\'))?.0;
        if name.trim_start_matches([',', ' ']) == key {
            return Some(&value[..end]);
        }
        rest = &value[end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllm_names_across_engines() {
        let text = "# HELP x\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 2.0\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 7.0\n\
            vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n\
            vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.5\n\
            vllm:prefix_cache_hits_total{engine=\"0\"} 99.0\n\
            vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"26000\"} 1.0\n";
        assert_eq!(
            parse(text),
            Some(ReportedLoad { running: 5.0, waiting: 7.0, kv_cache_usage: 0.5, num_gpu_blocks: 26000.0 })
        );
        assert_eq!(parse("vllm:gpu_cache_usage_perc 0.9\n").unwrap().kv_cache_usage, 0.9, "pre-0.11 name");
        assert_eq!(parse("<html>not metrics</html>"), None);
        assert_eq!(block_size(text), Some(16));
        assert_eq!(block_size("vllm:num_requests_running 1.0\n"), None);
        assert_eq!(process_start_time("# HELP x\nprocess_start_time_seconds 1.7954e9\n"), Some(1.7954e9));
        assert_eq!(process_start_time(text), None);
    }

    #[test]
    fn reads_the_adapters_an_engine_serves_from_its_models() {
        // As vLLM 0.32 answers `/v1/models` with `--lora-modules tiny-sql=...` (trimmed).
        let text = r#"{"object":"list","data":[
            {"id":"kvgate/qwen3-tiny","object":"model","root":"/m/model","parent":null,"max_model_len":4096},
            {"id":"tiny-sql","object":"model","root":"/m/adapter","parent":"kvgate/qwen3-tiny","max_model_len":null}]}"#;
        let served = models_served(text).unwrap();
        assert_eq!(served.models, vec!["kvgate/qwen3-tiny".to_string(), "tiny-sql".to_string()]);
        assert_eq!(served.adapters, vec![("tiny-sql".to_string(), "kvgate/qwen3-tiny".to_string())]);
        let base_only = models_served(r#"{"object":"list","data":[{"id":"m"}]}"#).unwrap();
        assert!(base_only.adapters.is_empty() && base_only.models == ["m"], "a base model only");
        assert_eq!(models_served("<html>"), None);
    }

    #[test]
    fn reads_the_newest_adapter_series() {
        // As vLLM's logger leaves it: one series per label set, valued at when it last held.
        let text = "# TYPE vllm:lora_requests_info gauge\n\
            vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"sql,chat\",waiting_lora_adapters=\"\"} 1.7e9\n\
            vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"sql\",waiting_lora_adapters=\"law,med\"} 1.8e9\n\
            vllm:lora_requests_info{max_lora=\"2\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 1.6e9\n\
            vllm:num_requests_running{engine=\"0\"} 1.0\n";
        let expected =
            PodAdapters { running: vec!["sql".into()], waiting: vec!["law".into(), "med".into()], max_lora: 2 };
        assert_eq!(adapters(text), Some(expected));
        assert_eq!(adapters("vllm:num_requests_running 1.0\n"), None, "an engine without adapters");
        assert_eq!(label("m{a=\"x,y\",b=\"say \\\"hi\\\", ok\"}", "b"), Some("say \\\"hi\\\", ok"));
        assert_eq!(label("m{a=\"x,y\",b=\"z\"}", "a"), Some("x,y"));
    }
}
