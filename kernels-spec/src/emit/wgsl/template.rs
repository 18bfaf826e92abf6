//! WGSL kernel templates: text, and loops over the head dim that the
//! emitter writes either as loops or unrolled.
//!
//! Unrolled, each copy of a loop body is its own block that binds the
//! counter as a constant, `{ const d = 3u; <body> }`, so private arrays
//! indexed by `d` have constant indices (compilers keep them in registers
//! or address them directly instead of gathering per invocation), and the
//! loops no longer count against llvmpipe's iteration limit. The body is
//! the same text either way: nothing in it is rewritten.

/// A piece of a template.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Piece {
    /// WGSL text, written as it is.
    Text(&'static str),
    /// The body of `for (var d = 0u; d < D; d++) { .. }`; it reads the
    /// counter as `d` and does not assign it.
    HeadDimLoop(&'static str),
}

/// How head-dim loops are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loops {
    /// As loops.
    Rolled,
    /// Unrolled for this head dim.
    Unrolled(u32),
}

/// Write `pieces` to `out`.
pub fn render(out: &mut String, pieces: &[Piece], loops: Loops) {
    for piece in pieces {
        match (*piece, loops) {
            (Piece::Text(text), _) => out.push_str(text),
            (Piece::HeadDimLoop(body), Loops::Rolled) => {
                out.push_str("for (var d = 0u; d < D; d++) {");
                out.push_str(body);
                out.push('}');
            }
            (Piece::HeadDimLoop(body), Loops::Unrolled(head_dim)) => {
                out.push('{');
                for d in 0..head_dim {
                    out.push_str(&format!(" {{ const d = {d}u; "));
                    out.push_str(body.trim());
                    out.push_str(" }");
                }
                out.push_str(" }");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOOP: &[Piece] = &[
        Piece::Text("    "),
        Piece::HeadDimLoop(" acc[d] *= alpha; "),
        Piece::Text("\n"),
    ];

    #[test]
    fn rolled_loops_are_the_template_text() {
        let mut out = String::new();
        render(&mut out, LOOP, Loops::Rolled);
        assert_eq!(
            out,
            "    for (var d = 0u; d < D; d++) { acc[d] *= alpha; }\n"
        );
    }

    #[test]
    fn unrolled_loops_bind_the_counter_in_each_copy() {
        let mut out = String::new();
        render(&mut out, LOOP, Loops::Unrolled(3));
        assert_eq!(
            out,
            "    { { const d = 0u; acc[d] *= alpha; } { const d = 1u; acc[d] *= alpha; } \
             { const d = 2u; acc[d] *= alpha; } }\n"
        );
    }
}
