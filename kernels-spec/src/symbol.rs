//! The keywords of the `#[attention(...)]` attribute and the language's
//! function names, as typed constants.

use std::fmt;

/// A keyword, compared against identifiers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Symbol(pub &'static str);

/// `score = |s, b, h, q, kv| ...`
pub const SCORE: Symbol = Symbol("score");
/// `score_grad = |s, b, h, q, kv| ...`
pub const SCORE_GRAD: Symbol = Symbol("score_grad");
/// `mask = |b, h, q, kv| ...`
pub const MASK: Symbol = Symbol("mask");
/// `sink = |b, h, q| ...`
pub const SINK: Symbol = Symbol("sink");
/// `dropout = p`
pub const DROPOUT: Symbol = Symbol("dropout");
/// `normalize = softmax | sigmoid`
pub const NORMALIZE: Symbol = Symbol("normalize");
/// `normalize = softmax`
pub const SOFTMAX: Symbol = Symbol("softmax");
/// `normalize = sigmoid`
pub const SIGMOID: Symbol = Symbol("sigmoid");
/// `tile(q = .., kv = ..)`
pub const TILE: Symbol = Symbol("tile");
/// `tests = [...]`
pub const TESTS: Symbol = Symbol("tests");
/// `tile(q = ..)`
pub const TILE_Q: Symbol = Symbol("q");
/// `tile(kv = ..)`
pub const TILE_KV: Symbol = Symbol("kv");

/// `#[tensor(elem, [dims])]` on a field.
pub const TENSOR: Symbol = Symbol("tensor");
/// `crate = "path"`: where the runtime crate is in the caller's crate.
pub const CRATE: Symbol = Symbol("crate");

/// Every attribute keyword, for "expected one of" messages.
pub const ATTRIBUTE_KEYS: &str =
    "`score`, `score_grad`, `mask`, `sink`, `dropout`, `normalize`, `tile`, `tests`, `crate`";

impl PartialEq<Symbol> for syn::Ident {
    fn eq(&self, word: &Symbol) -> bool {
        self == word.0
    }
}

impl PartialEq<Symbol> for &syn::Path {
    fn eq(&self, word: &Symbol) -> bool {
        self.is_ident(word.0)
    }
}

impl PartialEq<Symbol> for &syn::Ident {
    fn eq(&self, word: &Symbol) -> bool {
        *self == word.0
    }
}

impl fmt::Display for Symbol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}
