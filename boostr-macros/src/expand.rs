//! Quote a compiled variant: the struct, its `Variant` and `HostVariant`
//! impls (with captured tensors, a host type carrying them), and its tests.

use kernels_spec::emit::cpu::{Float, RustEmitter};
use kernels_spec::emit::gpu_lowerings;
use kernels_spec::ir::{DimDecl, Function, Holds, Program, Size, SizeForm, Ty};
use kernels_spec::params::{Encoding, SlotKind};
use kernels_spec::symbol;
use kernels_spec::{Compiled, compile, explain};
use proc_macro2::TokenStream;
use quote::{ToTokens, format_ident, quote};

pub fn expand(attr: TokenStream, item: syn::ItemStruct) -> TokenStream {
    // The runtime crate's path in the caller's crate: `crate = ".."`, as
    // serde's, for a caller that renames or re-exports it.
    let krate = match kernels_spec::parse::crate_path(attr.clone()) {
        Some(path) => path.to_token_stream(),
        None => quote!(::boostr_runtime),
    };
    let krate = &krate;
    let result = compile(attr, &item);
    let out = without_tensor_attrs(&item);
    match result {
        Ok(compiled) => {
            // A debug switch: print every stage while compiling.
            if std::env::var_os("BOOSTR_DUMP").is_some() {
                eprintln!("{}", explain(&compiled.program));
            }
            let imp = variant_impl(krate, &item, &compiled.program);
            let tests = tests(krate, &item, &compiled);
            quote!(#out #imp #tests)
        }
        Err(diags) => {
            let errors = diags.to_compile_errors();
            let stub = stub_impl(krate, &item);
            quote!(#errors #out #stub)
        }
    }
}

/// The struct as written, without its `#[tensor(..)]` field attributes
/// (which only this macro reads).
fn without_tensor_attrs(item: &syn::ItemStruct) -> syn::ItemStruct {
    let mut out = item.clone();
    if let syn::Fields::Named(fields) = &mut out.fields {
        for f in &mut fields.named {
            f.attrs.retain(|a| a.path() != symbol::TENSOR);
        }
    }
    out
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

fn elem_type(ty: Ty) -> TokenStream {
    match ty {
        Ty::I32 => quote!(i32),
        Ty::U32 => quote!(u32),
        _ => quote!(f32),
    }
}

/// The `HostVariant` methods: the functions, as Rust over `self`'s fields.
fn host_methods(krate: &TokenStream, program: &Program) -> TokenStream {
    let f32s = RustEmitter::new(program, Float::F32).with_crate(krate.clone());
    let f64s = RustEmitter::new(program, Float::F64).with_crate(krate.clone());
    let score = method(&f32s, "score", &program.score);
    let score_grad = method(&f32s, "score_grad", &program.score_grad);
    let mask = method(&f32s, "mask", &program.mask);
    let score_f64 = method(&f64s, "score_f64", &program.score);
    let score_grad_f64 = method(&f64s, "score_grad_f64", &program.score_grad);
    let mask_exact = method(
        &RustEmitter::exact_f32(program).with_crate(krate.clone()),
        "mask_exact",
        &program.mask,
    );
    let sink = method(&f32s, "sink", &program.sink);
    let sink_f64 = method(&f64s, "sink_f64", &program.sink);
    let classify_params = f32s.params(&program.classify);
    let classify_body = f32s.body(&program.classify);
    let name = &program.name;
    let identity = program.score_is_identity;
    let has_mask = program.has_mask;
    let grad_is_one = program.score_grad_is_one;
    let grad_given = program.score_grad_given;
    let weights = weights(krate, program.weights);
    let checked = |f: &Function| {
        let mut found = false;
        f.body.walk(&mut |e| {
            found |= matches!(&e.kind, kernels_spec::ir::ExprKind::Read(r)
                if r.checks.iter().any(|c| c.any()))
        });
        found
    };
    let score_checks = checked(&program.score) || checked(&program.score_grad);
    let reads_batch = |f: &Function| {
        let mut found = false;
        f.body.walk(&mut |e| {
            found |= matches!(
                &e.kind,
                kernels_spec::ir::ExprKind::Arg(kernels_spec::ir::Arg::B)
            )
        });
        found
    };
    let functions = [
        &program.score,
        &program.score_grad,
        &program.mask,
        &program.sink,
        &program.dropout,
    ];
    let batch_free = program.tensors.is_empty() && !functions.into_iter().any(reads_batch);
    let learnable = learnable_methods(program);
    let errors = program.tensors.iter().map(|t| {
        let field = format_ident!("{}", t.name);
        let name = &t.name;
        quote!(.or_else(|| self.#field.error(#name)))
    });
    quote! {
        const NAME: &'static str = #name;
        const SCORE_IS_IDENTITY: bool = #identity;
        const HAS_MASK: bool = #has_mask;
        const SCORE_GRAD_IS_ONE: bool = #grad_is_one;
        const SCORE_GRAD_GIVEN: bool = #grad_given;
        const WEIGHTS: #krate::variant::Weights = #weights;
        const SCORE_CHECKS_READS: bool = #score_checks;
        const BATCH_FREE: bool = #batch_free;
        #score
        #score_grad
        #mask
        #[inline]
        #[allow(unused_parens, unused_braces, clippy::all)]
        fn classify_tile(&self, #(#classify_params),*) -> #krate::variant::TileClass {
            #krate::variant::TileClass::from_code(#classify_body)
        }
        #score_f64
        #score_grad_f64
        #mask_exact
        #sink
        #sink_f64
        fn out_of_range(&self) -> ::core::option::Option<#krate::Error> {
            ::core::option::Option::None #(#errors)*
        }
        #learnable
    }
}

/// `weights` as a constant expression.
fn weights(krate: &TokenStream, weights: kernels_spec::ir::Weights) -> TokenStream {
    let normalize = format_ident!("{}", weights.normalize.variant_name());
    let (sink, dropout) = (weights.sink, weights.dropout);
    quote! {
        #krate::variant::Weights::new(#krate::variant::Normalize::#normalize, #sink, #dropout)
    }
}

/// The name of a learnable site's helper: `__boostr_site3_grad`.
fn site_fn(site: u32, what: &str) -> syn::Ident {
    format_ident!("__boostr_site{}_{}", site, what)
}

/// The inherent helpers of the learnable reads: per site, where it lands
/// (`index`, `index_f64`) and its derivative (`grad`, `grad_f64`).
fn learnable_helpers(krate: &TokenStream, program: &Program) -> TokenStream {
    let f32s = RustEmitter::new(program, Float::F32).with_crate(krate.clone());
    let f64s = RustEmitter::new(program, Float::F64).with_crate(krate.clone());
    let helpers = program.learnable_sites.iter().map(|l| {
        let site = l.site;
        let index = method(&f32s, &site_fn(site, "index").to_string(), &l.index);
        let index_f64 = method(&f64s, &site_fn(site, "index_f64").to_string(), &l.index);
        let grad = method(&f32s, &site_fn(site, "grad").to_string(), &l.grad);
        let grad_f64 = method(&f64s, &site_fn(site, "grad_f64").to_string(), &l.grad);
        quote!(#index #index_f64 #grad #grad_f64)
    });
    quote!(#(#helpers)*)
}

/// The `HostVariant` items of the learnable tensors: their count and sizes,
/// and the accumulation of `dz · ∂f/∂read` at every learnable read of
/// `score` and `sink`.
fn learnable_methods(program: &Program) -> TokenStream {
    if program.learnable.is_empty() {
        return TokenStream::new();
    }
    let count = program.learnable.len();
    let fields: Vec<syn::Ident> = program
        .learnable
        .iter()
        .map(|&t| format_ident!("{}", program.tensors[t].name))
        .collect();
    let slots: Vec<usize> = (0..count).collect();
    // One accumulation per site; `args` are the function's arguments.
    let accumulate = |in_sink: bool, f64: bool| {
        let sites = program
            .learnable_sites
            .iter()
            .filter(|l| l.in_sink == in_sink);
        let adds = sites.map(|l| {
            let slot = l.slot;
            let (index, grad) = if f64 {
                (site_fn(l.site, "index_f64"), site_fn(l.site, "grad_f64"))
            } else {
                (site_fn(l.site, "index"), site_fn(l.site, "grad"))
            };
            let args = if in_sink {
                quote!(b, h, q)
            } else {
                quote!(s, b, h, q, kv)
            };
            let term = if f64 {
                quote!({
                    let t = dz * self.#grad(#args);
                    if abs { t.abs() } else { t }
                })
            } else {
                quote!(dz * self.#grad(#args))
            };
            quote! {
                if let ::core::option::Option::Some(g) = grads.get_mut(#slot) {
                    if !g.is_empty() {
                        let at = self.#index(#args);
                        if at >= 0 {
                            if let ::core::option::Option::Some(x) = g.get_mut(at as usize) {
                                *x += #term;
                            }
                        }
                    }
                }
            }
        });
        quote!(#(#adds)*)
    };
    let (score, score_f64) = (accumulate(false, false), accumulate(false, true));
    let (sink, sink_f64) = (accumulate(true, false), accumulate(true, true));
    let in_score = program.learnable_sites.iter().any(|l| !l.in_sink);
    let by_difference = program.score_grads_by_difference();
    quote! {
        const LEARNABLE: usize = #count;
        const SCORE_READS_LEARNABLE: bool = #in_score;
        const SCORE_GRADS_BY_DIFFERENCE: bool = #by_difference;
        fn learnable_numel(&self, slot: usize) -> usize {
            match slot {
                #(#slots => self.#fields.numel(),)*
                _ => 0,
            }
        }
        #[inline(always)]
        #[allow(unused_variables, clippy::all)]
        fn score_tensor_grads(
            &self, s: f32, b: i32, h: i32, q: i32, kv: i32, dz: f32, grads: &mut [&mut [f32]],
        ) {
            #score
        }
        #[allow(unused_variables, clippy::all)]
        fn score_tensor_grads_f64(
            &self, s: f64, b: i32, h: i32, q: i32, kv: i32, dz: f64, abs: bool,
            grads: &mut [&mut [f64]],
        ) {
            #score_f64
        }
        #[allow(unused_variables, clippy::all)]
        fn sink_tensor_grads(&self, b: i32, h: i32, q: i32, dz: f32, grads: &mut [&mut [f32]]) {
            #sink
        }
        #[allow(unused_variables, clippy::all)]
        fn sink_tensor_grads_f64(
            &self, b: i32, h: i32, q: i32, dz: f64, abs: bool, grads: &mut [&mut [f64]],
        ) {
            #sink_f64
        }
        fn perturb_learnable(&mut self, slot: usize, at: usize, delta: f32) -> f32 {
            match slot {
                #(#slots => self.#fields.perturb(at, delta),)*
                _ => 0.0,
            }
        }
    }
}

/// A tensor field as a `&Tensor<R>`: a learnable `Var<R>` through its
/// tensor.
fn tensor_of(field: &syn::Ident, learnable: bool) -> TokenStream {
    if learnable {
        quote!(self.#field.tensor())
    } else {
        quote!(&self.#field)
    }
}

fn dim_decl(krate: &TokenStream, d: DimDecl) -> TokenStream {
    match d {
        DimDecl::Size(s) => {
            let s = format_ident!(
                "{}",
                match s {
                    Size::B => "B",
                    Size::Hq => "Hq",
                    Size::Hkv => "Hkv",
                    Size::Sq => "Sq",
                    Size::Sk => "Sk",
                }
            );
            quote!(#krate::capture::DimDecl::Size(#krate::capture::Size::#s))
        }
        DimDecl::Fixed(n) => quote!(#krate::capture::DimDecl::Fixed(#n)),
        DimDecl::Any => quote!(#krate::capture::DimDecl::Any),
    }
}

fn size_form(krate: &TokenStream, f: &SizeForm) -> TokenStream {
    let (constant, per_size) = (f.constant, f.per_size);
    quote!(#krate::capture::SizeForm {
        constant: #constant,
        per_size: [#(#per_size),*],
    })
}

/// The where clause of a variant with tensors: the struct is generic over
/// its runtime, and the impl holds wherever the struct has what a variant
/// needs (a runtime with attention kernels, whose derives apply).
fn variant_where(krate: &TokenStream, item: &syn::ItemStruct) -> syn::WhereClause {
    let mut generics = item.generics.clone();
    let runtime = item.generics.type_params().next().map(|t| t.ident.clone());
    let w = generics.make_where_clause();
    if let Some(runtime) = runtime {
        w.predicates
            .push(syn::parse_quote!(#runtime: #krate::AttentionRuntime));
    }
    w.predicates.push(syn::parse_quote!(
        Self: ::core::clone::Clone
            + ::core::fmt::Debug
            + ::core::marker::Send
            + ::core::marker::Sync
            + 'static
    ));
    w.clone()
}

fn variant_impl(krate: &TokenStream, item: &syn::ItemStruct, program: &Program) -> TokenStream {
    let ident = &item.ident;
    let vis = &item.vis;
    let (impl_generics, ty_generics, where_clause) = item.generics.split_for_impl();
    let name = ident.to_string();
    let some = |size: Option<u32>| match size {
        Some(v) => quote!(::core::option::Option::Some(#v)),
        None => quote!(::core::option::Option::None),
    };
    let (tile_q, tile_kv) = (some(program.tile.0), some(program.tile.1));
    let host_methods = host_methods(krate, program);

    let param_words = param_words(krate, program);
    let compiled = compiled(krate, program, &name);
    let dropout = if program.weights.dropout {
        method(
            &RustEmitter::new(program, Float::F32).with_crate(krate.clone()),
            "dropout",
            &program.dropout,
        )
    } else {
        TokenStream::new()
    };
    let consts = quote! {
        const NAME: &'static str = #name;
        const TILE_Q: ::core::option::Option<u32> = #tile_q;
        const TILE_KV: ::core::option::Option<u32> = #tile_kv;
        #dropout
    };

    if program.tensors.is_empty() {
        // No tensors: the variant is its own host.
        return quote! {
            impl #impl_generics #krate::HostVariant for #ident #ty_generics #where_clause {
                #host_methods
            }
            impl #impl_generics #krate::Variant for #ident #ty_generics #where_clause {
                #consts
                type Host = Self;
                fn host(&self, _: &#krate::Problem) -> #krate::Result<Self> {
                    ::core::result::Result::Ok(::core::clone::Clone::clone(self))
                }
                #compiled
                #param_words
            }
        };
    }

    let host = format_ident!("__BoostrHost{}", ident);
    let variant_where = variant_where(krate, item);
    let tensor_fields: Vec<syn::Ident> = program
        .tensors
        .iter()
        .map(|t| format_ident!("{}", t.name))
        .collect();
    let decls = tensor_decls(krate, program);
    let summaries = program.summaries.iter().map(|(t, a)| quote!((#t, #a)));
    let read_checks = read_checks(krate, program);
    let scalar_fields: Vec<syn::Ident> = program
        .params
        .iter()
        .map(|p| format_ident!("{}", p.name))
        .collect();
    let (scalar_types, tensor_types) = host_field_types(krate, program);
    let (captured, copied) = (
        capture_fields(krate, program, quote!(capture)),
        capture_fields(krate, program, quote!(copy)),
    );
    let captures = program.tensors.iter().enumerate().map(|(i, t)| {
        let tensor = tensor_of(&format_ident!("{}", t.name), t.learnable);
        quote!(#krate::capture::Capture::new(
            &<Self as #krate::Variant>::TENSORS[#i],
            #tensor,
        ))
    });
    let learnable_slots = &program.learnable;
    let learnables = program.learnable.iter().map(|&i| {
        let field = format_ident!("{}", program.tensors[i].name);
        quote!(#krate::capture::Learnable::new(
            &<Self as #krate::Variant>::TENSORS[#i],
            &self.#field,
        ))
    });
    let helpers = learnable_helpers(krate, program);
    let host_doc = format!(
        "`{name}` with its captured tensors checked and on the host: what the CPU kernels \
         and the reference evaluate."
    );
    quote! {
        #[doc = #host_doc]
        #[doc(hidden)]
        #[derive(Debug)]
        #[allow(non_camel_case_types)]
        #vis struct #host {
            #(#scalar_fields: #scalar_types,)*
            #(#tensor_fields: #tensor_types,)*
        }
        impl #krate::HostVariant for #host {
            #host_methods
        }
        impl #host {
            #helpers
        }
        impl #impl_generics #krate::Variant for #ident #ty_generics #variant_where {
            #consts
            const TENSORS: &'static [#krate::capture::TensorDecl] = &[#(#decls),*];
            const SUMMARIES: &'static [(usize, usize)] = &[#(#summaries),*];
            const READ_CHECKS: &'static [#krate::capture::ReadCheck] = &[#(#read_checks),*];
            type Host = #host;
            fn host(&self, p: &#krate::Problem) -> #krate::Result<#host> {
                ::core::result::Result::Ok(#host {
                    #(#scalar_fields: self.#scalar_fields,)*
                    #(#captured,)*
                })
            }
            fn host_copy(
                &self,
                p: &#krate::Problem,
            ) -> #krate::Result<#host> {
                ::core::result::Result::Ok(#host {
                    #(#scalar_fields: self.#scalar_fields,)*
                    #(#copied,)*
                })
            }
            fn captures(&self) -> ::std::vec::Vec<#krate::capture::Capture<'_>> {
                ::std::vec![#(#captures),*]
            }
            const LEARNABLE: &'static [usize] = &[#(#learnable_slots),*];
            fn learnables(&self) -> ::std::vec::Vec<#krate::capture::Learnable<'_>> {
                ::std::vec![#(#learnables),*]
            }
            #compiled
            #param_words
        }
    }
}

/// The variant's `TENSORS`: each captured tensor's declaration.
fn tensor_decls(krate: &TokenStream, program: &Program) -> Vec<TokenStream> {
    program
        .tensors
        .iter()
        .map(|t| {
            let name = &t.name;
            let elem = match t.elem {
                Ty::I32 => quote!(I32),
                Ty::U32 => quote!(U32),
                _ => quote!(F32),
            };
            let given = match t.given {
                kernels_spec::ir::Given::Elem => quote!(Elem),
                kernels_spec::ir::Given::Bool => quote!(Bool),
                kernels_spec::ir::Given::I64 => quote!(I64),
            };
            let dims = t.dims.iter().map(|d| dim_decl(krate, *d));
            quote!(#krate::capture::TensorDecl {
                name: #name,
                elem: #krate::capture::Ty::#elem,
                given: #krate::capture::Given::#given,
                dims: &[#(#dims),*],
            })
        })
        .collect()
}

/// The Rust types of the host struct's scalar and tensor fields.
fn host_field_types(
    krate: &TokenStream,
    program: &Program,
) -> (Vec<TokenStream>, Vec<TokenStream>) {
    let scalar_types: Vec<TokenStream> = program
        .params
        .iter()
        .map(|p| match p.ty {
            Ty::Bool => quote!(bool),
            other => elem_type(other),
        })
        .collect();
    let tensor_types: Vec<TokenStream> = program
        .tensors
        .iter()
        .map(|t| {
            let elem = elem_type(t.elem);
            let rank = t.dims.len();
            quote!(#krate::capture::HostTensor<#elem, #rank>)
        })
        .collect();
    (scalar_types, tensor_types)
}

/// The variant's `param_words`: scalars by their encoding, tensors by
/// their shapes and place in the arena.
fn param_words(krate: &TokenStream, program: &Program) -> TokenStream {
    let mut words = Vec::new();
    let mut tensor_slots = Vec::new();
    for slot in program.layout.slots() {
        let field = format_ident!("{}", slot.name);
        let word = slot.word;
        match (slot.kind, slot.encoding()) {
            (SlotKind::Scalar(_), Some(e)) => {
                let value = match e {
                    Encoding::F32Bits => quote!(f32::to_bits(self.#field)),
                    Encoding::I32Bits => quote!(self.#field as u32),
                    Encoding::U32 => quote!(self.#field),
                    Encoding::Bool => quote!(u32::from(self.#field)),
                };
                words.push(quote!(words.0[#word] = #value;));
            }
            (SlotKind::Tensor { rank, .. }, _) => tensor_slots.push(quote!((#word, #rank))),
            (_, None) => {}
        }
    }
    let tensor_fields: Vec<syn::Ident> = program
        .tensors
        .iter()
        .map(|t| format_ident!("{}", t.name))
        .collect();
    if !tensor_fields.is_empty() {
        words.push(quote! {
            #krate::capture::place_tensors(
                &mut words,
                &[#(#tensor_slots),*],
                &[#(self.#tensor_fields.shape()),*],
                <Self as #krate::Variant>::SUMMARIES,
                <Self as #krate::Variant>::LEARNABLE,
            );
        });
    }
    quote! {
        #[allow(unused_mut, clippy::all)]
        fn param_words(&self) -> #krate::variant::ParamWords {
            let mut words = #krate::variant::ParamWords::ZERO;
            #(#words)*
            words
        }
    }
}

/// The variant's `compiled`: what the compiler made of it.
fn compiled(krate: &TokenStream, program: &Program, name: &str) -> TokenStream {
    let text = explain(program);
    let summary = kernels_spec::summary(program);
    let lowerings = gpu_lowerings(program).into_iter().map(|(target, section)| {
        let target = format_ident!("{}", format!("{target:?}"));
        quote!(#krate::variant::Lowering {
            target: #krate::variant::Target::#target,
            section: #section,
        })
    });
    let classify_loops = program.classify_loop_iterations();
    quote! {
        fn compiled() -> #krate::variant::CompiledStages {
            #krate::variant::CompiledStages {
                name: #name,
                text: #text,
                summary: #summary,
                lowerings: &[#(#lowerings),*],
                classify_loop_iterations: #classify_loops,
            }
        }
    }
}

/// The variant's `READ_CHECKS`: each checked read's conditions, with the
/// signedness of its indices.
fn read_checks(krate: &TokenStream, program: &Program) -> Vec<TokenStream> {
    program
        .read_conditions
        .iter()
        .map(|c| {
            let (site, tensor) = (c.site, c.tensor);
            let mut signed = Vec::new();
            for f in program.reading_functions() {
                f.body.walk(&mut |e| {
                    if let kernels_spec::ir::ExprKind::Read(r) = &e.kind
                        && r.site == site
                        && signed.is_empty()
                    {
                        signed = r.indices.iter().map(|i| i.ty == Ty::I32).collect();
                    }
                });
            }
            let holds = c.holds.iter().map(|h| match h {
                Holds::Never => quote!(#krate::capture::Holds::Never),
                Holds::NonNegative(f) => {
                    let f = size_form(krate, f);
                    quote!(#krate::capture::Holds::NonNegative(#f))
                }
                Holds::BelowDim(f, axis) => {
                    let f = size_form(krate, f);
                    quote!(#krate::capture::Holds::BelowDim(#f, #axis))
                }
            });
            quote!(#krate::capture::ReadCheck {
                site: #site,
                tensor: #tensor,
                signed: &[#(#signed),*],
                holds: &[#(#holds),*],
            })
        })
        .collect()
}

/// The host struct's tensor fields, each built by `HostTensor::<how>`
/// (`capture` or `copy`) from the variant's field.
fn capture_fields(krate: &TokenStream, program: &Program, how: TokenStream) -> Vec<TokenStream> {
    program
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let field = format_ident!("{}", t.name);
            let axes = program
                .summaries
                .iter()
                .filter(|(st, _)| *st == i)
                .map(|(_, a)| *a);
            let tensor = tensor_of(&field, t.learnable);
            quote! {
                #field: #krate::capture::HostTensor::#how(
                    &<Self as #krate::Variant>::TENSORS[#i],
                    #tensor,
                    p,
                    &[#(#axes),*],
                )?
            }
        })
        .collect::<Vec<_>>()
}

/// After an error: impls whose bodies are never reached, so that one
/// mistake does not cascade into errors at every use of the variant.
fn stub_impl(krate: &TokenStream, item: &syn::ItemStruct) -> TokenStream {
    let ident = &item.ident;
    let name = ident.to_string();
    let (impl_generics, ty_generics, where_clause) = item.generics.split_for_impl();
    let host_stub = quote! {
        const NAME: &'static str = #name;
        const SCORE_IS_IDENTITY: bool = true;
        const HAS_MASK: bool = false;
        fn score(&self, s: f32, b: i32, h: i32, q: i32, kv: i32) -> f32 { unreachable!() }
        fn score_grad(&self, s: f32, b: i32, h: i32, q: i32, kv: i32) -> f32 { unreachable!() }
        fn mask(&self, b: i32, h: i32, q: i32, kv: i32) -> bool { unreachable!() }
        fn classify_tile(&self, b: i32, h: i32, q_lo: i32, q_hi: i32, kv_lo: i32, kv_hi: i32)
            -> #krate::variant::TileClass { unreachable!() }
        fn score_f64(&self, s: f64, b: i32, h: i32, q: i32, kv: i32) -> f64 { unreachable!() }
        fn score_grad_f64(&self, s: f64, b: i32, h: i32, q: i32, kv: i32) -> f64 { unreachable!() }
        fn mask_exact(&self, b: i32, h: i32, q: i32, kv: i32) -> bool { unreachable!() }
    };
    let generic = !item.generics.params.is_empty();
    let (host_ty, host_impl) = if generic {
        let host = format_ident!("__BoostrHost{}", ident);
        let vis = &item.vis;
        (
            quote!(#host),
            quote! {
                #[doc(hidden)]
                #[allow(non_camel_case_types)]
                #vis struct #host;
                #[allow(unused_variables, clippy::all)]
                impl #krate::HostVariant for #host { #host_stub }
            },
        )
    } else {
        (
            quote!(Self),
            quote! {
                #[allow(unused_variables, clippy::all)]
                impl #krate::HostVariant for #ident { #host_stub }
            },
        )
    };
    let where_clause = if generic {
        variant_where(krate, item).to_token_stream()
    } else {
        where_clause.to_token_stream()
    };
    quote! {
        #host_impl
        #[allow(unused_variables, clippy::all)]
        impl #impl_generics #krate::Variant for #ident #ty_generics #where_clause {
            const NAME: &'static str = #name;
            type Host = #host_ty;
            fn host(&self, p: &#krate::Problem) -> #krate::Result<#host_ty> {
                unreachable!()
            }
            fn compiled() -> #krate::variant::CompiledStages { unreachable!() }
        }
    }
}

/// `tests = [..]`: per instance, the reference's own gradient check and the
/// variant on every backend compiled into `boostr-runtime`. Each instance
/// becomes a function generic over the runtime that builds it from a case's
/// test data: a value is returned as written; a closure (`|data| V { t:
/// data.documents() }`, the only form for a variant with tensors) is called
/// once per case on each backend's device.
fn tests(krate: &TokenStream, item: &syn::ItemStruct, compiled: &Compiled) -> TokenStream {
    let instances = &compiled.spec.tests;
    if instances.is_empty() {
        return TokenStream::new();
    }
    let ident = &item.ident;
    let module = format_ident!("__boostr_tests_{}", ident);
    let runtime = format_ident!("__BoostrRuntime");
    let ret = if item.generics.params.is_empty() {
        quote!(#ident)
    } else {
        quote!(#ident<#runtime>)
    };
    let names: Vec<syn::Ident> = (0..instances.len())
        .map(|i| format_ident!("instance_{}", i))
        .collect();
    let builders = names.iter().zip(instances).map(|(name, instance)| {
        let body = match instance {
            syn::Expr::Closure(_) => {
                quote!(#krate::testing::build(data, #instance))
            }
            value => quote!((#value)),
        };
        quote! {
            #[allow(unused_variables, clippy::all)]
            fn #name<#runtime: #krate::AttentionRuntime>(
                data: &mut #krate::testing::TestData<'_, #runtime>,
            ) -> #ret {
                #body
            }
        }
    });
    quote! {
        #[cfg(test)]
        #[allow(non_snake_case)]
        mod #module {
            #[allow(unused_imports)]
            use super::*;

            #(#builders)*

            #[test]
            fn reference_gradients_match_finite_differences() {
                #(
                    #krate::testing::check_reference_gradients_built(
                        #names::<#krate::testing::CpuRuntime>,
                    );
                )*
            }

            #krate::__backend_tests! { #(#names,)* }
        }
    }
}
