//! Scraping a pod's vLLM `/metrics`: reported load, the engine's identity (its process
//! start time), and health (a refused connection takes the pod out at once, consecutive
//! failures after `health.unhealthy_after`; one success brings it back). Beside it, the
//! engine's `/v1/models` (on the same server) names the LoRA adapters it serves — loaded at
//! start or since — before any of them has run.

use crate::config::MetricsUrl;
use crate::engine_pages::{adapters, block_size, models_served, parse, process_start_time};
use crate::scorer::{Scorer, Scrape};
use kvgate_routing::pod_set::PodId;
use std::sync::Arc;
use std::time::Duration;

/// Scrapes `url` every interval until the process stops.
pub async fn run(scorer: Arc<Scorer>, pod: PodId, url: MetricsUrl) {
    let health = scorer.config.health.clone();
    let client = match reqwest::Client::builder().timeout(Duration::from_millis(health.scrape_timeout_ms)).build() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("cannot build the metrics client: {e}");
            return;
        }
    };
    let mut interval = tokio::time::interval(Duration::from_millis(health.scrape_interval_ms));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let models_url = url.models();
    let mut models_read: Option<tokio::time::Instant> = None;
    loop {
        interval.tick().await;
        let scrape = match client.get(&*url).send().await {
            Ok(r) if r.status().is_success() => match r.text().await {
                Ok(text) => parse(&text).map_or(Scrape::Failed, |load| Scrape::Answered {
                    load,
                    started_at: process_start_time(&text),
                    adapters: adapters(&text),
                    block_size: block_size(&text),
                }),
                Err(e) if e.is_timeout() => Scrape::TimedOut,
                Err(_) => Scrape::Failed,
            },
            Err(e) if e.is_connect() => Scrape::Refused,
            Err(e) if e.is_timeout() => Scrape::TimedOut,
            _ => Scrape::Failed,
        };
        let answered = matches!(scrape, Scrape::Answered { .. });
        scorer.scraped(pod, scrape);
        // The models it serves: at its first answer, then every `MODELS_INTERVAL`.
        if answered
            && models_read.is_none_or(|at| at.elapsed() >= MODELS_INTERVAL)
            && let Ok(r) = client.get(models_url.clone()).send().await
            && r.status().is_success()
            && let Ok(text) = r.text().await
        {
            models_read = Some(tokio::time::Instant::now());
            if let Some(served) = models_served(&text) {
                served.adapters.iter().for_each(|(name, base)| scorer.learn_adapter(name, Some(base)));
                scorer.served_models(pod, served.models);
            }
        }
    }
}

/// How often a pod's `/v1/models` is read again (adapters loaded at run time).
const MODELS_INTERVAL: Duration = Duration::from_secs(10);
