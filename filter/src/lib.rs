//! kvgate's Envoy filter (proxy-wasm, `wasm32-wasip1`).
//!
//! For `POST` to the routed APIs (`/v1/completions`, `/v1/chat/completions`, `/v1/responses`,
//! `/v1/messages`; configurable) it pauses on the request headers, buffers the body, asks the
//! scorer sidecar which pod should serve the request (one message, body verbatim, on the route
//! stream: a gRPC stream per worker kept open by the root context), sets the destination
//! header (`x-gateway-destination-endpoint: ip:port`) that Envoy's `override_host`
//! load-balancing policy follows, and resumes; first
//! response bytes and the end of each routed request are reported back to the scorer. What
//! each step decides — refusals, failure modes, prefill legs, reports — is the request
//! lifecycle every proxy shares ([`kvgate_route_api::lifecycle`]); this crate is its
//! proxy-wasm host.
//!
//! [`config`] can be tested natively; `wasm` is the glue to Envoy, compiled for `wasm32` only.

pub mod config;
#[cfg(target_arch = "wasm32")]
mod wasm;
