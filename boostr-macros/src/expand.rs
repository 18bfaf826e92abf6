//! Quote a compiled variant: the struct, its `Variant` impl and its tests.

use kernels_spec::emit::cpu::{Float, RustEmitter};
use kernels_spec::emit::gpu_lowerings;
use kernels_spec::ir::{Function, Program};
use kernels_spec::params::Encoding;
use kernels_spec::{Compiled, compile, explain};
use proc_macro2::TokenStream;
use quote::{format_ident, quote};

pub fn expand(attr: TokenStream, item: syn::ItemStruct) -> TokenStream {
    match compile(attr, &item) {
        Ok(compiled) => {
            // A debug switch: print every stage while compiling.
            if std::env::var_os("BOOSTR_DUMP").is_some() {
                eprintln!("{}", explain(&compiled.program));
            }
            let imp = variant_impl(&item, &compiled.program);
            let tests = tests(&item.ident, &compiled);
            quote!(#item #imp #tests)
        }
        Err(diags) => {
            let errors = diags.to_compile_errors();
            // A generic struct is itself an error; a stub impl for it would
            // only add unrelated trait-bound errors.
            let stub = if item.generics.params.is_empty() {
                stub_impl(&item)
            } else {
                TokenStream::new()
            };
            quote!(#errors #item #stub)
        }
    }
}

fn method(rust: &RustEmitter<'_>, name: &str, f: &Function) -> TokenStream {
    let name = format_ident!("{}", name);
    let params = rust.params(f);
    let ret = rust.ty(f.ret);
    let body = rust.body(f);
    quote! {
        #[inline(always)]
        #[allow(unused_parens, unused_braces, clippy::all)]
        fn #name(&self, #(#params),*) -> #ret #body
    }
}

fn variant_impl(item: &syn::ItemStruct, program: &Program) -> TokenStream {
    let ident = &item.ident;
    let (impl_generics, ty_generics, where_clause) = item.generics.split_for_impl();
    let name = ident.to_string();
    let f32s = RustEmitter::new(program, Float::F32);
    let f64s = RustEmitter::new(program, Float::F64);
    let score = method(&f32s, "score", &program.score);
    let score_grad = method(&f32s, "score_grad", &program.score_grad);
    let mask = method(&f32s, "mask", &program.mask);
    let score_f64 = method(&f64s, "score_f64", &program.score);
    let score_grad_f64 = method(&f64s, "score_grad_f64", &program.score_grad);
    let mask_f64 = method(&f64s, "mask_f64", &program.mask);
    let classify_params = f32s.params(&program.classify);
    let classify_body = f32s.body(&program.classify);
    let identity = program.score_is_identity;
    let has_mask = program.has_mask;
    let text = explain(program);
    let some = |size: Option<u32>| match size {
        Some(v) => quote!(::core::option::Option::Some(#v)),
        None => quote!(::core::option::Option::None),
    };
    let (tile_q, tile_kv) = (some(program.tile.0), some(program.tile.1));
    let lowerings = gpu_lowerings(program).into_iter().map(|(target, section)| {
        let target = format_ident!("{}", format!("{target:?}"));
        quote!(::boostr_runtime::Lowering {
            target: ::boostr_runtime::Target::#target,
            section: #section,
        })
    });
    let words = program.layout.slots().iter().map(|slot| {
        let name = format_ident!("{}", slot.name);
        let word = slot.word;
        let value = match slot.encoding() {
            Encoding::F32Bits => quote!(f32::to_bits(self.#name)),
            Encoding::I32Bits => quote!(self.#name as u32),
            Encoding::U32 => quote!(self.#name),
            Encoding::Bool => quote!(u32::from(self.#name)),
        };
        quote!(words.0[#word] = #value;)
    });
    quote! {
        impl #impl_generics ::boostr_runtime::Variant for #ident #ty_generics #where_clause {
            const NAME: &'static str = #name;
            const SCORE_IS_IDENTITY: bool = #identity;
            const HAS_MASK: bool = #has_mask;
            const TILE_Q: ::core::option::Option<u32> = #tile_q;
            const TILE_KV: ::core::option::Option<u32> = #tile_kv;
            #score
            #score_grad
            #mask
            #[inline]
            #[allow(unused_parens, unused_braces, clippy::all)]
            fn classify_tile(&self, #(#classify_params),*) -> ::boostr_runtime::TileClass {
                ::boostr_runtime::TileClass::from_code(#classify_body)
            }
            #score_f64
            #score_grad_f64
            #mask_f64
            fn compiled() -> ::boostr_runtime::CompiledStages {
                ::boostr_runtime::CompiledStages {
                    name: #name,
                    text: #text,
                    lowerings: &[#(#lowerings),*],
                }
            }
            #[allow(unused_mut, clippy::all)]
            fn param_words(&self) -> ::boostr_runtime::ParamWords {
                let mut words = ::boostr_runtime::ParamWords::ZERO;
                #(#words)*
                words
            }
        }
    }
}

fn stub_impl(item: &syn::ItemStruct) -> TokenStream {
    let ident = &item.ident;
    let name = ident.to_string();
    let (impl_generics, ty_generics, where_clause) = item.generics.split_for_impl();
    quote! {
        #[allow(unused_variables, clippy::all)]
        impl #impl_generics ::boostr_runtime::Variant for #ident #ty_generics #where_clause {
            const NAME: &'static str = #name;
            const SCORE_IS_IDENTITY: bool = true;
            const HAS_MASK: bool = false;
            fn score(&self, s: f32, b: i32, h: i32, q: i32, kv: i32) -> f32 { unreachable!() }
            fn score_grad(&self, s: f32, b: i32, h: i32, q: i32, kv: i32) -> f32 { unreachable!() }
            fn mask(&self, b: i32, h: i32, q: i32, kv: i32) -> bool { unreachable!() }
            fn classify_tile(&self, b: i32, h: i32, q_lo: i32, q_hi: i32, kv_lo: i32, kv_hi: i32)
                -> ::boostr_runtime::TileClass { unreachable!() }
            fn score_f64(&self, s: f64, b: i32, h: i32, q: i32, kv: i32) -> f64 { unreachable!() }
            fn score_grad_f64(&self, s: f64, b: i32, h: i32, q: i32, kv: i32) -> f64 { unreachable!() }
            fn mask_f64(&self, b: i32, h: i32, q: i32, kv: i32) -> bool { unreachable!() }
            fn compiled() -> ::boostr_runtime::CompiledStages { unreachable!() }
        }
    }
}

/// `tests = [..]`: per instance, the reference's own gradient check and the
/// variant on every backend compiled into `boostr-runtime`.
fn tests(ident: &syn::Ident, compiled: &Compiled) -> TokenStream {
    let instances = &compiled.spec.tests;
    if instances.is_empty() {
        return TokenStream::new();
    }
    let module = format_ident!("__boostr_tests_{}", ident);
    let names: Vec<syn::Ident> = (0..instances.len())
        .map(|i| format_ident!("instance_{}", i))
        .collect();
    quote! {
        #[cfg(test)]
        #[allow(non_snake_case)]
        mod #module {
            #[allow(unused_imports)]
            use super::*;

            #[test]
            fn reference_gradients_match_finite_differences() {
                #( ::boostr_runtime::testing::check_reference_gradients(&(#instances)); )*
            }

            ::boostr_runtime::__backend_tests! { #( #names => (#instances), )* }
        }
    }
}
