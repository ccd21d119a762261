//! The part of Envoy's dynamic-module ABI (v0.2.0, as Envoy 1.40 implements it) this module
//! uses: the types, the callbacks it calls and the statuses its event hooks return. Written
//! from Envoy's `abi.h`; the hooks themselves are in `hooks.rs`. Every call into Envoy is
//! wrapped here in a safe function over a [`Filter`] handle.

use std::ffi::c_void;

/// Envoy's ABI version string this module is written against (Envoy only warns on another).
pub const ABI_VERSION: &std::ffi::CStr = c"v0.2.0";

/// Memory owned by Envoy: header values, body slices, configuration.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    pub ptr: *const u8,
    pub length: usize,
}

impl EnvoyBuffer {
    const EMPTY: Self = Self { ptr: std::ptr::null(), length: 0 };

    /// The bytes, valid as long as Envoy keeps what they point into (the caller says how
    /// long: until the hook returns, or until the header map changes).
    ///
    /// # Safety
    /// `ptr` must point to `length` readable bytes for `'a` (or be null with length 0).
    pub unsafe fn bytes<'a>(self) -> &'a [u8] {
        if self.ptr.is_null() || self.length == 0 {
            return &[];
        }
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts(self.ptr, self.length) }
    }
}

/// Memory owned by the module, lent to Envoy for one call.
#[repr(C)]
#[derive(Clone, Copy)]
struct ModuleBuffer {
    ptr: *const u8,
    length: usize,
}

impl ModuleBuffer {
    fn of(bytes: &[u8]) -> Self {
        Self { ptr: bytes.as_ptr(), length: bytes.len() }
    }
}

#[repr(C)]
struct ModuleHeader {
    key_ptr: *const u8,
    key_length: usize,
    value_ptr: *const u8,
    value_length: usize,
}

/// `envoy_dynamic_module_type_http_header_type`.
#[repr(u32)]
#[derive(Clone, Copy)]
pub enum HeaderMap {
    Request = 0,
    Response = 2,
}

/// `envoy_dynamic_module_type_http_body_type`.
#[repr(u32)]
#[derive(Clone, Copy)]
pub enum Body {
    /// The request body's piece of the current `on_request_body` call.
    ReceivedRequest = 0,
    /// What earlier calls left in Envoy's buffer (`StopIterationAndBuffer`).
    BufferedRequest = 1,
    ReceivedResponse = 2,
}

/// `envoy_dynamic_module_type_on_http_filter_request_headers_status` (and the response's).
pub mod headers_status {
    pub const CONTINUE: u32 = 0;
    pub const STOP_ITERATION: u32 = 1;
}

/// `envoy_dynamic_module_type_on_http_filter_request_body_status` (and the response's).
pub mod body_status {
    pub const CONTINUE: u32 = 0;
    pub const STOP_ITERATION_AND_BUFFER: u32 = 1;
}

/// `envoy_dynamic_module_type_log_level`.
#[repr(u32)]
#[derive(Clone, Copy)]
pub enum LogLevel {
    Info = 2,
    Warn = 3,
    Error = 4,
}

/// `envoy_dynamic_module_type_metadata_source_Dynamic`: the stream's dynamic metadata.
const METADATA_DYNAMIC: u32 = 0;

unsafe extern "C" {
    fn envoy_dynamic_module_callback_log(level: LogLevel, message: ModuleBuffer);
    fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        config: *mut c_void,
        name: ModuleBuffer,
        label_names: *const ModuleBuffer,
        label_names_len: usize,
        id: *mut usize,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_filter_increment_counter(
        filter: *mut c_void,
        id: usize,
        label_values: *const ModuleBuffer,
        label_values_len: usize,
        value: u64,
    ) -> u32;
    fn envoy_dynamic_module_callback_http_get_metadata_string(
        filter: *mut c_void,
        source: u32,
        namespace: ModuleBuffer,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_get_header(
        filter: *mut c_void,
        map: HeaderMap,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
        index: usize,
        count: *mut usize,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_set_header(
        filter: *mut c_void,
        map: HeaderMap,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_send_response(
        filter: *mut c_void,
        status: u32,
        headers: *const ModuleHeader,
        headers_len: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );
    fn envoy_dynamic_module_callback_http_get_body_chunks_size(filter: *mut c_void, body: Body) -> usize;
    fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter: *mut c_void,
        body: Body,
        chunks: *mut EnvoyBuffer,
    ) -> bool;
    fn envoy_dynamic_module_callback_http_drain_body(filter: *mut c_void, body: Body, bytes: usize) -> bool;
    fn envoy_dynamic_module_callback_http_append_body(filter: *mut c_void, body: Body, data: ModuleBuffer) -> bool;
    fn envoy_dynamic_module_callback_http_filter_continue_decoding(filter: *mut c_void);
    fn envoy_dynamic_module_callback_http_filter_get_worker_index(filter: *mut c_void) -> u32;
    fn envoy_dynamic_module_callback_get_concurrency() -> u32;
    fn envoy_dynamic_module_callback_http_filter_scheduler_new(filter: *mut c_void) -> *mut c_void;
    fn envoy_dynamic_module_callback_http_filter_scheduler_commit(scheduler: *mut c_void, event_id: u64);
    fn envoy_dynamic_module_callback_http_filter_scheduler_delete(scheduler: *mut c_void);
}

/// Logs through Envoy's logger (component `dynamic_modules`).
pub fn log(level: LogLevel, message: &str) {
    // SAFETY: Envoy copies the message during the call.
    unsafe { envoy_dynamic_module_callback_log(level, ModuleBuffer::of(message.as_bytes())) }
}

/// Defines a counter (`<metrics_namespace>.<name>` in Envoy's stats) while Envoy creates
/// the filter configuration `config` (its `filter_config_envoy_ptr`); `None` if Envoy
/// refuses.
///
/// # Safety
/// `config` must be the pointer Envoy passed to `on_http_filter_config_new`, during that call.
pub unsafe fn define_counter(config: *mut c_void, name: &str) -> Option<Counter> {
    let mut id = 0usize;
    // SAFETY: the caller's contract; Envoy copies the name and writes `id`.
    let result = unsafe {
        envoy_dynamic_module_callback_http_filter_config_define_counter(
            config,
            ModuleBuffer::of(name.as_bytes()),
            std::ptr::null(),
            0,
            &mut id,
        )
    };
    (result == 0).then_some(Counter(id))
}

/// A counter defined with [`define_counter`].
#[derive(Clone, Copy)]
pub struct Counter(usize);

/// How many workers Envoy runs (`--concurrency`).
pub fn concurrency() -> usize {
    // SAFETY: no arguments; Envoy reads its options.
    unsafe { envoy_dynamic_module_callback_get_concurrency() as usize }
}

/// Envoy's handle of one HTTP stream's filter, valid from `on_http_filter_new` until the
/// filter is destroyed, and only on the worker thread that runs the stream: it is neither
/// `Send` nor `Sync`, and the hooks make one for the length of a call.
pub struct Filter {
    raw: *mut c_void,
}

impl Filter {
    /// # Safety
    /// `raw` must be the `filter_envoy_ptr` Envoy passed to the hook running now.
    pub unsafe fn new(raw: *mut c_void) -> Self {
        Self { raw }
    }

    /// The first value of header `name`, as bytes copied out.
    pub fn header(&self, map: HeaderMap, name: &str) -> Option<Vec<u8>> {
        let mut value = EnvoyBuffer::EMPTY;
        let key = ModuleBuffer::of(name.as_bytes());
        // SAFETY: a live filter; Envoy writes `value`, which points into the header map and
        // is copied before anything can change the map.
        let found = unsafe {
            envoy_dynamic_module_callback_http_get_header(self.raw, map, key, &mut value, 0, std::ptr::null_mut())
        };
        // SAFETY: just written by Envoy, the map unchanged since.
        found.then(|| unsafe { value.bytes() }.to_vec())
    }

    /// Sets header `name` (replacing every value), or removes it with `None`.
    pub fn set_header(&self, map: HeaderMap, name: &str, value: Option<&str>) {
        let value = ModuleBuffer::of(value.unwrap_or_default().as_bytes());
        // SAFETY: a live filter; Envoy copies key and value.
        unsafe {
            envoy_dynamic_module_callback_http_set_header(self.raw, map, ModuleBuffer::of(name.as_bytes()), value)
        };
    }

    /// Answers the client directly.
    pub fn send_response(&self, status: u16, headers: &[(&str, &str)], body: &[u8]) {
        let headers: Vec<ModuleHeader> = headers
            .iter()
            .map(|(k, v)| ModuleHeader {
                key_ptr: k.as_ptr(),
                key_length: k.len(),
                value_ptr: v.as_ptr(),
                value_length: v.len(),
            })
            .collect();
        let details = b"kvgate";
        // SAFETY: a live filter; Envoy copies headers, body and details during the call.
        unsafe {
            envoy_dynamic_module_callback_http_send_response(
                self.raw,
                u32::from(status),
                headers.as_ptr(),
                headers.len(),
                ModuleBuffer::of(body),
                ModuleBuffer::of(details),
            )
        }
    }

    /// Appends body `kind`'s bytes to `out` (nothing when Envoy has no such buffer).
    pub fn read_body(&self, kind: Body, out: &mut Vec<u8>) {
        // SAFETY: a live filter.
        let n = unsafe { envoy_dynamic_module_callback_http_get_body_chunks_size(self.raw, kind) };
        if n == 0 {
            return;
        }
        let mut chunks = vec![EnvoyBuffer::EMPTY; n];
        // SAFETY: room for the `n` slices Envoy just counted; they point into its buffer,
        // read before this call returns.
        if unsafe { envoy_dynamic_module_callback_http_get_body_chunks(self.raw, kind, chunks.as_mut_ptr()) } {
            for chunk in chunks {
                // SAFETY: as above.
                out.extend_from_slice(unsafe { chunk.bytes() });
            }
        }
    }

    /// Replaces the request body Envoy buffered (the request paused on its last piece).
    pub fn replace_buffered_request_body(&self, body: &[u8]) -> Result<(), String> {
        // SAFETY: a live filter; Envoy copies `body` during the call.
        let replaced = unsafe {
            envoy_dynamic_module_callback_http_drain_body(self.raw, Body::BufferedRequest, usize::MAX)
                && envoy_dynamic_module_callback_http_append_body(
                    self.raw,
                    Body::BufferedRequest,
                    ModuleBuffer::of(body),
                )
        };
        if replaced { Ok(()) } else { Err("Envoy has no buffered request body".into()) }
    }

    /// A string of the stream's dynamic metadata, copied out.
    pub fn dynamic_metadata(&self, namespace: &str, key: &str) -> Option<String> {
        let mut value = EnvoyBuffer::EMPTY;
        let (namespace, key) = (ModuleBuffer::of(namespace.as_bytes()), ModuleBuffer::of(key.as_bytes()));
        // SAFETY: a live filter; `value` points into the metadata, copied at once.
        let found = unsafe {
            envoy_dynamic_module_callback_http_get_metadata_string(
                self.raw,
                METADATA_DYNAMIC,
                namespace,
                key,
                &mut value,
            )
        };
        // SAFETY: just written by Envoy, nothing changed since.
        found.then(|| String::from_utf8_lossy(unsafe { value.bytes() }).into_owned())
    }

    pub fn increment(&self, counter: Counter) {
        // SAFETY: a live filter, a counter of its configuration.
        unsafe {
            envoy_dynamic_module_callback_http_filter_increment_counter(self.raw, counter.0, std::ptr::null(), 0, 1)
        };
    }

    /// The index of the worker running this stream (0 ≤ index < [`concurrency`]).
    pub fn worker(&self) -> usize {
        // SAFETY: a live filter.
        unsafe { envoy_dynamic_module_callback_http_filter_get_worker_index(self.raw) as usize }
    }

    /// Lets a request paused on its body go on to the router.
    pub fn continue_decoding(&self) {
        // SAFETY: a live filter.
        unsafe { envoy_dynamic_module_callback_http_filter_continue_decoding(self.raw) }
    }

    /// A way for other threads to wake this filter on its worker (`on_http_filter_scheduled`).
    pub fn scheduler(&self) -> Scheduler {
        // SAFETY: a live filter; the scheduler holds only a weak reference to it.
        Scheduler { raw: unsafe { envoy_dynamic_module_callback_http_filter_scheduler_new(self.raw) } }
    }
}

/// Envoy's scheduler of one filter: [`Scheduler::commit`] may be called from any thread and
/// posts `on_http_filter_scheduled` to the filter's worker — or nothing, once the filter is
/// gone. Deleted on drop.
pub struct Scheduler {
    raw: *mut c_void,
}

// SAFETY: Envoy's scheduler posts to the worker's dispatcher, which is thread-safe; it holds a
// weak reference to the filter, so committing after the filter is gone does nothing.
unsafe impl Send for Scheduler {}

impl Scheduler {
    pub fn commit(&self, event_id: u64) {
        // SAFETY: not deleted yet (drop is the only delete).
        unsafe { envoy_dynamic_module_callback_http_filter_scheduler_commit(self.raw, event_id) }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // SAFETY: created by scheduler_new, deleted once.
        unsafe { envoy_dynamic_module_callback_http_filter_scheduler_delete(self.raw) }
    }
}
