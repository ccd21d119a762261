//! `sync:`, the replicas' shared bookings over NATS (see `crate::sync`).

use kvgate_routing::validate::{Invalid, check};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// NATS server URLs (`nats://` or `tls://`): one, several comma-separated, or a list.
#[derive(Clone, Debug, PartialEq, Eq, schemars::JsonSchema, derive_more::Display)]
#[schemars(with = "String")]
#[display("{}", _0.join(","))]
pub struct NatsUrls(Vec<String>);

impl<'de> Deserialize<'de> for NatsUrls {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Joined(String),
            Listed(Vec<String>),
        }
        let urls: Vec<String> = match Written::deserialize(deserializer)? {
            Written::Joined(text) => text.split(',').map(|u| u.trim().to_string()).collect(),
            Written::Listed(urls) => urls.into_iter().map(|u| u.trim().to_string()).collect(),
        };
        match urls.iter().find(|u| !(u.starts_with("nats://") || u.starts_with("tls://"))) {
            Some(bad) => Err(serde::de::Error::custom(format!("{bad:?} is not a nats:// or tls:// URL"))),
            None if urls.is_empty() => Err(serde::de::Error::custom("no NATS URL")),
            None => Ok(NatsUrls(urls)),
        }
    }
}

impl NatsUrls {
    pub fn urls(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(String::as_str)
    }
}

/// Active-active replicas: each publishes its booking changes (decisions, first tokens,
/// completions, moved bookings) on NATS and applies the others' as its own, so every
/// replica decides on the whole fleet's requests in flight. A decision never waits for the
/// bus; without it each replica routes on its own bookings (counted in metrics).
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SyncSection {
    /// NATS server URL, e.g. `nats://nats.kvgate:4222` (several, comma-separated or as a
    /// list, for a NATS cluster).
    pub nats: NatsUrls,
    /// Subject prefix shared by the replicas of one fleet (`<prefix>.bookings`,
    /// `<prefix>.snapshot.<replica>`): two fleets on one NATS use two prefixes.
    #[serde(default = "default_subject_prefix")]
    pub subject_prefix: String,
    /// This replica's name, unique in the fleet (default: `$HOSTNAME`, the pod's name in
    /// Kubernetes).
    pub replica_id: Option<String>,
    /// A replica publishes at least this often (a heartbeat when it has nothing to say).
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// A replica not heard from for this long has left: its bookings are dropped.
    #[serde(default = "default_replica_timeout_ms")]
    pub replica_timeout_ms: u64,
    /// At start, how long to wait at most for the other replicas' bookings before
    /// `/readyz` answers ready (a replica that joins decides on the fleet's state).
    #[serde(default = "default_join_wait_ms")]
    pub join_wait_ms: u64,
    /// NATS token authentication: a file holding the token (a mounted Secret), read at
    /// start. Any client that can reach an unauthenticated NATS can inject bookings.
    pub token_file: Option<PathBuf>,
    /// NATS user authentication: the user, whose password is in `password_file`.
    pub user: Option<String>,
    /// The file holding `user`'s password (a mounted Secret), read at start.
    pub password_file: Option<PathBuf>,
    /// TLS to NATS: the connection is refused unless the server speaks TLS with a
    /// certificate this replica trusts.
    pub tls: Option<SyncTls>,
}

/// TLS to NATS (`sync.tls`).
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SyncTls {
    /// PEM file of the CA that signed the NATS server's certificate (absent: the system's
    /// roots).
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate, for a server that verifies its clients (with `key_file`).
    pub cert_file: Option<PathBuf>,
    /// PEM private key of `cert_file`.
    pub key_file: Option<PathBuf>,
}

fn default_subject_prefix() -> String {
    "kvgate".into()
}

fn default_heartbeat_ms() -> u64 {
    500
}

fn default_replica_timeout_ms() -> u64 {
    3000
}

fn default_join_wait_ms() -> u64 {
    2000
}

impl SyncSection {
    /// The configured replica id, else `$HOSTNAME`, else one made of the process id.
    pub fn replica(&self) -> String {
        self.replica_id
            .clone()
            .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()))
            .unwrap_or_else(|| format!("replica-{}", std::process::id()))
    }
}

/// A NATS subject token: no separators, wildcards or whitespace.
fn subject_token(s: &str) -> bool {
    !s.is_empty() && !s.chars().any(|c| c == '.' || c == '*' || c == '>' || c.is_whitespace())
}

impl SyncSection {
    pub(super) fn check(&self) -> Result<(), Invalid> {
        let prefix = self.subject_prefix.split('.').all(subject_token);
        check(prefix, "subject_prefix", "must be NATS subject tokens joined by '.', without wildcards")?;
        let replica = subject_token(&self.replica());
        check(replica, "replica_id", "must be one NATS subject token (no '.', '*', '>' or spaces)")?;
        let timeout = self.heartbeat_ms > 0 && self.replica_timeout_ms >= 2 * self.heartbeat_ms;
        check(timeout, "replica_timeout_ms", "must be at least twice a positive heartbeat_ms")?;
        check(self.token_file.is_none() || self.user.is_none(), "token_file", "use either token_file or user")?;
        check(self.user.is_none() || self.password_file.is_some(), "password_file", "user needs its password_file")?;
        check(self.password_file.is_none() || self.user.is_some(), "user", "password_file needs its user")?;
        if let Some(tls) = &self.tls {
            let pair = tls.cert_file.is_some() == tls.key_file.is_some();
            check(pair, "tls.key_file", "cert_file and key_file go together")?;
        }
        Ok(())
    }

    /// The files this section names, by field: they must exist at start.
    pub(super) fn files(&self) -> Vec<(&'static str, &Path)> {
        let tls = self.tls.as_ref();
        [
            ("sync.token_file", self.token_file.as_deref()),
            ("sync.password_file", self.password_file.as_deref()),
            ("sync.tls.ca_file", tls.and_then(|t| t.ca_file.as_deref())),
            ("sync.tls.cert_file", tls.and_then(|t| t.cert_file.as_deref())),
            ("sync.tls.key_file", tls.and_then(|t| t.key_file.as_deref())),
        ]
        .into_iter()
        .filter_map(|(field, path)| Some((field, path?)))
        .collect()
    }
}
