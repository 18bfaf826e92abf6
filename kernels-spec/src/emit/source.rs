//! Kernel source files: the GPU targets' kernel text lives in `.cu` and
//! `.wgsl` files beside their emitters (highlighted, with line numbers that
//! a compiler's message maps back to), loaded with `include_str!` and cut
//! into named sections at compile time.
//!
//! A section starts after a marker line `//@@ <name>` (a comment in both
//! languages) and runs to the next marker line or the end of the file;
//! text before the first marker is the file's own commentary and belongs
//! to no section. [`section`] is a `const fn`, so a name without its
//! marker is a compile error, not a missing kernel at run time.

/// The line that opens a section, before its name.
const MARKER: &[u8] = b"//@@ ";

/// Section `name` of the kernel source `file`: the text after the line
/// `//@@ name` up to the next `//@@` line or the end of the file.
///
/// # Panics
/// (At compile time, where called in a constant.) If `file` has no such
/// section.
pub const fn section(file: &'static str, name: &str) -> &'static str {
    let bytes = file.as_bytes();
    let Some(start) = find_section(bytes, name.as_bytes()) else {
        panic!("a kernel source file has no section of that name");
    };
    let end = match next_marker(bytes, start) {
        Some(at) => at,
        None => bytes.len(),
    };
    let (head, _) = bytes.split_at(end);
    let (_, body) = head.split_at(start);
    match core::str::from_utf8(body) {
        Ok(text) => text,
        Err(_) => panic!("sections are cut at line starts"),
    }
}

/// The byte after the marker line of section `name`.
const fn find_section(bytes: &[u8], name: &[u8]) -> Option<usize> {
    let mut at = 0;
    while let Some(line) = next_marker(bytes, at) {
        let name_at = line + MARKER.len();
        let end = name_at + name.len();
        if end < bytes.len() && bytes[end] == b'\n' && equal(bytes, name_at, name) {
            return Some(end + 1);
        }
        at = line + 1;
    }
    None
}

/// The start of the first marker line at or after byte `from`.
const fn next_marker(bytes: &[u8], from: usize) -> Option<usize> {
    let mut at = from;
    while at + MARKER.len() <= bytes.len() {
        if (at == 0 || bytes[at - 1] == b'\n') && equal(bytes, at, MARKER) {
            return Some(at);
        }
        at += 1;
    }
    None
}

/// Whether `bytes[at..]` starts with `prefix`.
const fn equal(bytes: &[u8], at: usize, prefix: &[u8]) -> bool {
    if at + prefix.len() > bytes.len() {
        return false;
    }
    let mut i = 0;
    while i < prefix.len() {
        if bytes[at + i] != prefix[i] {
            return false;
        }
        i += 1;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str =
        "// commentary\n//@@ first\nline one\n//@@ second\n\nline two\n//@@ first_too\nx\n";

    #[test]
    fn a_section_runs_from_its_marker_to_the_next() {
        assert_eq!(section(FILE, "first"), "line one\n");
        assert_eq!(section(FILE, "second"), "\nline two\n");
        assert_eq!(section(FILE, "first_too"), "x\n");
    }

    #[test]
    #[should_panic(expected = "no section of that name")]
    fn a_missing_section_is_an_error() {
        section(FILE, "fir");
    }
}
