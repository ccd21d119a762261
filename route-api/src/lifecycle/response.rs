//! What a response says of its request, as a proxy or a picker sees it pass.

use crate::{LifecycleEvent, output_tokens};

/// How a request ended, for its last report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct End {
    /// `Done`, or `Cancelled`.
    pub event: LifecycleEvent,
    /// Output tokens, when the response carried `usage`.
    pub output_tokens: Option<u32>,
}

/// One response, watched: its first token (the first body bytes: prefill is over), its
/// output size, and whether it completed well. The request is `done` when its response
/// completed with a success status (or one never seen: a picker may get the body without the
/// headers), and `cancelled` otherwise — the client left, the upstream failed or reset, the
/// pod answered an error.
#[derive(Debug, Default)]
pub struct ResponseWatch {
    status: Option<u16>,
    first_token: bool,
    complete: bool,
    output_tokens: Option<u32>,
    finished: bool,
}

impl ResponseWatch {
    /// The response's headers passed; `end_of_stream`: no body follows.
    pub fn headers(&mut self, status: Option<u16>, end_of_stream: bool) {
        self.status = status;
        self.complete |= end_of_stream;
    }

    /// A body chunk passed; true if it holds the first token.
    pub fn body(&mut self, chunk: &[u8], end_of_stream: bool) -> bool {
        if let Some(n) = output_tokens(chunk) {
            self.output_tokens = Some(n);
        }
        self.complete |= end_of_stream;
        !chunk.is_empty() && self.first_token()
    }

    /// The response is complete (its trailers passed, or the caller saw its end).
    pub fn completed(&mut self) {
        self.complete = true;
    }

    /// The first token is seen now (where no body will be seen, the headers are as close as
    /// it gets); true the first time only.
    pub fn first_token(&mut self) -> bool {
        !std::mem::replace(&mut self.first_token, true)
    }

    /// Whether the response has completed.
    pub fn is_complete(&self) -> bool {
        self.complete
    }

    /// The request is over as far as the caller sees it: how it ended, the first time only.
    pub fn finish(&mut self) -> Option<End> {
        if std::mem::replace(&mut self.finished, true) {
            return None;
        }
        let ok = self.complete && self.status.is_none_or(|s| (200..300).contains(&s));
        let event = if ok { LifecycleEvent::Done } else { LifecycleEvent::Cancelled };
        Some(End { event, output_tokens: self.output_tokens })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_token_then_done_with_usage() {
        let mut w = ResponseWatch::default();
        w.headers(Some(200), false);
        assert!(!w.body(b"", false), "an empty chunk is no token");
        assert!(w.body(b"data: {\"choices\":[]}", false));
        assert!(!w.body(b"data: {\"usage\":{\"completion_tokens\":7}}", true), "only the first");
        assert_eq!(w.finish(), Some(End { event: LifecycleEvent::Done, output_tokens: Some(7) }));
        assert_eq!(w.finish(), None, "reported once");
    }

    #[test]
    fn what_does_not_complete_well_is_cancelled() {
        for (status, complete) in [(Some(500), true), (Some(200), false), (None, false)] {
            let mut w = ResponseWatch::default();
            w.headers(status, complete);
            assert_eq!(w.finish().unwrap().event, LifecycleEvent::Cancelled, "{status:?} {complete}");
        }
        // A body seen without headers (a picker skipping them), ended by trailers: done.
        let mut w = ResponseWatch::default();
        assert!(w.body(b"x", false));
        w.completed();
        assert!(w.is_complete());
        assert_eq!(w.finish().unwrap().event, LifecycleEvent::Done);
        let mut w = ResponseWatch::default();
        assert!(w.first_token() && !w.first_token());
    }
}
