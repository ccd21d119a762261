//! The gateway's span, as an in-proxy filter learns it: Envoy's tracer injects `traceparent`
//! only into the upstream request, after every filter, so the rendered bootstrap's
//! `header_mutation` filter, placed before kvgate's, names the gateway's span in
//! [`HEADER_GATEWAY_SPAN`] (`%TRACE_ID%-%SPAN_ID%`), and its sampling decision is read where
//! Envoy itself carries it: the trace reason packed into the request's `x-request-id` (a
//! UUID; `pack_trace_reason`, on by default), and the client's own `traceparent` flag.

/// The request header naming the gateway's span, `<trace id>-<span id>` in hex (see the
/// module's documentation); only Envoy's own filter sets it, and the proxy removes it.
pub const HEADER_GATEWAY_SPAN: &str = "x-kvgate-gateway-span";

/// Whether Envoy decided to trace the request, from the trace reason it packs into the
/// request id (the UUID's 15th character: `9` sampled, `a` forced, `b` asked by the
/// client, `4` not traced); `None` for an id that is no UUID (a client's own, kept).
fn envoy_traced(request_id: &str) -> Option<bool> {
    let id = request_id.as_bytes();
    let uuid = id.len() == 36 && [8, 13, 18, 23].iter().all(|&i| id[i] == b'-');
    uuid.then(|| matches!(id[14], b'9' | b'a' | b'b'))
}

/// Whether a W3C `traceparent` is sampled (`None`: none, or unreadable).
fn sampled(traceparent: &str) -> Option<bool> {
    let flags = traceparent.split('-').nth(3).filter(|_| traceparent.len() == 55)?;
    u8::from_str_radix(flags, 16).ok().map(|flags| flags & 1 == 1)
}

fn hex(text: &str, len: usize) -> bool {
    text.len() == len && text.bytes().all(|b| b.is_ascii_hexdigit()) && text.bytes().any(|b| b != b'0')
}

/// The `traceparent` naming the gateway's span, sampled as Envoy sampled it (traced, and
/// the client's parent sampled when it sent one); `None` without a readable span.
pub fn gateway_traceparent(gateway_span: &str, request_id: &str, client: Option<&str>) -> Option<String> {
    let (trace, span) = gateway_span.split_once('-')?;
    if !hex(trace, 32) || !hex(span, 16) {
        return None;
    }
    let traced = envoy_traced(request_id).unwrap_or(false) && client.and_then(sampled).unwrap_or(true);
    Some(format!("00-{trace}-{span}-{:02x}", u8::from(traced)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPAN: &str = "0af7651916cd43dd8448eb211c80319c-a9936d355fe2169d";

    #[test]
    fn the_gateway_span_is_sampled_as_envoy_decided() {
        let parent = |id: &str, client: Option<&str>| gateway_traceparent(SPAN, id, client);
        let sampled = "00-0af7651916cd43dd8448eb211c80319c-a9936d355fe2169d-01";
        // The ids Envoy made, tracing (9) or not (4): as seen from Envoy 1.40.
        assert_eq!(parent("a18eea28-1041-96e4-b2ec-0c8efb551d15", None).as_deref(), Some(sampled));
        assert_eq!(
            parent("c72555a3-cd2d-4616-9990-8ef2f8b6fd3a", None).as_deref(),
            Some(&*sampled.replace("-01", "-00"))
        );
        // Forced (a), or asked by the client (b).
        assert!(parent("c72555a3-cd2d-a616-9990-8ef2f8b6fd3a", None).unwrap().ends_with("-01"));
        assert!(parent("c72555a3-cd2d-b616-9990-8ef2f8b6fd3a", None).unwrap().ends_with("-01"));
        // A client's parent not sampled is not sampled below; a sampled one changes nothing.
        let client = |flags: &str| format!("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-{flags}");
        assert!(parent("a18eea28-1041-96e4-b2ec-0c8efb551d15", Some(&client("00"))).unwrap().ends_with("-00"));
        assert!(parent("a18eea28-1041-96e4-b2ec-0c8efb551d15", Some(&client("01"))).unwrap().ends_with("-01"));
        // An id that is not Envoy's: the decision is unknown, nothing is sampled.
        assert!(parent("my-own-request-id", None).unwrap().ends_with("-00"));
    }

    #[test]
    fn no_readable_span_no_parent() {
        let id = "a18eea28-1041-96e4-b2ec-0c8efb551d15";
        for span in [
            "",
            "-",
            "0af7651916cd43dd8448eb211c80319c",
            "00000000000000000000000000000000-a9936d355fe2169d",
            "0af7651916cd43dd8448eb211c80319c-a9936d355fe2169",
            "zzf7651916cd43dd8448eb211c80319c-a9936d355fe2169d",
        ] {
            assert_eq!(gateway_traceparent(span, id, None), None, "{span:?}");
        }
    }
}
