//! Envoy's event hooks: the functions Envoy looks up in the module by name.
//!
//! # Safety
//! Every hook is called by Envoy only, with Envoy's pointers: `config_envoy` (its filter
//! configuration, during `config_new`), `config` (what `config_new` returned, until
//! `config_destroy`), `filter_envoy` (Envoy's handle of a stream's filter, valid during the
//! hook) and `module` (what `on_http_filter_new` returned: a leaked `Box<Request>`, reclaimed
//! in `on_http_filter_destroy`; Envoy calls a filter's hooks on one worker, one at a time).
//! None of them may panic: that would abort Envoy.
#![allow(clippy::missing_safety_doc)] // the contract above, the same for every hook

use crate::abi::{self, Filter, LogLevel, body_status, headers_status};
use crate::{Config, Counters, Request};
use kvgate_native_link::{Link, LinkConfig};
use kvgate_route_api::lifecycle::{self, NativeSettings};
use std::ffi::{c_char, c_void};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// The request behind a module pointer.
///
/// # Safety
/// `module` must come from `envoy_dynamic_module_on_http_filter_new`, not yet destroyed, with
/// no other reference to it alive (Envoy runs one hook of a filter at a time).
unsafe fn request<'a>(module: *mut c_void) -> &'a mut Request {
    // SAFETY: the caller's contract.
    unsafe { &mut *module.cast::<Request>() }
}

#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    abi::ABI_VERSION.as_ptr()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    config_envoy: *mut c_void,
    _name: abi::EnvoyBuffer,
    config: abi::EnvoyBuffer,
) -> *const c_void {
    // SAFETY: Envoy's configuration bytes, valid during this call.
    let bytes = unsafe { config.bytes() };
    let (proxy, own) = match lifecycle::parse::<NativeSettings>(bytes) {
        Ok(parsed) => parsed,
        Err(e) => {
            abi::log(LogLevel::Error, &format!("kvgate: configuration rejected: {e}"));
            return std::ptr::null();
        }
    };
    // SAFETY: Envoy's configuration pointer, during config_new.
    let Some(counters) = (unsafe { Counters::define(config_envoy) }) else {
        abi::log(LogLevel::Error, "kvgate: Envoy refused the module's counters");
        return std::ptr::null();
    };
    let link_config = LinkConfig {
        scorer: own.scorer_address.clone(),
        timeout: Duration::from_millis(proxy.scorer_timeout_ms),
        flush: Duration::from_millis(proxy.lifecycle_flush_ms),
        batch_max: proxy.lifecycle_batch_max,
        log: crate::link_log,
    };
    let link = match Link::start(link_config, abi::concurrency()) {
        Ok(link) => link,
        Err(e) => {
            abi::log(LogLevel::Error, &format!("kvgate: cannot start the link to the scorer: {e}"));
            return std::ptr::null();
        }
    };
    abi::log(LogLevel::Info, &format!("kvgate: native module routing {:?} via {}", proxy.paths, own.scorer_address));
    Arc::into_raw(Arc::new(Config { proxy, link, calls: AtomicU64::new(1), counters })).cast()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: *const c_void) {
    // SAFETY: from `Arc::into_raw` in config_new, released once.
    drop(unsafe { Arc::from_raw(config.cast::<Config>()) });
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: *const c_void,
    _filter_envoy: *mut c_void,
) -> *mut c_void {
    let config = config.cast::<Config>();
    // SAFETY: the config outlives its filters (Envoy destroys it after them); one more count.
    let config = unsafe {
        Arc::increment_strong_count(config);
        Arc::from_raw(config)
    };
    let request = Request::new(config);
    Box::into_raw(Box::new(request)).cast()
}

/// A hook of a stream's filter: `filter` (Envoy's handle) and `request` (the module's) from
/// Envoy's pointers, then `body`. Envoy posts no hook to a destroyed filter.
macro_rules! stream_hook {
    ($hook:ident($($arg:ident: $ty:ty),*) -> $out:ty, |$filter:ident, $request:ident| $body:expr) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $hook(filter_envoy: *mut c_void, module: *mut c_void, $($arg: $ty),*) -> $out {
            // SAFETY: Envoy's pointers for this hook.
            let ($filter, $request) = unsafe { (Filter::new(filter_envoy), request(module)) };
            $body
        }
    };
}

stream_hook!(envoy_dynamic_module_on_http_filter_request_headers(end_of_stream: bool) -> u32, |filter, request| {
    request.on_request_headers(&filter, end_of_stream)
});
stream_hook!(envoy_dynamic_module_on_http_filter_request_body(end_of_stream: bool) -> u32, |filter, request| {
    request.on_request_body(&filter, end_of_stream)
});
stream_hook!(envoy_dynamic_module_on_http_filter_response_headers(end_of_stream: bool) -> u32, |filter, request| {
    request.on_response_headers(&filter, end_of_stream);
    headers_status::CONTINUE
});
stream_hook!(envoy_dynamic_module_on_http_filter_response_body(end_of_stream: bool) -> u32, |filter, request| {
    request.on_response_body(&filter, end_of_stream);
    body_status::CONTINUE
});
stream_hook!(envoy_dynamic_module_on_http_filter_stream_complete() -> (), |filter, request| {
    request.on_stream_complete(&filter)
});
stream_hook!(envoy_dynamic_module_on_http_filter_scheduled(_event_id: u64) -> (), |filter, request| {
    request.on_scheduled(&filter)
});

#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    _filter_envoy: *mut c_void,
    _module: *mut c_void,
) -> u32 {
    headers_status::CONTINUE
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    _filter_envoy: *mut c_void,
    _module: *mut c_void,
) -> u32 {
    headers_status::CONTINUE
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(module: *mut c_void) {
    // SAFETY: from `Box::into_raw` in filter_new; Envoy destroys a filter once.
    unsafe { Box::from_raw(module.cast::<Request>()) }.forget_call();
}

// Hooks Envoy requires of every HTTP filter module; kvgate makes no callouts of Envoy's and
// does not watch the client's write buffer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done() {}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers() {}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data() {}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers() {}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete() {}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset() {}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark() {}
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark() {}
