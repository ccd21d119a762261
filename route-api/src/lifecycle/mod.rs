//! The lifecycle of a routed request, decided once for every way into kvgate.
//!
//! - [`RequestFlow`]: one request through a proxy — the wasm filter and the native module
//!   drive it from their hooks: which requests are routed, request ids, the body checks, the
//!   route call, what the answer means (route, refuse, fail open or closed), prefill legs,
//!   and the reports of the response.
//! - [`ResponseWatch`]: what a response says of its request — first token, done, cancelled —
//!   for the proxies and for the Endpoint Picker's exchange alike.
//! - [`CallsInFlight`]: a proxy's route calls waiting on its stream or socket, and when that
//!   stream is stuck.
//! - [`ReportQueue`]: a proxy's reports waiting for the scorer, batched, each dated by its age.
//! - [`ProxyConfig`]: the settings every proxy shares; each host adds its own ([`parse`]).
//!
//! Without I/O: a host implements [`Proxy`] with its own calls into Envoy, and passes in what
//! it reads (headers, bodies, answers, the clock). Adding a way in means a new host of these,
//! not a new decision.

mod calls;
mod config;
mod flow;
mod reports;
mod response;

pub use calls::{CallsInFlight, Expired};
pub use config::{FailureMode, HostConfig, NativeSettings, PdMode, ProxyConfig, WasmSettings, header_name, parse};
pub use flow::{
    AnswerNext, BodyNext, Counter, Next, Proxy, RequestFlow, decode_leg_body, prefill_leg_body, request_id,
};
pub use reports::ReportQueue;
pub use response::{End, ResponseWatch};
