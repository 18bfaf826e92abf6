//! The boostr attention compiler.
//!
//! A variant declaration — `#[attention(score = .., mask = ..)]` on a struct
//! whose fields are its parameters — goes through named, ordered stages, each
//! in its own module and each printable:
//!
//! 1. [`parse`]: syn → the spec [`ast`], with spans;
//! 2. [`check`]: names and types → the typed, target-neutral [`ir`], every
//!    error collected and pointing at its token, and the fields placed in
//!    the kernels' parameter block ([`params`]);
//! 3. [`analysis`]: the symbolic derivative d score / d s and the mask's tile
//!    classifier (interval arithmetic), assembled into an [`ir::Program`];
//! 4. [`emit`]: the program as Rust for the CPU, and as each GPU dialect
//!    prints its one shared lowering ([`emit::gpu`]), with the kernels
//!    those targets assemble around it, each described once
//!    ([`emit::interface`]).
//!
//! The `#[attention]` macro is a thin shell over [`compile`]; this crate is an
//! ordinary library so each stage can be tested directly.

#![warn(missing_docs)]

pub mod analysis;
pub mod ast;
pub mod check;
pub mod diag;
pub mod dropout;
pub mod emit;
pub mod eval;
pub mod ir;
pub mod params;
pub mod parse;
pub mod print;
pub mod symbol;

pub use diag::Diagnostics;
use proc_macro2::TokenStream;

/// A variant that went through every stage.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// The parsed declaration (for the macro: test instances, names).
    pub spec: ast::Spec,
    /// The analysed program every emitter reads.
    pub program: ir::Program,
}

/// Compile `#[attention(<attr>)]` on `item`. Every error of every stage that
/// could run is returned, each at its span.
pub fn compile(attr: TokenStream, item: &syn::ItemStruct) -> Result<Compiled, Diagnostics> {
    let mut diags = Diagnostics::new();
    let spec = parse::parse_spec(attr, item, &mut diags);
    let checked = check::check(&spec, &mut diags);
    let checked = diags.finish(checked)?;
    let program = analysis::analyze(&spec.name.to_string(), checked, spec.tile);
    Ok(Compiled { spec, program })
}

/// Compile a declaration given as source text (struct with its attribute);
/// for tests and tools.
pub fn compile_str(source: &str) -> Result<Compiled, Diagnostics> {
    let mut diags = Diagnostics::new();
    let mut item: syn::ItemStruct = match syn::parse_str(source) {
        Ok(item) => item,
        Err(e) => {
            diags.push(e);
            return Err(diags);
        }
    };
    let position = item
        .attrs
        .iter()
        .position(|a| a.path().is_ident("attention"));
    let Some(position) = position else {
        diags.error_spanned(&item.ident, "no #[attention(...)] attribute");
        return Err(diags);
    };
    let attr = item.attrs.remove(position);
    let tokens = match attr.meta {
        syn::Meta::List(list) => list.tokens,
        _ => TokenStream::new(),
    };
    compile(tokens, &item)
}

/// What the compiler made of a program, in a few lines: its declaration
/// (name, parameters, captured tensors), the derivative of `score` and the
/// tile classifier it derived (each on one line, cut at 96 characters), and
/// the targets it emitted ([`explain`] prints them whole).
pub fn summary(program: &ir::Program) -> String {
    let mut out = print::declaration(program);
    out.push('\n');
    let one_line = |f: &ir::Function| {
        let text = print::function(program, f);
        let body: Vec<&str> = text
            .lines()
            .skip(1)
            .map(str::trim)
            .filter(|l| !l.is_empty() && *l != "}")
            .collect();
        let joined = body.join(" ");
        const WIDTH: usize = 96;
        if joined.chars().count() > WIDTH {
            let cut: String = joined.chars().take(WIDTH - 1).collect();
            format!("{cut}…")
        } else {
            joined
        }
    };
    let derivative = if program.score_grad_given {
        format!("{} (declared)", one_line(&program.score_grad))
    } else if program.score_is_identity {
        "1 (score is the identity)".to_string()
    } else {
        one_line(&program.score_grad)
    };
    out.push_str(&format!("  d score / d s : {derivative}\n"));
    out.push_str(&format!(
        "  tile classifier: {}\n",
        one_line(&program.classify)
    ));
    let gpu: Vec<String> = emit::gpu_lowerings(program)
        .iter()
        .map(|(target, section)| format!("{target} ({} lines)", section.lines().count()))
        .collect();
    out.push_str(&format!(
        "  targets: cpu (Rust, f32 and bf16), {}\n",
        gpu.join(", ")
    ));
    out
}

/// Every stage of `program` in full: the IR after analysis, the Rust
/// functions emitted for the CPU, each GPU target's variant section, and
/// the kernel interfaces ([`summary`] is the short form).
pub fn explain(program: &ir::Program) -> String {
    let mut out = String::new();
    out.push_str("== stage: ir (after analysis) ==\n");
    out.push_str(&print::program(program));
    out.push_str("== target: cpu (Rust, f32) ==\n");
    let rust = emit::cpu::RustEmitter::new(program, emit::cpu::Float::F32);
    for f in program.functions() {
        let params = rust.params(f);
        let ret = rust.ty(f.ret);
        let body = rust.body(f);
        let name = quote::format_ident!("{}", f.name);
        out.push_str(&quote::quote!(fn #name(&self, #(#params),*) -> #ret #body).to_string());
        out.push_str("\n\n");
    }
    for (target, section) in emit::gpu_lowerings(program) {
        out.push_str(&format!("== target: {target} (variant section) ==\n"));
        out.push_str(&section);
    }
    out.push_str("== kernel interfaces ==\n");
    for kernel in emit::cuda::kernels::FORWARD_MODULE
        .interfaces()
        .chain(emit::cuda::kernels::BACKWARD_MODULE.interfaces())
        .chain(emit::cuda::kernels::TENSORS_MODULE.interfaces())
    {
        out.push_str(&format!("cuda {kernel}\n"));
    }
    for module in [
        &emit::wgsl::kernels::FORWARD,
        &emit::wgsl::kernels::BACKWARD_DQ,
        &emit::wgsl::kernels::BACKWARD_DKDV,
        &emit::wgsl::kernels::BACKWARD_TENSORS,
    ] {
        out.push_str(&format!("wgsl {module}\n"));
    }
    out.push_str(&tiles(program));
    out
}

/// The query/key and value head dims `explain` shows the tiles of: equal
/// dims, and the pairs of DeepSeek's MLA (prefill 192/128, absorbed decode
/// 576/512) and of halved values.
pub const EXPLAINED_HEAD_DIMS: [(u32, u32); 6] = [
    (64, 64),
    (128, 128),
    (192, 128),
    (576, 512),
    (128, 64),
    (64, 32),
];

/// The tiles each GPU target runs `program` with at the head dims of
/// [`EXPLAINED_HEAD_DIMS`]: its defaults with the variant's `tile(..)`
/// override where that validates, or why a pair has none.
fn tiles(program: &ir::Program) -> String {
    use emit::choose_tiles;
    use emit::cuda::{CudaDType, CudaTiles};
    use emit::wgsl::WgslTiles;
    let (q, kv) = program.tile;
    let mut out = String::from("== tiles (D/Dv: the defaults, with the variant's override) ==\n");
    for (d, dv) in EXPLAINED_HEAD_DIMS {
        match choose_tiles(WgslTiles::for_head_dims(d, dv), q, kv) {
            Ok(t) => out.push_str(&format!(
                "wgsl {d}/{dv}: {} rows per workgroup; {} keys staged (forward, dQ), {} query rows (dK/dV); {} B of workgroup memory\n",
                t.workgroup_size,
                t.block_kv,
                t.block_q,
                t.workgroup_bytes()
            )),
            Err(e) => out.push_str(&format!("wgsl {d}/{dv}: none: {e}\n")),
        }
        for dtype in [CudaDType::F32, CudaDType::Bf16] {
            let name = if dtype == CudaDType::F32 {
                "f32"
            } else {
                "f16/bf16"
            };
            match choose_tiles(CudaTiles::for_problem(d, dv, dtype), q, kv) {
                Ok(t) => out.push_str(&format!(
                    "cuda {name} {d}/{dv}: forward {}×{} over {} warps ({} B shared); backward {}×{} over {} warps ({} B shared)\n",
                    t.block_q,
                    t.block_kv,
                    t.warps,
                    t.forward_smem_bytes(),
                    t.bwd_block_q,
                    t.bwd_block_kv,
                    t.bwd_warps,
                    t.dq_smem_bytes()
                )),
                Err(e) => out.push_str(&format!("cuda {name} {d}/{dv}: none: {e}\n")),
            }
        }
    }
    out
}
