//! The ways into kvgate, side by side over the picking service ([`crate::picking`]): each
//! turns its wire format into pick requests and reports and back, and nothing else.
//!
//! - [`http`]: `POST /v1/route` and `/v1/lifecycle` (JSON), for people and other clients;
//! - [`route_stream`] (gRPC, the wasm filter) and [`route_socket`] (length-framed, the native
//!   module): two framings of the route protocol's calls ([`route_calls`]);
//! - [`epp`]: the Gateway API Inference Extension's Endpoint Picker (Envoy ext_proc).

pub mod epp;
pub mod http;
pub mod route_calls;
pub mod route_socket;
pub mod route_stream;

/// Says on stdout where a listener is bound (`listening <name> <ip:port>`), once it is: a
/// listener configured on port 0 gets a port from the OS, and whoever started the scorer
/// (a test harness, a script) reads it here.
pub fn announce(name: &str, address: std::net::SocketAddr) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "listening {name} {address}").and_then(|()| out.flush());
}
