//! WGSL kernel templates: text, and loops over the head dims that the
//! emitter writes either as loops or unrolled.
//!
//! A template (a section of a `.wgsl` file, see [`crate::emit::source`])
//! is WGSL text in which three forms stand for loops over the head dims:
//!
//! - `@loop(D) { body }`: `for (var d = 0u; d < D; d++) { body }` (the
//!   query/key head dim);
//! - `@loop(DV) { body }`: the same over the value head dim;
//! - `@loop(D, DV) { head } { value }`: one pass over both head dims, the
//!   first body for `d < D`, the second for `d < DV`, in one loop where
//!   the dims overlap (so a product over each costs one loop's iterations,
//!   not two).
//!
//! A body reads the counter as `d` and does not assign it; its braces are
//! balanced. Unrolled, each copy of a loop body is its own block that binds
//! the counter as a constant, `{ const d = 3u; <body> }`, so private arrays
//! indexed by `d` have constant indices (compilers keep them in registers
//! or address them directly instead of gathering per invocation), and the
//! loops no longer count against llvmpipe's iteration limit. The body is
//! the same text either way: nothing in it is rewritten.

/// A piece of a template.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Piece<'a> {
    /// WGSL text, written as it is.
    Text(&'a str),
    /// The body of a loop over the query/key head dim (`@loop(D)`).
    HeadDimLoop(&'a str),
    /// The body of a loop over the value head dim (`@loop(DV)`).
    ValueDimLoop(&'a str),
    /// The bodies of one pass over both head dims (`@loop(D, DV)`).
    BothDimsLoop(&'a str, &'a str),
}

/// The opening of each loop form, and how many bodies it takes.
const FORMS: [(&str, usize); 3] = [("@loop(D) ", 1), ("@loop(DV) ", 1), ("@loop(D, DV) ", 2)];

/// The pieces of `template`.
///
/// # Panics
/// If a loop form is not followed by its braced bodies (a template bug,
/// which every test that renders the module finds).
pub fn pieces(template: &str) -> Vec<Piece<'_>> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(at) = rest.find("@loop(") {
        out.push(Piece::Text(&rest[..at]));
        let (form, bodies) = FORMS
            .iter()
            .copied()
            .find(|(form, _)| rest[at..].starts_with(form))
            .unwrap_or_else(|| panic!("an unknown loop form at `{}`", &rest[at..at + 12]));
        let mut after = &rest[at + form.len()..];
        let mut found = Vec::with_capacity(bodies);
        for i in 0..bodies {
            if i > 0 {
                after = after
                    .strip_prefix(' ')
                    .expect("` ` between a loop's bodies");
            }
            let (body, tail) = braced(after);
            found.push(body);
            after = tail;
        }
        out.push(match (form, &found[..]) {
            ("@loop(D) ", [b]) => Piece::HeadDimLoop(b),
            ("@loop(DV) ", [b]) => Piece::ValueDimLoop(b),
            (_, [h, v]) => Piece::BothDimsLoop(h, v),
            _ => unreachable!("every form has its bodies"),
        });
        rest = after;
    }
    out.push(Piece::Text(rest));
    out
}

/// The text inside the braces that `text` opens with, and what follows.
fn braced(text: &str) -> (&str, &str) {
    assert!(text.starts_with('{'), "a loop body in braces");
    let mut depth = 0;
    for (i, c) in text.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return (&text[1..i], &text[i + 1..]);
                }
            }
            _ => {}
        }
    }
    panic!("an unclosed loop body");
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

/// Write `template` to `out`, its loops as `loops` says.
pub fn render(out: &mut String, template: &str, loops: Loops) {
    let (d, dv) = (loops.head_dim, loops.value_dim);
    for piece in pieces(template) {
        match piece {
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

    const LOOP: &str = "    @loop(D) { acc[d] *= alpha; }\n";

    const BOTH: &str = "@loop(D, DV) { a += q[d]; } { b += v[d]; }";

    fn rendered(template: &str, head_dim: u32, value_dim: u32, unrolled: bool) -> String {
        let mut out = String::new();
        let loops = Loops {
            head_dim,
            value_dim,
            unrolled,
        };
        render(&mut out, template, loops);
        out
    }

    #[test]
    fn a_template_splits_into_text_and_loops() {
        let nested = "x @loop(DV) { if a { b(); } } y";
        assert_eq!(
            pieces(nested),
            [
                Piece::Text("x "),
                Piece::ValueDimLoop(" if a { b(); } "),
                Piece::Text(" y")
            ]
        );
        assert_eq!(
            pieces(BOTH),
            [
                Piece::Text(""),
                Piece::BothDimsLoop(" a += q[d]; ", " b += v[d]; "),
                Piece::Text("")
            ]
        );
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
