//! Prefill/decode disaggregation: whether a request's prefill goes to a prefill pod, which
//! one, and the decode pod that then pulls its KV.

use super::{RouteRequest, Router};
use crate::load::{Booking, Leg};
use crate::pod_set::PodId;
use crate::policy::{Candidate, Decision, RouteInput};

impl Router {
    /// The prefill pod of a request whose best decode-capable pod would compute
    /// `uncached_tokens` (at least `pd.threshold_tokens`, and a prefill pod healthy), when
    /// disaggregating pays: the prefill pod starts this prompt no later than the least-busy
    /// decode-capable pod could compute it itself — an overloaded prefill pool sends long
    /// prompts direct instead of queueing them (threshold 0: always). `None`: served direct.
    pub(super) fn prefill_pod(
        &mut self,
        prefillers: &[PodId],
        direct: &[Candidate],
        request: &RouteRequest<'_>,
        input: &RouteInput,
        uncached_tokens: u32,
        now: f64,
    ) -> Option<Candidate> {
        if prefillers.is_empty() || uncached_tokens < self.pd_threshold_tokens {
            return None;
        }
        let candidates = self.candidates(prefillers, request, now, None);
        let prefill = candidates[self.prefill_policy.select(input, &candidates).chosen];
        let backlog =
            |c: &Candidate| c.load.queued_prefill_tokens + u64::from(request.prompt_tokens - c.credited_tokens());
        let local = direct.iter().map(backlog).min().unwrap_or(u64::MAX);
        (self.pd_threshold_tokens == 0 || backlog(&prefill) <= local).then_some(prefill)
    }

    /// A disaggregated request: its prefill leg booked on `prefill`, and its decode pod chosen
    /// by the decode policy among `decoders` — the decode pod pulls the KV, computes no
    /// prefill, and only its load counts. The decode candidates, the decision and its policy.
    pub(super) fn disaggregate(
        &mut self,
        prefill: &Candidate,
        decoders: &[PodId],
        request: &RouteRequest<'_>,
        input: &RouteInput,
        now: f64,
    ) -> (Vec<Candidate>, Decision, &'static str) {
        let candidates = self.candidates(decoders, request, now, Some(request.prompt_tokens));
        let decision = self.decode_policy.select(&RouteInput { kv_received: true, ..*input }, &candidates);
        self.book(
            request.request_id,
            Leg::Prefill,
            &Booking {
                pod: prefill.pod,
                prompt_tokens: request.prompt_tokens,
                cached_tokens: prefill.credited_tokens(),
                chain: request.chain,
                max_output_tokens: Some(0),
                adapter: request.adapter,
            },
            now,
        );
        (candidates, decision, self.policy_names.1)
    }
}
