//! kvgate's Envoy filter (proxy-wasm, `wasm32-wasip1`).
//!
//! For `POST /v1/completions` and `/v1/chat/completions` (configurable) it pauses on the
//! request headers, buffers the body, rejects bodies that do not open a JSON object with a
//! 400, asks the scorer sidecar which pod should serve the request (one message, body
//! verbatim, on the route stream: a gRPC stream per worker kept open by the root context),
//! sets the
//! destination header (`x-gateway-destination-endpoint: ip:port`) that Envoy's
//! `override_host` load-balancing policy follows, and resumes. A client-supplied destination
//! header is removed from every request. When the scorer is down, slow or failing, the
//! failure mode decides: `open` lets Envoy's fallback balancing pick, `closed` answers 503.
//! First response bytes and the end of each routed request are reported back to the scorer
//! in batches, so it can release its bookings.
//!
//! [`config`] and [`logic`] hold everything that can be tested natively; `wasm` is the
//! glue to Envoy, compiled for `wasm32` only.

pub mod config;
pub mod logic;
#[cfg(target_arch = "wasm32")]
mod wasm;
