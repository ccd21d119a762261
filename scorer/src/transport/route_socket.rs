//! The route socket: the route protocol's messages framed on a plain connection to the API
//! port or the route socket path (see [`kvgate_route_api::ROUTE_SOCKET_PREFACE`]) — what the
//! filter's native module uses. Same calls, same answers, same order of events as the gRPC
//! route stream ([`route_calls`]), without HTTP/2's framing, flow control and header
//! compression on either side. Served on the thread that accepted the connection; a call
//! decided at once is answered without a task of its own, and answers ready together go out
//! in one write. A caller of another protocol version is refused (closed, and said in the log).

use super::route_calls::{self, admission_notices, take_call};
use crate::picking::{Picker, PickingService};
use kvgate_route_api::{Frames, ROUTE_SOCKET_PREFACE, ROUTE_SOCKET_PREFACE_START, RouteAnswer, RouteCall, frame};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

/// Answers a caller may have ready before they are written.
const ANSWERS_QUEUED: usize = 1024;

/// Bytes read from the socket at a time (a long prompt's call arrives in a few reads).
const READ_BYTES: usize = 64 << 10;

/// Serves one route socket (its preface not read yet) until the caller closes it or sends
/// something that is not a route call.
pub async fn serve(picker: Picker, socket: impl AsyncRead + AsyncWrite + Send + 'static) {
    let (mut reader, mut writer) = tokio::io::split(socket);
    let mut preface = [0u8; ROUTE_SOCKET_PREFACE.len()];
    match reader.read_exact(&mut preface).await {
        Ok(_) if preface == ROUTE_SOCKET_PREFACE => {}
        Ok(_) if preface.starts_with(ROUTE_SOCKET_PREFACE_START) => {
            let version = String::from_utf8_lossy(&preface[ROUTE_SOCKET_PREFACE_START.len()..]);
            return route_calls::refused_version(&format!("route socket of protocol {}", version.trim_end()));
        }
        _ => return,
    }
    picker.metrics().route_streams.inc();
    let (answers, mut ready) = mpsc::channel::<RouteAnswer>(ANSWERS_QUEUED);
    let writing = tokio::spawn(async move {
        let mut out = Vec::new();
        while let Some(answer) = ready.recv().await {
            out.clear();
            frame(&answer, &mut out);
            while let Ok(answer) = ready.try_recv() {
                frame(&answer, &mut out);
            }
            if let Err(e) = writer.write_all(&out).await {
                tracing::debug!("route socket: cannot answer: {e}");
                break;
            }
        }
    });
    let notices = admission_notices(&picker, answers.clone(), std::convert::identity);
    let mut frames = Frames::default();
    'reading: loop {
        match reader.read_buf(frames.spare(READ_BYTES)).await {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => {
                tracing::debug!("route socket ended: {e}");
                break;
            }
        }
        loop {
            let call = match frames.message::<RouteCall>() {
                Ok(Some(call)) => call,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!("route socket closed: {e}");
                    break 'reading;
                }
            };
            let Some(answer) = take_call(&picker, call) else { continue };
            // Most calls are decided at once: answered here, without a task of their own;
            // one that waits (for room, or for a long body's preparation) gets one.
            let mut answer = Box::pin(answer);
            match futures::poll!(answer.as_mut()) {
                std::task::Poll::Ready(answer) => {
                    if answers.send(answer).await.is_err() {
                        break 'reading;
                    }
                }
                std::task::Poll::Pending => {
                    let answers = answers.clone();
                    tokio::spawn(async move {
                        // The caller gone: its lifecycle reports (or their absence) settle the booking.
                        let _ = answers.send(answer.await).await;
                    });
                }
            }
        }
    }
    if let Some(notices) = notices {
        notices.abort();
    }
    drop(answers);
    // Answers still being decided go out before the socket closes, if the caller still reads.
    let _ = writing.await;
    picker.metrics().route_streams.dec();
}

/// True when a connection's first bytes (as many as have arrived) can be a route socket's
/// preface, of any version: it then gets no HTTP.
pub fn may_be_preface(first: &[u8]) -> bool {
    let n = first.len().min(ROUTE_SOCKET_PREFACE_START.len());
    n > 0 && first[..n] == ROUTE_SOCKET_PREFACE_START[..n]
}
