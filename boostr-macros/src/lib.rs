//! `#[attention]`: declare an attention variant.
//!
//! A thin front end: parse the struct with syn, hand it and the attribute to
//! the compiler in `kernels-spec`, and quote what it made. On error the
//! compiler's diagnostics become `compile_error!`s at their spans, next to a
//! stub implementation so one mistake does not cascade into many.
//!
//! See the `boostr-runtime` crate for the language and the semantics.

#![warn(missing_docs)]

mod expand;

use proc_macro::TokenStream;

/// Declare an attention variant: `#[attention(score = |s, b, h, q, kv| .., mask = |b, h, q, kv| .., tests = [..])]`
/// on a struct whose fields (f32, i32, u32, bool) are the variant's parameters.
#[proc_macro_attribute]
pub fn attention(attr: TokenStream, item: TokenStream) -> TokenStream {
    let item = syn::parse_macro_input!(item as syn::ItemStruct);
    expand::expand(attr.into(), item).into()
}
