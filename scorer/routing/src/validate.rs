//! Checking configuration values: what is out of range, named by its field.

/// A value out of range: its field, as a path from the part validated, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct Invalid {
    pub field: String,
    pub message: String,
}

impl Invalid {
    pub fn new(field: &str, message: impl Into<String>) -> Self {
        Self { field: field.to_string(), message: message.into() }
    }

    /// The same error, its field under `section` (`section.field`).
    pub fn under(self, section: &str) -> Self {
        let field = if self.field.is_empty() { section.to_string() } else { format!("{section}.{}", self.field) };
        Self { field, ..self }
    }
}

/// A finite number above zero (NaN and infinities are not).
pub fn positive(v: f64) -> bool {
    v.is_finite() && v > 0.0
}

/// A finite number at or above zero.
pub fn non_negative(v: f64) -> bool {
    v.is_finite() && v >= 0.0
}

/// `Err(Invalid)` for `field` unless `ok`.
pub fn check(ok: bool, field: &str, message: &str) -> Result<(), Invalid> {
    if ok { Ok(()) } else { Err(Invalid::new(field, message)) }
}
