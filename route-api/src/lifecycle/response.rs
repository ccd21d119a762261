//! What a response says of its request, as a proxy or a picker sees it pass.

use crate::{LifecycleEvent, Usage};

/// How a request ended, for its last report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct End {
    /// `Done`, `Cancelled`, or `ErrorStatus`.
    pub event: LifecycleEvent,
    /// What its `usage` said.
    pub usage: Usage,
    /// The response's status, when it was an error.
    pub status: Option<u16>,
}

/// One response, watched: its first token (the first body bytes of a success: prefill is
/// over), its usage, and how it ended. The request is `done` when its response completed with
/// a success status (or one never seen: a picker may get the body without the headers),
/// `error_status` when it answered an error (the engine refused or failed it: no token came,
/// whatever its body), and `cancelled` otherwise — the client left, the upstream failed or
/// reset.
#[derive(Debug, Default)]
pub struct ResponseWatch {
    status: Option<u16>,
    first_token: bool,
    complete: bool,
    usage: Usage,
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
        self.usage.update(chunk);
        self.complete |= end_of_stream;
        !chunk.is_empty() && self.first_token()
    }

    /// The response is complete (its trailers passed, or the caller saw its end).
    pub fn completed(&mut self) {
        self.complete = true;
    }

    /// The first token is seen now (where no body will be seen, the headers are as close as
    /// it gets); true the first time only, and never for an error answer.
    pub fn first_token(&mut self) -> bool {
        self.error_status().is_none() && !std::mem::replace(&mut self.first_token, true)
    }

    /// The response's status, when it is an error.
    fn error_status(&self) -> Option<u16> {
        self.status.filter(|s| !(200..300).contains(s))
    }

    /// The request is over as far as the caller sees it: how it ended, the first time only.
    pub fn finish(&mut self) -> Option<End> {
        if std::mem::replace(&mut self.finished, true) {
            return None;
        }
        let status = self.error_status();
        let event = match status {
            Some(_) => LifecycleEvent::ErrorStatus,
            None if self.complete => LifecycleEvent::Done,
            None => LifecycleEvent::Cancelled,
        };
        Some(End { event, usage: self.usage, status })
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
        let usage = Usage { output_tokens: Some(7), cached_tokens: None };
        assert_eq!(w.finish(), Some(End { event: LifecycleEvent::Done, usage, status: None }));
        assert_eq!(w.finish(), None, "reported once");
    }

    #[test]
    fn what_does_not_complete_well_is_cancelled() {
        for (status, complete) in [(Some(200), false), (None, false)] {
            let mut w = ResponseWatch::default();
            w.headers(status, complete);
            assert_eq!(w.finish().unwrap().event, LifecycleEvent::Cancelled, "{status:?} {complete}");
        }
        // An error answer (a real engine's 404 for an unknown model, 400 for a prompt too
        // long) is no first token, however much body it has, and ends as what it is.
        for status in [400, 404, 500] {
            let mut w = ResponseWatch::default();
            w.headers(Some(status), false);
            assert!(!w.body(br#"{"error":{"message":"The model `x` does not exist."}}"#, true));
            assert!(!w.first_token());
            let end = w.finish().unwrap();
            assert_eq!((end.event, end.status), (LifecycleEvent::ErrorStatus, Some(status)));
        }
        // A body seen without headers (a picker skipping them), ended by trailers: done.
        let mut w = ResponseWatch::default();
        assert!(w.body(b"x", false));
        w.completed();
        assert!(w.complete);
        assert_eq!(w.finish().unwrap().event, LifecycleEvent::Done);
        let mut w = ResponseWatch::default();
        assert!(w.first_token() && !w.first_token());
    }
}
