//! Diagnostics: errors are collected, not thrown at the first one, and each
//! names the rule and points at the offending token.

use proc_macro2::{Span, TokenStream};
use std::fmt::Display;

/// A list of compile errors, each with the span it points at.
#[derive(Debug, Default)]
pub struct Diagnostics {
    errors: Vec<syn::Error>,
}

impl Diagnostics {
    /// An empty list.
    pub fn new() -> Self {
        Self::default()
    }

    /// Record an error at `span`.
    pub fn error(&mut self, span: Span, message: impl Display) {
        self.errors.push(syn::Error::new(span, message));
    }

    /// Record an error spanning the tokens of `tokens`.
    pub fn error_spanned(&mut self, tokens: impl quote::ToTokens, message: impl Display) {
        self.errors.push(syn::Error::new_spanned(tokens, message));
    }

    /// Record an already-built error.
    pub fn push(&mut self, error: syn::Error) {
        self.errors.push(error);
    }

    /// Whether no error was recorded.
    pub fn is_empty(&self) -> bool {
        self.errors.is_empty()
    }

    /// The messages, in order (for tests).
    pub fn messages(&self) -> Vec<String> {
        self.errors.iter().map(|e| e.to_string()).collect()
    }

    /// `Ok(value)` if nothing was recorded, else every error.
    pub fn finish<T>(self, value: T) -> Result<T, Diagnostics> {
        if self.errors.is_empty() {
            Ok(value)
        } else {
            Err(self)
        }
    }

    /// Every error as a `compile_error!` invocation at its span.
    pub fn to_compile_errors(&self) -> TokenStream {
        self.errors
            .iter()
            .map(syn::Error::to_compile_error)
            .collect()
    }
}
