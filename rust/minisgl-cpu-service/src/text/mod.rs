//! The service's text layer: tokenizer, chat templates and incremental detokenization, in pure
//! Rust, giving what the Python path (`minisgl.tokenizer`) gives.

pub mod bytetable;
pub mod chat;
pub mod cli;
pub mod detok;
pub mod fastbpe;
#[cfg(test)]
mod fixture;
pub mod model;
pub mod pyfmt;
pub mod tokenizer;

use std::fmt;

pub use chat::ChatTemplate;
pub use cli::run_text_cli;
pub use detok::{DecodeState, Detokenizer, Released};
pub use model::TextModel;
pub use tokenizer::Tokenizer;

/// A text-layer failure, as a message for the client (e.g. a 400 "cannot tokenize the
/// prompt: ...").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextError(pub String);

impl TextError {
    pub fn new(msg: impl Into<String>) -> Self {
        Self(msg.into())
    }
}

impl fmt::Display for TextError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TextError {}
