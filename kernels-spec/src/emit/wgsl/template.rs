//! WGSL kernel templates: text, and loops over the head dims that the
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
    /// The body of `for (var d = 0u; d < D; d++) { .. }` (the query/key
    /// head dim); it reads the counter as `d` and does not assign it.
    HeadDimLoop(&'static str),
    /// The body of `for (var d = 0u; d < DV; d++) { .. }` (the value head
    /// dim).
    ValueDimLoop(&'static str),
    /// One pass over both head dims: the first body for `d < D`, the
    /// second for `d < DV`, in one loop where the dims overlap (so a
    /// product over each costs one loop's iterations, not two).
    BothDimsLoop(&'static str, &'static str),
}

/// How head-dim loops are written, for head dims `D` and `DV`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Loops {
    /// The query/key head dim `D`.
    pub head_dim: u32,
    /// The value head dim `DV`.
    pub value_dim: u32,
    /// Unrolled (else written as loops).
    pub unrolled: bool,
}

impl Loops {
    /// `bodies` for `d` in `from..to`, each body with the condition it
    /// runs under already known to hold over the range.
    fn write(&self, out: &mut String, from: u32, to: u32, bodies: &[&str]) {
        if from >= to {
            return;
        }
        if self.unrolled {
            out.push('{');
            for d in from..to {
                out.push_str(&format!(" {{ const d = {d}u;"));
                for body in bodies {
                    out.push(' ');
                    out.push_str(body.trim());
                }
                out.push_str(" }");
            }
            out.push_str(" }");
        } else {
            let bound = |n: u32| match n {
                n if n == self.head_dim => "D".to_string(),
                n if n == self.value_dim => "DV".to_string(),
                n => format!("{n}u"),
            };
            let start = if from == 0 {
                "0u".to_string()
            } else {
                bound(from)
            };
            out.push_str(&format!("for (var d = {start}; d < {}; d++) {{", bound(to)));
            for body in bodies {
                out.push_str(body);
            }
            out.push('}');
        }
    }
}

/// Write `pieces` to `out`.
pub fn render(out: &mut String, pieces: &[Piece], loops: Loops) {
    let (d, dv) = (loops.head_dim, loops.value_dim);
    for piece in pieces {
        match *piece {
            Piece::Text(text) => out.push_str(text),
            Piece::HeadDimLoop(body) => loops.write(out, 0, d, &[body]),
            Piece::ValueDimLoop(body) => loops.write(out, 0, dv, &[body]),
            Piece::BothDimsLoop(head, value) => {
                loops.write(out, 0, d.min(dv), &[head, value]);
                loops.write(out, dv, d, &[head]);
                loops.write(out, d, dv, &[value]);
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

    const BOTH: &[Piece] = &[Piece::BothDimsLoop(" a += q[d]; ", " b += v[d]; ")];

    fn rendered(pieces: &[Piece], head_dim: u32, value_dim: u32, unrolled: bool) -> String {
        let mut out = String::new();
        let loops = Loops {
            head_dim,
            value_dim,
            unrolled,
        };
        render(&mut out, pieces, loops);
        out
    }

    #[test]
    fn rolled_loops_are_the_template_text() {
        assert_eq!(
            rendered(LOOP, 3, 3, false),
            "    for (var d = 0u; d < D; d++) { acc[d] *= alpha; }\n"
        );
    }

    #[test]
    fn unrolled_loops_bind_the_counter_in_each_copy() {
        assert_eq!(
            rendered(LOOP, 3, 2, true),
            "    { { const d = 0u; acc[d] *= alpha; } { const d = 1u; acc[d] *= alpha; } \
             { const d = 2u; acc[d] *= alpha; } }\n"
        );
    }

    #[test]
    fn both_dims_share_a_loop_where_they_overlap() {
        assert_eq!(
            rendered(BOTH, 4, 4, false),
            "for (var d = 0u; d < D; d++) { a += q[d];  b += v[d]; }"
        );
        assert_eq!(
            rendered(BOTH, 4, 2, false),
            "for (var d = 0u; d < DV; d++) { a += q[d];  b += v[d]; }\
             for (var d = DV; d < D; d++) { a += q[d]; }"
        );
        assert_eq!(
            rendered(BOTH, 1, 3, true),
            "{ { const d = 0u; a += q[d]; b += v[d]; } }\
             { { const d = 1u; b += v[d]; } { const d = 2u; b += v[d]; } }"
        );
    }
}
